// CPU decode tokens in one call (decode_loop.h): the layer loop of Qwen35Moe.forward for B = 1
// and T <= kMaxTokens (a decode token, a speculative verify step), and of Qwen35Moe.decode_many
// for B sequences, without Python between the ops. One code path serves both: the dense ops take
// all rows (B sequences' tokens, or one sequence's T), the mixers run per sequence on its rows;
// forward's token is decode_many's with one row. Each step below names the
// Python it mirrors; the arguments (row strides included) are those the ops.py wrappers pass,
// so that every kernel sees the same call and the logits are the same bits. The pool's threads
// are held awake for the whole token, as ops.cpu_threads_held does around a Python forward.
#include "decode_loop.h"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <stdexcept>
#include <string>
#include <tuple>

namespace ft::cpu {

// what run_many's plans must share: the weights (the States' pointers and n_ctx may differ)
static bool operator==(const MatW& a, const MatW& b) {
    return std::tie(a.type_id, a.w, a.n_out, a.row_stride) == std::tie(b.type_id, b.w, b.n_out, b.row_stride);
}
static bool operator==(const Bank& a, const Bank& b) {
    return std::tie(a.type_id, a.base, a.expert_stride) == std::tie(b.type_id, b.base, b.expert_stride);
}

namespace {

auto weights_of(const DecodeModel& m) {
    return std::tie(m.n_embd, m.n_vocab, m.eps, m.n_expert, m.top_k, m.expert_floor, m.ssm_hk, m.ssm_hv, m.ssm_dk,
                    m.ssm_dv, m.n_head, m.n_head_kv, m.head_dim, m.n_rot, m.inv_freq, m.embd_type, m.embd,
                    m.embd_row_bytes, m.out_norm, m.head);
}

auto weights_of(const DecodeLayer& L) {
    return std::tie(L.recurrent, L.attn_norm, L.post_norm, L.mixer_in, L.mixer_out, L.conv_w, L.conv_kc, L.ssm_a,
                    L.dt_bias, L.ssm_norm, L.q_norm, L.k_norm, L.ffn_in, L.shared_down, L.gate, L.up, L.down, L.n_ff,
                    L.n_bank_experts);
}

// ops._ld: the row stride a wrapper passes for `rows` rows of n floats, ld apart (one row: n)
int64_t ld_of(int64_t rows, int64_t n, int64_t ld) { return rows > 1 ? ld : n; }

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
    Widths& w = widths_;
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
        w.proj = std::max(w.proj, in);
        if (L.recurrent) w.conv = std::max(w.conv, L.mixer_in[0].n_out);
        w.ffn = std::max(w.ffn, total_out(L.ffn_in));
        if (shared) w.shared_ff = std::max(w.shared_ff, L.ffn_in[2].n_out);
    }
    scratch_ = std::make_unique<Scratch>(m, widths_, 1);
}

DecodePlan::Scratch::Scratch(const DecodeModel& m, const Widths& w, int64_t rows) : rows(rows) {
    const size_t B = size_t(rows), H = size_t(m.n_embd), K = size_t(m.top_k);
    const size_t mixer = size_t(std::max(m.n_head * m.head_dim, m.ssm_hv * m.ssm_dv));
    const size_t sizes[] = {B * H, B * H, B * size_t(w.proj), B * mixer, B * H, B * size_t(w.ffn), B * H,
                            B * size_t(w.shared_ff), B * H, B * K, B * size_t(w.conv),
                            B * size_t(m.n_head * m.head_dim), B * mixer, B * K, (B * size_t(m.embd_row_bytes) + 3) / 4};
    size_t total = 0;
    for (size_t n : sizes) total += aligned(n);
    arena.reset(new float[total + kAlign]);
    float* next = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(arena.get()) + 63) / 64 * 64);
    size_t i = 0;
    auto piece = [&] {
        float* p = next;
        next += aligned(sizes[i++]);
        return p;
    };
    for (float** p : {&x, &norm, &proj, &mix, &mix_out, &ffn, &experts_out, &swiglu, &shared_out, &expert_w,
                      &conv_y, &q_work, &mix_one})
        *p = piece();
    expert_ids = reinterpret_cast<int32_t*>(piece());
    embd_rows = reinterpret_cast<uint8_t*>(piece());
}

bool DecodePlan::shares_weights(const DecodePlan& other) const {
    return weights_of(m_) == weights_of(other.m_) &&
           std::equal(layers_.begin(), layers_.end(), other.layers_.begin(), other.layers_.end(),
                      [](const DecodeLayer& a, const DecodeLayer& b) { return weights_of(a) == weights_of(b); });
}

void DecodePlan::check_rows(int64_t n_tok, int64_t pos, int64_t n_attn) const {
    if (pos < 0 || pos + n_tok > std::min(n_attn, m_.n_ctx))
        throw std::invalid_argument("DecodePlan: no cache row for a token (pos + T > n_attn or n_ctx)");
}

void DecodePlan::check_tokens(const int64_t* tokens, int64_t n_tok, int64_t pos, int64_t n_attn) const {
    for (int64_t t = 0; t < n_tok; ++t)
        if (tokens[t] < 0 || tokens[t] >= m_.n_vocab) throw std::invalid_argument("DecodePlan: token id out of range");
    check_rows(n_tok, pos, n_attn);
}

void DecodePlan::run(int64_t token, int64_t pos, int64_t n_attn, float* logits) {
    run_tokens(&token, 1, pos, n_attn, false, false, logits, nullptr);
}

void DecodePlan::run_tokens(const int64_t* tokens, int64_t n_tok, int64_t pos, int64_t n_attn, bool keep,
                            bool last_only, float* logits, float* hidden) {
    if (n_tok < 1 || n_tok > kMaxTokens)
        throw std::invalid_argument("DecodePlan.run_tokens: 1 to " + std::to_string(kMaxTokens) + " tokens");
    if (keep && (n_tok < 2 || step_depth_ < n_tok - 1))
        throw std::invalid_argument("DecodePlan.run_tokens: keeping steps needs 2 <= T <= depth + 1");
    check_tokens(tokens, n_tok, pos, n_attn);
    const std::vector<DecodePlan*> plans{this};
    forward(Rows{plans, n_tok, &pos, &n_attn, keep}, tokens, nullptr, last_only, logits, hidden);
}

void DecodePlan::run_hidden(const float* x, int64_t n_tok, int64_t pos, int64_t n_attn, bool last_only,
                            float* logits, float* hidden) {
    if (n_tok < 1 || n_tok > kMaxTokens)
        throw std::invalid_argument("DecodePlan.run_hidden: 1 to " + std::to_string(kMaxTokens) + " tokens");
    if (!x) throw std::invalid_argument("DecodePlan.run_hidden: no input rows");
    check_rows(n_tok, pos, n_attn);
    const std::vector<DecodePlan*> plans{this};
    forward(Rows{plans, n_tok, &pos, &n_attn, false}, nullptr, x, last_only, logits, hidden);
}

void DecodePlan::set_steps(const std::vector<std::pair<float*, float*>>& steps, int64_t depth) {
    if (depth < 0 || (depth > 0 && steps.size() != layers_.size()))
        throw std::invalid_argument("DecodePlan.set_steps: one (conv, ssm) pair a layer");
    for (size_t i = 0; i < layers_.size(); ++i) {
        DecodeLayer& L = layers_[i];
        const bool has = depth > 0 && L.recurrent;
        if (has && (!steps[i].first || !steps[i].second))
            throw std::invalid_argument("DecodePlan.set_steps: a delta-net layer without kept states");
        L.conv_steps = has ? steps[i].first : nullptr;
        L.ssm_steps = has ? steps[i].second : nullptr;
    }
    step_depth_ = depth;
}

void DecodePlan::run_many(const std::vector<DecodePlan*>& plans, const int64_t* tokens, const int64_t* pos,
                          const int64_t* n_attn, float* logits) {
    if (plans.empty() || int64_t(plans.size()) > kMaxSequences)
        throw std::invalid_argument("DecodePlan.run_many: 1 to " + std::to_string(kMaxSequences) + " sequences");
    for (size_t b = 0; b < plans.size(); ++b) {
        if (!plans[b] || !plans[0]->shares_weights(*plans[b]))
            throw std::invalid_argument("DecodePlan.run_many: the plans are not of one model's weights");
        plans[b]->check_tokens(tokens + b, 1, pos[b], n_attn[b]);
    }
    plans[0]->forward(Rows{plans, 1, pos, n_attn, false}, tokens, nullptr, false, logits, nullptr);
}

// Qwen35Moe.decode_many (forward for one sequence): the weights are this plan's, sequence b's
// states plans[b]'s; B rows below are all the call's rows (sequences times tokens)
void DecodePlan::forward(const Rows& rows, const int64_t* tokens, const float* x_in, bool last_only, float* logits,
                         float* hidden) {
    const DecodeModel& m = m_;
    const int64_t H = m.n_embd, B = rows.count();
    if (scratch_->rows < B) scratch_ = std::make_unique<Scratch>(m, widths_, B);
    Scratch& s = *scratch_;
    HeldThreads held;
    if (x_in) {  // MtpHead.forward's x = _mm(z, eh_proj).contiguous()
        std::memcpy(s.x, x_in, size_t(B * H) * sizeof(float));
    } else {  // x = ops.dequantize(embd.data[tokens.reshape(-1)], ...): the rows gathered first, as the indexing does
        for (int64_t b = 0; b < B; ++b)
            std::memcpy(s.embd_rows + b * m.embd_row_bytes, m.embd + tokens[b] * m.embd_row_bytes,
                        size_t(m.embd_row_bytes));
        dequantize(m.embd_type, s.embd_rows, B, H, m.embd_row_bytes, s.x, 0);
    }
    Residual add;  // the previous layer's (routed, shared, shared gate): none before layer 0
    for (size_t i = 0; i < layers_.size(); ++i) {
        const DecodeLayer& L = layers_[i];
        residual_rms_norm(s.x, B, H, add.a, add.lda, add.b, add.ldb, add.s, add.lds, L.attn_norm, m.eps, s.norm);
        if (L.recurrent)
            delta_net(i, rows, s);
        else
            attention(i, rows, s);
        residual_rms_norm(s.x, B, H, s.mix_out, H, nullptr, 0, nullptr, 0, L.post_norm, m.eps, s.norm);
        add = feed_forward(L, B, s);
    }
    // h = residual_rms_norm(x, self.out_norm, ...), a fresh tensor: the hidden states returned
    float* h = hidden ? hidden : s.norm;
    residual_rms_norm(s.x, B, H, add.a, add.lda, add.b, add.ldb, add.s, add.lds, m.out_norm, m.eps, h);
    if (!logits) return;
    if (last_only)  // _mm(h[:, -1:], self.head)
        matmul_multi(&m.head, 1, H, h + (B - 1) * H, 1, logits, m.n_vocab);
    else  // _mm(h, self.head)
        matmul_multi(&m.head, 1, H, h, B, logits, m.n_vocab);
}

// the rows' projections, then per sequence layers.gated_delta_net on its n rows (views of the
// projections, rows `total` apart): ops.cpu_conv_silu and ops.cpu_delta_rule on all n at once,
// or with kept steps (gated_delta_net's `steps`) one call of each a token, on that token's row
// (a [1, 1, ..] slice is contiguous already: no copy), the conv/ssm states copied to kept step t
// after token t < n-1; each call's output is a fresh buffer that torch.cat copies into the
// rows; then the output projection
void DecodePlan::delta_net(size_t layer, const Rows& rows, Scratch& s) {
    const DecodeModel& m = m_;
    const DecodeLayer& L = layers_[layer];
    const int64_t B = rows.count(), n = rows.n_tok, total = total_out(L.mixer_in), C = L.mixer_in[0].n_out;
    const int64_t Z = L.mixer_in[1].n_out, G = L.mixer_in[2].n_out, hvdv = m.ssm_hv * m.ssm_dv;
    const int64_t conv_n = C * (L.conv_kc - 1), ssm_n = m.ssm_hv * m.ssm_dk * m.ssm_dv;
    matmul_multi(L.mixer_in.data(), 4, m.n_embd, s.norm, B, s.proj, total);  // mix | z | beta | alpha
    for (size_t b = 0; b < rows.plans.size(); ++b) {
        const DecodeLayer& state = rows.plans[b]->layers_[layer];
        const float* mix0 = s.proj + int64_t(b) * n * total;
        float* out = s.mix + int64_t(b) * n * hvdv;
        if (!rows.keep) {
            const float *z = mix0 + C, *beta = z + Z, *alpha = beta + G;
            conv_silu_seq(mix0, ld_of(n, C, total), state.conv_state, L.conv_w, 1, n, C, L.conv_kc, s.conv_y);
            delta_rule_seq(s.conv_y, C, z, ld_of(n, Z, total), beta, alpha, ld_of(n, G, total), L.ssm_a, L.dt_bias,
                           state.ssm_state, L.ssm_norm, 1, n, m.ssm_hk, m.ssm_hv, m.ssm_dk, m.ssm_dv, m.eps,
                           s.mix_one);
            std::memcpy(out, s.mix_one, size_t(n * hvdv) * sizeof(float));
            continue;
        }
        for (int64_t t = 0; t < n; ++t) {
            const float *mix = mix0 + t * total, *z = mix + C, *beta = z + Z, *alpha = beta + G;
            conv_silu_seq(mix, C, state.conv_state, L.conv_w, 1, 1, C, L.conv_kc, s.conv_y);
            delta_rule_seq(s.conv_y, C, z, Z, beta, alpha, G, L.ssm_a, L.dt_bias, state.ssm_state, L.ssm_norm, 1,
                           1, m.ssm_hk, m.ssm_hv, m.ssm_dk, m.ssm_dv, m.eps, s.mix_one);
            std::memcpy(out + t * hvdv, s.mix_one, size_t(hvdv) * sizeof(float));
            if (t < n - 1) {  // steps[0][t].copy_(conv_state), steps[1][t].copy_(ssm_state)
                std::memcpy(state.conv_steps + t * conv_n, state.conv_state, size_t(conv_n) * sizeof(float));
                std::memcpy(state.ssm_steps + t * ssm_n, state.ssm_state, size_t(ssm_n) * sizeof(float));
            }
        }
    }
    matmul_multi(&L.mixer_out, 1, hvdv, s.mix, B, s.mix_out, m.n_embd);
}

// Qwen35Moe._attention_in on the rows, then per sequence layers.gated_attention ->
// ops.cpu_gated_attention on its n rows in one call (torch.cat as in delta_net); then the output
// projection
void DecodePlan::attention(size_t layer, const Rows& rows, Scratch& s) {
    const DecodeModel& m = m_;
    const DecodeLayer& L = layers_[layer];
    const int64_t B = rows.count(), n = rows.n_tok, total = total_out(L.mixer_in);
    const int64_t hqd = m.n_head * m.head_dim, kvd = m.n_head_kv * m.head_dim;
    matmul_multi(L.mixer_in.data(), int(L.mixer_in.size()), m.n_embd, s.norm, B, s.proj, total);
    for (size_t b = 0; b < rows.plans.size(); ++b) {
        const DecodeLayer& state = rows.plans[b]->layers_[layer];
        const float *qg = s.proj + int64_t(b) * n * total, *k = qg + 2 * hqd, *v = k + kvd;  // qg | k | v
        gated_attention(qg, ld_of(n, 2 * hqd, total), k, v, ld_of(n, kvd, total), L.q_norm, L.k_norm, m.eps,
                        rows.pos[b], n, m.n_head, m.n_head_kv, m.head_dim, m.n_rot, m.inv_freq, state.k_cache,
                        state.v_cache, rows.n_attn[b], s.q_work, s.mix_one, state.kv_type);
        std::memcpy(s.mix + int64_t(b) * n * hqd, s.mix_one, size_t(n * hqd) * sizeof(float));
    }
    matmul_multi(&L.mixer_out, 1, hqd, s.mix, B, s.mix_out, m.n_embd);
}

// Qwen35Moe._moe: the router (with the shared expert's gate logit, gate and up: one call),
// top-k, the routed experts, then the shared expert's swiglu and down projection; the router's
// logits, gate and up are column views of the one output, rows `total` apart
DecodePlan::Residual DecodePlan::feed_forward(const DecodeLayer& L, int64_t rows, Scratch& s) {
    const DecodeModel& m = m_;
    const int64_t H = m.n_embd, E = m.n_expert, total = total_out(L.ffn_in);
    matmul_multi(L.ffn_in.data(), int(L.ffn_in.size()), H, s.norm, rows, s.ffn, total);
    route_topk(s.ffn, rows, ld_of(rows, E, total), E, m.top_k, m.expert_floor, s.expert_ids, s.expert_w);
    moe_ffn(s.norm, rows, H, L.n_ff, L.n_bank_experts, s.expert_ids, s.expert_w, m.top_k, L.gate, L.up, L.down,
            s.experts_out);
    Residual r;
    r.a = s.experts_out, r.lda = H;
    if (L.shared_down.n_out == 0) return r;
    const int64_t R = L.ffn_in[0].n_out, F = L.ffn_in[2].n_out;
    const float* gate = s.ffn + R + 1;
    swiglu(gate, gate + F, ld_of(rows, F, total), rows, F, s.swiglu);
    matmul_multi(&L.shared_down, 1, F, s.swiglu, rows, s.shared_out, H);
    r.b = s.shared_out, r.ldb = H;
    r.s = s.ffn + R, r.lds = ld_of(rows, 1, total);
    return r;
}

}  // namespace ft::cpu
