// Decode's product with a float weight (the F32 router, an F16/BF16 projection): y [T, O] =
// x [T, H] @ W^T for T = 1..8 rows in one launch. A block of kWarps warps computes one output
// for all T rows of x: thread j of the block takes the 4-value runs j, j + 32 kWarps, ... of
// the row in order (one FMA chain per row of x), each warp sums its lanes by a butterfly and
// the block adds its warps' sums in warp order. So each row of x gets the same bits whatever T
// is: a speculative verify step or a batch of sequences routes as decode does, which a library
// GEMM (kernel chosen by shape) does not promise.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda/api.h"
#include "cuda/common.cuh"

namespace ft::cuda {
namespace {

constexpr int kWarps = 4;

__device__ __forceinline__ float4 load4(const float* p) { return __ldg(reinterpret_cast<const float4*>(p)); }
__device__ __forceinline__ float4 load4(const __half* p) {
    const uint2 u = __ldg(reinterpret_cast<const uint2*>(p));
    const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&u.x));
    const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&u.y));
    return {a.x, a.y, b.x, b.y};
}
__device__ __forceinline__ float4 load4(const __nv_bfloat16* p) {
    const uint2 u = __ldg(reinterpret_cast<const uint2*>(p));
    const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.x));
    const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.y));
    return {a.x, a.y, b.x, b.y};
}

template <class W, int NT>
__global__ void __launch_bounds__(32 * kWarps)
float_rows_kernel(const W* w, int64_t ldw, int H, const float* x, int64_t ldx, int T, float* y,
                  int64_t ldy) {
    __shared__ float part[kWarps][NT];
    const int o = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const W* row = w + int64_t(o) * ldw;
    float acc[NT];
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[t] = 0.f;
    for (int i = threadIdx.x * 4; i < H; i += 128 * kWarps) {
        const float4 a = load4(row + i);
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            if (t < T) {
                const float4 b = __ldg(reinterpret_cast<const float4*>(x + t * ldx + i));
                acc[t] = __fmaf_rn(a.x, b.x, acc[t]);
                acc[t] = __fmaf_rn(a.y, b.y, acc[t]);
                acc[t] = __fmaf_rn(a.z, b.z, acc[t]);
                acc[t] = __fmaf_rn(a.w, b.w, acc[t]);
            }
        }
    }
#pragma unroll
    for (int t = 0; t < NT; ++t) {
#pragma unroll
        for (int s = 16; s > 0; s >>= 1) acc[t] += __shfl_xor_sync(0xffffffffu, acc[t], s);
    }
    if (lane == 0) {
#pragma unroll
        for (int t = 0; t < NT; ++t) part[warp][t] = acc[t];
    }
    __syncthreads();
    if (threadIdx.x < NT && threadIdx.x < T) {
        float sum = part[0][threadIdx.x];
#pragma unroll
        for (int k = 1; k < kWarps; ++k) sum += part[k][threadIdx.x];
        y[threadIdx.x * ldy + o] = sum;
    }
}

template <class W>
void launch(const void* w, int64_t ldw, int64_t O, int64_t H, const float* x, int64_t T, float* y,
            cudaStream_t st) {
    auto go = [&](auto nt) {
        float_rows_kernel<W, decltype(nt)::value><<<unsigned(O), 32 * kWarps, 0, st>>>(
            static_cast<const W*>(w), ldw, int(H), x, H, int(T), y, O);
    };
    if (T == 1) go(std::integral_constant<int, 1>{});
    else if (T == 2) go(std::integral_constant<int, 2>{});
    else if (T <= 4) go(std::integral_constant<int, 4>{});
    else go(std::integral_constant<int, 8>{});
    FT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void float_matmul(int type_id, const void* w, int64_t n_out, int64_t n_in, int64_t w_row_stride,
                  const float* x, int64_t n_tok, float* y, uintptr_t stream) {
    require(n_tok >= 0 && n_tok <= 8, "float_matmul: 1..8 rows of x a call");
    require(n_in % 4 == 0 && n_in < (int64_t(1) << 30) && n_out < (int64_t(1) << 31) - 1,
            "float_matmul: rows of a multiple of 4 values");
    require(reinterpret_cast<uintptr_t>(x) % 16 == 0, "float_matmul: x must be 16-byte aligned");
    if (n_tok == 0 || n_out == 0) return;
    const int elem = type_id == 0 ? 4 : 2;
    require(w_row_stride % (4 * elem) == 0 && reinterpret_cast<uintptr_t>(w) % (4 * elem) == 0,
            "float_matmul: weight rows must be aligned to 4 values");
    const int64_t ldw = w_row_stride / elem;
    const cudaStream_t st = to_stream(stream);
    switch (type_id) {
        case 0: launch<float>(w, ldw, n_out, n_in, x, n_tok, y, st); break;
        case 1: launch<__half>(w, ldw, n_out, n_in, x, n_tok, y, st); break;
        case 30: launch<__nv_bfloat16>(w, ldw, n_out, n_in, x, n_tok, y, st); break;
        default: require(false, "float_matmul: F32 (0), F16 (1) or BF16 (30) weights");
    }
}

}  // namespace ft::cuda
