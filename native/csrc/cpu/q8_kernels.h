// Int8-activation kernels (ggml's CPU scheme) for every type with a Unit (units_avx2.h).
//
// Activations are rounded once per call to int8 per 32 features: d = max|x| / 127, q = round(x / d)
// (float32 arithmetic, ties to even: native.numerics.q8_round bit for bit), plus d * (sum of q) per
// 16 features for the additive mins. Weights are decoded to int8 by the Units; the products of one
// 32-weight group are summed exactly in int32 (per 16 weights, so per-16 scales apply), then scaled
// by weight scale * d in float32 and accumulated. Types with one scale per 32 over 256-weight
// blocks (Unit::block_scales: Q4_K, Q5_K, IQ3_S, IQ4_XS) gather a block's 8 group sums into one
// vector first and take the float steps, mins included, once per block (block_fma). Weights with
// a sign multiply as |w| * (x with w's sign) (or, where the Unit keeps magnitude and sign bits
// apart, magnitude * signed x), so both the AVX2 (maddubs: unsigned x signed bytes) and the VNNI
// (dpbusd) products are exact: |w| <= 128, |x| <= 127.
//
// Included by kernels_avx2.cpp (Dot = maddubs + madd) and kernels_avx512.cpp (Dot = dpbusd on
// 256-bit vectors, AVX512-VNNI + VL; the block form's decode streams take two groups per 512-bit
// dpbusd; the many-token path of the block types runs 512-bit on group-interleaved blocks,
// gemm_q8x); each instantiates fill_q8<Dot, ...> for its table. The group sums are exact integers
// however they are formed, so only the float steps fix a token's bits.
//
// Two shapes of work:
//   * few tokens (decode, nt <= 4): rows stream through the Unit decoder, two rows at a time
//     (rows r and r + h: two sequential streams, which hardware prefetch follows better than
//     adjacent rows) sharing each activation load;
//   * many tokens (prefill, grouped experts): RB rows are decoded once into int8 + scale buffers
//     (L1-sized), then a register-blocked RB x 4-token micro-kernel runs over all the tokens (on
//     AVX-512, block types: row pairs against Act::q8x, whose layout needs no horizontal sums).
// Both do a token's arithmetic in the same order, so its result does not depend on the other
// tokens of the call (decode_many's batch equals each sequence alone, bit for bit).
#pragma once
#include <algorithm>
#include <new>
#include <type_traits>
#include <utility>

#include "units_avx2.h"

namespace ft::cpu::avx2 {

template <QType T, class = void> struct HasUnit : std::false_type {};
template <QType T> struct HasUnit<T, std::void_t<decltype(Unit<T>::has_min)>> : std::true_type {};

inline float hsum_ps(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
inline int hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

// ---- activations ----------------------------------------------------------------------------------
// 32 floats from p into v[4]; returns their largest magnitude (the per-32 scale's numerator of the
// int8 and int16 activations alike).
inline float load_amax32(const float* p, __m256 v[4]) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(p + 8 * i);
    __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], abs_mask), _mm256_and_ps(v[1], abs_mask)),
                              _mm256_max_ps(_mm256_and_ps(v[2], abs_mask), _mm256_and_ps(v[3], abs_mask)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    return _mm_cvtss_f32(m4);
}

inline void quantize_q8(const float* x, int64_t ldx, int64_t t0, int64_t t1, int64_t n, int8_t* q,
                        float* d, float* m16) {
    const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t t = t0; t < t1; ++t) {
        const float* xt = x + t * ldx;
        for (int64_t c = 0; c < n / 32; ++c) {
            __m256 v[4];
            const float dd = load_amax32(xt + 32 * c, v) / 127.f;  // q8_round: d = amax / 127, x * (1 / d)
            const __m256 id = _mm256_set1_ps(dd > 0.f ? 1.f / dd : 0.f);
            __m256i iv[4];
            for (int i = 0; i < 4; ++i) iv[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], id));
            const int s0 = hsum_epi32(_mm256_add_epi32(iv[0], iv[1]));
            const int s1 = hsum_epi32(_mm256_add_epi32(iv[2], iv[3]));
            // packs interleave 128-bit lanes; the permute restores feature order
            const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(iv[0], iv[1]), _mm256_packs_epi32(iv[2], iv[3]));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + t * n + 32 * c), _mm256_permutevar8x32_epi32(p, perm));
            d[t * (n / 32) + c] = dd;
            m16[t * (n / 16) + 2 * c] = dd * float(s0);
            m16[t * (n / 16) + 2 * c + 1] = dd * float(s1);
        }
    }
}

// ---- products --------------------------------------------------------------------------------------
// w: int8 weights as decoded; unsigned (Unit::has_min: every such type's q is >= 0) or signed.
// Returns 8 int32: lanes 0-3 sum weights 0-15, lanes 4-7 weights 16-31.
// The AVX2 product: 32 u8 x s8 products -> 8 int32 (4 per 16 weights); no pair exceeds int16
struct DotAvx2 {
    static constexpr bool kBiasedX = false;  // (x + 128) * w pairs would saturate maddubs' int16
    static __m256i dot_acc(__m256i, __m256i, __m256i) { return _mm256_setzero_si256(); }
    static __m256i dot(__m256i u, __m256i s) {
        return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
    }
};

#ifdef __AVX512VNNI__
struct DotVnni {  // 32 u8 x s8 products -> 8 int32 (4 per 16 weights), exact
    static constexpr bool kBiasedX = true;  // kBiased below: signed weights in one dpbusd
    static __m256i dot(__m256i u, __m256i s) { return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s); }
    static __m256i dot_acc(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
};
#endif

template <class Dot, bool kUnsigned>
inline __m256i idot(__m256i w, __m256i x) {
    if constexpr (kUnsigned) return Dot::dot(w, x);
    return Dot::dot(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
}
// scale vector of one 32-weight group: s0 for lanes 0-3, s1 for 4-7
inline __m256 scale_pair(float s0, float s1) {
    return _mm256_set_m128(_mm_set1_ps(s1), _mm_set1_ps(s0));
}

// The additive mins of a row against a token: sum over 16-weight groups i of m[i] * m16[i]
// (m16 = d * sum of q per 16), 8 lanes then the tail; both paths below use it, so a token's
// result does not depend on how many tokens its call has. (Per group and token, scalar, the
// mins cost as much as the integer products of Q4_K / Q5_K.)
inline float dot_mins(const float* m, const float* m16, int64_t ns) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= ns; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(m + i), _mm256_loadu_ps(m16 + i), acc);
    float sum = hsum_ps(acc);
    for (; i < ns; ++i) sum += m[i] * m16[i];
    return sum;
}
struct MinBuf {  // one streamed row's mins [n/16] (a plain array, as RowBuf below)
    float* p = nullptr;
    int64_t cap = 0;
    float* size(int64_t n) {
        if (n > cap) delete[] p, p = new float[n], cap = n;
        return p;
    }
    MinBuf() = default;
    MinBuf(const MinBuf&) = delete;
    MinBuf& operator=(const MinBuf&) = delete;
    ~MinBuf() { delete[] p; }
};

// ---- block form ------------------------------------------------------------------------------------
// Types whose Unit has block_scales (one scale per 32 weights, 256-weight kernel blocks) take
// their float steps once per block instead of once per 32 weights: the 8 integer group sums P
// of a block are gathered into one vector (lane g = group g; |P| <= 32 * 128 * 127 < 2^20, so
// int32 and its float are exact), then acc += float(P) * (S * d8) and, for the mins, acc += M *
// m16 per 16. Both shapes call block_fma with the same integers, so a token's bits do not depend
// on the shape.
template <class U, class = void> struct HasBlock : std::false_type {};
template <class U> struct HasBlock<U, std::void_t<decltype((void)&U::block_scales)>> : std::true_type {};
// Units with unsigned magnitudes and separate sign bits (IQ3_S): the decode path signs the
// activations instead of the weights (one op on AVX-512, and the magnitudes need no |w|).
template <class U, class = void> struct HasSigns : std::false_type {};
template <class U> struct HasSigns<U, std::void_t<decltype((void)&U::signs)>> : std::true_type {};

// Units whose decode streams read unsigned codes c with w = 2c - kCodeOffset (IQ3_S_N4): a
// group's exact sum is 2 * (c . x) - kCodeOffset * (sum of x), x's sums taken once per token for
// all the rows streamed with it.
template <class U, class = void> struct HasCodes : std::false_type {};
template <class U> struct HasCodes<U, std::void_t<decltype(U::kCodeOffset)>> : std::true_type {};
// 2 * p - k * xs, lane by lane (the group sums of a code Unit)
inline __m256i code_sums(__m256i p, __m256i xs, int k) {
    return _mm256_sub_epi32(_mm256_add_epi32(p, p), _mm256_mullo_epi32(xs, _mm256_set1_epi32(k)));
}

template <class F, int... I>
[[gnu::always_inline]] inline void static_for_(F&& f, std::integer_sequence<int, I...>) {
    (f(std::integral_constant<int, I>{}), ...);
}
template <int N, class F> [[gnu::always_inline]] inline void static_for(F&& f) {
    static_for_(f, std::make_integer_sequence<int, N>{});
}

// x negated where bit j of `bits` is set (|x| <= 127, so -x is exact)
inline __m256i sign_x(__m256i x, uint32_t bits) {
#ifdef __AVX512BW__
    return _mm256_mask_sub_epi8(x, __mmask32(bits), _mm256_setzero_si256(), x);
#else
    return _mm256_sign_epi8(x, _mm256_or_si256(bits_to_bytes(bits), _mm256_set1_epi8(1)));
#endif
}

// Sums the 8 lanes of each of 8 vectors added in order (add<0> .. add<7>): lane g of get() is
// vector g's sum. Pairs are folded as they come, so at most three partial vectors are live.
struct Sum8 {
    __m256i e, p, q0, q1;
    template <int S> [[gnu::always_inline]] void add(__m256i v) {
        if constexpr (S % 2 == 0) e = v;
        else if constexpr (S % 4 == 1) p = _mm256_hadd_epi32(e, v);
        else if constexpr (S == 3) q0 = _mm256_hadd_epi32(p, _mm256_hadd_epi32(e, v));
        else q1 = _mm256_hadd_epi32(p, _mm256_hadd_epi32(e, v));
    }
    // q0 = [g0..g3 over lanes 0-3 | g0..g3 over lanes 4-7], q1 the same for g4..g7
    __m256i get() const {
        return _mm256_add_epi32(_mm256_permute2x128_si256(q0, q1, 0x20), _mm256_permute2x128_si256(q0, q1, 0x31));
    }
};

// One block's float steps for one row and token: s = the row's block_scales, d8 / m16 = the
// token's scales at the block's first group / 16, m = the row's block mins (has_min).
template <bool kMin>
inline __m256 block_fma(__m256 acc, __m256i sums, __m256 s, const float* d8, const __m256* m, const float* m16) {
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(s, _mm256_loadu_ps(d8)), acc);
    if constexpr (kMin) {
        acc = _mm256_fmadd_ps(m[0], _mm256_loadu_ps(m16), acc);
        acc = _mm256_fmadd_ps(m[1], _mm256_loadu_ps(m16 + 8), acc);
    }
    return acc;
}

#ifdef __AVX512VNNI__
// The block form on AVX-512: subs 2k and 2k+1 in one 512-bit vector, one dpbusd per pair. The
// group sums are the same integers, so block_fma gives the 256-bit form's bits.
template <class U, class = void> struct HasPair : std::false_type {};
template <class U> struct HasPair<U, std::void_t<decltype((void)&U::pair)>> : std::true_type {};
template <class U, class = void> struct HasSigns2 : std::false_type {};
template <class U> struct HasSigns2<U, std::void_t<decltype((void)&U::signs2)>> : std::true_type {};

inline __m512i join(__m256i lo, __m256i hi) { return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1); }

// weights of subs 2k and 2k+1 (HasSigns: their magnitudes) and, for HasSigns, their sign bits
template <class U>
inline __m512i decode_pair(const uint8_t* blk, int k, const Grids& g, const typename U::State& st, uint64_t& sg) {
    if constexpr (HasSigns<U>::value) {
        if constexpr (HasSigns2<U>::value) {
            sg = U::signs2(blk, k);
            return U::magnitude2(blk, k, g, st);
        } else {
            sg = U::signs(blk, 2 * k) | uint64_t(U::signs(blk, 2 * k + 1)) << 32;
            return join(U::magnitude(blk, 2 * k, g, st), U::magnitude(blk, 2 * k + 1, g, st));
        }
    } else if constexpr (HasPair<U>::value) {
        return U::pair(blk, k, g, st);
    } else {
        Sub u0, u1;
        U::decode(blk, 2 * k, g, st, u0);
        U::decode(blk, 2 * k + 1, g, st, u1);
        return join(u0.q, u1.q);
    }
}
inline __m512i dot512(__m512i u, __m512i s) { return _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, s); }
inline __m512i neg_where(__m512i x, __mmask64 m) { return _mm512_mask_sub_epi8(x, m, _mm512_setzero_si512(), x); }

// Sum8 for pairs: add<0..3>(z_k), z_k = [sums of sub 2k (8 lanes) | sub 2k+1]; lane g of get() is
// sub g's total.
struct Sum8x2 {
    __m512i a, z;
    template <int K> [[gnu::always_inline]] void add(__m512i v) {
        if constexpr (K % 2 == 0) {
            z = v;
        } else {  // per 128-bit lane: [z e0+e2, v e0+e2, z e1+e3, v e1+e3]
            const __m512i h = _mm512_add_epi32(_mm512_unpacklo_epi32(z, v), _mm512_unpackhi_epi32(z, v));
            if constexpr (K == 1) a = h;
            else a = _mm512_add_epi32(_mm512_unpacklo_epi64(a, h), _mm512_unpackhi_epi64(a, h));
        }
    }
    // a: per 128-bit lane L, the 4 vectors' lane-L sums; lanes 0+1 hold subs 0 2 4 6, 2+3 subs 1 3 5 7
    __m256i get() const {
        const __m512i v = _mm512_add_epi32(a, _mm512_shuffle_i32x4(a, a, _MM_SHUFFLE(2, 3, 0, 1)));
        const __m512i order = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 0, 0, 0, 0, 0, 0, 0, 0);
        return _mm512_castsi512_si256(_mm512_permutexvar_epi32(order, v));
    }
};

template <QType T, int R, int NT>
void dot_stream_block512(const uint8_t* const* rows, int64_t nkb, const Act& a, float* const* out, int64_t ldo,
                         const Grids& g) {
    using Tr = Traits<T>;
    using U = Unit<T>;
    __m256 acc[R][NT];
    for (int r = 0; r < R; ++r)
        for (int t = 0; t < NT; ++t) acc[r][t] = _mm256_setzero_ps();
    const int64_t nd = a.n / 32, ns = a.n / 16;
    for (int64_t b = 0; b < nkb; ++b) {
        typename U::State st[R];
        const uint8_t* blk[R];
        for (int r = 0; r < R; ++r) blk[r] = rows[r] + b * Tr::kb_bytes, U::begin(blk[r], g, st[r]);
        Sum8x2 sum[R][NT], xsum[NT];
        static_for<4>([&](auto K) {
            constexpr int k = K;
            __m512i w[R];
            uint64_t sg[R];
            for (int r = 0; r < R; ++r) {
                if constexpr (HasCodes<U>::value) w[r] = U::codes2(blk[r], k);
                else w[r] = decode_pair<U>(blk[r], k, g, st[r], sg[r]);
            }
            for (int t = 0; t < NT; ++t) {
                const __m512i x = _mm512_loadu_si512(a.q8 + t * a.n + 256 * b + 64 * k);
                if constexpr (HasCodes<U>::value) xsum[t].template add<k>(dot512(_mm512_set1_epi8(1), x));
                for (int r = 0; r < R; ++r) {
                    __m512i z;
                    if constexpr (HasCodes<U>::value) z = dot512(w[r], x);
                    else if constexpr (HasSigns<U>::value) z = dot512(w[r], neg_where(x, sg[r]));
                    else if constexpr (U::has_min) z = dot512(w[r], x);
                    else z = dot512(_mm512_abs_epi8(w[r]), neg_where(x, _mm512_movepi8_mask(w[r])));
                    sum[r][t].template add<k>(z);
                }
            }
        });
        __m256i xs[NT];
        if constexpr (HasCodes<U>::value)
            for (int t = 0; t < NT; ++t) xs[t] = xsum[t].get();
        for (int r = 0; r < R; ++r) {
            const __m256 sc = U::block_scales(st[r]);
            __m256 m[2];
            if constexpr (U::has_min) U::block_mins(st[r], m);
            for (int t = 0; t < NT; ++t) {
                __m256i p = sum[r][t].get();
                if constexpr (HasCodes<U>::value) p = code_sums(p, xs[t], U::kCodeOffset);
                acc[r][t] = block_fma<U::has_min>(acc[r][t], p, sc, a.d8 + t * nd + 8 * b, m,
                                                  a.m16 + t * ns + 16 * b);
            }
        }
    }
    for (int r = 0; r < R; ++r)
        for (int t = 0; t < NT; ++t) out[r][t * ldo] = hsum_ps(acc[r][t]);
}
#endif

template <class Dot, QType T, int R, int NT>
void dot_stream_block(const uint8_t* const* rows, int64_t nkb, const Act& a, float* const* out, int64_t ldo,
                      const Grids& g) {
    using Tr = Traits<T>;
    using U = Unit<T>;
    static_assert(Tr::subs == 8);
    __m256 acc[R][NT];
    for (int r = 0; r < R; ++r)
        for (int t = 0; t < NT; ++t) acc[r][t] = _mm256_setzero_ps();
    const int64_t nd = a.n / 32, ns = a.n / 16;
    for (int64_t b = 0; b < nkb; ++b) {
        typename U::State st[R];
        const uint8_t* blk[R];
        for (int r = 0; r < R; ++r) blk[r] = rows[r] + b * Tr::kb_bytes, U::begin(blk[r], g, st[r]);
        Sum8 sum[R][NT], xsum[NT];
        static_for<8>([&](auto S) {
            constexpr int s = S;
            const int64_t c = b * 8 + s;
            __m256i w[R];
            uint32_t sg[R];
            for (int r = 0; r < R; ++r) {
                if constexpr (HasCodes<U>::value) {
                    w[r] = U::codes(blk[r], s);
                } else if constexpr (HasSigns<U>::value) {
                    w[r] = U::magnitude(blk[r], s, g, st[r]);
                    sg[r] = U::signs(blk[r], s);
                } else {
                    Sub u;
                    U::decode(blk[r], s, g, st[r], u);
                    w[r] = u.q;
                }
            }
            for (int t = 0; t < NT; ++t) {
                const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q8 + t * a.n + 32 * c));
                if constexpr (HasCodes<U>::value) xsum[t].template add<s>(Dot::dot(_mm256_set1_epi8(1), x));
                for (int r = 0; r < R; ++r) {
                    if constexpr (HasCodes<U>::value) sum[r][t].template add<s>(Dot::dot(w[r], x));
                    else if constexpr (HasSigns<U>::value) sum[r][t].template add<s>(Dot::dot(w[r], sign_x(x, sg[r])));
                    else sum[r][t].template add<s>(idot<Dot, U::has_min>(w[r], x));
                }
            }
        });
        __m256i xs[NT];
        if constexpr (HasCodes<U>::value)
            for (int t = 0; t < NT; ++t) xs[t] = xsum[t].get();
        for (int r = 0; r < R; ++r) {
            const __m256 sc = U::block_scales(st[r]);
            __m256 m[2];
            if constexpr (U::has_min) U::block_mins(st[r], m);
            for (int t = 0; t < NT; ++t) {
                __m256i p = sum[r][t].get();
                if constexpr (HasCodes<U>::value) p = code_sums(p, xs[t], U::kCodeOffset);
                acc[r][t] = block_fma<U::has_min>(acc[r][t], p, sc, a.d8 + t * nd + 8 * b, m,
                                                  a.m16 + t * ns + 16 * b);
            }
        }
    }
    for (int r = 0; r < R; ++r)
        for (int t = 0; t < NT; ++t) out[r][t * ldo] = hsum_ps(acc[r][t]);
}

// Units with a column form (Unit::begin_cols: IQ3_S): column j of a block is dword j of every
// group (lane g = group g), as Act::q8x holds the activations, so each group's products stay in
// their own lane and a block needs no horizontal sums.
template <class U, class = void> struct HasCols : std::false_type {};
template <class U> struct HasCols<U, std::void_t<decltype((void)&U::begin_cols)>> : std::true_type {};

#ifdef __AVX512VNNI__
// The column form on AVX-512: two rows in one 512-bit vector (lanes 0-7 row a's groups, 8-15 row
// b's), column j of both from one 16-index gather, against the token's T_j in both halves with
// the weights' signs applied by mask; one dpbusd per column leaves each group's exact sum in its
// lane. The float steps are block_fma's, lane by lane: the bits of dot_stream_block. An odd last
// row goes in both halves (the second is not written out).
template <QType T, int NT>
void dot_stream_cols512(const uint8_t* const* rows, int nrows, int64_t nkb, const Act& a, float* const* out,
                        int64_t ldo, const Grids& g) {
    using Tr = Traits<T>;
    using U = Unit<T>;
    const uint8_t* rb = rows[nrows - 1];
    __m512 acc[NT];
    for (int t = 0; t < NT; ++t) acc[t] = _mm512_setzero_ps();
    const int64_t nd = a.n / 32;
    const __m512i bias = _mm512_set1_epi8(char(0x80)), zero = _mm512_setzero_si512();
    for (int64_t b = 0; b < nkb; ++b) {
        typename U::Cols ca, cb;
        U::begin_cols(rows[0] + b * Tr::kb_bytes, ca);
        U::begin_cols(rb + b * Tr::kb_bytes, cb);
        const __m512i sg = join(ca.sg, cb.sg);
        __m512i p[NT];
        static_for<8>([&](auto J) {
            constexpr int j = J;
            const __m512i w = U::grid_col2(ca, cb, j, g);
            const __mmask64 neg = U::sign_col2(sg, j);
            for (int t = 0; t < NT; ++t) {
                const __m512i x = _mm512_xor_si512(bias, _mm512_broadcast_i64x4(_mm256_loadu_si256(
                    reinterpret_cast<const __m256i*>(a.q8x + t * a.n + 256 * b + 32 * j))));  // q8x is q8 + 128
                p[t] = _mm512_dpbusd_epi32(j ? p[t] : zero, w, _mm512_mask_sub_epi8(x, neg, zero, x));
            }
        });
        const __m512 s = _mm512_castpd_ps(_mm512_insertf64x4(
            _mm512_castps_pd(_mm512_castps256_ps512(_mm256_load_ps(ca.s))), _mm256_castps_pd(_mm256_load_ps(cb.s)), 1));
        for (int t = 0; t < NT; ++t) {
            const __m512 d = _mm512_broadcast_f32x8(_mm256_loadu_ps(a.d8 + t * nd + 8 * b));
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p[t]), _mm512_mul_ps(s, d), acc[t]);
        }
    }
    for (int t = 0; t < NT; ++t) {
        out[0][t * ldo] = hsum_ps(_mm512_castps512_ps256(acc[t]));
        if (nrows == 2)
            out[1][t * ldo] = hsum_ps(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[t]), 1)));
    }
}
#else
// The block form on AVX2 for the column-form Units, over Act::q8x: maddubs per column, the 8
// columns added in int16 (each lane: 16 products, |sum| <= 16 * kGridMax * 127 < 2^15), one madd
// per block. Same group sums, same block_fma: the bits of dot_stream_block.
template <QType T, int R, int NT>
void dot_stream_cols(const uint8_t* const* rows, int64_t nkb, const Act& a, float* const* out, int64_t ldo,
                     const Grids& g) {
    using Tr = Traits<T>;
    using U = Unit<T>;
    static_assert(16 * U::kGridMax * 127 < 32768);
    __m256 acc[R][NT];
    for (int r = 0; r < R; ++r)
        for (int t = 0; t < NT; ++t) acc[r][t] = _mm256_setzero_ps();
    const int64_t nd = a.n / 32;
    for (int64_t b = 0; b < nkb; ++b) {
        typename U::Cols st[R];
        for (int r = 0; r < R; ++r) U::begin_cols(rows[r] + b * Tr::kb_bytes, st[r]);
        __m256i p[R][NT];
        static_for<8>([&](auto J) {
            constexpr int j = J;
            __m256i w[R], sg[R];
            for (int r = 0; r < R; ++r) w[r] = U::grid_col(st[r], j, g), sg[r] = U::sign_col(st[r], j);
            for (int t = 0; t < NT; ++t) {
                const __m256i xb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q8x + t * a.n + 256 * b + 32 * j));
                const __m256i x = _mm256_xor_si256(xb, _mm256_set1_epi8(char(0x80)));  // q8x is q8 + 128
                for (int r = 0; r < R; ++r) {
                    const __m256i d = _mm256_maddubs_epi16(w[r], _mm256_sign_epi8(x, sg[r]));
                    p[r][t] = j ? _mm256_add_epi16(p[r][t], d) : d;
                }
            }
        });
        for (int r = 0; r < R; ++r) {
            const __m256 sc = _mm256_load_ps(st[r].s);
            for (int t = 0; t < NT; ++t)
                acc[r][t] = block_fma<false>(acc[r][t], _mm256_madd_epi16(p[r][t], _mm256_set1_epi16(1)), sc,
                                             a.d8 + t * nd + 8 * b, nullptr, nullptr);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int t = 0; t < NT; ++t) out[r][t * ldo] = hsum_ps(acc[r][t]);
}

#endif

// gemm_q8's decode shape: rows r and r + nr/2 as two sequential streams, then an odd last row
// alone; f(rows, outs, R) with R = std::integral_constant<int, 2 or 1>
template <class F>
void for_row_pairs(const uint8_t* w, int64_t stride, int64_t nr, float* out, F&& f) {
    const int64_t h = nr / 2;
    for (int64_t r = 0; r < h; ++r) {
        const uint8_t* rows[2] = {w + r * stride, w + (r + h) * stride};
        float* o[2] = {out + r, out + r + h};
        f(rows, o, std::integral_constant<int, 2>{});
    }
    if (nr % 2) {
        const uint8_t* rows[1] = {w + (nr - 1) * stride};
        float* o[1] = {out + nr - 1};
        f(rows, o, std::integral_constant<int, 1>{});
    }
}

// The decode shape of the column form with the token count dispatched once per call, not per row
// pair as dot_stream_any does (a 512-wide row is only two blocks, so per-pair overhead shows)
template <QType T, int NT>
void gemm_cols(const uint8_t* w, int64_t stride, int64_t nr, int64_t nkb, const Act& a, float* out, int64_t ldo,
               const Grids& g) {
    for_row_pairs(w, stride, nr, out, [&](const uint8_t* const* rows, float* const* o, auto R) {
#ifdef __AVX512VNNI__
        dot_stream_cols512<T, NT>(rows, decltype(R)::value, nkb, a, o, ldo, g);
#else
        dot_stream_cols<T, decltype(R)::value, NT>(rows, nkb, a, o, ldo, g);
#endif
    });
}

#ifndef __AVX512VNNI__
// Act::q8x on AVX2 (the decode path of dot_stream_cols): as interleave_q8 below, per block T_j =
// dword j of each group (an 8 x 8 dword transpose), plus 128
inline void interleave_q8_avx2(const int8_t* q8, int64_t t0, int64_t t1, int64_t n, uint8_t* q8x) {
    const __m256i bias = _mm256_set1_epi8(char(0x80));
    for (int64_t i = t0 * n; i < t1 * n; i += 256) {
        __m256i v[8], u[8];
        for (int k = 0; k < 8; ++k) v[k] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q8 + i + 32 * k));
        for (int k = 0; k < 8; k += 2) {  // u[k] / u[k+1]: dwords 0,1 / 2,3 (lane 1: 4,5 / 6,7) of v[k], v[k+1]
            u[k] = _mm256_unpacklo_epi32(v[k], v[k + 1]);
            u[k + 1] = _mm256_unpackhi_epi32(v[k], v[k + 1]);
        }
        for (int k = 0; k < 8; k += 4) {  // v[k + d]: dword d (lane 1: d + 4) of groups k..k+3
            v[k] = _mm256_unpacklo_epi64(u[k], u[k + 2]);
            v[k + 1] = _mm256_unpackhi_epi64(u[k], u[k + 2]);
            v[k + 2] = _mm256_unpacklo_epi64(u[k + 1], u[k + 3]);
            v[k + 3] = _mm256_unpackhi_epi64(u[k + 1], u[k + 3]);
        }
        for (int d = 0; d < 4; ++d) {
            const __m256i lo = _mm256_permute2x128_si256(v[d], v[4 + d], 0x20);  // T_d
            const __m256i hi = _mm256_permute2x128_si256(v[d], v[4 + d], 0x31);  // T_(d+4)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(q8x + i + 32 * d), _mm256_xor_si256(lo, bias));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(q8x + i + 32 * (d + 4)), _mm256_xor_si256(hi, bias));
        }
    }
}
#endif

// ---- few tokens: stream R rows through the decoder ------------------------------------------------------
template <class Dot, QType T, int R, int NT>
void dot_stream(const uint8_t* const* rows, int64_t nkb, const Act& a, float* const* out, int64_t ldo,
                const Grids& g) {
    using Tr = Traits<T>;
    using U = Unit<T>;
    __m256 acc[R][NT];
    for (int r = 0; r < R; ++r)
        for (int t = 0; t < NT; ++t) acc[r][t] = _mm256_setzero_ps();
    const int64_t nd = a.n / 32, ns = a.n / 16;
    thread_local MinBuf mbuf[2];
    float* mins[R];
    if constexpr (U::has_min)
        for (int r = 0; r < R; ++r) mins[r] = mbuf[r].size(ns);
    for (int64_t b = 0; b < nkb; ++b) {
        typename U::State st[R];
        for (int r = 0; r < R; ++r) U::begin(rows[r] + b * Tr::kb_bytes, g, st[r]);
        for (int s = 0; s < Tr::subs; ++s) {
            const int64_t c = b * Tr::subs + s;
            Sub u[R];
            for (int r = 0; r < R; ++r) U::decode(rows[r] + b * Tr::kb_bytes, s, g, st[r], u[r]);
            for (int t = 0; t < NT; ++t) {
                const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q8 + t * a.n + 32 * c));
                const float dx = a.d8[t * nd + c];
                for (int r = 0; r < R; ++r) {
                    const __m256 p = _mm256_cvtepi32_ps(idot<Dot, U::has_min>(u[r].q, x));
                    const __m256 sc = U::per16 ? scale_pair(u[r].s[0] * dx, u[r].s[1] * dx)
                                               : _mm256_set1_ps(u[r].s[0] * dx);
                    acc[r][t] = _mm256_fmadd_ps(p, sc, acc[r][t]);
                }
            }
            if constexpr (U::has_min)
                for (int r = 0; r < R; ++r) mins[r][2 * c] = u[r].m[0], mins[r][2 * c + 1] = u[r].m[1];
        }
    }
    for (int r = 0; r < R; ++r)
        for (int t = 0; t < NT; ++t) {
            float v = hsum_ps(acc[r][t]);
            if constexpr (U::has_min) v += dot_mins(mins[r], a.m16 + t * ns, ns);
            out[r][t * ldo] = v;
        }
}

template <class Dot, QType T, int R, int NT>
void dot_stream_of(const uint8_t* const* rows, int64_t nkb, const Act& a, float* const* out, int64_t ldo,
                   const Grids& g) {
#ifdef __AVX512VNNI__
    if constexpr (HasBlock<Unit<T>>::value) dot_stream_block512<T, R, NT>(rows, nkb, a, out, ldo, g);
#else
    if constexpr (HasBlock<Unit<T>>::value) dot_stream_block<Dot, T, R, NT>(rows, nkb, a, out, ldo, g);
#endif
    else dot_stream<Dot, T, R, NT>(rows, nkb, a, out, ldo, g);
}

template <class Dot, QType T, int R>
void dot_stream_any(const uint8_t* const* rows, int64_t nkb, const Act& a, int64_t nt, float* const* out,
                    int64_t ldo, const Grids& g) {
    for (int64_t t = 0; t < nt;) {
        const int n = int(std::min<int64_t>(4, nt - t));
        float* o[R];
        for (int r = 0; r < R; ++r) o[r] = out[r] + t * ldo;
        const Act at = a.at(t);
        switch (n) {
            case 1: dot_stream_of<Dot, T, R, 1>(rows, nkb, at, o, ldo, g); break;
            case 2: dot_stream_of<Dot, T, R, 2>(rows, nkb, at, o, ldo, g); break;
            case 3: dot_stream_of<Dot, T, R, 3>(rows, nkb, at, o, ldo, g); break;
            default: dot_stream_of<Dot, T, R, 4>(rows, nkb, at, o, ldo, g); break;
        }
        t += n;
    }
}

// ---- many tokens: decode RB rows once, then an RB x NT register block over the tokens -----------------
// One decoded row. Plain arrays, no std::vector: a library template instantiated here would be
// compiled with this file's ISA flags, and the linker may keep that copy for every file.
struct RowBuf {
    int8_t* q = nullptr;   // [n]
    float* s = nullptr;    // [n/32][8]: the scale vector of each 32-weight group
    float* m = nullptr;    // [n/16]: the additive min of each 16 (types with mins)
    int32_t* c = nullptr;  // [n/32][8]: -128 * (sum of each 4 weights), for Dot::kBiasedX
    int64_t cap = 0;
    void size(int64_t n) {
        if (n <= cap) return;
        release();
        q = new int8_t[n], s = new float[n / 4], m = new float[n / 16], c = new int32_t[n / 4];
        cap = n;
    }
    void release() {
        delete[] q, delete[] s, delete[] m, delete[] c;
        q = nullptr, s = nullptr, m = nullptr, c = nullptr, cap = 0;
    }
    RowBuf() = default;
    RowBuf(const RowBuf&) = delete;
    RowBuf& operator=(const RowBuf&) = delete;
    ~RowBuf() { release(); }
};

template <QType T, bool kBias = false>
void decode_q8_row(const uint8_t* row, int64_t nkb, RowBuf& rb, const Grids& g) {
    using Tr = Traits<T>;
    using U = Unit<T>;
    const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < nkb; ++b) {
        typename U::State st;
        U::begin(row + b * Tr::kb_bytes, g, st);
        for (int s = 0; s < Tr::subs; ++s) {
            const int64_t c = b * Tr::subs + s;
            Sub u;
            U::decode(row + b * Tr::kb_bytes, s, g, st, u);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(rb.q + 32 * c), u.q);
            _mm256_storeu_ps(rb.s + 8 * c, U::per16 ? scale_pair(u.s[0], u.s[1]) : _mm256_set1_ps(u.s[0]));
            if constexpr (kBias) {  // sums of 4 weights (exact in int16), times -128
                const __m256i s4 = _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, u.q), ones16);
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(rb.c + 8 * c),
                                    _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(s4, 7)));
            }
            if constexpr (!HasBlock<U>::value && U::has_min) rb.m[2 * c] = u.m[0], rb.m[2 * c + 1] = u.m[1];
        }
        if constexpr (HasBlock<U>::value) {  // s: [nkb][8] block scales; m: [nkb][16] mins per 16
            _mm256_storeu_ps(rb.s + 8 * b, U::block_scales(st));
            if constexpr (U::has_min) {
                __m256 m[2];
                U::block_mins(st, m);
                _mm256_storeu_ps(rb.m + 16 * b, m[0]), _mm256_storeu_ps(rb.m + 16 * b + 8, m[1]);
            }
        }
    }
}

// Signed weights with a Dot that takes an accumulator (VNNI: Dot::kBiasedX): x + 128 is unsigned,
// and dpbusd(-128 * sums of 4 weights, x + 128, w) = the exact sum of x * w in one instruction,
// where maddubs needs |w| and x with w's sign (two more per row and token). The same integers.
template <class Dot, class U> constexpr bool kBiased = Dot::kBiasedX && !U::has_min;

// gemm_block of a type with block_scales: dot_stream_block's integers and block_fma, rows taken
// kPass at a time so that their partial sums stay in registers.
template <class Dot, QType T, int RB, int NT>
void gemm_block_block(const RowBuf* rb, const Act& a, float* out, int64_t ldo) {
    using U = Unit<T>;
    constexpr bool biased = kBiased<Dot, U>;
#ifdef __AVX512F__
    constexpr int kPass = RB % 2 ? 1 : 2;  // 32 vector registers
#else
    constexpr int kPass = 1;
#endif
    const int64_t nkb = a.n / 256, nd = a.n / 32, ns = a.n / 16;
    __m256 acc[RB][NT];
    for (int r = 0; r < RB; ++r)
        for (int t = 0; t < NT; ++t) acc[r][t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nkb; ++b) {
        for (int r0 = 0; r0 < RB; r0 += kPass) {
            Sum8 sum[kPass][NT];
            static_for<8>([&](auto S) {
                constexpr int s = S;
                const int64_t c = b * 8 + s;
                __m256i x[NT];
                for (int t = 0; t < NT; ++t) {
                    x[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q8 + t * a.n + 32 * c));
                    if constexpr (biased) x[t] = _mm256_xor_si256(x[t], _mm256_set1_epi8(char(0x80)));  // x + 128
                }
                for (int i = 0; i < kPass; ++i) {
                    const RowBuf& w = rb[r0 + i];
                    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.q + 32 * c));
                    for (int t = 0; t < NT; ++t) {
                        if constexpr (biased) {
                            const __m256i cw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.c + 8 * c));
                            sum[i][t].template add<s>(Dot::dot_acc(cw, x[t], q));
                        } else {
                            sum[i][t].template add<s>(idot<Dot, U::has_min>(q, x[t]));
                        }
                    }
                }
            });
            for (int i = 0; i < kPass; ++i) {
                const RowBuf& w = rb[r0 + i];
                const __m256 sc = _mm256_loadu_ps(w.s + 8 * b);
                __m256 m[2];
                if constexpr (U::has_min) m[0] = _mm256_loadu_ps(w.m + 16 * b), m[1] = _mm256_loadu_ps(w.m + 16 * b + 8);
                for (int t = 0; t < NT; ++t)
                    acc[r0 + i][t] = block_fma<U::has_min>(acc[r0 + i][t], sum[i][t].get(), sc, a.d8 + t * nd + 8 * b,
                                                           m, a.m16 + t * ns + 16 * b);
            }
        }
    }
    for (int r = 0; r < RB; ++r)
        for (int t = 0; t < NT; ++t) out[t * ldo + r] = hsum_ps(acc[r][t]);
}

template <class Dot, QType T, int RB, int NT>
void gemm_block(const RowBuf* rb, const Act& a, float* out, int64_t ldo) {
    using U = Unit<T>;
    constexpr bool biased = kBiased<Dot, U>;
    const int64_t nc = a.n / 32, ns = a.n / 16;
    __m256 acc[RB][NT];
    for (int r = 0; r < RB; ++r)
        for (int t = 0; t < NT; ++t) acc[r][t] = _mm256_setzero_ps();
    for (int64_t c = 0; c < nc; ++c) {
        __m256i x[NT];
        __m256 dx[NT];
        for (int t = 0; t < NT; ++t) {
            x[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q8 + t * a.n + 32 * c));
            if constexpr (biased) x[t] = _mm256_xor_si256(x[t], _mm256_set1_epi8(char(0x80)));  // x + 128
            dx[t] = _mm256_broadcast_ss(a.d8 + t * nc + c);
        }
        for (int r = 0; r < RB; ++r) {
            const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rb[r].q + 32 * c));
            const __m256 sw = _mm256_loadu_ps(rb[r].s + 8 * c);
            if constexpr (biased) {
                const __m256i cw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rb[r].c + 8 * c));
                for (int t = 0; t < NT; ++t)
                    acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(Dot::dot_acc(cw, x[t], w)),
                                                _mm256_mul_ps(sw, dx[t]), acc[r][t]);
            } else {
                for (int t = 0; t < NT; ++t)
                    acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(idot<Dot, U::has_min>(w, x[t])),
                                                _mm256_mul_ps(sw, dx[t]), acc[r][t]);
            }
        }
    }
    for (int r = 0; r < RB; ++r)
        for (int t = 0; t < NT; ++t) {
            float v = hsum_ps(acc[r][t]);
            if constexpr (U::has_min) v += dot_mins(rb[r].m, a.m16 + t * ns, ns);  // dot_stream's order
            out[t * ldo + r] = v;
        }
}

template <class Dot, QType T, int RB, int NT>
void gemm_block_of(const RowBuf* rb, const Act& a, float* out, int64_t ldo) {
    if constexpr (HasBlock<Unit<T>>::value) gemm_block_block<Dot, T, RB, NT>(rb, a, out, ldo);
    else gemm_block<Dot, T, RB, NT>(rb, a, out, ldo);
}

template <class Dot, QType T, int RB>
void gemm_rows(const RowBuf* rb, const Act& a, int64_t nt, float* out, int64_t ldo) {
    int64_t t = 0;
    for (; t + 4 <= nt; t += 4) gemm_block_of<Dot, T, RB, 4>(rb, a.at(t), out + t * ldo, ldo);
    switch (nt - t) {
        case 1: return gemm_block_of<Dot, T, RB, 1>(rb, a.at(t), out + t * ldo, ldo);
        case 2: return gemm_block_of<Dot, T, RB, 2>(rb, a.at(t), out + t * ldo, ldo);
        case 3: return gemm_block_of<Dot, T, RB, 3>(rb, a.at(t), out + t * ldo, ldo);
        default: return;
    }
}

#ifdef __AVX512VNNI__
// ---- many tokens on AVX-512: group-interleaved blocks ------------------------------------------------
// The block form wants lane g = group g's sum. With a block's 256 bytes stored as 8 vectors T_j
// whose dword lane g holds bytes 4j..4j+3 of group g (weights and activations alike), dpbusd over
// j accumulates every group in its own lane: no horizontal sums. Two rows share a 512-bit vector
// ([row r | row r+1]) against the token's T_j in both halves, and the float steps run on both at
// once, each lane as block_fma runs it, so a token's bits are the decode path's. The activations
// are the unsigned operand (x + 128) and each row's -128 * (group weight sums) starts the sums.

// v[k] = groups 2k, 2k+1 of a block -> o[i] = [T_2i | T_2i+1]
[[gnu::always_inline]] inline void interleave_groups(const __m512i v[4], __m512i o[4]) {
    alignas(64) static const int32_t i1[2][16] = {{0, 8, 16, 24, 1, 9, 17, 25, 2, 10, 18, 26, 3, 11, 19, 27},
                                                  {4, 12, 20, 28, 5, 13, 21, 29, 6, 14, 22, 30, 7, 15, 23, 31}};
    alignas(64) static const int32_t i2[2][16] = {{0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23},
                                                  {8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31}};
    const __m512i a0 = _mm512_load_si512(i1[0]), a1 = _mm512_load_si512(i1[1]);
    const __m512i b0 = _mm512_load_si512(i2[0]), b1 = _mm512_load_si512(i2[1]);
    // groups 0-3 (u0: dwords 0-3, u1: 4-7) and 4-7 (u2, u3), dword j of group g at lane 4j + g % 4
    const __m512i u0 = _mm512_permutex2var_epi32(v[0], a0, v[1]), u1 = _mm512_permutex2var_epi32(v[0], a1, v[1]);
    const __m512i u2 = _mm512_permutex2var_epi32(v[2], a0, v[3]), u3 = _mm512_permutex2var_epi32(v[2], a1, v[3]);
    o[0] = _mm512_permutex2var_epi32(u0, b0, u2), o[1] = _mm512_permutex2var_epi32(u0, b1, u2);
    o[2] = _mm512_permutex2var_epi32(u1, b0, u3), o[3] = _mm512_permutex2var_epi32(u1, b1, u3);
}

// Act::q8x rows [t0, t1): q8 + 128 (as x ^ 0x80), each block interleaved
inline void interleave_q8(const int8_t* q8, int64_t t0, int64_t t1, int64_t n, uint8_t* q8x) {
    const __m512i bias = _mm512_set1_epi8(char(0x80));
    for (int64_t i = t0 * n; i < t1 * n; i += 256) {
        __m512i v[4], o[4];
        for (int k = 0; k < 4; ++k) v[k] = _mm512_loadu_si512(q8 + i + 64 * k);
        interleave_groups(v, o);
        for (int k = 0; k < 4; ++k) _mm512_storeu_si512(q8x + i + 64 * k, _mm512_xor_si512(o[k], bias));
    }
}

// Two decoded rows (halves h = 0, 1), per block b: q [8 j][2 h][32 bytes] (T_j), s [2 h][8] block
// scales, m [2 halves of 16][2 h][8] mins per 16 (has_min), c [2 h][8] = -128 * group weight sums.
struct PairBuf {
    int8_t* q = nullptr;
    float *s = nullptr, *m = nullptr;
    int32_t* c = nullptr;
    int64_t cap = 0;  // blocks
    void size(int64_t nkb) {
        if (nkb <= cap) return;
        release();
        q = static_cast<int8_t*>(::operator new[](512 * nkb, std::align_val_t(64)));
        s = new float[16 * nkb], m = new float[32 * nkb], c = new int32_t[16 * nkb];
        cap = nkb;
    }
    void release() {
        if (q) ::operator delete[](q, std::align_val_t(64));
        delete[] s, delete[] m, delete[] c;
        q = nullptr, s = nullptr, m = nullptr, c = nullptr, cap = 0;
    }
    PairBuf() = default;
    PairBuf(const PairBuf&) = delete;
    PairBuf& operator=(const PairBuf&) = delete;
    ~PairBuf() { release(); }
};

// Units that decode a block straight into that layout (Unit::interleaved)
template <class U, class = void> struct HasInterleaved : std::false_type {};
template <class U> struct HasInterleaved<U, std::void_t<decltype((void)&U::interleaved)>> : std::true_type {};

template <QType T>
void decode_half(const uint8_t* row, int64_t nkb, PairBuf& pb, int h, const Grids& g) {
    using U = Unit<T>;
    const __m512i ones = _mm512_set1_epi8(1);
    for (int64_t b = 0; b < nkb; ++b) {
        const uint8_t* blk = row + b * Traits<T>::kb_bytes;
        typename U::State st;
        U::begin(blk, g, st);
        __m512i o[4];
        if constexpr (HasInterleaved<U>::value) {
            U::interleaved(blk, o);
        } else {
            __m512i v[4];
            static_for<4>([&](auto K) {
                uint64_t sg = 0;
                v[K] = decode_pair<U>(blk, K, g, st, sg);
                if constexpr (HasSigns<U>::value) v[K] = neg_where(v[K], sg);
            });
            interleave_groups(v, o);
        }
        __m512i sum = _mm512_setzero_si512();
        int8_t* q = pb.q + 512 * b + 32 * h;
        for (int i = 0; i < 4; ++i) {
            sum = _mm512_dpbusd_epi32(sum, ones, o[i]);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 128 * i), _mm512_castsi512_si256(o[i]));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 128 * i + 64), _mm512_extracti64x4_epi64(o[i], 1));
        }
        const __m256i gs = _mm256_add_epi32(_mm512_castsi512_si256(sum), _mm512_extracti64x4_epi64(sum, 1));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb.c + 16 * b + 8 * h),
                            _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(gs, 7)));
        _mm256_storeu_ps(pb.s + 16 * b + 8 * h, U::block_scales(st));
        if constexpr (U::has_min) {
            __m256 m[2];
            U::block_mins(st, m);
            _mm256_storeu_ps(pb.m + 32 * b + 8 * h, m[0]), _mm256_storeu_ps(pb.m + 32 * b + 16 + 8 * h, m[1]);
        }
    }
}

inline float hsum_hi(__m512 v) { return hsum_ps(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))); }

// out[t * ldo + r] for r < nrv of the 2 * RP rows of pb, t < NT
template <QType T, int RP, int NT>
void gemm_pairs(const PairBuf* pb, const Act& a, float* out, int64_t ldo, int nrv) {
    constexpr bool kMin = Unit<T>::has_min;
    const int64_t nkb = a.n / 256, nd = a.n / 32, ns = a.n / 16;
    __m512 acc[RP][NT];
    for (int r = 0; r < RP; ++r)
        for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nkb; ++b) {
        __m512i p[RP][NT];
        for (int r = 0; r < RP; ++r) {
            const __m512i c = _mm512_loadu_si512(pb[r].c + 16 * b);
            for (int t = 0; t < NT; ++t) p[r][t] = c;
        }
        const uint8_t* xb = a.q8x + 256 * b;
        static_for<8>([&](auto J) {
            constexpr int j = J;
            __m512i w[RP];
            for (int r = 0; r < RP; ++r) w[r] = _mm512_load_si512(pb[r].q + 512 * b + 64 * j);
            for (int t = 0; t < NT; ++t) {
                const __m512i x = _mm512_broadcast_i64x4(
                    _mm256_load_si256(reinterpret_cast<const __m256i*>(xb + t * a.n + 32 * j)));
                for (int r = 0; r < RP; ++r) p[r][t] = _mm512_dpbusd_epi32(p[r][t], x, w[r]);
            }
        });
        for (int r = 0; r < RP; ++r) {
            const __m512 s = _mm512_loadu_ps(pb[r].s + 16 * b);
            __m512 m0, m1;
            if constexpr (kMin) m0 = _mm512_loadu_ps(pb[r].m + 32 * b), m1 = _mm512_loadu_ps(pb[r].m + 32 * b + 16);
            for (int t = 0; t < NT; ++t) {  // block_fma on both halves
                const __m512 d = _mm512_broadcast_f32x8(_mm256_loadu_ps(a.d8 + t * nd + 8 * b));
                acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p[r][t]), _mm512_mul_ps(s, d), acc[r][t]);
                if constexpr (kMin) {
                    const float* m16 = a.m16 + t * ns + 16 * b;
                    acc[r][t] = _mm512_fmadd_ps(m0, _mm512_broadcast_f32x8(_mm256_loadu_ps(m16)), acc[r][t]);
                    acc[r][t] = _mm512_fmadd_ps(m1, _mm512_broadcast_f32x8(_mm256_loadu_ps(m16 + 8)), acc[r][t]);
                }
            }
        }
    }
    for (int r = 0; r < RP; ++r)
        for (int t = 0; t < NT; ++t) {
            out[t * ldo + 2 * r] = hsum_ps(_mm512_castps512_ps256(acc[r][t]));
            if (2 * r + 1 < nrv) out[t * ldo + 2 * r + 1] = hsum_hi(acc[r][t]);
        }
}

template <QType T, int RP>
void gemm_pairs_rows(const PairBuf* pb, const Act& a, int64_t nt, float* out, int64_t ldo, int nrv) {
    constexpr int NT = 4;  // 2 * RP * NT accumulators, RP weights and a token: within 32 registers
    int64_t t = 0;
    for (; t + NT <= nt; t += NT) gemm_pairs<T, RP, NT>(pb, a.at(t), out + t * ldo, ldo, nrv);
    switch (nt - t) {
        case 1: return gemm_pairs<T, RP, 1>(pb, a.at(t), out + t * ldo, ldo, nrv);
        case 2: return gemm_pairs<T, RP, 2>(pb, a.at(t), out + t * ldo, ldo, nrv);
        case 3: return gemm_pairs<T, RP, 3>(pb, a.at(t), out + t * ldo, ldo, nrv);
        default: return;
    }
}

// gemm_q8's many-token path for block types: RP row pairs decoded, then every token
template <QType T, int RP>
void gemm_q8x(const uint8_t* w, int64_t stride, int64_t nr, int64_t nkb, const Act& a, int64_t nt, float* out,
              int64_t ldo, const Grids& g) {
    thread_local PairBuf bufs[RP];
    for (auto& b : bufs) b.size(nkb);
    for (int64_t r = 0; r < nr; r += 2 * RP) {
        const int nrv = int(std::min<int64_t>(2 * RP, nr - r)), np = (nrv + 1) / 2;
        for (int i = 0; i < np; ++i) {  // an odd last row fills both halves (the second is not written out)
            decode_half<T>(w + (r + 2 * i) * stride, nkb, bufs[i], 0, g);
            decode_half<T>(w + std::min(r + 2 * i + 1, nr - 1) * stride, nkb, bufs[i], 1, g);
        }
        if (np == RP) {
            gemm_pairs_rows<T, RP>(bufs, a, nt, out + r, ldo, nrv);
        } else {
            for (int i = 0; i < np; ++i) gemm_pairs_rows<T, 1>(bufs + i, a, nt, out + r + 2 * i, ldo, nrv - 2 * i);
        }
    }
}
#endif

// out[t * ldo + r] = dot(row r, token t), r < nr (rows at w + r * stride), t < nt.
template <class Dot, QType T, int RB>
void gemm_q8(const uint8_t* w, int64_t stride, int64_t nr, int64_t nkb, const Act& a, int64_t nt,
             float* out, int64_t ldo, const Grids& g) {
    if (nt <= 4) {
        if constexpr (HasCols<Unit<T>>::value) {
            if (a.q8x) {
                switch (nt) {
                    case 1: return gemm_cols<T, 1>(w, stride, nr, nkb, a, out, ldo, g);
                    case 2: return gemm_cols<T, 2>(w, stride, nr, nkb, a, out, ldo, g);
                    case 3: return gemm_cols<T, 3>(w, stride, nr, nkb, a, out, ldo, g);
                    default: return gemm_cols<T, 4>(w, stride, nr, nkb, a, out, ldo, g);
                }
            }
        }
        for_row_pairs(w, stride, nr, out, [&](const uint8_t* const* rows, float* const* o, auto R) {
            dot_stream_any<Dot, T, decltype(R)::value>(rows, nkb, a, nt, o, ldo, g);
        });
        return;
    }
#ifdef __AVX512VNNI__
    if constexpr (HasBlock<Unit<T>>::value)
        if (a.q8x) return gemm_q8x<T, RB / 2>(w, stride, nr, nkb, a, nt, out, ldo, g);
#endif
    thread_local RowBuf bufs[RB];
    const int64_t n = nkb * Traits<T>::kb_elems;
    for (auto& b : bufs) b.size(n);
    int64_t r = 0;
    constexpr bool biased = kBiased<Dot, Unit<T>>;
    for (; r + RB <= nr; r += RB) {
        for (int i = 0; i < RB; ++i) decode_q8_row<T, biased>(w + (r + i) * stride, nkb, bufs[i], g);
        gemm_rows<Dot, T, RB>(bufs, a, nt, out + r, ldo);
    }
    for (; r < nr; ++r) {
        decode_q8_row<T, biased>(w + r * stride, nkb, bufs[0], g);
        gemm_rows<Dot, T, 1>(bufs, a, nt, out + r, ldo);
    }
}

template <class Dot, QType T, int RB>
void dot_row_q8(const uint8_t* row, int64_t nkb, const Act& a, int nt, float* out, int64_t ldo,
                const Grids& g) {
    gemm_q8<Dot, T, RB>(row, 0, 1, nkb, a, nt, out, ldo, g);
}

// From how many tokens gemm_q8 of a Unit reads Act::q8x (0: never; prepare_act builds q8x only
// then): the decode path of the column-form Units, the AVX-512 many-token path of the block types
template <class U> constexpr int64_t kQ8xFrom =
#ifdef __AVX512VNNI__
    HasCols<U>::value ? 1 : HasBlock<U>::value ? 5 : 0;
#else
    HasCols<U>::value ? 1 : 0;
#endif

// The q8 kernels of every type with a Unit; the rest keep what `k` holds.
template <class Dot, int RB>
void fill_q8(IsaKernels& k) {
    k.quantize_act = quantize_q8;
#ifdef __AVX512VNNI__
    k.interleave_act = interleave_q8;
#else
    k.interleave_act = interleave_q8_avx2;
#endif
#define FT_X(NAME, BE, BB)                                                          \
    if constexpr (HasUnit<QType::NAME>::value) {                                    \
        TypeKernels& t = k.types[int(QType::NAME)];                                 \
        t.dot_row = dot_row_q8<Dot, QType::NAME, RB>;                               \
        t.dot_row2 = nullptr;                                                       \
        t.gemm = gemm_q8<Dot, QType::NAME, RB>;                                     \
        t.q8x_from = kQ8xFrom<Unit<QType::NAME>>;                                   \
        t.accumulation = "q8";                                                      \
        t.reads = kReadsQ8;                                                         \
    }
    FT_QUANT_TYPES(FT_X)
    FT_CPU_REPACKED_TYPES(FT_X)
#undef FT_X
}

}  // namespace ft::cpu::avx2
