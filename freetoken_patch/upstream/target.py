"""The FreeToken install the patch is for: its version, and the files the patch touches or relies
on, each held to the hash the wheel's RECORD gives it. Anything else is refused with one line."""
from __future__ import annotations

import base64
import hashlib
import importlib.metadata as md
from dataclasses import dataclass
from pathlib import Path

from .errors import PatchRefused

VERSION = "0.2.1"

# Files whose attributes the hooks rebind, or whose behaviour the replacements assume (every
# header read going through reader._reader, config's use of it, the function-local import of the
# bank loader, the bank and pin classes, the ggml type helpers, the profile reader, the argument
# parser, the spawn targets).
TOUCHED = (
    "freetoken/models/gguf/config.py",
    "freetoken/models/gguf/experts.py",
    "freetoken/models/gguf/reader.py",
    "freetoken/moe/expert_banks.py",
    "freetoken/moe/host_banks.py",
    "freetoken/moe/pool_policy.py",
    "freetoken/layers/quantization/ggml_types.py",
    "freetoken/server/args.py",
    "freetoken/server/launch.py",
)


@dataclass(frozen=True)
class FileCheck:
    path: str          # relative to site-packages, as RECORD names it
    expected: str      # sha256=... from RECORD
    actual: str | None  # None: missing

    @property
    def ok(self) -> bool:
        return self.actual == self.expected


@dataclass(frozen=True)
class Target:
    version: str
    root: Path                    # the folder holding freetoken/
    files: tuple[FileCheck, ...]


def file_hash(path: Path) -> str:
    """The RECORD form of a file's hash: sha256=<urlsafe base64, no padding>."""
    digest = hashlib.sha256(path.read_bytes()).digest()
    return "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def _distribution() -> md.Distribution:
    try:
        return md.distribution("freetoken")
    except md.PackageNotFoundError:
        raise PatchRefused("FreeToken is not installed; pip install 'ftpatch[freetoken]' "
                           f"(freetoken=={VERSION})") from None


def record_hashes(dist: md.Distribution) -> dict[str, str]:
    """RECORD's path -> hash for the files this patch cares about."""
    out = {}
    for f in dist.files or ():
        if str(f) in TOUCHED and f.hash is not None:
            out[str(f)] = f"{f.hash.mode}={f.hash.value}"
    return out


def inspect(dist: md.Distribution | None = None) -> Target:
    """What is installed (or what `dist` describes), without judging it (doctor prints this)."""
    dist = dist or _distribution()
    root = Path(dist.locate_file(""))
    expected = record_hashes(dist)
    files = []
    for rel in TOUCHED:
        p = root / rel
        files.append(FileCheck(rel, expected.get(rel, "(not in RECORD)"),
                               file_hash(p) if p.is_file() else None))
    return Target(dist.version, root, tuple(files))


def check(dist: md.Distribution | None = None) -> Target:
    """The install, if the patch may be applied to it; else PatchRefused with the reason."""
    t = inspect(dist)
    if t.version != VERSION:
        raise PatchRefused(f"FreeToken {t.version} is installed; this patch is for {VERSION} only "
                           f"(pip install freetoken=={VERSION})")
    bad = [f for f in t.files if not f.ok]
    if bad:
        f = bad[0]
        what = "is missing" if f.actual is None else "differs from the wheel's RECORD"
        raise PatchRefused(f"{t.root / f.path} {what}; the patch applies to an unmodified "
                           f"freetoken=={VERSION} only (reinstall it)")
    return t
