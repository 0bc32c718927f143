// Per-unit dot products: one "unit" is 32 consecutive weights of a row (sub-block `sub` of a kernel
// block, quants.h) against 32 values of the activation vector(s). Two families:
//
//   F32Policy<T>  any type: decode32<T> (bit-exact floats) and float32 FMA with float32 x.
//   Q8Policy<T>   types with a Q8Unit<T> below: the weights as int8 words plus per-16/32 scales,
//                 x rounded per 32 values to int8 (d = amax/127), __dp4a, float32 scale sums.
//                 ~4x fewer instructions per weight, which is what makes 3-4 bit types
//                 bandwidth-bound instead of issue-bound (an int->float convert alone is
//                 quarter rate).
//
// A type gets the q8 path by adding a Q8Unit specialization here; every other type runs
// F32Policy with no code of its own. The Q8Unit loaders are FT_HD so a CPU test can hold them
// against decode32.
//
// x layouts (shared memory, and the moe scratch, which is copied there as is):
//   q8:  q int8 [nvec][ng][32] then ds float2 [nvec][ng] = (d, d * sum q); x ~ d * q.
//        The two 16-byte halves of group g are stored swapped when (g >> 2) & 1, so that the 8
//        lanes of one 128-bit shared-memory phase, reading 8 consecutive groups, hit distinct banks.
//   f32: float [nvec][ng][36] (32 values + 4 pad): 144-byte groups, conflict-free the same way.
#pragma once
#include <type_traits>

#include "cuda/common.cuh"

namespace ft::cuda {

// ---- loads from shared memory at the alignment a block start guarantees ---------------------------

// Little-endian 32-bit word at a 2-aligned address, from the two aligned words around it.
// (The aligned address is p minus an offset, not an integer cast back: the compiler then still
// knows p's state space, and loads from shared memory stay shared loads.)
FT_HD uint32_t ld32_a2(const uint8_t* p) {
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    const uint32_t* w = reinterpret_cast<const uint32_t*>(p - (a & 3));
    return funnel_r(w[0], w[1], uint32_t(a & 2) * 8);
}

// N consecutive words at a 2-aligned address (N + 1 aligned loads; may read 2 bytes past the end).
template <int N> FT_HD void ld32n_a2(const uint8_t* p, uint32_t (&out)[N]) {
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    const uint32_t* w = reinterpret_cast<const uint32_t*>(p - (a & 3));
    const uint32_t sh = uint32_t(a & 2) * 8;
    uint32_t r[N + 1];
#pragma unroll
    for (int i = 0; i <= N; ++i) r[i] = w[i];
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = funnel_r(r[i], r[i + 1], sh);
}

FT_HD uint32_t ld16(const uint8_t* p) { return *reinterpret_cast<const uint16_t*>(p); }

// 16-entry int8 lookup of 4 indices at once: byte j of `idx` (0..15) -> byte j of the result,
// from the table in kv[0..3] (entry i = byte i%4 of kv[i/4]).
FT_HD uint32_t lut16(uint32_t idx, const uint32_t (&kv)[4]) {
    const uint32_t lo3 = idx & 0x07070707u;
    const uint32_t sel = prmt(lo3 | (lo3 >> 4), 0, 0x4420);  // nibble j = low 3 bits of index j
    const uint32_t lo = prmt(kv[0], kv[1], sel), hi = prmt(kv[2], kv[3], sel);
    const uint32_t m = ((idx >> 3) & 0x01010101u) * 0xFFu;     // 0xFF where the index is >= 8
    return (lo & ~m) | (hi & m);
}

// Bytes of `w` negated where bit j of the nibble `sn` is set (w's bytes must be 1..127).
FT_HD uint32_t apply_signs4(uint32_t w, uint32_t sn) {
    const uint32_t b = (sn * 0x00204081u) & 0x01010101u;  // bit j -> bit 0 of byte j
    return (w ^ (b * 0xFFu)) + b;                          // ~w + 1 per negated byte, no carries
}

// 6-bit scale and min of sub-block s of Q4_K/Q5_K from the 12 scale bytes in words a, b, c.
FT_HD void k4_scale_min_words(uint32_t a, uint32_t b, uint32_t c, int s, int& sc, int& mn) {
    auto sb = [&](int j) -> int {
        const uint32_t w = j < 4 ? a : (j < 8 ? b : c);
        return int((w >> (8 * (j & 3))) & 0xFF);
    };
    if (s < 4) {
        sc = sb(s) & 63;
        mn = sb(s + 4) & 63;
    } else {
        sc = (sb(s + 4) & 0xF) | ((sb(s - 4) >> 6) << 4);
        mn = (sb(s + 4) >> 4) | ((sb(s) >> 6) << 4);
    }
}

// Tables a Q8Unit reads: grids copied to shared memory, small ones held in registers.
struct Q8Tables {
    const uint32_t* iq3s = nullptr;  // Grids::iq3s [512] (one of the copies in shared memory)
    uint32_t kv[4] = {0, 0, 0, 0};   // kvalues_iq4nl as 4 words
};

// ---- int8 unit decoders ----------------------------------------------------------------------------
// load(blk, sub, tab, q, d0, d1, m): weights j = 0..31 of sub-block `sub` as q[j/4] byte j%4 (int8),
// with w[j] = (j < 16 ? d0 : d1) * q_j - m. kTwoScales: d1 may differ from d0; kMin: m may be
// nonzero. kAlign: alignment of the block start the loads rely on (gcd(16, kb_bytes)).
// kTableBytes: shared memory for load_tables().
template <QType T> struct Q8Unit {
    static constexpr bool kAvailable = false;
};

template <> struct Q8Unit<QType::Q4_K> {
    static constexpr bool kAvailable = true, kTwoScales = false, kMin = true;
    static constexpr int kAlign = 16, kTableBytes = 0;
    FT_HD static void load(const uint8_t* blk, int s, const Q8Tables&, uint32_t (&q)[8], float& d0,
                           float& d1, float& m) {
        const uint4 h = *reinterpret_cast<const uint4*>(blk);  // d, dmin | scales[0..11]
        const uint4* qp = reinterpret_cast<const uint4*>(blk + 16 + 32 * (s >> 1));
        const uint4 a = qp[0], b = qp[1];
        const int sh = 4 * (s & 1);  // sub-blocks 2c, 2c+1: low, high nibbles of chunk c
        q[0] = (a.x >> sh) & 0x0F0F0F0Fu; q[1] = (a.y >> sh) & 0x0F0F0F0Fu;
        q[2] = (a.z >> sh) & 0x0F0F0F0Fu; q[3] = (a.w >> sh) & 0x0F0F0F0Fu;
        q[4] = (b.x >> sh) & 0x0F0F0F0Fu; q[5] = (b.y >> sh) & 0x0F0F0F0Fu;
        q[6] = (b.z >> sh) & 0x0F0F0F0Fu; q[7] = (b.w >> sh) & 0x0F0F0F0Fu;
        int sc, mn;
        k4_scale_min_words(h.y, h.z, h.w, s, sc, mn);
        d0 = d1 = half_bits_to_f32(h.x & 0xFFFF) * float(sc);
        m = half_bits_to_f32(h.x >> 16) * float(mn);
    }
};

template <> struct Q8Unit<QType::Q6_K> {
    static constexpr bool kAvailable = true, kTwoScales = true, kMin = false;
    static constexpr int kAlign = 2, kTableBytes = 0;
    FT_HD static void load(const uint8_t* blk, int s, const Q8Tables&, uint32_t (&q)[8], float& d0,
                           float& d1, float& m) {
        const int half = s >> 2, r = s & 3;  // 128-weight half, 32-weight row in it
        uint32_t lo[8], hi[8];
        ld32n_a2<8>(blk + 64 * half + 32 * (r & 1), lo);  // ql: nibble r/2
        ld32n_a2<8>(blk + 128 + 32 * half, hi);           // qh: bits 2r, 2r+1
        const int shl = 4 * (r >> 1), shh = 2 * r;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const uint32_t v = ((lo[i] >> shl) & 0x0F0F0F0Fu) | (((hi[i] >> shh) & 0x03030303u) << 4);
            q[i] = ((v | 0x80808080u) - 0x20202020u) ^ 0x80808080u;  // v - 32 per byte, no borrows
        }
        const uint32_t sc = ld16(blk + 192 + 2 * s);  // int8 scales 2s, 2s+1
        const float d = half_bits_to_f32(ld16(blk + 208));
        d0 = d * float(int8_t(sc & 0xFF));
        d1 = d * float(int8_t(sc >> 8));
        m = 0.f;
    }
};

template <> struct Q8Unit<QType::IQ4_XS> {
    static constexpr bool kAvailable = true, kTwoScales = false, kMin = false;
    static constexpr int kAlign = 8, kTableBytes = 0;
    FT_HD static void load(const uint8_t* blk, int s, const Q8Tables& tab, uint32_t (&q)[8],
                           float& d0, float& d1, float& m) {
        const uint2 h = *reinterpret_cast<const uint2*>(blk);  // d, scales_h | scales_l[4]
        const uint2* qp = reinterpret_cast<const uint2*>(blk + 8 + 16 * s);
        const uint2 a = qp[0], b = qp[1];
        const uint32_t w[4] = {a.x, a.y, b.x, b.y};
#pragma unroll
        for (int i = 0; i < 4; ++i) {  // low nibbles: weights 0..15, high: 16..31
            q[i] = lut16(w[i] & 0x0F0F0F0Fu, tab.kv);
            q[4 + i] = lut16((w[i] >> 4) & 0x0F0F0F0Fu, tab.kv);
        }
        const int ls = int((h.y >> (4 * s)) & 0xF) | int(((h.x >> (16 + 2 * s)) & 3) << 4);
        d0 = d1 = half_bits_to_f32(h.x & 0xFFFF) * float(ls - 32);
        m = 0.f;
    }
};

template <> struct Q8Unit<QType::IQ3_S> {
    static constexpr bool kAvailable = true, kTwoScales = false, kMin = false;
    static constexpr int kAlign = 2, kTableBytes = 512 * 4;
    FT_HD static void load(const uint8_t* blk, int s, const Q8Tables& tab, uint32_t (&q)[8],
                           float& d0, float& d1, float& m) {
        uint32_t qs[2];
        ld32n_a2<2>(blk + 2 + 8 * s, qs);            // 8 low index bytes
        const uint32_t qh = blk[66 + s];             // 9th index bits
        const uint32_t sg = ld32_a2(blk + 74 + 4 * s);  // 32 sign bits
        const uint32_t sc = (uint32_t(blk[106 + (s >> 1)]) >> (4 * (s & 1))) & 0xF;
        // bit k of qh into bit 0 of byte k % 4 of hb[k / 4]; then one byte permute puts two
        // entries' 9-bit indices side by side (low byte from qs, high byte from hb)
        const uint32_t hb[2] = {((qh & 0xF) * 0x00204081u) & 0x01010101u,
                                ((qh >> 4) * 0x00204081u) & 0x01010101u};
#pragma unroll
        for (int k = 0; k < 8; k += 2) {
            const uint32_t b = k & 3;  // bytes b, b + 1 of qs[k / 4] and of hb[k / 4]
            const uint32_t sel = b | ((b + 4) << 4) | ((b + 1) << 8) | ((b + 5) << 12);
            const uint32_t two = prmt(qs[k >> 2], hb[k >> 2], sel);
            q[k] = apply_signs4(tab.iq3s[two & 0xFFFF], (sg >> (4 * k)) & 0xF);
            q[k + 1] = apply_signs4(tab.iq3s[two >> 16], (sg >> (4 * k + 4)) & 0xF);
        }
        d0 = d1 = half_bits_to_f32(ld16(blk)) * float(1 + 2 * int(sc));
        m = 0.f;
    }
};

// Per-byte v - c for bytes v in 0..127 and c <= 0x7F (no borrow crosses a byte).
FT_HD uint32_t sub_bytes(uint32_t v, uint32_t c) { return ((v | 0x80808080u) - c) ^ 0x80808080u; }

template <> struct Q8Unit<QType::Q8_0> {
    static constexpr bool kAvailable = true, kTwoScales = false, kMin = false;
    static constexpr int kAlign = 2, kTableBytes = 0;
    FT_HD static void load(const uint8_t* blk, int, const Q8Tables&, uint32_t (&q)[8], float& d0,
                           float& d1, float& m) {
        ld32n_a2<8>(blk + 2, q);  // the int8 weights as they are
        d0 = d1 = half_bits_to_f32(ld16(blk));
        m = 0.f;
    }
};

template <> struct Q8Unit<QType::Q4_0> {
    static constexpr bool kAvailable = true, kTwoScales = false, kMin = false;
    static constexpr int kAlign = 2, kTableBytes = 0;
    FT_HD static void load(const uint8_t* blk, int, const Q8Tables&, uint32_t (&q)[8], float& d0,
                           float& d1, float& m) {
        uint32_t w[4];
        ld32n_a2<4>(blk + 2, w);
#pragma unroll
        for (int i = 0; i < 4; ++i) {  // low nibbles: weights 0..15, high: 16..31; value - 8
            q[i] = sub_bytes(w[i] & 0x0F0F0F0Fu, 0x08080808u);
            q[4 + i] = sub_bytes((w[i] >> 4) & 0x0F0F0F0Fu, 0x08080808u);
        }
        d0 = d1 = half_bits_to_f32(ld16(blk));
        m = 0.f;
    }
};

template <> struct Q8Unit<QType::IQ4_NL> {
    static constexpr bool kAvailable = true, kTwoScales = false, kMin = false;
    static constexpr int kAlign = 2, kTableBytes = 0;
    FT_HD static void load(const uint8_t* blk, int, const Q8Tables& tab, uint32_t (&q)[8],
                           float& d0, float& d1, float& m) {
        uint32_t w[4];
        ld32n_a2<4>(blk + 2, w);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            q[i] = lut16(w[i] & 0x0F0F0F0Fu, tab.kv);
            q[4 + i] = lut16((w[i] >> 4) & 0x0F0F0F0Fu, tab.kv);
        }
        d0 = d1 = half_bits_to_f32(ld16(blk));
        m = 0.f;
    }
};

template <> struct Q8Unit<QType::Q5_K> {
    static constexpr bool kAvailable = true, kTwoScales = false, kMin = true;
    static constexpr int kAlign = 16, kTableBytes = 0;
    FT_HD static void load(const uint8_t* blk, int s, const Q8Tables&, uint32_t (&q)[8], float& d0,
                           float& d1, float& m) {
        const uint4 h = *reinterpret_cast<const uint4*>(blk);  // d, dmin | scales[0..11]
        const uint4* hp = reinterpret_cast<const uint4*>(blk + 16);            // qh[32]
        const uint4* qp = reinterpret_cast<const uint4*>(blk + 48 + 32 * (s >> 1));
        const uint4 h0 = hp[0], h1 = hp[1], a = qp[0], b = qp[1];
        const uint32_t lo[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
        const uint32_t hi[8] = {h0.x, h0.y, h0.z, h0.w, h1.x, h1.y, h1.z, h1.w};
        const int sh = 4 * (s & 1);
#pragma unroll
        for (int i = 0; i < 8; ++i)
            q[i] = ((lo[i] >> sh) & 0x0F0F0F0Fu) | (((hi[i] >> s) & 0x01010101u) << 4);
        int sc, mn;
        k4_scale_min_words(h.y, h.z, h.w, s, sc, mn);
        d0 = d1 = half_bits_to_f32(h.x & 0xFFFF) * float(sc);
        m = half_bits_to_f32(h.x >> 16) * float(mn);
    }
};

template <> struct Q8Unit<QType::Q3_K> {
    static constexpr bool kAvailable = true, kTwoScales = true, kMin = false;
    static constexpr int kAlign = 2, kTableBytes = 0;
    FT_HD static void load(const uint8_t* blk, int s, const Q8Tables&, uint32_t (&q)[8], float& d0,
                           float& d1, float& m) {
        uint32_t hm[8], qs[8], sw[3];
        ld32n_a2<8>(blk, hm);                    // hmask[32]: bit s = high bit of weight l
        ld32n_a2<8>(blk + 32 + 32 * (s >> 2), qs);  // 2-bit values, shift 2 * (s % 4)
        ld32n_a2<3>(blk + 96, sw);               // 16 6-bit scales, packed
        const int sh = 2 * (s & 3);
#pragma unroll
        for (int i = 0; i < 8; ++i) {  // q2 - (hbit ? 0 : 4) = (q2 | hbit << 2) - 4
            const uint32_t v = ((qs[i] >> sh) & 0x03030303u) | (((hm[i] >> s) & 0x01010101u) << 2);
            q[i] = sub_bytes(v, 0x04040404u);
        }
        auto sb = [&](int j) -> int {
            const uint32_t w = j < 4 ? sw[0] : (j < 8 ? sw[1] : sw[2]);
            return int((w >> (8 * (j & 3))) & 0xFF);
        };
        auto scale = [&](int i) -> int {  // low 4 bits in byte i%8 (nibble i/8), high 2 in 8 + i%4
            return (((sb(i % 8) >> (4 * (i / 8))) & 0xF) | (((sb(8 + i % 4) >> (2 * (i / 4))) & 3) << 4)) - 32;
        };
        const float d = half_bits_to_f32(ld16(blk + 108));
        d0 = d * float(scale(2 * s));
        d1 = d * float(scale(2 * s + 1));
        m = 0.f;
    }
};

#if defined(__CUDACC__) || defined(FT_CUDA_EMULATE)

// ---- policies ------------------------------------------------------------------------------------
// A view of nvec activation vectors of ng groups in one of the layouts above.
struct XView {
    const uint8_t* base;
    int ng, nvec;
};

// x vector of token t of a tile whose tokens are `tmask` (rows.cuh, Map::kCompactX).
template <bool kCompact> __device__ __forceinline__ int x_vector(int xvec, uint32_t tmask, int t) {
    if constexpr (kCompact) return xvec + __popc(tmask & ((1u << t) - 1u));
    return xvec + t;
}

template <QType T> struct Q8Policy {
    using U = Q8Unit<T>;
    static constexpr QType kType = T;
    static constexpr bool kQ8 = true;
    static constexpr int kStages = 4;
    static constexpr int kKbBytes = Traits<T>::kb_bytes, kSubs = Traits<T>::subs;
    static constexpr int kTableBytes = U::kTableBytes;
    static constexpr int kAlign = U::kAlign;
    Q8Tables tab;

    // Block-cooperative: `copies` copies of the table this type reads into shared memory `dst`,
    // copy c from word c * (entries + 1): entry i of copy c sits in bank (i + c) % 32, so lanes
    // reading different copies spread their lookups over the banks, and a lookup is one add.
    static constexpr int kTableWords = kTableBytes / 4;
    __device__ static void load_tables(uint8_t* dst, const Grids& g, int copies) {
        if constexpr (kTableBytes > 0) {
            static_assert(T == QType::IQ3_S, "only IQ3_S keeps a table in shared memory");
            uint32_t* d = reinterpret_cast<uint32_t*>(dst);
            for (int i = threadIdx.x; i < kTableWords * copies; i += blockDim.x) {
                const int c = i / kTableWords, e = i - c * kTableWords;
                d[c * (kTableWords + 1) + e] = __ldg(g.iq3s + e);
            }
        }
    }
    // Shared memory for `copies` copies of the table.
    static constexpr size_t table_bytes(int copies) {
        return kTableBytes ? size_t(copies) * (kTableWords + 1) * 4 : 0;
    }
    __device__ Q8Policy(const uint8_t* tables, const Grids& g, int copies, int lane) {
        tab.iq3s = reinterpret_cast<const uint32_t*>(tables) + (lane & (copies - 1)) * (kTableWords + 1);
        if (g.kvalues_iq4nl) {
            const uint32_t* kv = reinterpret_cast<const uint32_t*>(g.kvalues_iq4nl);
#pragma unroll
            for (int i = 0; i < 4; ++i) tab.kv[i] = __ldg(kv + i);
        }
    }

    // acc[b][t] += dot(unit b, x of token t) for the tokens t of tmask and the units b that are
    // `on` (RB rows' units of one group g, decoded first, so each token's x is read once for all
    // of them; each (b, t) gets the same arithmetic whatever RB and the other tokens are).
    template <int NT, int RB, bool kCompact>
    __device__ __forceinline__ void dot(const uint8_t* const (&blk)[RB], const bool (&on)[RB], int sub,
                                        const XView& xv, int xvec, uint32_t tmask, int g,
                                        float (&acc)[RB][NT]) const {
        uint32_t q[RB][8];
        float d0[RB], d1[RB], m[RB];
#pragma unroll
        for (int b = 0; b < RB; ++b) U::load(blk[b], sub, tab, q[b], d0[b], d1[b], m[b]);
        const float2* ds = reinterpret_cast<const float2*>(xv.base + size_t(xv.nvec) * xv.ng * 32);
        const int sw = (g >> 2) & 1;
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            if ((tmask >> t) & 1) {
                const size_t vg = size_t(x_vector<kCompact>(xvec, tmask, t)) * xv.ng + g;
                const int4* xp = reinterpret_cast<const int4*>(xv.base + vg * 32);
                const int4 a = xp[sw], c = xp[sw ^ 1];
                const float2 dx = ds[vg];
#pragma unroll
                for (int b = 0; b < RB; ++b) {
                    if (RB > 1 && !on[b]) continue;  // (the caller skips a single missing row)
                    int s0 = dp4a(q[b][0], a.x, 0);
                    s0 = dp4a(q[b][1], a.y, s0);
                    s0 = dp4a(q[b][2], a.z, s0);
                    s0 = dp4a(q[b][3], a.w, s0);
                    int s1 = dp4a(q[b][4], c.x, 0);
                    s1 = dp4a(q[b][5], c.y, s1);
                    s1 = dp4a(q[b][6], c.z, s1);
                    s1 = dp4a(q[b][7], c.w, s1);
                    const float v = U::kTwoScales ? d0[b] * float(s0) + d1[b] * float(s1)
                                                  : d0[b] * float(s0 + s1);
                    const float part = U::kMin ? dx.x * v - m[b] * dx.y : dx.x * v;
                    acc[b][t] += part;
                }
            }
        }
    }
};

template <QType T> struct F32Policy {
    static constexpr QType kType = T;
    static constexpr bool kQ8 = false;
    static constexpr int kKbBytes = Traits<T>::kb_bytes, kSubs = Traits<T>::subs;
    // Wide blocks (F32 weights: 4 KiB per 32-unit chunk) keep fewer chunks in flight.
    static constexpr int kStages = kKbBytes * (32 / kSubs) > 2048 ? 2 : 4;
    static constexpr int kTableBytes = 0;
    // decode32 reads 16-bit fields, which every type with one keeps even-sized (quants.h); an
    // odd-sized block (MXFP4) has only byte fields.
    static constexpr int kAlign = kKbBytes % 2 ? 1 : 2;
    Grids grids;

    __device__ static void load_tables(uint8_t*, const Grids&, int) {}
    static constexpr size_t table_bytes(int) { return 0; }
    __device__ F32Policy(const uint8_t*, const Grids& g, int, int) : grids(g) {}

    template <int NT, int RB, bool kCompact>
    __device__ __forceinline__ void dot(const uint8_t* const (&blk)[RB], const bool (&on)[RB], int sub,
                                        const XView& xv, int xvec, uint32_t tmask, int g,
                                        float (&acc)[RB][NT]) const {
#pragma unroll
        for (int b = 0; b < RB; ++b)
            if (RB == 1 || on[b]) dot_unit<NT, kCompact>(blk[b], sub, xv, xvec, tmask, g, acc[b]);
    }

    template <int NT, bool kCompact>
    __device__ __forceinline__ void dot_unit(const uint8_t* blk, int sub, const XView& xv, int xvec,
                                             uint32_t tmask, int g, float (&acc)[NT]) const {
        float w[32];
        decode32<T>(blk, sub, grids, w);
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            if ((tmask >> t) & 1) {
                const size_t vg = size_t(x_vector<kCompact>(xvec, tmask, t)) * xv.ng + g;
                const float4* xp = reinterpret_cast<const float4*>(xv.base) + vg * 9;  // 36 floats
                float a0 = 0.f, a1 = 0.f;
#pragma unroll
                for (int i = 0; i < 8; i += 2) {
                    const float4 u = xp[i], v = xp[i + 1];
                    a0 = fmaf(w[4 * i], u.x, a0);
                    a1 = fmaf(w[4 * i + 1], u.y, a1);
                    a0 = fmaf(w[4 * i + 2], u.z, a0);
                    a1 = fmaf(w[4 * i + 3], u.w, a1);
                    a0 = fmaf(w[4 * i + 4], v.x, a0);
                    a1 = fmaf(w[4 * i + 5], v.y, a1);
                    a0 = fmaf(w[4 * i + 6], v.z, a0);
                    a1 = fmaf(w[4 * i + 7], v.w, a1);
                }
                acc[t] += a0 + a1;
            }
        }
    }
};

// The policy every kernel uses for type T.
template <QType T> struct PolicyOf {
    using type = std::conditional_t<Q8Unit<T>::kAvailable, Q8Policy<T>, F32Policy<T>>;
};
template <QType T> using PolicyFor = typename PolicyOf<T>::type;

template <QType T> constexpr bool uses_q8() { return Q8Unit<T>::kAvailable; }

#endif  // __CUDACC__ || FT_CUDA_EMULATE

}  // namespace ft::cuda
