"""Measurements the pull-request notes cite, each written as JSON (rendered by `evidence`).

bank_load   FreeToken's GGUF bank loader against the patched one on the same file: each run in
            a fresh process, the file's page cache dropped first (cold: posix_fadvise
            DONTNEED on every shard, which needs no privileges) or read through first (warm);
            the loaders run as when serving (host banks and the pin pipeline) with pinning
            skipped (FREETOKEN_SKIP_BANK_PIN=1: no GPU here).
parity      both loaders on synthetic GGUFs (several types, mixed per layer and projection,
            split sets opened from another shard): every bank byte compared, pad rows included.
header      FreeToken's GGUF header reads (metadata, tensor index, `ft serve`'s argument parse,
            the tokenizer build, the engine process's reads) with 0.2.1's reader, a pull-request
            build's and our runtime patch's: fresh processes, digests of what each produced.
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

LOADERS = ("freetoken", "patched")


def machine() -> dict:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "ram_gib": round(_meminfo("MemTotal") / 2**20, 1),
            "python": platform.python_version(), "platform": platform.platform()}


def _meminfo(key: str) -> int:
    """A /proc/meminfo field in KiB (0 where unknown)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _shards(model: str) -> list[Path]:
    from loaders.gguf_file import split_paths
    return split_paths(model)


def drop_cache(paths: list[Path]) -> None:
    os.sync()   # pages still dirty (a file just written) are not dropped
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm_cache(paths: list[Path], limit: int | None = None) -> None:
    """Read every file through the page cache (its first `limit` bytes only, when given)."""
    buf = bytearray(16 << 20)
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            done = 0
            while (limit is None or done < limit) and (n := f.readinto(buf)):
                done += n


def _load_once(model: str, loader: str, layers: int, tree: str = "") -> dict:
    """In this (fresh) process: one bank load, timed. `loader`: freetoken (as installed),
    patched (our runtime patch) or pr (the FreeToken tree a PR build wrote, at `tree`)."""
    os.environ["FREETOKEN_SKIP_BANK_PIN"] = "1"
    if loader == "pr":
        sys.path.insert(0, tree)
        from freetoken.models.gguf import experts
        if not experts.__file__.startswith(tree):
            raise RuntimeError(f"the PR tree {tree} did not shadow FreeToken ({experts.__file__})")
        fn = experts.load_gguf_expert_banks
    else:
        from freetoken_patch.upstream import hooks
        hooks.apply()
        fn = (hooks.original("freetoken.models.gguf.experts", "load_gguf_expert_banks")
              if loader == "freetoken" else hooks.hook("parallel-banks").ours())
    path = str(_shards(model)[0])
    # a server parses the header once, for the config, before it loads banks; FreeToken's loader
    # reuses that parse (cached), so it is taken and timed apart here
    t0 = time.perf_counter()
    from freetoken.models.gguf.reader import gguf_tensor_index
    gguf_tensor_index(path)
    header = time.perf_counter() - t0
    t0 = time.perf_counter()
    banks = fn(path, layers)
    seconds = time.perf_counter() - t0
    nbytes = sum(t.numel() * t.element_size() for ts in banks.sources.values() for t in ts)
    return {"seconds": seconds, "bank_bytes": nbytes, "freetoken_header_seconds": header}


def bank_load(model: str, *, repeats: int = 2, caches=("cold", "warm"), threads: int | None = None,
              pr_tree: str | None = None) -> dict:
    """Alternating runs of the loaders under each cache state (FreeToken's, our patch's, and a
    PR build's when `pr_tree` is given); one JSON-able record."""
    from loaders import open_gguf
    g = open_gguf(model)
    layers = int(g.get("qwen35moe.block_count"))
    paths = [Path(p) for p in g.paths]
    size = sum(p.stat().st_size for p in paths)
    name = Path(g.paths[0]).name
    g.close()
    env = dict(os.environ)
    if threads:
        env["FTPATCH_FT_BANK_THREADS"] = env["FREETOKEN_GGUF_LOAD_WORKERS"] = str(threads)
    loaders = LOADERS + (("pr",) if pr_tree else ())
    from .banks import bank_threads
    runs = []
    for cache in caches:
        for rep in range(repeats):
            for loader in loaders:
                (drop_cache if cache == "cold" else warm_cache)(paths)
                cached_kib = _meminfo("Cached")
                out = subprocess.run(
                    [sys.executable, "-m", "freetoken_patch.upstream.measure", "_one", model,
                     loader, str(layers), str(Path(pr_tree).resolve()) if pr_tree else ""],
                    env=env, capture_output=True, text=True, check=False)
                if out.returncode:
                    raise RuntimeError(f"bank load ({loader}) failed: {out.stderr[-2000:]}")
                rec = json.loads(out.stdout.strip().splitlines()[-1])
                runs.append(dict(rec, loader=loader, cache=cache, repeat=rep,
                                 page_cache_kib_before=cached_kib))
    return {"kind": "bank_load", "model": name, "file_bytes": size, "shards": len(paths),
            "layers": layers, "threads": threads or bank_threads(), "machine": machine(),
            "method": "fresh process per run, loaders alternated; cold: posix_fadvise DONTNEED "
                      "on every shard before the run; warm: every shard read through first; "
                      "FreeToken's header parse (gguf_tensor_index, cached, which a server does "
                      "for its config first) done before the timed call and timed apart; our "
                      "loader's own header parse is inside its time; host banks + pin pipeline "
                      "with FREETOKEN_SKIP_BANK_PIN=1",
            "pr_tree": str(pr_tree or ""), "runs": runs}


def parity(workdir: str | Path) -> dict:
    """Both loaders on synthetic GGUFs; every byte of every bank compared."""
    import torch

    from loaders.synth import SynthOptions, synthesize

    from . import hooks
    os.environ["FREETOKEN_SKIP_BANK_PIN"] = "1"
    hooks.apply()
    ours = hooks.hook("parallel-banks").ours()
    theirs = hooks.original("freetoken.models.gguf.experts", "load_gguf_expert_banks")
    workdir = Path(workdir)
    cases = []
    for i, (label, kw, open_shard) in enumerate(PARITY_CASES):
        paths = synthesize(workdir / f"p{i}.gguf", SynthOptions(**kw), threads=2)
        for device in (None, torch.device("cpu")):
            a = theirs(str(paths[0]), 4, device=device)
            b = ours(str(paths[min(open_shard, len(paths) - 1)]), 4, device=device)
            cases.append({"case": label, "options": kw, "shards": len(paths),
                          "opened": paths[min(open_shard, len(paths) - 1)].name,
                          "banks": "host" if device is None else "device=cpu",
                          **compare(a, b)})
    return {"kind": "parity", "machine": machine(), "cases": cases}


# (label, SynthOptions fields, which shard the patched loader is given)
PARITY_CASES = (
    ("IQ3_S", {"type": "IQ3_S"}, 0),
    ("Q4_K", {"type": "Q4_K"}, 0),
    ("Q8_0", {"type": "Q8_0"}, 0),
    ("IQ2_XXS", {"type": "IQ2_XXS"}, 0),
    ("BF16 experts", {"type": "Q4_K", "expert_type": "BF16"}, 0),
    ("mixed: IQ3_S gate/up, Q4_K down", {"type": "IQ3_S", "down_type": "Q4_K"}, 0),
    ("mixed per layer", {"type": "IQ3_S", "tensor_types": (
        (r"blk\.1\.ffn_(gate|up)_exps", "Q5_K"), (r"blk\.2\.ffn_down_exps", "Q6_K"))}, 0),
    ("split set, opened at shard 3", {"type": "IQ3_S", "down_type": "Q4_K",
                                      "split_max_size": 400_000}, 2),
)


def _storage(t):
    """Every byte of the allocation behind `t` (a device bank's pad rows lie past its view)."""
    import torch
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def compare(a, b) -> dict:
    """Byte comparison of two ExpertBanks (pad rows past a device bank's end included)."""
    import torch
    same_meta = (a.quant_format == b.quant_format and a.layer_tags == b.layer_tags
                 and a.row_tail_bytes == b.row_tail_bytes and set(a.sources) == set(b.sources))
    nbytes, identical = 0, same_meta
    for role in a.sources:
        for x, y in zip(a.sources[role], b.sources[role]):
            if x.dtype != y.dtype or x.shape != y.shape:
                identical = False
                continue
            identical &= bool(torch.equal(x.view(torch.uint8), y.view(torch.uint8)))
            identical &= bool(torch.equal(_storage(x), _storage(y)))   # the zero pad rows too
            nbytes += x.numel() * x.element_size()
    return {"identical": identical, "metadata_equal": same_meta, "bank_bytes": nbytes}


def _fill_once(model: str, threads: int) -> dict:
    """In this (fresh) process: the patched loader's fill alone (no FreeToken: its banks are
    lazy anonymous mappings like FreeToken's host banks), with `threads` threads, timed."""
    import mmap
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from loaders import open_gguf

    from . import banks
    g = open_gguf(model)
    t0 = time.perf_counter()
    plan = banks._plan(g, int(g.get("qwen35moe.block_count")), 0)
    dst, jobs = [], []
    for layer, spec in enumerate(plan):
        b = {}
        for role, srcs in (("gate_up", spec.parts), ("down", [spec.down])):
            e, _, r = srcs[0].array.shape
            shape = (e, sum(s.array.shape[1] for s in srcs), r)
            buf = mmap.mmap(-1, shape[0] * shape[1] * shape[2])
            b[role] = torch.frombuffer(buf, dtype=torch.uint8).view(shape)
        dst.append(b)
        jobs += banks._jobs(layer, spec, b)
    with ThreadPoolExecutor(max_workers=threads) as pool:
        list(pool.map(lambda j: banks._run_job(j, True), jobs))
    for spec in plan:
        for src in (*spec.parts, spec.down):
            banks._drop_page_cache(src)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "bank_bytes": sum(t.numel() for b in dst for t in b.values())}


def fill_threads(model: str, threads=None, caches=("cold", "warm"), repeats: int = 2) -> dict:
    """The patched loader's fill at several thread counts (default 1, 2, 4, ... up to the CPU
    count); no FreeToken code runs; same cache method as `bank_load`."""
    cpus = os.cpu_count() or 1
    threads = threads or tuple(1 << i for i in range(cpus.bit_length()) if 1 << i <= cpus)
    from loaders import open_gguf
    g = open_gguf(model)
    paths = [Path(p) for p in g.paths]
    name, layers = Path(g.paths[0]).name, int(g.get("qwen35moe.block_count"))
    g.close()
    runs = []
    for cache in caches:
        for rep in range(repeats):
            for n in threads:
                (drop_cache if cache == "cold" else warm_cache)(paths)
                cached_kib = _meminfo("Cached")
                out = subprocess.run([sys.executable, "-m", "freetoken_patch.upstream.measure",
                                      "_fill", model, str(n)], capture_output=True, text=True,
                                     check=False)
                if out.returncode:
                    raise RuntimeError(f"fill ({n} threads) failed: {out.stderr[-2000:]}")
                rec = json.loads(out.stdout.strip().splitlines()[-1])
                runs.append(dict(rec, threads=n, cache=cache, repeat=rep,
                                 page_cache_kib_before=cached_kib))
    return {"kind": "fill_threads", "model": name, "layers": layers, "shards": len(paths),
            "file_bytes": sum(p.stat().st_size for p in paths), "machine": machine(),
            "method": "fresh process per run, thread counts alternated; cold: posix_fadvise "
                      "DONTNEED on every shard first; warm: every shard read through first; "
                      "the patched loader's jobs into lazy anonymous mappings, header parse "
                      "included; no FreeToken code runs", "runs": runs}


# -- the GGUF header: FreeToken 0.2.1's reader, the pull request's, our runtime patch's ------------
HEADER_READERS = ("freetoken", "pr", "patched")
HEADER_WARM_BYTES = 256 << 20   # far more than any header (a 248k-token vocabulary is ~6 MB)
# what each task runs, in a fresh process, after its imports (timed apart)
HEADER_TASKS = {
    "metadata": "load_gguf_metadata(model): every key and value of the header",
    "tensor_index": "gguf_tensor_index(model): the tensor table of every file of the model",
    "parse_args": "freetoken.server.args.parse_args(['--model', model]): `ft serve`'s first "
                  "process, before it spawns the others",
    "tokenizer": "load_tokenizer(model) and load_eos_token_ids(model, tok): what the "
                 "detokenizer process does before it reports ready",
    "scheduler": "cached_load_hf_config(model), gguf_tensor_index(model), load_tokenizer(model) "
                 "and load_eos_token_ids: the header reads of the engine process (it touches "
                 "the GPU between the config and the weights; that part is not run)",
}
SAMPLE_TEXT = "Hello, world! Grüße aus Köln. 1234567 + 89 = ?\n<|im_start|>user\n你好<|im_end|>"


def _digest(obj) -> str:
    """sha256 of a value's pickle (no memo: equal values give equal bytes whatever their identity)."""
    import hashlib
    import io
    import pickle
    f = io.BytesIO()
    p = pickle.Pickler(f, protocol=5)
    p.fast = True
    p.dump(obj)
    return hashlib.sha256(f.getvalue()).hexdigest()


def _header_once(model: str, reader: str, task: str, tree: str = "") -> dict:
    """In this (fresh) process: one task with one reader, timed; digests of what it produced."""
    t0 = time.perf_counter()
    if reader == "pr":
        sys.path.insert(0, tree)
    import freetoken.models.gguf.reader as ftreader
    if reader == "pr" and not ftreader.__file__.startswith(tree):
        raise RuntimeError(f"the PR tree {tree} did not shadow FreeToken ({ftreader.__file__})")
    if reader == "patched":
        from . import hooks
        hooks.apply()
    from freetoken.models.gguf.reader import gguf_tensor_index, load_gguf_metadata
    if task == "parse_args":
        from freetoken.server.args import parse_args
    if task in ("tokenizer", "scheduler"):
        from freetoken.utils import cached_load_hf_config, load_eos_token_ids, load_tokenizer
    imports = time.perf_counter() - t0
    out: dict = {}
    t0 = time.perf_counter()
    if task == "metadata":
        load_gguf_metadata(model)
    elif task == "tensor_index":
        gguf_tensor_index(model)
    elif task == "parse_args":
        server_args, _ = parse_args(["--model", model])
        out["model_path"] = server_args.model_path
    else:
        if task == "scheduler":
            cached_load_hf_config(model)
            gguf_tensor_index(model)
        tok = load_tokenizer(model)
        eos = load_eos_token_ids(model, tok)
    seconds = time.perf_counter() - t0
    # what came out, to compare across readers (not timed)
    out["metadata_sha256"] = _digest(load_gguf_metadata(model))
    out["tensor_index_sha256"] = _digest(sorted(
        (n, os.path.basename(i.path), i.offset, i.nbytes, i.ggml_type, i.ne)
        for n, i in gguf_tensor_index(model).items()))
    if task in ("tokenizer", "scheduler"):
        out["tokenizer_sha256"] = _digest((sorted(tok.get_vocab().items()), sorted(eos),
                                           tok.encode(SAMPLE_TEXT)))
    return {"seconds": seconds, "import_seconds": imports, **out}


def header(model: str, *, tasks=tuple(HEADER_TASKS), readers=("freetoken", "patched"),
           repeats: int = 3, cache: str = "warm", pr_tree: str | None = None) -> dict:
    """Every task with every reader, `repeats` times, readers alternated, each run a fresh
    process; the file read through first (warm) or dropped from the page cache (cold)."""
    from loaders.gguf_file import split_paths
    paths = split_paths(model)
    model = str(paths[0])
    tree = ""
    if "pr" in readers:
        if not pr_tree:
            raise ValueError("the pr reader needs pr_tree (BUILD/upstream of `pr-notes build`)")
        tree = str((Path(pr_tree) / "python").resolve())
    meta = _header_facts(model)     # first: a file that is not a GGUF is one line, no runs
    runs = []
    for task in tasks:
        for rep in range(repeats):
            for reader in readers:
                if cache == "cold":
                    drop_cache(paths)
                else:   # the header is what these read; the tensor data stays out of the way
                    warm_cache(paths, limit=HEADER_WARM_BYTES)
                out = subprocess.run([sys.executable, "-m", "freetoken_patch.upstream.measure",
                                      "_header", model, reader, task, tree],
                                     capture_output=True, text=True, check=False)
                if out.returncode:
                    from ..errors import CLIError
                    last = (out.stderr.strip().splitlines() or ["no output"])[-1]
                    raise CLIError(f"{task} with the {reader} reader failed: {last}")
                rec = json.loads(out.stdout.strip().splitlines()[-1])
                runs.append(dict(rec, task=task, reader=reader, repeat=rep))
    return {"kind": "header", "model": Path(model).name, "files": len(paths),
            "file_bytes": sum(p.stat().st_size for p in paths), **meta,
            "machine": machine(), "versions": _versions(), "cache": cache,
            "tasks": {t: HEADER_TASKS[t] for t in tasks},
            "method": "one fresh process per run; readers alternated within each repeat; the "
                      f"model's files {'dropped from' if cache == 'cold' else 'read through'} the "
                      "page cache before every run; imports timed apart from the task; digests "
                      "(sha256 of the pickled metadata dict and tensor index, and of the "
                      "tokenizer's vocabulary, stop ids and one encoded text) taken after the "
                      "timed part",
            "runs": runs}


def _header_facts(model: str) -> dict:
    """The counts that make a header slow to read, by our own parser."""
    from loaders import open_gguf
    with open_gguf(model) as g:
        md = g.metadata
        count = {k: len(md[k]) for k in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges",
                                          "tokenizer.ggml.scores", "tokenizer.ggml.token_type")
                 if k in md}
        data_start = min((t.offset for t in g.tensors.values() if t.shard == 0), default=g.file_size)
        return {"tensors": len(g.tensors), "keys": len(md), "arrays": count,
                "header_bytes": data_start, "architecture": md.get("general.architecture")}


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version
    out = {}
    for name in ("freetoken", "transformers", "tokenizers", "numpy", "torch"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def _main(argv: list[str]) -> None:
    if argv[0] == "_one":
        print(json.dumps(_load_once(argv[1], argv[2], int(argv[3]), argv[4])))
    elif argv[0] == "_fill":
        print(json.dumps(_fill_once(argv[1], int(argv[2]))))
    elif argv[0] == "_header":
        print(json.dumps(_header_once(argv[1], argv[2], argv[3], argv[4] if len(argv) > 4 else "")))


if __name__ == "__main__":
    _main(sys.argv[1:])
