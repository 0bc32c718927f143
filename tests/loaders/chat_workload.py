"""A coding agent's request, for chat-template tests and measurements: 24 tools with JSON schemas
and a conversation of user turns, reasoning, tool calls and tool results, grown to a given size.
Deterministic (seeded); the text is shuffled sentences of the package's own corpus and code-like
lines."""
from __future__ import annotations

import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
QWEN35_STYLE = (HERE / "qwen35_style.jinja").read_text(encoding="utf-8")
_CORPUS = (HERE.parents[1] / "loaders" / "data" / "corpus.txt").read_text(encoding="utf-8")
_SENTENCES = [s.strip() + "." for s in _CORPUS.replace("\n", " ").split(".") if s.strip()]

_VERBS = ["read", "write", "list", "search", "run", "open", "fetch", "update", "delete", "check",
          "build", "format"]
_NOUNS = ["file", "directory", "tests", "issue", "page", "branch", "command", "symbol"]


def tools(n: int = 24, seed: int = 0) -> list[dict]:
    """`n` OpenAI-style function tools with nested parameter schemas."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        name = f"{_VERBS[i % len(_VERBS)]}_{_NOUNS[(i * 5 + 3) % len(_NOUNS)]}"
        props = {
            "path": {"type": "string", "description": "Where, relative to the workspace root."},
            "limit": {"type": "integer", "minimum": 1, "maximum": 1000,
                      "description": "At most this many results."},
            "recursive": {"type": "boolean", "description": "Look into subfolders too."},
            "options": {"type": "object", "description": "Less common settings.",
                        "properties": {"encoding": {"type": "string", "enum": ["utf-8", "latin-1"]},
                                       "timeout": {"type": "number"}}},
        }
        for k in range(rng.randint(0, 3)):
            props[f"extra_{k}"] = {"type": "string", "description": rng.choice(_SENTENCES)}
        out.append({"type": "function", "function": {
            "name": name + (f"_{i}" if i >= len(_VERBS) else ""),
            "description": " ".join(rng.sample(_SENTENCES, 2)),
            "parameters": {"type": "object", "properties": props, "required": ["path"]}}})
    return out


def _prose(rng: random.Random, words: int) -> str:
    out, n = [], 0
    while n < words:
        s = rng.choice(_SENTENCES)
        out.append(s)
        n += len(s.split())
    return " ".join(out)


def _code(rng: random.Random, lines: int) -> str:
    return "\n".join(f"{'    ' * rng.randint(0, 3)}{rng.choice(_VERBS)}_{rng.choice(_NOUNS)}"
                     f"(x={rng.randint(0, 999)}, y='{rng.choice(_NOUNS)}')  # {rng.choice(_VERBS)}"
                     for _ in range(lines))


def conversation(chars: int = 40_000, seed: int = 0) -> list[dict]:
    """A system prompt, then rounds of user question, assistant reasoning and tool call, tool
    result and answer, until the contents hold about `chars` characters (English and code
    tokenize at 3 to 4 characters a token: 40,000 make about 18K tokens with the tools)."""
    rng = random.Random(seed)
    msgs = [{"role": "system", "content": "You are a careful coding agent. " + _prose(rng, 120)}]
    total = len(msgs[0]["content"])
    tool_names = [t["function"]["name"] for t in tools()]
    while total < chars:
        q = {"role": "user", "content": _prose(rng, rng.randint(20, 80))}
        call = {"role": "assistant", "content": "", "reasoning_content": _prose(rng, 60),
                "tool_calls": [{"type": "function", "function": {
                    "name": rng.choice(tool_names),
                    "arguments": {"path": f"src/{rng.choice(_NOUNS)}.py", "limit": 50,
                                  "options": {"encoding": "utf-8"}}}}]}
        result = {"role": "tool", "content": _code(rng, rng.randint(10, 60))}
        answer = {"role": "assistant", "content": _prose(rng, rng.randint(40, 150))}
        for m in (q, call, result, answer):
            msgs.append(m)
            total += len(m["content"]) + len(m.get("reasoning_content", ""))
    msgs.append({"role": "user", "content": _prose(rng, 40)})
    return msgs
