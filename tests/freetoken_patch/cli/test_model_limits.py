"""Hostile weights and metadata through the CLI: each is one `ftpatch: error:` line and exit 1
(argparse's exit 2 for a flag it cannot read), before the work that would fail.

  weights that decode to NaN/Inf   run, chat and logits name the file, the position and the
                                   tensor, at the first step they appear
  metadata that implies gigabytes  refused before anything is allocated, naming the key;
                                   `inspect` shows the estimate and the key
  --ctx past any dimension         one line naming --ctx, no ValueError
  --vram without a unit            refused, suggesting 8GiB
  logits --out in a missing folder one line naming the folder, before the model runs
"""
from __future__ import annotations

import json
import math
import subprocess

import numpy as np
import pytest
import torch

from freetoken_patch.cli import main
from helpers import poison
from loaders.tokenizer import Tokenizer


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def nan_model(tiny_model, tmp_path_factory):
    """The tiny model with its final norm's values NaN: every position's logits are NaN."""
    return poison(tiny_model, tmp_path_factory.mktemp("nan") / "nan.gguf", "output_norm.weight")


@pytest.fixture(scope="module")
def hostile_model(tmp_path_factory):
    """A consistent 11 MB file whose ssm.state_size (65536) asks for a ~1 GiB prompt workspace."""
    from loaders import synth
    synth.PRESETS["hostile-test"] = synth.Preset(
        n_layer=2, n_embd=64, n_vocab=None, n_expert=4, n_expert_used=2, n_ff_exp=32,
        n_ff_shexp=32, n_head=1, n_head_kv=1, head_dim=32, n_rot=32, rope_sections=(4, 4, 4, 0),
        ssm_d_inner=64, ssm_d_state=65536, ssm_n_v_heads=2, ssm_n_k_heads=1, n_ctx_train=4096,
        full_attention_interval=2)
    try:
        path = tmp_path_factory.mktemp("hostile") / "hostile.gguf"
        synth.synthesize(path, synth.SynthOptions(preset="hostile-test", type="Q8_0"), threads=2)
    finally:
        del synth.PRESETS["hostile-test"]
    return path


def _err(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("ftpatch: error: ") and "\n" not in err and "Traceback" not in err, err
    return err


# ---- weights that decode to NaN / Inf -------------------------------------------------------------

@pytest.mark.parametrize("sampling", [["--temp", "0"], ["--seed", "1"]], ids=["greedy", "sampled"])
def test_run_names_the_file_the_position_and_the_tensor(nan_model, sampling, capsys):
    assert main(["run", str(nan_model), "-p", "hello there", "-n", "4", *sampling]) == 1
    out = capsys.readouterr()
    err = out.err.strip()
    assert err.startswith(f"ftpatch: error: {nan_model}: the logits at position ") and "\n" not in err
    assert "are not finite (NaN or Inf): output_norm.weight holds NaN/Inf" in err
    assert "\x00" not in out.out and out.out.strip() == ""          # no token was written


@pytest.mark.slow
def test_chat_exits_at_the_first_bad_answer(nan_model):
    from helpers import child_env, ftpatch_cmd
    r = subprocess.run(ftpatch_cmd("chat", str(nan_model)), env=child_env(),
                       input="hi\nhello again\n", capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"ftpatch: error: {nan_model}: the logits at position ")
    assert "Traceback" not in r.stderr and "\x00" not in r.stdout


def test_logits_finds_the_first_bad_row(tiny_model, tmp_path, capsys):
    """Token 17's embedding scales are Inf: rows before its position are fine, NaN from it on
    (attention carries it forward); the error names that position and the tensor."""
    bad = poison(tiny_model, tmp_path / "inf.gguf", "token_embd.weight", row=17, value=math.inf)
    out = tmp_path / "x.npy"
    assert main(["logits", str(bad), "--tokens", "5,6,7,17,8,9", "--out", str(out)]) == 1
    err = _err(capsys)
    assert "logits at position 3 are not finite" in err and "token_embd.weight" in err
    assert not out.exists()
    assert main(["logits", str(bad), "--tokens", "5,6,7,8", "--out", str(out)]) == 0
    assert np.isfinite(np.load(out)).all()


def test_a_tensor_stored_as_the_wrong_type_is_the_cause_named(tiny_model, tmp_path, capsys):
    """Finite stored values that overflow (a norm of 1e30 before the experts): nothing stores NaN/Inf, so the
    message says a tensor is likely stored as the wrong type."""
    big = poison(tiny_model, tmp_path / "big.gguf", "blk.0.post_attention_norm.weight", value=1e30)
    assert main(["run", str(big), "-p", "hi", "-n", "2", "--temp", "0"]) == 1
    err = _err(capsys)
    assert "no weight stores NaN/Inf, so a tensor is likely corrupt in its values or stored as " \
           "the wrong type" in err


# ---- metadata that implies more memory than there is --------------------------------------------

def test_a_huge_state_size_is_refused_up_front_naming_the_key(hostile_model, monkeypatch, capsys):
    from moe_offload import memory
    monkeypatch.setattr(memory, "host_room",
                        lambda: (256 << 20, "the address-space limit (ulimit -v)"))
    built = []
    import moe_offload.models as models
    monkeypatch.setattr(models, "build_model", lambda *a, **k: built.append(1))
    assert main(["run", str(hostile_model), "-p", "hi", "-n", "2"]) == 1
    err = _err(capsys)
    assert f"{hostile_model} needs " in err and "(ulimit -v) leaves 256.0 MiB" in err
    assert "qwen35moe.ssm.state_size = 65,536 (the Qwen3.5-35B-A3B has 128)" in err
    assert "--ctx" not in err.split("leaves")[1] and not built     # refused before the model


def test_inspect_shows_the_estimate_and_the_key(hostile_model, capsys):
    assert main(["inspect", str(hostile_model), "--json"]) == 0
    m = json.loads(capsys.readouterr().out)["memory"]
    assert m["largest_because"] == {"key": "qwen35moe.ssm.state_size", "value": 65536,
                                    "reference": 128}
    assert m["total_bytes"] == m["state_bytes"] + m["kv_bytes"] + m["workspace_bytes"] > 1 << 29
    assert main(["inspect", str(hostile_model)]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "run-time memory beside the weights" in text
    assert "qwen35moe.ssm.state_size = 65,536 (the Qwen3.5-35B-A3B has 128) is what makes it" in text


def test_a_context_beyond_any_dimension_is_one_line(tiny_model, capsys):
    assert main(["run", str(tiny_model), "-p", "hi", "--ctx", str(2**62), "--allow-long-ctx"]) == 1
    err = _err(capsys)
    assert "--ctx 4,611,686,018,427,387,904 is what makes it large; lower --ctx" in err
    assert "ValueError" not in err and "dimension" not in err


def test_vram_needs_a_unit(tiny_model, capsys):
    with pytest.raises(SystemExit) as e:
        main(["run", str(tiny_model), "-p", "hi", "--vram", "8"])
    assert e.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == ("ftpatch run: error: argument --vram: '8' has no unit; write 8GiB for 8 GiB "
                    "(or 8MiB, 8B)")
    from freetoken_patch.cli.model_args import size_arg
    assert size_arg("8GiB") == 8 << 30 and size_arg("512MiB") == 512 << 20 and size_arg("4G") == 4 << 30
    assert size_arg("1000B") == 1000


def test_logits_out_in_a_missing_folder_is_one_line_before_the_model_runs(tiny_model, capsys):
    assert main(["logits", "/no/such/model.gguf", "--tokens", "1", "--out",
                 "/nonexistent/x.npy"]) == 1
    assert _err(capsys) == ("ftpatch: error: --out /nonexistent/x.npy: the folder /nonexistent "
                            "does not exist; create it first")


def test_the_tokenizer_of_a_poisoned_file_still_reads(nan_model):
    """Poisoning touches tensor bytes only (the fixtures above are the files they claim)."""
    assert Tokenizer.from_gguf(nan_model).encode("hi", add_special=False)
