// Generic (portable C++) row kernels for every type: the CPU oracle the ISA overrides are tested
// against. Templated on the type, instantiated from FT_QUANT_TYPES.
#include "cpu.h"

namespace ft::cpu {
namespace {

template <QType T>
void decode_row(const uint8_t* row, int64_t nkb, float* out, const Grids& g) {
    using Tr = Traits<T>;
    for (int64_t b = 0; b < nkb; ++b)
        for (int s = 0; s < Tr::subs; ++s)
            decode32<T>(row + b * Tr::kb_bytes, s, g, out + (b * Tr::subs + s) * 32);
}

// Few tokens: decode 32 weights at a time, use them for every token.
template <QType T, int NT>
void dot_stream(const uint8_t* row, int64_t nkb, const float* x, int64_t ldx, float* out,
                int64_t ldo, const Grids& g) {  // x: float activations, token stride ldx
    using Tr = Traits<T>;
    float acc[NT] = {};
    float w[32];
    for (int64_t b = 0; b < nkb; ++b) {
        for (int s = 0; s < Tr::subs; ++s) {
            decode32<T>(row + b * Tr::kb_bytes, s, g, w);
            const float* xc = x + (b * Tr::subs + s) * 32;
            for (int t = 0; t < NT; ++t) {
                float p = 0.f;
                for (int j = 0; j < 32; ++j) p += w[j] * xc[t * ldx + j];
                acc[t] += p;
            }
        }
    }
    for (int t = 0; t < NT; ++t) out[t * ldo] = acc[t];
}

// Many tokens: decode the row once, then one dot product per token.
template <QType T>
void dot_row(const uint8_t* row, int64_t nkb, const Act& a, int nt, float* out, int64_t ldo,
             const Grids& g) {
    const float* x = a.x;
    const int64_t ldx = a.ldx;
    switch (nt) {
        case 1: return dot_stream<T, 1>(row, nkb, x, ldx, out, ldo, g);
        case 2: return dot_stream<T, 2>(row, nkb, x, ldx, out, ldo, g);
        case 3: return dot_stream<T, 3>(row, nkb, x, ldx, out, ldo, g);
        case 4: return dot_stream<T, 4>(row, nkb, x, ldx, out, ldo, g);
        default: break;
    }
    const int64_t n = nkb * Traits<T>::kb_elems;
    thread_local std::vector<float> w;
    if (int64_t(w.size()) < n) w.resize(n);
    decode_row<T>(row, nkb, w.data(), g);
    for (int t = 0; t < nt; ++t) {
        const float* xt = x + t * ldx;
        float acc = 0.f;
        for (int64_t c = 0; c < n; c += 32) {
            float p = 0.f;
            for (int j = 0; j < 32; ++j) p += w[c + j] * xt[c + j];
            acc += p;
        }
        out[t * ldo] = acc;
    }
}

}  // namespace

void fill_generic(IsaKernels& k) {
    k.name = "generic";
#define FT_X(NAME, BE, BB)                                                                         \
    k.types[int(QType::NAME)] = TypeKernels{decode_row<QType::NAME>, dot_row<QType::NAME>,                       \
                              Traits<QType::NAME>::kb_elems, Traits<QType::NAME>::kb_bytes, #NAME, \
                              UsesGrids<QType::NAME>::value};
    FT_QUANT_TYPES(FT_X)
    FT_CPU_REPACKED_TYPES(FT_X)
#undef FT_X
}

}  // namespace ft::cpu
