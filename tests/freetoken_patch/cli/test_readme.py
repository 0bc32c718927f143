"""README.md's claims held to the code: every flag it names exists in the CLI, every extra it
names exists in pyproject.toml with the packages the README says it brings, the quick start is
what CI runs, the FTPATCH_* variables it names are read somewhere. (Its tables are checked by
test_bench_report.py: they are made from docs/results.)"""
from __future__ import annotations

import argparse
import re
import shlex
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
README = (ROOT / "README.md").read_text()
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
EXTRAS = PYPROJECT["project"]["optional-dependencies"]
CI = (ROOT / ".ci" / "run").read_text()
# flags in the README that belong to other programs: pip, llama.cpp's llama-bench, llm
OTHER_PROGRAMS = {"--index-url", "--no-deps", "--n-cpu-moe", "--cpu-moe",   # pip's, llama.cpp's,
                  "--schema"}                                            # llm's


def _parsers() -> dict[str, argparse.ArgumentParser]:
    """Every command's parser by its words ("run", "bench", "bench serve"), and "" for ftpatch."""
    from freetoken_patch.cli import bench_serve, build_parser
    top = build_parser()
    out = {"": top}
    for action in top._actions:
        if isinstance(action, argparse._SubParsersAction):
            out.update(action.choices)
    out["bench serve"] = bench_serve.build_parser()
    return out


def _options(p: argparse.ArgumentParser) -> set[str]:
    return {s for a in p._actions for s in a.option_strings}


def _bash_lines() -> list[str]:
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", README, re.S):
        joined = block.replace("\\\n", " ")
        lines += [ln for ln in joined.splitlines() if ln.strip()]
    return lines


def _ftpatch_commands() -> list[list[str]]:
    """Each `ftpatch ...` invocation in the README's bash blocks and inline code, as tokens (its
    comment cut off)."""
    texts = []
    for ln in _bash_lines():
        texts += [part for part in re.split(r"&&|\|(?!\|)", ln)]
    texts += re.findall(r"`(ftpatch [^`]+)`", README)
    out = []
    for t in texts:
        try:
            tokens = shlex.split(t, comments=True)
        except ValueError:
            continue
        while tokens and "=" in tokens[0] and not tokens[0].startswith("-"):
            tokens = tokens[1:]             # VAR=value before the command
        if tokens and tokens[0] == "ftpatch":
            out.append(tokens)
    return out


def test_every_ftpatch_command_line_uses_flags_its_command_has():
    parsers = _parsers()
    checked = 0
    for tokens in _ftpatch_commands():
        words = [t for t in tokens[1:3] if not t.startswith("-")]
        name = " ".join(words[:2]) if " ".join(words[:2]) in parsers else (words[0] if words else "")
        if name and name not in parsers:
            continue                        # e.g. `ftpatch COMMAND --help`
        known = _options(parsers[name]) | _options(parsers[""])
        if name.startswith("bench") or name == "bench serve":
            known |= _options(parsers["bench"])
        for t in tokens:
            flag = t.split("=", 1)[0]
            if flag.startswith("-") and flag != "-":
                assert flag in known, f"README: `{' '.join(tokens)}`: {flag} is not a flag of ftpatch {name}"
                checked += 1
    assert checked > 30, checked


def test_every_flag_the_readme_names_exists_somewhere():
    everything = set().union(*(_options(p) for p in _parsers().values()))
    named = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", README))
    missing = sorted(named - everything - OTHER_PROGRAMS)
    assert not missing, f"README names flags no ftpatch command has: {missing}"


def test_extras_exist_and_bring_what_the_readme_says():
    named = set(re.findall(r"ftpatch\[(\w+)\]", README)) | set(re.findall(r"\.\[(\w+)\]", README))
    assert named and named <= set(EXTRAS), named - set(EXTRAS)
    table = re.search(r"## Extras\n\n(.*?)\n\n", README, re.S)[1]
    rows = [r.split("|")[1:-1] for r in table.splitlines()[2:]]
    assert {r[0].strip().strip("`") for r in rows} == set(EXTRAS)
    def names(extra):
        return {re.split(r"[<>=\[;]", r)[0].lower() for r in EXTRAS[extra]}
    for extra, _, brings in rows:
        extra = extra.strip().strip("`")
        if extra == "freetoken":        # what FreeToken itself pulls in: checked below
            continue
        for package in ("fastapi", "uvicorn", "pydantic", "httpx", "matplotlib", "pytest",
                        "transformers", "openai", "anthropic"):
            if re.search(rf"\b{package}\b", brings, re.I):
                assert package in names(extra), \
                    f"README says [{extra}] brings {package}; pyproject's [{extra}]: {sorted(names(extra))}"
        if "the `serve` packages" in brings:
            assert names("serve") <= names(extra)
    assert "httpx" in {re.split(r"[<>=]", r)[0] for r in EXTRAS["serve"]}, \
        "`ftpatch bench serve` needs httpx and points at [serve]"
    version = re.search(r"FreeToken (\d+\.\d+\.\d+)", README)[1]
    assert EXTRAS["freetoken"] == [f"freetoken=={version}"]


def test_bench_serve_names_the_extra_that_holds_httpx():
    text = (ROOT / "freetoken_patch" / "cli" / "bench_serve.py").read_text()
    extra = re.search(r"needs httpx.*?ftpatch\[(\w+)\]", text, re.S)[1]
    assert any(r.startswith("httpx") for r in EXTRAS[extra])


def test_the_quick_start_is_what_ci_runs():
    """Both quick-start lines, step by step, appear in .ci/run (pip's -q aside), so CI runs what
    a new user types; and the Python and torch versions they name are pyproject's."""
    quick = re.search(r"## Quick start\n(.*?)\n## ", README, re.S)[1]
    lines = [ln for ln in re.findall(r"```bash\n(.*?)```", quick, re.S)[:2]]
    assert len(lines) == 2
    ci = CI.replace("pip install -q ", "pip install ")
    for line in lines:
        for step in (s.strip() for s in line.strip().split("&&")):
            if step in ("pytest", "ftpatch chat"):
                assert re.search(rf"^\s*(printf .*\| )?{step}\b", ci, re.M), step
            elif step == "pip install .":
                assert "pip install '.[test]'" in ci   # the test extra installs . with it
            else:
                assert step in ci, f"CI does not run the quick start's `{step}`"
    assert "Python 3.11 or later" in quick and PYPROJECT["project"]["requires-python"] == ">=3.11"
    torch = re.search(r"pip install torch==([\d.]+)", quick)[1]
    floor = next(d for d in PYPROJECT["project"]["dependencies"] if d.startswith("torch"))
    assert tuple(map(int, torch.split("."))) >= tuple(map(int, floor.split(">=")[1].split(".")))
    assert "--index-url https://download.pytorch.org/whl/cpu" in quick


@pytest.mark.parametrize("var", sorted(set(re.findall(r"\bFTPATCH_[A-Z_]+", README))))
def test_every_ftpatch_variable_is_read_somewhere(var):
    sources = [p for pat in ("**/*.py", "**/*.cpp", "**/*.h", "CMakeLists.txt", "pyproject.toml")
               for p in ROOT.glob(pat) if "tests" not in p.parts and ".venv" not in p.parts]
    assert any(var in p.read_text(errors="replace") for p in sources), f"README names {var}; nothing reads it"
