"""upstream: the FreeToken integration (freetoken==0.2.1, the `ftpatch[freetoken]` extra).

Public names:
  apply, revert, applied, HOOKS    the runtime patch: module attributes of FreeToken pointed at
                                   ours (parallel expert banks, any-shard/folder --model, spawn
                                   targets that re-apply in FreeToken's child processes)
  check, inspect, VERSION, PatchRefused   the install the patch is for (version, RECORD hashes)
  write_profile, convert_profile   routing profiles for FreeToken's --moe-cache-split profile:
Modules beside them: `doctor` (what is installed, applied here and in a spawned child, and
what this machine cannot run), `prbuild` (pr_notes/<N> -> FreeToken's patched tree and a diff;
`check` runs each PR's tests before and after), `measure` (bank-load times, loader parity, as
JSON) and `evidence` (that JSON rendered into the PR text).
Importing this package imports no FreeToken module; `apply` does.
"""
from .errors import PatchRefused
from .hooks import HOOKS, applied, apply, revert
from .profile import convert as convert_profile
from .profile import write_profile
from .target import VERSION, check, inspect

__all__ = ["apply", "revert", "applied", "HOOKS", "check", "inspect", "VERSION", "PatchRefused",
           "write_profile", "convert_profile"]
