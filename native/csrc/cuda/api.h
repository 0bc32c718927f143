// ftpatch CUDA kernels: the host entry points that bindings_cuda.cpp wraps. Torch-free and free of
// CUDA types, so the bindings compile with the host compiler alone.
//
// Conventions (the same as native._cpu, see bindings_cpu.cpp):
//   * Every pointer is device memory of the current device, owned by the caller, kept alive by the
//     caller until the work on `stream` has finished. Nothing is retained after a call returns.
//   * `stream` is a cudaStream_t as an integer (0 = the legacy default stream). Every entry point
//     only enqueues work on it: no host synchronisation, no device allocation (except moe_ffn,
//     which takes its scratch from the stream-ordered allocator; moe_ffn_pool takes it from the
//     caller), so all of them can be captured into a CUDA graph.
//   * Weight rows hold whole kernel blocks (quants.h: Traits::kb_elems), 2-byte aligned; the fast
//     int8 paths (matmul_accum(type) == "q8") need every block start aligned to
//     gcd(16, kb_bytes), which holds for any row of a 16-byte aligned tensor.
//   * Bad arguments throw std::invalid_argument before anything is enqueued; CUDA errors at launch
//     throw std::runtime_error.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace ft::cuda {

// dst [n_rows, n_cols] contiguous of dst_dtype (ggml id: 0 F32, 1 F16, 30 BF16) from n_rows rows
// of blocks (row r at src + r*src_row_stride bytes). F32 is bit-exact with gguf-py; F16/BF16 are
// the F32 values rounded to nearest even.
void dequantize(int type_id, const void* src, int64_t n_rows, int64_t n_cols,
                int64_t src_row_stride, void* dst, int dst_dtype, uintptr_t stream);

// out [n_rows, n_cols] f16 contiguous = x [n_rows, n_cols] f32 (row stride ldx) * 2^-k_r per row,
// k_r >= 0 the least that keeps the row under f16's range; row_scale [n_rows] f32 = 2^k_r.
// The other operand of a prefill GEMM: (out @ W16^T) * row_scale = x @ W16^T without overflow.
void rows_to_f16(const float* x, int64_t n_rows, int64_t n_cols, int64_t ldx, void* out,
                 float* row_scale, uintptr_t stream);

// y [n_tok, n_out] f32 = x [n_tok, n_in] f32 @ W^T, W [n_out, n_in] blocks (row o at
// w + o*w_row_stride). Any n_tok; the kernels run 1..8 tokens per launch (weights are re-read per
// group of 8 tokens: prefill belongs to dequantize + a GEMM, see native/ops.py).
// Accumulation: matmul_accum(type) "q8": x is rounded per 32 values to int8 with d = amax/127
// (y is exact for that rounded x up to float32 sums); "f32": float32 x and FMA.
void matmul(int type_id, const void* w, int64_t n_out, int64_t n_in, int64_t w_row_stride,
            const float* x, int64_t n_tok, float* y, uintptr_t stream);

// y [n_tok, n_out] f32 = x [n_tok, n_in] f32 (contiguous, 16-byte aligned) @ W^T for a float
// weight (type_id 0 F32, 1 F16, 30 BF16; row o at w + o*w_row_stride bytes; n_in a multiple of
// 4), n_tok = 1..8 in one launch: each row of x gets the same bits whatever n_tok (one block an
// output, a fixed order of FMAs and sums). Decode's float products (float_rows.cu).
void float_matmul(int type_id, const void* w, int64_t n_out, int64_t n_in, int64_t w_row_stride,
                  const float* x, int64_t n_tok, float* y, uintptr_t stream);

// One projection of an expert pool: expert slot s at base + s*slot_bytes, [rows, cols] blocks with
// contiguous rows inside a slot.
struct Pool {
    int type_id;
    const void* base;
    int64_t slot_bytes;
};

// Routed experts over a device-resident slot pool (the decode path; capturable):
//   y [T, H] f32 = sum_k weights[t,k] * down_s(silu(gate_s x_t) * up_s x_t)   (accumulate: y +=),
//   s = slot_of_expert[ids[t,k]] (slot_of_expert == nullptr: s = ids[t,k], a full bank, or slot
//   ids written by offload_plan's pair_slots).
// x [T, H] f32; ids, weights [T, K] (int32, f32); slot_of_expert int32 [n_experts] or nullptr.
// Pairs whose id is outside [0, n_experts) or whose slot is outside [0, n_slots) contribute nothing
// (the runtime computes those elsewhere); skipped [T, K] int32 (optional, may be nullptr) gets 1
// for them, 0 for the others, and so does a second pair of one token naming the same slot (a
// token's K ids are distinct experts). gate/up pools hold [F, H] per slot, down [H, F]. Each
// slot's weights are read once a call for all the tokens that chose it.
// scratch: device bytes >= moe_scratch_bytes(T, K, F, H), 16-byte aligned, owned by the caller.
// T <= 8, K <= 16 per call. Launches: group, gate/up (one, or two if their types differ), act,
// down, sum.
void moe_ffn_pool(const float* x, int64_t n_tok, int64_t hidden, int64_t ff, const int32_t* ids,
                  const float* weights, int64_t top_k, const int32_t* slot_of_expert,
                  int64_t n_experts, int64_t n_slots, const Pool& gate, const Pool& up,
                  const Pool& down, float* y, bool accumulate, int32_t* skipped, void* scratch,
                  int64_t scratch_bytes, uintptr_t stream);
int64_t moe_scratch_bytes(int64_t n_tok, int64_t top_k, int64_t ff, int64_t hidden);

// native._cpu's moe_ffn signature: full banks (expert e at base + e*stride), ids < 0 skipped,
// any T (groups of 8 tokens). Scratch comes from cudaMallocAsync on `stream` (capturable as
// graph memory nodes).
void moe_ffn(const float* x, int64_t n_tok, int64_t hidden, int64_t ff, int64_t n_experts,
             const int32_t* ids, const float* weights, int64_t top_k, const Pool& gate,
             const Pool& up, const Pool& down, float* y, uintptr_t stream);

// ---- decode-step kernels (step.cu): one launch each for what torch does in 5-10 ------------------
// Row-major float32 rows; `ld*` are row strides in floats (a slice of a fused projection's output
// can be passed without a copy). Optional inputs are nullptr.

// x [rows, n] (contiguous) += a + sigmoid(s) * b (a: [rows, lda]; b, s optional: [rows, ldb], s
// one logit per row at s + r*lds); out [rows, n] = x * rsqrt(mean(x^2) + eps) * w[n]. With a ==
// nullptr x is only read. out may be x.
void residual_rms_norm(float* x, int64_t rows, int64_t n, const float* a, int64_t lda,
                       const float* b, int64_t ldb, const float* s, int64_t lds, const float* w,
                       float eps, float* out, uintptr_t stream);

// The decode-step kernels below take n_seq sequences whose states are tensors of their own
// (states[s], S[s], caches[s]: separate addresses, kept by a captured graph) and, for the
// delta-net, n_tok tokens of each in order (rows s*n_tok + t of every per-token input and
// output). keep (or null) [n_tok-1, n_seq, ..state] receives each sequence's state after every
// token but the last (a speculative verify step rewinds to one of them).
//
// With a SeqTable the addresses are read on the device instead: sequence s's buffer is at
// table[at[s]] (table: int64 device memory; at: n_seq host ints), and the address arrays may be
// null. A graph captured so is bound to the table, not to the sequences: the host rewrites the
// table to run the same captured step on other sequences (a server's batch as requests come and go).
struct SeqTable {
    const int64_t* table = nullptr;
    const int32_t* at = nullptr;
};


// Depthwise causal conv + SiLU: y[row, c] = silu(sum_j xs[j] * w[c, j]), xs = (the state's
// [c, 0 .. kc-2], x[row, c]); each state [channels, kc-1] shifts by one a token. x rows at
// stride ldx, y [n_seq*n_tok, channels].
void conv_silu_steps(const float* x, int64_t ldx, float* const* states, const SeqTable& table,
                     int64_t n_seq, const float* w, int64_t channels, int64_t kc, int64_t n_tok,
                     float* y, float* keep, uintptr_t stream);

// The gated delta rule + gated RMS norm (qwen35moe's delta-net after the conv), one token's
// arithmetic whatever n_tok: a row of y (stride ldy) holds q (hk*dk) | k (hk*dk) | v (hv*dv)
// after conv + SiLU; value head j reads key head j % hk. q, k are L2-normed (eps), q scaled by
// dk^-0.5; decay = exp(ssm_a * softplus(alpha + dt_bias)), beta = sigmoid(beta_raw) (alpha_raw,
// beta_raw rows at stride ldg); each S[s] [hv, dk, dv] is updated in place (S = decay*S;
// u = beta*(v - S^T k); S += k u^T; o = S^T q); out [n_seq*n_tok, hv*dv] = rms_norm(o per head) *
// norm_w[dv] * silu(z) (z rows at stride ldz). dv <= 512; dk / (threads per value column) <= 64.
void delta_rule_steps(const float* y, int64_t ldy, const float* z, int64_t ldz, const float* beta_raw,
                      const float* alpha_raw, int64_t ldg, const float* ssm_a, const float* dt_bias,
                      float* const* S, const SeqTable& table, int64_t n_seq, const float* norm_w,
                      int64_t n_tok, int64_t hk, int64_t hv, int64_t dk, int64_t dv, float eps,
                      float* out, float* keep, uintptr_t stream);

// Router: p = softmax(logits[r, 0:E]) (rows at logits + r*ld), the top_k largest (ties: lower id
// first, in descending order) -> ids [rows, top_k] int32, weights = p / max(sum of the k, floor).
void route_topk(const float* logits, int64_t rows, int64_t ld, int64_t n_experts, int64_t top_k,
                float floor, int32_t* ids, float* weights, uintptr_t stream);

// One token of gated full attention (qwen35moe) for each of n_seq sequences: row s of qg (at
// qg + s*ldq), of k and v (+ s*ldkv): q of head h = qg[h*2d : h*2d+d], its gate =
// qg[h*2d+d : (h+1)*2d]; k, v of kv head h / (hq/hkv). q and k are RMS-normed (q_norm, k_norm
// [d], eps) and NEOX-roped on the first n_rot dims at position *pos[s] (device int64, < n_attn);
// k, v are written to that sequence's caches k_caches[s], v_caches[s] [n_ctx, hkv, X] at *pos[s];
// softmax attention over its positions 0..*pos[s] (scale d^-0.5), each row as the cache holds it;
// out [n_seq, hq*d] = attention * sigmoid(gate). d 64, 128, 256 or 512; cache_dtype (X): 0 f32
// (d floats), 1 f16 (d halves), 2 q8_0 (d + d/16 bytes: d int8 quants, then d/32 f16 scales),
// 3 q4_0 (d/2 + d/16 bytes: d/2 bytes of nibbles, value 2i low in byte i, then d/32 f16 scales),
// blocks of 32 values; native/kv_cache.py is the reference, bit for bit. Caches aligned to 16
// bytes, or to the largest power of two dividing a row's bytes where that is less.
// (k_table, v_table: the caches through a SeqTable; one table for both.) workspace: >= n_seq *
// hq * attention_splits(n_attn) * (d + 2) floats. Two launches per 8
// sequences; a sequence attending fewer rows than n_attn leaves its last splits empty. Splits
// are 128 positions up to 32,768 (256 splits) and larger past that, at most 256 of them: past
// 32,768 rows a sequence's sums follow the launch's n_attn, not only its own length. Groups of
// 4 or 8 query heads a kv head with d 128 or 256 run a block a kv head, which reads each cache
// row once for the group (env FTPATCH_ATTENTION_GROUPED=0: a block a query head, to compare).
// write_first: every entry's k, v rows are written (one more launch per 8) before any entry
// attends, so entries may share caches: T tokens of one sequence at T positions (a speculative
// verify step) in three launches, each token's result the bits of its own one-token step.
void attention_steps(const float* qg, int64_t ldq, const float* k, const float* v, int64_t ldkv,
                     const float* q_norm, const float* k_norm, float eps, const int64_t* const* pos,
                     int64_t n_rot, float base, void* const* k_caches, void* const* v_caches,
                     const SeqTable& k_table, const SeqTable& v_table, int cache_dtype, int64_t n_attn,
                     int64_t n_seq, int64_t hq, int64_t hkv, int64_t d, float* workspace, float* out,
                     bool write_first, uintptr_t stream);
int64_t attention_splits(int64_t n_attn);

// One tile of a prompt chunk's attention (softmax_tile.cu): scores s [rows, n] (row stride ld)
// become p = exp(s - m_new) in place, m_new = max(m, the row's max) is written over m, l becomes
// l * corr + sum p and corr = exp(m_old - m_new). With pos, row r's columns past its position
// (j0 + c > pos[r % T]) count as -inf.
void softmax_tile(float* s, int64_t rows, int64_t n, int64_t ld, float* m, float* l, float* corr,
                  const int64_t* pos, int64_t T, int64_t j0, uintptr_t stream);

// out [rows, n] = silu(gate) * up (gate, up: [rows, ld]).
void swiglu(const float* gate, const float* up, int64_t ld, int64_t rows, int64_t n, float* out,
            uintptr_t stream);

// IQ tables (loaders.quants.iq_tables()): copied to the host, uploaded to the current device now
// and to other devices at their first use. Every kernel call needs them set (ops.py sets them at
// import).
void set_tables(const std::map<std::string, std::vector<uint8_t>>& tables);
bool tables_ready();

std::vector<std::string> type_names();        // every type in FT_QUANT_TYPES (all ops run all)
std::string matmul_accum(int type_id);       // "q8" or "f32" (see matmul); "" if unknown
std::map<std::string, int> device_limits();  // sms, smem_optin, of the current device
int rows_min_chunks();          // fewest chunks a warp of the rows engine streams (rows.cuh)
void set_rows_min_chunks(int n);
// Row blocking of the rows engine's several-token launches (rows.cuh, blocked_rows_pay):
// 0 = where it pays (default), 1 = never, 2 = always; FTPATCH_ROW_BLOCKS sets it at start.
int row_blocking();
void set_row_blocking(int mode);

}  // namespace ft::cuda
