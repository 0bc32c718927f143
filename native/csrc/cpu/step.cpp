// The small operations of a CPU decode step next to the matmuls: the residual add + RMS norm and
// the router's softmax + top-k (the contracts of csrc/cuda/api.h, same names; torch spends 5-10
// operations and more time than the arithmetic on each), and the delta-net: a decode step's token in two calls (the same contract as
// csrc/cuda/api.h's conv_silu_step and delta_rule_step) and a prompt's tokens in one
// (delta_rule_seq: the recurrence token by token, each value head's 64 KiB state kept in one
// core's cache throughout -- on a CPU that beats the chunked form's many small batched matmuls).
// torch needs ~40 operations for a token, each a pass over the 2 MiB state of a layer; here each
// value head reads and writes its state once per token, heads split over the pool.
//
// Denormals are flushed (FTZ/DAZ for the duration of a call, per thread): a decaying state drifts
// into the denormal range, where x86 arithmetic is tens of times slower; values that small
// (< 1.2e-38) change no output.
#include <algorithm>
#include <cmath>

#include "cpu.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace ft::cpu {
namespace {

class FlushDenormals {  // FTZ + DAZ on this thread while in scope
  public:
#if defined(__x86_64__) || defined(__i386__)
    FlushDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | 0x8040u); }
    ~FlushDenormals() { _mm_setcsr(saved_); }

  private:
    unsigned saved_;
#endif
};

inline float sigmoid(float x) { return 1.f / (1.f + std::exp(-x)); }
inline float softplus(float x) { return x > 20.f ? x : std::log1p(std::exp(x)); }  // torch's threshold
inline float silu(float x) { return x * sigmoid(x); }

}  // namespace

void conv_silu_seq(const float* x, int64_t ldx, float* conv_state, const float* w, int64_t batch,
                   int64_t n_tok, int64_t channels, int64_t kc, float* y) {
    if (kc < 1 || channels <= 0 || batch <= 0 || n_tok <= 0) return;
    // Blocks of channels over the pool. Per block: the weights transposed to [kc, block] and the
    // state to [kc - 1, block] rows, so that each tap is a contiguous multiply-add over the block
    // (vectorized), in the reference's order (oldest input first, this token's last).
    const int64_t grain = std::max<int64_t>(64, channels / (4 * num_threads()));
    if (n_tok == 1) {  // a decode token: each channel's taps straight from w [C, kc] and its state
        auto step = [&](int64_t c0, int64_t c1) {
            FlushDenormals ftz;
            const int64_t nh = kc - 1;
            for (int64_t b = 0; b < batch; ++b) {
                const float* xb = x + b * ldx;
                float* yb = y + b * channels;
                for (int64_t c = c0; c < c1; ++c) {
                    const float* wc = w + c * kc;
                    float* sc = conv_state + (b * channels + c) * nh;
                    float acc = 0.f;  // the order of the many-token path below: oldest input first
                    for (int64_t j = 0; j < nh; ++j) acc += sc[j] * wc[j];
                    acc += xb[c] * wc[nh];
                    for (int64_t r = 0; r + 1 < nh; ++r) sc[r] = sc[r + 1];
                    if (nh > 0) sc[nh - 1] = xb[c];
                    yb[c] = silu(acc);
                }
            }
        };
        // 8192 channels cost ~100 us on one thread (an exp each): worth the pool
        if (batch * channels < 2048) return step(0, channels);
        return parallel_for(channels, grain, step);
    }
    auto run = [&](int64_t c0, int64_t c1) {
        FlushDenormals ftz;
        const int64_t nc = c1 - c0, nh = kc - 1;
        thread_local std::vector<float> wt, hist;
        wt.resize(kc * nc);
        hist.resize(std::max<int64_t>(nh, 1) * nc);
        for (int64_t c = 0; c < nc; ++c)
            for (int64_t j = 0; j < kc; ++j) wt[j * nc + c] = w[(c0 + c) * kc + j];
        for (int64_t b = 0; b < batch; ++b) {
            float* sb = conv_state + b * channels * nh;
            for (int64_t c = 0; c < nc; ++c)
                for (int64_t r = 0; r < nh; ++r) hist[r * nc + c] = sb[(c0 + c) * nh + r];
            // input i of the sequence [state, x]: a state row for i < nh, else x row i - nh
            auto in = [&](int64_t i) -> const float* {
                return i < nh ? hist.data() + i * nc : x + (b * n_tok + i - nh) * ldx + c0;
            };
            for (int64_t t = 0; t < n_tok; ++t) {
                float* __restrict yt = y + (b * n_tok + t) * channels + c0;
                for (int64_t c = 0; c < nc; ++c) yt[c] = 0.f;
                for (int64_t j = 0; j < kc; ++j) {
                    const float* __restrict src = in(t + j);
                    const float* __restrict wj = wt.data() + j * nc;
                    for (int64_t c = 0; c < nc; ++c) yt[c] += src[c] * wj[c];
                }
                for (int64_t c = 0; c < nc; ++c) yt[c] = silu(yt[c]);
            }
            // the new state: the last nh inputs (read before any is overwritten: hist is a copy)
            for (int64_t r = 0; r < nh; ++r) {
                const float* src = in(n_tok + r);
                for (int64_t c = 0; c < nc; ++c) sb[(c0 + c) * nh + r] = src[c];
            }
        }
    };
    if (batch * n_tok * channels < (1 << 14)) return run(0, channels);  // cheaper than the pool
    parallel_for(channels, grain, run);
}

void conv_silu_step(const float* x, int64_t ldx, float* conv_state, const float* w, int64_t batch,
                    int64_t channels, int64_t kc, float* y) {
    conv_silu_seq(x, ldx, conv_state, w, batch, 1, channels, kc, y);
}

namespace {

// n_tok tokens of one (sequence, value head): the recurrence with its state s [dk, dv] kept in
// cache. Built for three x86-64 levels and chosen at load time (target_clones): this file has no
// ISA flags of its own, and the two passes over the state are most of a CPU prompt's delta-net.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
void head_tokens(const float* y, int64_t ldy, const float* z, int64_t ldz, const float* beta_raw,
                 const float* alpha_raw, int64_t ldg, float ssm_a, float dt_bias, float* __restrict s,
                 const float* norm_w, int64_t row0, int64_t n_tok, int64_t hk, int64_t h,
                 int64_t hv, int64_t dk, int64_t dv, float eps, float* out, float* __restrict q,
                 float* __restrict k, float* __restrict kv, float* __restrict o) {
    const int64_t kh = h % hk;
    const float qscale = 1.f / std::sqrt(float(dk));
    for (int64_t t = 0; t < n_tok; ++t) {
        const int64_t row = row0 + t;
        const float* yb = y + row * ldy;
        const float* qs = yb + kh * dk;
        const float* ks = yb + hk * dk + kh * dk;
        const float* v = yb + 2 * hk * dk + h * dv;
        float sq = 0.f, sk = 0.f;  // L2 norms of q and k
        for (int64_t i = 0; i < dk; ++i) sq += qs[i] * qs[i], sk += ks[i] * ks[i];
        const float nq = qscale / std::sqrt(sq + eps), nk = 1.f / std::sqrt(sk + eps);
        for (int64_t i = 0; i < dk; ++i) q[i] = qs[i] * nq, k[i] = ks[i] * nk;
        const float beta = sigmoid(beta_raw[row * ldg + h]);
        const float decay = std::exp(ssm_a * softplus(alpha_raw[row * ldg + h] + dt_bias));
        // pass 1: S *= decay, kv = S^T k
        for (int64_t c = 0; c < dv; ++c) kv[c] = 0.f;
        for (int64_t i = 0; i < dk; ++i) {
            float* __restrict si = s + i * dv;
            const float ki = k[i];
            for (int64_t c = 0; c < dv; ++c) {
                si[c] *= decay;
                kv[c] += ki * si[c];
            }
        }
        for (int64_t c = 0; c < dv; ++c) kv[c] = beta * (v[c] - kv[c]);  // u
        // pass 2 (the state is in cache now): S += k u^T, o = S^T q
        for (int64_t c = 0; c < dv; ++c) o[c] = 0.f;
        for (int64_t i = 0; i < dk; ++i) {
            float* __restrict si = s + i * dv;
            const float ki = k[i], qi = q[i];
            for (int64_t c = 0; c < dv; ++c) {
                si[c] += ki * kv[c];
                o[c] += qi * si[c];
            }
        }
        // gated RMS norm over the head: rms_norm(o) * norm_w * silu(z)
        float ss = 0.f;
        for (int64_t c = 0; c < dv; ++c) ss += o[c] * o[c];
        const float r = 1.f / std::sqrt(ss / float(dv) + eps);
        const float* zh = z + row * ldz + h * dv;
        float* oh = out + row * hv * dv + h * dv;
        for (int64_t c = 0; c < dv; ++c) oh[c] = o[c] * r * norm_w[c] * silu(zh[c]);
    }
}

}  // namespace

void delta_rule_seq(const float* y, int64_t ldy, const float* z, int64_t ldz, const float* beta_raw,
                    const float* alpha_raw, int64_t ldg, const float* ssm_a, const float* dt_bias,
                    float* S, const float* norm_w, int64_t batch, int64_t n_tok, int64_t hk, int64_t hv,
                    int64_t dk, int64_t dv, float eps, float* out) {
    if (hk <= 0 || hv % hk || dk <= 0 || dv <= 0 || n_tok < 0)
        throw std::invalid_argument("delta_rule_step: needs hk > 0 dividing hv, dk > 0, dv > 0");
    // one task per (sequence, value head): its state stays in this core's cache for all tokens
    parallel_for(batch * hv, 1, [&](int64_t h0, int64_t h1) {
        FlushDenormals ftz;
        std::vector<float> buf(2 * dk + 2 * dv);
        for (int64_t bh = h0; bh < h1; ++bh) {
            const int64_t b = bh / hv, h = bh % hv;
            head_tokens(y, ldy, z, ldz, beta_raw, alpha_raw, ldg, ssm_a[h], dt_bias[h], S + bh * dk * dv,
                        norm_w, b * n_tok, n_tok, hk, h, hv, dk, dv, eps, out, buf.data(),
                        buf.data() + dk, buf.data() + 2 * dk, buf.data() + 2 * dk + dv);
        }
    });
}

void residual_rms_norm(float* x, int64_t rows, int64_t n, const float* a, int64_t lda, const float* b,
                       int64_t ldb, const float* s, int64_t lds, const float* w, float eps, float* out) {
    auto run = [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
            float* xr = x + r * n;
            if (a) {
                const float* ar = a + r * lda;
                if (b) {
                    const float* br = b + r * ldb;
                    const float g = sigmoid(s[r * lds]);
                    for (int64_t j = 0; j < n; ++j) xr[j] += ar[j] + g * br[j];
                } else {
                    for (int64_t j = 0; j < n; ++j) xr[j] += ar[j];
                }
            }
            float ss = 0.f;
            for (int64_t j = 0; j < n; ++j) ss += xr[j] * xr[j];
            const float k = 1.f / std::sqrt(ss / float(n) + eps);
            float* o = out + r * n;
            for (int64_t j = 0; j < n; ++j) o[j] = xr[j] * k * w[j];
        }
    };
    if (rows * n < (1 << 16)) return run(0, rows);  // a decode token: cheaper than the pool
    parallel_for(rows, std::max<int64_t>(1, 16384 / n), run);
}

void route_topk(const float* logits, int64_t rows, int64_t ld, int64_t n_experts, int64_t top_k,
                float floor, int32_t* ids, float* weights) {
    if (top_k <= 0 || top_k > n_experts) throw std::invalid_argument("route_topk: need 0 < top_k <= n_experts");
    auto run = [&](int64_t r0, int64_t r1) {
        std::vector<float> p(n_experts);
        std::vector<int32_t> order(n_experts);
        for (int64_t r = r0; r < r1; ++r) {
            const float* l = logits + r * ld;
            float mx = l[0];
            for (int64_t e = 1; e < n_experts; ++e) mx = std::max(mx, l[e]);
            float sum = 0.f;
            for (int64_t e = 0; e < n_experts; ++e) sum += (p[e] = std::exp(l[e] - mx));
            for (int64_t e = 0; e < n_experts; ++e) p[e] /= sum, order[e] = int32_t(e);
            // the k largest, descending; ties: lower id first
            std::partial_sort(order.begin(), order.begin() + top_k, order.end(), [&](int32_t i, int32_t j) {
                return p[i] > p[j] || (p[i] == p[j] && i < j);
            });
            float ksum = 0.f;
            for (int64_t k = 0; k < top_k; ++k) ksum += p[order[k]];
            const float denom = std::max(ksum, floor);
            for (int64_t k = 0; k < top_k; ++k) {
                ids[r * top_k + k] = order[k];
                weights[r * top_k + k] = p[order[k]] / denom;
            }
        }
    };
    if (rows < 16) return run(0, rows);  // a decode step: cheaper than the pool
    parallel_for(rows, 8, run);
}

void swiglu(const float* gate, const float* up, int64_t ld, int64_t rows, int64_t n, float* out) {
    auto run = [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
            const float *g = gate + r * ld, *u = up + r * ld;
            float* o = out + r * n;
            for (int64_t j = 0; j < n; ++j) o[j] = silu(g[j]) * u[j];
        }
    };
    if (rows * n < (1 << 16)) return run(0, rows);
    parallel_for(rows, std::max<int64_t>(1, 16384 / n), run);
}

void delta_rule_step(const float* y, int64_t ldy, const float* z, int64_t ldz, const float* beta_raw,
                     const float* alpha_raw, int64_t ldg, const float* ssm_a, const float* dt_bias,
                     float* S, const float* norm_w, int64_t batch, int64_t hk, int64_t hv, int64_t dk,
                     int64_t dv, float eps, float* out) {
    delta_rule_seq(y, ldy, z, ldz, beta_raw, alpha_raw, ldg, ssm_a, dt_bias, S, norm_w, batch, 1, hk,
                   hv, dk, dv, eps, out);
}

}  // namespace ft::cpu
