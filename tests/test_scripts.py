"""scripts/dev stays runnable: every Python script answers --help (without importing torch: its
arguments are parsed first), every shell script parses, the Python ones reach moe_offload only
through its public names and documented submodules and touch no private member of anything, the
commands the docs show exist with the flags they show, and the scripts that run without a GPU
run (slow)."""
from __future__ import annotations

import ast
import importlib
import os
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEV = ROOT / "scripts" / "dev"
PY_SCRIPTS = sorted(DEV.glob("*.py"))
SH_SCRIPTS = sorted(DEV.glob("*.sh")) + [ROOT / "scripts" / "gpu_session.sh"]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# the extension modules are native's documented binding modules (native/csrc/bindings_*.cpp)
EXTENSIONS = {"native._cpu", "native._cuda"}
# moe_offload's documented submodules (besides the package's own public names)
DOCUMENTED = {"moe_offload.config", "moe_offload.backend", "moe_offload.gen", "moe_offload.spec",
              "moe_offload.models", "moe_offload.instrument", "moe_offload.instrument.switches",
              "moe_offload.instrument.phases", "moe_offload.instrument.trace"}
# private names a script may use, and why
EXEMPT = {("mtp_reagree.py", n): "rebuilds one tensor of a synth file from loaders.synth's plan "
          "(no public form exists; test_mtp_reagree_writes_what_synth_writes holds it)"
          for n in ("_config", "_agreeing_mtp", "_mtp_specs", "_tensor_seed")}


def _env() -> dict:
    """The test process's import path: a script imports the packages the tests import (the
    installed ones in CI, whose source tree holds no built extension)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}


@cache
def _help(script: Path, *sub: str) -> str:
    """`python -X importtime SCRIPT [SUB] --help`: its help (stdout); fails on a non-zero exit
    and on torch imported to answer it."""
    r = subprocess.run([sys.executable, "-X", "importtime", str(script), *sub, "--help"],
                       capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=60)
    assert r.returncode == 0, f"{script.name} {' '.join(sub)} --help: {r.stderr[-2000:]}"
    heavy = [line for line in r.stderr.splitlines() if re.search(r"\|\s+torch$", line)]
    assert not heavy, f"{script.name} {' '.join(sub)} imports torch to print its help"
    return r.stdout


def _subcommands(help_text: str) -> list[str]:
    m = re.search(r"^positional arguments:\n\s+\{([\w,-]+)\}", help_text, re.M)
    return m[1].split(",") if m else []


@pytest.mark.parametrize("script", PY_SCRIPTS, ids=lambda p: p.name)
def test_python_script_answers_help(script):
    text = _help(script)
    for sub in _subcommands(text):
        _help(script, sub)


@pytest.mark.parametrize("script", SH_SCRIPTS, ids=lambda p: p.name)
def test_shell_script_parses(script):
    r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


# ---- no private members, moe_offload through its public face ---------------------------------------

def _public(module: str) -> set[str]:
    mod = importlib.import_module(module)
    return set(getattr(mod, "__all__", ()))


def _problems(path: Path) -> list[str]:
    out = []
    tree = ast.parse(path.read_text(encoding="utf-8"))

    def private(name: str) -> bool:
        return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))

    def check_module(module: str, line: int) -> bool:
        if module in EXTENSIONS:
            return True
        if any(private(part) for part in module.split(".")):
            out.append(f"{path.name}:{line} imports private module {module}")
        elif module.startswith("moe_offload.") and module not in DOCUMENTED:
            out.append(f"{path.name}:{line} imports {module}: not a documented submodule")
        else:
            return True
        return False

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                check_module(a.name, node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names if check_module(node.module, node.lineno) else ():
                full = f"{node.module}.{a.name}"
                if full in EXTENSIONS or (path.name, a.name) in EXEMPT:
                    continue
                if private(a.name):
                    out.append(f"{path.name}:{node.lineno} imports private {full}")
                elif node.module.startswith("moe_offload") and full not in DOCUMENTED \
                        and a.name not in _public(node.module):
                    out.append(f"{path.name}:{node.lineno} imports {full}: not public")
        elif isinstance(node, ast.Attribute) and private(node.attr):
            if (path.name, node.attr) not in EXEMPT:
                out.append(f"{path.name}:{node.lineno} uses private member .{node.attr}")
    return out


def test_scripts_use_public_names_only():
    problems = [p for script in PY_SCRIPTS for p in _problems(script)]
    assert not problems, "\n".join(problems)


def test_the_check_sees_private_access(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from moe_offload.offload import runtime\nfrom moe_offload import OffloadRuntime\n"
                   "from native.ops import _cuda\nimport native._cpu\n"
                   "def f(rt):\n    rt._capture = None\n    rt.graphs.drop()\n")
    got = _problems(bad)
    assert len(got) == 3, got
    assert "moe_offload.offload" in got[0] and "_cuda" in got[1] and "._capture" in got[2]


# ---- the commands the docs show ---------------------------------------------------------------------

def _doc_commands() -> list[tuple[str, str, list[str]]]:
    """(doc:line, script, words after it) for each scripts/dev command the docs show: in a fenced
    block, to the end of its line; in an inline code span, to the span's end (it may wrap)."""
    out = []
    pattern = r"scripts/dev/([\w.-]+)([^;&|]*)"
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        spans = [(m.start(1), m[1], True) for m in re.finditer(r"```[^\n]*\n(.*?)```", text, re.S)]
        blanked = re.sub(r"```.*?```", lambda m: " " * len(m[0]), text, flags=re.S)
        spans += [(m.start(1), m[1], False) for m in re.finditer(r"`([^`]+)`", blanked)]
        for start, span, fenced in spans:
            for line in span.split("\n") if fenced else [span.replace("\n", " ")]:
                for m in re.finditer(pattern, line):
                    at = text.count("\n", 0, start + span.find(line[:m.start()] if fenced else "")) + 1
                    out.append((f"{doc.name}:{at}", m[1], m[2].split()))
    return out


def test_docs_show_scripts_that_exist_with_their_flags():
    commands = _doc_commands()
    assert any(script == "decode_many_runtime.py" for _, script, _ in commands)   # the parser works
    bad = []
    for where, script, words in commands:
        path = DEV / script
        if not path.exists():
            bad.append(f"{where}: scripts/dev/{script} does not exist")
            continue
        if path.suffix != ".py":
            continue
        subs = _subcommands(_help(path))
        sub = [words[0]] if words and words[0] in subs else []
        if subs and not sub:
            bad.append(f"{where}: scripts/dev/{script} needs a subcommand ({', '.join(subs)})")
            continue
        text = _help(path, *sub)
        for flag in (w.strip("[]`().,") for w in words):
            flag = flag.split("=")[0]
            if flag.startswith("--") and not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text):
                bad.append(f"{where}: scripts/dev/{script} {' '.join(sub)} has no {flag}")
    assert not bad, "\n".join(bad)


def test_readme_lists_every_script():
    listed = set(re.findall(r"^\| `([\w.-]+)` \|", (DEV / "README.md").read_text(), re.M))
    present = {p.name for p in DEV.iterdir() if p.suffix in (".py", ".sh")}
    assert listed == present, (sorted(present - listed), sorted(listed - present))


# ---- ab.py's settings set back what they set ---------------------------------------------------------

def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"dev_{name}", DEV / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _Scheduler:
    def __init__(self):
        self.forced, self.applied = None, []

    def apply(self):
        self.applied.append(self.forced)


class _Cache:
    def __init__(self):
        self.slots = [10, 12]

    def resize(self, slots):
        self.slots = list(slots)


class _Engine:
    predict, prefetch_k, guesses_in_split, max_in_flight = None, 6, True, 2

    def settle(self):
        pass


class _Graphs:
    drops = 0

    def drop(self):
        self.drops += 1


class _Runtime:
    def __init__(self):
        from moe_offload import OffloadPolicy
        self.scheduler, self.cache, self.engine = _Scheduler(), _Cache(), _Engine()
        self.graphs, self.policy, self.recorder = _Graphs(), OffloadPolicy(), None

    def attach_recorder(self, recorder):
        self.recorder = recorder


def _state(rt) -> dict:
    from moe_offload.instrument import switches
    from native import ops
    cpu = importlib.import_module("native._cpu") if importlib.util.find_spec("native._cpu") else None
    return {"forced": rt.scheduler.forced, "slots": rt.cache.slots, "pf": rt.engine.prefetch_k,
            "split": rt.engine.guesses_in_split, "inflight": rt.engine.max_in_flight,
            "policy": rt.policy, "recorder": rt.recorder, "step_kernels": switches.STEP_KERNELS,
            "dtypes": (ops.PREFILL_DTYPE, ops.PREFILL_MOE_DTYPE, ops.PREFILL_MOE_MIN_TOKENS),
            "threads": cpu.threads() if cpu else None}


@pytest.mark.parametrize("variant", ["base", "pcie-only", "fraction0.6", "threads1", "slots+3",
                                     "slots-2", "pf4", "no-guess-split", "inflight1", "record",
                                     "torch-steps", "prefill-bf16+moe-f16", "moemin128",
                                     "short-prompt0", "draft-guess0"])
def test_ab_variants_set_back_what_they_set(variant):
    ab = _load("ab")
    if variant.startswith("threads") and importlib.util.find_spec("native._cpu") is None:
        pytest.skip("needs the CPU extension")
    rt = _Runtime()
    before = _state(rt)
    undo = ab.apply(rt, ab.parse_variant(variant))
    during = _state(rt)
    assert during != before or variant == "base", variant
    undo()
    assert _state(rt) == before


def test_ab_refuses_an_unknown_setting():
    with pytest.raises(SystemExit, match="unknown setting 'pf'"):
        _load("ab").parse_variant("base+pf")


# ---- the scripts that run without a GPU, run -----------------------------------------------------------

def _run(*argv: str, timeout: int = 240) -> str:
    r = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=_env(), cwd=ROOT,
                       timeout=timeout)
    assert r.returncode == 0, f"{' '.join(argv)}:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return r.stdout


@pytest.mark.slow
def test_cpu_profiler_times_every_family(tiny_model):
    out = _run(str(DEV / "profiler.py"), "cpu", str(tiny_model), "--tokens", "2", "--prompt", "8")
    for family in ("mixer projections", "expert FFN", "delta-net core", "attention core", "norms",
                   "routing", "head", "weights read"):
        assert family in out, out


CPU_RUNS = {   # script: (arguments, what its output must hold); TINY: the tiny model, TMP: a folder
    "decode_many_bench.py": (["TINY", "--batches", "1,2", "--steps", "2"], "B=2: wall"),
    "spec_cpu.py": (["--rates", "0.9", "--drafts", "1", "--gen", "6", "--reps", "1"], "same True"),
    "iq3s_forms.py": (["256", "256", "1", "avx2:loads,avx2:n4"], "every form gave the same bits"),
    "fidelity.py": (["--types", "Q8_0", "--seeds", "0", "--tokens", "4", "--dir", "TMP",
                     "--out", "TMP/f.json"], "| Q8_0 |"),
}


@pytest.mark.slow
@pytest.mark.parametrize("script", list(CPU_RUNS))
def test_cpu_script_runs(script, tiny_model, tmp_path):
    argv, expect = CPU_RUNS[script]
    argv = [a.replace("TINY", str(tiny_model)).replace("TMP", str(tmp_path)) for a in argv]
    out = _run(str(DEV / script), *argv)
    assert expect in out, out


@pytest.mark.slow
def test_mtp_reagree_writes_what_synth_writes(tmp_path):
    from loaders.synth import SynthOptions, synthesize
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    synthesize(a, SynthOptions(preset="tiny", type="Q4_K", mtp_agree=0.8), threads=2)
    synthesize(b, SynthOptions(preset="tiny", type="Q4_K", mtp_agree=0.3), threads=2)
    assert a.read_bytes() != b.read_bytes()
    _run(str(DEV / "mtp_reagree.py"), str(a), "0.3", "--preset", "tiny", "--type", "Q4_K")
    assert a.read_bytes() == b.read_bytes()
