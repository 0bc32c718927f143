"""`ftpatch inspect` and `ftpatch synth` through the CLI entry point."""
import json

import pytest

from freetoken_patch.cli import main


def test_synth_then_inspect_json(tmp_path, capsys):
    out = tmp_path / "m.gguf"
    assert main(["synth", "-o", str(out), "--type", "Q4_K", "--down-type", "Q6_K", "--mtp"]) == 0
    assert "random weights" in capsys.readouterr().out
    assert main(["inspect", str(out), "--json", "--vram", "64MiB"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["architecture"] == "qwen35moe"
    assert isinstance(d["parameters"], int) and d["parameters"] > d["parameters_active"] > 0
    names = {t["name"]: t for t in d["tensors"]}
    assert names["blk.0.ffn_down_exps.weight"]["type"] == "Q6_K"
    assert names["blk.0.ffn_gate_exps.weight"]["shape"] == [16, 256, 256]
    assert all(set(t) == {"name", "type", "shape", "bytes"} for t in d["tensors"])
    assert d["parameters_mtp"] > 0 and d["synthetic"] is True
    plan = d["plan"]
    assert plan["vram_bytes"] == 64 << 20 and plan["experts_total"] == 4 * 16
    assert 0 <= plan["experts_fit"] <= plan["decode_experts_fit"] <= plan["experts_total"]
    embd = names["token_embd.weight"]["bytes"]
    assert plan["host_bytes"] == embd    # the runtime keeps the embedding in host RAM
    assert plan["kv_type"] == "f16"      # auto, with no room for experts at all: f16
    assert main(["inspect", str(out), "--json", "--vram", "3GiB"]) == 0
    big = json.loads(capsys.readouterr().out)["plan"]
    assert big["decode_experts_fit"] == big["experts_total"] and big["kv_type"] == "f16"
    assert main(["inspect", str(out), "--json", "--vram", "3GiB", "--kv-type", "q4_0"]) == 0
    q4 = json.loads(capsys.readouterr().out)["plan"]
    assert q4["kv_type"] == "q4_0" and q4["kv_bytes"] == big["kv_bytes"] * 9 // 32


def test_inspect_tables(tiny_model, capsys):
    assert main(["inspect", str(tiny_model), "--vram", "2GiB"]) == 0  # context alone ~0.85 GiB
    out = capsys.readouterr().out
    for needle in ("parameters:", "bytes by tensor class", "routed experts", "layers",
                   "delta-net", "attention", "kernels for the types", "plan for 2.00 GiB",
                   "64 of 64 experts", "KV f16"):
        assert needle in out, needle


@pytest.mark.parametrize("args,needle", [
    (["inspect", "/nonexistent/model.gguf"], "no such file"),
    (["synth", "-o", "{tmp}/x.gguf", "--type", "Q9_K"], "unsupported ggml type"),
    (["synth", "-o", "{tmp}/x.gguf", "--tensor-type", "nonsense"], "REGEX=TYPE"),
])
def test_errors_are_one_line(tmp_path, capsys, args, needle):
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1 and "Traceback" not in err


def test_not_a_gguf_one_line(tmp_path, capsys):
    p = tmp_path / "notes.txt"
    p.write_text("hello")
    assert main(["inspect", str(p)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("ftpatch: error:") and "not a GGUF file" in err


def test_bad_size_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit):
        main(["inspect", "x.gguf", "--vram", "lots"])
    assert "cannot read size 'lots'" in capsys.readouterr().err


def test_help_teaches(capsys):
    with pytest.raises(SystemExit):
        main(["synth", "--help"])
    out = capsys.readouterr().out
    assert "35b-a3b" in out and "IQ3_S" in out and "example" in out


def test_synth_output_starts_with_its_line_not_a_blank_one(tmp_path, capfd):
    """Piped or captured (no terminal), no progress bar and no blank line before 'wrote'."""
    assert main(["synth", "-o", str(tmp_path / "s.gguf")]) == 0
    out = capfd.readouterr().out
    assert out.startswith("wrote "), repr(out[:40])


def test_inspect_plans_for_the_context_run_would_use(tiny_model, capsys):
    """The tiny model is trained for 4,096 tokens: inspect's default plan is for 4,096 (run's
    rule), and a --ctx past it says that run needs --allow-long-ctx."""
    assert main(["inspect", str(tiny_model), "--json", "--vram", "2GiB"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["config"]["n_ctx_train"] == 4096 and d["plan"]["n_ctx"] == 4096 and "notes" not in d
    assert main(["inspect", str(tiny_model), "--vram", "2GiB", "--ctx", "8192"]) == 0
    out = capsys.readouterr().out
    assert "context 8,192" in out and "--allow-long-ctx" in out
