// ftpatch: every ggml weight type, declared once, shared by the CPU (g++) and CUDA (nvcc) kernels.
//
// Contract (what every kernel relies on; torch-free, no allocation, no globals except the grids):
//   FT_QUANT_TYPES(X)      X-macro over the types the kernels handle:
//                          X(NAME, ggml_type_id, block_elems, block_bytes)
//   struct Traits<NAME>    static constants: id, block_elems, block_bytes, subs (= block_elems/32)
//   decode32<NAME>(blk, sub, grids, out)
//                          writes the 32 float weights [32*sub, 32*sub+32) of the block at `blk`
//                          into out[0..32). Bit-exact with ggml's dequantize_row_* (float32 math
//                          in the same order). `grids` holds the IQ lookup tables, on the same side
//                          (host or device) as the caller.
//   Grids                  pointers to the IQ tables, filled at run time from gguf-py's tables
//                          (never pasted into our sources).
// Adding a type = one Traits/decoder here + one X entry + one row in loaders/quants.py.
#pragma once
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define FT_HD __host__ __device__ __forceinline__
#else
#define FT_HD inline
#endif

namespace ft {

// IQ lookup tables as ggml lays them out (see shared/docs/ggml-quants.md "IQ grid tables").
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

// ggml type ids, as stored in GGUF.
enum class QType : int {
    F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8,
    Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14,
    IQ2_XXS = 16, IQ2_XS = 17, IQ3_XXS = 18, IQ1_S = 19, IQ4_NL = 20, IQ3_S = 21, IQ2_S = 22,
    IQ4_XS = 23, IQ1_M = 29, BF16 = 30, TQ1_0 = 34, TQ2_0 = 35, MXFP4 = 39,
};

// X(NAME, block_elems, block_bytes) for every type the kernels handle; NAME is a QType member.
#define FT_QUANT_TYPES(X) \
    X(F32, 1, 4) X(F16, 1, 2) X(BF16, 1, 2) \
    X(Q4_0, 32, 18) X(Q4_1, 32, 20) X(Q5_0, 32, 22) X(Q5_1, 32, 24) X(Q8_0, 32, 34) \
    X(Q2_K, 256, 84) X(Q3_K, 256, 110) X(Q4_K, 256, 144) X(Q5_K, 256, 176) X(Q6_K, 256, 210) \
    X(IQ1_S, 256, 50) X(IQ1_M, 256, 56) X(IQ2_XXS, 256, 66) X(IQ2_XS, 256, 74) X(IQ2_S, 256, 82) \
    X(IQ3_XXS, 256, 98) X(IQ3_S, 256, 110) X(IQ4_NL, 32, 18) X(IQ4_XS, 256, 136) \
    X(TQ1_0, 256, 54) X(TQ2_0, 256, 66) X(MXFP4, 32, 17)

template <QType T> struct Traits;  // id, block_elems, block_bytes, subs (32-weight groups per block)

// Weights [32*sub, 32*sub + 32) of the block at `blk` -> out[0..32), bit-exact with ggml.
// Float types (block of 1 element) decode 32 consecutive elements starting at `blk` (sub = 0).
template <QType T> FT_HD void decode32(const uint8_t* blk, int sub, const Grids& g, float* out);

}  // namespace ft
