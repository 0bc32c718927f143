"""Spawn targets for FreeToken's server. `ft serve` starts its engine and tokenizer processes with
multiprocessing's spawn method, which pickles a target by its module and name; with these in
place of FreeToken's, the child imports this module, applies the patch (the parent's environment
says so), then runs FreeToken's own target."""
from __future__ import annotations

from . import hooks

LAUNCH = "freetoken.server.launch"


def run_scheduler(*args, **kwargs):
    hooks.apply_if_requested()
    return hooks.original(LAUNCH, "_run_scheduler")(*args, **kwargs)


def run_tokenize_worker(*args, **kwargs):
    hooks.apply_if_requested()
    return hooks.original(LAUNCH, "_run_tokenize_worker")(*args, **kwargs)


def report_hooks(queue) -> None:
    """A spawn target for doctor: apply as a child would, and send back what is applied."""
    hooks.apply_if_requested()
    queue.put(hooks.applied())
