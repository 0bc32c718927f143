// AVX2 decoders: 32 weights of a kernel block as int8 values + scales, w = s * q + m.
// Included only by kernels_avx2.cpp (compiled with -mavx2 -mfma -mf16c -mbmi2).
//
// Unit<T>::decode(blk, sub, grids, state, u) fills u.q (32 int8, weight order), u.s[h] (the scale
// of weights 16h..16h+15; equal unless Unit<T>::per16) and, where Unit<T>::has_min, u.m[h] (added
// to them); Unit<T>::begin(blk, grids, state) runs once per block first (grid indices, scales).
// Every quant type fits this form exactly (IQ1_S/IQ1_M: q = 8*grid +- 1, s = dl/8), so both the
// dot kernels (integer products) and a bit-exact dequantize (float(q) * s + m, rounded like the
// reference: the same single product, the same add) are built on it. Layouts: quants.h.
#pragma once
#include <immintrin.h>

#include "cpu.h"

namespace ft::cpu::avx2 {

struct Sub {
    __m256i q;
    float s[2];
    float m[2];
};

inline float h2f(uint16_t h) { return _cvtsh_ss(h); }  // F16C: exact

// byte j = 0xFF where bit j of `bits` is set, else 0
inline __m256i bits_to_bytes(uint32_t bits) {
    const __m256i shuf = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                          2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
    const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32(int(bits)), shuf);
    return _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
}
// q negated where bit j of `bits` is set
inline __m256i apply_signs(__m256i q, uint32_t bits) {
    return _mm256_sign_epi8(q, _mm256_or_si256(bits_to_bytes(bits), _mm256_set1_epi8(1)));
}
// 16 bytes -> weights 0..15 = low nibbles, 16..31 = high nibbles (legacy / IQ4 layout)
inline __m256i nibbles16(const uint8_t* p) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i m = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m), _mm_and_si128(v, m));
}
// 32 bytes, field of `mask` bits at bit `shift` of each byte
inline __m256i field32(const uint8_t* p, int shift, int mask) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(shift)), _mm256_set1_epi8(char(mask)));
}
inline __m256i lookup16(__m256i idx, const int8_t* table) {  // idx in 0..15
    const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(table));
    return _mm256_shuffle_epi8(_mm256_set_m128i(t, t), idx);
}
inline void scale(Sub& u, float s) { u.s[0] = u.s[1] = s; }

// Per-block prologue: Unit<T>::begin(blk, grids, state) runs once per kernel block before its
// subs' decode(); units that need none inherit this empty one.
struct UnitBase {
    struct State {};
    static void begin(const uint8_t*, const Grids&, State&) {}
};

template <QType T> struct Unit;  // no specialization: the type runs the float fallback

// ---- legacy --------------------------------------------------------------------------------------
template <> struct Unit<QType::Q4_0> : UnitBase {
    static constexpr bool has_min = false;
    static constexpr bool per16 = false;
    static void decode(const uint8_t* blk, int, const Grids&, const State&, Sub& u) {
        u.q = _mm256_sub_epi8(nibbles16(blk + 2), _mm256_set1_epi8(8));
        scale(u, h2f(ld_u16(blk)));
    }
};
template <> struct Unit<QType::Q4_1> : UnitBase {
    static constexpr bool has_min = true;
    static constexpr bool per16 = false;
    static void decode(const uint8_t* blk, int, const Grids&, const State&, Sub& u) {
        u.q = nibbles16(blk + 4);
        scale(u, h2f(ld_u16(blk)));
        u.m[0] = u.m[1] = h2f(ld_u16(blk + 2));
    }
};
template <> struct Unit<QType::Q5_0> : UnitBase {
    static constexpr bool has_min = false;
    static constexpr bool per16 = false;
    static void decode(const uint8_t* blk, int, const Grids&, const State&, Sub& u) {
        const __m256i hi = _mm256_and_si256(bits_to_bytes(ld_u32(blk + 2)), _mm256_set1_epi8(0x10));
        u.q = _mm256_sub_epi8(_mm256_or_si256(nibbles16(blk + 6), hi), _mm256_set1_epi8(16));
        scale(u, h2f(ld_u16(blk)));
    }
};
template <> struct Unit<QType::Q5_1> : UnitBase {
    static constexpr bool has_min = true;
    static constexpr bool per16 = false;
    static void decode(const uint8_t* blk, int, const Grids&, const State&, Sub& u) {
        const __m256i hi = _mm256_and_si256(bits_to_bytes(ld_u32(blk + 4)), _mm256_set1_epi8(0x10));
        u.q = _mm256_or_si256(nibbles16(blk + 8), hi);
        scale(u, h2f(ld_u16(blk)));
        u.m[0] = u.m[1] = h2f(ld_u16(blk + 2));
    }
};
template <> struct Unit<QType::Q8_0> : UnitBase {
    static constexpr bool has_min = false;
    static constexpr bool per16 = false;
    static void decode(const uint8_t* blk, int, const Grids&, const State&, Sub& u) {
        u.q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
        scale(u, h2f(ld_u16(blk)));
    }
};

// 8 / 16 small ints (bytes) -> float * d, stored: the per-block scale tables of the prologues
inline void scale8(__m128i bytes, bool is_signed, float d, float* out) {
    const __m256i v = is_signed ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes);
    _mm256_store_ps(out, _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(v)));
}
inline void scale16(__m128i bytes, bool is_signed, float d, float* out) {
    scale8(bytes, is_signed, d, out);
    scale8(_mm_srli_si128(bytes, 8), is_signed, d, out + 8);
}
inline void negate8(float* p) {
    _mm256_store_ps(p, _mm256_xor_ps(_mm256_load_ps(p), _mm256_set1_ps(-0.f)));
}

// Block form (Unit::block_scales, q8_kernels.h's dot_block): the 8 per-32 scales of a 256-weight
// block as one vector, and its per-32 mins m[8] repeated per 16 (m16's order: m0 m0 m1 m1 ...).
inline void mins_per16(const float* m8, __m256 m[2]) {
    const __m256 v = _mm256_load_ps(m8);
    m[0] = _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
    m[1] = _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7));
}

// Q4_K / Q5_K: s[i] = d * scale i, m[i] = -(dmin * min i) from the 6-bit fields of quants.h's
// k4_scale_min, all 16 at once: with u0 u1 u2 the three words of `scales`, scales 0-3 | 4-7 |
// mins 0-3 | 4-7 are the bytes of [u0 & 63, (u2 & 15) | (u0 >> 2 & 48), u1 & 63, (u2 >> 4 & 15) | (u1 >> 2 & 48)].
inline void k4_scales_mins(const uint8_t* blk, float* s, float* m) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk));  // d, dmin, scales[12]
    const __m128i a = _mm_shuffle_epi8(v, _mm_setr_epi8(4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15));
    const __m128i b = _mm_shuffle_epi8(v, _mm_setr_epi8(-1, -1, -1, -1, 4, 5, 6, 7, -1, -1, -1, -1, 8, 9, 10, 11));
    const __m128i lo = _mm_and_si128(_mm_srlv_epi32(a, _mm_setr_epi32(0, 0, 0, 4)),
                                     _mm_setr_epi32(0x3F3F3F3F, 0x0F0F0F0F, 0x3F3F3F3F, 0x0F0F0F0F));
    const __m128i sm = _mm_or_si128(lo, _mm_and_si128(_mm_srli_epi32(b, 2), _mm_set1_epi8(0x30)));
    const __m128 dd = _mm_cvtph_ps(v);  // d, dmin (exact)
    const __m256 d = _mm256_broadcastss_ps(dd), dmin = _mm256_broadcastss_ps(_mm_movehdup_ps(dd));
    _mm256_store_ps(s, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sm))));
    const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(sm, sm)));
    _mm256_store_ps(m, _mm256_xor_ps(_mm256_mul_ps(dmin, mn), _mm256_set1_ps(-0.f)));
}

// ---- K types ---------------------------------------------------------------------------------------
template <> struct Unit<QType::Q2_K> : UnitBase {
    static constexpr bool has_min = true;
    static constexpr bool per16 = true;
    struct State {
        alignas(32) float s[16], m[16];  // d*scale and -(dmin*min) of every 16 weights
    };
    static void begin(const uint8_t* blk, const Grids&, State& st) {
        const BlockQ2_K& b = *reinterpret_cast<const BlockQ2_K*>(blk);
        const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b.scales));
        scale16(_mm_and_si128(sc, _mm_set1_epi8(0x0F)), false, h2f(b.d), st.s);
        scale16(_mm_and_si128(_mm_srli_epi16(sc, 4), _mm_set1_epi8(0x0F)), false, h2f(b.dmin), st.m);
        negate8(st.m);
        negate8(st.m + 8);
    }
    static void decode(const uint8_t* blk, int s, const Grids&, const State& st, Sub& u) {
        const BlockQ2_K& b = *reinterpret_cast<const BlockQ2_K*>(blk);
        u.q = field32(b.qs + 32 * (s / 4), 2 * (s % 4), 3);
        u.s[0] = st.s[2 * s], u.s[1] = st.s[2 * s + 1];
        u.m[0] = st.m[2 * s], u.m[1] = st.m[2 * s + 1];
    }
};
template <> struct Unit<QType::Q3_K> : UnitBase {
    static constexpr bool has_min = false;
    static constexpr bool per16 = true;
    struct State {
        alignas(32) float s[16];  // d * (scale - 32) of every 16 weights
    };
    static void begin(const uint8_t* blk, const Grids&, State& st) {
        const BlockQ3_K& b = *reinterpret_cast<const BlockQ3_K*>(blk);
        // scale i: low 4 bits = nibble i/8 of scales[i%8]; high 2 bits = bits 2*(i/4) of scales[8+i%4]
        const __m128i lo8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b.scales));
        const __m128i m4 = _mm_set1_epi8(0x0F);
        const __m128i lo = _mm_unpacklo_epi64(_mm_and_si128(lo8, m4), _mm_and_si128(_mm_srli_epi16(lo8, 4), m4));
        const uint32_t h = ld_u32(b.scales + 8);
        const __m128i hi = _mm_setr_epi32(int(h & 0x03030303u), int((h >> 2) & 0x03030303u),
                                          int((h >> 4) & 0x03030303u), int((h >> 6) & 0x03030303u));
        const __m128i sc = _mm_sub_epi8(_mm_or_si128(lo, _mm_slli_epi16(hi, 4)), _mm_set1_epi8(32));
        scale16(sc, true, h2f(b.d), st.s);
    }
    static void decode(const uint8_t* blk, int s, const Grids&, const State& st, Sub& u) {
        const BlockQ3_K& b = *reinterpret_cast<const BlockQ3_K*>(blk);
        const __m256i lo = field32(b.qs + 32 * (s / 4), 2 * (s % 4), 3);
        const __m256i hbit = field32(b.hmask, s, 1);  // 1: no offset, 0: minus 4
        const __m256i off = _mm256_andnot_si256(_mm256_slli_epi16(hbit, 2), _mm256_set1_epi8(4));
        u.q = _mm256_sub_epi8(lo, off);
        u.s[0] = st.s[2 * s], u.s[1] = st.s[2 * s + 1];
    }
};
template <> struct Unit<QType::Q4_K> : UnitBase {
    static constexpr bool has_min = true;
    static constexpr bool per16 = false;
    struct State {
        alignas(32) float s[8], m[8];  // d*scale and -(dmin*min) of every 32 weights
    };
    static void begin(const uint8_t* blk, const Grids&, State& st) { k4_scales_mins(blk, st.s, st.m); }
    static void decode(const uint8_t* blk, int s, const Grids&, const State& st, Sub& u) {
        const BlockQ4_K& b = *reinterpret_cast<const BlockQ4_K*>(blk);
        u.q = field32(b.qs + 32 * (s / 2), 4 * (s % 2), 0xF);
        scale(u, st.s[s]);
        u.m[0] = u.m[1] = st.m[s];
    }
    static __m256 block_scales(const State& st) { return _mm256_load_ps(st.s); }
    static void block_mins(const State& st, __m256 m[2]) { mins_per16(st.m, m); }
#ifdef __AVX512BW__
    // subs 2k and 2k+1 in one vector: the low and the high nibbles of the same 32 bytes
    static __m512i pair(const uint8_t* blk, int k, const Grids&, const State&) {
        const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16 + 32 * k)));
        const __m512i sh = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
        return _mm512_and_si512(_mm512_srlv_epi16(v, sh), _mm512_set1_epi8(0x0F));
    }
    // the block in q8_kernels.h's interleave_groups layout: o[i] = [T_2i | T_2i+1], T_j lane g =
    // dword j of group g, i.e. of qs dword 8 * (g / 2) + j, low nibbles for even g, high for odd
    static void interleaved(const uint8_t* blk, __m512i o[4]) {
        const __m512i a = _mm512_loadu_si512(blk + 16), b = _mm512_loadu_si512(blk + 80);
        const __m512i idx = _mm512_setr_epi32(0, 0, 8, 8, 16, 16, 24, 24, 1, 1, 9, 9, 17, 17, 25, 25);
        const __m512i sh = _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4);
        for (int i = 0; i < 4; ++i) {
            const __m512i d = _mm512_permutex2var_epi32(a, _mm512_add_epi32(idx, _mm512_set1_epi32(2 * i)), b);
            o[i] = _mm512_and_si512(_mm512_srlv_epi32(d, sh), _mm512_set1_epi8(0x0F));
        }
    }
#endif
};
template <> struct Unit<QType::Q5_K> : UnitBase {
    static constexpr bool has_min = true;
    static constexpr bool per16 = false;
    struct State {
        alignas(32) float s[8], m[8];  // d*scale and -(dmin*min) of every 32 weights
    };
    static void begin(const uint8_t* blk, const Grids&, State& st) { k4_scales_mins(blk, st.s, st.m); }
    static void decode(const uint8_t* blk, int s, const Grids&, const State& st, Sub& u) {
        const BlockQ5_K& b = *reinterpret_cast<const BlockQ5_K*>(blk);
        const __m256i hi = _mm256_slli_epi16(field32(b.qh, s, 1), 4);
        u.q = _mm256_or_si256(field32(b.qs + 32 * (s / 2), 4 * (s % 2), 0xF), hi);
        scale(u, st.s[s]);
        u.m[0] = u.m[1] = st.m[s];
    }
    static __m256 block_scales(const State& st) { return _mm256_load_ps(st.s); }
    static void block_mins(const State& st, __m256 m[2]) { mins_per16(st.m, m); }
};
template <> struct Unit<QType::Q6_K> : UnitBase {
    static constexpr bool has_min = false;
    static constexpr bool per16 = true;
    struct State {
        alignas(32) float s[16];  // d * scale of every 16 weights
    };
    static void begin(const uint8_t* blk, const Grids&, State& st) {
        const BlockQ6_K& b = *reinterpret_cast<const BlockQ6_K*>(blk);
        scale16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b.scales)), true, h2f(b.d), st.s);
    }
    static void decode(const uint8_t* blk, int s, const Grids&, const State& st, Sub& u) {
        const BlockQ6_K& b = *reinterpret_cast<const BlockQ6_K*>(blk);
        const int half = s / 4, r = s % 4;
        const __m256i lo = field32(b.ql + 64 * half + 32 * (r % 2), 4 * (r / 2), 0xF);
        const __m256i hi = _mm256_slli_epi16(field32(b.qh + 32 * half, 2 * r, 3), 4);
        u.q = _mm256_sub_epi8(_mm256_or_si256(lo, hi), _mm256_set1_epi8(32));
        u.s[0] = st.s[2 * s], u.s[1] = st.s[2 * s + 1];
    }
};

// ---- I types ---------------------------------------------------------------------------------------
inline __m256i grid8x4(const uint64_t* grid, int i0, int i1, int i2, int i3) {
    return _mm256_setr_epi64x(int64_t(grid[i0]), int64_t(grid[i1]), int64_t(grid[i2]), int64_t(grid[i3]));
}
inline __m256i grid4x8(const uint32_t* grid, const int* i) {
    return _mm256_setr_epi32(int(grid[i[0]]), int(grid[i[1]]), int(grid[i[2]]), int(grid[i[3]]),
                             int(grid[i[4]]), int(grid[i[5]]), int(grid[i[6]]), int(grid[i[7]]));
}
// IQ1: q = 8*grid + (delta > 0 ? 1 : -1) per group of 8 (sign bits in `neg`, one per group)
inline __m256i iq1_values(__m256i grid, int neg0, int neg1, int neg2, int neg3) {
    const __m256i g8 = _mm256_sign_epi8(_mm256_set1_epi8(8), grid);
    const __m256i delta = _mm256_setr_epi64x(neg0 ? -1 : 0x0101010101010101LL, neg1 ? -1 : 0x0101010101010101LL,
                                             neg2 ? -1 : 0x0101010101010101LL, neg3 ? -1 : 0x0101010101010101LL);
    return _mm256_add_epi8(g8, delta);
}

template <> struct Unit<QType::IQ1_S> : UnitBase {
    static constexpr bool has_min = false;
    static constexpr bool per16 = false;
    struct State {
        alignas(32) uint16_t idx[32];  // 11-bit grid index of every 8 weights
    };
    static void begin(const uint8_t* blk, const Grids&, State& st) {
        const BlockIQ1_S& b = *reinterpret_cast<const BlockIQ1_S*>(blk);
        // entry 4s+k: qs byte | bits 3k..3k+2 of qh[s] as bits 8..10; per 16 entries (4 subs)
        const __m256i rep = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3,
                                             4, 5, 4, 5, 4, 5, 4, 5, 6, 7, 6, 7, 6, 7, 6, 7);
        const __m256i shl = _mm256_setr_epi16(256, 32, 4, 0, 256, 32, 4, 0, 256, 32, 4, 0, 256, 32, 4, 0);
        const __m256i shr = _mm256_setr_epi16(0, 0, 0, -32768, 0, 0, 0, -32768, 0, 0, 0, -32768, 0, 0, 0, -32768);
        for (int c = 0; c < 2; ++c) {
            uint64_t q4;
            std::memcpy(&q4, b.qh + 4 * c, 8);
            const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi64x(int64_t(q4)), rep);
            const __m256i hi = _mm256_and_si256(_mm256_or_si256(_mm256_mullo_epi16(v, shl), _mm256_mulhi_epu16(v, shr)),
                                                _mm256_set1_epi16(0x700));
            const __m256i lo = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b.qs + 16 * c)));
            _mm256_store_si256(reinterpret_cast<__m256i*>(st.idx + 16 * c), _mm256_or_si256(lo, hi));
        }
    }
    static void decode(const uint8_t* blk, int s, const Grids& g, const State& st, Sub& u) {
        const BlockIQ1_S& b = *reinterpret_cast<const BlockIQ1_S*>(blk);
        const uint16_t qh = b.qh[s];
        const uint16_t* i = st.idx + 4 * s;
        const int neg = qh >> 15;
        u.q = iq1_values(grid8x4(g.iq1s, i[0], i[1], i[2], i[3]), neg, neg, neg, neg);
        scale(u, h2f(b.d) * float(2 * ((qh >> 12) & 7) + 1) * 0.125f);
    }
};
template <> struct Unit<QType::IQ1_M> : UnitBase {
    static constexpr bool has_min = false;
    static constexpr bool per16 = true;
    struct State {
        alignas(32) uint16_t idx[32];  // 11-bit grid index of every 8 weights
        float d;
    };
    static void begin(const uint8_t* blk, const Grids&, State& st) {
        const BlockIQ1_M& b = *reinterpret_cast<const BlockIQ1_M*>(blk);
        st.d = h2f(uint16_t((b.scales[0] >> 12) | ((b.scales[1] >> 8) & 0x00F0) |
                            ((b.scales[2] >> 4) & 0x0F00) | (b.scales[3] & 0xF000)));
        // entry grp: qs byte | (nibble grp%2 of qh[grp/2]) & 7 as bits 8..10
        const __m128i qh = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b.qh));
        const __m128i m7 = _mm_set1_epi8(7);
        const __m128i nl = _mm_and_si128(qh, m7), nh = _mm_and_si128(_mm_srli_epi16(qh, 4), m7);
        const __m128i nib[2] = {_mm_unpacklo_epi8(nl, nh), _mm_unpackhi_epi8(nl, nh)};  // per entry
        for (int c = 0; c < 2; ++c) {
            const __m256i hi = _mm256_slli_epi16(_mm256_cvtepu8_epi16(nib[c]), 8);
            const __m256i lo = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b.qs + 16 * c)));
            _mm256_store_si256(reinterpret_cast<__m256i*>(st.idx + 16 * c), _mm256_or_si256(lo, hi));
        }
    }
    static void decode(const uint8_t* blk, int s, const Grids& g, const State& st, Sub& u) {
        const BlockIQ1_M& b = *reinterpret_cast<const BlockIQ1_M*>(blk);
        const uint16_t* i = st.idx + 4 * s;
        const int h0 = b.qh[2 * s], h1 = b.qh[2 * s + 1];  // delta signs: bit 3 of each nibble
        u.q = iq1_values(grid8x4(g.iq1s, i[0], i[1], i[2], i[3]), h0 & 8, h0 & 0x80, h1 & 8, h1 & 0x80);
        for (int h = 0; h < 2; ++h) {
            const int sc = (b.scales[s / 2] >> (6 * (s % 2) + 3 * h)) & 7;
            u.s[h] = st.d * float(2 * sc + 1) * 0.125f;
        }
    }
};
template <> struct Unit<QType::IQ2_XXS> : UnitBase {
    static constexpr bool has_min = false;
    static constexpr bool per16 = false;
    static void decode(const uint8_t* blk, int s, const Grids& g, const State&, Sub& u) {
        const uint8_t* q = blk + 2 + 8 * s;
        const uint32_t aux = ld_u32(q + 4);
        u.q = apply_signs(grid8x4(g.iq2xxs, q[0], q[1], q[2], q[3]),
                          uint32_t(g.ksigns[aux & 127]) | (uint32_t(g.ksigns[(aux >> 7) & 127]) << 8) |
                              (uint32_t(g.ksigns[(aux >> 14) & 127]) << 16) |
                              (uint32_t(g.ksigns[(aux >> 21) & 127]) << 24));
        scale(u, h2f(ld_u16(blk)) * (0.5f + float(aux >> 28)) * 0.25f);
    }
};
template <> struct Unit<QType::IQ2_XS> : UnitBase {
    static constexpr bool has_min = false;
    static constexpr bool per16 = true;
    struct State {
        alignas(32) uint16_t idx[32];  // 9-bit grid index of every 8 weights
    };
    static void begin(const uint8_t* blk, const Grids&, State& st) {
        for (int c = 0; c < 2; ++c) {
            const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2 + 32 * c));
            _mm256_store_si256(reinterpret_cast<__m256i*>(st.idx + 16 * c), _mm256_and_si256(q, _mm256_set1_epi16(511)));
        }
    }
    static void decode(const uint8_t* blk, int s, const Grids& g, const State& st, Sub& u) {
        const BlockIQ2_XS& b = *reinterpret_cast<const BlockIQ2_XS*>(blk);
        const uint16_t* q = b.qs + 4 * s;
        const uint16_t* i = st.idx + 4 * s;
        u.q = apply_signs(grid8x4(g.iq2xs, i[0], i[1], i[2], i[3]),
                          uint32_t(g.ksigns[q[0] >> 9]) | (uint32_t(g.ksigns[q[1] >> 9]) << 8) |
                              (uint32_t(g.ksigns[q[2] >> 9]) << 16) | (uint32_t(g.ksigns[q[3] >> 9]) << 24));
        const float d = h2f(b.d);
        u.s[0] = d * (0.5f + float(b.scales[s] & 0xF)) * 0.25f;
        u.s[1] = d * (0.5f + float(b.scales[s] >> 4)) * 0.25f;
    }
};
template <> struct Unit<QType::IQ2_S> : UnitBase {
    static constexpr bool has_min = false;
    static constexpr bool per16 = true;
    struct State {
        alignas(32) uint16_t idx[32];  // 10-bit grid index of every 8 weights
    };
    static void begin(const uint8_t* blk, const Grids&, State& st) {
        const BlockIQ2_S& b = *reinterpret_cast<const BlockIQ2_S*>(blk);
        // entry 4s+k: qs byte | bits 2k..2k+1 of qh[s] as bits 8..9 (left shifts by 8-2k)
        const __m256i rep = _mm256_setr_epi8(0, -1, 0, -1, 0, -1, 0, -1, 1, -1, 1, -1, 1, -1, 1, -1,
                                             2, -1, 2, -1, 2, -1, 2, -1, 3, -1, 3, -1, 3, -1, 3, -1);
        const __m256i shl = _mm256_setr_epi16(256, 64, 16, 4, 256, 64, 16, 4, 256, 64, 16, 4, 256, 64, 16, 4);
        for (int c = 0; c < 2; ++c) {
            const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32(int(ld_u32(b.qh + 4 * c))), rep);
            const __m256i hi = _mm256_and_si256(_mm256_mullo_epi16(v, shl), _mm256_set1_epi16(0x300));
            const __m256i lo = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b.qs + 16 * c)));
            _mm256_store_si256(reinterpret_cast<__m256i*>(st.idx + 16 * c), _mm256_or_si256(lo, hi));
        }
    }
    static void decode(const uint8_t* blk, int s, const Grids& g, const State& st, Sub& u) {
        const BlockIQ2_S& b = *reinterpret_cast<const BlockIQ2_S*>(blk);
        const uint16_t* i = st.idx + 4 * s;
        u.q = apply_signs(grid8x4(g.iq2s, i[0], i[1], i[2], i[3]), ld_u32(b.signs + 4 * s));
        const float d = h2f(b.d);
        u.s[0] = d * (0.5f + float(b.scales[s] & 0xF)) * 0.25f;
        u.s[1] = d * (0.5f + float(b.scales[s] >> 4)) * 0.25f;
    }
};
template <> struct Unit<QType::IQ3_XXS> : UnitBase {
    static constexpr bool has_min = false;
    static constexpr bool per16 = false;
    static void decode(const uint8_t* blk, int s, const Grids& g, const State&, Sub& u) {
        const BlockIQ3_XXS& b = *reinterpret_cast<const BlockIQ3_XXS*>(blk);
        const uint8_t* q = b.qs + 8 * s;
        const uint32_t aux = ld_u32(b.scales_signs + 4 * s);
        const int idx[8] = {q[0], q[1], q[2], q[3], q[4], q[5], q[6], q[7]};
        u.q = apply_signs(grid4x8(g.iq3xxs, idx),
                          uint32_t(g.ksigns[aux & 127]) | (uint32_t(g.ksigns[(aux >> 7) & 127]) << 8) |
                              (uint32_t(g.ksigns[(aux >> 14) & 127]) << 16) |
                              (uint32_t(g.ksigns[(aux >> 21) & 127]) << 24));
        scale(u, h2f(b.d) * (0.5f + float(aux >> 28)) * 0.5f);
    }
};
// word j = 0xFFFF where bit j of `bits` is set
inline __m256i bits_to_words(uint32_t bits) {
    const __m256i bit = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096,
                                          8192, 16384, -32768);
    return _mm256_cmpeq_epi16(_mm256_and_si256(_mm256_set1_epi16(short(bits)), bit), bit);
}

// IQ3_S's (and IQ3_S_N4's) scale of every 32 weights: d * (1 + 2 * the group's 4-bit scale)
inline void iq3s_group_scales(uint16_t d, const uint8_t* scales, float* out) {
    const __m128i sc4 = _mm_cvtsi32_si128(int(ld_u32(scales)));
    const __m128i nib = _mm_and_si128(_mm_unpacklo_epi8(sc4, _mm_srli_epi16(sc4, 4)), _mm_set1_epi8(0x0F));
    const __m256 odd = _mm256_cvtepi32_ps(_mm256_add_epi32(
        _mm256_slli_epi32(_mm256_cvtepu8_epi32(nib), 1), _mm256_set1_epi32(1)));  // 1 + 2*sc
    _mm256_store_ps(out, _mm256_mul_ps(_mm256_set1_ps(h2f(d)), odd));
}

template <> struct Unit<QType::IQ3_S> : UnitBase {
    static constexpr bool has_min = false;
    static constexpr bool per16 = false;
    struct State {
        alignas(32) uint16_t idx[64];  // 9-bit grid index of every 4 weights
        alignas(32) float s[8];        // scale of every 32 weights
    };
    static void begin(const uint8_t* blk, const Grids&, State& st) {
        const BlockIQ3_S& b = *reinterpret_cast<const BlockIQ3_S*>(blk);
        for (int c = 0; c < 4; ++c) {  // 16 indices: qs bytes | the qh bit as bit 8
            const __m256i lo = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b.qs + 16 * c)));
            const __m256i hi = _mm256_and_si256(bits_to_words(b.qh[2 * c] | (b.qh[2 * c + 1] << 8)),
                                                _mm256_set1_epi16(256));
            _mm256_store_si256(reinterpret_cast<__m256i*>(st.idx + 16 * c), _mm256_or_si256(lo, hi));
        }
        iq3s_group_scales(b.d, b.scales, st.s);
    }
    // the 8 unsigned grid entries of sub s: 8 scalar loads, or with FT_IQ3S_GATHER one gather (the
    // AVX-512 file, and the AVX2 table's IQ3_S on Intel: kernels_iq3s_gather_avx2.cpp)
    static __m256i grid(const State& st, int s, const Grids& g) {
#ifdef FT_IQ3S_GATHER
        const __m256i idx = _mm256_cvtepu16_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(st.idx + 8 * s)));
        return _mm256_i32gather_epi32(reinterpret_cast<const int*>(g.iq3s), idx, 4);
#endif
        const uint16_t* i = st.idx + 8 * s;
        const __m128i g0 = _mm_setr_epi32(int(g.iq3s[i[0]]), int(g.iq3s[i[1]]), int(g.iq3s[i[2]]), int(g.iq3s[i[3]]));
        const __m128i g1 = _mm_setr_epi32(int(g.iq3s[i[4]]), int(g.iq3s[i[5]]), int(g.iq3s[i[6]]), int(g.iq3s[i[7]]));
        return _mm256_set_m128i(g1, g0);
    }
    static void decode(const uint8_t* blk, int s, const Grids& g, const State& st, Sub& u) {
        u.q = apply_signs(grid(st, s, g), signs(blk, s));
        scale(u, st.s[s]);
    }
    // u.q = magnitude(...) with signs(...) applied (dot_block signs the activations instead)
    static __m256i magnitude(const uint8_t*, int s, const Grids& g, const State& st) { return grid(st, s, g); }
    static uint32_t signs(const uint8_t* blk, int s) {
        return ld_u32(reinterpret_cast<const BlockIQ3_S*>(blk)->signs + 4 * s);
    }
    static __m256 block_scales(const State& st) { return _mm256_load_ps(st.s); }

    // Column form (q8_kernels.h's dot_stream_cols): column j of a block = dword j (weights
    // 4j..4j+3) of each of its 8 groups, lane g = group g, as Act::q8x holds the activations.
    static constexpr int kGridMax = 15;  // the largest grid byte (dot_stream_cols' int16 bound)
    struct Cols {
        alignas(32) uint16_t idx[64];  // column j's 8 grid indices at idx + col_at(j)
        alignas(32) float s[8];
        __m256i sg;  // dword g = the sign bits of group g
    };
    static constexpr int col_at(int j) { return 32 * (j / 4) + 16 * (j % 2) + 8 * (j / 2 % 2); }
    static void begin_cols(const uint8_t* blk, Cols& st) {
        const BlockIQ3_S& b = *reinterpret_cast<const BlockIQ3_S*>(blk);
        // qs as 8 rows (groups) of 8 bytes (columns), transposed: rows 0,1 | 4,5 and 2,3 | 6,7
        // (inserts from memory: no shuffle), each lane's row pair interleaved per column, then
        // words of the two merged (dword c of lane L = rows 4L..4L+3 of column c) and the lanes
        // paired (qword c = column c)
        auto ld = [](const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); };
        const __m256i a = _mm256_inserti128_si256(_mm256_castsi128_si256(ld(b.qs)), ld(b.qs + 32), 1);
        const __m256i c = _mm256_inserti128_si256(_mm256_castsi128_si256(ld(b.qs + 16)), ld(b.qs + 48), 1);
        const __m256i pair = _mm256_setr_epi8(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15,
                                              0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
        const __m256i pa = _mm256_shuffle_epi8(a, pair), pc = _mm256_shuffle_epi8(c, pair);
        const __m256i lanes = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        const __m256i lo = _mm256_permutevar8x32_epi32(_mm256_unpacklo_epi16(pa, pc), lanes);  // columns 0-3
        const __m256i hi = _mm256_permutevar8x32_epi32(_mm256_unpackhi_epi16(pa, pc), lanes);  // 4-7
        // the high index bits: byte g of column c = bit c of qh[g] = bit 8g + c of qh as one word
        uint64_t qh;
        std::memcpy(&qh, b.qh, 8);
        const __m256i q = _mm256_set1_epi64x(int64_t(qh)), one = _mm256_set1_epi8(1);
        const __m256i h0 = _mm256_and_si256(_mm256_srlv_epi64(q, _mm256_setr_epi64x(0, 1, 2, 3)), one);
        const __m256i h1 = _mm256_and_si256(_mm256_srlv_epi64(q, _mm256_setr_epi64x(4, 5, 6, 7)), one);
        auto st16 = [&](int at, __m256i v) { _mm256_store_si256(reinterpret_cast<__m256i*>(st.idx + at), v); };
        st16(0, _mm256_unpacklo_epi8(lo, h0));   // columns 0 | 2
        st16(16, _mm256_unpackhi_epi8(lo, h0));  // 1 | 3
        st16(32, _mm256_unpacklo_epi8(hi, h1));  // 4 | 6
        st16(48, _mm256_unpackhi_epi8(hi, h1));  // 5 | 7
        iq3s_group_scales(b.d, b.scales, st.s);
        st.sg = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.signs));
    }
    // the unsigned grid bytes of column j
    static __m256i grid_col(const Cols& st, int j, const Grids& g) {
        const uint16_t* i = st.idx + col_at(j);
#ifdef FT_IQ3S_GATHER
        const __m256i idx = _mm256_cvtepu16_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(i)));
        return _mm256_i32gather_epi32(reinterpret_cast<const int*>(g.iq3s), idx, 4);
#endif
        // broadcasts from memory (load ports only) merged by blends (any vector ALU port), not
        // inserts (a shuffle each)
        uint64_t w[2];  // the 8 indices in two loads, not eight
        std::memcpy(w, i, 16);
        auto e = [&](int k) {
            const uint32_t ix = uint32_t(w[k / 4] >> (16 * (k % 4))) & 0xFFFF;
            return _mm256_castps_si256(_mm256_broadcast_ss(reinterpret_cast<const float*>(g.iq3s + ix)));
        };
        const __m256i a = _mm256_blend_epi32(_mm256_blend_epi32(e(0), e(1), 0x02), _mm256_blend_epi32(e(2), e(3), 0x08), 0x0C);
        const __m256i c = _mm256_blend_epi32(_mm256_blend_epi32(e(4), e(5), 0x20), _mm256_blend_epi32(e(6), e(7), 0x80), 0xC0);
        return _mm256_blend_epi32(a, c, 0xF0);
    }
    // column j's signs for _mm256_sign_epi8: byte < 0 where the weight is negative, else > 0
    // (the sign bit isolated, plus 0x7F: 0 -> 0x7F, any set bit -> 0x80..0xFF)
    static __m256i sign_col(const Cols& st, int j) {
        const char p = char(j / 2), q = char(4 + j / 2), r = char(8 + j / 2), t = char(12 + j / 2);
        const __m256i rep = _mm256_setr_epi8(p, p, p, p, q, q, q, q, r, r, r, r, t, t, t, t,
                                             p, p, p, p, q, q, q, q, r, r, r, r, t, t, t, t);
        const __m256i bit = j % 2 ? _mm256_set1_epi32(int(0x80402010u)) : _mm256_set1_epi32(0x08040201);
        const __m256i v = _mm256_and_si256(_mm256_shuffle_epi8(st.sg, rep), bit);
        return _mm256_add_epi8(v, _mm256_set1_epi8(0x7F));
    }
#ifdef __AVX512BW__
    // Column j of two rows in one 512-bit vector (q8_kernels.h, dot_stream_cols512): lanes 0-7
    // row a's groups, 8-15 row b's, from one 16-index gather
    static __m512i grid_col2(const Cols& a, const Cols& b, int j, const Grids& g) {
#ifdef FT_IQ3S_GATHER
        auto ld = [&](const Cols& c) { return _mm_load_si128(reinterpret_cast<const __m128i*>(c.idx + col_at(j))); };
        const __m256i idx = _mm256_inserti128_si256(_mm256_castsi128_si256(ld(a)), ld(b), 1);
        return _mm512_i32gather_epi32(_mm512_cvtepu16_epi32(idx), reinterpret_cast<const int*>(g.iq3s), 4);
#else
        return _mm512_inserti64x4(_mm512_castsi256_si512(grid_col(a, j, g)), grid_col(b, j, g), 1);
#endif
    }
    // Bytes of grid_col2(j) whose weight is negative, as a mask; sg = [a.sg | b.sg]: each 128-bit
    // lane holds the sign bytes of the 4 groups whose weights it carries (sign_col's pick, by
    // byte test instead of the byte sign)
    static __mmask64 sign_col2(__m512i sg, int j) {
        const char p = char(j / 2), q = char(4 + j / 2), r = char(8 + j / 2), t = char(12 + j / 2);
        const __m512i rep = _mm512_broadcast_i32x4(_mm_setr_epi8(p, p, p, p, q, q, q, q, r, r, r, r, t, t, t, t));
        const __m512i bit = _mm512_set1_epi32(j % 2 ? int(0x80402010u) : 0x08040201);
        return _mm512_test_epi8_mask(_mm512_shuffle_epi8(sg, rep), bit);
    }
#endif
#ifdef __AVX512F__
    // magnitudes of subs 2k and 2k+1 (one 16-index gather) and their 64 sign bits
    static __m512i magnitude2(const uint8_t*, int k, const Grids& g, const State& st) {
        const __m512i idx = _mm512_cvtepu16_epi32(_mm256_load_si256(reinterpret_cast<const __m256i*>(st.idx + 16 * k)));
        return _mm512_i32gather_epi32(idx, reinterpret_cast<const int*>(g.iq3s), 4);
    }
    static uint64_t signs2(const uint8_t* blk, int k) {
        uint64_t v;
        std::memcpy(&v, reinterpret_cast<const BlockIQ3_S*>(blk)->signs + 8 * k, 8);
        return v;
    }
#endif
};
// IQ3_S_N4 (quants.h): IQ3_S's block scales; weights w = 2 * code - 15. decode() gives w (the
// many-token paths); the decode streams take the unsigned codes themselves (codes / codes2) and
// form each group's 2 * (codes . x) - 15 * (sum of x) in int32 (q8_kernels.h: HasCodes).
template <> struct Unit<QType::IQ3_S_N4> : UnitBase {
    static constexpr bool has_min = false;
    static constexpr bool per16 = false;
    static constexpr int kCodeOffset = 15;  // w = 2 * code - kCodeOffset
    struct State {
        alignas(32) float s[8];  // d * (1 + 2 * scale) of every 32 weights, as IQ3_S's
    };
    static void begin(const uint8_t* blk, const Grids&, State& st) {
        const BlockIQ3_S_N4& b = *reinterpret_cast<const BlockIQ3_S_N4*>(blk);
        iq3s_group_scales(b.d, b.scales, st.s);
    }
    // the 32 codes (0..15) of group s
    static __m256i codes(const uint8_t* blk, int s) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 6 + 32 * (s / 2)));
        return _mm256_and_si256(s % 2 ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(0x0F));
    }
    static void decode(const uint8_t* blk, int s, const Grids&, const State& st, Sub& u) {
        const __m256i c = codes(blk, s);
        u.q = _mm256_sub_epi8(_mm256_add_epi8(c, c), _mm256_set1_epi8(kCodeOffset));
        scale(u, st.s[s]);
    }
    static __m256 block_scales(const State& st) { return _mm256_load_ps(st.s); }
#ifdef __AVX512BW__
    // the codes of groups 2k and 2k + 1: one 32-byte chunk, its low nibbles then its high ones
    static __m512i codes2(const uint8_t* blk, int k) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 6 + 32 * k));
        const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(v), _mm256_srli_epi16(v, 4), 1);
        return _mm512_and_si512(both, _mm512_set1_epi8(0x0F));
    }
#endif
};
template <> struct Unit<QType::IQ4_NL> : UnitBase {
    static constexpr bool has_min = false;
    static constexpr bool per16 = false;
    static void decode(const uint8_t* blk, int, const Grids& g, const State&, Sub& u) {
        u.q = lookup16(nibbles16(blk + 2), g.kvalues_iq4nl);
        scale(u, h2f(ld_u16(blk)));
    }
};
template <> struct Unit<QType::IQ4_XS> : UnitBase {
    static constexpr bool has_min = false;
    static constexpr bool per16 = false;
    struct State {
        alignas(32) float s[8];  // d * (ls - 32) of every 32 weights
    };
    static void begin(const uint8_t* blk, const Grids&, State& st) {
        const BlockIQ4_XS& b = *reinterpret_cast<const BlockIQ4_XS*>(blk);
        // ls of sub s: nibble s%2 of scales_l[s/2], plus bits 2s..2s+1 of scales_h as bits 4..5
        const __m128i l4 = _mm_cvtsi32_si128(int(ld_u32(b.scales_l)));
        const __m128i lo = _mm_and_si128(_mm_unpacklo_epi8(l4, _mm_srli_epi16(l4, 4)), _mm_set1_epi8(0x0F));
        const uint64_t hi = _pdep_u64(b.scales_h, 0x3030303030303030ull);  // 2 bits -> bits 4..5 of byte s
        const __m128i ls = _mm_sub_epi8(_mm_or_si128(lo, _mm_cvtsi64_si128(int64_t(hi))), _mm_set1_epi8(32));
        scale8(ls, true, h2f(b.d), st.s);
    }
    static void decode(const uint8_t* blk, int s, const Grids& g, const State& st, Sub& u) {
        const BlockIQ4_XS& b = *reinterpret_cast<const BlockIQ4_XS*>(blk);
        u.q = lookup16(nibbles16(b.qs + 16 * s), g.kvalues_iq4nl);
        scale(u, st.s[s]);
    }
    static __m256 block_scales(const State& st) { return _mm256_load_ps(st.s); }
};

// ---- ternary, fp4 ----------------------------------------------------------------------------------
// TQ1_0: trit k of byte q = ((uint8)(q * 3^k) * 3) >> 8, per byte with 16-bit multiplies.
inline __m256i tq1_trits(__m256i src, __m256i pow3) {
    const __m256i lo8 = _mm256_set1_epi16(0x00FF);
    const __m256i even = _mm256_and_si256(_mm256_mullo_epi16(src, pow3), lo8);
    const __m256i odd = _mm256_slli_epi16(_mm256_mullo_epi16(_mm256_srli_epi16(src, 8), _mm256_srli_epi16(pow3, 8)), 8);
    const __m256i m = _mm256_or_si256(even, odd);  // (uint8)(q * 3^k) in every byte
    const __m256i three = _mm256_set1_epi16(3);
    const __m256i t_even = _mm256_mulhi_epu16(_mm256_slli_epi16(m, 8), three);
    const __m256i t_odd = _mm256_slli_epi16(_mm256_mulhi_epu16(_mm256_andnot_si256(lo8, m), three), 8);
    return _mm256_or_si256(t_even, t_odd);
}
template <> struct Unit<QType::TQ1_0> : UnitBase {
    static constexpr bool has_min = false;
    static constexpr bool per16 = false;
    static void decode(const uint8_t* blk, int s, const Grids&, const State&, Sub& u) {
        const BlockTQ1_0& b = *reinterpret_cast<const BlockTQ1_0*>(blk);
        // weights 0..159: qs[l] trit s; 160..239: qs[32 + l%16] trit (n-160)/16;
        // 240..255: qh[l%4] trit (n-240)/4 (see quants.h)
        const __m128i mid = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b.qs + 32));
        __m256i src, pow3;
        if (s < 5) {
            static constexpr int8_t p[5] = {1, 3, 9, 27, 81};
            src = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qs));
            pow3 = _mm256_set1_epi8(p[s]);
        } else if (s < 7) {
            static constexpr int8_t p[4] = {1, 3, 9, 27};
            src = _mm256_set_m128i(mid, mid);
            pow3 = _mm256_set_m128i(_mm_set1_epi8(p[2 * (s - 5) + 1]), _mm_set1_epi8(p[2 * (s - 5)]));
        } else {
            src = _mm256_set_m128i(_mm_set1_epi32(int(ld_u32(b.qh))), mid);
            pow3 = _mm256_set_m128i(_mm_setr_epi8(1, 1, 1, 1, 3, 3, 3, 3, 9, 9, 9, 9, 27, 27, 27, 27),
                                    _mm_set1_epi8(81));
        }
        u.q = _mm256_sub_epi8(tq1_trits(src, pow3), _mm256_set1_epi8(1));
        scale(u, h2f(b.d));
    }
};
template <> struct Unit<QType::TQ2_0> : UnitBase {
    static constexpr bool has_min = false;
    static constexpr bool per16 = false;
    static void decode(const uint8_t* blk, int s, const Grids&, const State&, Sub& u) {
        const BlockTQ2_0& b = *reinterpret_cast<const BlockTQ2_0*>(blk);
        u.q = _mm256_sub_epi8(field32(b.qs + 32 * (s / 4), 2 * (s % 4), 3), _mm256_set1_epi8(1));
        scale(u, h2f(b.d));
    }
};
template <> struct Unit<QType::MXFP4> : UnitBase {
    static constexpr bool has_min = false;
    static constexpr bool per16 = false;
    static void decode(const uint8_t* blk, int, const Grids& g, const State&, Sub& u) {
        u.q = lookup16(nibbles16(blk + 1), g.kvalues_mxfp4);
        scale(u, e8m0_half_to_f32(blk[0]));
    }
};

}  // namespace ft::cpu::avx2
