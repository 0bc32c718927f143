// ftpatch CPU kernels: internal declarations shared by the cpu/*.cpp files (torch-free).
//
// Layering: quants.h (decode32 per type) -> per-ISA row kernels (kernels_generic.cpp,
// kernels_avx2.cpp, kernels_avx512.cpp; the int8 ones in q8_kernels.h) -> ops (dequantize.cpp, matmul.cpp, moe_ffn.cpp) -> bindings_cpu.cpp.
// The ops are ISA-agnostic: they split work over the thread pool and call the row kernels of
// the ISA chosen at load time (CPUID, or FTPATCH_CPU_ISA=generic|avx2|avx512).
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "quants.h"

namespace ft::cpu {

constexpr int kMaxTypeId = 64;  // ggml ids are < 64; tables are indexed by id

// ---- activations, prepared once per call for the active ISA ---------------------------------------
// Every ISA reads the float rows; ISAs with an integer dot product also read the q8 form
// (q8_kernels.h): per 32 features int8 q = round(x / d), d = max|x| / 127 (exactly
// native.numerics.q8_round), and per 16 features d * (sum of q), for the additive mins; and for
// the 32-weight block types the q16 form (q16_kernels.h): per 32 features int16 q = round(x / d),
// d = max|x| / 32767 (native.numerics.q16_round), and per 32 d * (sum of q). Each form is built
// only when a weight of the call reads it (ActNeeds).
struct Act {
    const float* x = nullptr;  // [nt, n] float, row stride ldx
    int64_t ldx = 0;
    const int8_t* q8 = nullptr;  // [nt, n]      (null unless the ISA quantizes)
    const float* d8 = nullptr;   // [nt, n / 32]
    const float* m16 = nullptr;  // [nt, n / 16]
    // [nt, n]: q8 + 128 with each 256-feature block's groups interleaved (q8_kernels.h: the
    // AVX-512 many-token kernels, the column-form decode of IQ3_S); null unless a weight of the
    // call reads it at nt tokens (TypeKernels::q8x_from) and n % 256 == 0
    const uint8_t* q8x = nullptr;
    const int16_t* x16 = nullptr;  // [nt, n]      (null unless a weight of the call reads q16)
    const float* dx16 = nullptr;   // [nt, n / 32]
    const float* sx16 = nullptr;   // [nt, n / 32]
    int64_t n = 0;
    // the activations from token t on (always inlined: an out-of-line copy built in an ISA file
    // could be the one the linker keeps for the generic files)
    [[gnu::always_inline]] inline Act at(int64_t t) const {
        Act a = *this;
        a.x += t * ldx;
        if (q8) a.q8 += t * n, a.d8 += t * (n / 32), a.m16 += t * (n / 16);
        if (q8x) a.q8x += t * n;
        if (x16) a.x16 += t * n, a.dx16 += t * (n / 32), a.sx16 += t * (n / 32);
        return a;
    }
};
struct ActBuf {  // left uninitialized (every element is written before it is read): a prompt's
                // buffers are megabytes, and zeroing them would run on one thread
    std::unique_ptr<int8_t[]> q8;
    std::unique_ptr<float[]> d8, m16;
    std::unique_ptr<uint8_t[]> q8x;
    std::unique_ptr<int16_t[]> x16;
    std::unique_ptr<float[]> dx16, sx16;
};
// Fills q8/d8/m16 rows [t0, t1) (x rows at x + t*ldx, n % 32 == 0).
using QuantizeActFn = void (*)(const float* x, int64_t ldx, int64_t t0, int64_t t1, int64_t n,
                               int8_t* q8, float* d8, float* m16);
// Fills x16/dx16/sx16 rows [t0, t1) (n % 32 == 0).
using QuantizeAct16Fn = void (*)(const float* x, int64_t ldx, int64_t t0, int64_t t1, int64_t n,
                                 int16_t* x16, float* dx16, float* sx16);
// Fills q8x rows [t0, t1) from the q8 rows (n % 256 == 0).
using InterleaveActFn = void (*)(const int8_t* q8, int64_t t0, int64_t t1, int64_t n, uint8_t* q8x);

// ---- row kernels of one type on one ISA --------------------------------------------------------
// A row is `nkb` kernel blocks (Traits::kb_bytes each, contiguous) = nkb * kb_elems weights.

// out[0 .. nkb*kb_elems) = the row's weights as float, bit-exact with decode32.
using DecodeRowFn = void (*)(const uint8_t* row, int64_t nkb, float* out, const Grids& g);
// out[t*ldo] = dot(row, activations of token t) for t < nt (any nt >= 1); float32 accumulation.
using DotRowFn = void (*)(const uint8_t* row, int64_t nkb, const Act& a, int nt, float* out,
                          int64_t ldo, const Grids& g);

// out[t*ldo + r] = dot(row r, activations of token t) for r < nr (row r at w + r*stride),
// t < nt: the whole block of rows and tokens in one call, so a kernel can decode each row once
// for all tokens (prefill, grouped experts) or stream rows in pairs (decode).
using GemmFn = void (*)(const uint8_t* w, int64_t stride, int64_t nr, int64_t nkb, const Act& a,
                        int64_t nt, float* out, int64_t ldo, const Grids& g);

// dot_row of two rows (same nkb) into out0 / out1, sharing the activation loads.
using DotRow2Fn = void (*)(const uint8_t* row0, const uint8_t* row1, int64_t nkb, const Act& a, int nt,
                           float* out0, float* out1, int64_t ldo, const Grids& g);

struct TypeKernels {
    DecodeRowFn decode_row = nullptr;
    DotRowFn dot_row = nullptr;
    int kb_elems = 0, kb_bytes = 0;
    const char* name = nullptr;
    bool needs_grids = false;
    // How dot_row accumulates (tests pick their tolerance by it): "f32" = exact weights times
    // float x; "q8" / "q16" = exact weights times the q8 / q16 activations above, exact integer
    // sums per 16 or 32 weights, scaled and summed in float32.
    const char* accumulation = "f32";
    uint8_t reads = 0;             // the Act forms dot_row / gemm read: kReadsQ8 | kReadsQ16
    DotRow2Fn dot_row2 = nullptr;  // null: no gain over two dot_row calls (callers use dot_pair)
    GemmFn gemm = nullptr;         // null: callers loop over dot_row / dot_pair
    int64_t q8x_from = 0;          // gemm reads Act::q8x in calls of this many tokens or more
                                   // (0: never); prepare_act builds it only then
};

constexpr uint8_t kReadsQ8 = 1, kReadsQ16 = 2;

// The activation forms a call must build for its weights: add() each weight's kernels.
struct ActNeeds {
    uint8_t reads = 0;
    int64_t q8x_from = 0;  // the fewest tokens at which a weight reads Act::q8x (0: none does)
    ActNeeds& add(const TypeKernels& k);
};

// Two rows of type k against the same activations: dot_row2 where the type has one.
inline void dot_pair(const TypeKernels& k, const uint8_t* row0, const uint8_t* row1, int64_t nkb,
                     const Act& a, int nt, float* out0, float* out1, int64_t ldo, const Grids& g) {
    if (k.dot_row2) return k.dot_row2(row0, row1, nkb, a, nt, out0, out1, ldo, g);
    k.dot_row(row0, nkb, a, nt, out0, ldo, g);
    k.dot_row(row1, nkb, a, nt, out1, ldo, g);
}

struct IsaKernels {
    const char* name = nullptr;
    QuantizeActFn quantize_act = nullptr;  // null: the ISA reads float activations only
    QuantizeAct16Fn quantize_act16 = nullptr;  // null: no type of the ISA reads q16
    InterleaveActFn interleave_act = nullptr;  // null: the ISA reads no Act::q8x
    TypeKernels types[kMaxTypeId];
};

// Per-ISA tables (defined in kernels_<isa>.cpp). Each table starts from the one below it
// (generic -> avx2 -> avx512) and overrides what it accelerates.
void fill_generic(IsaKernels& k);
void fill_avx2(IsaKernels& k);
// How the avx2 and avx512 tables read IQ3_S's grid in decode: "gather" or "loads" (dispatch.cpp:
// by CPU vendor, env FTPATCH_IQ3S_GRID); set_iq3s_grid switches both (invalid_argument for
// another name).
std::string iq3s_grid();
void set_iq3s_grid(const std::string& how);

}  // namespace ft::cpu
// The AVX-512 file compiles every shared header in a namespace of its own (so no inline function
// built with AVX-512 flags can stand in for another file's copy at link time): it is reached by
// this C name, with the IsaKernels table of the other files.
extern "C" void ft_cpu_fill_avx512(void* isa_kernels);
// The avx2 table's IQ3_S entry with its grid read by gathers (kernels_iq3s_gather_avx2.cpp, same
// namespace arrangement), and the avx512 table's with its decode grid read by loads
// (kernels_iq3s_loads_avx512.cpp); each fills dot_row and gemm of one TypeKernels.
extern "C" void ft_cpu_fill_avx2_iq3s_gather(void* type_kernels);
extern "C" void ft_cpu_fill_avx512_iq3s_loads(void* type_kernels);
namespace ft::cpu {

// The fewer of two q8x thresholds (TypeKernels::q8x_from, 0 = never): the fewest tokens at which
// one of a call's weights reads Act::q8x.
inline int64_t q8x_min(int64_t a, int64_t b) { return a == 0 ? b : b == 0 ? a : a < b ? a : b; }
inline ActNeeds& ActNeeds::add(const TypeKernels& k) {
    reads |= k.reads;
    q8x_from = q8x_min(q8x_from, k.q8x_from);
    return *this;
}
// Activations for `isa` (multithreaded for many tokens); buf owns the integer forms. Only the
// forms `needs` names are built (Act::q8x only from needs.q8x_from tokens on).
Act prepare_act(const IsaKernels& isa, const float* x, int64_t ldx, int64_t nt, int64_t n,
                ActBuf& buf, const ActNeeds& needs);

// ---- dispatch and tables (dispatch.cpp) -----------------------------------------------------------
const IsaKernels& kernels();                // the active ISA's table (ops read it once per call)
std::vector<std::string> available_isas();  // best last; what this CPU can run
void set_isa(const std::string& name);      // throws std::invalid_argument if unavailable
// The kernels of a type id, checked: throws std::invalid_argument naming the type if it is
// unknown, or needs the IQ tables and set_tables() has not run.
const TypeKernels& type_kernels(const IsaKernels& isa, int type_id);
const Grids& grids();
void set_table(const std::string& name, const void* data, size_t nbytes);  // copies
bool tables_ready();
// Repacked CPU forms (repack.cpp): the id of src_id's form, or -1; repack writes it for `items`
// runs of nblocks blocks (item i at src + i * src_stride, written to dst + i * dst_stride; the
// form's block_bytes each), over the pool.
int repacked_type(int src_id);
void repack(int src_id, const uint8_t* src, int64_t nblocks, uint8_t* dst, int64_t items,
            int64_t src_stride, int64_t dst_stride);

// ---- thread pool (threadpool.cpp) -----------------------------------------------------------------
int num_threads();
void set_num_threads(int n);  // n <= 0: all cores this process may use
// Calls fn(begin, end) over [0, n) in chunks of `grain`, on all pool threads plus the caller.
// One parallel_for runs at a time (callers from several threads queue); never call it (or an op)
// from inside fn: the pool is not reentrant.
void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);
// While held (counted: holds nest), idle pool threads keep spinning instead of going to sleep,
// so a parallel_for that comes after a long gap starts without waking threads (the offload
// worker holds them for a decode step: its calls come every few hundred microseconds).
void hold_threads(bool on);
// Pin the pool's workers, one per allowed CPU (see threadpool.cpp); rebuilds a running pool.
void set_pin_threads(bool on);
bool threads_pinned();  // whether the current pool's workers are pinned

// ---- ops (one file each) ------------------------------------------------------------------------
// dst_dtype: ggml id of the output element type: 0 (F32), 1 (F16), 30 (BF16).
void dequantize(int type_id, const uint8_t* src, int64_t n_rows, int64_t n_cols,
                int64_t src_row_stride, void* dst, int dst_dtype);
void matmul(int type_id, const uint8_t* w, int64_t n_out, int64_t n_in, int64_t w_row_stride,
            const float* x, int64_t n_tok, float* y);
struct MatW {  // one weight W [n_out, n_in] of matmul_multi: row o at w + o*row_stride (bytes)
    int type_id;
    const uint8_t* w;
    int64_t n_out, row_stride;
};
// y[t, c_j + o] = x[t] . W_j[o] for the n_w weights in order (c_j = the n_out of those before j):
// y [n_tok, >= sum n_out] with row stride ldy, x [n_tok, n_in] contiguous.
void matmul_multi(const MatW* ws, int n_w, int64_t n_in, const float* x, int64_t n_tok, float* y,
                  int64_t ldy);
struct Bank {  // one expert weight bank [E, rows, cols]: rows contiguous inside an expert
    int type_id;
    const uint8_t* base;
    int64_t expert_stride;  // bytes from expert e to e+1
};
void moe_ffn(const float* x, int64_t n_tok, int64_t hidden, int64_t ff, int64_t n_experts,
             const int32_t* ids, const float* weights, int64_t top_k, const Bank& gate,
             const Bank& up, const Bank& down, float* y);

// Small operations of a decode step (step.cpp; contracts: csrc/cuda/api.h, same names).
void residual_rms_norm(float* x, int64_t rows, int64_t n, const float* a, int64_t lda, const float* b,
                       int64_t ldb, const float* s, int64_t lds, const float* w, float eps, float* out);
void route_topk(const float* logits, int64_t rows, int64_t ld, int64_t n_experts, int64_t top_k,
                float floor, int32_t* ids, float* weights);
// out [rows, n] = silu(gate) * up, gate and up rows at stride ld (the shared expert's gate|up).
void swiglu(const float* gate, const float* up, int64_t ld, int64_t rows, int64_t n, float* out);
// The delta-net token of a decode step (step.cpp; contracts: csrc/cuda/api.h, same names).
void conv_silu_step(const float* x, int64_t ldx, float* conv_state, const float* w, int64_t batch,
                    int64_t channels, int64_t kc, float* y);
// conv_silu_step for n_tok tokens of each sequence in order: x rows b*n_tok + t (stride ldx),
// y [batch*n_tok, channels].
void conv_silu_seq(const float* x, int64_t ldx, float* conv_state, const float* w, int64_t batch,
                   int64_t n_tok, int64_t channels, int64_t kc, float* y);
void delta_rule_step(const float* y, int64_t ldy, const float* z, int64_t ldz, const float* beta_raw,
                     const float* alpha_raw, int64_t ldg, const float* ssm_a, const float* dt_bias,
                     float* S, const float* norm_w, int64_t batch, int64_t hk, int64_t hv, int64_t dk,
                     int64_t dv, float eps, float* out);
// delta_rule_step for n_tok tokens of each sequence in order: rows b*n_tok + t of y, z, beta_raw,
// alpha_raw and out.
void delta_rule_seq(const float* y, int64_t ldy, const float* z, int64_t ldz, const float* beta_raw,
                    const float* alpha_raw, int64_t ldg, const float* ssm_a, const float* dt_bias,
                    float* S, const float* norm_w, int64_t batch, int64_t n_tok, int64_t hk, int64_t hv,
                    int64_t dk, int64_t dv, float eps, float* out);

// Causal GQA attention of one sequence (attention.cpp): query t of head h at q + t*q_t + h*q_h
// (d floats, normed and roped), position pos0 + t, sees cache rows l < n_attn with l <= pos0 + t;
// k_cache, v_cache [n_ctx, hkv, X] contiguous head rows of kv_type (native/kv_cache.py: 0 f32,
// 1 f16, 2 q8_0, 3 q4_0; packed rows unpacked as read), query head h reads kv head h / (hq / hkv);
// scale 1/sqrt(d). out [n_tok, hq*d] contiguous = softmax(q k^T) v, times sigmoid(gate) where
// gate (same layout as q, strides g_t, g_h) is not null. d % 16 == 0, d <= 512.
void attention(const float* q, int64_t q_t, int64_t q_h, const float* gate, int64_t g_t, int64_t g_h,
               const void* k_cache, const void* v_cache, int64_t n_attn, int64_t pos0, int64_t n_tok,
               int64_t hq, int64_t hkv, int64_t d, float* out, int kv_type);

// The full-attention mixer between its projections for n_tok tokens of one sequence (the
// contract of csrc/cuda/api.h's attention_steps, any n_tok): qg [n_tok, hq*2d] rows at ld_qg (per
// head d query then d gate values), k, v [n_tok, hkv*d] rows at ld_kv; q and k RMS-normed (times
// q_norm / k_norm [d]) and roped (NEOX, first n_rot dims, inv_freq [n_rot/2]) at positions
// pos0 + t; k, v written to cache rows pos0 + t ([n_ctx, hkv, X] rows of kv_type as
// `attention` takes them: packed as native/kv_cache.py's quantize packs, bit for bit); then
// `attention` with the gate. q_work: [n_tok, hq*d] scratch; out [n_tok, hq*d].
void gated_attention(const float* qg, int64_t ld_qg, const float* k, const float* v, int64_t ld_kv,
                     const float* q_norm, const float* k_norm, float eps, int64_t pos0, int64_t n_tok,
                     int64_t hq, int64_t hkv, int64_t d, int64_t n_rot, const float* inv_freq,
                     void* k_cache, void* v_cache, int64_t n_attn, float* q_work, float* out, int kv_type);

// Row geometry check shared by the ops: n_cols weights of `k` per row.
int64_t row_kblocks(const TypeKernels& k, int64_t n_cols, const char* what);

}  // namespace ft::cpu
