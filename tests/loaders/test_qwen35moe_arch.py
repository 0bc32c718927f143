"""The architecture registry and qwen35moe: config keys, schema, alternatives, MTP, bad files."""
import gguf
import numpy as np
import pytest

from helpers import fused_gate_up, rewrite
from loaders import GGUFError, get_architecture, open_gguf, open_model, supported_architectures
from loaders.quants import QUANT_TYPES, random_tensor

A = "qwen35moe."


def test_registry_lists_and_refuses_unknown():
    assert "qwen35moe" in supported_architectures()
    with pytest.raises(GGUFError, match="unsupported architecture 'llama'; supported: .*qwen35moe"):
        get_architecture("llama")


def test_unknown_architecture_file(tiny_model, tmp_path):
    p = rewrite(tiny_model, tmp_path / "x.gguf", metadata={"general.architecture": ("str", "gpt-oss")})
    with pytest.raises(GGUFError, match="unsupported architecture 'gpt-oss'"):
        open_model(p)


def test_config_from_tiny(tiny_model):
    m = open_model(tiny_model)
    c = m.config
    assert (c.n_layer, c.n_embd, c.n_expert, c.n_expert_used, c.n_ff_exp, c.n_ff_shexp) == \
        (4, 256, 16, 4, 256, 256)
    assert c.recurrent == (True, True, True, False)
    assert c.attention_layers == [3] and c.recurrent_layers == [0, 1, 2]
    assert (c.head_dim, c.n_rot, c.n_head, c.n_head_kv) == (128, 32, 2, 1)
    assert c.ssm_conv_dim == 2 * 2 * 64 + 256 and c.ssm_head_v_dim == 64
    assert c.rope_base == pytest.approx(1e7) and c.rms_eps == pytest.approx(1e-6)
    assert c.n_vocab == m.weights["token_embd.weight"].shape[0]
    assert not m.problems and not m.aside and not m.extras


def test_layer_kinds_fall_back_to_interval(tiny_model, tmp_path):
    p = rewrite(tiny_model, tmp_path / "i.gguf", drop_keys=[A + "attention.recurrent_layers"],
                metadata={A + "full_attention_interval": ("u32", 2)})
    # interval 2: layers 1 and 3 are attention; the schema then wants attention tensors in 1
    m = open_model(p, strict=False)
    assert m.config.recurrent == (True, False, True, False)
    assert any("blk.1.attn_output.weight' is missing" in x for x in m.problems)


def test_required_key_missing_is_named(tiny_model, tmp_path):
    p = rewrite(tiny_model, tmp_path / "k.gguf", drop_keys=[A + "ssm.conv_kernel"])
    with pytest.raises(GGUFError, match="'qwen35moe.ssm.conv_kernel' is missing"):
        open_model(p)


def test_missing_tensor_is_named(tiny_model, tmp_path):
    p = rewrite(tiny_model, tmp_path / "m.gguf", drop=["blk.2.ssm_out.weight"])
    with pytest.raises(GGUFError, match=r"'blk.2.ssm_out.weight' is missing \(expected shape \[256, 256\]\)"):
        open_model(p)


def test_misshapen_tensor_is_named(tiny_model, tmp_path):
    f = open_gguf(tiny_model)
    t = f.tensors["blk.0.ssm_alpha.weight"]  # [4, 256] -> store [2, 256]
    ne = (t.ne[0], 2)
    data = f.data(t.name)[:2].tobytes()
    p = rewrite(tiny_model, tmp_path / "s.gguf", replace={t.name: (ne, t.type_id, data)})
    with pytest.raises(GGUFError, match=r"'blk.0.ssm_alpha.weight' has shape \[2, 256\], expected \[4, 256\]"):
        open_model(p)


def test_unsupported_type_is_named(tiny_model, tmp_path):
    f = open_gguf(tiny_model)
    t = f.tensors["blk.0.ffn_gate_shexp.weight"]
    nvfp4 = int(gguf.GGMLQuantizationType.NVFP4)
    elems, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.NVFP4]
    data = bytes(t.ne[1] * t.ne[0] // elems * nbytes)
    p = rewrite(tiny_model, tmp_path / "u.gguf", replace={t.name: (t.ne, nvfp4, data)})
    with pytest.raises(GGUFError, match="'blk.0.ffn_gate_shexp.weight' has type NVFP4"):
        open_model(p)
    m = open_model(p, strict=False)  # inspect still describes it
    assert len(m.problems) == 1


def test_fused_alternatives_load(tiny_model, tmp_path):
    f = open_gguf(tiny_model)
    add, drop = fused_gate_up(tiny_model)
    q, k, v = (f.tensors[f"blk.3.attn_{x}.weight"] for x in "qkv")
    qkv = np.concatenate([f.data(q.name), f.data(k.name), f.data(v.name)], axis=0)
    add["blk.3.attn_qkv.weight"] = ((q.ne[0], q.ne[1] + k.ne[1] + v.ne[1]), q.type_id, qkv.tobytes())
    drop += [q.name, k.name, v.name]
    p = rewrite(tiny_model, tmp_path / "f.gguf", drop=drop, add=add)
    m = open_model(p)
    assert m.weights["blk.0.ffn_gate_up_exps.weight"].shape == (16, 512, 256)
    assert m.weights["blk.3.attn_qkv.weight"].shape == (2 * 2 * 128 + 2 * 128, 256)
    assert "blk.0.ffn_gate_exps.weight" not in m.weights


def test_mixed_types_across_tensors_and_layers(synth_model):
    p = synth_model(type="Q4_K", expert_type="IQ3_S", down_type="Q6_K", output_type="Q8_0",
                    tensor_types=(("blk\\.1\\.ffn_down_exps", "IQ4_XS"), ("attn_gate", "Q5_K")))
    m = open_model(p)
    w = m.weights
    assert w["blk.0.ffn_gate_exps.weight"].qtype.name == "IQ3_S"
    assert w["blk.0.ffn_down_exps.weight"].qtype.name == "Q6_K"
    assert w["blk.1.ffn_down_exps.weight"].qtype.name == "IQ4_XS"
    assert w["blk.3.attn_q.weight"].qtype.name == "Q4_K"
    assert w["blk.0.attn_gate.weight"].qtype.name == "Q5_K"
    assert w["output.weight"].qtype.name == "Q8_0"
    assert w["blk.0.ffn_gate_inp.weight"].qtype.name == "F32"


def test_mtp_block_kept_aside(synth_model):
    m = open_model(synth_model(mtp=True))
    assert m.config.n_layer == 4 and m.config.n_nextn == 1
    assert "blk.4.nextn.eh_proj.weight" in m.aside and "blk.4.ffn_down_exps.weight" in m.aside
    assert not any(n.startswith("blk.4.") for n in m.weights)


def test_vector_stored_quantized_is_refused(tiny_model, tmp_path):
    f = open_gguf(tiny_model)
    t = f.tensors["blk.0.attn_norm.weight"]  # [256] F32 -> Q8_0
    raw = random_tensor("Q8_0", (256,), np.random.default_rng(0))
    q8 = QUANT_TYPES["Q8_0"].type_id
    p = rewrite(tiny_model, tmp_path / "v.gguf", replace={t.name: (t.ne, q8, raw.tobytes())})
    with pytest.raises(GGUFError, match="'blk.0.attn_norm.weight' is a vector stored as Q8_0"):
        open_model(p)
