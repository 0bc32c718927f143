"""Chat templates in the worker process: the hostile templates of the findings refused within 3 s
and 512 MB (by the sandbox's checks, and by the worker's OS limits with those checks out of the
way), a render past its time stopped and the worker replaced, the CPU-time limit, the worker's
isolation (its own interpreter, session, environment and rlimits), many threads at once."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from loaders import ChatTemplate, ChatTemplateError, TemplateLimits
from loaders import template_worker

ROOT = Path(__file__).resolve().parents[2]
MESSAGES = [{"role": "user", "content": "hi"}]
HINT = "pass --chat-template FILE to use another template"

# the findings: each rendered, or refused only after seconds and gigabytes
ISSUE_TEMPLATES = [
    "{{ 'x'.encode().center(1500000000)|length }}",
    "{{ (1).to_bytes(1500000000,'big')|length }}",
    "{{ 'x'.encode().ljust(3000000000)|length }}",
    "{{ ('a'*1000).translate({97:'x'*4000000}) }}",
    "{{ (range(500)|list)|tojson(separators=('x' * 4000000, ':')) }}",
    "{{ range(100000)|map('string')|map('center',4000000)|list }}",
]

# Runs in a fresh interpreter, so its peak RSS and its children's are this run's alone.
_PROBE = r"""
import json, resource, sys, time
from loaders import ChatTemplate, ChatTemplateError, TemplateLimits
from loaders import template_worker
big = 1 << 40
modes = {"checks": TemplateLimits(),
         # the sandbox's size checks out of the way: the worker's OS limits must hold alone
         "os-limits": TemplateLimits(value_size=big, emitted_chars=big, output_chars=big)}
out = []
for src in json.loads(sys.argv[1]):
    for mode, limits in modes.items():
        t0 = time.monotonic()
        try:
            ChatTemplate(src, limits=limits).render([{"role": "user", "content": "hi"}])
            said = None
        except ChatTemplateError as e:
            said = str(e)
        out.append({"src": src, "mode": mode, "seconds": time.monotonic() - t0, "said": said})
template_worker._close_pools()      # every worker reaped: RUSAGE_CHILDREN counts them all
time.sleep(0.2)
for t in list(__import__("threading").enumerate()):
    if t.name == "ftpatch-template-restart":
        t.join()
template_worker._close_pools()
# our peak: VmHWM (ru_maxrss would count the image of the process that started us: Linux keeps
# it across exec); the workers': the largest reaped child, an upper bound for the same reason
hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM"))
print(json.dumps({"runs": out, "parent_mb": hwm / 1024,
                  "workers_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))
"""


@pytest.mark.slow
def test_the_findings_are_refused_within_3_s_and_512_mb():
    r = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(ISSUE_TEMPLATES)],
                       capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout.splitlines()[-1])
    for run in res["runs"]:
        where = f"{run['mode']}: {run['src']}"
        assert run["said"] is not None, f"rendered: {where}"
        assert "\n" not in run["said"] and run["said"].endswith(HINT), run["said"]
        assert run["seconds"] <= 3.0, f"{run['seconds']:.1f} s: {where}"
        if run["mode"] == "os-limits" and "separators" not in run["said"]:
            assert "256 MiB memory limit (the render process was stopped)" in run["said"], where
    print(f"peak RSS: parent {res['parent_mb']:.0f} MB, workers {res['workers_mb']:.0f} MB")
    assert res["parent_mb"] <= 512 and res["workers_mb"] <= 512, res


def test_the_checks_refuse_the_findings_before_the_work():
    # the fast path: a precise message, the template's line, no memory spent
    said = []
    for src in ISSUE_TEMPLATES:
        with pytest.raises(ChatTemplateError) as e:
            ChatTemplate(src, isolate=False).render(MESSAGES)
        said.append(str(e.value))
    assert "bytes.center width of 1,500,000,000 is larger" in said[0]
    assert "an argument of 1,500,000,000 to int.to_bytes" in said[1]
    assert "bytes.ljust width of 3,000,000,000" in said[2]
    assert "the result of str.translate is larger" in said[3]
    assert "tojson separators must be two strings of at most 16 characters" in said[4]
    assert "what 'map' produced is larger" in said[5]
    assert all("at template line 1" in s and s.endswith(HINT) for s in said), said


def test_sizes_count_bytes_and_check_more_arguments():
    def refused(src: str) -> str:
        with pytest.raises(ChatTemplateError) as e:
            ChatTemplate(src, isolate=False).render(MESSAGES)
        return str(e.value)
    # a bytes value counts its length (it counted as 16 characters)
    assert "is larger" in refused("{% set b = 'x'.encode() * 3000000 %}{{ [b, b]|length }}")
    assert "is larger" in refused("{{ ('x' * 3000000).encode().replace('x'.encode(), 'xx'.encode())|length }}")
    assert "'%' format width" in refused("{{ ('%999999999d'.encode() % 1)|length }}")
    assert "the result of str.translate" in refused(
        "{{ ('ab' * 100000).translate(['y' * 100] * 128)|length }}")
    assert "tojson separators" in refused("{{ [1, 2]|tojson(separators=[',', 7]) }}")
    assert "the result of 'tojson'" in refused(
        "{% set d = range(1000)|map('string')|list %}{{ ([d] * 110)|tojson(indent=16)|length }}")
    assert "the result of 'e'" in refused("{{ ('&' * 1000000)|e|length }}")
    # within the limits, the same filters and methods give Python's results
    ok = ChatTemplate("{{ 'ab'.encode().center(6) }}|{{ 'a\\tb'.translate({9: '--'}) }}|"
                      "{{ {'a': [1, 2]}|tojson(separators=(',', ':')) }}|{{ '<&>'|e }}|"
                      "{{ {'a': 1}.get('b', 10000000000) }}", isolate=False).render(MESSAGES)
    assert ok == "b'  ab  '|a--b|{\"a\":[1,2]}|&lt;&amp;&gt;|10000000000"


def test_a_render_past_its_time_is_stopped_and_the_worker_replaced(monkeypatch):
    # the parent's clock fires first here (it is set below the render's own), as it does for
    # one long C call that the sandbox's clock cannot interrupt
    limits = TemplateLimits(seconds=0.6, compile_seconds=0.0)
    tpl = ChatTemplate("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                       "{% endfor %}", limits=TemplateLimits())
    tpl.limits = limits
    monkeypatch.setattr(template_worker, "GRACE_SECONDS", -0.3)
    before = _worker_pids()
    t0 = time.monotonic()
    with pytest.raises(ChatTemplateError) as e:
        tpl.render(MESSAGES)
    took = time.monotonic() - t0
    msg = str(e.value)
    assert msg == ("tokenizer.chat_template: rendering took longer than its 0.6 s limit (the "
                   f"render process was stopped); {HINT}"), msg
    assert took < 1.5, took
    monkeypatch.setattr(template_worker, "GRACE_SECONDS", 0.5)
    # a new worker serves the next render, and the stopped one is gone
    assert ChatTemplate("{{ 6 * 7 }}", limits=limits).render(MESSAGES) == "42"
    for pid in before - _worker_pids():
        assert not Path(f"/proc/{pid}").exists() or _is_zombie_free(pid)


def test_memory_past_the_limit_stops_the_worker_and_the_next_render_works():
    big = 1 << 40
    limits = TemplateLimits(value_size=big, emitted_chars=big, output_chars=big, memory=64 << 20)
    with pytest.raises(ChatTemplateError, match=r"rendering needed more than its 64 MiB memory "
                                                r"limit \(the render process was stopped\)"):
        ChatTemplate("{{ ('x' * 200000000)|length }}", limits=limits).render(MESSAGES)
    assert ChatTemplate("{{ ('x' * 20000000)|length }}", limits=limits).render(MESSAGES) == \
        "20000000"


@pytest.mark.slow
def test_cpu_time_past_the_limit_ends_the_worker():
    # RLIMIT_CPU is the backstop behind the parent's clock: here the parent waits a minute, and
    # a compile (which has no clock of its own) of a large source runs into it
    w = template_worker._Worker(256 << 20)
    w.start()
    limits = TemplateLimits(compile_seconds=0.0, source_chars=1 << 20)
    t0 = time.monotonic()
    with pytest.raises(template_worker._Broke, match="died"):
        w.call(("compile", "k", "{{ x }}\n" * 40000, "here", limits, None),
               time.monotonic() + 60, 1 << 20)
    assert time.monotonic() - t0 < 10
    assert w.last_exit == -template_worker._sigxcpu()
    said = template_worker._breach("died", w, "here", limits, "compile")
    assert said.startswith("here: compiling used more than its 0 s of CPU time (the render "
                           "process was stopped)")


def test_the_worker_is_a_fresh_interpreter_apart_from_us(monkeypatch):
    import torch  # noqa: F401  -- a process with torch loaded and threads running
    stop = threading.Event()
    spinners = [threading.Thread(target=lambda: stop.wait(), daemon=True) for _ in range(4)]
    for t in spinners:
        t.start()
    monkeypatch.setenv("FTPATCH_API_KEY", "not-for-templates")
    template_worker._close_pools()
    try:
        tpl = ChatTemplate("{{ messages[0].content }}")
        assert tpl.render(MESSAGES) == "hi"
    finally:
        stop.set()
    pids = _worker_pids()
    assert pids
    for pid in pids:
        _check_worker(pid)


def _check_worker(pid: int) -> None:
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    assert cmdline[1:5] == [b"-P", b"-s", b"-m", b"loaders.template_worker"]
    environ = Path(f"/proc/{pid}/environ").read_bytes()
    assert b"not-for-templates" not in environ and b"FTPATCH" not in environ
    assert os.getsid(pid) != os.getsid(0)            # a terminal's Ctrl-C does not reach it
    limits = Path(f"/proc/{pid}/limits").read_text()
    row = {line[:26].strip(): line[26:].split() for line in limits.splitlines()[1:]}
    assert row["Max file size"][:2] == ["0", "0"]
    assert row["Max open files"][:2] == ["16", "16"]
    assert row["Max core file size"][:2] == ["0", "0"]
    space = int(row["Max address space"][0])
    assert 256 << 20 < space < 1 << 30, space
    assert int(row["Max cpu time"][1]) == template_worker.LIFETIME_CPU


def test_many_threads_render_at_once_and_a_slow_one_holds_up_none_but_itself():
    limits = TemplateLimits(seconds=1.0)
    slow = ChatTemplate("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                        "{% endfor %}", limits=limits)
    fast = [ChatTemplate(f"{{{{ messages[0].content }}}}-{k}") for k in range(3)]
    results: dict = {}

    def render(k: int) -> None:
        t0 = time.monotonic()
        try:
            out = fast[k % 3].render([{"role": "user", "content": f"m{k}"}])
        except ChatTemplateError as e:
            out = e
        results[k] = (out, time.monotonic() - t0)

    def render_slow() -> None:
        try:
            slow.render(MESSAGES)
        except ChatTemplateError as e:
            results["slow"] = str(e)

    hog = threading.Thread(target=render_slow)
    hog.start()
    time.sleep(0.2)
    threads = [threading.Thread(target=render, args=(k,)) for k in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    hog.join()
    assert all(results[k][0] == f"m{k}-{k % 3}" for k in range(24)), results
    assert max(results[k][1] for k in range(24)) < 0.9     # none waited for the slow one
    assert "longer than its 1 s limit" in results["slow"]


def test_inputs_that_are_not_plain_data_are_refused():
    with pytest.raises(ChatTemplateError, match="inputs must be plain data"):
        ChatTemplate("{{ x }}").render(MESSAGES, x=threading.Lock())


def test_the_built_in_chatml_renders_here_and_model_templates_there():
    assert not ChatTemplate(None).isolate
    assert ChatTemplate("{{ 1 }}").isolate and not ChatTemplate("{{ 1 }}", isolate=False).isolate
    with pytest.raises(ChatTemplateError, match=r"syntax error at template line 2"):
        ChatTemplate("ok\n{{ foo( }}")       # compiled in the worker: reported at once


def _worker_pids() -> set[int]:
    pids = set()
    for pool in template_worker._pools.values():
        with pool.cond:
            for w in pool.idle:
                if w.alive():
                    pids.add(w.proc.pid)
    return pids


def _is_zombie_free(pid: int) -> bool:
    try:
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True
