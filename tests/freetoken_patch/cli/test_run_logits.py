"""`ftpatch logits` and `ftpatch run` through the CLI entry point: outputs and one-line errors."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from freetoken_patch.cli import main
from helpers import rewrite
from loaders import open_gguf, open_model
from loaders.tokenizer import Tokenizer
from moe_offload.models import build_model


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)   # tiny tensors: fastest, and immune to a busy machine
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def no_tokenizer_model(tiny_model, tmp_path_factory):
    keys = [k for k in open_gguf(tiny_model).metadata if k.startswith("tokenizer.")]
    return rewrite(tiny_model, tmp_path_factory.mktemp("notok") / "m.gguf", drop_keys=keys)


def _err(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("ftpatch: error: ") and "\n" not in err and "Traceback" not in err
    return err


# ---- logits --------------------------------------------------------------------------------------

def test_logits_from_tokens_and_from_a_prompt(tiny_model, tmp_path, capsys):
    tok = Tokenizer.from_gguf(tiny_model)
    ids = tok.encode("Hello world, hello", add_special=True, parse_special=True)
    out_t, out_p = tmp_path / "t.npy", tmp_path / "p.npy"
    assert main(["logits", str(tiny_model), "--tokens", ",".join(map(str, ids)),
                 "--out", str(out_t)]) == 0
    n_vocab = len(tok)
    assert f"[{len(ids)}, {n_vocab}]" in capsys.readouterr().out
    assert main(["logits", str(tiny_model), "--prompt", "Hello world, hello", "--out",
                 str(out_p)]) == 0
    a, b = np.load(out_t), np.load(out_p)
    assert a.dtype == np.float32 and a.shape == (len(ids), n_vocab)
    np.testing.assert_array_equal(a, b)
    model = build_model(open_model(tiny_model))
    want = model.forward(torch.tensor([ids]), model.new_state())[0].numpy()
    np.testing.assert_allclose(a, want, atol=1e-5)


def test_logits_of_a_model_without_tokenizer(no_tokenizer_model, tmp_path, capsys):
    out = tmp_path / "x.npy"
    assert main(["logits", str(no_tokenizer_model), "--prompt", "hi", "--out", str(out)]) == 1
    assert "no tokenizer" in (e := _err(capsys)) and "--tokens" in e
    assert main(["logits", str(no_tokenizer_model), "--tokens", "5,6,7", "--out", str(out)]) == 0
    assert np.load(out).shape[0] == 3


# ---- run ---------------------------------------------------------------------------------------------

def test_run_streams_text_then_speeds(tiny_model, capsys):
    args = ["run", str(tiny_model), "-p", "Once upon a time", "-n", "6", "--temp", "0"]
    assert main(args) == 0
    first = capsys.readouterr()
    assert first.out.endswith("\n") and len(first.out) > 1
    assert "prompt:" in first.err and "decode" in first.err and first.err.count("tok/s") == 2
    assert "generated: 6 tokens" in first.err     # the count -n asked for, the first token included
    assert "TTFT" in first.err and "stop: reached --max-tokens (6)" in first.err
    assert main(args) == 0
    assert capsys.readouterr().out == first.out                      # greedy is deterministic


def test_run_sampling_with_a_seed_repeats_and_chat_works(tiny_model, capsys):
    args = ["run", str(tiny_model), "-p", "Hi", "-n", "5", "--temp", "1.0", "--top-k", "0",
            "--top-p", "0.9", "--min-p", "0.01", "--repeat-penalty", "1.1",
            "--presence-penalty", "0.5", "--seed", "7"]
    assert main(args) == 0
    a = capsys.readouterr().out
    assert main(args) == 0
    assert capsys.readouterr().out == a
    assert main(["run", str(tiny_model), "-p", "Hi", "-n", "3", "--chat", "--temp", "0"]) == 0
    assert "tok/s" in capsys.readouterr().err


# ---- bad input: one clear line -------------------------------------------------------------------

@pytest.mark.parametrize("args,needle", [
    (["logits", "{m}", "--prompt", "", "--out", "{tmp}/x.npy"], "the prompt is empty"),
    (["run", "{m}", "-p", ""], "the prompt is empty"),
    (["run", "{m}", "-p", "a long prompt that does not fit", "--ctx", "4"],
     "more than the context of 4"),
    (["logits", "{m}", "--tokens", "1,2,3,4,5", "--ctx", "3", "--out", "{tmp}/x.npy"],
     "the prompt has 5 tokens, more than the context of 3"),
    (["logits", "{m}", "--tokens", "1,x", "--out", "{tmp}/x.npy"], "integers separated by commas"),
    (["logits", "{m}", "--tokens", "1,999999", "--out", "{tmp}/x.npy"], "outside the vocabulary"),
    (["run", "{m}", "-p", "hi", "--device", "tpu"], "use cpu or cuda"),
    (["run", "{m}", "-p", "hi", "-n", "0"], "-n 0: give 1 or more tokens"),
    (["run", "{notok}", "-p", "hi"], "no tokenizer metadata"),
    (["run", "{arch}", "-p", "hi"], "unsupported architecture 'llama'"),
    (["logits", "{arch}", "--tokens", "1", "--out", "{tmp}/x.npy"], "unsupported architecture"),
])
def test_bad_input_is_one_line(tiny_model, no_tokenizer_model, tmp_path, capsys, args, needle):
    arch = rewrite(tiny_model, tmp_path / "llama.gguf",
                   metadata={"general.architecture": ("str", "llama")})
    fill = dict(m=tiny_model, notok=no_tokenizer_model, arch=arch, tmp=tmp_path)
    assert main([a.format(**fill) for a in args]) == 1
    assert needle in _err(capsys)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_without_cuda(tiny_model, capsys):
    assert main(["run", str(tiny_model), "-p", "hi", "--device", "cuda"]) == 1
    assert "no CUDA device" in _err(capsys)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_run_vram_without_cuda(tiny_model, capsys):
    assert main(["run", str(tiny_model), "-p", "hi", "--vram", "8GiB"]) == 1
    assert _err(capsys) == ("ftpatch: error: --vram puts the hot experts on a GPU and torch sees "
                            "no CUDA device; run without --vram to use the CPU")


def test_bench_refuses_zero_guesses(tiny_model, capsys):
    assert main(["bench", str(tiny_model), "--prefetch-k", "0"]) == 1
    assert "--prefetch-k 0: guess at least 1 expert a token" in _err(capsys)


def test_bench_refuses_a_negative_count_of_draft_guess_layers(tiny_model, capsys):
    assert main(["bench", str(tiny_model), "--draft", "1", "--draft-guess-layers", "-1"]) == 1
    assert "--draft-guess-layers -1: give 0 (off) or more" in _err(capsys)


def test_run_vram_on_the_cpu_is_refused(tiny_model, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # get past the CUDA check
    assert main(["run", str(tiny_model), "-p", "hi", "--vram", "8GiB", "--device", "cpu"]) == 1
    assert "--vram caps GPU memory, so it needs a CUDA device, not --device cpu" in _err(capsys)


def test_placement_flags_need_vram(tiny_model, capsys):
    assert main(["run", str(tiny_model), "-p", "hi", "--host-head"]) == 1
    assert _err(capsys) == ("ftpatch: error: --host-head and --gpu-embedding place weights for the "
                            "offload runtime; add --vram SIZE")

    assert main(["run", str(tiny_model), "-p", "hi", "--link-gbps", "11.8"]) == 1
    assert _err(capsys) == ("ftpatch: error: --link-gbps emulates the link the offload runtime "
                            "copies experts over; add --vram SIZE")


@pytest.mark.parametrize("flag,value,fix", [("--link-gbps", "0", "from 0.1 to 1000"),
                                            ("--link-gbps", "nan", "from 0.1 to 1000"),
                                            ("--threads", "0", "give 1 or more threads")])
def test_link_and_threads_are_range_checked(tiny_model, capsys, flag, value, fix):
    assert main(["run", str(tiny_model), "-p", "hi", flag, value]) == 1
    err = _err(capsys)
    assert flag in err and fix in err


def test_threads_run_the_plain_model(tiny_model, capsys):
    from native.ops import _cpu
    before = torch.get_num_threads(), _cpu.threads()
    try:
        assert main(["run", str(tiny_model), "-p", "hi", "-n", "2", "--threads", "1",
                     "--temp", "0"]) == 0
        assert torch.get_num_threads() == 1 and _cpu.threads() == 1
    finally:
        torch.set_num_threads(before[0])
        _cpu.set_threads(before[1])


@pytest.mark.gpu
@pytest.mark.parametrize("where", [[], ["--host-head"]])
def test_run_under_the_offload_runtime_reports_the_cache(tiny_model, capsys, where):
    assert main(["run", str(tiny_model), "-p", "Once upon a time", "-n", "8", "--temp", "0",
                 "--vram", "2GiB", *where]) == 0
    err = capsys.readouterr().err
    assert "tok/s" in err and "expert cache: hit rate" in err and "slots a layer now" in err


@pytest.mark.gpu
def test_logits_on_cuda_match_cpu(tiny_model, tmp_path, capsys):
    cpu, gpu = tmp_path / "c.npy", tmp_path / "g.npy"
    for dev, out in (("cpu", cpu), ("cuda", gpu)):
        assert main(["logits", str(tiny_model), "--tokens", "1,2,3,4,5,6,7,8", "--out", str(out),
                     "--device", dev]) == 0
    # The GPU's decode kernels round activations to int8 per 32 values (as ggml's MMVQ does), the
    # CPU's to int16: the logits agree in direction and within a few % of their scale.
    c, g = np.load(cpu), np.load(gpu)
    cos = float((c * g).sum() / np.linalg.norm(c) / np.linalg.norm(g))
    assert cos > 0.998 and np.abs(c - g).max() <= 0.08 * np.abs(c).max(), cos


def test_offload_stats_lines_name_the_cache_and_an_elastic_kv():
    from freetoken_patch.cli.model_args import offload_stats_lines
    m = {"hit_rate": 0.75, "hits": 30, "fetched": 8, "cpu": 2, "cache_slots": [114] * 40,
         "cache_bytes": 6 << 30, "kv_bytes": 40 << 20, "prefetched": 0}
    lines = offload_stats_lines(m)
    assert lines[0].startswith("expert cache: hit rate 75.0%, 30 hits, 10 misses (8 fetched")
    assert "114 slots a layer now, 6.00 GiB of VRAM; the KV maps 40 MiB" in lines[1]
    assert "KV" not in offload_stats_lines({**m, "kv_bytes": 0})[1]   # KV allocated whole


# ---- --chat-template ---------------------------------------------------------------------------------

HOSTILE = "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}"


@pytest.fixture(scope="module")
def hostile_template_model(tiny_model, tmp_path_factory):
    return rewrite(tiny_model, tmp_path_factory.mktemp("hostile") / "m.gguf",
                   metadata={"tokenizer.chat_template": ("str", HOSTILE)})


def test_a_refused_template_names_the_override_and_the_override_works(hostile_template_model,
                                                                         tmp_path, capsys):
    assert main(["run", str(hostile_template_model), "-p", "hi", "--chat", "-n", "2"]) == 1
    assert "--chat-template" in _err(capsys)
    mine = tmp_path / "chatml.jinja"
    mine.write_text("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                    "{% endfor %}<|im_start|>assistant\n")
    assert main(["run", str(hostile_template_model), "-p", "hi", "--chat", "-n", "2", "--temp", "0",
                 "--chat-template", str(mine)]) == 0
    capsys.readouterr()
    for bad, needle in ((tmp_path / "missing.jinja", "No such file"), (tmp_path / "bin.jinja", "not UTF-8")):
        if bad.name == "bin.jinja":
            bad.write_bytes(b"\xff\xfe{{")
        assert main(["run", str(hostile_template_model), "-p", "hi", "--chat",
                     "--chat-template", str(bad)]) == 1
        assert needle in _err(capsys)
