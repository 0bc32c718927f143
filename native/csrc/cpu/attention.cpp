// Causal GQA softmax attention of one sequence on the CPU, with the gated mixer's sigmoid gate:
// the core of qwen35moe's full-attention layers between the cache write and the output
// projection, for a decode token or a prompt chunk. torch ran it on one thread (the kernels' pool
// owns the cores) through [Hq, T, L] score tensors; here (query head, block of queries) tasks
// split over the pool, a block's scores in rows of L floats, K and V read from the cache.
#include <cmath>

#include "cpu.h"

namespace ft::cpu {
namespace {

constexpr int64_t kQueryBlock = 8;  // queries a task: dozens of tasks for one decode token's heads

// Queries [t0, t1) (at most kQueryBlock) of query head h, key-major: each key and value row is
// read once for the whole block (from L2), the block's queries and sums stay in L1. The dot
// products keep 16 partial sums (one vector lane each, so the compiler vectorizes them without
// reordering a sum: every ISA gives the same bits): d % 16 == 0. s: [kQueryBlock, n_attn],
// o: [kQueryBlock, d]. Inlined into one wrapper per ISA below, compiled for that ISA.
[[gnu::always_inline]] inline void head_block(const float* q, int64_t q_t, const float* gate, int64_t g_t,
                                              const float* kc, const float* vc, int64_t ld_kv, int64_t n_attn,
                                              int64_t pos0, int64_t t0, int64_t t1, int64_t d, float scale,
                                              float* out, int64_t o_t, float* __restrict s, float* __restrict o) {
    const int64_t nq = t1 - t0;
    int64_t n[kQueryBlock];  // keys query i sees: l <= its position
    for (int64_t i = 0; i < nq; ++i) n[i] = std::min(n_attn, pos0 + t0 + i + 1);
    const int64_t n_max = n[nq - 1];
    for (int64_t l = 0; l < n_max; ++l) {
        const float* kl = kc + l * ld_kv;
        for (int64_t i = 0; i < nq; ++i) {
            if (l >= n[i]) continue;
            const float* qi = q + (t0 + i) * q_t;
            float acc[16] = {};
            for (int64_t c = 0; c < d; c += 16)
                for (int j = 0; j < 16; ++j) acc[j] += qi[c + j] * kl[c + j];
            float dot = 0.f;
            for (int j = 0; j < 16; ++j) dot += acc[j];
            s[i * n_attn + l] = dot * scale;
        }
    }
    float inv[kQueryBlock];
    for (int64_t i = 0; i < nq; ++i) {
        float* si = s + i * n_attn;
        float mx = -INFINITY, sum = 0.f;
        for (int64_t l = 0; l < n[i]; ++l) mx = std::max(mx, si[l]);
        for (int64_t l = 0; l < n[i]; ++l) sum += (si[l] = std::exp(si[l] - mx));
        inv[i] = n[i] > 0 ? 1.f / sum : 0.f;
        for (int64_t c = 0; c < d; ++c) o[i * d + c] = 0.f;
    }
    for (int64_t l = 0; l < n_max; ++l) {
        const float* vl = vc + l * ld_kv;
        for (int64_t i = 0; i < nq; ++i) {
            if (l >= n[i]) continue;
            const float p = s[i * n_attn + l];
            float* __restrict oi = o + i * d;
            for (int64_t c = 0; c < d; ++c) oi[c] += p * vl[c];
        }
    }
    for (int64_t i = 0; i < nq; ++i) {
        float* ot = out + (t0 + i) * o_t;
        const float* gt = gate ? gate + (t0 + i) * g_t : nullptr;
        for (int64_t c = 0; c < d; ++c) {
            const float v = o[i * d + c] * inv[i];
            ot[c] = gt ? v / (1.f + std::exp(-gt[c])) : v;
        }
    }
}

using HeadBlockFn = void (*)(const float*, int64_t, const float*, int64_t, const float*, const float*,
                             int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float, float*, int64_t,
                             float*, float*);
#define FT_HEAD_BLOCK_ARGS                                                                          \
    const float *q, int64_t q_t, const float *gate, int64_t g_t, const float *kc, const float *vc, \
        int64_t ld_kv, int64_t n_attn, int64_t pos0, int64_t t0, int64_t t1, int64_t d, float scale, \
        float *out, int64_t o_t, float *s, float *o
#define FT_HEAD_BLOCK_CALL head_block(q, q_t, gate, g_t, kc, vc, ld_kv, n_attn, pos0, t0, t1, d, scale, out, o_t, s, o)
void head_block_generic(FT_HEAD_BLOCK_ARGS) { FT_HEAD_BLOCK_CALL; }
#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx2,fma"))) void head_block_avx2(FT_HEAD_BLOCK_ARGS) { FT_HEAD_BLOCK_CALL; }
__attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma"))) void head_block_avx512(FT_HEAD_BLOCK_ARGS) {
    FT_HEAD_BLOCK_CALL;
}
#endif

// the build of the active ISA (kernels().name: FTPATCH_CPU_ISA / set_isa pick it, as for the matmuls)
HeadBlockFn head_block_for(const IsaKernels& isa) {
#if defined(__x86_64__) && defined(__GNUC__)
    const std::string name = isa.name;
    if (name == "avx512") return head_block_avx512;
    if (name == "avx2") return head_block_avx2;
#endif
    return head_block_generic;
}

}  // namespace

void attention(const float* q, int64_t q_t, int64_t q_h, const float* gate, int64_t g_t, int64_t g_h,
               const float* k_cache, const float* v_cache, int64_t n_attn, int64_t pos0, int64_t n_tok,
               int64_t hq, int64_t hkv, int64_t d, float* out) {
    if (hq <= 0 || hkv <= 0 || hq % hkv || d <= 0 || d % 16 || n_attn < 0 || pos0 < 0)
        throw std::invalid_argument("attention: needs hkv dividing hq, d a multiple of 16, n_attn and pos >= 0");
    if (n_tok <= 0) return;
    const int64_t nb = (n_tok + kQueryBlock - 1) / kQueryBlock, group = hq / hkv;
    const float scale = 1.f / std::sqrt(float(d));
    const HeadBlockFn block = head_block_for(kernels());
    auto run = [&](int64_t i0, int64_t i1) {
        thread_local std::vector<float> buf;
        if (int64_t(buf.size()) < kQueryBlock * (n_attn + d)) buf.resize(kQueryBlock * (n_attn + d));
        for (int64_t i = i0; i < i1; ++i) {
            const int64_t h = i / nb, b = i % nb, kvh = h / group;
            const int64_t t0 = b * kQueryBlock, t1 = std::min(n_tok, t0 + kQueryBlock);
            block(q + h * q_h, q_t, gate ? gate + h * g_h : nullptr, g_t, k_cache + kvh * d,
                       v_cache + kvh * d, hkv * d, n_attn, pos0, t0, t1, d, scale, out + h * d, hq * d,
                       buf.data(), buf.data() + kQueryBlock * n_attn);
        }
    };
    // a decode token over a short context: less work than handing it to the pool
    if (n_tok * std::min(n_attn, pos0 + n_tok) * hq * d < (1 << 17)) return run(0, hq * nb);
    parallel_for(hq * nb, 1, run);
}

void gated_attention(const float* qg, int64_t ld_qg, const float* k, const float* v, int64_t ld_kv,
                     const float* q_norm, const float* k_norm, float eps, int64_t pos0, int64_t n_tok,
                     int64_t hq, int64_t hkv, int64_t d, int64_t n_rot, const float* inv_freq,
                     float* k_cache, float* v_cache, int64_t n_attn, float* q_work, float* out) {
    if (n_rot < 0 || n_rot > d || n_rot % 2 || pos0 + n_tok > n_attn)
        throw std::invalid_argument("gated_attention: needs an even n_rot <= d and pos0 + n_tok <= n_attn");
    // RMS norm (times its weight), then NEOX RoPE on the first n_rot dims: pair (i, i + n_rot/2)
    // turns by angle pos * inv_freq[i] -- layers.rms_norm and layers.rope_neox, row by row
    auto norm_rope = [&](const float* x, const float* w, int64_t pos, float* y) {
        float ss = 0.f;
        for (int64_t c = 0; c < d; ++c) ss += x[c] * x[c];
        const float r = 1.f / std::sqrt(ss / float(d) + eps);
        for (int64_t c = 0; c < d; ++c) y[c] = x[c] * r * w[c];
        const int64_t half = n_rot / 2;
        for (int64_t i = 0; i < half; ++i) {
            const float a = float(pos) * inv_freq[i], cs = std::cos(a), sn = std::sin(a);
            const float x1 = y[i], x2 = y[i + half];
            y[i] = x1 * cs - x2 * sn;
            y[i + half] = x2 * cs + x1 * sn;
        }
    };
    auto prep = [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t) {
            const int64_t pos = pos0 + t;
            for (int64_t h = 0; h < hq; ++h)  // qg row: per head d query values, then d gate values
                norm_rope(qg + t * ld_qg + h * 2 * d, q_norm, pos, q_work + (t * hq + h) * d);
            for (int64_t g = 0; g < hkv; ++g) {
                norm_rope(k + t * ld_kv + g * d, k_norm, pos, k_cache + (pos * hkv + g) * d);
                std::copy(v + t * ld_kv + g * d, v + t * ld_kv + (g + 1) * d, v_cache + (pos * hkv + g) * d);
            }
        }
    };
    if (n_tok < 8) prep(0, n_tok);  // a decode token: cheaper than the pool
    else parallel_for(n_tok, 4, prep);
    attention(q_work, hq * d, d, qg + d, ld_qg, 2 * d, k_cache, v_cache, n_attn, pos0, n_tok, hq, hkv, d, out);
}

}  // namespace ft::cpu
