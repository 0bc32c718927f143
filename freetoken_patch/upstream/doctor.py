"""`ftpatch freetoken doctor`: is this FreeToken the one the patch is for, does the patch apply
here and in a process spawned the way `ft serve` spawns its engine, and what cannot run on this
machine (and why)."""
from __future__ import annotations

import multiprocessing as mp
import pickle
import platform
import sys
from dataclasses import asdict

from . import hooks, target
from .errors import PatchRefused

CHILD_TIMEOUT_S = 120


def spawned_child_hooks() -> dict[str, bool]:
    """Start a child with the spawn method (as `ft serve` does) and ask it which hooks it has."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    from .spawn import report_hooks
    p = ctx.Process(target=report_hooks, args=(q,), name="ftpatch-doctor-child")
    p.start()
    try:
        return q.get(timeout=CHILD_TIMEOUT_S)
    finally:
        p.join(CHILD_TIMEOUT_S)


def spawn_targets() -> dict[str, str]:
    """Where spawn's pickle sends a child for each of FreeToken's launch targets."""
    from freetoken.server import launch
    out = {}
    for name in ("_run_scheduler", "_run_tokenize_worker"):
        fn = getattr(launch, name)
        out[name] = f"{fn.__module__}.{fn.__qualname__}"
        pickle.dumps(fn)   # fails here, not in `ft serve`, if the target cannot be pickled
    return out


def unavailable() -> list[str]:
    """What the patch or FreeToken cannot do on this machine, one reason each."""
    out = []
    if sys.version_info[:2] != (3, 11):
        out.append(f"FreeToken itself: its 0.2.1 wheel is cp311 only; this is Python "
                   f"{platform.python_version()}")
    try:
        import torch
        cuda = torch.cuda.is_available()
    except Exception:   # a broken torch is itself the reason
        cuda = False
    if not cuda:
        out.append("no CUDA device: FreeToken's engine, kernels, OffloadMoeCache and pinned "
                   "banks (cudaHostRegister) do not run; the bank loader runs on CPU "
                   "(device=cpu or FREETOKEN_SKIP_BANK_PIN=1)")
    try:
        import freetoken.server.api_server  # noqa: F401  (the web stack `ft serve` needs)
    except Exception as exc:   # what is missing is the message
        out.append(f"`ft serve` cannot start its server here ({type(exc).__name__}: {exc}); "
                   "the CPU install leaves out FreeToken's web stack and CUDA packages")
    out.append("`ft daemon` starts `python -m freetoken.cli serve` itself: it runs unpatched; "
               "serve through `ftpatch freetoken serve` instead")
    return out


def _clear_header_caches() -> None:
    """FreeToken caches every header read per path; a timing must start from none."""
    from freetoken.models.gguf import reader
    for name in ("load_gguf_metadata", "gguf_split_paths", "gguf_tensor_index"):
        getattr(reader, name).cache_clear()
    for fn in (reader._reader, hooks.original("freetoken.models.gguf.reader", "_reader")):
        getattr(fn, "cache_clear", lambda: None)()


def header_parse(model: str, compare: bool = False) -> dict:
    """What reading `model`'s GGUF header costs through FreeToken's own functions with the patch
    applied (metadata, split set, tensor index); with `compare`, gguf-py's reader on the same
    files too (FreeToken 0.2.1's way: tens of seconds on a large vocabulary) and whether the two
    give the same metadata and tensor index."""
    import time

    from freetoken.models.gguf import reader

    from .paths import resolve_model_path
    path = resolve_model_path(model)

    def timed() -> tuple[float, dict, dict]:
        _clear_header_caches()
        t0 = time.perf_counter()
        meta = reader.load_gguf_metadata(path)
        index = reader.gguf_tensor_index(path)
        return time.perf_counter() - t0, meta, index

    try:
        seconds, meta, index = timed()
    except ValueError as e:    # the header reader's: not a GGUF, ends early (names the file)
        from ..errors import CLIError
        raise CLIError(str(e)) from None
    out = {"model": path, "files": len(reader.gguf_split_paths(path)), "keys": len(meta) - 3,
           "tensors": len(index), "seconds": seconds, "reader": "ftpatch (lean header)"}
    if compare:
        from .header import reader as lean
        setattr(reader, "_reader", hooks.original("freetoken.models.gguf.reader", "_reader"))
        try:
            old_seconds, old_meta, old_index = timed()
        finally:
            setattr(reader, "_reader", lean)
            _clear_header_caches()
        out.update(gguf_py_seconds=old_seconds, same_metadata=_same(meta, old_meta),
                   same_tensor_index=index == old_index)
    return out


def _same(a, b) -> bool:
    """Equal values of equal types, floats by their bits (NaN included), dicts in key order."""
    import struct
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(map(_same, a, b))
    return a == b


def report(dist=None, spawn_child: bool = True, model: str | None = None,
           compare: bool = False) -> dict:
    """Everything doctor prints, as data. Raises PatchRefused when the install is not ours."""
    t = target.inspect(dist)
    files = [dict(asdict(f), ok=f.ok) for f in t.files]
    out = {"version": t.version, "expected_version": target.VERSION, "location": str(t.root),
           "files": files, "refused": None, "hooks": {}, "child_hooks": None,
           "spawn_targets": None, "header": None, "unavailable": unavailable()}
    try:
        target.check(dist)
    except PatchRefused as e:
        out["refused"] = str(e)
        return out
    hooks.apply()
    out["hooks"] = hooks.applied()
    out["spawn_targets"] = spawn_targets()
    if spawn_child:
        out["child_hooks"] = spawned_child_hooks()
    if model:
        out["header"] = header_parse(model, compare)
    return out


def render(r: dict) -> str:
    lines = [f"FreeToken {r['version']} at {r['location']} (patch is for {r['expected_version']})"]
    for f in r["files"]:
        state = "ok" if f["ok"] else ("missing" if f["actual"] is None else "CHANGED")
        lines.append(f"  {state:8s} {f['path']}  {f['expected']}")
    if r["refused"]:
        lines.append(f"refused: {r['refused']}")
    else:
        child = r["child_hooks"] or {}
        lines.append("hooks (this process / spawned child):")
        for h in hooks.HOOKS:
            here = "applied" if r["hooks"].get(h.name) else "MISSING"
            there = ("applied" if child.get(h.name) else "MISSING") if child else "not checked"
            lines.append(f"  {h.name:16s} {here:8s} / {there:11s} {h.what}")
        for name, where in (r["spawn_targets"] or {}).items():
            lines.append(f"  spawn target {name} -> {where}")
        h = r.get("header")
        if h:
            lines.append(f"GGUF header of {h['model']} ({h['files']} file(s), {h['keys']} keys, "
                         f"{h['tensors']} tensors): {h['seconds']:.2f} s with the patch")
            if "gguf_py_seconds" in h:
                same = "same" if h["same_metadata"] and h["same_tensor_index"] else "DIFFERENT"
                lines.append(f"  FreeToken 0.2.1's reader (gguf-py): {h['gguf_py_seconds']:.2f} s, "
                             f"{h['gguf_py_seconds'] / max(h['seconds'], 1e-9):.0f}x as long; "
                             f"{same} metadata and tensor index")
        else:
            lines.append("GGUF header parse: not timed (doctor --model M times it)")
    lines.append("not available here:")
    lines += [f"  - {u}" for u in r["unavailable"]]
    return "\n".join(lines)


def healthy(r: dict) -> bool:
    child, h = r["child_hooks"], r.get("header") or {}
    return (r["refused"] is None and all(r["hooks"].values())
            and (child is None or all(child.values()))
            and h.get("same_metadata", True) and h.get("same_tensor_index", True))
