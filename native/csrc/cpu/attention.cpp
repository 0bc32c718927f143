// Causal GQA softmax attention of one sequence on the CPU, with the gated mixer's sigmoid gate:
// the core of qwen35moe's full-attention layers between the cache write and the output
// projection, for a decode token or a prompt chunk. torch ran it on one thread (the kernels' pool
// owns the cores) through [Hq, T, L] score tensors; here tasks of up to 8 queries that read one
// kv head (a decode token's group of query heads, or a few tokens of fewer heads) split over the
// pool, a task's scores in rows of L floats, each K and V row read (and unpacked, for a packed
// KV type) once for the task. A query's arithmetic does not depend on its task's other queries.
#include <cmath>
#include <cstring>
#include <string>

#include "cpu.h"

namespace ft::cpu {
namespace {

constexpr int64_t kQueryBlock = 8;  // queries a task: a decode token's group of 8 query heads
constexpr int64_t kMaxHeadDim = 512;

// quants.h's fp16_to_f32 as selects rather than branches, so that a row's loop vectorizes: the
// same floats (subnormals exact: the CPU kernels may run with denormals flushed, so the
// subnormal case is an exact product of normal numbers, not a bit trick).
inline float half_to_float(uint16_t h) {
    const uint32_t sign = uint32_t(h & 0x8000u) << 16, em = h & 0x7FFFu;
    const float normal = bits_to_f32(sign | ((em << 13) + 0x38000000u));
    const float special = bits_to_f32(sign | 0x7F800000u | ((em & 0x3FFu) << 13));
    const float sub = bits_to_f32(sign | f32_to_bits(float(em) * 5.9604644775390625e-08f));
    return em >= 0x7C00u ? special : em >= 0x400u ? normal : sub;
}

// One kv head's rows of a cache as stored (native/kv_cache.py's layouts, `type` its code): row l
// as floats, read in place (f32) or unpacked into buf (f16; q8_0, q4_0: each value its quant
// times its block's f16 scale, the float32 product kv_cache.dequantize computes).
struct KvRows {
    const uint8_t* base;  // row 0 of this kv head
    int64_t stride;       // bytes from one position's row to the next
    int type;
    int64_t d;
    const float* row(int64_t l, float* buf) const {
        const uint8_t* r = base + l * stride;
        if (type == 0) return reinterpret_cast<const float*>(r);
        if (type == 1) {
            for (int64_t c = 0; c < d; ++c) buf[c] = half_to_float(ld_u16(r + 2 * c));
            return buf;
        }
        const uint8_t* scales = r + (type == 2 ? d : d / 2);
        for (int64_t b = 0; b < d / 32; ++b) {
            const float s = fp16_to_f32(ld_u16(scales + 2 * b));
            float* out = buf + 32 * b;
            if (type == 2) {
                const uint8_t* q = r + 32 * b;
                for (int j = 0; j < 32; ++j) out[j] = float(int8_t(q[j])) * s;
            } else {  // nibbles: value 2i low in byte i, 2i+1 high; value q - 8
                const uint8_t* q = r + 16 * b;
                for (int j = 0; j < 16; ++j) {
                    out[2 * j] = (float(q[j] & 15) - 8.f) * s;
                    out[2 * j + 1] = (float(q[j] >> 4) - 8.f) * s;
                }
            }
        }
        return buf;
    }
};

inline void st_u16(uint8_t* p, uint16_t v) { std::memcpy(p, &v, 2); }

// f32 -> f16 rounded to nearest even (torch's .to(float16)): overflow to inf, subnormal halves
// by an exact scaling and a rounding to an integer (the CPU kernels may flush denormals, so no
// bit trick on f32 subnormals is relied on).
inline uint16_t float_to_half(float f) {
    const uint32_t x = f32_to_bits(f), sign = (x >> 16) & 0x8000u, a = x & 0x7FFFFFFFu;
    if (a >= 0x7F800000u) return uint16_t(sign | 0x7C00u | (a > 0x7F800000u ? 0x200u : 0u));
    if (a >= 0x477FF000u) return uint16_t(sign | 0x7C00u);  // 65520 and up round to inf
    if (a < 0x38800000u) return uint16_t(sign | uint32_t(std::nearbyint(bits_to_f32(a) * 16777216.f)));
    const uint32_t r = a + 0xFFFu + ((a >> 13) & 1u);  // round the 13 dropped bits, ties to even
    return uint16_t(sign | ((r - 0x38000000u) >> 13));
}

// A head row of d floats into its KV type's bytes at dst, as native/kv_cache.py's quantize does
// it step for step (each an IEEE float operation; ties of q8_0's rounding to even, as
// torch.round): f16 the values rounded; q8_0 / q4_0 blocks of 32, quants then f16 scales.
void pack_row(const float* x, int64_t d, int type, uint8_t* dst) {
    if (type == 0) {
        std::memcpy(dst, x, size_t(d) * sizeof(float));
        return;
    }
    if (type == 1) {
        for (int64_t c = 0; c < d; ++c) st_u16(dst + 2 * c, float_to_half(x[c]));
        return;
    }
    uint8_t* scales = dst + (type == 2 ? d : d / 2);
    for (int64_t b = 0; b < d / 32; ++b) {
        const float* xb = x + 32 * b;
        float s;
        if (type == 2) {
            float amax = 0.f;
            for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(xb[j]));
            s = amax / 127.f;
        } else {  // the value of largest magnitude, the first of equal ones, over -8
            int at = 0;
            for (int j = 1; j < 32; ++j)
                if (std::fabs(xb[j]) > std::fabs(xb[at])) at = j;
            s = xb[at] / -8.f;
        }
        const float inv = s != 0.f ? 1.f / s : 0.f;
        if (type == 2) {
            for (int j = 0; j < 32; ++j) dst[32 * b + j] = uint8_t(int8_t(std::nearbyint(xb[j] * inv)));
        } else {
            for (int j = 0; j < 16; ++j) {
                const int lo = std::min(15, int(std::floor(xb[2 * j] * inv + 8.5f)));
                const int hi = std::min(15, int(std::floor(xb[2 * j + 1] * inv + 8.5f)));
                dst[16 * b + j] = uint8_t(lo | hi << 4);
            }
        }
        st_u16(scales + 2 * b, float_to_half(s));
    }
}

// Up to kQueryBlock queries that read the same kv head: query i's d values, its gate (or null),
// where its output goes, and how many cache rows it sees (keys < n[i]).
struct QueryBlock {
    int64_t count;
    const float* q[kQueryBlock];
    const float* gate[kQueryBlock];
    float* out[kQueryBlock];
    int64_t n[kQueryBlock];
};

// A block of queries, key-major: each key and value row is read once for the whole block, the
// block's queries and sums stay in L1. The dot products keep 16 partial sums (one vector lane
// each, so the compiler vectorizes them without reordering a sum: every ISA gives the same
// bits): d % 16 == 0. s: [kQueryBlock, n_attn], o: [kQueryBlock, d]. Inlined into one wrapper
// per ISA below, compiled for that ISA.
[[gnu::always_inline]] inline void head_block(const QueryBlock& qb, const KvRows& kc, const KvRows& vc,
                                              int64_t n_attn, int64_t d, float scale, float* __restrict s,
                                              float* __restrict o) {
    alignas(64) float row_buf[kMaxHeadDim];
    const int64_t nq = qb.count;
    int64_t n_max = 0;
    for (int64_t i = 0; i < nq; ++i) n_max = std::max(n_max, qb.n[i]);
    for (int64_t l = 0; l < n_max; ++l) {
        const float* kl = kc.row(l, row_buf);
        for (int64_t i = 0; i < nq; ++i) {
            if (l >= qb.n[i]) continue;
            const float* qi = qb.q[i];
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
        for (int64_t l = 0; l < qb.n[i]; ++l) mx = std::max(mx, si[l]);
        for (int64_t l = 0; l < qb.n[i]; ++l) sum += (si[l] = std::exp(si[l] - mx));
        inv[i] = qb.n[i] > 0 ? 1.f / sum : 0.f;
        for (int64_t c = 0; c < d; ++c) o[i * d + c] = 0.f;
    }
    for (int64_t l = 0; l < n_max; ++l) {
        const float* vl = vc.row(l, row_buf);
        for (int64_t i = 0; i < nq; ++i) {
            if (l >= qb.n[i]) continue;
            const float p = s[i * n_attn + l];
            float* __restrict oi = o + i * d;
            for (int64_t c = 0; c < d; ++c) oi[c] += p * vl[c];
        }
    }
    for (int64_t i = 0; i < nq; ++i) {
        float* ot = qb.out[i];
        const float* gt = qb.gate[i];
        for (int64_t c = 0; c < d; ++c) {
            const float v = o[i * d + c] * inv[i];
            ot[c] = gt ? v / (1.f + std::exp(-gt[c])) : v;
        }
    }
}

using HeadBlockFn = void (*)(const QueryBlock&, const KvRows&, const KvRows&, int64_t, int64_t, float, float*,
                             float*);
#define FT_HEAD_BLOCK_ARGS \
    const QueryBlock &qb, const KvRows &kc, const KvRows &vc, int64_t n_attn, int64_t d, float scale, float *s, float *o
#define FT_HEAD_BLOCK_CALL head_block(qb, kc, vc, n_attn, d, scale, s, o)
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

// Bytes of a head row of d values of kv_type (native/kv_cache.py's row_bytes), after checking
// that the kernels take it: a known type, d <= kMaxHeadDim (the row buffers), blocks of 32 for
// q8_0 / q4_0. `what` names the caller in the error.
int64_t kv_row_bytes(int kv_type, int64_t d, const char* what) {
    if (kv_type < 0 || kv_type > 3)
        throw std::invalid_argument(std::string(what) + ": kv_type must be 0 (f32), 1 (f16), 2 (q8_0) or 3 (q4_0)");
    if (d > kMaxHeadDim || (kv_type >= 2 && d % 32))
        throw std::invalid_argument(std::string(what) + ": d at most 512, a multiple of 32 for q8_0 / q4_0");
    switch (kv_type) {
        case 0: return 4 * d;
        case 1: return 2 * d;
        case 2: return d + d / 16;
        default: return d / 2 + d / 16;
    }
}

}  // namespace

void attention(const float* q, int64_t q_t, int64_t q_h, const float* gate, int64_t g_t, int64_t g_h,
               const void* k_cache, const void* v_cache, int64_t n_attn, int64_t pos0, int64_t n_tok,
               int64_t hq, int64_t hkv, int64_t d, float* out, int kv_type) {
    if (hq <= 0 || hkv <= 0 || hq % hkv || d <= 0 || d % 16 || n_attn < 0 || pos0 < 0)
        throw std::invalid_argument("attention: needs hkv dividing hq, d a multiple of 16, n_attn and pos >= 0");
    const int64_t rb = kv_row_bytes(kv_type, d, "attention");
    if (n_tok <= 0) return;
    // a task: kv head g, heads [h0, h0 + hb) of its group, tokens [t0, t0 + tb): hb * tb <= 8
    // queries reading one kv head's rows (a decode token: the whole group of 8 in one task)
    const int64_t group = hq / hkv, hb = std::min(group, kQueryBlock), tb = std::max<int64_t>(1, kQueryBlock / hb);
    const int64_t head_chunks = (group + hb - 1) / hb, tok_chunks = (n_tok + tb - 1) / tb;
    const float scale = 1.f / std::sqrt(float(d));
    const HeadBlockFn block = head_block_for(kernels());
    auto run = [&](int64_t i0, int64_t i1) {
        thread_local std::vector<float> buf;
        if (int64_t(buf.size()) < kQueryBlock * (n_attn + d)) buf.resize(kQueryBlock * (n_attn + d));
        for (int64_t i = i0; i < i1; ++i) {
            const int64_t g = i / (head_chunks * tok_chunks), hc = i / tok_chunks % head_chunks, tc = i % tok_chunks;
            const int64_t h0 = g * group + hc * hb, h1 = std::min((g + 1) * group, h0 + hb);
            const int64_t t0 = tc * tb, t1 = std::min(n_tok, t0 + tb);
            QueryBlock qb{};
            for (int64_t t = t0; t < t1; ++t)
                for (int64_t h = h0; h < h1; ++h) {
                    const int64_t j = qb.count++;
                    qb.q[j] = q + t * q_t + h * q_h;
                    qb.gate[j] = gate ? gate + t * g_t + h * g_h : nullptr;
                    qb.out[j] = out + t * hq * d + h * d;
                    qb.n[j] = std::min(n_attn, pos0 + t + 1);
                }
            const KvRows kr{static_cast<const uint8_t*>(k_cache) + g * rb, hkv * rb, kv_type, d};
            const KvRows vr{static_cast<const uint8_t*>(v_cache) + g * rb, hkv * rb, kv_type, d};
            block(qb, kr, vr, n_attn, d, scale, buf.data(), buf.data() + kQueryBlock * n_attn);
        }
    };
    const int64_t tasks = hkv * head_chunks * tok_chunks;
    // a decode token over a short context: less work than handing it to the pool
    if (n_tok * std::min(n_attn, pos0 + n_tok) * hq * d < (1 << 17)) return run(0, tasks);
    parallel_for(tasks, 1, run);
}

void gated_attention(const float* qg, int64_t ld_qg, const float* k, const float* v, int64_t ld_kv,
                     const float* q_norm, const float* k_norm, float eps, int64_t pos0, int64_t n_tok,
                     int64_t hq, int64_t hkv, int64_t d, int64_t n_rot, const float* inv_freq,
                     void* k_cache, void* v_cache, int64_t n_attn, float* q_work, float* out, int kv_type) {
    if (n_rot < 0 || n_rot > d || n_rot % 2 || pos0 + n_tok > n_attn)
        throw std::invalid_argument("gated_attention: needs an even n_rot <= d and pos0 + n_tok <= n_attn");
    const int64_t rb = kv_row_bytes(kv_type, d, "gated_attention");
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
    uint8_t* const kc = static_cast<uint8_t*>(k_cache);
    uint8_t* const vc = static_cast<uint8_t*>(v_cache);
    auto prep = [&](int64_t t0, int64_t t1) {
        alignas(64) float row[kMaxHeadDim];
        for (int64_t t = t0; t < t1; ++t) {
            const int64_t pos = pos0 + t;
            for (int64_t h = 0; h < hq; ++h)  // qg row: per head d query values, then d gate values
                norm_rope(qg + t * ld_qg + h * 2 * d, q_norm, pos, q_work + (t * hq + h) * d);
            for (int64_t g = 0; g < hkv; ++g) {  // the rows as floats, then in the cache's type
                norm_rope(k + t * ld_kv + g * d, k_norm, pos, row);
                pack_row(row, d, kv_type, kc + (pos * hkv + g) * rb);
                pack_row(v + t * ld_kv + g * d, d, kv_type, vc + (pos * hkv + g) * rb);
            }
        }
    };
    if (n_tok < 8) prep(0, n_tok);  // a decode token: cheaper than the pool
    else parallel_for(n_tok, 4, prep);
    attention(q_work, hq * d, d, qg + d, ld_qg, 2 * d, k_cache, v_cache, n_attn, pos0, n_tok, hq, hkv, d, out,
              kv_type);
}

}  // namespace ft::cpu
