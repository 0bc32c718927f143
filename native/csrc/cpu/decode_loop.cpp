// One CPU decode token in one call (decode_loop.h): the layer loop of Qwen35Moe.forward for
// B = 1, T = 1 without Python between the ops. Each step below names the Python it mirrors; the
// arguments (row strides included) are those the ops.py wrappers pass, so that every kernel
// sees the same call and the logits are the same bits. The pool's threads are held awake for
// the whole token, as ops.cpu_threads_held does around a Python forward.
#include "decode_loop.h"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <stdexcept>

namespace ft::cpu {
namespace {

int64_t total_out(const std::vector<MatW>& ws) {
    return std::accumulate(ws.begin(), ws.end(), int64_t(0), [](int64_t s, const MatW& w) { return s + w.n_out; });
}

struct HeldThreads {  // hold_threads(true) for a scope, released on any exit
    HeldThreads() { hold_threads(true); }
    ~HeldThreads() { hold_threads(false); }
};

constexpr size_t kAlign = 16;  // floats: 64 bytes, as torch aligns the buffers of the Python path

size_t aligned(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

}  // namespace

DecodePlan::DecodePlan(const DecodeModel& model, std::vector<DecodeLayer> layers)
    : m_(model), layers_(std::move(layers)) {
    const DecodeModel& m = m_;
    const int64_t H = m.n_embd, hqd = m.n_head * m.head_dim, hvdv = m.ssm_hv * m.ssm_dv;
    if (H <= 0 || layers_.empty() || m.top_k <= 0 || m.head.n_out != m.n_vocab || !m.embd || !m.out_norm)
        throw std::invalid_argument("DecodePlan: needs layers, n_embd > 0, top_k > 0 and a head of n_vocab rows");
    int64_t proj = 0, conv = 0, ffn = 0, shared_ff = 0;
    for (const DecodeLayer& L : layers_) {
        const int64_t in = total_out(L.mixer_in);
        const bool ok_mixer = L.recurrent
            ? L.mixer_in.size() == 4 && L.mixer_in[1].n_out == hvdv && L.mixer_in[2].n_out == m.ssm_hv &&
                  L.mixer_in[3].n_out == m.ssm_hv && L.mixer_in[0].n_out == 2 * m.ssm_hk * m.ssm_dk + hvdv
            : (L.mixer_in.size() == 1 || L.mixer_in.size() == 3) &&
                  in == 2 * hqd + 2 * m.n_head_kv * m.head_dim && L.k_cache && L.v_cache;
        const bool shared = L.shared_down.n_out > 0;
        if (!ok_mixer || L.mixer_out.n_out != H || L.ffn_in.size() != (shared ? 4u : 1u) ||
            L.ffn_in[0].n_out < m.n_expert || (shared && (L.ffn_in[1].n_out != 1 || L.shared_down.n_out != H ||
                                                          L.ffn_in[2].n_out != L.ffn_in[3].n_out)))
            throw std::invalid_argument("DecodePlan: a layer's projections do not fit the model's shapes");
        proj = std::max(proj, in);
        if (L.recurrent) conv = std::max(conv, L.mixer_in[0].n_out);
        ffn = std::max(ffn, total_out(L.ffn_in));
        if (shared) shared_ff = std::max(shared_ff, L.ffn_in[2].n_out);
    }
    const size_t sizes[] = {size_t(H), size_t(H), size_t(proj), size_t(conv), size_t(std::max(hqd, hvdv)),
                            size_t(H), size_t(ffn), size_t(H), size_t(shared_ff), size_t(H), size_t(m.top_k),
                            size_t(hqd), size_t(m.top_k), size_t((m.embd_row_bytes + 3) / 4)};
    for (size_t n : sizes) arena_size_ += aligned(n);
    arena_.reset(new float[arena_size_ + kAlign]);
    size_t i = 0;
    for (float** p : {&x_, &norm_, &proj_, &conv_y_, &mix_, &mix_out_, &ffn_, &experts_out_, &swiglu_,
                      &shared_out_, &expert_w_, &q_work_})
        *p = scratch(sizes[i++]);
    expert_ids_ = reinterpret_cast<int32_t*>(scratch(sizes[i++]));
    embd_row_ = reinterpret_cast<uint8_t*>(scratch(sizes[i++]));
}

float* DecodePlan::scratch(size_t n) {
    const uintptr_t base = reinterpret_cast<uintptr_t>(arena_.get());
    float* aligned_base = reinterpret_cast<float*>((base + 63) / 64 * 64);
    float* p = aligned_base + arena_used_;
    arena_used_ += aligned(n);
    return p;
}

void DecodePlan::run(int64_t token, int64_t pos, int64_t n_attn, float* logits) {
    const DecodeModel& m = m_;
    const int64_t H = m.n_embd;
    if (token < 0 || token >= m.n_vocab) throw std::invalid_argument("DecodePlan.run: token id out of range");
    if (pos < 0 || pos + 1 > std::min(n_attn, m.n_ctx))
        throw std::invalid_argument("DecodePlan.run: no cache row for the token (pos >= n_attn or n_ctx)");
    HeldThreads held;
    // x = ops.dequantize(embd.data[token], ...): the row copied out first, as the gather does
    std::memcpy(embd_row_, m.embd + token * m.embd_row_bytes, size_t(m.embd_row_bytes));
    dequantize(m.embd_type, embd_row_, 1, H, m.embd_row_bytes, x_, 0);
    Residual add;  // the previous layer's (routed, shared, shared gate): none before layer 0
    for (const DecodeLayer& L : layers_) {
        residual_rms_norm(x_, 1, H, add.a, add.lda, add.b, add.ldb, add.s, add.lds, L.attn_norm, m.eps, norm_);
        if (L.recurrent)
            delta_net(L);
        else
            attention(L, pos, n_attn);
        residual_rms_norm(x_, 1, H, mix_out_, H, nullptr, 0, nullptr, 0, L.post_norm, m.eps, norm_);
        add = feed_forward(L);
    }
    residual_rms_norm(x_, 1, H, add.a, add.lda, add.b, add.ldb, add.s, add.lds, m.out_norm, m.eps, norm_);
    matmul_multi(&m.head, 1, H, norm_, 1, logits, m.n_vocab);  // _mm(h, self.head)
}

// Qwen35Moe._delta_net -> layers.gated_delta_net -> ops.cpu_conv_silu, ops.cpu_delta_rule
void DecodePlan::delta_net(const DecodeLayer& L) {
    const DecodeModel& m = m_;
    const int64_t total = total_out(L.mixer_in), C = L.mixer_in[0].n_out, Z = L.mixer_in[1].n_out;
    const int64_t G = L.mixer_in[2].n_out;
    matmul_multi(L.mixer_in.data(), 4, m.n_embd, norm_, 1, proj_, total);  // mix | z | beta | alpha
    const float *z = proj_ + C, *beta = z + Z, *alpha = beta + G;
    conv_silu_seq(proj_, C, L.conv_state, L.conv_w, 1, 1, C, L.conv_kc, conv_y_);
    delta_rule_seq(conv_y_, C, z, Z, beta, alpha, G, L.ssm_a, L.dt_bias, L.ssm_state, L.ssm_norm, 1, 1,
                   m.ssm_hk, m.ssm_hv, m.ssm_dk, m.ssm_dv, m.eps, mix_);
    matmul_multi(&L.mixer_out, 1, m.ssm_hv * m.ssm_dv, mix_, 1, mix_out_, m.n_embd);
}

// Qwen35Moe._attention -> layers.gated_attention -> ops.cpu_gated_attention
void DecodePlan::attention(const DecodeLayer& L, int64_t pos, int64_t n_attn) {
    const DecodeModel& m = m_;
    const int64_t hqd = m.n_head * m.head_dim, kvd = m.n_head_kv * m.head_dim;
    matmul_multi(L.mixer_in.data(), int(L.mixer_in.size()), m.n_embd, norm_, 1, proj_, total_out(L.mixer_in));
    const float *k = proj_ + 2 * hqd, *v = k + kvd;  // qg | k | v
    gated_attention(proj_, 2 * hqd, k, v, kvd, L.q_norm, L.k_norm, m.eps, pos, 1, m.n_head, m.n_head_kv,
                    m.head_dim, m.n_rot, m.inv_freq, L.k_cache, L.v_cache, n_attn, q_work_, mix_);
    matmul_multi(&L.mixer_out, 1, hqd, mix_, 1, mix_out_, m.n_embd);
}

// Qwen35Moe._moe: the router (with the shared expert's gate logit, gate and up: one call),
// top-k, the routed experts, then the shared expert's swiglu and down projection
DecodePlan::Residual DecodePlan::feed_forward(const DecodeLayer& L) {
    const DecodeModel& m = m_;
    const int64_t H = m.n_embd, E = m.n_expert;
    matmul_multi(L.ffn_in.data(), int(L.ffn_in.size()), H, norm_, 1, ffn_, total_out(L.ffn_in));
    route_topk(ffn_, 1, E, E, m.top_k, m.expert_floor, expert_ids_, expert_w_);
    moe_ffn(norm_, 1, H, L.n_ff, L.n_bank_experts, expert_ids_, expert_w_, m.top_k, L.gate, L.up, L.down,
            experts_out_);
    Residual r;
    r.a = experts_out_, r.lda = H;
    if (L.shared_down.n_out == 0) return r;
    const int64_t R = L.ffn_in[0].n_out, F = L.ffn_in[2].n_out;
    const float* gate = ffn_ + R + 1;
    swiglu(gate, gate + F, F, 1, F, swiglu_);
    matmul_multi(&L.shared_down, 1, F, swiglu_, 1, shared_out_, H);
    r.b = shared_out_, r.ldb = H;
    r.s = ffn_ + R, r.lds = 1;
    return r;
}

}  // namespace ft::cpu
