// CPU decode tokens in one native call (decode_loop.cpp): every layer, the final norm and the
// head, calling the same ops in the same order with the same arguments as the per-op path of
// moe_offload/models/qwen35moe.py (forward with B = 1 and a few tokens, T <= kMaxTokens: a
// decode token or a speculative verify step; decode_many for B sequences), so the logits (and
// the final-normed hidden states) are the same bits. A plan is built once per (model, State) from raw pointers;
// Python keeps every buffer it points to alive (weights, norms, the State's conv/ssm/KV tensors,
// the RoPE frequencies).
#pragma once
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "cpu.h"

namespace ft::cpu {

struct DecodeLayer {
    bool recurrent = false;
    const float* attn_norm = nullptr;
    const float* post_norm = nullptr;
    // the mixer's input projections, one matmul_multi (delta-net: qkv, gate, beta, alpha;
    // attention: q (with its gate rows), k, v, or the fused qkv) and its output projection
    std::vector<MatW> mixer_in;
    MatW mixer_out{};
    // delta-net: conv state [C, kc-1] and weights [C, kc]; ssm state [hv, dk, dv]
    float* conv_state = nullptr;
    const float* conv_w = nullptr;
    int64_t conv_kc = 0;
    float* ssm_state = nullptr;
    // the kept states (State.steps): conv [depth, C, kc-1], ssm [depth, hv, dk, dv]; null: none
    float* conv_steps = nullptr;
    float* ssm_steps = nullptr;
    const float* ssm_a = nullptr;
    const float* dt_bias = nullptr;
    const float* ssm_norm = nullptr;
    // attention: q/k norms [d], caches [n_ctx, hkv, X] of kv_type (attention.cpp's codes)
    const float* q_norm = nullptr;
    const float* k_norm = nullptr;
    void* k_cache = nullptr;
    void* v_cache = nullptr;
    int kv_type = 0;
    // feed-forward: the router, and with a shared expert its gate logit, gate and up (one
    // matmul_multi), its down projection (n_out 0: none); the routed experts' banks
    std::vector<MatW> ffn_in;
    MatW shared_down{};
    Bank gate{}, up{}, down{};
    int64_t n_ff = 0, n_bank_experts = 0;
};

struct DecodeModel {
    int64_t n_embd = 0, n_vocab = 0;
    float eps = 0.f;
    int64_t n_expert = 0, top_k = 0;  // routing (config), its renormalisation floor
    float expert_floor = 0.f;
    int64_t ssm_hk = 0, ssm_hv = 0, ssm_dk = 0, ssm_dv = 0;
    int64_t n_head = 0, n_head_kv = 0, head_dim = 0, n_rot = 0, n_ctx = 0;
    const float* inv_freq = nullptr;  // [n_rot / 2], RoPE's frequencies as Python computes them
    int embd_type = 0;
    const uint8_t* embd = nullptr;  // token_embd rows
    int64_t embd_row_bytes = 0;
    const float* out_norm = nullptr;
    MatW head{};
};

class DecodePlan {
  public:
    static constexpr int64_t kMaxSequences = 64;  // run_many's batch: its arena grows with it
    static constexpr int64_t kMaxTokens = 8;      // run_tokens' T (ops.DECODE_MAX_TOKENS)

    DecodePlan(const DecodeModel& model, std::vector<DecodeLayer> layers);
    // One token at position pos (< n_attn <= n_ctx), the first n_attn cache rows attended:
    // updates the conv/ssm states and KV rows in place, logits f32 [n_vocab].
    void run(int64_t token, int64_t pos, int64_t n_attn, float* logits);
    // Qwen35Moe.forward of n_tok tokens of the one sequence (B = 1) at positions pos.., the first
    // n_attn cache rows attended: the norms, projections, router and experts take the n_tok rows
    // in one call; attention takes them in one call, the delta-net too, or with `keep` token by
    // token, the conv/ssm states after each of the first n_tok-1 written to the kept steps
    // (set_steps; depth >= n_tok-1). logits f32 [n_tok or, last_only, 1, n_vocab]; hidden (if
    // not null) the final-normed hidden states f32 [n_tok, n_embd].
    void run_tokens(const int64_t* tokens, int64_t n_tok, int64_t pos, int64_t n_attn, bool keep, bool last_only,
                    float* logits, float* hidden);
    // run_tokens from the residual stream x f32 [n_tok, n_embd] (copied) instead of the tokens'
    // embeddings, no kept steps: the MTP head's block after its eh_proj (models/mtp.py); logits
    // null: no head (logits="none").
    void run_hidden(const float* x, int64_t n_tok, int64_t pos, int64_t n_attn, bool last_only, float* logits,
                    float* hidden);
    // The State's kept steps: per layer (conv, ssm) base pointers (null for attention layers or
    // none), `depth` states each; depth 0 drops them.
    void set_steps(const std::vector<std::pair<float*, float*>>& steps, int64_t depth);
    // Qwen35Moe.decode_many: token b of sequence b at pos[b], the first n_attn[b] rows of its
    // cache attended, b < B = plans.size(); plan b holds sequence b's State, every plan the
    // same weights. Norms, projections, router and experts take the B rows in one call, the
    // mixer's core runs per sequence on its own state. logits f32 [B, n_vocab].
    static void run_many(const std::vector<DecodePlan*>& plans, const int64_t* tokens, const int64_t* pos,
                         const int64_t* n_attn, float* logits);

  private:
    struct Residual {  // what the next residual_rms_norm adds to x (the rows' strides as Python's)
        const float *a = nullptr, *b = nullptr, *s = nullptr;
        int64_t lda = 0, ldb = 0, lds = 0;
    };
    struct Widths {  // the widest projection outputs over the layers: the arena's row sizes
        int64_t proj = 0, conv = 0, ffn = 0, shared_ff = 0;
    };
    struct Rows {  // what a call computes: n_tok tokens of each of the plans' sequences
        const std::vector<DecodePlan*>& plans;
        int64_t n_tok;      // tokens a sequence (rows b*n_tok + t)
        const int64_t *pos, *n_attn;  // per sequence
        bool keep;          // the delta-net token by token, its states kept (one sequence)
        int64_t count() const { return int64_t(plans.size()) * n_tok; }
    };
    struct Scratch {  // the working buffers of a call of `rows` sequences, 64-byte aligned pieces
        Scratch(const DecodeModel& m, const Widths& w, int64_t rows);
        int64_t rows;
        std::unique_ptr<float[]> arena;
        // per row: x, norm, proj, mix, mix_out, ffn, experts_out, swiglu, shared_out, expert_w,
        // expert_ids, embd_rows; one sequence's rows: conv_y, q_work, mix_one (its mixer's output)
        float *x, *norm, *proj, *mix, *mix_out, *ffn, *experts_out, *swiglu, *shared_out, *expert_w, *conv_y,
            *q_work, *mix_one;
        int32_t* expert_ids;
        uint8_t* embd_rows;
    };
    bool shares_weights(const DecodePlan& other) const;
    void check_rows(int64_t n_tok, int64_t pos, int64_t n_attn) const;  // cache rows for the tokens
    void check_tokens(const int64_t* tokens, int64_t n_tok, int64_t pos, int64_t n_attn) const;  // + ids
    // the rows' residual stream starts as the tokens' embeddings, or a copy of x_in (tokens null)
    void forward(const Rows& rows, const int64_t* tokens, const float* x_in, bool last_only, float* logits,
                 float* hidden);
    void delta_net(size_t layer, const Rows& rows, Scratch& s);
    void attention(size_t layer, const Rows& rows, Scratch& s);
    Residual feed_forward(const DecodeLayer& L, int64_t rows, Scratch& s);

    DecodeModel m_;
    std::vector<DecodeLayer> layers_;
    Widths widths_;
    std::unique_ptr<Scratch> scratch_;  // sized for the most rows a call has had
    int64_t step_depth_ = 0;            // kept states a layer (set_steps)
};

}  // namespace ft::cpu
