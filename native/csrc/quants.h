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

}  // namespace ft
