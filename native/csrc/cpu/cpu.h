// ftpatch CPU kernels: internal declarations shared by the cpu/*.cpp files (torch-free).
//
// Layering: quants.h (decode32 per type) -> per-ISA row kernels (kernels_generic.cpp,
// kernels_avx2.cpp) -> ops (dequantize.cpp, matmul.cpp, moe_ffn.cpp) -> bindings_cpu.cpp.
// The ops are ISA-agnostic: they split work over the thread pool and call the row kernels of
// the ISA chosen at load time (CPUID, or FTPATCH_CPU_ISA=generic|avx2).
#pragma once
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "quants.h"

namespace ft::cpu {

constexpr int kMaxTypeId = 64;  // ggml ids are < 64; tables are indexed by id

// ---- row kernels of one type on one ISA --------------------------------------------------------
// A row is `nkb` kernel blocks (Traits::kb_bytes each, contiguous) = nkb * kb_elems weights.

// out[0 .. nkb*kb_elems) = the row's weights as float, bit-exact with decode32.
using DecodeRowFn = void (*)(const uint8_t* row, int64_t nkb, float* out, const Grids& g);
// out[t*ldo] = dot(row, x + t*ldx) for t < nt (any nt >= 1). Float32 accumulation, FMA allowed.
using DotRowFn = void (*)(const uint8_t* row, int64_t nkb, const float* x, int64_t ldx, int nt,
                          float* out, int64_t ldo, const Grids& g);

struct TypeKernels {
    DecodeRowFn decode_row = nullptr;
    DotRowFn dot_row = nullptr;
    int kb_elems = 0, kb_bytes = 0;
    const char* name = nullptr;
    bool needs_grids = false;
};

struct IsaKernels {
    const char* name = nullptr;
    TypeKernels types[kMaxTypeId];
};

// Per-ISA tables (defined in kernels_<isa>.cpp). The AVX2 table starts from the generic one and
// overrides what it accelerates.
void fill_generic(IsaKernels& k);
void fill_avx2(IsaKernels& k);

// ---- dispatch and tables (dispatch.cpp) -----------------------------------------------------------
const IsaKernels& kernels();                // the active ISA's table
std::vector<std::string> available_isas();  // best last; what this CPU can run
void set_isa(const std::string& name);      // throws std::invalid_argument if unavailable
// The kernels of a type id, checked: throws std::invalid_argument naming the type if it is
// unknown, or needs the IQ tables and set_tables() has not run.
const TypeKernels& type_kernels(int type_id);
const Grids& grids();
void set_table(const std::string& name, const void* data, size_t nbytes);  // copies
bool tables_ready();

// ---- thread pool (threadpool.cpp) -----------------------------------------------------------------
int num_threads();
void set_num_threads(int n);  // n <= 0: all cores this process may use
// Calls fn(begin, end) over [0, n) in chunks of `grain`, on all pool threads plus the caller.
// One parallel_for runs at a time (callers from several Python threads queue).
void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

// ---- ops (one file each) ------------------------------------------------------------------------
// dst_dtype: ggml id of the output element type: 0 (F32), 1 (F16), 30 (BF16).
void dequantize(int type_id, const uint8_t* src, int64_t n_rows, int64_t n_cols,
                int64_t src_row_stride, void* dst, int dst_dtype);
void matmul(int type_id, const uint8_t* w, int64_t n_out, int64_t n_in, int64_t w_row_stride,
            const float* x, int64_t n_tok, float* y);
struct Bank {  // one expert weight bank [E, rows, cols]: rows contiguous inside an expert
    int type_id;
    const uint8_t* base;
    int64_t expert_stride;  // bytes from expert e to e+1
};
void moe_ffn(const float* x, int64_t n_tok, int64_t hidden, int64_t ff, int64_t n_experts,
             const int32_t* ids, const float* weights, int64_t top_k, const Bank& gate,
             const Bank& up, const Bank& down, float* y);

// Row geometry check shared by the ops: n_cols weights of `k` per row.
int64_t row_kblocks(const TypeKernels& k, int64_t n_cols, const char* what);

}  // namespace ft::cpu
