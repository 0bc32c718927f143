"""upstream: the FreeToken integration (freetoken==0.2.1, the `ftpatch[freetoken]` extra).

Public names:
  apply, revert, applied, HOOKS    the runtime patch: module attributes of FreeToken pointed at
                                   ours (the lean GGUF header reader, parallel expert banks,
                                   any-shard/folder --model, spawn targets that re-apply in
                                   FreeToken's child processes)
  check, inspect, VERSION, PatchRefused   the install the patch is for (version, RECORD hashes)
  write_profile, convert_profile   routing profiles for FreeToken's --moe-cache-split profile:
Modules beside them: `header` (the GGUF header reader: the hook's, and PR 1's parser), `doctor`
(what is installed, applied here and in a spawned child, the header parse time of a model, and
what this machine cannot run), `prbuild` (pr_notes/<N> -> a `git am` patch series at FreeToken's
repository paths; `check` runs each PR's tests on 0.2.1 and on the patched tree), `measure`
(header reads, bank-load times, loader parity, as JSON) and `evidence` (that JSON rendered into
the PR text, with its CONTRIBUTING checklist).
Importing this package imports no FreeToken module; `apply` does.
"""
from .errors import PatchRefused
from .hooks import HOOKS, applied, apply, revert
from .profile import convert as convert_profile
from .profile import write_profile
from .target import VERSION, check, inspect

__all__ = ["apply", "revert", "applied", "HOOKS", "check", "inspect", "VERSION", "PatchRefused",
           "write_profile", "convert_profile"]
