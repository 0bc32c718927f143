// The small per-token operations of a decode step, one launch each (api.h documents the entry
// points). In a CUDA graph a launch costs ~2-3 us however little it does, and torch spends 5-10
// launches on each of these (an RMS norm alone is pow, mean, add, rsqrt, mul, mul): by our count
// of the torch code a qwen35moe decode step was ~3,000 launches; with these kernels the profiler
// counts ~570 (~14 a layer). Each one has a torch reference in moe_offload/models/layers.py that
// the GPU tests compare with.
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "cuda/api.h"
#include "cuda/common.cuh"

namespace ft::cuda {
namespace {

constexpr int kNormThreads = 256;
constexpr int kRouteThreads = 256;
constexpr int kRouteValues = 8;  // experts per thread: E <= 2048
constexpr int kMaxSeqs = 8;      // sequences a delta-net or attention launch (by value below)

// The state of each sequence of a launch: separate tensors (one per server request) in one launch.
// Either their addresses (a graph captured on them is bound to those sequences) or, with `table`
// set, where to read them on the device: sequence i's address is table[at[i]], so a captured step
// is bound to the table and the host changes which sequences it runs by rewriting the table.
struct SeqPtrs {
    float* p[kMaxSeqs];
    const int64_t* table;
    int32_t at[kMaxSeqs];
    __device__ float* get(int i) const { return table ? reinterpret_cast<float*>(table[at[i]]) : p[i]; }
};

// Each sequence's KV cache ([n_ctx, Hkv] head rows of f32, f16, q8_0 or q4_0; by address or
// through `table` as above) and position (int64 on the device).
struct SeqKV {
    void* k[kMaxSeqs];
    void* v[kMaxSeqs];
    const int64_t* pos[kMaxSeqs];
    const int64_t* table;
    int32_t at_k[kMaxSeqs];
    int32_t at_v[kMaxSeqs];
    __device__ void* key(int i) const { return table ? reinterpret_cast<void*>(table[at_k[i]]) : k[i]; }
    __device__ void* value(int i) const { return table ? reinterpret_cast<void*>(table[at_v[i]]) : v[i]; }
};

__device__ __forceinline__ float sigmoid(float v) { return 1.f / (1.f + expf(-v)); }
__device__ __forceinline__ float silu(float v) { return v / (1.f + expf(-v)); }

// Sum over the block (blockDim a multiple of 32, <= 1024); every thread gets the same value,
// added in the same order. `red` holds 32 floats of shared memory.
__device__ float block_sum(float v, float* red) {
    v = warp_sum(v);
    const int tid = threadIdx.x + threadIdx.y * blockDim.x;
    const int nw = (blockDim.x * blockDim.y) >> 5;
    __syncthreads();  // `red` may still be read from a previous call
    if ((tid & 31) == 0) red[tid >> 5] = v;
    __syncthreads();
    float t = 0.f;
    for (int w = 0; w < nw; ++w) t += red[w];
    return t;
}

// ---- x += a + sigmoid(s) * b; out = rms_norm(x) * w ------------------------------------------------
// Block per row; thread t holds elements t, t + 256, ... (V of them) in registers, so all loads
// are issued before the first use: a decode-sized row costs one memory round trip, not four.
template <int V>
__global__ void __launch_bounds__(kNormThreads)
residual_norm_kernel(float* x, int n, const float* a, int64_t lda, const float* b, int64_t ldb,
                     const float* s, int64_t lds, const float* w, float eps, float* out) {
    __shared__ float red[32];
    const int64_t r = blockIdx.x;
    float* xr = x + r * n;
    float v[V], wv[V], av[V], bv[V];
#pragma unroll
    for (int k = 0; k < V; ++k) {
        const int i = threadIdx.x + k * kNormThreads;
        const bool ok = i < n;
        v[k] = ok ? xr[i] : 0.f;
        wv[k] = ok ? w[i] : 0.f;
        av[k] = ok && a ? a[r * lda + i] : 0.f;
        bv[k] = ok && b ? b[r * ldb + i] : 0.f;
    }
    const float gate = (b && s) ? sigmoid(s[r * lds]) : 1.f;
    float sq = 0.f;
#pragma unroll
    for (int k = 0; k < V; ++k) {
        if (a) v[k] += b ? av[k] + gate * bv[k] : av[k];
        sq += v[k] * v[k];
    }
    const float scale = rsqrtf(block_sum(sq, red) / float(n) + eps);
#pragma unroll
    for (int k = 0; k < V; ++k) {
        const int i = threadIdx.x + k * kNormThreads;
        if (i < n) {
            if (a) xr[i] = v[k];
            out[r * n + i] = v[k] * scale * wv[k];
        }
    }
}

// ---- depthwise causal conv + SiLU over n_tok tokens of each sequence, shifting its state --------
// Thread per (sequence, channel); tokens in order. x and y rows are s * n_tok + t; `keep` (or null)
// receives the state after each token but the last, at keep + t * keep_t + s * channels * (kc-1).
__global__ void conv_silu_kernel(const float* x, int64_t ldx, SeqPtrs states, int n_seq, const float* w,
                                 int channels, int kc, int n_tok, float* y, float* keep, int64_t keep_t) {
    const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= int64_t(n_seq) * channels) return;
    const int si = int(i / channels), c = int(i - int64_t(si) * channels);
    float* st = states.get(si) + int64_t(c) * (kc - 1);
    const float* wc = w + int64_t(c) * kc;
    for (int t = 0; t < n_tok; ++t) {
        const int64_t row = int64_t(si) * n_tok + t;
        const float cur = x[row * ldx + c];
        float acc = 0.f;
        for (int j = 0; j < kc - 1; ++j) acc += st[j] * wc[j];
        acc += cur * wc[kc - 1];
        for (int j = 0; j + 1 < kc - 1; ++j) st[j] = st[j + 1];
        if (kc > 1) st[kc - 2] = cur;
        y[row * channels + c] = silu(acc);
        if (keep && t + 1 < n_tok) {
            float* kp = keep + t * keep_t + (int64_t(si) * channels + c) * (kc - 1);
            for (int j = 0; j < kc - 1; ++j) kp[j] = st[j];
        }
    }
}

// ---- gated delta rule over n_tok tokens of each sequence, each followed by the gated RMS norm ------
// Block (vh, sequence): dv x R threads; thread (c, r) = threadIdx.x = r + R * c owns value column c
// of S for key rows [r*rows, (r+1)*rows), rows = dk/R <= CAP, and holds them in registers from the
// first token to the last: S is read once and written once a launch however many tokens it runs (a
// verify step's 2-4 tokens, or a decode step's one). The tokens' inputs come in batches of `tb`:
// their loads issued together, their q and k norms taken a warp a vector, then the recurrence runs
// token after token with no barrier (a column's R threads are adjacent lanes: they add their
// partial sums by shuffles), and the gated norms of the batch follow, a warp a token. Each token's
// arithmetic is the same whatever the batch, so T tokens in one launch equal T launches of one.
// kExact: rows == CAP = 32 and dv == 128 (the 35B-A3B's heads): the loops over a thread's rows
// unroll with no guard, and the strides are constants.
// Rows of y, z, beta, alpha and out are s * n_tok + t; `keep` as in conv_silu_kernel, a state of
// hv * dk * dv per sequence.

// Shared memory: norm_w [dv], then for a batch of tb tokens q and k [tb][R * seg], v, z, o
// [tb][dv], decay and beta [tb]. Key rows [r*rows, (r+1)*rows) start at r * seg, seg = rows
// rounded up to 4, plus 4: each thread reads its rows 16 bytes at a time, and the R threads of a
// column, at r * seg + j, fall in distinct banks.
__host__ __device__ inline int delta_seg(int rows) { return ((rows + 3) & ~3) + 4; }
__host__ __device__ inline size_t delta_smem_floats(int tb, int dk, int dv, int R) {
    return size_t(dv) + size_t(tb) * (2 * R * delta_seg(dk / R) + 3 * dv + 2);
}

template <int CAP, bool kExact>
__global__ void __launch_bounds__(512) delta_step_kernel(const float* y, int64_t ldy, const float* z, int64_t ldz,
                                  const float* beta_raw, const float* alpha_raw, int64_t ldg,
                                  const float* ssm_a, const float* dt_bias, SeqPtrs S,
                                  const float* norm_w, int hk, int hv, int dk, int dv, int R, float eps,
                                  int n_tok, int tb_max, float* out, float* keep, int64_t keep_t) {
    extern __shared__ float sm[];
    if (kExact) dv = 128;
    const int rows = kExact ? CAP : dk / R, seg = delta_seg(rows), dkp = R * seg;
    float* const nw_s = sm;                  // [dv]
    float* const qs = nw_s + dv;             // [tb_max][dkp]
    float* const ks = qs + tb_max * dkp;     // [tb_max][dkp]
    float* const vs = ks + tb_max * dkp;     // [tb_max][dv]
    float* const zs = vs + tb_max * dv;      // [tb_max][dv]
    float* const os = zs + tb_max * dv;      // [tb_max][dv]
    float* const dec = os + tb_max * dv;     // [tb_max]
    float* const bet = dec + tb_max;         // [tb_max]
    const int vh = blockIdx.x, si = blockIdx.y, kh = vh % hk;
    const int tid = threadIdx.x, nthreads = blockDim.x;
    const int r = tid % R, c = tid / R;
    const int warp = tid >> 5, lane = tid & 31, nw = nthreads >> 5;
    const int i0 = r * rows, k0 = r * seg;  // k0: key row i0 in qs / ks
    const int64_t head = int64_t(vh) * dk * dv;
    float* Sh = S.get(si) + head + c;
    float s[CAP];
#pragma unroll
    for (int j = 0; j < CAP; ++j)
        if (kExact || j < rows) s[j] = Sh[int64_t(i0 + j) * dv];
    for (int j = tid; j < dv; j += nthreads) nw_s[j] = norm_w[j];
    const float qscale = rsqrtf(float(dk));

    for (int t0 = 0; t0 < n_tok; t0 += tb_max) {
        const int tb = min(tb_max, n_tok - t0);
        const int64_t row0 = int64_t(si) * n_tok + t0;
        // the batch's inputs: every load issued before any is used
        for (int i = tid; i < dk; i += nthreads) {
            const int at = (i / rows) * (seg - rows) + i;
            for (int t = 0; t < tb; ++t) {
                const float* yb = y + (row0 + t) * ldy;
                qs[t * dkp + at] = yb[kh * dk + i];
                ks[t * dkp + at] = yb[hk * dk + kh * dk + i];
            }
        }
        for (int j = tid; j < dv; j += nthreads) {
            for (int t = 0; t < tb; ++t) {
                vs[t * dv + j] = y[(row0 + t) * ldy + 2 * hk * dk + vh * dv + j];
                zs[t * dv + j] = z[(row0 + t) * ldz + vh * dv + j];
            }
        }
        if (tid < tb) {
            const int64_t row = row0 + tid;
            const float graw = alpha_raw[row * ldg + vh] + dt_bias[vh];
            dec[tid] = expf(ssm_a[vh] * (graw > 20.f ? graw : log1pf(expf(graw))));
            bet[tid] = sigmoid(beta_raw[row * ldg + vh]);
        }
        __syncthreads();
        for (int job = warp; job < 2 * tb; job += nw) {  // L2 norms: a warp each q and k
            const bool is_q = (job & 1) == 0;
            float* x = (is_q ? qs : ks) + (job >> 1) * dkp;
            float sq = 0.f;
            for (int rr = 0; rr < R; ++rr)
                for (int j = lane; j < rows; j += 32) sq += x[rr * seg + j] * x[rr * seg + j];
            const float n = rsqrtf(warp_sum(sq) + eps);
            for (int rr = 0; rr < R; ++rr)
                for (int j = lane; j < rows; j += 32) {
                    float* e = x + rr * seg + j;
                    *e = is_q ? *e * n * qscale : *e * n;
                }
        }
        __syncthreads();

        for (int t = 0; t < tb; ++t) {  // the recurrence: no barrier from token to token
            const float* qt = qs + t * dkp + k0;
            const float* kt = ks + t * dkp + k0;
            const float decay = dec[t];
            float kv = 0.f;  // (S^T k)[c] over this thread's rows, S already decayed
#pragma unroll
            for (int j = 0; j < CAP; j += 4) {
                if (kExact || j < rows) {
                    const float4 k4 = *reinterpret_cast<const float4*>(kt + j);
                    const float kk[4] = {k4.x, k4.y, k4.z, k4.w};
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        if (kExact || j + e < rows) kv += kk[e] * (s[j + e] * decay);
                }
            }
            for (int o = 1; o < R; o <<= 1) kv += __shfl_xor_sync(0xffffffffu, kv, o);
            const float u = bet[t] * (vs[t * dv + c] - kv);
            float o = 0.f;
#pragma unroll
            for (int j = 0; j < CAP; j += 4) {
                if (kExact || j < rows) {
                    const float4 k4 = *reinterpret_cast<const float4*>(kt + j);
                    const float4 q4 = *reinterpret_cast<const float4*>(qt + j);
                    const float kk[4] = {k4.x, k4.y, k4.z, k4.w}, qq[4] = {q4.x, q4.y, q4.z, q4.w};
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        if (kExact || j + e < rows) {
                            const float sv = s[j + e] * decay + kk[e] * u;
                            s[j + e] = sv;
                            o += qq[e] * sv;
                        }
                    }
                }
            }
            for (int m = 1; m < R; m <<= 1) o += __shfl_xor_sync(0xffffffffu, o, m);
            if (r == 0) os[t * dv + c] = o;
            if (keep && t0 + t + 1 < n_tok) {
                float* kp = keep + (t0 + t) * keep_t + int64_t(si) * hv * dk * dv + head + c +
                            int64_t(i0) * dv;
#pragma unroll
                for (int j = 0; j < CAP; ++j)
                    if (kExact || j < rows) kp[int64_t(j) * dv] = s[j];
            }
        }
        __syncthreads();
        for (int t = warp; t < tb; t += nw) {  // the gated RMS norm, a warp a token
            const float* ot = os + t * dv;
            float ss = 0.f;
            for (int j = lane; j < dv; j += 32) ss += ot[j] * ot[j];
            const float scale = rsqrtf(warp_sum(ss) / float(dv) + eps);
            float* ob = out + ((row0 + t) * hv + vh) * dv;
            for (int j = lane; j < dv; j += 32) ob[j] = ot[j] * scale * nw_s[j] * silu(zs[t * dv + j]);
        }
        __syncthreads();  // the next batch overwrites shared memory
    }
#pragma unroll
    for (int j = 0; j < CAP; ++j)
        if (kExact || j < rows) Sh[int64_t(i0 + j) * dv] = s[j];
}

// ---- router: softmax over E, top-k, renormalised weights -----------------------------------------
struct Best {
    float v;
    int i;
};
__device__ __forceinline__ Best better(Best a, Best b) {
    return (b.v > a.v || (b.v == a.v && b.i < a.i)) ? b : a;
}

__global__ void __launch_bounds__(kRouteThreads)
route_kernel(const float* logits, int64_t ld, int E, int K, float floor, int32_t* ids, float* wout) {
    __shared__ float red[32];
    __shared__ Best wbest[32];
    __shared__ float sel[32];
    const int64_t row = blockIdx.x;
    const float* lg = logits + row * ld;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nw = blockDim.x >> 5;
    float p[kRouteValues];
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < kRouteValues; ++j) {
        const int e = tid + j * blockDim.x;
        p[j] = e < E ? lg[e] : -INFINITY;
        mx = fmaxf(mx, p[j]);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    if (lane == 0) red[warp] = mx;
    __syncthreads();
    mx = red[0];
    for (int w = 1; w < nw; ++w) mx = fmaxf(mx, red[w]);
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < kRouteValues; ++j) {
        p[j] = tid + j * blockDim.x < E ? expf(p[j] - mx) : -1.f;  // -1: never selected
        sum += p[j] > 0.f ? p[j] : 0.f;
    }
    const float inv = 1.f / block_sum(sum, red);
#pragma unroll
    for (int j = 0; j < kRouteValues; ++j)
        if (p[j] >= 0.f) p[j] *= inv;

    for (int k = 0; k < K; ++k) {
        Best bst{-2.f, 0x7fffffff};
#pragma unroll
        for (int j = 0; j < kRouteValues; ++j) bst = better(bst, Best{p[j], tid + j * int(blockDim.x)});
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const Best other{__shfl_xor_sync(0xffffffffu, bst.v, o), __shfl_xor_sync(0xffffffffu, bst.i, o)};
            bst = better(bst, other);
        }
        if (lane == 0) wbest[warp] = bst;
        __syncthreads();
        Best win = wbest[0];
        for (int w = 1; w < nw; ++w) win = better(win, wbest[w]);
        __syncthreads();  // wbest is rewritten next round
#pragma unroll
        for (int j = 0; j < kRouteValues; ++j)
            if (tid + j * int(blockDim.x) == win.i) p[j] = -1.f;
        if (tid == 0) {
            sel[k] = win.v;
            ids[row * K + k] = win.i;
        }
    }
    __syncthreads();
    if (tid < K) {
        float tot = 0.f;
        for (int k = 0; k < K; ++k) tot += sel[k];
        wout[row * K + tid] = sel[tid] / fmaxf(tot, floor);
    }
}

// One warp per row for E <= 32 * V: the K rounds of arg-max are shuffles only (no block barriers).
template <int V>
__global__ void route_warp_kernel(const float* logits, int64_t ld, int64_t rows, int E, int K,
                                  float floor, int32_t* ids, float* wout) {
    const int lane = threadIdx.x & 31;
    const int64_t row = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= rows) return;
    const float* lg = logits + row * ld;
    float p[V];
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < V; ++j) {
        const int e = lane + 32 * j;
        p[j] = e < E ? lg[e] : -INFINITY;
        mx = fmaxf(mx, p[j]);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < V; ++j) {
        p[j] = lane + 32 * j < E ? expf(p[j] - mx) : -1.f;  // -1: never selected
        sum += p[j] > 0.f ? p[j] : 0.f;
    }
    sum = warp_sum(sum);
    const float inv = 1.f / sum;
#pragma unroll
    for (int j = 0; j < V; ++j)
        if (p[j] >= 0.f) p[j] *= inv;
    float mine = 0.f;  // lane k keeps the k-th selected probability
    for (int k = 0; k < K; ++k) {
        Best bst{-2.f, 0x7fffffff};
#pragma unroll
        for (int j = 0; j < V; ++j) bst = better(bst, Best{p[j], lane + 32 * j});
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const Best other{__shfl_xor_sync(0xffffffffu, bst.v, o), __shfl_xor_sync(0xffffffffu, bst.i, o)};
            bst = better(bst, other);
        }
#pragma unroll
        for (int j = 0; j < V; ++j)
            if (lane + 32 * j == bst.i) p[j] = -1.f;
        if (lane == k) {
            mine = bst.v;
            ids[row * K + k] = bst.i;
        }
    }
    float tot = 0.f;  // the K probabilities summed in selection order, as the block kernel does
    for (int k = 0; k < K; ++k) tot += __shfl_sync(0xffffffffu, mine, k);
    if (lane < K) wout[row * K + lane] = mine / fmaxf(tot, floor);
}

// ---- silu(gate) * up ----------------------------------------------------------------------------------
__global__ void swiglu_kernel(const float* g, const float* u, int64_t ld, int rows, int n, float* out) {
    const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= int64_t(rows) * n) return;
    const int64_t r = i / n, j = i - r * n;
    out[i] = silu(g[r * ld + j]) * u[r * ld + j];
}

// ---- gated attention for one token (qwen35moe's full-attention layers) -----------------------------
// Two kernels. attention_part: block (h, b, split) with 8 warps. Phase 1: q of head h and k, v of
// its kv head: RMS-normed, NEOX RoPE, into shared memory (k, v as the cache's format holds them:
// rounded to f16, or quantized and dequantized, as the reference reads them back); block (first q
// head of the group, split 0) writes k, v into the caches at `pos`. Phase 2: the split's
// `chunk` positions (those <= pos), warp w taking runs of kAttnRun positions whose rows it
// loads at once (latency, not bandwidth, bounds this loop), lane l holding dims [l*PER,
// (l+1)*PER); an online softmax per warp, merged over the warps into the split's (max, sum,
// acc[d]) in a workspace. Position pos comes from shared memory: another block
// may still be writing it. attention_merge: block (h, b) merges the splits and applies the gate.
// Splits keep the GPU busy at long contexts (16 heads alone would use 16 SMs): kAttnChunk
// positions each, or past kAttnMaxSplits of those, more (a multiple of kAttnChunk), so that a
// long context's merge reads at most kAttnMaxSplits rows and each block has a loop's worth of
// positions. The group kernel below (one block a kv head: 2 heads' worth of blocks a split, not
// 16) wants the many splits; the merge reads the splits' maxima and sums in parallel.
constexpr int kAttnWarps = 8;
constexpr int kAttnRun = 8;
constexpr int kAttnChunk = 2 * kAttnWarps * kAttnRun;  // positions per split, at least
constexpr int kAttnMaxSplits = 256;

int64_t attention_chunk(int64_t n_attn) {
    const int64_t per = (n_attn + kAttnMaxSplits - 1) / kAttnMaxSplits;
    return std::max<int64_t>(kAttnChunk, (per + kAttnChunk - 1) / kAttnChunk * kAttnChunk);
}

template <class C> __device__ __forceinline__ C store_c(float v) { return C(v); }
template <> __device__ __forceinline__ __half store_c(float v) { return __float2half_rn(v); }
__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }

// PER consecutive cache values (16-byte loads where PER allows; rows are 64-byte aligned).
template <int PER> __device__ __forceinline__ void load_row(const float* p, float (&out)[PER]) {
    if constexpr (PER % 4 == 0) {
#pragma unroll
        for (int j = 0; j < PER; j += 4) {
            const float4 v = *reinterpret_cast<const float4*>(p + j);
            out[j] = v.x; out[j + 1] = v.y; out[j + 2] = v.z; out[j + 3] = v.w;
        }
    } else {
#pragma unroll
        for (int j = 0; j < PER; ++j) out[j] = p[j];
    }
}
template <int PER> __device__ __forceinline__ void load_row(const __half* p, float (&out)[PER]) {
    if constexpr (PER % 8 == 0) {
#pragma unroll
        for (int j = 0; j < PER; j += 8) {
            const uint4 v = *reinterpret_cast<const uint4*>(p + j);
            const __half2* h = reinterpret_cast<const __half2*>(&v);
#pragma unroll
            for (int t = 0; t < 4; ++t) {
                const float2 f = __half22float2(h[t]);
                out[j + 2 * t] = f.x;
                out[j + 2 * t + 1] = f.y;
            }
        }
    } else {
#pragma unroll
        for (int j = 0; j < PER; ++j) out[j] = __half2float(p[j]);
    }
}

// ---- KV cache formats (native/kv_cache.py: the layouts, and the torch reference of q8_0, q4_0) ----
// A policy a format, for head rows of d = 32 * PER values:
//   row_bytes(d)           bytes of a head row: position p, kv head kh at (p * hkv + kh) * row_bytes
//   load<PER>(row, lane)   lane's values [lane*PER, (lane+1)*PER) of a head row; out times the
//                          returned scale is what the cache holds (kScaled: the scale is not 1,
//                          and the caller multiplies dot products by it, not each value); the
//                          kScaled formats split it into fetch (the raw bytes, a few registers)
//                          and unpack, so that V rows are fetched with K's
//   put_rows<d>(k, v, ks, vs, write)   the block's k, v rows in shared memory -> the cache's form:
//                          written at k, v when `write`, and put back in ks, vs as the cache holds
//                          them (what this token and later ones read); a barrier must follow
template <class T> struct CacheFloat {
    static constexpr bool kScaled = false;
    template <int PER> struct Raw {};  // (no early fetch: the row is the values)
    __host__ __device__ static constexpr int row_bytes(int d) { return int(sizeof(T)) * d; }
    template <int PER>
    __device__ static __forceinline__ float load(const char* row, int lane, float (&out)[PER]) {
        load_row<PER>(reinterpret_cast<const T*>(row) + lane * PER, out);
        return 1.f;
    }
    template <int D>
    __device__ static __forceinline__ void put_rows(char* k, char* v, float* ks, float* vs, bool write) {
        for (int i = threadIdx.x; i < D; i += blockDim.x) {
            const T kc = store_c<T>(ks[i]), vc = store_c<T>(vs[i]);
            if (write) {
                reinterpret_cast<T*>(k)[i] = kc;
                reinterpret_cast<T*>(v)[i] = vc;
            }
            ks[i] = to_f(kc);
            vs[i] = to_f(vc);
        }
    }
};
using CacheF32 = CacheFloat<float>;
using CacheF16 = CacheFloat<__half>;

// Byte i of w as a float, minus `bias`: 2^23 + byte built under the exponent bits (a PRMT), then
// one exact FADD. Cheaper than I2F, a quarter-rate conversion, of which a position's K and V
// rows would take 2d a head.
__device__ __forceinline__ float byte_minus(uint32_t w, int i, float bias) {
    return __int_as_float(int(__byte_perm(w, 0x4B000000u, 0x7440u | unsigned(i)))) - bias;
}

// n bytes (1, 2, 4, 8 or 16; p aligned to n) as 32-bit words, the last one zero-padded.
template <int N> __device__ __forceinline__ void load_bytes(const char* p, uint32_t (&w)[(N + 3) / 4]) {
    if constexpr (N == 16) {
        const uint4 v = *reinterpret_cast<const uint4*>(p);
        w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
    } else if constexpr (N == 8) {
        const uint2 v = *reinterpret_cast<const uint2*>(p);
        w[0] = v.x; w[1] = v.y;
    } else if constexpr (N == 4) {
        w[0] = *reinterpret_cast<const uint32_t*>(p);
    } else if constexpr (N == 2) {
        w[0] = *reinterpret_cast<const uint16_t*>(p);
    } else {
        static_assert(N == 1, "load_bytes: 1, 2, 4, 8 or 16 bytes");
        w[0] = *reinterpret_cast<const uint8_t*>(p);
    }
}

// q8_0 and q4_0: a row is its quants then its d/32 f16 scales. A lane's PER values lie in one
// 32-block (PER <= 16 divides 32), so one scale a lane and row. Its quants are PER (q8_0) or PER/2
// (q4_0) bytes at a multiple of that size, and the rows' sizes (17d/16, 9d/16 bytes) are multiples
// of it too: one aligned load of that width whatever d.
template <bool kQ4> struct CacheQuant {
    static constexpr bool kScaled = true;
    __host__ __device__ static constexpr int quant_bytes(int d) { return kQ4 ? d / 2 : d; }
    __host__ __device__ static constexpr int row_bytes(int d) { return quant_bytes(d) + d / 16; }

    // A lane's part of a head row as loaded: its quant bytes, its block's scale.
    template <int PER> struct Raw {
        uint32_t w[((kQ4 ? PER / 2 : PER) + 3) / 4];
        __half scale;
    };
    template <int PER> __device__ static __forceinline__ Raw<PER> fetch(const char* row, int lane) {
        constexpr int n = kQ4 ? PER / 2 : PER;  // bytes a lane
        Raw<PER> r;
        load_bytes<n>(row + lane * n, r.w);
        r.scale = reinterpret_cast<const __half*>(row + quant_bytes(32 * PER))[lane * PER / 32];
        return r;
    }
    template <int PER>
    __device__ static __forceinline__ float unpack(const Raw<PER>& r, float (&out)[PER]) {
        if constexpr (kQ4) {  // nibbles q, value q - 8: value 2i low in byte i, 2i+1 high
#pragma unroll
            for (int j = 0; j < PER; j += 2) {
                const uint32_t x = r.w[j / 8], sh = (j / 2) % 4;
                out[j] = byte_minus(x & 0x0F0F0F0Fu, sh, 8388616.f);
                out[j + 1] = byte_minus((x >> 4) & 0x0F0F0F0Fu, sh, 8388616.f);
            }
        } else {  // int8 q: q + 128 = the byte with its top bit flipped
#pragma unroll
            for (int j = 0; j < PER; ++j) out[j] = byte_minus(r.w[j / 4] ^ 0x80808080u, j % 4, 8388736.f);
        }
        return __half2float(r.scale);
    }
    template <int PER>
    __device__ static __forceinline__ float load(const char* row, int lane, float (&out)[PER]) {
        return unpack<PER>(fetch<PER>(row, lane), out);
    }

    // Half-warp job j < 2 * d/32: block j of k (then of v), lane i of the half its values 2i and
    // 2i+1 (one round of jobs for d <= 512). Each step is one IEEE operation, as in kv_cache.py,
    // so the quants and scales are its bits.
    template <int D>
    __device__ static __forceinline__ void put_rows(char* k, char* v, float* ks, float* vs, bool write) {
        constexpr int nb = D / 32;
        const int i = threadIdx.x & 15;
        for (int job = threadIdx.x >> 4; job < 2 * nb; job += blockDim.x >> 4) {
            const int blk = job < nb ? job : job - nb;
            float2* const xs = reinterpret_cast<float2*>((job < nb ? ks : vs) + blk * 32) + i;
            char* const row = job < nb ? k : v;
            const float2 x = *xs;
            float s;
            if constexpr (kQ4) {  // m: the value of largest magnitude, the first on ties
                float a = fabsf(x.x);
                int at = 2 * i;
                if (fabsf(x.y) > a) {
                    a = fabsf(x.y);
                    at = 2 * i + 1;
                }
#pragma unroll
                for (int o = 8; o > 0; o >>= 1) {
                    const float oa = __shfl_xor_sync(0xffffffffu, a, o);
                    const int oat = __shfl_xor_sync(0xffffffffu, at, o);
                    if (oa > a || (oa == a && oat < at)) {
                        a = oa;
                        at = oat;
                    }
                }
                s = __fdiv_rn(__shfl_sync(0xffffffffu, at & 1 ? x.y : x.x, at >> 1, 16), -8.f);
            } else {
                float a = fmaxf(fabsf(x.x), fabsf(x.y));
#pragma unroll
                for (int o = 8; o > 0; o >>= 1) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, o));
                s = __fdiv_rn(a, 127.f);
            }
            const float inv = s != 0.f ? __fdiv_rn(1.f, s) : 0.f;
            const __half sh = __float2half_rn(s);
            int q0, q1;
            if constexpr (kQ4) {
                q0 = min(15, int(floorf(__fadd_rn(__fmul_rn(x.x, inv), 8.5f))));
                q1 = min(15, int(floorf(__fadd_rn(__fmul_rn(x.y, inv), 8.5f))));
                if (write) reinterpret_cast<uint8_t*>(row)[blk * 16 + i] = uint8_t(q0 | q1 << 4);
                q0 -= 8;
                q1 -= 8;
            } else {
                q0 = __float2int_rn(__fmul_rn(x.x, inv));  // round half to even, as torch.round
                q1 = __float2int_rn(__fmul_rn(x.y, inv));
                if (write)  // the two int8 bytes, little-endian
                    reinterpret_cast<uint16_t*>(row + blk * 32)[i] = uint16_t((q0 & 0xFF) | (q1 & 0xFF) << 8);
            }
            if (write && i == 0) reinterpret_cast<__half*>(row + quant_bytes(D))[blk] = sh;
            const float sf = __half2float(sh);
            *xs = make_float2(float(q0) * sf, float(q1) * sf);
        }
    }
};
using CacheQ8 = CacheQuant<false>;
using CacheQ4 = CacheQuant<true>;

// Pieces of rms_norm(x[0:d]) * w then NEOX RoPE on the first n_rot dims, written as explicit IEEE
// operations (no contraction under --use_fast_math) so that both attention kernels, which
// organise the work differently, write the same k rows into the caches bit for bit.
__device__ __forceinline__ float norm_factor(float sum_sq, int d, float eps) {
    return rsqrtf(__fadd_rn(__fdiv_rn(sum_sq, float(d)), eps));
}
// the reference's float32 inverse frequency and angle, then an accurate cos/sin of it (fast-math
// sinf loses digits at angles of thousands of radians)
__device__ __forceinline__ void rope_cos_sin(int i, float pos, int n_rot, float base, float& c, float& s) {
    const float inv = float(pow(double(base), -double(2 * i) / double(n_rot)));
    const float ang = pos * inv;
    c = float(cos(double(ang)));
    s = float(sin(double(ang)));
}
__device__ __forceinline__ void rope_pair(float* x, int i, int half, float c, float s) {
    const float x1 = x[i], x2 = x[i + half];
    x[i] = __fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s));
    x[i + half] = __fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s));
}

// The whole of it for one row in shared memory, by the block (the sum of squares in block_sum's
// order: thread i's value i, warps in order, for d <= blockDim; each square rounded on its own,
// not fused into the first sum of the warp's, which the inlined form would otherwise do).
__device__ void norm_rope(float* x, const float* w, int d, float eps, float pos, int n_rot, float base,
                          float* red) {
    float sq = 0.f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) sq = __fadd_rn(sq, __fmul_rn(x[i], x[i]));
    const float r = norm_factor(block_sum(sq, red), d, eps);
    for (int i = threadIdx.x; i < d; i += blockDim.x) x[i] = __fmul_rn(__fmul_rn(x[i], r), w[i]);
    __syncthreads();
    const int half = n_rot / 2;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        float c, s;
        rope_cos_sin(i, pos, n_rot, base, c, s);
        rope_pair(x, i, half, c, s);
    }
    __syncthreads();
}

// A run of R positions p0.. of a warp's FFMA attention loop, lane's values [lane*PER, (lane+1)*PER)
// of each row into rows[u] (times sc[u]): rows before pos from the cache, the row at pos from
// shared memory (`cur`: another block may still be writing it), rows past pos zeros. K rows:
// the quantized formats fetch the run's V bytes with them (one memory round trip a run, not two;
// their raw bytes are few registers, f16 or f32 rows would cost occupancy). V rows: from those
// bytes, or from the cache.
template <class C, int PER, int R>
__device__ __forceinline__ void load_run_k(const char* kbase, const char* vbase, int64_t stride,
                                           int64_t p0, int64_t pos, int lane, const float* cur,
                                           float (&rows)[R][PER], float (&sc)[R],
                                           typename C::template Raw<PER> (&vraw)[R]) {
#pragma unroll
    for (int u = 0; u < R; ++u) {
        const int64_t p = p0 + u;
        if (p < pos) {
            if constexpr (C::kScaled) vraw[u] = C::template fetch<PER>(vbase + p * stride, lane);
            sc[u] = C::template load<PER>(kbase + p * stride, lane, rows[u]);
        } else {
            sc[u] = 1.f;
#pragma unroll
            for (int j = 0; j < PER; ++j) rows[u][j] = p == pos ? cur[lane * PER + j] : 0.f;
        }
    }
}
template <class C, int PER, int R>
__device__ __forceinline__ void load_run_v(const char* vbase, int64_t stride, int64_t p0,
                                           int64_t pos, int lane, const float* cur,
                                           float (&rows)[R][PER], float (&sc)[R],
                                           const typename C::template Raw<PER> (&vraw)[R]) {
#pragma unroll
    for (int u = 0; u < R; ++u) {
        const int64_t p = p0 + u;
        if (p < pos) {
            if constexpr (C::kScaled)
                sc[u] = C::template unpack<PER>(vraw[u], rows[u]);
            else
                sc[u] = C::template load<PER>(vbase + p * stride, lane, rows[u]);
        } else {
            sc[u] = 1.f;
#pragma unroll
            for (int j = 0; j < PER; ++j) rows[u][j] = p == pos ? cur[lane * PER + j] : 0.f;
        }
    }
}

// What a launch of attention_part_kernel does with the caches. A step of several tokens of one
// sequence runs kWriteRows (every token's k, v row into the cache) then kAttendOnly (each token
// attends rows the others wrote): each token's arithmetic is the one-token kWriteAndAttend's.
enum AttnMode : int { kWriteAndAttend = 0, kWriteRows = 1, kAttendOnly = 2 };

// Blocks an SM must hold at once for the quantized formats: as many as the f32 and f16 kernels'
// register counts give them (3, 2, 2, 1 for PER 2 .. 16). Left free, ptxas spends a few more
// registers on the quantized ones, which cuts their occupancy in this latency-bound loop by a
// third to a half (bound, PER 8 spills ~20 bytes: measured, much the cheaper). 0 (f32, f16): no
// bound, the code ptxas has always made for them.
template <class C, int PER> constexpr int attn_min_blocks() {
    return !C::kScaled ? 0 : PER <= 2 ? 3 : PER <= 8 ? 2 : 1;
}

template <class C, int PER, int MODE>
__global__ void __launch_bounds__(32 * kAttnWarps, attn_min_blocks<C, PER>())
attention_part_kernel(const float* qg, int64_t ldq, const float* kin, const float* vin, int64_t ldkv,
                      const float* q_norm, const float* k_norm, float eps, SeqKV kv, int n_rot,
                      float base, int hq, int hkv, int64_t chunk, float* part) {
    constexpr int d = 32 * PER;
    __shared__ float qs[d], ks[d], vs[d], accs[kAttnWarps][d];
    __shared__ float red[32], wm[kAttnWarps], wl[kAttnWarps];
    const int h = blockIdx.x, b = blockIdx.y, group = hq / hkv, kh = h / group;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (MODE == kWriteRows && h % group != 0) return;   // one block a kv head writes
    const int64_t pos = *kv.pos[b];
    char* const k_cache = static_cast<char*>(kv.key(b));  // this sequence's [n_ctx, Hkv] head rows
    char* const v_cache = static_cast<char*>(kv.value(b));
    const float* qb = qg + int64_t(b) * ldq + int64_t(h) * 2 * d;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        qs[i] = qb[i];
        ks[i] = kin[int64_t(b) * ldkv + int64_t(kh) * d + i];
        vs[i] = vin[int64_t(b) * ldkv + int64_t(kh) * d + i];
    }
    __syncthreads();
    if (MODE != kWriteRows) norm_rope(qs, q_norm, d, eps, float(pos), n_rot, base, red);
    norm_rope(ks, k_norm, d, eps, float(pos), n_rot, base, red);
    constexpr int rb = C::row_bytes(d);
    const int64_t row_stride = int64_t(hkv) * rb;  // bytes
    const char* kbase = k_cache + int64_t(kh) * rb;
    const char* vbase = v_cache + int64_t(kh) * rb;
    // the row as the cache holds it, in every block: what this token and later ones read
    const int64_t at = (pos * hkv + kh) * rb;
    C::template put_rows<d>(k_cache + at, v_cache + at, ks, vs,
                            MODE != kAttendOnly && h % group == 0 && blockIdx.z == 0);
    if (MODE == kWriteRows) return;
    __syncthreads();

    float q[PER], acc[PER];
#pragma unroll
    for (int j = 0; j < PER; ++j) {
        q[j] = qs[lane * PER + j];
        acc[j] = 0.f;
    }
    const float scale = rsqrtf(float(d));
    float m = -INFINITY, l = 0.f;
    const int64_t first = int64_t(blockIdx.z) * chunk;
    const int64_t last = min(pos, first + chunk - 1);
    for (int64_t p0 = first + int64_t(warp) * kAttnRun; p0 <= last; p0 += kAttnWarps * kAttnRun) {
        float rows[kAttnRun][PER], s[kAttnRun], sc[kAttnRun];  // a row: rows[u][] * sc[u]
        typename C::template Raw<PER> vraw[kAttnRun];
        load_run_k<C, PER>(kbase, vbase, row_stride, p0, pos, lane, ks, rows, sc, vraw);
#pragma unroll
        for (int u = 0; u < kAttnRun; ++u) {
            float dot = 0.f;
#pragma unroll
            for (int j = 0; j < PER; ++j) dot += q[j] * rows[u][j];
            s[u] = C::kScaled ? __fmul_rn(dot, sc[u]) : dot;  // not fused into the sums below
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1)
#pragma unroll
            for (int u = 0; u < kAttnRun; ++u) s[u] += __shfl_xor_sync(0xffffffffu, s[u], o);
        float mn = m;
#pragma unroll
        for (int u = 0; u < kAttnRun; ++u) {
            s[u] = p0 + u <= pos ? s[u] * scale : -INFINITY;
            mn = fmaxf(mn, s[u]);
        }
        const float corr = expf(m - mn);
        l *= corr;
#pragma unroll
        for (int u = 0; u < kAttnRun; ++u) {
            s[u] = expf(s[u] - mn);
            l += s[u];
        }
        load_run_v<C, PER>(vbase, row_stride, p0, pos, lane, vs, rows, sc, vraw);
        if constexpr (C::kScaled) {
#pragma unroll
            for (int u = 0; u < kAttnRun; ++u) s[u] *= sc[u];
        }
#pragma unroll
        for (int j = 0; j < PER; ++j) {
            float a = acc[j] * corr;
#pragma unroll
            for (int u = 0; u < kAttnRun; ++u) a += s[u] * rows[u][j];
            acc[j] = a;
        }
        m = mn;
    }
#pragma unroll
    for (int j = 0; j < PER; ++j) accs[warp][lane * PER + j] = acc[j];
    if (lane == 0) {
        wm[warp] = m;
        wl[warp] = l;
    }
    __syncthreads();
    float M = -INFINITY;
    for (int w = 0; w < kAttnWarps; ++w) M = fmaxf(M, wm[w]);
    float L = 0.f;
    for (int w = 0; w < kAttnWarps; ++w) L += wm[w] == -INFINITY ? 0.f : wl[w] * expf(wm[w] - M);
    // workspace row (b, h, split): acc[d] (unnormalised, relative to M), M, L
    float* pr = part + ((int64_t(b) * hq + h) * gridDim.z + blockIdx.z) * (d + 2);
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float o = 0.f;
        for (int w = 0; w < kAttnWarps; ++w)
            if (wm[w] != -INFINITY) o += accs[w][i] * expf(wm[w] - M);
        pr[i] = o;
    }
    if (threadIdx.x == 0) {
        pr[d] = M;
        pr[d + 1] = L;
    }
}

// ---- attention of a query group: one block a kv head ---------------------------------------------
// qwen35moe's 16 query heads share 2 kv heads, 8 a group. attention_part_kernel reads a kv row (and
// unpacks a quantized one) once for each query head of its group; this kernel once for the group,
// or for each half of it. Block (kh, b, split), kGroupWarps warps; warp w takes the group's heads
// [HW * (w % S), HW * (w % S + 1)) (HW = G / S: the whole group, S = 1, or half, S = 2) over runs of
// kGroupRun positions (warps w / S of the block share a run's rows, read once from memory). A
// lane holds dims [lane*PER, (lane+1)*PER) of the run's K rows (then V rows) and of its HW heads'
// outputs (registers; the queries in shared memory). The run's HW x kGroupRun partial dot
// products are summed over the warp by a reduce-scatter (8 + 4 + 2 + 1 shuffles for 16 sums, one
// more round for 32, where one sum at a time takes 5), after which lane i holds head (i % N) / run's
// score of position i % run: each lane does one score's softmax step, and the heads' weights and
// rescale factors go back to every lane by shuffles for the V products. Phase 1 is
// attention_part_kernel's (the queries and k normed and roped, the row written as the cache holds
// it, bit for bit) with one RoPE table for the G + 1 rows. The split's (acc[d], max, sum) rows are
// the per-head kernel's, for the same merge.
constexpr int kGroupWarps = 4;
constexpr int kGroupRun = 4;

// One round of a warp's reduce-scatter of N sums: lanes l and l ^ W swap halves of the 2W partial
// sums each holds, each keeping the half its bit W names, so after rounds N/2, .., 2, 1 lane l holds
// sum l % N over its N-lane part of the warp in ps[0]. Values are selected, not addresses (an
// index by `upper` would put ps in local memory).
template <int W, int N> __device__ __forceinline__ void reduce_scatter(float (&ps)[N], int lane) {
    if constexpr (W >= 1) {
        const bool upper = lane & W;
#pragma unroll
        for (int i = 0; i < W; ++i) {
            const float lo = ps[i], hi = ps[i + W];
            ps[i] = (upper ? hi : lo) + __shfl_xor_sync(0xffffffffu, upper ? lo : hi, W);
        }
        reduce_scatter<W / 2, N>(ps, lane);
    }
}

// Phase 1 of the group kernels, for kv head blockIdx.x of sequence blockIdx.y with W warps: the
// group's G query rows (unless only writing) and the k row RMS-normed and NEOX-roped in shared
// memory (attention_part_kernel's arithmetic, one RoPE table for the G + 1 rows), then the k, v
// rows put into the caches' form at pos (written by split 0 unless MODE is kAttendOnly). Both
// group kernels call it, so they write the same rows bit for bit; a barrier must follow.
template <class C, int D, int G, int W, int MODE>
__device__ __forceinline__ void group_rows(float (*qs)[D], float* ks, float* vs, float* rope_c,
                                           float* rope_s, const float* qg, int64_t ldq,
                                           const float* kin, const float* vin, int64_t ldkv,
                                           const float* q_norm, const float* k_norm, float eps,
                                           int n_rot, float base, int hkv, char* k_cache,
                                           char* v_cache, int64_t pos) {
    constexpr int PER = D / 32;
    const int kh = blockIdx.x, b = blockIdx.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const float* qb = qg + int64_t(b) * ldq + int64_t(kh) * G * 2 * D;
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
        ks[i] = kin[int64_t(b) * ldkv + int64_t(kh) * D + i];
        vs[i] = vin[int64_t(b) * ldkv + int64_t(kh) * D + i];
        if (MODE != kWriteRows)
#pragma unroll
            for (int g = 0; g < G; ++g) qs[g][i] = qb[int64_t(g) * 2 * D + i];
    }
    const int half = n_rot / 2;
    for (int i = threadIdx.x; i < half; i += blockDim.x) rope_cos_sin(i, float(pos), n_rot, base, rope_c[i], rope_s[i]);
    __syncthreads();
    // row r < G: query head r; row G: k. A warp a row (only k when only writing), its sum of
    // squares in norm_rope's order (that of a block of 256 threads: d <= 256 here).
    for (int r = (MODE == kWriteRows ? G : 0) + warp; r <= G; r += W) {
        float* x = r < G ? qs[r] : ks;
        const float* w = r < G ? q_norm : k_norm;
        float sq = 0.f;
#pragma unroll
        for (int c = 0; c < PER; ++c) sq += warp_sum(__fmul_rn(x[32 * c + lane], x[32 * c + lane]));
        const float rr = norm_factor(sq, D, eps);
        for (int i = lane; i < D; i += 32) x[i] = __fmul_rn(__fmul_rn(x[i], rr), w[i]);
        __syncwarp();
        for (int i = lane; i < half; i += 32) rope_pair(x, i, half, rope_c[i], rope_s[i]);
    }
    __syncthreads();
    const int64_t at = (pos * hkv + kh) * C::row_bytes(D);
    C::template put_rows<D>(k_cache + at, v_cache + at, ks, vs, MODE != kAttendOnly && blockIdx.z == 0);
}

// The end of both group kernels: this split's workspace row (b, head, split) of each of the G
// heads, its outputs relative to the max M of its parts, then M and the sum. Head h is slot
// h % HW of warps h / HW, h / HW + S, ... below W, each a part (max wm, sum wl, outputs accs
// relative to wm); with cur given, the row at pos is one more part (max cur[h], sum 1, outputs
// vs). A barrier must come before.
template <int G, int HW, int S, int W, int D>
__device__ __forceinline__ void write_split_rows(float* part, int64_t row0, const float (*accs)[HW][D],
                                                 const float (*wm)[HW], const float (*wl)[HW],
                                                 const float* cur, const float* vs) {
    for (int idx = threadIdx.x; idx < G * (D + 2); idx += blockDim.x) {
        const int h = idx / (D + 2), i = idx % (D + 2), hw = h % HW, w0 = h / HW;
        const float cm = cur ? cur[h] : -INFINITY;
        float M = cm;
        for (int w = w0; w < W; w += S) M = fmaxf(M, wm[w][hw]);
        float o = M;
        if (i != D) {
            o = 0.f;
            for (int w = w0; w < W; w += S)
                if (wm[w][hw] != -INFINITY) o += (i < D ? accs[w][hw][i] : wl[w][hw]) * expf(wm[w][hw] - M);
            if (cur) o += (i < D ? vs[i] : 1.f) * expf(cm - M);
        }
        part[(row0 + int64_t(h) * gridDim.z) * (D + 2) + i] = o;
    }
}

template <class C, int PER, int G, int S, int MODE>
__global__ void __launch_bounds__(32 * kGroupWarps)
attention_group_kernel(const float* qg, int64_t ldq, const float* kin, const float* vin, int64_t ldkv,
                       const float* q_norm, const float* k_norm, float eps, SeqKV kv, int n_rot,
                       float base, int hq, int hkv, int64_t chunk, float* part) {
    constexpr int d = 32 * PER, R = kGroupRun, W = kGroupWarps, HW = G / S, N = HW * R;
    static_assert((N == 16 || N == 32) && PER % 4 == 0 && d <= 256 && W % S == 0,
                  "attention_group_kernel: 16 or 32 sums a run, PER 4 or 8");
    __shared__ __align__(16) float qs[G][d];
    __shared__ __align__(16) float accs[W][HW][d];
    __shared__ float ks[d], vs[d], rope_c[d / 2], rope_s[d / 2], wm[W][HW], wl[W][HW];
    const int kh = blockIdx.x, b = blockIdx.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int64_t pos = *kv.pos[b];
    char* const k_cache = static_cast<char*>(kv.key(b));
    char* const v_cache = static_cast<char*>(kv.value(b));
    group_rows<C, d, G, W, MODE>(qs, ks, vs, rope_c, rope_s, qg, ldq, kin, vin, ldkv, q_norm, k_norm,
                                 eps, n_rot, base, hkv, k_cache, v_cache, pos);
    if (MODE == kWriteRows) return;
    __syncthreads();
    constexpr int rb = C::row_bytes(d);
    const int64_t row_stride = int64_t(hkv) * rb;  // bytes
    const char* kbase = k_cache + int64_t(kh) * rb;
    const char* vbase = v_cache + int64_t(kh) * rb;

    const int h0 = HW * (warp % S);  // this warp's first head of the group
    float acc[HW][PER];
#pragma unroll
    for (int h = 0; h < HW; ++h)
#pragma unroll
        for (int j = 0; j < PER; ++j) acc[h][j] = 0.f;
    const float scale = rsqrtf(float(d));
    float m = -INFINITY, l = 0.f;  // head (lane % N) / R's running max and sum (its lanes agree)
    const int64_t first = int64_t(blockIdx.z) * chunk;
    const int64_t last = min(pos, first + chunk - 1);
    for (int64_t p0 = first + int64_t(warp / S) * R; p0 <= last; p0 += (W / S) * R) {
        float rows[R][PER], sc[R];  // a row: rows[u][] * sc[u]
        typename C::template Raw<PER> vraw[R];
        load_run_k<C, PER>(kbase, vbase, row_stride, p0, pos, lane, ks, rows, sc, vraw);
        float ps[N];  // ps[h * R + u]: this lane's part of head h0 + h's dot with row u
#pragma unroll
        for (int h = 0; h < HW; ++h) {
            float q[PER];
#pragma unroll
            for (int j = 0; j < PER; j += 4) {
                const float4 v4 = *reinterpret_cast<const float4*>(&qs[h0 + h][lane * PER + j]);
                q[j] = v4.x; q[j + 1] = v4.y; q[j + 2] = v4.z; q[j + 3] = v4.w;
            }
#pragma unroll
            for (int u = 0; u < R; ++u) {
                float dot = 0.f;
#pragma unroll
                for (int j = 0; j < PER; ++j) dot += q[j] * rows[u][j];
                ps[h * R + u] = C::kScaled ? __fmul_rn(dot, sc[u]) : dot;
            }
        }
        reduce_scatter<N / 2, N>(ps, lane);
        if constexpr (N < 32) ps[0] += __shfl_xor_sync(0xffffffffu, ps[0], 16);  // the two halves
        const float s = p0 + lane % R <= last ? ps[0] * scale : -INFINITY;
        float mx = s;
#pragma unroll
        for (int o = 1; o < R; o <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        const float mn = fmaxf(m, mx);
        const float corr = expf(m - mn);
        const float e = expf(s - mn);
        float run = e;
#pragma unroll
        for (int o = 1; o < R; o <<= 1) run += __shfl_xor_sync(0xffffffffu, run, o);
        l = l * corr + run;
        m = mn;
        load_run_v<C, PER>(vbase, row_stride, p0, pos, lane, vs, rows, sc, vraw);
#pragma unroll
        for (int h = 0; h < HW; ++h) {
            const float ch = __shfl_sync(0xffffffffu, corr, h * R);
            float eh[R];
#pragma unroll
            for (int u = 0; u < R; ++u) {
                eh[u] = __shfl_sync(0xffffffffu, e, h * R + u);
                if constexpr (C::kScaled) eh[u] *= sc[u];
            }
#pragma unroll
            for (int j = 0; j < PER; ++j) {
                float a = acc[h][j] * ch;
#pragma unroll
                for (int u = 0; u < R; ++u) a += eh[u] * rows[u][j];
                acc[h][j] = a;
            }
        }
    }
#pragma unroll
    for (int h = 0; h < HW; ++h)
#pragma unroll
        for (int j = 0; j < PER; ++j) accs[warp][h][lane * PER + j] = acc[h][j];
    if (lane < N && lane % R == 0) {
        wm[warp][lane / R] = m;
        wl[warp][lane / R] = l;
    }
    __syncthreads();
    write_split_rows<G, HW, S, W, d>(part, (int64_t(b) * hq + kh * G) * gridDim.z + blockIdx.z, accs, wm,
                                     wl, nullptr, nullptr);
}

// ---- attention of a query group on the tensor cores ----------------------------------------------
// Groups of 8 query heads over f16, q8_0 or q4_0 caches, d 128 or 256 (qwen35moe's decode shape).
// The group kernel above issues ~340 instructions a cache position (each product of 8 heads by
// d values twice over, in FFMAs): that count, not memory, bounded it at long contexts. Here a
// warp takes 16 positions at a time and both products are mma.m16n8k16 (f16 operands, exact
// products, f32 sums):
//  - scores S = Q K^T. A: rows 0-7 each head's query in f16, rows 8-15 the f16 of what that
//    misses (q - f16(q): together ~22 bits of q; RMS-normed, |q| stays far inside f16); B: 8
//    positions' keys, exact in f16 (int8 and nibble quants, f16 values). A q8_0 or q4_0 row has
//    a scale per 32 dims, so each 32-dim block is a pair of products whose sum is scaled in f32
//    and added to the score.
//  - outputs O^T = V^T P^T. A: 16 dims by 16 positions of values (exact in f16); B: the 8
//    heads' softmax weights times the rows' V scales (times kPScale, keeping the remainder of
//    small ones), again an f16 part and its remainder, two products. A 16-dim tile lies in one
//    32-dim block, so its scale goes with B.
// A lane of the warp (g = lane / 4, c = lane % 4) ends the scores holding head g at positions
// 2c, 2c+1 of each 8: the B fragment of P^T wants head g at positions 2c, 2c+1, 2c+8, 2c+9 of 16,
// so the weights never leave the lane. Which dims of a 32-dim block a product's k index names is
// free; each format takes the order its bytes unpack to most cheaply (MmaCache::qk_dim), and the
// queries' fragments follow it. The V fragment of a tile is 2 dims of 4 positions: a lane loads
// 4 dims of each of its 4 rows (one 4-, 2- or 8-byte load a row and block) and the block's two
// tiles take 2 each. kPScale keeps weight x scale inside f16: V values up to 32,512 (q8_0) or
// 32,768 (q4_0) in magnitude, about where an f16 cache overflows anyway.
// The row at pos comes from shared memory (another block may still be writing it): the split
// that holds it adds it to its partial sums at the end. The partial rows are the other kernels'.
constexpr int kMmaWarps = 4;
constexpr int kMmaRun = 16;         // positions a warp takes at a time

__device__ __forceinline__ void mma_16816(float (&c)[4], const uint4& a, uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a.x), "r"(a.y), "r"(a.z), "r"(a.w), "r"(b0), "r"(b1));
}
__device__ __forceinline__ uint32_t half2_bits(__half2 h) { return *reinterpret_cast<uint32_t*>(&h); }
// (x0, x1) as an f16 pair and the f16 pair of what it misses
__device__ __forceinline__ void split_f16(float x0, float x1, uint32_t& hi, uint32_t& lo) {
    const __half2 h = __floats2half2_rn(x0, x1);
    const float2 f = __half22float2(h);
    hi = half2_bits(h);
    lo = half2_bits(__floats2half2_rn(__fsub_rn(x0, f.x), __fsub_rn(x1, f.y)));
}
// f16 pair 0x64XX, 0x64YY (1024 + XX, 1024 + YY) minus `bias`: exact small integers
__device__ __forceinline__ uint32_t minus_f16(uint32_t bits, float bias) {
    const __half2 h = __hsub2(*reinterpret_cast<const __half2*>(&bits), __float2half2_rn(bias));
    return half2_bits(h);
}
// The d/32 scales of a q8_0 / q4_0 row as f16 pairs; scale `blk` as a float.
template <int NB> __device__ __forceinline__ void load_scales(const char* p, uint32_t (&w)[NB / 2]) {
    if constexpr (NB == 8) {
        const uint4 v = __ldg(reinterpret_cast<const uint4*>(p));
        w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
    } else {
        static_assert(NB == 4, "load_scales: d 128 or 256");
        const uint2 v = __ldg(reinterpret_cast<const uint2*>(p));
        w[0] = v.x; w[1] = v.y;
    }
}
template <int NB> __device__ __forceinline__ float scale_of(const uint32_t (&w)[NB / 2], int blk) {
    return __half2float(__ushort_as_half(uint16_t(w[blk >> 1] >> (16 * (blk & 1)))));
}

// A format's loads and fragments for attention_mma_kernel (lane g = lane / 4, c = lane % 4):
//   load_k(row, blk, c)       the lane's 8 dims [8c, 8c+8) of 32-dim block blk of a K row
//   k_frag(k, s, b0, b1)      B fragment of product s (0, 1) of the block: its k index 2c+e is
//                             dim 8c + qk_dim(s, e) of the block, 2c+8+e dim 8c + qk_dim(s, 2+e)
//   load_v(row, blk, g)       the lane's 4 dims [4g, 4g+4) of block blk of a V row
//   v_frag(r, u, a)           A fragment of the block's tile u from the lane's 4 rows: row g is
//                             dim 4g + 2u, row g + 8 dim 4g + 2u + 1
template <class C> struct MmaCache;
template <> struct MmaCache<CacheF16> {
    static constexpr bool kScaled = false;
    static constexpr float kPScale = 4096.f;  // weights <= 1
    using K = uint4;
    using V = uint2;
    __device__ static constexpr int qk_dim(int s, int e) { return 4 * s + e; }
    __device__ static K load_k(const char* row, int blk, int c) {
        return __ldg(reinterpret_cast<const uint4*>(row) + blk * 4 + c);
    }
    __device__ static void k_frag(const K& k, int s, uint32_t& b0, uint32_t& b1) {
        b0 = s ? k.z : k.x;
        b1 = s ? k.w : k.y;
    }
    __device__ static V load_v(const char* row, int blk, int g) {
        return __ldg(reinterpret_cast<const uint2*>(row) + blk * 8 + g);
    }
    __device__ static void v_frag(const V (&r)[4], int u, uint4& a) {
        const uint32_t w0 = u ? r[0].y : r[0].x, w1 = u ? r[1].y : r[1].x;
        const uint32_t w2 = u ? r[2].y : r[2].x, w3 = u ? r[3].y : r[3].x;
        a.x = __byte_perm(w0, w1, 0x5410);  // low halves: dim 4g + 2u of rows 0, 1
        a.y = __byte_perm(w0, w1, 0x7632);  // high halves: dim 4g + 2u + 1
        a.z = __byte_perm(w2, w3, 0x5410);
        a.w = __byte_perm(w2, w3, 0x7632);
    }
};
// int8 q: the byte with its top bit flipped is q + 128, under 0x64 the f16 1024 + q + 128
template <> struct MmaCache<CacheQ8> {
    static constexpr bool kScaled = true;
    static constexpr float kPScale = 256.f;
    using K = uint2;
    using V = uint32_t;
    __device__ static constexpr int qk_dim(int s, int e) { return 4 * s + e; }
    __device__ static K load_k(const char* row, int blk, int c) {
        return __ldg(reinterpret_cast<const uint2*>(row) + blk * 4 + c);
    }
    __device__ static void k_frag(const K& k, int s, uint32_t& b0, uint32_t& b1) {
        const uint32_t w = (s ? k.y : k.x) ^ 0x80808080u;
        b0 = minus_f16(__byte_perm(w, 0x64646464u, 0x4140), 1152.f);  // bytes 0, 1
        b1 = minus_f16(__byte_perm(w, 0x64646464u, 0x4342), 1152.f);  // bytes 2, 3
    }
    __device__ static V load_v(const char* row, int blk, int g) {
        return __ldg(reinterpret_cast<const uint32_t*>(row) + blk * 8 + g);
    }
    __device__ static void v_frag(const V (&r)[4], int u, uint4& a) {
        // bytes 2u, 2u + 1 of rows (0, 1) and of rows (2, 3), interleaved
        const uint32_t t01 = __byte_perm(r[0], r[1], u ? 0x7362 : 0x5140) ^ 0x80808080u;
        const uint32_t t23 = __byte_perm(r[2], r[3], u ? 0x7362 : 0x5140) ^ 0x80808080u;
        a.x = minus_f16(__byte_perm(t01, 0x64646464u, 0x4140), 1152.f);
        a.y = minus_f16(__byte_perm(t01, 0x64646464u, 0x4342), 1152.f);
        a.z = minus_f16(__byte_perm(t23, 0x64646464u, 0x4140), 1152.f);
        a.w = minus_f16(__byte_perm(t23, 0x64646464u, 0x4342), 1152.f);
    }
};
// nibbles q (value q - 8), value 2i low in byte i and 2i+1 high: a mask of bits 0-3 and 16-19
// under 0x6400 gives the f16 pair 1024 + q of bytes 0 and 2
template <> struct MmaCache<CacheQ4> {
    static constexpr bool kScaled = true;
    static constexpr float kPScale = 16.f;
    using K = uint32_t;
    using V = uint32_t;  // 2 bytes
    __device__ static constexpr int qk_dim(int s, int e) { return 2 * s + 4 * (e & 1) + (e >> 1); }
    __device__ static uint32_t nibbles(uint32_t x) {
        return minus_f16((x & 0x000F000Fu) | 0x64006400u, 1032.f);
    }
    __device__ static K load_k(const char* row, int blk, int c) {
        return __ldg(reinterpret_cast<const uint32_t*>(row) + blk * 4 + c);
    }
    __device__ static void k_frag(const K& k, int s, uint32_t& b0, uint32_t& b1) {
        const uint32_t x = s ? k >> 8 : k;
        b0 = nibbles(x);       // dims 2s, 2s + 4
        b1 = nibbles(x >> 4);  // dims 2s + 1, 2s + 5
    }
    __device__ static V load_v(const char* row, int blk, int g) {
        return __ldg(reinterpret_cast<const uint16_t*>(row) + blk * 8 + g);
    }
    __device__ static void v_frag(const V (&r)[4], int u, uint4& a) {
        const uint32_t x01 = (r[0] | r[1] << 16) >> (8 * u), x23 = (r[2] | r[3] << 16) >> (8 * u);
        a.x = nibbles(x01);
        a.y = nibbles(x01 >> 4);
        a.z = nibbles(x23);
        a.w = nibbles(x23 >> 4);
    }
};

template <class C, int NB, int MODE>
__global__ void __launch_bounds__(32 * kMmaWarps)
attention_mma_kernel(const float* qg, int64_t ldq, const float* kin, const float* vin, int64_t ldkv,
                     const float* q_norm, const float* k_norm, float eps, SeqKV kv, int n_rot,
                     float base, int hq, int hkv, int64_t chunk, float* part) {
    using F = MmaCache<C>;
    constexpr int D = 32 * NB, G = 8, W = kMmaWarps, NT = 2 * NB;  // NT 16-dim tiles of V^T
    static_assert(MODE != kWriteRows, "attention_mma_kernel: the group kernel writes rows alone");
    __shared__ __align__(16) union {
        struct {
            float qs[G][D];
            uint4 qf[NB][2][32];  // the queries' A fragments: block, product, lane
        } in;
        float accs[W][G][D];  // after the loop: each warp's outputs
    } sh;
    __shared__ float ks[D], vs[D], rope_c[D / 2], rope_s[D / 2], wm[W][G], wl[W][G], cur[G];
    const int kh = blockIdx.x, b = blockIdx.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const int64_t pos = *kv.pos[b];
    char* const k_cache = static_cast<char*>(kv.key(b));
    char* const v_cache = static_cast<char*>(kv.value(b));
    group_rows<C, D, G, W, MODE>(sh.in.qs, ks, vs, rope_c, rope_s, qg, ldq, kin, vin, ldkv, q_norm,
                                 k_norm, eps, n_rot, base, hkv, k_cache, v_cache, pos);
    __syncthreads();
    const float scale = rsqrtf(float(D));
    const int64_t first = int64_t(blockIdx.z) * chunk;
    const bool has_cur = first <= pos && pos < first + chunk;
    if (has_cur)  // the row at pos: each head's score, a warp a head
        for (int h = warp; h < G; h += W) {
            float s = 0.f;
            for (int i = lane; i < D; i += 32) s += sh.in.qs[h][i] * ks[i];
            s = warp_sum(s);
            if (lane == 0) cur[h] = s * scale;
        }
    for (int e = threadIdx.x; e < NB * 2 * 32; e += blockDim.x) {
        const int blk = e / 64, s = (e / 32) % 2, l = e % 32;
        const float* q = sh.in.qs[l >> 2] + blk * 32 + 8 * (l & 3);
        uint32_t h01, l01, h23, l23;
        split_f16(q[F::qk_dim(s, 0)], q[F::qk_dim(s, 1)], h01, l01);
        split_f16(q[F::qk_dim(s, 2)], q[F::qk_dim(s, 3)], h23, l23);
        sh.in.qf[blk][s][l] = make_uint4(h01, l01, h23, l23);  // rows g, g + 8, then k + 8
    }
    __syncthreads();

    constexpr int rb = C::row_bytes(D);
    const int64_t stride = int64_t(hkv) * rb;  // bytes
    const char* kbase = k_cache + int64_t(kh) * rb;
    const char* vbase = v_cache + int64_t(kh) * rb;
    const int64_t end = min(first + chunk, pos);  // this split's rows before pos
    float acc[NT][4];
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.f;
    float m = -INFINITY, l = 0.f;  // head g's running max (its 4 lanes agree), this lane's part of its sum
    for (int64_t c0 = first + int64_t(kMmaRun) * warp; c0 < end; c0 += int64_t(kMmaRun) * W) {
        // K rows c0 + g, c0 + 8 + g for the two score tiles; the lane's 4 positions for V and scales
        const int off[4] = {2 * c, 2 * c + 1, 8 + 2 * c, 9 + 2 * c};
        const char* krow[2] = {kbase + min(c0 + g, end - 1) * stride, kbase + min(c0 + 8 + g, end - 1) * stride};
        typename F::K kr[2][NB];
        typename F::V vr[NB][4];
        [[maybe_unused]] uint32_t ksc[4][NB / 2], vsc[4][NB / 2];
#pragma unroll
        for (int t = 0; t < 2; ++t)
#pragma unroll
            for (int blk = 0; blk < NB; ++blk) kr[t][blk] = F::load_k(krow[t], blk, c);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int64_t r = min(c0 + off[i], end - 1) * stride;
#pragma unroll
            for (int blk = 0; blk < NB; ++blk) vr[blk][i] = F::load_v(vbase + r, blk, g);
            if constexpr (F::kScaled) {
                load_scales<NB>(kbase + r + C::quant_bytes(D), ksc[i]);
                load_scales<NB>(vbase + r + C::quant_bytes(D), vsc[i]);
            }
        }
        float s[4];  // head g at positions off[0..3]
#pragma unroll
        for (int t = 0; t < 2; ++t) {
            float cs[4] = {0.f, 0.f, 0.f, 0.f}, s0 = 0.f, s1 = 0.f;
#pragma unroll
            for (int blk = 0; blk < NB; ++blk) {
                if constexpr (F::kScaled) cs[0] = cs[1] = cs[2] = cs[3] = 0.f;
#pragma unroll
                for (int p = 0; p < 2; ++p) {
                    uint32_t b0, b1;
                    F::k_frag(kr[t][blk], p, b0, b1);
                    mma_16816(cs, sh.in.qf[blk][p][lane], b0, b1);
                }
                if constexpr (F::kScaled) {
                    s0 += (cs[0] + cs[2]) * scale_of<NB>(ksc[2 * t], blk);
                    s1 += (cs[1] + cs[3]) * scale_of<NB>(ksc[2 * t + 1], blk);
                }
            }
            if constexpr (!F::kScaled) {
                s0 = cs[0] + cs[2];
                s1 = cs[1] + cs[3];
            }
            s[2 * t] = s0;
            s[2 * t + 1] = s1;
        }
        float mx = -INFINITY;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            s[i] = c0 + off[i] < end ? s[i] * scale : -INFINITY;
            mx = fmaxf(mx, s[i]);
        }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float mn = fmaxf(m, mx);  // finite: position c0 is a row
        const float corr = expf(m - mn);
        float pw[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            pw[i] = expf(s[i] - mn);
            l = i == 0 ? l * corr + pw[i] : l + pw[i];
        }
        m = mn;
        // this lane's outputs are heads 2c, 2c+1: their factors from lanes 8c, 8c + 4
        const float ca = __shfl_sync(0xffffffffu, corr, 8 * c), cb = __shfl_sync(0xffffffffu, corr, 8 * c + 4);
        if (__any_sync(0xffffffffu, corr != 1.f)) {
#pragma unroll
            for (int t = 0; t < NT; ++t) {
                acc[t][0] *= ca;
                acc[t][1] *= cb;
                acc[t][2] *= ca;
                acc[t][3] *= cb;
            }
        }
        uint32_t h01, l01, h23, l23;
        if constexpr (!F::kScaled) {
            split_f16(pw[0] * F::kPScale, pw[1] * F::kPScale, h01, l01);
            split_f16(pw[2] * F::kPScale, pw[3] * F::kPScale, h23, l23);
        }
#pragma unroll
        for (int blk = 0; blk < NB; ++blk) {
            if constexpr (F::kScaled) {
                split_f16(pw[0] * (scale_of<NB>(vsc[0], blk) * F::kPScale),
                          pw[1] * (scale_of<NB>(vsc[1], blk) * F::kPScale), h01, l01);
                split_f16(pw[2] * (scale_of<NB>(vsc[2], blk) * F::kPScale),
                          pw[3] * (scale_of<NB>(vsc[3], blk) * F::kPScale), h23, l23);
            }
#pragma unroll
            for (int u = 0; u < 2; ++u) {
                uint4 a;
                F::v_frag(vr[blk], u, a);
                mma_16816(acc[2 * blk + u], a, h01, h23);
                mma_16816(acc[2 * blk + u], a, l01, l23);
            }
        }
    }
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    if (c == 0) {
        wm[warp][g] = m;
        wl[warp][g] = l;
    }
    __syncthreads();  // every warp is past its last read of the query fragments, which accs overlays
    constexpr float inv = 1.f / F::kPScale;
#pragma unroll
    for (int blk = 0; blk < NB; ++blk)
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            const int dim = blk * 32 + 4 * g + 2 * u;
            const float* a = acc[2 * blk + u];
            sh.accs[warp][2 * c][dim] = a[0] * inv;
            sh.accs[warp][2 * c + 1][dim] = a[1] * inv;
            sh.accs[warp][2 * c][dim + 1] = a[2] * inv;
            sh.accs[warp][2 * c + 1][dim + 1] = a[3] * inv;
        }
    __syncthreads();
    write_split_rows<G, G, 1, W, D>(part, (int64_t(b) * hq + kh * G) * gridDim.z + blockIdx.z, sh.accs, wm,
                                    wl, has_cur ? cur : nullptr, vs);
}

// Max over the block (as block_sum); every thread gets it.
__device__ float block_max(float v, float* red) {
    v = warp_max(v);
    const int nw = blockDim.x >> 5;
    __syncthreads();
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    float t = -INFINITY;
    for (int w = 0; w < nw; ++w) t = fmaxf(t, red[w]);
    return t;
}

// Block (h, b, dims [64 z, 64 z + 64)): the splits' maximum M and their weights exp(m_s - M) and
// total sum, found in parallel (a split a thread, then block reductions); then 4 threads a dim
// each sum every 4th split (loads unconditional and unrolled: an empty split's row is zeros
// with weight 0) and their sums are added in order. Past a few dozen splits a dim's serial sum
// was the merge's cost: 256 dependent loads per thread took tens of microseconds a layer.
constexpr int kMergeDims = 64, kMergeParts = 4;

__global__ void __launch_bounds__(kMergeDims * kMergeParts)
attention_merge_kernel(const float* part, int splits, int d, const float* qg, int64_t ldq, int hq,
                       float* out) {
    __shared__ float ws[kAttnMaxSplits], red[32], sums[kMergeParts][kMergeDims];
    const int h = blockIdx.x, b = blockIdx.y;
    const float* pr = part + (int64_t(b) * hq + h) * splits * (d + 2);
    float mine = -INFINITY;
    for (int s = threadIdx.x; s < splits; s += blockDim.x) mine = fmaxf(mine, pr[s * (d + 2) + d]);
    const float M = block_max(mine, red);
    float part_l = 0.f;
    for (int s = threadIdx.x; s < splits; s += blockDim.x) {
        const float ms = pr[s * (d + 2) + d];
        ws[s] = ms != -INFINITY ? expf(ms - M) : 0.f;
        if (ms != -INFINITY) part_l += pr[s * (d + 2) + d + 1] * ws[s];
    }
    const float total = block_sum(part_l, red);  // its barriers also publish ws
    const int c = threadIdx.x % kMergeDims, k = threadIdx.x / kMergeDims;
    const int i = blockIdx.z * kMergeDims + c;
    float o = 0.f;
    if (i < d) {
#pragma unroll 8
        for (int s = k; s < splits; s += kMergeParts) o += pr[int64_t(s) * (d + 2) + i] * ws[s];
    }
    sums[k][c] = o;
    __syncthreads();
    if (k == 0 && i < d) {
        float t = sums[0][c];
#pragma unroll
        for (int j = 1; j < kMergeParts; ++j) t += sums[j][c];
        const float gate = qg[int64_t(b) * ldq + int64_t(h) * 2 * d + d + i];
        out[(int64_t(b) * hq + h) * d + i] = t / total * sigmoid(gate);
    }
}

// Which attention kernel a launch runs: 0 the per-head kernel, 1 the group kernel with a warp
// for the whole group, 2 with a warp for half of it, 3 the tensor-core group kernel. The group
// kernel where a group is 4 or 8 query heads of 128 or 256 dims (registers: HW * PER outputs and
// 4 * PER row values a lane), a warp for the whole group (half groups timed the same on an H100
// and unpack each row twice); the tensor-core kernel where, further, the group is 8 heads and the
// cache f16, q8_0 or q4_0 (f32 values are not exact in f16). FTPATCH_ATTENTION_GROUPED (0 to 3)
// overrides, to compare; a form the shape does not take falls back to the next one down (3 to 1).
int attention_kernel_choice(int64_t hq, int64_t hkv, int64_t d, bool f16_exact) {
    const int64_t g = hq / hkv;
    if ((g != 4 && g != 8) || d < 128 || d > 256) return 0;
    const bool mma = g == 8 && f16_exact;
    if (const char* env = std::getenv("FTPATCH_ATTENTION_GROUPED")) {
        const std::string v(env);
        require(v == "0" || v == "1" || v == "2" || v == "3",
                "FTPATCH_ATTENTION_GROUPED must be 0, 1, 2 or 3");
        const int choice = std::atoi(env);
        return choice == 3 && !mma ? 1 : choice;
    }
    return mma ? 3 : 1;
}

template <class C, int MODE>
void launch_attention(dim3 grid, cudaStream_t st, int64_t d, const float* qg, int64_t ldq,
                      const float* k, const float* v, int64_t ldkv, const float* qn, const float* kn,
                      float eps, const SeqKV& kv, int n_rot, float base, int hq, int hkv,
                      int64_t chunk, float* part) {
    constexpr bool f16_exact = !std::is_same_v<C, CacheF32>;
    if (const int choice = attention_kernel_choice(hq, hkv, d, f16_exact)) {
        const dim3 g_grid{unsigned(hkv), grid.y, grid.z};
        if constexpr (f16_exact && MODE != kWriteRows) {
            if (choice == 3) {  // rows alone are the group kernel's below: the same phase 1
                auto go = [&](auto nb) {
                    attention_mma_kernel<C, decltype(nb)::value, MODE>
                        <<<g_grid, 32 * kMmaWarps, 0, st>>>(qg, ldq, k, v, ldkv, qn, kn, eps, kv,
                                                            n_rot, base, hq, hkv, chunk, part);
                };
                if (d == 128) go(std::integral_constant<int, 4>{});
                else go(std::integral_constant<int, 8>{});
                return;
            }
        }
        auto go = [&](auto per, auto group, auto split) {
            attention_group_kernel<C, decltype(per)::value, decltype(group)::value,
                                   decltype(split)::value, MODE>
                <<<g_grid, 32 * kGroupWarps, 0, st>>>(qg, ldq, k, v, ldkv, qn, kn, eps, kv, n_rot,
                                                      base, hq, hkv, chunk, part);
        };
        using I1 = std::integral_constant<int, 1>;
        using I2 = std::integral_constant<int, 2>;
        using I4 = std::integral_constant<int, 4>;
        using I8 = std::integral_constant<int, 8>;
        auto by_group = [&](auto per) {
            if (hq / hkv == 4) go(per, I4{}, I1{});
            else if (choice == 2) go(per, I8{}, I2{});
            else go(per, I8{}, I1{});
        };
        if (d == 128) by_group(I4{});
        else by_group(I8{});
        return;
    }
    auto go = [&](auto per) {
        attention_part_kernel<C, decltype(per)::value, MODE><<<grid, 32 * kAttnWarps, 0, st>>>(
            qg, ldq, k, v, ldkv, qn, kn, eps, kv, n_rot, base, hq, hkv, chunk, part);
    };
    switch (d) {
        case 64: go(std::integral_constant<int, 2>{}); break;
        case 128: go(std::integral_constant<int, 4>{}); break;
        case 256: go(std::integral_constant<int, 8>{}); break;
        default: go(std::integral_constant<int, 16>{}); break;  // 512
    }
}

float* part_of(float* workspace, int64_t s0, int64_t hq, int64_t splits, int64_t d) {
    return workspace + s0 * hq * splits * (d + 2);
}

unsigned blocks_for(int64_t n, int per) { return unsigned((n + per - 1) / per); }

// Sequences s0 .. s0+ns-1 of a launch: their addresses, or their places in the table.
SeqPtrs seq_ptrs(float* const* ptrs, const SeqTable& table, int64_t s0, int ns) {
    SeqPtrs p{};
    p.table = table.table;
    for (int i = 0; i < ns; ++i) {
        if (table.table) p.at[i] = table.at[s0 + i];
        else p.p[i] = ptrs[s0 + i];
    }
    return p;
}

// launch(s0, ns) for each group of at most kMaxSeqs sequences (first s0, ns of them): a kernel
// takes its sequences' addresses by value.
template <class F> void by_groups(int64_t n_seq, F&& launch) {
    for (int64_t s0 = 0; s0 < n_seq; s0 += kMaxSeqs)
        launch(s0, int(n_seq - s0 < kMaxSeqs ? n_seq - s0 : kMaxSeqs));
}

}  // namespace

void residual_rms_norm(float* x, int64_t rows, int64_t n, const float* a, int64_t lda,
                       const float* b, int64_t ldb, const float* s, int64_t lds, const float* w,
                       float eps, float* out, uintptr_t stream) {
    require(n > 0 && n <= 32 * kNormThreads, "residual_rms_norm: rows of 1..8192 values");
    require(!b || a, "residual_rms_norm: a gated term needs the plain term too");
    if (rows <= 0) return;
    const int per = int((n + kNormThreads - 1) / kNormThreads);
    auto go = [&](auto v) {
        residual_norm_kernel<decltype(v)::value><<<unsigned(rows), kNormThreads, 0, to_stream(stream)>>>(
            x, int(n), a, lda, b, ldb, s, lds, w, eps, out);
    };
    if (per <= 1) go(std::integral_constant<int, 1>{});
    else if (per <= 2) go(std::integral_constant<int, 2>{});
    else if (per <= 4) go(std::integral_constant<int, 4>{});
    else if (per <= 8) go(std::integral_constant<int, 8>{});
    else if (per <= 16) go(std::integral_constant<int, 16>{});
    else go(std::integral_constant<int, 32>{});
    FT_CUDA_CHECK(cudaGetLastError());
}

void conv_silu_steps(const float* x, int64_t ldx, float* const* states, const SeqTable& table,
                     int64_t n_seq, const float* w, int64_t channels, int64_t kc, int64_t n_tok,
                     float* y, float* keep, uintptr_t stream) {
    require(kc >= 1 && kc <= 16, "conv_silu_steps: kernel width must be 1..16");
    require(n_tok >= 0 && n_tok < (int64_t(1) << 20), "conv_silu_steps: bad token count");
    if (n_seq <= 0 || n_tok <= 0 || channels <= 0) return;
    const int64_t keep_t = n_seq * channels * (kc - 1);
    by_groups(n_seq, [&](int64_t s0, int ns) {
        const SeqPtrs p = seq_ptrs(states, table, s0, ns);
        conv_silu_kernel<<<blocks_for(int64_t(ns) * channels, 256), 256, 0, to_stream(stream)>>>(
            x + s0 * n_tok * ldx, ldx, p, ns, w, int(channels), int(kc), int(n_tok),
            y + s0 * n_tok * channels, keep ? keep + s0 * channels * (kc - 1) : nullptr, keep_t);
        FT_CUDA_CHECK(cudaGetLastError());
    });
}

void delta_rule_steps(const float* y, int64_t ldy, const float* z, int64_t ldz, const float* beta_raw,
                      const float* alpha_raw, int64_t ldg, const float* ssm_a, const float* dt_bias,
                      float* const* S, const SeqTable& table, int64_t n_seq, const float* norm_w,
                      int64_t n_tok, int64_t hk, int64_t hv, int64_t dk, int64_t dv, float eps,
                      float* out, float* keep, uintptr_t stream) {
    require(hk > 0 && hv % hk == 0, "delta_rule_steps: value heads must be a multiple of key heads");
    require(dv >= 32 && dv <= 512 && dv % 32 == 0 && dk >= 1,
            "delta_rule_steps: head dims must be dv = 32..512 (multiple of 32), dk >= 1");
    require(n_tok >= 0 && n_tok < (int64_t(1) << 20), "delta_rule_steps: bad token count");
    int R = 1;  // threads a value column (a divisor of dk)
    while (R < 8 && dv * R * 2 <= 512 && dk % (R * 2) == 0) R *= 2;
    const int64_t rows = dk / R;  // state rows a thread holds in registers
    require(rows <= 64, "delta_rule_steps: key head dim " + std::to_string(dk) + " is more than 64 x " +
                            std::to_string(R) + " threads a value column can hold");
    if (n_seq <= 0 || n_tok <= 0) return;
    // tokens a batch: up to 8, as many as fit in 48 KB of shared memory
    int tb = int(n_tok < 8 ? n_tok : 8);
    while (tb > 1 && delta_smem_floats(tb, int(dk), int(dv), R) * sizeof(float) > 48 * 1024) --tb;
    const size_t smem = delta_smem_floats(tb, int(dk), int(dv), R) * sizeof(float);
    require(smem <= 48 * 1024, "delta_rule_steps: head dims too large for shared memory");
    const int64_t state = hv * dk * dv, keep_t = n_seq * state;
    by_groups(n_seq, [&](int64_t s0, int ns) {
        const SeqPtrs p = seq_ptrs(S, table, s0, ns);
        const int64_t r0 = s0 * n_tok;  // first row of this group
        auto go = [&](auto cap, auto exact) {
            delta_step_kernel<decltype(cap)::value, decltype(exact)::value>
                <<<dim3(unsigned(hv), unsigned(ns)), unsigned(dv * R), smem, to_stream(stream)>>>(
                    y + r0 * ldy, ldy, z + r0 * ldz, ldz, beta_raw + r0 * ldg, alpha_raw + r0 * ldg, ldg,
                    ssm_a, dt_bias, p, norm_w, int(hk), int(hv), int(dk), int(dv), R, eps, int(n_tok), tb,
                    out + r0 * hv * dv, keep ? keep + s0 * state : nullptr, keep_t);
        };
        if (rows == 32 && dv == 128) go(std::integral_constant<int, 32>{}, std::true_type{});  // 35B-A3B
        else if (rows <= 8) go(std::integral_constant<int, 8>{}, std::false_type{});
        else if (rows <= 32) go(std::integral_constant<int, 32>{}, std::false_type{});
        else go(std::integral_constant<int, 64>{}, std::false_type{});
        FT_CUDA_CHECK(cudaGetLastError());
    });
}

void route_topk(const float* logits, int64_t rows, int64_t ld, int64_t n_experts, int64_t top_k,
                float floor, int32_t* ids, float* weights, uintptr_t stream) {
    require(n_experts >= 1 && n_experts <= kRouteThreads * kRouteValues,
            "route_topk: 1..2048 experts");
    require(top_k >= 1 && top_k <= 32 && top_k <= n_experts, "route_topk: top_k must be 1..32 and <= E");
    if (rows <= 0) return;
    if (n_experts <= 256 && top_k <= 32) {  // a warp per row, 4 rows per block
        route_warp_kernel<8><<<unsigned((rows + 3) / 4), 128, 0, to_stream(stream)>>>(
            logits, ld, rows, int(n_experts), int(top_k), floor, ids, weights);
    } else {
        route_kernel<<<unsigned(rows), kRouteThreads, 0, to_stream(stream)>>>(
            logits, ld, int(n_experts), int(top_k), floor, ids, weights);
    }
    FT_CUDA_CHECK(cudaGetLastError());
}

int64_t attention_splits(int64_t n_attn) {
    if (n_attn < 1) return 1;
    const int64_t chunk = attention_chunk(n_attn);
    return (n_attn + chunk - 1) / chunk;
}

void attention_steps(const float* qg, int64_t ldq, const float* k, const float* v, int64_t ldkv,
                     const float* q_norm, const float* k_norm, float eps, const int64_t* const* pos,
                     int64_t n_rot, float base, void* const* k_caches, void* const* v_caches,
                     const SeqTable& k_table, const SeqTable& v_table, int cache_dtype, int64_t n_attn,
                     int64_t n_seq, int64_t hq, int64_t hkv, int64_t d, float* workspace, float* out,
                     bool write_first, uintptr_t stream) {
    require(hkv > 0 && hq % hkv == 0, "attention_steps: query heads must be a multiple of kv heads");
    require(d == 64 || d == 128 || d == 256 || d == 512, "attention_steps: head dim must be 64, 128, 256 or 512");
    require(n_rot % 2 == 0 && n_rot <= d, "attention_steps: n_rot must be even and <= head dim");
    require(cache_dtype >= 0 && cache_dtype <= 3,
            "attention_steps: cache must be f32 (0), f16 (1), q8_0 (2) or q4_0 (3)");
    require(n_attn >= 1, "attention_steps: n_attn must be >= 1");
    if (n_seq <= 0) return;
    // a sequence attending fewer rows than n_attn leaves its last splits empty: the merge skips them
    const int64_t splits = attention_splits(n_attn), chunk = attention_chunk(n_attn);
    const cudaStream_t st = to_stream(stream);
    auto seqs = [&](int64_t s0, int ns) {
        SeqKV kv{};
        kv.table = k_table.table;
        for (int i = 0; i < ns; ++i) {
            if (k_table.table) {
                kv.at_k[i] = k_table.at[s0 + i];
                kv.at_v[i] = v_table.at[s0 + i];
            } else {
                kv.k[i] = k_caches[s0 + i];
                kv.v[i] = v_caches[s0 + i];
            }
            kv.pos[i] = pos[s0 + i];
        }
        return kv;
    };
    auto launch = [&](auto mode, int64_t s0, int ns, unsigned n_splits) {
        constexpr int M = decltype(mode)::value;
        const dim3 grid{unsigned(hq), unsigned(ns), n_splits};
        float* part = part_of(workspace, s0, hq, splits, d);
        const SeqKV kv = seqs(s0, ns);
        auto go = [&](auto cache) {
            launch_attention<decltype(cache), M>(grid, st, d, qg + s0 * ldq, ldq, k + s0 * ldkv,
                                                 v + s0 * ldkv, ldkv, q_norm, k_norm, eps, kv,
                                                 int(n_rot), base, int(hq), int(hkv), chunk, part);
        };
        switch (cache_dtype) {
            case 0: go(CacheF32{}); break;
            case 1: go(CacheF16{}); break;
            case 2: go(CacheQ8{}); break;
            default: go(CacheQ4{}); break;
        }
        FT_CUDA_CHECK(cudaGetLastError());
    };
    // write_first: the sequences' rows go into the caches before any attends, so entries that
    // share a cache (the tokens of one sequence) see each other's rows
    if (write_first)
        by_groups(n_seq, [&](int64_t s0, int ns) {
            launch(std::integral_constant<int, kWriteRows>{}, s0, ns, 1u);
        });
    by_groups(n_seq, [&](int64_t s0, int ns) {
        if (write_first)
            launch(std::integral_constant<int, kAttendOnly>{}, s0, ns, unsigned(splits));
        else
            launch(std::integral_constant<int, kWriteAndAttend>{}, s0, ns, unsigned(splits));
        attention_merge_kernel<<<dim3{unsigned(hq), unsigned(ns), blocks_for(d, kMergeDims)},
                                 kMergeDims * kMergeParts, 0, st>>>(
            part_of(workspace, s0, hq, splits, d), int(splits), int(d), qg + s0 * ldq, ldq, int(hq),
            out + s0 * hq * d);
        FT_CUDA_CHECK(cudaGetLastError());
    });
}

void swiglu(const float* gate, const float* up, int64_t ld, int64_t rows, int64_t n, float* out,
            uintptr_t stream) {
    if (rows <= 0 || n <= 0) return;
    swiglu_kernel<<<blocks_for(rows * n, 256), 256, 0, to_stream(stream)>>>(gate, up, ld, int(rows),
                                                                           int(n), out);
    FT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace ft::cuda
