// Int16-activation kernels for the 32-weight block types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL,
// MXFP4: the ones ggml's CPU pairs with q8_0 / q8_1 activations).
//
// Why not int8 as for the other types: ggml rounds x for these to int8 per 32 values (scale
// stored as f16), which is the q8 kernels' own scheme to within the f16 rounding of the scale, so
// int8 would only tie ggml's fidelity; the K and IQ types' int8 per 32 already beats ggml's q8_K
// (per 256) by a clear margin. Int16 per 32 (d = max|x| / 32767, q = round(x / d), float32
// arithmetic, ties to even: native.numerics.q16_round bit for bit) rounds 258 times finer, and on
// these types costs about what int8 does: their float steps (one scale per 32 weights and token)
// dominate either way.
//
// A 32-weight group's products are exact in int32 (|w| <= 128, |q| <= 32767: 32 products
// < 2^27): the int8 weights from the Unit decoders are widened to int16 and multiplied pairwise,
// 4 int32 sums per group and token. Then acc += float(sums) * (weight scale * d) lane by lane,
// the lanes summed at the end, and the additive mins (Q4_1, Q5_1) as m . (d * sum of q) per 32
// (dot_mins). Both shapes (rows streamed for few tokens, rows decoded once for many) do a token's
// arithmetic in this order, so its bits do not depend on the call; the AVX2 and AVX-512 tables
// sum the same integers per lane, so they give the same bits too.
#pragma once
#include "q8_kernels.h"

namespace ft::cpu::avx2 {

template <QType T> constexpr bool kWide =
    T == QType::Q4_0 || T == QType::Q4_1 || T == QType::Q5_0 || T == QType::Q5_1 || T == QType::Q8_0 ||
    T == QType::IQ4_NL || T == QType::MXFP4;

// Rows [t0, t1) of x (stride ldx) -> q (int16 [.., n]), d (per 32), s (d * sum of q, per 32).
inline void quantize_q16(const float* x, int64_t ldx, int64_t t0, int64_t t1, int64_t n, int16_t* q,
                         float* d, float* s) {
    for (int64_t t = t0; t < t1; ++t) {
        const float* xt = x + t * ldx;
        for (int64_t c = 0; c < n / 32; ++c) {
            __m256 v[4];
            const float dd = load_amax32(xt + 32 * c, v) / 32767.f;
            const __m256 id = _mm256_set1_ps(dd > 0.f ? 1.f / dd : 0.f);
            __m256i iv[4];
            for (int i = 0; i < 4; ++i) iv[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], id));
            const int sum = hsum_epi32(_mm256_add_epi32(_mm256_add_epi32(iv[0], iv[1]), _mm256_add_epi32(iv[2], iv[3])));
            int16_t* qc = q + t * n + 32 * c;
            for (int i = 0; i < 2; ++i)  // packs interleaves 128-bit lanes; the permute restores order
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(qc + 16 * i),
                                    _mm256_permute4x64_epi64(_mm256_packs_epi32(iv[2 * i], iv[2 * i + 1]), 0xD8));
            d[t * (n / 32) + c] = dd;
            s[t * (n / 32) + c] = dd * float(sum);
        }
    }
}

// One group's 32 products against the int16 activations: 8 int32 lanes (lane i: weights 2i, 2i+1
// of each half; madd, and dpwssd on AVX-512 VNNI). Two such products, of two rows against a
// token or of a row against two tokens, are folded into one vector by hadd: lanes 0,1,4,5 hold
// the first's four pair sums, lanes 2,3,6,7 the second's. The float steps (convert, scale by
// weight scale * d, accumulate) then run lane by lane on both at once: each lane's value does not
// depend on what shares its vector, so a token's bits are the same in both shapes.
struct W16 {
    __m256i lo, hi;  // weights 0-15, 16-31 as int16
};
[[gnu::always_inline]] inline W16 widen(__m256i q) {
    return {_mm256_cvtepi8_epi16(_mm256_castsi256_si128(q)), _mm256_cvtepi8_epi16(_mm256_extracti128_si256(q, 1))};
}
[[gnu::always_inline]] inline W16 load_w16(const int16_t* p) {
    return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16))};
}
[[gnu::always_inline]] inline void store_w16(int16_t* p, W16 w) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), w.lo);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + 16), w.hi);
}
[[gnu::always_inline]] inline __m256i dot16(W16 w, const int16_t* x) {
    const __m256i lo = _mm256_madd_epi16(w.lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
    const __m256i xh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16));
#ifdef __AVX512VNNI__
    return _mm256_dpwssd_epi32(lo, w.hi, xh);
#else
    return _mm256_add_epi32(lo, _mm256_madd_epi16(w.hi, xh));
#endif
}
// [a a b b a a b b]: the scale vector of a folded pair
[[gnu::always_inline]] inline __m256 pair_scale(float a, float b) {
    return _mm256_blend_ps(_mm256_set1_ps(a), _mm256_set1_ps(b), 0xCC);
}
[[gnu::always_inline]] inline __m256 fma_pair(__m256 acc, __m256i p0, __m256i p1, __m256 scale) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_hadd_epi32(p0, p1)), scale, acc);
}
// the two sums of a folded pair: lanes 0,1,4,5 and 2,3,6,7, in one fixed order
[[gnu::always_inline]] inline void hsum_pair(__m256 acc, float& a, float& b) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    a = _mm_cvtss_f32(s) + _mm_cvtss_f32(_mm_shuffle_ps(s, s, 1));
    b = _mm_cvtss_f32(_mm_shuffle_ps(s, s, 2)) + _mm_cvtss_f32(_mm_shuffle_ps(s, s, 3));
}

// One block's weights as int16 (its Unit's int8 values widened), scale and min. Q8_0's bytes are
// widened straight from memory (no 256-bit load and lane extract first).
template <QType T>
[[gnu::always_inline]] inline W16 decode16(const uint8_t* blk, const Grids& g, float& s, float& m) {
    using U = Unit<T>;
    if constexpr (T == QType::Q8_0) {
        s = h2f(ld_u16(blk));
        return {_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2))),
                _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 18)))};
    } else {
        typename U::State st;
        Sub u;
        U::decode(blk, 0, g, st, u);
        s = u.s[0];
        if constexpr (U::has_min) m = u.m[0];
        return widen(u.q);
    }
}

// a row's result for a token: its lanes' sum, then the mins (m per 32 against s per 32)
template <bool kMin>
[[gnu::always_inline]] inline float with_mins(float v, const float* m, const Act& a, int t, int64_t nc) {
    if constexpr (kMin) v += dot_mins(m, a.sx16 + t * nc, nc);
    return v;
}

// Few tokens: R (1 or 2) rows streamed together, folded as a pair, each group decoded once for
// the NT tokens.
template <QType T, int R, int NT>
void dot_stream16(const uint8_t* const* rows, int64_t nkb, const Act& a, float* const* out, int64_t ldo,
                  const Grids& g) {
    using U = Unit<T>;
    static_assert(Traits<T>::subs == 1 && !U::per16 && (R == 1 || R == 2));
    __m256 acc[NT];
    for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
    thread_local MinBuf mbuf[2];
    float* mins[2] = {};
    if constexpr (U::has_min)
        for (int r = 0; r < R; ++r) mins[r] = mbuf[r].size(nkb);
    for (int64_t c = 0; c < nkb; ++c) {
        W16 w[R];
        __m256 swv;
        if constexpr (T == QType::Q8_0) {  // both rows' f16 scales in one conversion
            const uint8_t* b0 = rows[0] + c * Traits<T>::kb_bytes;
            const uint8_t* b1 = rows[R - 1] + c * Traits<T>::kb_bytes;
            float unused;
            for (int r = 0; r < R; ++r) w[r] = decode16<T>(rows[r] + c * Traits<T>::kb_bytes, g, unused, unused);
            const __m128i h = _mm_insert_epi16(_mm_cvtsi32_si128(ld_u16(b0)), R == 2 ? ld_u16(b1) : 0, 1);
            swv = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_cvtph_ps(h)), _mm256_setr_epi32(0, 0, 1, 1, 0, 0, 1, 1));
        } else {
            float sw[2] = {0.f, 0.f}, m;
            for (int r = 0; r < R; ++r) {
                w[r] = decode16<T>(rows[r] + c * Traits<T>::kb_bytes, g, sw[r], m);
                if constexpr (U::has_min) mins[r][c] = m;
            }
            swv = pair_scale(sw[0], sw[1]);
        }
        for (int t = 0; t < NT; ++t) {
            const int16_t* x = a.x16 + t * a.n + 32 * c;
            const __m256i p0 = dot16(w[0], x);
            const __m256i p1 = R == 2 ? dot16(w[R - 1], x) : _mm256_setzero_si256();
            acc[t] = fma_pair(acc[t], p0, p1, _mm256_mul_ps(swv, _mm256_set1_ps(a.dx16[t * nkb + c])));
        }
    }
    for (int t = 0; t < NT; ++t) {
        float v[2];
        hsum_pair(acc[t], v[0], v[1]);
        for (int r = 0; r < R; ++r) out[r][t * ldo] = with_mins<U::has_min>(v[r], mins[r], a, t, nkb);
    }
}

template <QType T, int R>
void dot_stream16_any(const uint8_t* const* rows, int64_t nkb, const Act& a, int64_t nt, float* const* out,
                      int64_t ldo, const Grids& g) {
    for (int64_t t = 0; t < nt;) {
        const int n = int(std::min<int64_t>(4, nt - t));
        float* o[R];
        for (int r = 0; r < R; ++r) o[r] = out[r] + t * ldo;
        const Act at = a.at(t);
        switch (n) {
            case 1: dot_stream16<T, R, 1>(rows, nkb, at, o, ldo, g); break;
            case 2: dot_stream16<T, R, 2>(rows, nkb, at, o, ldo, g); break;
            case 3: dot_stream16<T, R, 3>(rows, nkb, at, o, ldo, g); break;
            default: dot_stream16<T, R, 4>(rows, nkb, at, o, ldo, g); break;
        }
        t += n;
    }
}

// Many tokens: RB rows decoded once (int16 weights, scales, mins), then RB x NT register blocks.
struct RowBuf16 {  // plain arrays, as RowBuf
    int16_t* q = nullptr;  // [n]
    float* s = nullptr;    // [n/32]
    float* m = nullptr;    // [n/32]
    int64_t cap = 0;
    void size(int64_t n) {
        if (n <= cap) return;
        release();
        q = new int16_t[n], s = new float[n / 32], m = new float[n / 32];
        cap = n;
    }
    void release() {
        delete[] q, delete[] s, delete[] m;
        q = nullptr, s = nullptr, m = nullptr, cap = 0;
    }
    RowBuf16() = default;
    RowBuf16(const RowBuf16&) = delete;
    RowBuf16& operator=(const RowBuf16&) = delete;
    ~RowBuf16() { release(); }
};

template <QType T>
void decode_q16_row(const uint8_t* row, int64_t nkb, RowBuf16& rb, const Grids& g) {
    for (int64_t c = 0; c < nkb; ++c) {
        float s, m;
        store_w16(rb.q + 32 * c, decode16<T>(row + c * Traits<T>::kb_bytes, g, s, m));
        rb.s[c] = s;
        if constexpr (Unit<T>::has_min) rb.m[c] = m;
    }
}

// RB rows x NT tokens, the tokens folded in pairs (a last odd token beside zeros)
template <QType T, int RB, int NT>
void gemm16_block(const RowBuf16* rb, const Act& a, float* out, int64_t ldo) {
    constexpr int NP = (NT + 1) / 2;
    const int64_t nc = a.n / 32;
    __m256 acc[RB][NP];
    for (int r = 0; r < RB; ++r)
        for (int p = 0; p < NP; ++p) acc[r][p] = _mm256_setzero_ps();
    for (int64_t c = 0; c < nc; ++c) {
        __m256 dx[NP];
        for (int p = 0; p < NP; ++p)
            dx[p] = pair_scale(a.dx16[2 * p * nc + c], 2 * p + 1 < NT ? a.dx16[(2 * p + 1) * nc + c] : 0.f);
        for (int r = 0; r < RB; ++r) {
            const W16 w = load_w16(rb[r].q + 32 * c);
            const __m256 sw = _mm256_set1_ps(rb[r].s[c]);
            for (int p = 0; p < NP; ++p) {
                const __m256i p0 = dot16(w, a.x16 + 2 * p * a.n + 32 * c);
                const __m256i p1 = 2 * p + 1 < NT ? dot16(w, a.x16 + (2 * p + 1) * a.n + 32 * c) : _mm256_setzero_si256();
                acc[r][p] = fma_pair(acc[r][p], p0, p1, _mm256_mul_ps(sw, dx[p]));
            }
        }
    }
    for (int r = 0; r < RB; ++r)
        for (int p = 0; p < NP; ++p) {
            float v[2];
            hsum_pair(acc[r][p], v[0], v[1]);
            for (int i = 0; i < 2 && 2 * p + i < NT; ++i)
                out[(2 * p + i) * ldo + r] = with_mins<Unit<T>::has_min>(v[i], rb[r].m, a, 2 * p + i, nc);
        }
}

template <QType T, int RB>
void gemm16_rows(const RowBuf16* rb, const Act& a, int64_t nt, float* out, int64_t ldo) {
    int64_t t = 0;
    for (; t + 4 <= nt; t += 4) gemm16_block<T, RB, 4>(rb, a.at(t), out + t * ldo, ldo);
    switch (nt - t) {
        case 1: return gemm16_block<T, RB, 1>(rb, a.at(t), out + t * ldo, ldo);
        case 2: return gemm16_block<T, RB, 2>(rb, a.at(t), out + t * ldo, ldo);
        case 3: return gemm16_block<T, RB, 3>(rb, a.at(t), out + t * ldo, ldo);
        default: return;
    }
}

// out[t * ldo + r] = dot(row r, token t), r < nr (rows at w + r * stride), t < nt.
template <QType T, int RB>
void gemm_q16(const uint8_t* w, int64_t stride, int64_t nr, int64_t nkb, const Act& a, int64_t nt,
              float* out, int64_t ldo, const Grids& g) {
    if (nt <= 4) {
        for_row_pairs(w, stride, nr, out, [&](const uint8_t* const* rows, float* const* o, auto R) {
            dot_stream16_any<T, decltype(R)::value>(rows, nkb, a, nt, o, ldo, g);
        });
        return;
    }
    thread_local RowBuf16 bufs[RB];
    const int64_t n = nkb * 32;
    for (auto& b : bufs) b.size(n);
    int64_t r = 0;
    for (; r + RB <= nr; r += RB) {
        for (int i = 0; i < RB; ++i) decode_q16_row<T>(w + (r + i) * stride, nkb, bufs[i], g);
        gemm16_rows<T, RB>(bufs, a, nt, out + r, ldo);
    }
    for (; r < nr; ++r) {
        decode_q16_row<T>(w + r * stride, nkb, bufs[0], g);
        gemm16_rows<T, 1>(bufs, a, nt, out + r, ldo);
    }
}

template <QType T, int RB>
void dot_row_q16(const uint8_t* row, int64_t nkb, const Act& a, int nt, float* out, int64_t ldo,
                 const Grids& g) {
    gemm_q16<T, RB>(row, 0, 1, nkb, a, nt, out, ldo, g);
}

// The int16 kernels of the wide types; the rest keep what `k` holds (call after fill_q8).
template <int RB>
void fill_q16(IsaKernels& k) {
    k.quantize_act16 = quantize_q16;
#define FT_X(NAME, BE, BB)                                                          \
    if constexpr (kWide<QType::NAME>) {                                             \
        TypeKernels& t = k.types[int(QType::NAME)];                                 \
        t.dot_row = dot_row_q16<QType::NAME, RB>;                                   \
        t.dot_row2 = nullptr;                                                       \
        t.gemm = gemm_q16<QType::NAME, RB>;                                         \
        t.q8x_from = 0;                                                             \
        t.accumulation = "q16";                                                     \
        t.reads = kReadsQ16;                                                        \
    }
    FT_QUANT_TYPES(FT_X)
#undef FT_X
}

}  // namespace ft::cpu::avx2
