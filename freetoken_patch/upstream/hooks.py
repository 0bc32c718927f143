"""The hooks: module attributes of FreeToken that it looks up at call time, each pointed at a
replacement of ours. `apply()` checks the install first (version, RECORD hashes), is idempotent,
and marks the environment so that processes FreeToken spawns apply it too; `revert()` puts every
original back. FreeToken's originals are kept here, the one place the patch holds state."""
from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Callable

from . import target

ENV = "FTPATCH_FREETOKEN_PATCH"   # "1" in the environment: spawned children apply the patch


@dataclass(frozen=True)
class Hook:
    name: str           # what doctor calls it
    module: str         # FreeToken module whose attribute is rebound
    attr: str
    replacement: str    # "module:attr" of ours (resolved lazily: our modules import FreeToken)
    what: str           # one line for doctor

    def ours(self) -> Callable:
        mod, attr = self.replacement.split(":")
        return getattr(importlib.import_module(mod), attr)


HOOKS = (
    Hook("lean-gguf-header", "freetoken.models.gguf.reader", "_reader",
         "freetoken_patch.upstream.header:reader",
         "GGUF headers read without gguf-py's per-value views (the same metadata, without the "
         "tens of seconds gguf-py takes on a large vocabulary)"),
    Hook("parallel-banks", "freetoken.models.gguf.experts", "load_gguf_expert_banks",
         "freetoken_patch.upstream.banks:load_gguf_expert_banks",
         "GGUF expert banks filled by parallel threads (byte-identical to the serial loader)"),
    Hook("any-shard-model", "freetoken.server.args", "parse_args",
         "freetoken_patch.upstream.paths:parse_args",
         "--model accepts any shard of a split GGUF set, or a folder holding one model"),
    Hook("spawn-scheduler", "freetoken.server.launch", "_run_scheduler",
         "freetoken_patch.upstream.spawn:run_scheduler",
         "the engine process (spawned) applies the patch before it loads"),
    Hook("spawn-tokenizer", "freetoken.server.launch", "_run_tokenize_worker",
         "freetoken_patch.upstream.spawn:run_tokenize_worker",
         "the tokenizer processes (spawned) apply the patch before they start"),
)


def hook(name: str) -> Hook:
    return next(h for h in HOOKS if h.name == name)


_originals: dict[tuple[str, str], Callable] = {}


def original(module: str, attr: str) -> Callable:
    """FreeToken's own function behind a hook (the live attribute when the hook is not applied)."""
    got = _originals.get((module, attr))
    return got if got is not None else getattr(importlib.import_module(module), attr)


def is_applied(hook: Hook) -> bool:
    mod = importlib.import_module(hook.module)
    return getattr(mod, hook.attr) is hook.ours()


def applied() -> dict[str, bool]:
    return {h.name: is_applied(h) for h in HOOKS}


def apply() -> target.Target:
    """Apply every hook in this process (again: a no-op) and in the processes it spawns."""
    t = target.check()
    for h in HOOKS:
        mod = importlib.import_module(h.module)
        ours = h.ours()
        current = getattr(mod, h.attr)
        if current is ours:
            continue
        _originals.setdefault((h.module, h.attr), current)
        setattr(mod, h.attr, ours)
    os.environ[ENV] = "1"
    return t


def revert() -> None:
    """Put FreeToken's functions back; children spawned from now on run unpatched."""
    for (module, attr), fn in _originals.items():
        setattr(importlib.import_module(module), attr, fn)
    _originals.clear()
    os.environ.pop(ENV, None)


def apply_if_requested() -> None:
    """In a spawned child: apply when the parent asked for it (the environment carries it)."""
    if os.environ.get(ENV) == "1":
        apply()
