// AVX2 + FMA row kernels. Quant types with a Unit (units_avx2.h) multiply their int8 weights with
// int8 activations (q8_kernels.h: maddubs + madd, exact integer sums per 16 weights, one float
// FMA per 32), the 32-weight block types with int16 activations (q16_kernels.h); float types
// decode to float and FMA with float activations. Dequantize is
// bit-exact with the generic path either way. Chosen at run time when CPUID reports AVX2+FMA+F16C.
#include <algorithm>
#include <type_traits>

#include "q16_kernels.h"

namespace ft::cpu {
namespace {
using namespace avx2;


inline float hsum(__m256 v) { return hsum_ps(v); }

// ---- dequantize of the types with a Unit: bit-exact with the generic path ------------------------------
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
    constexpr int A = 4;  // accumulators per token, whatever NT: a token's sums never depend on the batch
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

// Any nt: pairs of tokens share each decoded group of 32 weights (4 accumulators each).
template <QType T, template <QType, int> class K>
void dot_rows(const uint8_t* row, int64_t nkb, const Act& a, int nt, float* out, int64_t ldo,
              const Grids& g) {
    int t = 0;
    for (; t + 2 <= nt; t += 2) K<T, 2>::run(row, nkb, a.at(t), out + t * ldo, ldo, g);
    if (t < nt) K<T, 1>::run(row, nkb, a.at(t), out + t * ldo, ldo, g);
}
template <QType T, int NT> struct FloatK {
    static void run(const uint8_t* r, int64_t n, const Act& a, float* o, int64_t l, const Grids& g) {
        dot_float_n<T, NT>(r, n, a, o, l, g);
    }
};

template <QType T> void set_type(TypeKernels& k) {
    if constexpr (HasUnit<T>::value) {
        k.decode_row = decode_unit<T>;  // dot_row and gemm: fill_q8
    } else {
        k.dot_row = dot_rows<T, FloatK>;
        k.decode_row = decode_float<T>;
        k.accumulation = "f32";
    }
}

}  // namespace

void fill_avx2(IsaKernels& k) {
    k.name = "avx2";
#define FT_X(NAME, BE, BB) set_type<QType::NAME>(k.types[int(QType::NAME)]);
    FT_QUANT_TYPES(FT_X)
    FT_CPU_REPACKED_TYPES(FT_X)
#undef FT_X
    fill_q8<DotAvx2, 2>(k);
    fill_q16<2>(k);
}

}  // namespace ft::cpu
