"""Which constrained-decoding library fits our tokenizer, and how fast each computes a mask.

For each of llguidance, xgrammar and outlines-core that imports, with our byte-level BPE tokenizer
(loaders.tokenizer; by default the real Qwen3.5 vocabulary of tests/fixtures): the time to build
its tokenizer index, to compile a grammar (a tool's JSON schema, any JSON object) and start a
matcher on it, and the time of one mask over the vocabulary at each step of generations that take a random allowed token each
step (seeded). Prints a table and, with --json, the figures.

  PYTHONPATH=. python scripts/agents/bench_constrained.py [--vocab GGUF] [--steps 200] [--runs 5]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

TOOL_SCHEMA = {
    "type": "object",
    "properties": {
        "path": {"type": "string"},
        "line": {"type": "integer", "minimum": 1},
        "mode": {"enum": ["read", "write", "append"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "options": {"type": "object", "properties": {"force": {"type": "boolean"},
                                                     "depth": {"type": "number"}},
                    "required": ["force"], "additionalProperties": False},
    },
    "required": ["path", "mode"],
    "additionalProperties": False,
}
ANY_OBJECT = {"type": "object"}


def token_bytes(tok) -> list[bytes]:
    return [tok.token_bytes(i) for i in range(len(tok))]


# -- the libraries: each -> (build the vocabulary index, compile a schema, a matcher's steps) --------

class Llguidance:
    name = "llguidance"

    def __init__(self, tok, n_vocab):
        import llguidance

        class Wrapper:      # what llguidance.LLTokenizer reads from a tokenizer
            eos_token_id = tok.eos_id
            bos_token_id = tok.bos_id
            tokens = token_bytes(tok)
            special_token_ids = sorted(tok._special_id.values())

            def __call__(self, s):
                return tok.encode(s if isinstance(s, str) else s.decode("utf-8", "surrogateescape"))
        self.ll = llguidance
        self.tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(Wrapper()), n_vocab=n_vocab,
                                          eos_token=sorted(tok.eog_ids))
        self.words = (n_vocab + 31) // 32

    def compile(self, schema):
        return self.ll.LLMatcher.grammar_from_json_schema(json.dumps(schema))

    def run(self, grammar, rng, steps, n_vocab):
        t = time.perf_counter()
        m = self.ll.LLMatcher(self.tok, grammar)
        times = [time.perf_counter() - t]
        assert not m.is_error(), m.get_error()
        mask = np.zeros(self.words, dtype=np.int32)
        for _ in range(steps):
            t = time.perf_counter()
            m.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
            times.append(time.perf_counter() - t)
            allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[:n_vocab])
            if m.is_stopped() or not len(allowed):
                break
            assert m.consume_token(int(rng.choice(allowed))), m.get_error()
        return times


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tok, n_vocab):
        import xgrammar
        self.xg = xgrammar
        info = xgrammar.TokenizerInfo(token_bytes(tok), xgrammar.VocabType.RAW,
                                      vocab_size=n_vocab, stop_token_ids=sorted(tok.eog_ids))
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1)

    def compile(self, schema):
        return self.compiler.compile_json_schema(json.dumps(schema))

    def run(self, grammar, rng, steps, n_vocab):
        import torch
        t = time.perf_counter()
        m = self.xg.GrammarMatcher(grammar)
        times = [time.perf_counter() - t]
        mask = self.xg.allocate_token_bitmask(1, n_vocab)
        for _ in range(steps):
            if m.is_terminated():
                break
            t = time.perf_counter()
            m.fill_next_token_bitmask(mask)
            times.append(time.perf_counter() - t)
            bits = mask[0].numpy().view(np.uint8)
            allowed = np.flatnonzero(np.unpackbits(bits, bitorder="little")[:n_vocab])
            if not len(allowed):
                break
            assert m.accept_token(int(rng.choice(allowed)))
        del torch
        return times


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tok, n_vocab):
        import outlines_core
        self.oc = outlines_core
        eog = sorted(tok.eog_ids)
        words: dict[bytes, list[int]] = {}
        for i, b in enumerate(token_bytes(tok)):
            if i not in eog and i not in tok._raw:
                words.setdefault(b, []).append(i)
        self.vocab = outlines_core.Vocabulary(eog[0], words)

    def compile(self, schema):
        from outlines_core.json_schema import build_regex_from_schema
        return self.oc.Index(build_regex_from_schema(json.dumps(schema)), self.vocab)

    def run(self, index, rng, steps, n_vocab):
        t = time.perf_counter()
        g = self.oc.Guide(index)
        times = [time.perf_counter() - t]
        mask = np.zeros((n_vocab + 31) // 32, dtype=np.int32)
        for _ in range(steps):
            t = time.perf_counter()
            g.write_mask_into(mask.ctypes.data, mask.size, mask.itemsize)
            times.append(time.perf_counter() - t)
            allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[:n_vocab])
            if g.is_finished() or not len(allowed):
                break
            g.advance(int(rng.choice(allowed)))
        return times


LIBRARIES = (Llguidance, Xgrammar, OutlinesCore)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", default="tests/fixtures/ggml-vocab-qwen35.gguf")
    ap.add_argument("--steps", type=int, default=200, help="tokens a generation at most")
    ap.add_argument("--runs", type=int, default=5, help="generations per schema and library")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    from loaders.tokenizer import Tokenizer
    tok = Tokenizer.from_gguf(args.vocab)
    n_vocab = len(tok)
    out = []
    for lib in LIBRARIES:
        row = {"library": lib.name}
        try:
            t = time.perf_counter()
            impl = lib(tok, n_vocab)
            row["index_s"] = time.perf_counter() - t
        except Exception as e:   # noqa: BLE001 -- absent or refusing our vocabulary: say which
            row["error"] = f"{type(e).__name__}: {e}"[:200]
            out.append(row)
            continue
        for label, schema in (("tool", TOOL_SCHEMA), ("object", ANY_OBJECT)):
            try:
                t = time.perf_counter()
                g = impl.compile(schema)
                row[f"{label}_compile_ms"] = 1e3 * (time.perf_counter() - t)
                times, starts = [], []
                for r in range(args.runs):
                    start, *steps = impl.run(g, np.random.default_rng(r), args.steps, n_vocab)
                    starts.append(start)
                    times += steps
                row[f"{label}_matcher_ms"] = 1e3 * statistics.median(starts)
                row[f"{label}_mask_us_median"] = 1e6 * statistics.median(times)
                row[f"{label}_mask_us_p90"] = 1e6 * float(np.percentile(times, 90))
                row[f"{label}_steps"] = len(times)
            except Exception as e:   # noqa: BLE001
                row[f"{label}_error"] = f"{type(e).__name__}: {e}"[:200]
        out.append(row)
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"vocabulary {args.vocab}: {n_vocab} tokens; {args.runs} generations x <= {args.steps} "
          "steps, a random allowed token each step")
    for row in out:
        if "error" in row:
            print(f"{row['library']:14} unavailable: {row['error']}")
            continue
        cells = [f"index {row['index_s']:.2f} s"]
        for label in ("tool", "object"):
            if f"{label}_error" in row:
                cells.append(f"{label}: {row[f'{label}_error']}")
            else:
                cells.append(f"{label}: compile {row[f'{label}_compile_ms']:.1f} ms, matcher "
                             f"{row[f'{label}_matcher_ms']:.1f} ms, mask "
                             f"median {row[f'{label}_mask_us_median']:.0f} us, p90 "
                             f"{row[f'{label}_mask_us_p90']:.0f} us ({row[f'{label}_steps']} steps)")
        print(f"{row['library']:14} " + " | ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
