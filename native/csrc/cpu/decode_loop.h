// A CPU decode token of a qwen35moe model in one native call (decode_loop.cpp): every layer, the
// final norm and the head, calling the same ops in the same order with the same arguments as
// the per-op path of moe_offload/models/qwen35moe.py (B = 1, T = 1), so the logits are the same
// bits. The plan is built once per (model, State) from raw pointers; Python keeps every buffer
// it points to alive (weights, norms, the State's conv/ssm/KV tensors, the RoPE frequencies).
#pragma once
#include <cstdint>
#include <memory>
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
    const float* ssm_a = nullptr;
    const float* dt_bias = nullptr;
    const float* ssm_norm = nullptr;
    // attention: q/k norms [d], caches [n_ctx, hkv, d] f32
    const float* q_norm = nullptr;
    const float* k_norm = nullptr;
    float* k_cache = nullptr;
    float* v_cache = nullptr;
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
    DecodePlan(const DecodeModel& model, std::vector<DecodeLayer> layers);
    // One token at position pos (< n_attn <= n_ctx), the first n_attn cache rows attended:
    // updates the conv/ssm states and KV rows in place, logits f32 [n_vocab].
    void run(int64_t token, int64_t pos, int64_t n_attn, float* logits);

  private:
    struct Residual {  // what the next residual_rms_norm adds to x (the rows' strides as Python's)
        const float *a = nullptr, *b = nullptr, *s = nullptr;
        int64_t lda = 0, ldb = 0, lds = 0;
    };
    void delta_net(const DecodeLayer& L);
    void attention(const DecodeLayer& L, int64_t pos, int64_t n_attn);
    Residual feed_forward(const DecodeLayer& L);
    float* scratch(size_t n);  // a 64-byte aligned piece of the arena (sized in the constructor)

    DecodeModel m_;
    std::vector<DecodeLayer> layers_;
    std::unique_ptr<float[]> arena_;
    size_t arena_size_ = 0, arena_used_ = 0;
    float *x_, *norm_, *proj_, *conv_y_, *mix_, *mix_out_, *ffn_, *experts_out_, *swiglu_, *shared_out_,
        *expert_w_, *q_work_;
    int32_t* expert_ids_;
    uint8_t* embd_row_;
};

}  // namespace ft::cpu
