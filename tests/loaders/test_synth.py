"""ftpatch synth: presets, determinism, types per class, routing skew, MTP, split, 35B counts."""
import numpy as np
import pytest

from loaders import GGUFError, open_gguf, open_model
from loaders.archs.qwen35moe import tensor_schema
from loaders.synth import PRESETS, SynthOptions, _config, plan_tensors, synthesize
from loaders.vocab import read_vocab


def _bytes(path):
    return open(path, "rb").read()


def test_deterministic_for_a_seed(tmp_path):
    a = synthesize(tmp_path / "a.gguf", SynthOptions(seed=1), threads=2)[0]
    b = synthesize(tmp_path / "b.gguf", SynthOptions(seed=1), threads=1)[0]
    c = synthesize(tmp_path / "c.gguf", SynthOptions(seed=2), threads=2)[0]
    assert _bytes(a) == _bytes(b)
    assert _bytes(a) != _bytes(c)


def test_35b_a3b_plan_has_the_real_counts():
    p = PRESETS["35b-a3b"]
    c = _config(p, p.n_vocab, p.n_layer)
    plans = plan_tensors(SynthOptions(preset="35b-a3b", type="IQ3_S"), c, [])
    assert sum(int(np.prod(x.shape)) for x in plans) == 34_660_610_688
    assert sum(x.nbytes for x in plans) / 2**30 == pytest.approx(14.244, abs=0.001)
    by = {x.name: x for x in plans}
    assert by["token_embd.weight"].qtype.name == "Q8_0"
    assert by["blk.0.ffn_gate_inp.weight"].qtype.name == "F32"
    assert by["blk.0.ssm_conv1d.weight"].qtype.name == "F32"
    assert by["blk.39.ffn_down_exps.weight"].shape == (256, 2048, 512)
    assert len(c.attention_layers) == 10 and c.attention_layers[0] == 3


def test_weights_are_finite_and_sized(synth_model):
    from loaders.quants import dequantize_reference
    m = open_model(synth_model(type="Q4_K"))
    for name in ("blk.0.attn_qkv.weight", "blk.3.attn_q.weight", "blk.1.ffn_down_exps.weight"):
        w = m.weights[name]
        x = dequantize_reference(w.data, w.qtype, w.shape)
        assert np.isfinite(x).all()
        assert 0.01 < float(np.sqrt(np.mean(x.astype(np.float64) ** 2))) < 0.04
    norm = m.weights["blk.0.attn_norm.weight"].data.view(np.float32)
    assert 0.5 < norm.mean() < 1.5  # stored with the folded +1
    ssm_a = m.weights["blk.0.ssm_a"].data.view(np.float32)
    assert (ssm_a < 0).all()


def test_routing_skew_concentrates_router_norms(synth_model):
    def norms(path):
        w = open_model(path).weights["blk.0.ffn_gate_inp.weight"]
        return np.linalg.norm(w.data.view(np.float32).reshape(w.shape), axis=1)
    flat, skewed = norms(synth_model()), norms(synth_model(routing_skew=1.0))
    assert flat.max() / flat.min() < 2
    assert skewed.max() / skewed.min() > 8


def test_vocab_copied_and_padded(synth_model, vocab_path):
    m = open_model(synth_model(vocab=str(vocab_path)))
    src = read_vocab(vocab_path)
    toks = m.metadata["tokenizer.ggml.tokens"]
    assert len(toks) == m.config.n_vocab == len(src)
    assert toks[:1000] == src.tokens[:1000]
    assert m.metadata["tokenizer.ggml.merges"][:10] == src.merges[:10]
    assert m.metadata["tokenizer.ggml.pre"] == "qwen35"


def test_builtin_vocab_has_chatml(tiny_model):
    md = open_gguf(tiny_model).metadata
    toks = md["tokenizer.ggml.tokens"]
    assert "<|im_start|>" in toks and toks[md["tokenizer.ggml.eos_token_id"]] == "<|im_end|>"
    assert "tokenizer.chat_template" in md and len(md["tokenizer.ggml.merges"]) > 100


def test_split_output(tmp_path):
    paths = synthesize(tmp_path / "s.gguf", SynthOptions(split_max_size=3 << 20), threads=2)
    assert len(paths) > 1 and all(p.exists() for p in paths)
    assert open_model(paths[1]).config.n_layer == 4


def test_bad_type_choices_are_refused(tmp_path):
    with pytest.raises(GGUFError, match="unsupported ggml type 'Q7_K'"):
        synthesize(tmp_path / "x.gguf", SynthOptions(type="Q7_K"))
    with pytest.raises(GGUFError, match="holds values, not weights"):
        synthesize(tmp_path / "y.gguf", SynthOptions(tensor_types=(("ffn_gate_inp", "Q4_K"),)))
    assert not (tmp_path / "y.gguf").exists()
    with pytest.raises(GGUFError, match="unknown preset"):
        synthesize(tmp_path / "z.gguf", SynthOptions(preset="70b"))
    # --mtp-agree writes the embedding from the head: a type gguf-py cannot quantize is refused
    with pytest.raises(GGUFError, match="cannot quantize IQ3_S: use --embed-type Q8_0"):
        synthesize(tmp_path / "m.gguf", SynthOptions(mtp_agree=0.8, embed_type="IQ3_S"), threads=2)
    assert not (tmp_path / "m.gguf").exists()


@pytest.mark.parametrize("qtype", ["F16", "BF16", "Q8_0", "IQ2_XXS", "TQ1_0", "MXFP4"])
def test_every_family_writes_and_loads(synth_model, qtype):
    m = open_model(synth_model(type=qtype))
    assert m.weights["blk.0.attn_qkv.weight"].qtype.name == qtype
    assert not m.problems
