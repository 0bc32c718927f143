// dequantize: rows of raw blocks -> F32 / F16 / BF16 rows, all cores.
#include "cpu.h"

namespace ft::cpu {
namespace {

// float -> IEEE half, round to nearest even (the classic bit trick: let the FPU round the
// subnormal range, round normal mantissas with a carry-in of 0xFFF + odd bit).
uint16_t f32_to_f16(float f) {
    constexpr uint32_t kInf = 255u << 23, kHalfMax = (127u + 16u) << 23;
    constexpr uint32_t kDenormMagic = ((127u - 15u) + (23u - 10u) + 1u) << 23;
    uint32_t u = f32_to_bits(f);
    const uint32_t sign = u & 0x80000000u;
    u ^= sign;
    uint32_t o;
    if (u >= kHalfMax) {
        o = u > kInf ? 0x7E00u : 0x7C00u;  // NaN -> quiet NaN, too large -> inf
    } else if (u < (113u << 23)) {         // result is subnormal or zero
        o = f32_to_bits(bits_to_f32(u) + bits_to_f32(kDenormMagic)) - kDenormMagic;
    } else {
        const uint32_t odd = (u >> 13) & 1u;
        u += (uint32_t(15 - 127) << 23) + 0xFFFu + odd;
        o = u >> 13;
    }
    return uint16_t(o | (sign >> 16));
}

uint16_t f32_to_bf16(float f) {  // round to nearest even, NaN kept quiet
    const uint32_t u = f32_to_bits(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return uint16_t((u >> 16) | 0x40u);
    return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

}  // namespace

void dequantize(int type_id, const uint8_t* src, int64_t n_rows, int64_t n_cols,
                int64_t src_row_stride, void* dst, int dst_dtype) {
    const TypeKernels& k = type_kernels(kernels(), type_id);
    const int64_t nkb = row_kblocks(k, n_cols, "dequantize");
    if (src_row_stride < nkb * k.kb_bytes)
        throw std::invalid_argument("dequantize: row stride is shorter than a row");
    if (dst_dtype != 0 && dst_dtype != 1 && dst_dtype != 30)
        throw std::invalid_argument("dequantize: output dtype must be F32 (0), F16 (1) or BF16 (30)");
    const Grids& g = grids();
    const int64_t grain = std::max<int64_t>(1, 32768 / n_cols);
    parallel_for(n_rows, grain, [&](int64_t r0, int64_t r1) {
        thread_local std::vector<float> buf;
        if (dst_dtype != 0 && int64_t(buf.size()) < n_cols) buf.resize(n_cols);
        for (int64_t r = r0; r < r1; ++r) {
            const uint8_t* row = src + r * src_row_stride;
            if (dst_dtype == 0) {
                k.decode_row(row, nkb, static_cast<float*>(dst) + r * n_cols, g);
                continue;
            }
            k.decode_row(row, nkb, buf.data(), g);
            uint16_t* o = static_cast<uint16_t*>(dst) + r * n_cols;
            if (dst_dtype == 1) for (int64_t j = 0; j < n_cols; ++j) o[j] = f32_to_f16(buf[j]);
            else for (int64_t j = 0; j < n_cols; ++j) o[j] = f32_to_bf16(buf[j]);
        }
    });
}

}  // namespace ft::cpu
