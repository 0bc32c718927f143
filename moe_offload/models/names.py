"""The GGUF weight names the qwen35moe forward pass groups: projections that read the same
input. Uploaded to a GPU as one weight when their types match (weights.upload_weights(fuse=
FUSED_PROJECTIONS)), they cost one matmul launch instead of 2-4; on the CPU they stay apart and
run as one matmul_many call."""

SSM_IN = ("attn_qkv.weight", "attn_gate.weight", "ssm_beta.weight", "ssm_alpha.weight")
ATTN_IN = ("attn_q.weight", "attn_k.weight", "attn_v.weight")
SHEXP_IN = ("ffn_gate_shexp.weight", "ffn_up_shexp.weight")
ROUTER = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")
FUSED_PROJECTIONS = {"+".join(g): g for g in (SSM_IN, ATTN_IN, SHEXP_IN, ROUTER)}
