"""The GGUF mutation fuzzer behind test_fuzz.py: small base files, mutators, the oracle, a worker.

A mutant is a function of (seed, index) alone, so any one can be rebuilt. The oracle does what
`ftpatch inspect` and a chat's start do with a file -- open_model (or open_gguf for a
vocabulary-only file), the tokenizer, the chat template -- and classifies the result: "ok",
"refused" (a GGUFError) or anything else, which is a bug.

Run as a script it is the worker: it fuzzes in its own process under an address-space cap and a
per-mutant alarm, writing each mutant's index to a progress file before trying it (so a hang
the alarm cannot break is still pinned to its mutant by the parent), failures as JSON lines on
stdout and the failing files into --out.
"""
from __future__ import annotations

import base64
import gzip
import json
import os
import signal
import struct
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
MUTANT_SECONDS = 10          # one mutant: open + tokenizer + template, far above the ~10 ms used
MEMORY_BYTES = 1 << 30       # address space a mutant may add to the worker's own

_FMT = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_SUB_OF_DTYPE = {np.dtype(np.uint8): 0, np.dtype(np.int8): 1, np.dtype(np.uint16): 2,
                 np.dtype(np.int16): 3, np.dtype(np.uint32): 4, np.dtype(np.int32): 5,
                 np.dtype(np.float32): 6, np.dtype(np.bool_): 7, np.dtype(np.uint64): 10,
                 np.dtype(np.int64): 11, np.dtype(np.float64): 12}
INTERESTING = [0, 1, 2, 3, 4, 7, 8, 31, 32, 33, 255, 256, 4095, 65535, 65536, 2**31 - 1, 2**31,
               2**32 - 1, 2**32, 2**53, 2**62, 2**63 - 1, 2**63, 2**64 - 1]
SAMPLE_TEXT = "Hello <|im_start|>wörld\x00\x1b[0m 日本 <think>\ud800</think>"
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi\x00"}]


# -- the structure of a file, enough to rebuild it ---------------------------------------------

@dataclass
class Parsed:
    version: int
    kv: list          # [key, vtype, value]; arrays: value = (subtype, list)
    tensors: list     # [name, ne (list), type_id, offset]
    alignment: int
    data: bytes       # everything from the first tensor byte on


def parse(buf: bytes) -> Parsed:
    """A trusting reader for our own base files (the fuzzer's, not the loader's)."""
    pos = 4
    version, n_t, n_kv = struct.unpack_from("<IQQ", buf, pos)
    pos += 20

    def string() -> str:
        nonlocal pos
        (n,) = struct.unpack_from("<Q", buf, pos)
        s = buf[pos + 8:pos + 8 + n].decode("utf-8", "surrogateescape")
        pos += 8 + n
        return s

    def value(vt: int) -> Any:
        nonlocal pos
        if vt == 8:
            return string()
        if vt == 9:
            (sub,) = struct.unpack_from("<I", buf, pos)
            (n,) = struct.unpack_from("<Q", buf, pos + 4)
            pos += 12
            return (sub, [value(sub) for _ in range(n)])
        (v,) = struct.unpack_from("<" + _FMT[vt], buf, pos)
        pos += struct.calcsize(_FMT[vt])
        return v

    kv = []
    for _ in range(n_kv):
        key = string()
        (vt,) = struct.unpack_from("<I", buf, pos)
        pos += 4
        kv.append([key, vt, value(vt)])
    alignment = next((v for k, t, v in kv if k == "general.alignment"), 32)
    tensors = []
    for _ in range(n_t):
        name = string()
        (nd,) = struct.unpack_from("<I", buf, pos)
        ne = list(struct.unpack_from(f"<{nd}Q", buf, pos + 4))
        pos += 4 + 8 * nd
        tid, off = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        tensors.append([name, ne, tid, off])
    start = -(-pos // alignment) * alignment
    return Parsed(version, kv, tensors, alignment, buf[start:])


def _enc_str(s: Any) -> bytes:
    b = s if isinstance(s, bytes) else str(s).encode("utf-8", "surrogateescape")
    return struct.pack("<Q", len(b)) + b


def _enc_value(vt: int, v: Any) -> bytes:
    if vt == 8:
        return _enc_str(v)
    if vt == 9:
        sub, items = v
        return struct.pack("<IQ", sub, len(items)) + b"".join(_enc_value(sub, x) for x in items)
    fmt = _FMT.get(vt)
    if fmt is None:        # an unknown type id: a few raw bytes after it
        return bytes(v) if isinstance(v, (bytes, bytearray)) else b"\0" * 4
    try:
        return struct.pack("<" + fmt, v)
    except (struct.error, TypeError, OverflowError):
        return struct.pack("<" + fmt, 0)


def encode(p: Parsed) -> bytes:
    out = [b"GGUF", struct.pack("<IQQ", p.version, len(p.tensors), len(p.kv))]
    for key, vt, v in p.kv:
        out += [_enc_str(key), struct.pack("<I", vt & 0xFFFFFFFF), _enc_value(vt, v)]
    for name, ne, tid, off in p.tensors:
        out += [_enc_str(name), struct.pack("<I", len(ne)),
                b"".join(struct.pack("<Q", n & (2**64 - 1)) for n in ne),
                struct.pack("<IQ", tid & 0xFFFFFFFF, off & (2**64 - 1))]
    head = b"".join(out)
    align = p.alignment if isinstance(p.alignment, int) and 0 < p.alignment <= 4096 else 32
    return head + b"\0" * (-len(head) % align) + p.data


def fields(buf: bytes) -> list[tuple[int, int]]:
    """(offset, size) of every length, count, type and number in a base file's header: where a
    structure-aware byte mutation aims."""
    out: list[tuple[int, int]] = [(8, 8), (16, 8), (4, 4)]
    pos = 24

    def string() -> None:
        nonlocal pos
        out.append((pos, 8))
        (n,) = struct.unpack_from("<Q", buf, pos)
        pos += 8 + n

    def value(vt: int) -> None:
        nonlocal pos
        if vt == 8:
            string()
        elif vt == 9:
            (sub,) = struct.unpack_from("<I", buf, pos)
            (n,) = struct.unpack_from("<Q", buf, pos + 4)
            out.extend([(pos, 4), (pos + 4, 8)])
            pos += 12
            for i in range(n):
                if i < 4 or i == n - 1:
                    value(sub)
                elif sub == 8:
                    (m,) = struct.unpack_from("<Q", buf, pos)
                    pos += 8 + m
                else:
                    pos += struct.calcsize(_FMT[sub])
        else:
            size = struct.calcsize(_FMT[vt])
            out.append((pos, size))
            pos += size

    n_t, n_kv = struct.unpack_from("<QQ", buf, 8)
    for _ in range(n_kv):
        string()
        (vt,) = struct.unpack_from("<I", buf, pos)
        out.append((pos, 4))
        pos += 4
        value(vt)
    for _ in range(n_t):
        string()
        (nd,) = struct.unpack_from("<I", buf, pos)
        out.append((pos, 4))
        out.extend((pos + 4 + 8 * i, 8) for i in range(nd))
        pos += 4 + 8 * nd
        out.extend([(pos, 4), (pos + 4, 8)])
        pos += 12
    return out


# -- mutators ------------------------------------------------------------------------------------

@dataclass
class Base:
    name: str         # "model" | "vocab"
    raw: bytes
    parsed: Parsed
    fields: list
    header_len: int


def load_base(name: str, path: str | Path) -> Base:
    raw = Path(path).read_bytes()
    p = parse(raw)
    return Base(name, raw, p, fields(raw), len(raw) - len(p.data))


def _interesting(rng: np.random.Generator) -> int:
    v = int(rng.choice(INTERESTING))
    return v + int(rng.integers(-2, 3)) if rng.random() < 0.3 else v


def _random_value(rng: np.random.Generator, like: Any = None) -> tuple[int, Any]:
    """A (vtype, value) of a random kind: the types a reader must refuse where it wants others."""
    k = int(rng.integers(0, 12))
    if k == 0:
        return 4, _interesting(rng) & 0xFFFFFFFF
    if k == 1:
        return 5, int(rng.choice([0, -1, -2**31, 2**31 - 1]))
    if k == 2:
        return 10, _interesting(rng) & (2**64 - 1)
    if k == 3:
        return 8, str(rng.choice(["", "x", "12", "qwen35moe", "gpt2", "\x00", "é" * 3]))
    if k == 4:
        return 7, bool(rng.integers(0, 2))
    if k == 5:
        return 6, float(rng.choice([0.0, -1.0, float("nan"), float("inf"), 1e-6, 3.5e38]))
    if k == 6:
        return 12, float(rng.choice([0.0, float("nan"), -float("inf"), 1e300]))
    if k == 7:
        n = int(rng.choice([0, 1, 3, 4, 5, 41]))
        sub = int(rng.choice([4, 5, 7, 0, 11]))
        return 9, (sub, [int(rng.integers(0, 3)) if sub != 7 else bool(rng.integers(0, 2))
                         for _ in range(n)])
    if k == 8:
        return 9, (8, [str(i) for i in range(int(rng.integers(0, 5)))])
    if k == 9:
        return 9, (9, [(4, [1, 2])] * int(rng.integers(0, 3)))
    if k == 10:
        return 0, int(rng.integers(0, 256))
    return int(rng.integers(13, 40)), b""   # an unknown value type


def _mutate_kv(rng: np.random.Generator, p: Parsed) -> None:
    i = int(rng.integers(0, len(p.kv)))
    key, vt, v = p.kv[i]
    op = int(rng.integers(0, 9))
    if op == 0:
        del p.kv[i]
    elif op == 1:
        p.kv.append(list(p.kv[i]))            # duplicate key
    elif op == 2 and vt in (4, 5, 10, 11):
        p.kv[i][2] = _interesting(rng) & ((1 << (8 * struct.calcsize(_FMT[vt]))) - 1)
        if vt in (5, 11) and rng.random() < 0.5:
            p.kv[i][2] = -int(rng.integers(1, 3))
    elif op == 3 and vt == 9:
        sub, items = v
        items = list(items)
        cut = int(rng.integers(0, len(items) + 1))
        p.kv[i][2] = (sub, items[:cut] if rng.random() < 0.5 else items + items[:cut])
    elif op == 4 and vt == 9:
        sub, items = v
        new_sub = int(rng.choice([0, 4, 5, 6, 7, 8, 10, 12]))
        conv = {8: str, 6: float, 12: float, 7: bool}.get(new_sub, lambda x: 1)
        try:
            p.kv[i][2] = (new_sub, [conv(x) for x in items])
        except (TypeError, ValueError):
            p.kv[i][2] = (new_sub, [])
    elif op == 5:
        p.kv[i][0] = key[: int(rng.integers(0, len(key) + 1))]   # a renamed (or emptied) key
    else:
        p.kv[i][1], p.kv[i][2] = _random_value(rng, v)


def _mutate_tensor(rng: np.random.Generator, p: Parsed) -> None:
    if not p.tensors:
        return
    i = int(rng.integers(0, len(p.tensors)))
    t = p.tensors[i]
    op = int(rng.integers(0, 8))
    if op == 0 and t[1]:
        t[1][int(rng.integers(0, len(t[1])))] = _interesting(rng)
    elif op == 1:
        t[1] = [_interesting(rng) for _ in range(int(rng.integers(0, 10)))]
    elif op == 2:
        t[2] = int(rng.choice([0, 1, 2, 8, 12, 21, 30, 31, 39, 40, 41, 255, 2**32 - 1]))
    elif op == 3:
        t[3] = int(rng.choice([t[3] + 1, t[3] + 32, 2**64 - 32, 2**63, 0, len(p.data)]))
    elif op == 4:
        del p.tensors[i]
    elif op == 5:
        p.tensors.append([t[0], list(t[1]), t[2], t[3]])
    elif op == 6:
        t[1] = list(reversed(t[1]))
    else:
        t[0] = str(rng.choice(["", "token_embd.weight", "output.weight", "blk.999.x",
                               "blk.0.ffn_gate_exps.weight", t[0] + "x"]))


def _byte_mutation(rng: np.random.Generator, buf: bytearray, base: Base) -> bytearray:
    hl = min(base.header_len, len(buf))
    op = int(rng.integers(0, 6))
    if op <= 1 and base.fields:                  # a field set to an interesting value
        off, size = base.fields[int(rng.integers(0, len(base.fields)))]
        if off + size <= len(buf):
            buf[off:off + size] = (_interesting(rng) & ((1 << (8 * size)) - 1)).to_bytes(size, "little")
    elif op == 2 and hl:                         # bit flips
        for _ in range(int(rng.integers(1, 9))):
            j = int(rng.integers(0, hl))
            buf[j] ^= 1 << int(rng.integers(0, 8))
    elif op == 3 and hl:                         # random bytes
        j = int(rng.integers(0, hl))
        n = int(rng.integers(1, 17))
        buf[j:j + n] = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
    elif op == 4:                                # truncation
        cut = int(rng.integers(0, hl + 1)) if rng.random() < 0.8 else int(rng.integers(0, len(buf) + 1))
        del buf[cut:]
    elif hl:                                     # a chunk copied elsewhere (inserted)
        a = int(rng.integers(0, hl))
        n = int(rng.integers(1, 64))
        b = int(rng.integers(0, hl))
        buf[b:b] = buf[a:a + n]
    return buf


def mutant(seed: int, index: int, bases: list[Base]) -> tuple[Base, bytes]:
    """Mutant `index` of run `seed`: one to three structural edits and/or byte edits."""
    rng = np.random.default_rng([seed, index])
    base = bases[int(rng.integers(0, len(bases)))]
    if rng.random() < 0.6:
        p = Parsed(base.parsed.version, [list(x) for x in base.parsed.kv],
                   [[n, list(ne), t, o] for n, ne, t, o in base.parsed.tensors],
                   base.parsed.alignment, base.parsed.data)
        for _ in range(int(rng.integers(1, 4))):
            if rng.random() < 0.65 or not p.tensors:
                _mutate_kv(rng, p)
            else:
                _mutate_tensor(rng, p)
        if rng.random() < 0.05:
            p.version = int(rng.choice([1, 2, 4, 2**16 + 3]))
        buf = bytearray(encode(p))
    else:
        buf = bytearray(base.raw)
    if rng.random() < 0.5 or bytes(buf) == base.raw:
        for _ in range(int(rng.integers(1, 3))):
            buf = _byte_mutation(rng, buf, base)
    return base, bytes(buf)


# -- regression files: the mutant as its changed prefix + the base's unchanged tail --------------

def to_regression(base: Base, data: bytes, info: dict) -> dict:
    n = 0
    limit = min(len(data), len(base.raw))
    while n < limit and data[len(data) - 1 - n] == base.raw[len(base.raw) - 1 - n]:
        n += 1
    prefix = data[:len(data) - n]
    return dict(info, base=base.name, tail_from=len(base.raw) - n,
                prefix=base64.b64encode(gzip.compress(prefix, mtime=0)).decode())


def from_regression(reg: dict, bases: dict[str, Base]) -> bytes:
    base = bases[reg["base"]]
    return gzip.decompress(base64.b64decode(reg["prefix"])) + base.raw[reg["tail_from"]:]


# -- base files ----------------------------------------------------------------------------------

def _kv(md: dict) -> list:
    out = []
    for key, v in md.items():
        if isinstance(v, str):
            out.append((key, 8, v))
        elif isinstance(v, bool):
            out.append((key, 7, v))
        elif isinstance(v, int):
            out.append((key, 4, v))
        elif isinstance(v, np.ndarray):
            out.append((key, 9, (_SUB_OF_DTYPE[v.dtype], v.tolist())))
        else:
            out.append((key, 9, (8, list(v))))
    return out


def write_vocab_gguf(path: Path, n_merges: int = 40) -> Path:
    """A vocabulary-only GGUF (as llama.cpp's ggml-vocab-*.gguf files are)."""
    from loaders.vocab import builtin_vocab, vocab_metadata
    md = {"general.architecture": "qwen35moe", **vocab_metadata(builtin_vocab(n_merges))}
    kv = _kv(md)
    head = b"GGUF" + np.array([3], "<u4").tobytes() + np.array([0, len(kv)], "<u8").tobytes()
    head += b"".join(_enc_str(k) + np.array([t], "<u4").tobytes() + _enc_value(t, v)
                     for k, t, v in kv)
    path.write_bytes(head + b"\0" * (-len(head) % 32))
    return path


def make_bases(d: Path) -> dict[str, Path]:
    """A small qwen35moe model (every tensor kind, 4 layers, 40-merge vocabulary, ~330 KB) and
    a vocabulary-only file, in folder d. Both are deterministic, so regression files stay
    meaningful."""
    from loaders import synth
    vocab = write_vocab_gguf(d / "vocab.gguf")
    synth.PRESETS["fuzz"] = synth.Preset(
        n_layer=4, n_embd=64, n_vocab=None, n_expert=4, n_expert_used=2, n_ff_exp=32,
        n_ff_shexp=32, n_head=2, n_head_kv=1, head_dim=32, n_rot=16, rope_sections=(4, 2, 2, 0),
        ssm_d_inner=64, ssm_d_state=16, ssm_n_v_heads=4, ssm_n_k_heads=2, n_ctx_train=256)
    try:
        model = synth.synthesize(d / "model.gguf", synth.SynthOptions(
            preset="fuzz", type="Q8_0", embed_type="Q8_0", vocab=str(vocab), mtp=True),
            threads=1)[0]
    finally:
        del synth.PRESETS["fuzz"]
    return {"model": model, "vocab": vocab}


# -- the oracle ----------------------------------------------------------------------------------

_templates: dict[Any, Any] = {}


def check(path: Path, kind: str) -> str:
    """What inspect and a chat's start do with the file: "ok" or "refused" (GGUFError); any
    other exception propagates (a bug)."""
    from loaders import ChatTemplate, GGUFError, Tokenizer, open_gguf, open_model
    try:
        from loaders.chat_template import TemplateLimits
        limits = {"limits": TemplateLimits(seconds=1.0)}
    except ImportError:   # fuzzing a loaders tree from before the limits
        limits = {}
    try:
        if kind == "model":
            m = open_model(path, strict=False)
            md = m.metadata
            sum(w.n_elements + w.data.shape[0] for w in m.weights.values())
        else:
            md = open_gguf(path).metadata
        if "tokenizer.ggml.tokens" in md:
            tok = Tokenizer.from_metadata(md, str(path))
            tok.decode(tok.encode(SAMPLE_TEXT, parse_special=True))
            tok.encode(b"\xff\xfe\x00 bytes")
            tok.eog_ids, tok.bos_token, tok.eos_token
        src = md.get("tokenizer.chat_template")
        key = src if isinstance(src, (str, type(None))) else repr(src)
        if key not in _templates:
            if len(_templates) > 64:
                _templates.clear()
            try:
                _templates[key] = ChatTemplate(src, **limits)
            except GGUFError as e:
                _templates[key] = e
        tpl = _templates[key]
        if isinstance(tpl, GGUFError):
            raise tpl
        tpl.render(MESSAGES)
    except GGUFError as e:
        msg = str(e)
        if "\n" in msg or not msg:
            raise AssertionError(f"GGUFError message is not one line: {msg!r:.300}") from e
        return "refused"
    return "ok"


# -- the worker ----------------------------------------------------------------------------------

class Hang(BaseException):
    """The per-mutant alarm fired (BaseException: no `except Exception` in the code swallows it)."""


def _on_alarm(signum: int, frame: Any) -> None:
    raise Hang()


def _cap_memory() -> None:
    import resource
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (vm + MEMORY_BYTES, vm + MEMORY_BYTES))


def worker(args: list[str]) -> None:
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", action="append", default=[])     # name=path
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--seconds", type=float, default=0)
    ap.add_argument("--mutants", type=int, default=0)
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--progress", type=Path, required=True)
    a = ap.parse_args(args)
    sys.path.append(str(ROOT))     # after PYTHONPATH: a loaders tree named there is fuzzed
    # imported before the cap (loaders imports its modules on first use)
    from loaders import GGUFError, Tokenizer, open_gguf, open_model  # noqa: F401
    from loaders.chat_template import ChatTemplate
    ChatTemplate(None).render(MESSAGES)
    bases = [load_base(*b.split("=", 1)) for b in a.base]
    bases = [bases[0]] * 3 + bases[1:]      # the model file gets three mutants in four
    _cap_memory()
    signal.signal(signal.SIGALRM, _on_alarm)
    path = a.out / "mutant.gguf"
    progress = os.open(a.progress, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    t0 = time.monotonic()
    counts = {"ok": 0, "refused": 0, "failed": 0}
    i = a.start
    while True:
        if a.mutants and i - a.start >= a.mutants:
            break
        if a.seconds and time.monotonic() - t0 > a.seconds:
            break
        os.write(progress, f"{i}\n".encode())
        base, data = mutant(a.seed, i, bases)
        path.write_bytes(data)
        signal.setitimer(signal.ITIMER_REAL, MUTANT_SECONDS)
        try:
            counts[check(path, base.name)] += 1
        except BaseException as e:   # noqa: B036 -- every escape is the finding
            signal.setitimer(signal.ITIMER_REAL, 0)
            counts["failed"] += 1
            what = "hang" if isinstance(e, Hang) else type(e).__name__
            tb = traceback.extract_tb(e.__traceback__)[-3:]
            where = "; ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in tb)
            (a.out / f"fail-{i}.gguf").write_bytes(data)
            print(json.dumps({"fail": {"seed": a.seed, "index": i, "base": base.name,
                                       "error": f"{what}: {str(e)[:300]}", "where": where}}),
                  flush=True)
            if isinstance(e, KeyboardInterrupt):
                raise
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        i += 1
    print(json.dumps({"summary": dict(counts, mutants=i - a.start,
                                      seconds=round(time.monotonic() - t0, 1))}), flush=True)


if __name__ == "__main__":
    worker(sys.argv[1:])
