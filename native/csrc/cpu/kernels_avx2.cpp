// AVX2 + FMA row kernels. Quant types with a Unit (units_avx2.h) multiply their int8 weights with
// int16 activations (exact integer sums per 16 weights, one float FMA per 16 or 32 weights);
// float types (and TQ1_0) decode to float and FMA with float activations. Dequantize is
// bit-exact with the generic path either way. Chosen at run time when CPUID reports AVX2+FMA+F16C.
#include <algorithm>
#include <type_traits>

#include "units_avx2.h"

namespace ft::cpu {
namespace {
using namespace avx2;

template <QType T, class = void> struct HasUnit : std::false_type {};
template <QType T> struct HasUnit<T, std::void_t<decltype(Unit<T>::has_min)>> : std::true_type {};

inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// ---- activations: int16 per 32 features, plus float sums per 16 -----------------------------------
void quantize_act(const float* x, int64_t ldx, int64_t t0, int64_t t1, int64_t n, int16_t* q,
                  float* d, float* s16) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    for (int64_t t = t0; t < t1; ++t) {
        const float* xt = x + t * ldx;
        for (int64_t c = 0; c < n / 32; ++c) {
            __m256 v[4];
            for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(xt + 32 * c + 8 * i);
            __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], abs_mask), _mm256_and_ps(v[1], abs_mask)),
                                      _mm256_max_ps(_mm256_and_ps(v[2], abs_mask), _mm256_and_ps(v[3], abs_mask)));
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
            const float amax = _mm_cvtss_f32(m4);
            const __m256 id = _mm256_set1_ps(amax > 0.f ? 32767.f / amax : 0.f);
            __m256i iv[4];
            for (int i = 0; i < 4; ++i) iv[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], id));
            // packs interleaves 128-bit lanes; the permute restores feature order
            const __m256i p01 = _mm256_permute4x64_epi64(_mm256_packs_epi32(iv[0], iv[1]), 0xD8);
            const __m256i p23 = _mm256_permute4x64_epi64(_mm256_packs_epi32(iv[2], iv[3]), 0xD8);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + t * n + 32 * c), p01);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + t * n + 32 * c + 16), p23);
            d[t * (n / 32) + c] = amax / 32767.f;
            s16[t * (n / 16) + 2 * c] = hsum(_mm256_add_ps(v[0], v[1]));
            s16[t * (n / 16) + 2 * c + 1] = hsum(_mm256_add_ps(v[2], v[3]));
        }
    }
}

// ---- quant types with a Unit -------------------------------------------------------------------------
template <QType T, int NT>
void dot_unit_n(const uint8_t* row, int64_t nkb, const Act& a, float* out, int64_t ldo, const Grids& g) {
    using Tr = Traits<T>;
    using U = Unit<T>;
    __m256 acc[NT];
    float macc[NT];
    for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps(), macc[t] = 0.f;
    const int64_t nd = a.n / 32, ns = a.n / 16;
    for (int64_t b = 0; b < nkb; ++b) {
        const uint8_t* blk = row + b * Tr::kb_bytes;
        typename U::State st;
        U::begin(blk, g, st);
        for (int s = 0; s < Tr::subs; ++s) {
            Sub u;
            U::decode(blk, s, g, st, u);
            const int64_t c = b * Tr::subs + s;
            const __m256i q0 = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(u.q));
            const __m256i q1 = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(u.q, 1));
            for (int t = 0; t < NT; ++t) {
                const int16_t* xq = a.q + t * a.n + 32 * c;
                const __m256i p0 = _mm256_madd_epi16(q0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq)));
                const __m256i p1 = _mm256_madd_epi16(q1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 16)));
                const float xd = a.d[t * nd + c];
                if constexpr (U::per16) {
                    acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_set1_ps(u.s[0] * xd), acc[t]);
                    acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_set1_ps(u.s[1] * xd), acc[t]);
                } else {
                    acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(p0, p1)),
                                             _mm256_set1_ps(u.s[0] * xd), acc[t]);
                }
                if constexpr (U::has_min)
                    macc[t] += u.m[0] * a.s16[t * ns + 2 * c] + u.m[1] * a.s16[t * ns + 2 * c + 1];
            }
        }
    }
    for (int t = 0; t < NT; ++t) out[t * ldo] = hsum(acc[t]) + macc[t];
}

template <QType T>
void decode_unit(const uint8_t* row, int64_t nkb, float* out, const Grids& g) {
    using Tr = Traits<T>;
    for (int64_t b = 0; b < nkb; ++b) {
        typename Unit<T>::State st;
        Unit<T>::begin(row + b * Tr::kb_bytes, g, st);
        for (int s = 0; s < Tr::subs; ++s) {
            Sub u;
            Unit<T>::decode(row + b * Tr::kb_bytes, s, g, st, u);
            float* o = out + (b * Tr::subs + s) * 32;
            const __m128i lo = _mm256_castsi256_si128(u.q), hi = _mm256_extracti128_si256(u.q, 1);
            const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
            for (int i = 0; i < 4; ++i) {  // w = float(q) * s (+ m): the reference's product and add
                __m256 w = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(parts[i])),
                                         _mm256_set1_ps(u.s[i / 2]));
                if constexpr (Unit<T>::has_min) w = _mm256_add_ps(w, _mm256_set1_ps(u.m[i / 2]));
                _mm256_storeu_ps(o + 8 * i, w);
            }
        }
    }
}

// ---- IQ3_S: R rows at a time (dot_row2) ---------------------------------------------------------------
// The 8 grid loads per 32 weights bound this dot (gathers, a signed 32 KB grid and GPR-built
// vectors all measured slower on Zen 3), so the work around them is trimmed: scale times activation
// scale once per block, the sign bytes of 4 subs in one load, and R rows sharing each activation
// load. Same products and sums in the same order as dot_unit_n: bit-identical results.
template <int R, int NT>
void dot_iq3s_n(const uint8_t* const* rows, int64_t nkb, const Act& a, float* const* out, int64_t ldo,
                const Grids& g) {
    using U = Unit<QType::IQ3_S>;
    using Tr = Traits<QType::IQ3_S>;
    // sign byte 4s+k (k = 0..3) of a 16-byte half-block broadcast to bytes 8k..8k+7; +4 per sub
    const __m256i shuf0 = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                           2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
    const __m256i one = _mm256_set1_epi8(1);
    const int64_t nd = a.n / 32;
    __m256 acc[R][NT];
    for (int r = 0; r < R; ++r)
        for (int t = 0; t < NT; ++t) acc[r][t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nkb; ++b) {
        typename U::State st[R];
        alignas(32) float sc[R][NT][8];  // scale of every 32 weights times the token's x scale
        for (int r = 0; r < R; ++r) {
            U::begin(rows[r] + b * Tr::kb_bytes, g, st[r]);
            for (int t = 0; t < NT; ++t)
                _mm256_store_ps(sc[r][t], _mm256_mul_ps(_mm256_load_ps(st[r].s), _mm256_loadu_ps(a.d + t * nd + 8 * b)));
        }
        for (int h = 0; h < 2; ++h) {
            __m256i sg[R];
            for (int r = 0; r < R; ++r) {
                const BlockIQ3_S& blk = *reinterpret_cast<const BlockIQ3_S*>(rows[r] + b * Tr::kb_bytes);
                sg[r] = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk.signs + 16 * h)));
            }
            __m256i shuf = shuf0;
            for (int j = 0; j < 4; ++j, shuf = _mm256_add_epi8(shuf, _mm256_set1_epi8(4))) {
                const int s = 4 * h + j;
                __m256i q0[R], q1[R];
                for (int r = 0; r < R; ++r) {
                    const __m256i neg = _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(sg[r], shuf), bit), bit);
                    const __m256i q = _mm256_sign_epi8(U::grid(st[r], s, g), _mm256_or_si256(neg, one));
                    q0[r] = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(q));
                    q1[r] = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(q, 1));
                }
                for (int t = 0; t < NT; ++t) {
                    const int16_t* xq = a.q + t * a.n + 32 * (b * Tr::subs + s);
                    const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
                    const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 16));
                    for (int r = 0; r < R; ++r) {
                        const __m256i p = _mm256_add_epi32(_mm256_madd_epi16(q0[r], x0), _mm256_madd_epi16(q1[r], x1));
                        acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_broadcast_ss(&sc[r][t][s]), acc[r][t]);
                    }
                }
            }
        }
    }
    for (int r = 0; r < R; ++r)
        for (int t = 0; t < NT; ++t) out[r][t * ldo] = hsum(acc[r][t]);
}

// Any nt for R rows: groups of up to 4 tokens, like dot_rows.
template <int R>
void dot_iq3s(const uint8_t* const* rows, int64_t nkb, const Act& a, int nt, float* const* out, int64_t ldo,
              const Grids& g) {
    for (int t = 0; t < nt;) {
        const int n = std::min(4, nt - t);
        float* o[R];
        for (int r = 0; r < R; ++r) o[r] = out[r] + t * ldo;
        const Act at = a.at(t);
        switch (n) {
            case 1: dot_iq3s_n<R, 1>(rows, nkb, at, o, ldo, g); break;
            case 2: dot_iq3s_n<R, 2>(rows, nkb, at, o, ldo, g); break;
            case 3: dot_iq3s_n<R, 3>(rows, nkb, at, o, ldo, g); break;
            default: dot_iq3s_n<R, 4>(rows, nkb, at, o, ldo, g); break;
        }
        t += n;
    }
}
void dot_row2_iq3s(const uint8_t* row0, const uint8_t* row1, int64_t nkb, const Act& a, int nt, float* out0,
                   float* out1, int64_t ldo, const Grids& g) {
    const uint8_t* rows[2] = {row0, row1};
    float* out[2] = {out0, out1};
    dot_iq3s<2>(rows, nkb, a, nt, out, ldo, g);
}

// ---- float path: 32 weights as 4 x 8 floats, FMA with float activations ------------------------------
template <QType T> struct FloatDec {  // any type: the scalar decoder
    static void decode(const uint8_t* blk, int s, const Grids& g, __m256 w[4]) {
        alignas(32) float f[32];
        decode32<T>(blk, s, g, f);
        for (int i = 0; i < 4; ++i) w[i] = _mm256_load_ps(f + 8 * i);
    }
};
template <> struct FloatDec<QType::F32> {
    static void decode(const uint8_t* blk, int, const Grids&, __m256 w[4]) {
        for (int i = 0; i < 4; ++i) w[i] = _mm256_loadu_ps(reinterpret_cast<const float*>(blk) + 8 * i);
    }
};
template <> struct FloatDec<QType::F16> {
    static void decode(const uint8_t* blk, int, const Grids&, __m256 w[4]) {
        for (int i = 0; i < 4; ++i)
            w[i] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16 * i)));
    }
};
template <> struct FloatDec<QType::BF16> {
    static void decode(const uint8_t* blk, int, const Grids&, __m256 w[4]) {
        for (int i = 0; i < 4; ++i) {
            const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16 * i)));
            w[i] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
        }
    }
};

template <QType T, int NT>
void dot_float_n(const uint8_t* row, int64_t nkb, const Act& a, float* out, int64_t ldo, const Grids& g) {
    using Tr = Traits<T>;
    constexpr int A = NT == 1 ? 4 : NT == 2 ? 2 : 1;  // independent accumulators per token
    __m256 acc[NT][A];
    for (int t = 0; t < NT; ++t)
        for (int i = 0; i < A; ++i) acc[t][i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nkb; ++b) {
        for (int s = 0; s < Tr::subs; ++s) {
            __m256 w[4];
            FloatDec<T>::decode(row + b * Tr::kb_bytes, s, g, w);
            const float* xc = a.x + (b * Tr::subs + s) * 32;
            for (int t = 0; t < NT; ++t)
                for (int i = 0; i < 4; ++i)
                    acc[t][i % A] = _mm256_fmadd_ps(w[i], _mm256_loadu_ps(xc + t * a.ldx + 8 * i), acc[t][i % A]);
        }
    }
    for (int t = 0; t < NT; ++t) {
        for (int i = 1; i < A; ++i) acc[t][0] = _mm256_add_ps(acc[t][0], acc[t][i]);
        out[t * ldo] = hsum(acc[t][0]);
    }
}

template <QType T>
void decode_float(const uint8_t* row, int64_t nkb, float* out, const Grids& g) {
    using Tr = Traits<T>;
    for (int64_t b = 0; b < nkb; ++b)
        for (int s = 0; s < Tr::subs; ++s) {
            __m256 w[4];
            FloatDec<T>::decode(row + b * Tr::kb_bytes, s, g, w);
            for (int i = 0; i < 4; ++i) _mm256_storeu_ps(out + (b * Tr::subs + s) * 32 + 8 * i, w[i]);
        }
}

// Any nt: groups of up to 4 tokens share each decoded group of 32 weights.
template <QType T, template <QType, int> class K>
void dot_rows(const uint8_t* row, int64_t nkb, const Act& a, int nt, float* out, int64_t ldo,
              const Grids& g) {
    int t = 0;
    for (; t + 4 <= nt; t += 4) K<T, 4>::run(row, nkb, a.at(t), out + t * ldo, ldo, g);
    switch (nt - t) {
        case 1: return K<T, 1>::run(row, nkb, a.at(t), out + t * ldo, ldo, g);
        case 2: return K<T, 2>::run(row, nkb, a.at(t), out + t * ldo, ldo, g);
        case 3: return K<T, 3>::run(row, nkb, a.at(t), out + t * ldo, ldo, g);
        default: return;
    }
}
template <QType T, int NT> struct UnitK {
    static void run(const uint8_t* r, int64_t n, const Act& a, float* o, int64_t l, const Grids& g) {
        dot_unit_n<T, NT>(r, n, a, o, l, g);
    }
};
template <QType T, int NT> struct FloatK {
    static void run(const uint8_t* r, int64_t n, const Act& a, float* o, int64_t l, const Grids& g) {
        dot_float_n<T, NT>(r, n, a, o, l, g);
    }
};

template <QType T> void set_type(TypeKernels& k) {
    if constexpr (HasUnit<T>::value) {
        k.dot_row = dot_rows<T, UnitK>;
        k.decode_row = decode_unit<T>;
        k.accumulation = "i16";
    } else {
        k.dot_row = dot_rows<T, FloatK>;
        k.decode_row = decode_float<T>;
        k.accumulation = "f32";
    }
}

}  // namespace

void fill_avx2(IsaKernels& k) {
    k.name = "avx2";
    k.quantize_act = quantize_act;
#define FT_X(NAME, BE, BB) set_type<QType::NAME>(k.types[int(QType::NAME)]);
    FT_QUANT_TYPES(FT_X)
#undef FT_X
    k.types[int(QType::IQ3_S)].dot_row2 = dot_row2_iq3s;
}

}  // namespace ft::cpu
