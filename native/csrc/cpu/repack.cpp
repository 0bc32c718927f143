// Repacking: a file type's blocks rewritten into a CPU form of the same weights (quants.h,
// FT_CPU_REPACKED_TYPES) whose kernels need no table lookups. Exact: the repacked block decodes
// to the same floats, and every q8 kernel forms the same integer group sums and float steps, so
// a product against a repacked weight has the original's bits.
#include <cstring>
#include <stdexcept>
#include <string>

#include "cpu.h"

namespace ft::cpu {
namespace {

// byte j of kByteMask[b] = 0xFF where bit j of b is set
struct ByteMasks {
    uint64_t m[256];
    constexpr ByteMasks() : m() {
        for (int b = 0; b < 256; ++b)
            for (int j = 0; j < 8; ++j)
                if (b >> j & 1) m[b] |= uint64_t(0xFF) << (8 * j);
    }
};
constexpr ByteMasks kByteMask;

// IQ3_S -> IQ3_S_N4: each weight w = +-(grid byte), an odd number in -15..15, becomes (w + 15) / 2.
// Eight weights at a time in a 64-bit word (weight i's sign is bit i % 8 of signs[i / 8]; every
// byte stays in 0..30, so no carry crosses a byte).
void iq3s_to_n4(const uint8_t* src, uint8_t* dst, const uint32_t* grid) {
    constexpr uint64_t k15 = 0x0F0F0F0F0F0F0F0FULL, k7F = 0x7F7F7F7F7F7F7F7FULL;
    const BlockIQ3_S& a = *reinterpret_cast<const BlockIQ3_S*>(src);
    BlockIQ3_S_N4& b = *reinterpret_cast<BlockIQ3_S_N4*>(dst);
    uint64_t code[32];  // word w: the codes of weights 8w..8w+7
    for (int w = 0; w < 32; ++w) {
        const int g = 2 * w;  // grid entries g, g + 1: weights 4g..4g+7; 9th index bits in qh
        const uint64_t lo = grid[a.qs[g] | (((a.qh[g / 8] >> (g % 8)) & 1) << 8)];
        const uint64_t hi = grid[a.qs[g + 1] | (((a.qh[g / 8] >> (g % 8 + 1)) & 1) << 8)];
        const uint64_t mag = lo | hi << 32, neg = kByteMask.m[a.signs[w]];
        code[w] = ((((k15 - mag) & neg) | ((k15 + mag) & ~neg)) >> 1) & k7F;
    }
    b.d = a.d;
    std::memcpy(b.scales, a.scales, 4);
    for (int k = 0; k < 4; ++k)  // chunk k: group 2k in the low nibbles, 2k + 1 in the high ones
        for (int j = 0; j < 4; ++j) {
            const uint64_t v = code[8 * k + j] | code[8 * k + 4 + j] << 4;
            std::memcpy(b.qs + 32 * k + 8 * j, &v, 8);
        }
}

}  // namespace

int repacked_type(int src_id) { return src_id == int(QType::IQ3_S) ? int(QType::IQ3_S_N4) : -1; }

void repack(int src_id, const uint8_t* src, int64_t nblocks, uint8_t* dst, int64_t items,
            int64_t src_stride, int64_t dst_stride) {
    if (repacked_type(src_id) < 0)
        throw std::invalid_argument("repack: no CPU form for ggml type id " + std::to_string(src_id));
    if (!tables_ready()) throw std::runtime_error("repack: the IQ tables are not loaded (set_tables)");
    if (nblocks < 0 || items < 0) throw std::invalid_argument("repack: negative block or item count");
    const uint32_t* grid = grids().iq3s;
    for (int i = 0; i < 512; ++i)  // the form holds odd weights up to 15 in 4 bits
        for (int j = 0; j < 4; ++j) {
            const uint32_t m = (grid[i] >> (8 * j)) & 0xFF;
            if (m % 2 == 0 || m > 15)
                throw std::runtime_error("repack: an IQ3_S grid byte is not an odd number up to 15");
        }
    constexpr int in = Traits<QType::IQ3_S>::block_bytes, out = Traits<QType::IQ3_S_N4>::block_bytes;
    parallel_for(items * nblocks, 512, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i) {
            const int64_t item = i / nblocks, b = i % nblocks;
            iq3s_to_n4(src + item * src_stride + b * in, dst + item * dst_stride + b * out, grid);
        }
    });
}

}  // namespace ft::cpu
