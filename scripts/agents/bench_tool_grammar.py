"""What holding tool calls to their form costs a request: the grammar of one call of any of
Claude Code's tools (its recorded first request, tests/fixtures/claude_code), compiled against
a vocabulary, and the masks while a call is written.

For the template's XML call form (Qwen3.5's) and the Hermes-style JSON one: the grammar's size,
the time to compile it and compute the first mask (what a request with tools pays up front, and
again at each call it begins), then the mean and p90 mask time over the tokens of a
well-formed call of each tool walked through the grammar. Before all of it, the vocabulary's
index (built once per server, at start-up). Runs on a CPU.

  PYTHONPATH=. python scripts/agents/bench_tool_grammar.py [--vocab GGUF] [--reps 5]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--vocab", default=str(ROOT / "tests/fixtures/ggml-vocab-qwen35.gguf"))
    ap.add_argument("--request", default=str(ROOT / "tests/fixtures/claude_code/first_request.json"))
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    from freetoken_patch.server.structured import tool_call_grammar
    from loaders.tokenizer import Tokenizer
    from moe_offload import GrammarConstraint, grammar_tokenizer

    req = json.loads(Path(args.request).read_text())
    tools = [{"type": "function", "function": {"name": t["name"],
                                               "parameters": t.get("input_schema") or {}}}
             for t in req.get("body", req)["tools"]]
    tok = Tokenizer.from_gguf(args.vocab)
    t0 = time.perf_counter()
    grammar_tokenizer(tok)
    print(f"vocabulary: {len(tok):,} tokens, index built in {time.perf_counter() - t0:.2f} s; "
          f"{len(tools)} tools")
    for xml in (True, False):
        grammar = tool_call_grammar(tools, None, xml, after_open=True, tags=tok.markup_texts)
        compile_ms = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            GrammarConstraint(grammar, tok).allowed()
            compile_ms.append((time.perf_counter() - t0) * 1000)
        masks = []
        for t in tools:     # a minimal call: the required parameters, strings "x"
            f = t["function"]
            params = f["parameters"].get("properties") or {}
            need = [k for k in f["parameters"].get("required") or [] if k in params]
            if not all(params[k].get("type") == "string" for k in need):
                continue
            if xml:
                body = "".join(f"<parameter={k}>\nx\n</parameter>\n" for k in need)
                call = f"\n<function={f['name']}>\n{body}</function>\n</tool_call>"
            else:
                args_ = ", ".join(f'"{k}": "x"' for k in need)
                call = '\n{"name": ' + json.dumps(f["name"]) + ', "arguments": {' + args_ + \
                       "}}\n</tool_call>"
            c = GrammarConstraint(grammar, tok)
            for i in tok.encode(call, parse_special=True):
                t0 = time.perf_counter()
                c.allowed()
                masks.append((time.perf_counter() - t0) * 1e6)
                c.advance(i)
        masks.sort()
        print(f"{'XML' if xml else 'JSON'} form: grammar {len(grammar):,} characters; compile + "
              f"first mask {statistics.median(compile_ms):.1f} ms (median of {args.reps}); "
              f"masks over {len(masks)} tokens of calls: mean {statistics.mean(masks):.0f} us, "
              f"p90 {masks[int(0.9 * (len(masks) - 1))]:.0f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
