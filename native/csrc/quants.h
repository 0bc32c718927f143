// ftpatch: every ggml weight type, declared once, shared by the CPU (g++) and CUDA (nvcc) kernels.
//
// ==== Contract (stable; the CPU and CUDA kernels both build on it) ================================
// Torch-free, no allocation, no globals. Everything callable on host and device is FT_HD.
//
//   enum class QType    the ggml type ids, QType::NAME (as stored in GGUF).
//   FT_QUANT_TYPES(X)   X-macro over the 25 weight types: X(NAME, block_elems, block_bytes);
//                       block sizes are ggml's (= gguf.GGML_QUANT_SIZES); id = int(QType::NAME).
//   Traits<QType::NAME> id, name, block_elems, block_bytes (ggml's) and the *kernel block* every
//                       kernel addresses: kb_elems / kb_bytes / subs = kb_elems / 32.
//                       Quant types: kernel block = ggml block. Float types (F32/F16/BF16, ggml
//                       block = 1 element): kernel block = 32 consecutive elements, so a float row
//                       must hold a multiple of 32 elements for the kernels.
//   Block<NAME>         one struct per type, static_assert(sizeof == block_bytes).
//   decode32<QType::NAME>(blk, sub, grids, out)
//                       writes the 32 weights [32*sub, 32*sub+32) of the kernel block at `blk` to
//                       out[0..32) as float. Bit-exact with gguf-py / ggml dequantize_row_*:
//                       the same float32 operations in the same order, never fused into an FMA
//                       (products that feed an add go through ft_mul, which is __fmul_rn on the
//                       device; host builds must use -ffp-contract=off, set in CMakeLists.txt).
//                       0 <= sub < Traits::subs. Float types: sub is 0, blk = 32 elements.
//   Alignment           blk must be 2-byte aligned (every type with a 16-bit field has an even
//                       block size, so a 2-aligned row keeps every block aligned; GGUF data is
//                       32-aligned). 32-bit fields at 2-aligned offsets are read as two 16-bit
//                       halves (ld_u32). F32 blocks are read the same way.
//   Grids               pointers to the IQ lookup tables, filled at run time from gguf-py's tables
//                       (loaders.quants.iq_tables(); never pasted into our sources). The pointers
//                       must be on the side (host or device) that runs the decoder. Types that need
//                       no table ignore it.
//   fp16_to_f32 / bf16_to_f32 / e8m0_half_to_f32
//                       portable bit-level conversions (exact, subnormals included), host+device.
//   UsesGrids<T>::value whether decode32<T> reads `grids` (IQ types, IQ4_*, MXFP4).
//   visit_type(id, f)   host helper: calls f(TypeTag<QType::NAME>{}) for a runtime id; false if
//                       the id is not in the list. Drives every per-type table from the one list.
// Adding a type = one X entry + one Block struct + one decode32 specialization here, + one row in
// loaders/quants.py. Nothing else.
// ==================================================================================================
#pragma once
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define FT_HD __host__ __device__ __forceinline__
#else
#define FT_HD inline
#endif

namespace ft {

// ggml type ids, as stored in GGUF.
enum class QType : int {
    F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8,
    Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14,
    IQ2_XXS = 16, IQ2_XS = 17, IQ3_XXS = 18, IQ1_S = 19, IQ4_NL = 20, IQ3_S = 21, IQ2_S = 22,
    IQ4_XS = 23, IQ1_M = 29, BF16 = 30, TQ1_0 = 34, TQ2_0 = 35, MXFP4 = 39,
    // CPU-side repacked forms (never in a file, never on the GPU): ids ggml does not use
    IQ3_S_N4 = 60,
};

// X(NAME, block_elems, block_bytes) for every type the kernels handle; NAME is a QType member.
#define FT_QUANT_TYPES(X) \
    X(F32, 1, 4) X(F16, 1, 2) X(BF16, 1, 2) \
    X(Q4_0, 32, 18) X(Q4_1, 32, 20) X(Q5_0, 32, 22) X(Q5_1, 32, 24) X(Q8_0, 32, 34) \
    X(Q2_K, 256, 84) X(Q3_K, 256, 110) X(Q4_K, 256, 144) X(Q5_K, 256, 176) X(Q6_K, 256, 210) \
    X(IQ1_S, 256, 50) X(IQ1_M, 256, 56) X(IQ2_XXS, 256, 66) X(IQ2_XS, 256, 74) X(IQ2_S, 256, 82) \
    X(IQ3_XXS, 256, 98) X(IQ3_S, 256, 110) X(IQ4_NL, 32, 18) X(IQ4_XS, 256, 136) \
    X(TQ1_0, 256, 54) X(TQ2_0, 256, 66) X(MXFP4, 32, 17)

// X(NAME, block_elems, block_bytes) for the CPU's repacked forms of file types: the same weights
// in a layout its kernels decode without table lookups (cpu/repack.cpp makes them). Only the
// CPU tables list them.
//   IQ3_S_N4: IQ3_S with every weight w as the 4-bit code (w + 15) / 2 (IQ3_S's weights are odd
//   numbers, |w| <= 15, times a group's scale), so w = 2 * code - 15 and a group's product is
//   2 * (codes . x) - 15 * (sum of x): unsigned codes straight into maddubs / dpbusd, no table.
//   Block: d, the 4 bytes of 4-bit scales as in IQ3_S, then 4 x 32 bytes: byte j of chunk k
//   holds weight j of group 2k in its low nibble and of group 2k + 1 in its high nibble. 134
//   bytes a 256 weights against IQ3_S's 110.
#define FT_CPU_REPACKED_TYPES(X) X(IQ3_S_N4, 256, 134)

// id, name, block_elems, block_bytes (ggml's), and the kernel block: kb_elems, kb_bytes,
// subs (32-weight groups per kernel block).
template <QType T> struct Traits;
#define FT_X(NAME, BE, BB)                                                                         \
    template <> struct Traits<QType::NAME> {                                                       \
        static constexpr int id = int(QType::NAME);                                                \
        static constexpr const char* name = #NAME;                                                 \
        static constexpr int block_elems = BE, block_bytes = BB;                                   \
        static constexpr int kb_elems = BE < 32 ? 32 : BE;                                         \
        static constexpr int kb_bytes = BE < 32 ? 32 * BB : BB;                                    \
        static constexpr int subs = kb_elems / 32;                                                 \
    };
FT_QUANT_TYPES(FT_X)
FT_CPU_REPACKED_TYPES(FT_X)
#undef FT_X

template <QType T> struct TypeTag { static constexpr QType type = T; };

// Whether decode32<T> reads the Grids (IQ tables, kvalues); set next to each such decoder.
template <QType T> struct UsesGrids { static constexpr bool value = false; };
#define FT_USES_GRIDS(NAME) template <> struct UsesGrids<QType::NAME> { static constexpr bool value = true; };
FT_USES_GRIDS(IQ1_S) FT_USES_GRIDS(IQ1_M) FT_USES_GRIDS(IQ2_XXS) FT_USES_GRIDS(IQ2_XS)
FT_USES_GRIDS(IQ2_S) FT_USES_GRIDS(IQ3_XXS) FT_USES_GRIDS(IQ3_S) FT_USES_GRIDS(IQ4_NL)
FT_USES_GRIDS(IQ4_XS) FT_USES_GRIDS(MXFP4)
#undef FT_USES_GRIDS

// Runtime id -> compile-time type. Host only (a switch over the one list).
template <class F> inline bool visit_type(int id, F&& f) {
    switch (id) {
#define FT_X(NAME, BE, BB) case int(QType::NAME): f(TypeTag<QType::NAME>{}); return true;
        FT_QUANT_TYPES(FT_X)
#undef FT_X
    }
    return false;
}

// IQ lookup tables as ggml lays them out (its ggml-common.h).
struct Grids {
    const uint64_t* iq2xxs;   // [256]  8 byte-values per entry
    const uint64_t* iq2xs;    // [512]
    const uint64_t* iq2s;     // [1024]
    const uint32_t* iq3xxs;   // [256]  4 byte-values per entry
    const uint32_t* iq3s;     // [512]
    const uint64_t* iq1s;     // [2048] 8 int8 values (-1, 0, 1) per entry
    const uint8_t* ksigns;    // [128]  ksigns_iq2xs
    const int8_t* kvalues_iq4nl;  // [16]
    const int8_t* kvalues_mxfp4;  // [16] (doubled E2M1 values)
};

// ---- scalar helpers (host + device) ----------------------------------------------------------------

FT_HD float bits_to_f32(uint32_t u) {
#if defined(__CUDA_ARCH__)
    return __uint_as_float(u);
#else
    float f;
    std::memcpy(&f, &u, 4);
    return f;
#endif
}

FT_HD uint32_t f32_to_bits(float f) {
#if defined(__CUDA_ARCH__)
    return __float_as_uint(f);
#else
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return u;
#endif
}

// a*b rounded once, never contracted with a following add (see contract).
FT_HD float ft_mul(float a, float b) {
#if defined(__CUDA_ARCH__)
    return __fmul_rn(a, b);
#else
    return a * b;
#endif
}

FT_HD uint16_t ld_u16(const uint8_t* p) { return *reinterpret_cast<const uint16_t*>(p); }
FT_HD uint32_t ld_u32(const uint8_t* p) {  // p 2-aligned; little-endian
    return uint32_t(ld_u16(p)) | (uint32_t(ld_u16(p + 2)) << 16);
}

// IEEE half -> float, exact for every input (normal, subnormal, inf, NaN payload kept).
FT_HD float fp16_to_f32(uint16_t h) {
    const uint32_t sign = uint32_t(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
    if (exp == 0x1F) return bits_to_f32(sign | 0x7F800000u | (man << 13));
    if (exp != 0) return bits_to_f32(sign | ((exp + 112u) << 23) | (man << 13));
    // zero or subnormal: man * 2^-24, exact in float (man < 2^10)
    const float mag = float(man) * bits_to_f32(0x33800000u);  // 2^-24
    return bits_to_f32(sign | f32_to_bits(mag));
}

FT_HD float bf16_to_f32(uint16_t h) { return bits_to_f32(uint32_t(h) << 16); }

// MXFP4 scale: 2^(e-128) (half of E8M0's 2^(e-127), because the fp4 table is doubled).
FT_HD float e8m0_half_to_f32(uint8_t e) {
    return bits_to_f32(e < 2 ? (0x00200000u << e) : (uint32_t(e - 1) << 23));
}

// Byte j of a packed grid entry.
FT_HD int grid_byte(uint64_t entry, int j) { return int((entry >> (8 * j)) & 0xFF); }
FT_HD int grid_byte(uint32_t entry, int j) { return int((entry >> (8 * j)) & 0xFF); }

// ---- block layouts (byte offsets as in ggml-common.h) -------------------------------------------

struct BlockF32 { uint16_t v[2]; };         // one float, read as two halves (alignment 2)
struct BlockF16 { uint16_t v; };
struct BlockBF16 { uint16_t v; };
struct BlockQ4_0 { uint16_t d; uint8_t qs[16]; };
struct BlockQ4_1 { uint16_t d, m; uint8_t qs[16]; };
struct BlockQ5_0 { uint16_t d; uint8_t qh[4]; uint8_t qs[16]; };
struct BlockQ5_1 { uint16_t d, m; uint8_t qh[4]; uint8_t qs[16]; };
struct BlockQ8_0 { uint16_t d; int8_t qs[32]; };
struct BlockQ2_K { uint8_t scales[16]; uint8_t qs[64]; uint16_t d, dmin; };
struct BlockQ3_K { uint8_t hmask[32]; uint8_t qs[64]; uint8_t scales[12]; uint16_t d; };
struct BlockQ4_K { uint16_t d, dmin; uint8_t scales[12]; uint8_t qs[128]; };
struct BlockQ5_K { uint16_t d, dmin; uint8_t scales[12]; uint8_t qh[32]; uint8_t qs[128]; };
struct BlockQ6_K { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; uint16_t d; };
struct BlockIQ1_S { uint16_t d; uint8_t qs[32]; uint16_t qh[8]; };
struct BlockIQ1_M { uint8_t qs[32]; uint8_t qh[16]; uint16_t scales[4]; };  // fp16 d in top nibbles
struct BlockIQ2_XXS { uint16_t d; uint16_t qs[32]; };  // per 32: u32 grid idx bytes, u32 signs+scale
struct BlockIQ2_XS { uint16_t d; uint16_t qs[32]; uint8_t scales[8]; };
struct BlockIQ2_S { uint16_t d; uint8_t qs[32]; uint8_t signs[32]; uint8_t qh[8]; uint8_t scales[8]; };
struct BlockIQ3_XXS { uint16_t d; uint8_t qs[64]; uint8_t scales_signs[32]; };  // 8 x u32 @66
struct BlockIQ3_S { uint16_t d; uint8_t qs[64]; uint8_t qh[8]; uint8_t signs[32]; uint8_t scales[4]; };
struct BlockIQ4_NL { uint16_t d; uint8_t qs[16]; };
struct BlockIQ4_XS { uint16_t d; uint16_t scales_h; uint8_t scales_l[4]; uint8_t qs[128]; };
struct BlockTQ1_0 { uint8_t qs[48]; uint8_t qh[4]; uint16_t d; };
struct BlockTQ2_0 { uint8_t qs[64]; uint16_t d; };
struct BlockMXFP4 { uint8_t e; uint8_t qs[16]; };
struct BlockIQ3_S_N4 { uint16_t d; uint8_t scales[4]; uint8_t qs[128]; };

#define FT_X(NAME, BE, BB)                                                                         \
    static_assert(sizeof(Block##NAME) == BB, "block size of " #NAME " differs from ggml");
FT_QUANT_TYPES(FT_X)
FT_CPU_REPACKED_TYPES(FT_X)
#undef FT_X

// ---- decoders: 32 weights of one kernel block -------------------------------------------------------

template <QType T> FT_HD void decode32(const uint8_t* blk, int sub, const Grids& g, float* out);

#define FT_BLOCK(NAME) const Block##NAME& b = *reinterpret_cast<const Block##NAME*>(blk)

template <> FT_HD void decode32<QType::F32>(const uint8_t* blk, int, const Grids&, float* out) {
    for (int j = 0; j < 32; ++j) out[j] = bits_to_f32(ld_u32(blk + 4 * j));
}
template <> FT_HD void decode32<QType::F16>(const uint8_t* blk, int, const Grids&, float* out) {
    for (int j = 0; j < 32; ++j) out[j] = fp16_to_f32(ld_u16(blk + 2 * j));
}
template <> FT_HD void decode32<QType::BF16>(const uint8_t* blk, int, const Grids&, float* out) {
    for (int j = 0; j < 32; ++j) out[j] = bf16_to_f32(ld_u16(blk + 2 * j));
}

// Legacy 32-weight blocks: low nibbles are weights 0..15, high nibbles 16..31.
template <> FT_HD void decode32<QType::Q4_0>(const uint8_t* blk, int, const Grids&, float* out) {
    FT_BLOCK(Q4_0);
    const float d = fp16_to_f32(b.d);
    for (int j = 0; j < 16; ++j) {
        out[j] = d * float(int(b.qs[j] & 0xF) - 8);
        out[j + 16] = d * float(int(b.qs[j] >> 4) - 8);
    }
}
template <> FT_HD void decode32<QType::Q4_1>(const uint8_t* blk, int, const Grids&, float* out) {
    FT_BLOCK(Q4_1);
    const float d = fp16_to_f32(b.d), m = fp16_to_f32(b.m);
    for (int j = 0; j < 16; ++j) {
        out[j] = ft_mul(d, float(b.qs[j] & 0xF)) + m;
        out[j + 16] = ft_mul(d, float(b.qs[j] >> 4)) + m;
    }
}
template <> FT_HD void decode32<QType::Q5_0>(const uint8_t* blk, int, const Grids&, float* out) {
    FT_BLOCK(Q5_0);
    const float d = fp16_to_f32(b.d);
    const uint32_t qh = ld_u32(b.qh);
    for (int j = 0; j < 16; ++j) {
        out[j] = d * float(int((b.qs[j] & 0xF) | (((qh >> j) & 1) << 4)) - 16);
        out[j + 16] = d * float(int((b.qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16);
    }
}
template <> FT_HD void decode32<QType::Q5_1>(const uint8_t* blk, int, const Grids&, float* out) {
    FT_BLOCK(Q5_1);
    const float d = fp16_to_f32(b.d), m = fp16_to_f32(b.m);
    const uint32_t qh = ld_u32(b.qh);
    for (int j = 0; j < 16; ++j) {
        out[j] = ft_mul(d, float((b.qs[j] & 0xF) | (((qh >> j) & 1) << 4))) + m;
        out[j + 16] = ft_mul(d, float((b.qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4))) + m;
    }
}
template <> FT_HD void decode32<QType::Q8_0>(const uint8_t* blk, int, const Grids&, float* out) {
    FT_BLOCK(Q8_0);
    const float d = fp16_to_f32(b.d);
    for (int j = 0; j < 32; ++j) out[j] = float(b.qs[j]) * d;
}

// K types. Sub-block s of a 256-block: 2-bit fields are packed 4 per byte over 32-byte chunks
// (chunk s/4, shift 2*(s%4)); nibble fields 2 per byte over 32-byte chunks (chunk s/2, shift 4*(s%2)).
template <> FT_HD void decode32<QType::Q2_K>(const uint8_t* blk, int s, const Grids&, float* out) {
    FT_BLOCK(Q2_K);
    const float d = fp16_to_f32(b.d), dmin = fp16_to_f32(b.dmin);
    const uint8_t* q = b.qs + 32 * (s / 4);
    const int sh = 2 * (s % 4);
    for (int h = 0; h < 2; ++h) {  // 16 weights per scale
        const uint8_t sc = b.scales[2 * s + h];
        const float dl = d * float(sc & 0xF), ml = dmin * float(sc >> 4);
        for (int l = 16 * h; l < 16 * h + 16; ++l) out[l] = ft_mul(dl, float((q[l] >> sh) & 3)) - ml;
    }
}
template <> FT_HD void decode32<QType::Q3_K>(const uint8_t* blk, int s, const Grids&, float* out) {
    FT_BLOCK(Q3_K);
    const float d = fp16_to_f32(b.d);
    const uint8_t* q = b.qs + 32 * (s / 4);
    const int sh = 2 * (s % 4);
    for (int h = 0; h < 2; ++h) {
        const int i = 2 * s + h;  // 6-bit scale i: low 4 bits in scales[i%8] (nibble i/8),
                                  // high 2 bits in scales[8 + i%4] (bits 2*(i/4))
        const int lo = (b.scales[i % 8] >> (4 * (i / 8))) & 0xF;
        const int hi = (b.scales[8 + i % 4] >> (2 * (i / 4))) & 3;
        const float dl = d * float((lo | (hi << 4)) - 32);
        for (int l = 16 * h; l < 16 * h + 16; ++l) {
            const int v = int((q[l] >> sh) & 3) - (((b.hmask[l] >> s) & 1) ? 0 : 4);
            out[l] = dl * float(v);
        }
    }
}

// Q4_K/Q5_K 6-bit scale and min of sub-block s (ggml's get_scale_min_k4).
FT_HD void k4_scale_min(const uint8_t* sc, int s, int& scale, int& min) {
    if (s < 4) {
        scale = sc[s] & 63;
        min = sc[s + 4] & 63;
    } else {
        scale = (sc[s + 4] & 0xF) | ((sc[s - 4] >> 6) << 4);
        min = (sc[s + 4] >> 4) | ((sc[s] >> 6) << 4);
    }
}

template <> FT_HD void decode32<QType::Q4_K>(const uint8_t* blk, int s, const Grids&, float* out) {
    FT_BLOCK(Q4_K);
    int sc, mn;
    k4_scale_min(b.scales, s, sc, mn);
    const float d = fp16_to_f32(b.d) * float(sc), m = fp16_to_f32(b.dmin) * float(mn);
    const uint8_t* q = b.qs + 32 * (s / 2);
    const int sh = 4 * (s % 2);
    for (int l = 0; l < 32; ++l) out[l] = ft_mul(d, float((q[l] >> sh) & 0xF)) - m;
}
template <> FT_HD void decode32<QType::Q5_K>(const uint8_t* blk, int s, const Grids&, float* out) {
    FT_BLOCK(Q5_K);
    int sc, mn;
    k4_scale_min(b.scales, s, sc, mn);
    const float d = fp16_to_f32(b.d) * float(sc), m = fp16_to_f32(b.dmin) * float(mn);
    const uint8_t* q = b.qs + 32 * (s / 2);
    const int sh = 4 * (s % 2);
    for (int l = 0; l < 32; ++l) {
        const int v = ((q[l] >> sh) & 0xF) | (((b.qh[l] >> s) & 1) << 4);
        out[l] = ft_mul(d, float(v)) - m;
    }
}
template <> FT_HD void decode32<QType::Q6_K>(const uint8_t* blk, int s, const Grids&, float* out) {
    FT_BLOCK(Q6_K);
    const float d = fp16_to_f32(b.d);
    const int half = s / 4, r = s % 4;  // 128-weight half, 32-weight row within it
    const uint8_t* ql = b.ql + 64 * half + 32 * (r % 2);
    const uint8_t* qh = b.qh + 32 * half;
    for (int h = 0; h < 2; ++h) {
        const float dl = d * float(b.scales[2 * s + h]);
        for (int l = 16 * h; l < 16 * h + 16; ++l) {
            const int v = ((ql[l] >> (4 * (r / 2))) & 0xF) | (((qh[l] >> (2 * r)) & 3) << 4);
            out[l] = dl * float(v - 32);
        }
    }
}

// I types (grids from gguf-py). Sign bits: bit j of a sign byte negates weight j of its group of 8.
FT_HD float apply_sign(float v, int bits, int j) { return (bits >> j) & 1 ? -v : v; }

template <> FT_HD void decode32<QType::IQ1_S>(const uint8_t* blk, int s, const Grids& g, float* out) {
    FT_BLOCK(IQ1_S);
    const uint16_t qh = b.qh[s];
    const float dl = fp16_to_f32(b.d) * float(2 * ((qh >> 12) & 7) + 1);
    const float delta = (qh & 0x8000) ? -0.125f : 0.125f;
    for (int k = 0; k < 4; ++k) {
        const uint64_t e = g.iq1s[b.qs[4 * s + k] | (((qh >> (3 * k)) & 7) << 8)];
        for (int j = 0; j < 8; ++j) out[8 * k + j] = dl * (float(int8_t(grid_byte(e, j))) + delta);
    }
}
template <> FT_HD void decode32<QType::IQ1_M>(const uint8_t* blk, int s, const Grids& g, float* out) {
    FT_BLOCK(IQ1_M);
    const uint16_t dbits = uint16_t((b.scales[0] >> 12) | ((b.scales[1] >> 8) & 0x00F0) |
                                    ((b.scales[2] >> 4) & 0x0F00) | (b.scales[3] & 0xF000));
    const float d = fp16_to_f32(dbits);
    for (int h = 0; h < 2; ++h) {  // 16 weights per 3-bit scale
        const int sc = (b.scales[s / 2] >> (6 * (s % 2) + 3 * h)) & 7;
        const float dl = d * float(2 * sc + 1);
        for (int k = 0; k < 2; ++k) {  // groups of 8: grid index + delta sign from a qh nibble
            const int grp = 4 * s + 2 * h + k;
            const int nib = (b.qh[grp / 2] >> (4 * (grp % 2))) & 0xF;
            const uint64_t e = g.iq1s[b.qs[grp] | ((nib & 7) << 8)];
            const float delta = (nib & 8) ? -0.125f : 0.125f;
            for (int j = 0; j < 8; ++j)
                out[16 * h + 8 * k + j] = dl * (float(int8_t(grid_byte(e, j))) + delta);
        }
    }
}
template <> FT_HD void decode32<QType::IQ2_XXS>(const uint8_t* blk, int s, const Grids& g, float* out) {
    FT_BLOCK(IQ2_XXS);
    const uint32_t idx = ld_u32(reinterpret_cast<const uint8_t*>(b.qs + 4 * s));
    const uint32_t aux = ld_u32(reinterpret_cast<const uint8_t*>(b.qs + 4 * s + 2));
    const float db = fp16_to_f32(b.d) * (0.5f + float(aux >> 28)) * 0.25f;
    for (int k = 0; k < 4; ++k) {
        const uint64_t e = g.iq2xxs[(idx >> (8 * k)) & 0xFF];
        const int signs = g.ksigns[(aux >> (7 * k)) & 127];
        for (int j = 0; j < 8; ++j) out[8 * k + j] = apply_sign(db * float(grid_byte(e, j)), signs, j);
    }
}
template <> FT_HD void decode32<QType::IQ2_XS>(const uint8_t* blk, int s, const Grids& g, float* out) {
    FT_BLOCK(IQ2_XS);
    const float d = fp16_to_f32(b.d);
    for (int k = 0; k < 4; ++k) {
        const float db = d * (0.5f + float((b.scales[s] >> (4 * (k / 2))) & 0xF)) * 0.25f;
        const uint16_t q = b.qs[4 * s + k];
        const uint64_t e = g.iq2xs[q & 511];
        const int signs = g.ksigns[q >> 9];
        for (int j = 0; j < 8; ++j) out[8 * k + j] = apply_sign(db * float(grid_byte(e, j)), signs, j);
    }
}
template <> FT_HD void decode32<QType::IQ2_S>(const uint8_t* blk, int s, const Grids& g, float* out) {
    FT_BLOCK(IQ2_S);
    const float d = fp16_to_f32(b.d);
    for (int k = 0; k < 4; ++k) {
        const float db = d * (0.5f + float((b.scales[s] >> (4 * (k / 2))) & 0xF)) * 0.25f;
        const int i = 4 * s + k;
        const uint64_t e = g.iq2s[b.qs[i] | (((b.qh[s] >> (2 * k)) & 3) << 8)];
        for (int j = 0; j < 8; ++j) out[8 * k + j] = apply_sign(db * float(grid_byte(e, j)), b.signs[i], j);
    }
}
template <> FT_HD void decode32<QType::IQ3_XXS>(const uint8_t* blk, int s, const Grids& g, float* out) {
    FT_BLOCK(IQ3_XXS);
    const uint32_t aux = ld_u32(b.scales_signs + 4 * s);
    const float db = fp16_to_f32(b.d) * (0.5f + float(aux >> 28)) * 0.5f;
    for (int k = 0; k < 4; ++k) {  // 8 weights = 2 grid entries of 4, one 7-bit sign index
        const int signs = g.ksigns[(aux >> (7 * k)) & 127];
        const uint32_t e0 = g.iq3xxs[b.qs[8 * s + 2 * k]], e1 = g.iq3xxs[b.qs[8 * s + 2 * k + 1]];
        for (int j = 0; j < 4; ++j) {
            out[8 * k + j] = apply_sign(db * float(grid_byte(e0, j)), signs, j);
            out[8 * k + 4 + j] = apply_sign(db * float(grid_byte(e1, j)), signs, j + 4);
        }
    }
}
template <> FT_HD void decode32<QType::IQ3_S>(const uint8_t* blk, int s, const Grids& g, float* out) {
    FT_BLOCK(IQ3_S);
    const float db = fp16_to_f32(b.d) * float(1 + 2 * ((b.scales[s / 2] >> (4 * (s % 2))) & 0xF));
    for (int k = 0; k < 8; ++k) {  // 8 grid entries of 4 weights; 9th index bit in qh[s]
        const uint32_t e = g.iq3s[b.qs[8 * s + k] | (((b.qh[s] >> k) & 1) << 8)];
        const int signs = b.signs[4 * s + k / 2];
        for (int j = 0; j < 4; ++j)
            out[4 * k + j] = apply_sign(db * float(grid_byte(e, j)), signs, 4 * (k % 2) + j);
    }
}
template <> FT_HD void decode32<QType::IQ3_S_N4>(const uint8_t* blk, int s, const Grids&, float* out) {
    FT_BLOCK(IQ3_S_N4);
    // IQ3_S's float steps: (d * (1 + 2 * scale)) * w, w = 2 * code - 15
    const float db = fp16_to_f32(b.d) * float(1 + 2 * ((b.scales[s / 2] >> (4 * (s % 2))) & 0xF));
    const uint8_t* q = b.qs + 32 * (s / 2);
    for (int j = 0; j < 32; ++j) out[j] = db * float(2 * ((q[j] >> (4 * (s % 2))) & 0xF) - 15);
}
template <> FT_HD void decode32<QType::IQ4_NL>(const uint8_t* blk, int, const Grids& g, float* out) {
    FT_BLOCK(IQ4_NL);
    const float d = fp16_to_f32(b.d);
    for (int j = 0; j < 16; ++j) {
        out[j] = d * float(g.kvalues_iq4nl[b.qs[j] & 0xF]);
        out[j + 16] = d * float(g.kvalues_iq4nl[b.qs[j] >> 4]);
    }
}
template <> FT_HD void decode32<QType::IQ4_XS>(const uint8_t* blk, int s, const Grids& g, float* out) {
    FT_BLOCK(IQ4_XS);
    const int ls = ((b.scales_l[s / 2] >> (4 * (s % 2))) & 0xF) | (((b.scales_h >> (2 * s)) & 3) << 4);
    const float dl = fp16_to_f32(b.d) * float(ls - 32);
    const uint8_t* q = b.qs + 16 * s;
    for (int j = 0; j < 16; ++j) {
        out[j] = dl * float(g.kvalues_iq4nl[q[j] & 0xF]);
        out[j + 16] = dl * float(g.kvalues_iq4nl[q[j] >> 4]);
    }
}

// Ternary. TQ1_0 packs 5 trits per byte (base-3 fixed point: trit k of byte q is
// ((uint8)(q * 3^k) * 3) >> 8): qs[0..32) hold weights 0..159 (trit k -> 32k + l),
// qs[32..48) weights 160..239 (16k + l), qh[0..4) weights 240..255 (4 trits, 4k + l).
FT_HD int tq1_trit(uint8_t q, int k) {
    const uint8_t pow3[5] = {1, 3, 9, 27, 81};
    return ((uint8_t(q * pow3[k]) * 3) >> 8) - 1;
}
template <> FT_HD void decode32<QType::TQ1_0>(const uint8_t* blk, int s, const Grids&, float* out) {
    FT_BLOCK(TQ1_0);
    const float d = fp16_to_f32(b.d);
    for (int l = 0; l < 32; ++l) {
        const int n = 32 * s + l;  // weight index in the block
        int t;
        if (n < 160) t = tq1_trit(b.qs[n % 32], n / 32);
        else if (n < 240) t = tq1_trit(b.qs[32 + (n - 160) % 16], (n - 160) / 16);
        else t = tq1_trit(b.qh[(n - 240) % 4], (n - 240) / 4);
        out[l] = d * float(t);
    }
}
template <> FT_HD void decode32<QType::TQ2_0>(const uint8_t* blk, int s, const Grids&, float* out) {
    FT_BLOCK(TQ2_0);
    const float d = fp16_to_f32(b.d);
    const uint8_t* q = b.qs + 32 * (s / 4);
    const int sh = 2 * (s % 4);
    for (int l = 0; l < 32; ++l) out[l] = d * float(int((q[l] >> sh) & 3) - 1);
}

template <> FT_HD void decode32<QType::MXFP4>(const uint8_t* blk, int, const Grids& g, float* out) {
    FT_BLOCK(MXFP4);
    const float d = e8m0_half_to_f32(b.e);
    for (int j = 0; j < 16; ++j) {
        out[j] = d * float(g.kvalues_mxfp4[b.qs[j] & 0xF]);
        out[j + 16] = d * float(g.kvalues_mxfp4[b.qs[j] >> 4]);
    }
}

#undef FT_BLOCK

}  // namespace ft
