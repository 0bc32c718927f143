"""Fuzzing: hostile GGUF files and hostile chat templates get the loaders' error, nothing else.

GGUF: a time-boxed mutation fuzz (fuzz_gguf.py) over the header, metadata and tensor directory
of a small synthetic model and a vocabulary-only file, in a worker process under a 1 GiB
address-space cap and a 10 s alarm per mutant. A few seconds by default; longer with
FTPATCH_FUZZ_SECONDS=..., a fixed count with FTPATCH_FUZZ_MUTANTS=..., a given run with
FTPATCH_FUZZ_SEED=... (the seed is printed on failure). Each failing mutant is written to
fuzz_regressions/ (as the bytes that differ from the base file) and replayed by
test_fuzz_regressions from then on.

Templates: random templates from a small grammar (loops, ifs, macros, filters, string and list
operations, nested), rendered under tight limits, in turn in this process (where anything but
ChatTemplateError shows) and in the worker process: only ChatTemplateError escapes, the limits
hold (the sandbox's own checks: the worker's memory limit or a death is a check that missed),
and the caller's messages are untouched. Time-boxed like the GGUF fuzz (at least 20);
FTPATCH_FUZZ_TEMPLATES=N renders exactly N.
"""
from __future__ import annotations

import copy
import json
import os
import random
import signal
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))   # the worker module beside this file
import fuzz_gguf  # noqa: E402
from fuzz_gguf import load_base  # noqa: E402
from loaders.chat_template import ChatTemplate, ChatTemplateError, TemplateLimits  # noqa: E402

HERE = Path(__file__).resolve().parent
REGRESSIONS = HERE / "fuzz_regressions"
FUZZ_SECONDS = float(os.environ.get("FTPATCH_FUZZ_SECONDS", "0") or 0)
FUZZ_MUTANTS = int(os.environ.get("FTPATCH_FUZZ_MUTANTS", "0") or 0)
FUZZ_TEMPLATES = int(os.environ.get("FTPATCH_FUZZ_TEMPLATES", "100000"))
_seed_env = os.environ.get("FTPATCH_FUZZ_SEED")
FUZZ_SEED = int(_seed_env) if _seed_env else random.SystemRandom().randrange(1 << 31)
CI_SECONDS = 4.0


# -- base files ----------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def fuzz_bases(tmp_path_factory) -> dict[str, Path]:
    return fuzz_gguf.make_bases(tmp_path_factory.mktemp("fuzz_bases"))


def test_bases_are_valid(fuzz_bases):
    from loaders import Tokenizer, open_model
    m = open_model(fuzz_bases["model"])
    assert not m.problems and m.aside
    assert fuzz_gguf.check(fuzz_bases["model"], "model") == "ok"
    assert fuzz_gguf.check(fuzz_bases["vocab"], "vocab") == "ok"
    tok = Tokenizer.from_gguf(fuzz_bases["vocab"])
    assert tok.decode(tok.encode("fuzz")) == "fuzz"
    assert fuzz_bases["model"].stat().st_size < 1_000_000


# -- the GGUF fuzz -------------------------------------------------------------------------------

def run_fuzz(bases: dict[str, Path], out: Path, seed: int, seconds: float, mutants: int,
             env: dict | None = None) -> tuple[dict, list[dict]]:
    """Run the worker; returns (summary, failures). A hang the worker's alarm cannot break
    (stuck in C) is caught here: no progress for 3 alarm periods."""
    out.mkdir(parents=True, exist_ok=True)
    progress = out / "progress"
    cmd = [sys.executable, str(HERE / "fuzz_gguf.py"), "--seed", str(seed), "--out", str(out),
           "--progress", str(progress), "--seconds", str(seconds), "--mutants", str(mutants)]
    cmd += [f"--base={name}={path}" for name, path in bases.items()]
    # output to files: a pipe nobody reads until the end would fill and stall the worker
    with open(out / "stdout", "w") as so, open(out / "stderr", "w") as se:
        proc = subprocess.Popen(cmd, stdout=so, stderr=se, env=env, cwd=HERE.parents[1])
    last, last_change = None, time.monotonic()
    while proc.poll() is None:
        time.sleep(0.5)
        cur = progress.read_text().split()[-1:] if progress.exists() else None
        if cur != last:
            last, last_change = cur, time.monotonic()
        elif time.monotonic() - last_change > 3 * fuzz_gguf.MUTANT_SECONDS:
            proc.kill()
            proc.wait()
            index = int(cur[0]) if cur else 0
            return {}, [{"seed": seed, "index": index, "error": "hang (no progress, killed)"}]
    stdout, stderr = (out / "stdout").read_text(), (out / "stderr").read_text()
    lines = [json.loads(x) for x in stdout.splitlines() if x.startswith("{")]
    fails = [x["fail"] for x in lines if "fail" in x]
    summary = next((x["summary"] for x in lines if "summary" in x), None)
    if summary is None:   # the worker died: at a mutant (a crash in C?) or before any
        fail = {"seed": seed, "error": f"worker exited {proc.returncode}: {stderr.strip()[-500:]}"}
        if last:
            fail["index"] = int(last[0])
        fails.append(fail)
        summary = {}
    return summary, fails


def keep_regressions(bases: dict[str, Path], fails: list[dict]) -> list[Path]:
    """The failures as regression files, one per kind of failure (exception type and where it
    was raised): a bug often fails thousands of mutants the same way."""
    loaded = [load_base(name, path) for name, path in bases.items()]
    weighted = [loaded[0]] * 3 + loaded[1:]
    REGRESSIONS.mkdir(exist_ok=True)
    kept, seen = [], set()
    for f in fails:
        kind = (f["error"].split(":")[0], f.get("where", "").split("; ")[-1])
        if "index" not in f or kind in seen:
            continue
        seen.add(kind)
        base, data = fuzz_gguf.mutant(f["seed"], f["index"], weighted)
        reg = fuzz_gguf.to_regression(base, data, {"found": f"{f['error'][:200]} at {kind[1]}"})
        path = REGRESSIONS / f"gguf-{f['seed']}-{f['index']}.json"
        path.write_text(json.dumps(reg, indent=1) + "\n")
        kept.append(path)
    return kept


def test_fuzz_gguf(fuzz_bases, tmp_path):
    seconds = FUZZ_SECONDS or (0 if FUZZ_MUTANTS else CI_SECONDS)
    summary, fails = run_fuzz(fuzz_bases, tmp_path, FUZZ_SEED, seconds, FUZZ_MUTANTS)
    print(f"fuzz: seed {FUZZ_SEED}, {summary}")
    if fails:
        kept = keep_regressions(fuzz_bases, fails)
        shown = "\n".join(f"  index {f.get('index')}: {f['error']} ({f.get('where', '')})"
                          for f in fails[:10])
        pytest.fail(f"{len(fails)} mutants escaped with something other than GGUFError "
                    f"(replay: FTPATCH_FUZZ_SEED={FUZZ_SEED}; kept in {len(kept)} files under "
                    f"{REGRESSIONS.name}/):\n{shown}")
    assert summary["mutants"] > 0 and summary["refused"] > 0 and summary["ok"] > 0


def test_mutants_are_reproducible(fuzz_bases):
    bases = [load_base(n, p) for n, p in fuzz_bases.items()]
    for i in range(20):
        assert fuzz_gguf.mutant(7, i, bases)[1] == fuzz_gguf.mutant(7, i, bases)[1]
        base, data = fuzz_gguf.mutant(7, i, bases)
        reg = fuzz_gguf.to_regression(base, data, {})
        assert fuzz_gguf.from_regression(reg, {b.name: b for b in bases}) == data


def _regression_files() -> list[Path]:
    return sorted(REGRESSIONS.glob("gguf-*.json")) if REGRESSIONS.exists() else []


@pytest.mark.parametrize("reg_path", _regression_files(), ids=lambda p: p.stem)
def test_fuzz_regressions(reg_path, fuzz_bases, tmp_path):
    bases = {n: load_base(n, p) for n, p in fuzz_bases.items()}
    reg = json.loads(reg_path.read_text())
    path = tmp_path / "regression.gguf"
    path.write_bytes(fuzz_gguf.from_regression(reg, bases))
    alarm = signal.getsignal(signal.SIGALRM)
    signal.signal(signal.SIGALRM, fuzz_gguf._on_alarm)
    signal.setitimer(signal.ITIMER_REAL, fuzz_gguf.MUTANT_SECONDS)
    try:
        assert fuzz_gguf.check(path, reg["base"]) in ("ok", "refused")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, alarm)


# -- templates -----------------------------------------------------------------------------------

INTS = ["0", "1", "2", "3", "7", "-1", "100", "100000", "1000000", "10**9", "10**5", "2**40"]
STRS = ["'x'", "'ab'", "''", "'<|im_end|>'", "'%s'", "'{}'", "'{:>9}'", "'\\n'", "'a b c'",
        "'%999999999d'", "'{:>99999999}'"]


class TemplateGrammar:
    """Random templates: statements and expressions of the kinds real and hostile templates
    use, nested to a random depth."""

    def __init__(self, rng: random.Random):
        self.r = rng

    def atom(self) -> str:
        r = self.r
        return r.choice([
            r.choice(INTS), r.choice(STRS), "messages", "messages[0]", "messages[0].content",
            "ns.v", "x", "loop.index", "range(" + r.choice(INTS) + ")", "[1, 2, 3]",
            "{'a': 1}", "none", "true", "m(" + r.choice(STRS) + ")", "'x' * 3",
        ])

    def expr(self, d: int) -> str:
        r = self.r
        if d <= 0 or r.random() < 0.3:
            return self.atom()
        a, b = self.expr(d - 1), self.expr(d - 1)
        return r.choice([
            f"({a} * {b})", f"({a} ** {b})", f"({a} + {b})", f"({a} ~ {b})", f"({a} % {b})",
            f"({a} // {b})", f"[{a}, {b}]", f"({a}, {b})", f"{{'k': {a}, 'j': {b}}}",
            f"({a})|string", f"({a})|length", f"({a})|list", f"({a})|join({b})",
            f"({a})|replace('a', {b})", f"({a})|center({b})", f"({a})|indent({b})",
            f"({a})|tojson", f"({a})|batch({b})", f"({a})|slice({b})", f"({a})|sum",
            f"({a})|first", f"({a})|reverse", f"({a})|sort", f"({a})|unique", f"({a})|upper",
            f"({a})|format({b})", f"({a})|int", f"({a})|default({b})", f"({a})|trim",
            f"({a})|map('upper')|list", f"({a})|select|list", f"({a})|truncate({b})",
            f"({a}).split()", f"({a}).replace({b}, {a})", f"({a}).ljust({b})",
            f"({a}).format({b})", f"({a}).join({b})", f"({a}).strip()", f"({a})[{b}]",
            f"({a})[1:{b}]", f"({a} if {b} else {a})", f"({a} in {b})", f"({a} == {b})",
            f"m({a})", f"namespace(v={a})", f"dict(k={a})", f"({a}).items()|list",
            f"raise_exception({a})" if r.random() < 0.05 else f"({a})|lower",
        ])

    def block(self, d: int) -> str:
        r = self.r
        n = r.randint(1, 3)
        return "".join(self.stmt(d) for _ in range(n))

    def stmt(self, d: int) -> str:
        r = self.r
        if d <= 0 or r.random() < 0.25:
            return r.choice([f"{{{{ {self.expr(1)} }}}}", "text", "{% set ns.v = x %}",
                             "{% break %}" if r.random() < 0.1 else "."])
        e = self.expr(r.randint(0, 2))
        body = self.block
        forms = [   # built lazily: only the chosen form recurses
            lambda: f"{{{{ {self.expr(r.randint(0, 3))} }}}}",
            lambda: f"{{% for x in {e} %}}{body(d - 1)}{{% endfor %}}",
            lambda: f"{{% for x in {e} if {self.expr(1)} %}}{body(d - 1)}{{% endfor %}}",
            lambda: f"{{% for x in {e} recursive %}}{body(d - 1)}{{{{ loop([x]) }}}}{{% endfor %}}",
            lambda: f"{{% if {e} %}}{body(d - 1)}{{% else %}}{body(d - 1)}{{% endif %}}",
            lambda: f"{{% set ns.v = {e} %}}",
            lambda: f"{{% set y = {e} %}}{{{{ y }}}}",
            lambda: f"{{% set ns.v %}}{body(d - 1)}{{% endset %}}",
            lambda: f"{{% filter upper %}}{body(d - 1)}{{% endfilter %}}",
            lambda: f"{{% call m({e}) %}}{body(d - 1)}{{% endcall %}}",
        ]
        return r.choice(forms)()

    def template(self) -> str:
        r = self.r
        body = self.block(r.randint(1, 4))
        macro = self.block(r.randint(0, 3))
        if r.random() < 0.5:
            macro += "{{ caller() if caller is defined else '' }}"
        return ("{% set ns = namespace(v='x') %}{% set x = 'x' %}"
                f"{{% macro m(a) %}}{macro}{{% endmacro %}}{body}")


LIMITS = TemplateLimits(seconds=0.5, output_chars=1 << 16, value_size=1 << 16,
                        emitted_chars=1 << 20, depth=16)


def test_fuzz_templates():
    seed = FUZZ_SEED
    rng = random.Random(seed)
    gen = TemplateGrammar(rng)
    messages = [{"role": "user", "content": "hello ab"}, {"role": "assistant", "content": "x"}]
    before = copy.deepcopy(messages)
    outcomes = {"ok": 0, "refused": 0}
    slowest = 0.0
    seconds = FUZZ_SECONDS or CI_SECONDS
    t_end = time.monotonic() + seconds
    tracemalloc.start()
    try:
        for i in range(FUZZ_TEMPLATES):
            if i >= 20 and time.monotonic() > t_end and "FTPATCH_FUZZ_TEMPLATES" not in os.environ:
                break
            src = gen.template()
            t0 = time.monotonic()
            try:
                out = ChatTemplate(src, limits=LIMITS, isolate=bool(i & 1)).render(messages)
                assert len(out) <= LIMITS.output_chars
                outcomes["ok"] += 1
            except ChatTemplateError as e:
                assert "\n" not in str(e)
                assert "memory limit" not in str(e) and "died" not in str(e), \
                    f"template {i} (FTPATCH_FUZZ_SEED={seed}): {e}\n{src}"
                outcomes["refused"] += 1
            except BaseException as e:
                pytest.fail(f"template {i} (FTPATCH_FUZZ_SEED={seed}) raised "
                            f"{type(e).__name__}: {e}\n{src}")
            slowest = max(slowest, time.monotonic() - t0)
            # generous: the limit is 0.5 s; the checks run at every loop step and call
            assert slowest < 10 * LIMITS.seconds + 5, f"template {i} (seed {seed}) ran {slowest:.1f} s\n{src}"
            assert messages == before
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    print(f"templates: seed {seed}, {outcomes}, slowest {slowest:.2f} s, peak {peak >> 20} MiB")
    assert peak < 512 << 20
    assert outcomes["ok"] and outcomes["refused"]
