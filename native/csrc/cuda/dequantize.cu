// dequantize: raw blocks -> f32 / f16 / bf16, for prefill (a GEMM on the dequantized weights) and
// for tests. One thread decodes one 32-weight unit with decode32<T> (bit-exact floats) and
// writes its 32 outputs as 16-byte stores; a grid-stride loop covers rows x units.
// rows_to_f16: the prefill GEMM's other operand, float32 activations -> f16 with a power-of-two
// scale per row, so that no value overflows f16's range (scaling by 2^-k is exact).
//
// Stream behaviour: one kernel on `stream`, no sync, no allocation; capturable.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda/common.cuh"

namespace ft::cuda {
namespace {

constexpr int kDequantThreads = 256;

// 32 floats -> 32 outputs at `o` (16-byte aligned when `vec`).
__device__ __forceinline__ void store32(float* o, const float (&w)[32], bool vec) {
    if (vec) {
#pragma unroll
        for (int i = 0; i < 8; ++i)
            reinterpret_cast<float4*>(o)[i] = make_float4(w[4 * i], w[4 * i + 1], w[4 * i + 2], w[4 * i + 3]);
    } else {
#pragma unroll
        for (int i = 0; i < 32; ++i) o[i] = w[i];
    }
}
template <class H, class Cvt>
__device__ __forceinline__ void store32_16(H* o, const float (&w)[32], bool vec, Cvt cvt) {
    if (vec) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            uint32_t p[4];
#pragma unroll
            for (int k = 0; k < 4; ++k)
                p[k] = uint32_t(cvt(w[8 * i + 2 * k])) | (uint32_t(cvt(w[8 * i + 2 * k + 1])) << 16);
            reinterpret_cast<uint4*>(o)[i] = make_uint4(p[0], p[1], p[2], p[3]);
        }
    } else {
#pragma unroll
        for (int i = 0; i < 32; ++i) reinterpret_cast<uint16_t*>(o)[i] = cvt(w[i]);
    }
}
__device__ __forceinline__ void store32(__half* o, const float (&w)[32], bool vec) {
    store32_16(o, w, vec, [](float v) { return __half_as_ushort(__float2half_rn(v)); });
}
__device__ __forceinline__ void store32(__nv_bfloat16* o, const float (&w)[32], bool vec) {
    store32_16(o, w, vec, [](float v) { return __bfloat16_as_ushort(__float2bfloat16_rn(v)); });
}

template <QType T, class Out>
__global__ void __launch_bounds__(kDequantThreads)
dequant_kernel(const uint8_t* __restrict__ src, int64_t n_rows, int64_t nkb, int64_t stride,
               Out* __restrict__ dst, bool vec, const Grids grids) {
    constexpr int kbB = Traits<T>::kb_bytes, subs = Traits<T>::subs;
    const int64_t upr = nkb * subs, total = n_rows * upr;
    for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
         i += int64_t(gridDim.x) * blockDim.x) {
        const int64_t r = i / upr, u = i - r * upr;
        float w[32];
        decode32<T>(src + r * stride + (u / subs) * kbB, int(u % subs), grids, w);
        store32(dst + i * 32, w, vec);
    }
}

template <QType T, class Out>
void launch_dequant(const uint8_t* src, int64_t n_rows, int64_t nkb, int64_t stride, Out* dst,
                    cudaStream_t stream) {
    const int64_t units = n_rows * nkb * Traits<T>::subs;
    if (units <= 0) return;
    const int64_t cap = int64_t(device_info().sms) * 8;
    const int64_t blocks = cdiv(units, kDequantThreads) < cap ? cdiv(units, kDequantThreads) : cap;
    const bool vec = reinterpret_cast<uintptr_t>(dst) % 16 == 0;
    auto kernel = dequant_kernel<T, Out>;
    FT_LAUNCH(kernel, dim3(unsigned(blocks)), kDequantThreads, 0, stream, src, n_rows, nkb, stride,
              dst, vec, device_grids(UsesGrids<T>::value));
    check_launch("dequant_kernel");
}

// One block per row: the row's largest magnitude, then every value times 2^-k (k >= 0, the least
// that brings it under 2^15) rounded to f16; row_scale[r] = 2^k undoes it on the GEMM's output.
constexpr int kRowThreads = 256;
__global__ void __launch_bounds__(kRowThreads)
rows_to_f16_kernel(const float* __restrict__ x, int64_t ldx, int64_t n_cols, __half* __restrict__ out,
                   float* __restrict__ row_scale) {
    const float* xr = x + int64_t(blockIdx.x) * ldx;
    __half* orow = out + int64_t(blockIdx.x) * n_cols;
    float amax = 0.f;
    for (int64_t i = threadIdx.x; i < n_cols; i += kRowThreads) amax = fmaxf(amax, fabsf(xr[i]));
    __shared__ float part[kRowThreads / 32];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = amax;
    __syncthreads();
    amax = part[0];
#pragma unroll
    for (int w = 1; w < kRowThreads / 32; ++w) amax = fmaxf(amax, part[w]);
    // 2^15 <= amax < 2^16 -> k = 1; NaN compares false and keeps k = 0 (the NaN propagates)
    const int k = amax >= 32768.f ? min(ilogbf(amax) - 14, 126) : 0;
    const float s = ldexpf(1.f, -k);
    for (int64_t i = threadIdx.x; i < n_cols; i += kRowThreads) orow[i] = __float2half_rn(xr[i] * s);
    if (threadIdx.x == 0) row_scale[blockIdx.x] = ldexpf(1.f, k);
}

}  // namespace

void rows_to_f16(const float* x, int64_t n_rows, int64_t n_cols, int64_t ldx, void* out,
                 float* row_scale, uintptr_t stream) {
    require(n_rows >= 0 && n_cols >= 0 && ldx >= n_cols, "rows_to_f16: bad shape or row stride");
    require(n_rows < (int64_t(1) << 31), "rows_to_f16: too many rows");
    if (n_rows == 0) return;
    FT_LAUNCH(rows_to_f16_kernel, dim3(unsigned(n_rows)), kRowThreads, 0, to_stream(stream), x, ldx,
              n_cols, static_cast<__half*>(out), row_scale);
    check_launch("rows_to_f16_kernel");
}

void dequantize(int type_id, const void* src, int64_t n_rows, int64_t n_cols,
                int64_t src_row_stride, void* dst, int dst_dtype, uintptr_t stream) {
    require(dst_dtype == 0 || dst_dtype == 1 || dst_dtype == 30,
            "dequantize: dst_dtype must be 0 (F32), 1 (F16) or 30 (BF16), got " + std::to_string(dst_dtype));
    const bool known = visit_type(type_id, [&](auto tag) {
        constexpr QType T = decltype(tag)::type;
        using Tr = Traits<T>;
        require(n_cols % Tr::kb_elems == 0,
                std::string("dequantize: ") + Tr::name + " rows of " + std::to_string(n_cols) +
                    " weights are not whole blocks of " + std::to_string(Tr::kb_elems));
        const int64_t nkb = n_cols / Tr::kb_elems;
        require(n_rows <= 1 || src_row_stride >= nkb * Tr::kb_bytes,
                "dequantize: source row stride is shorter than a row");
        constexpr int align = Tr::kb_bytes % 2 ? 1 : 2;  // 16-bit fields only in even blocks
        require(reinterpret_cast<uintptr_t>(src) % align == 0 && src_row_stride % align == 0,
                "dequantize: block rows must be 2-byte aligned");
        const uint8_t* s = static_cast<const uint8_t*>(src);
        const cudaStream_t st = to_stream(stream);
        if (dst_dtype == 0) launch_dequant<T>(s, n_rows, nkb, src_row_stride, static_cast<float*>(dst), st);
        else if (dst_dtype == 1) launch_dequant<T>(s, n_rows, nkb, src_row_stride, static_cast<__half*>(dst), st);
        else launch_dequant<T>(s, n_rows, nkb, src_row_stride, static_cast<__nv_bfloat16*>(dst), st);
    });
    require(known, "dequantize: unknown ggml type id " + std::to_string(type_id));
}

}  // namespace ft::cuda
