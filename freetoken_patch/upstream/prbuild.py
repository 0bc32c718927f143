"""`ftpatch pr-notes build N`: turn `pr_notes/<N>-<slug>/` into FreeToken's patched tree and a
unified diff against its unpacked 0.2.1 sources.

A PR folder holds:
  pr.toml        title (a conventional-commit line), branch, and `[[insert]]` edits: `text`
                 placed before or after one line of a FreeToken file that must occur exactly once
  change/        files at their FreeToken paths. For a file FreeToken has, the fragment's
                 top-level functions, classes and assignments replace FreeToken's of the same
                 name, new ones go before `__all__` (or at the end), and its imports not yet
                 present join FreeToken's first import group. A file FreeToken lacks (tests) is added whole.
  PR.md          the pull-request text; `{{evidence:NAME}}` is replaced by the rendering of
                 `evidence/NAME.json`, written by our tools (see `evidence.py`)
Nothing of FreeToken is stored here: the builder reads it from the --freetoken folder.
"""
from __future__ import annotations

import ast
import difflib
import os
import re
import shutil
import tomllib
from dataclasses import dataclass
from pathlib import Path

from ..errors import CLIError

NOTES_ENV = "FTPATCH_PR_NOTES"


def notes_root() -> Path:
    """pr_notes/: $FTPATCH_PR_NOTES, else the source checkout's (beside this package), else
    ./pr_notes. An installed wheel ships no pr_notes/: run from the repository root."""
    for cand in (os.environ.get(NOTES_ENV), Path(__file__).resolve().parents[2] / "pr_notes",
                 Path.cwd() / "pr_notes"):
        if cand and Path(cand).is_dir():
            return Path(cand)
    raise CLIError("no pr_notes/ folder found: run from the repository root or set "
                   f"{NOTES_ENV}")
EVIDENCE_RE = re.compile(r"\{\{evidence:([\w.-]+)\}\}")


@dataclass(frozen=True)
class PR:
    number: int
    folder: Path
    title: str
    inserts: tuple[dict, ...]

    @property
    def change(self) -> Path:
        return self.folder / "change"


def find_pr(number: int, root: Path | None = None) -> PR:
    root = root or notes_root()
    hits = [p for p in sorted(root.iterdir()) if p.is_dir() and p.name.split("-")[0] == f"{number}"]
    if not hits:
        have = ", ".join(p.name for p in sorted(root.iterdir()) if (p / "pr.toml").is_file())
        raise CLIError(f"no pull request {number} in {root} (have: {have or 'none'})")
    folder = hits[0]
    meta = tomllib.loads((folder / "pr.toml").read_text())
    return PR(number, folder, meta["title"], tuple(meta.get("insert", ())))


def list_prs(root: Path | None = None) -> list[PR]:
    root = root or notes_root()
    return [find_pr(int(p.name.split("-")[0]), root) for p in sorted(root.iterdir())
            if (p / "pr.toml").is_file()]


# -- merging a fragment into a FreeToken module -----------------------------------------------------
def _named_nodes(tree: ast.Module) -> dict[str, ast.stmt]:
    """Top-level functions, classes and single-name assignments (not `__all__`), by name."""
    out = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out[node.name] = node
        elif isinstance(node, ast.Assign) and len(node.targets) == 1 and \
                isinstance(node.targets[0], ast.Name) and node.targets[0].id != "__all__":
            out[node.targets[0].id] = node
    return out


def _span(node: ast.stmt) -> tuple[int, int]:
    """0-based [start, end) lines of a top-level node, decorators included."""
    start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])]) - 1
    return start, node.end_lineno


def _source(lines: list[str], node: ast.stmt, comments: bool = False) -> str:
    """A node's lines; with `comments`, the comment lines right above it too."""
    a, b = _span(node)
    while comments and a > 0 and lines[a - 1].lstrip().startswith("#"):
        a -= 1
    return "".join(lines[a:b])


def merge_module(original: str, fragment: str, name: str) -> str:
    """FreeToken's module `original` with `fragment`'s definitions and imports merged in."""
    try:
        otree, ftree = ast.parse(original), ast.parse(fragment)
    except SyntaxError as e:
        raise CLIError(f"{name}: {e}") from None
    olines = original.splitlines(keepends=True)
    flines = fragment.splitlines(keepends=True)
    onamed = _named_nodes(otree)
    replace: dict[int, tuple[int, str]] = {}   # start line -> (end line, new text)
    new_defs: list[str] = []
    for fname, fnode in _named_nodes(ftree).items():
        text = _source(flines, fnode, comments=True)
        if fname in onamed:
            a, b = _span(onamed[fname])
            replace[a] = (b, text)
        else:
            new_defs.append(text)
    have = {ast.unparse(n) for n in otree.body if isinstance(n, (ast.Import, ast.ImportFrom))}
    new_imports = [_source(flines, n) for n in ftree.body
                   if isinstance(n, (ast.Import, ast.ImportFrom)) and ast.unparse(n) not in have]
    # new imports join the module's first import group (the standard library's, by convention)
    imports = [n for n in otree.body if isinstance(n, (ast.Import, ast.ImportFrom))
               and not (isinstance(n, ast.ImportFrom) and n.module == "__future__")]
    after_imports = 0
    for n in imports:
        if after_imports and n.lineno != after_imports + 1:
            break
        after_imports = n.end_lineno
    all_node = next((n for n in otree.body if isinstance(n, ast.Assign) and any(
        isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets)), None)
    defs_at = (all_node.lineno - 1) if all_node is not None else len(olines)

    out: list[str] = []
    i = 0
    while i <= len(olines):
        if i == defs_at and new_defs:
            out.extend(d + "\n\n" for d in new_defs)
        if i == len(olines):
            break
        if i in replace:
            end, text = replace[i]
            out.append(text)
            i = end
            continue
        out.append(olines[i])
        i += 1
        if i == after_imports and new_imports:
            out.extend(new_imports)
    return "".join(out)


def apply_insert(text: str, edit: dict, name: str) -> str:
    anchor = edit.get("before") or edit.get("after")
    lines = text.splitlines(keepends=True)
    hits = [i for i, line in enumerate(lines) if line.rstrip("\n") == anchor]
    if len(hits) != 1:
        raise CLIError(f"{name}: the anchor line occurs {len(hits)} times (want once): {anchor!r}")
    at = hits[0] + (1 if "after" in edit else 0)
    body = edit["text"] if edit["text"].endswith("\n") else edit["text"] + "\n"
    return "".join(lines[:at]) + body + "".join(lines[at:])


# -- build -----------------------------------------------------------------------------------------
def changed_files(pr: PR) -> dict[str, str | None]:
    """Relative path -> fragment text (None: touched by inserts only)."""
    out: dict[str, str | None] = {}
    for f in sorted(pr.change.rglob("*")):
        if f.is_file() and "__pycache__" not in f.parts:
            out[str(f.relative_to(pr.change))] = f.read_text()
    for e in pr.inserts:
        out.setdefault(e["file"], None)
    return out


def patched_text(pr: PR, freetoken_dir: Path, rel: str, fragment: str | None) -> tuple[str | None, str]:
    """(FreeToken's text or None for a new file, the patched text)."""
    src = freetoken_dir / rel
    original = src.read_text() if src.is_file() else None
    text = original
    if fragment is not None:
        text = fragment if original is None else merge_module(original, fragment, rel)
    if text is None:
        raise CLIError(f"{rel}: pr.toml inserts into a file FreeToken does not have")
    for e in pr.inserts:
        if e["file"] == rel:
            text = apply_insert(text, e, rel)
    return original, text


def unified(rel: str, before: str | None, after: str) -> str:
    a = "/dev/null" if before is None else f"a/{rel}"
    lines = difflib.unified_diff((before or "").splitlines(keepends=True),
                                 after.splitlines(keepends=True), a, f"b/{rel}", n=3)
    return "".join(lines)


def build(number: int, freetoken_dir: str | Path, out: str | Path, root: Path | None = None,
          text: bool = True) -> tuple[Path, Path]:
    """Write BUILD/tree (FreeToken's sources with the PR applied), BUILD/<N>.diff and, with
    `text`, BUILD/<N>.md (the PR text with its evidence rendered)."""
    from . import evidence
    pr = find_pr(number, root)
    ft = Path(freetoken_dir)
    if not (ft / "freetoken" / "__init__.py").is_file():
        raise CLIError(f"{ft}: not a folder holding an unpacked `freetoken` package "
                       "(want DIR/freetoken/__init__.py)")
    out = Path(out)
    tree = out / "tree"
    if tree.exists():
        shutil.rmtree(tree)
    shutil.copytree(ft / "freetoken", tree / "freetoken",
                    ignore=shutil.ignore_patterns("__pycache__"))
    diffs = []
    for rel, fragment in changed_files(pr).items():
        before, after = patched_text(pr, ft, rel, fragment)
        dst = tree / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_text(after)
        diffs.append(unified(rel, before, after))
    diff = out / f"{number}.diff"
    diff.write_text("".join(diffs))
    if text:
        (out / f"{number}.md").write_text(evidence.render_pr(pr))
    return tree, diff


# -- check: the diff applies to 0.2.1, its tests fail before and pass after ----------------------
def _pytest(tree: Path, tests: list[str]) -> dict:
    import os
    import subprocess
    import sys
    import xml.etree.ElementTree as ET
    report = tree / "junit.xml"
    env = dict(os.environ, PYTHONPATH=str(tree), FREETOKEN_SKIP_BANK_PIN="1")
    env.pop("FTPATCH_FREETOKEN_PATCH", None)   # FreeToken as built, never our runtime patch
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           f"--junitxml={report}", *tests], cwd=tree, env=env,
                          capture_output=True, text=True, check=False)
    outcomes: dict[str, int] = {}
    if report.is_file():
        for case in ET.parse(report).getroot().iter("testcase"):
            kind = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
            kind = {"failure": "failed", "error": "errors"}.get(kind, kind)
            outcomes[kind] = outcomes.get(kind, 0) + 1
    return {"returncode": proc.returncode, "outcomes": outcomes, "tail": proc.stdout[-3000:]}


def check(number: int, freetoken_dir: str | Path, out: str | Path, root: Path | None = None) -> dict:
    """Build PR `number`, apply its diff to a clean copy of FreeToken's files, run its tests on
    the unpatched and the patched tree; a JSON-able record (evidence kind `pr_tests`)."""
    import subprocess
    from .measure import machine
    tree, diff = build(number, freetoken_dir, out, root, text=False)
    pr = find_pr(number, root)
    out = Path(out)
    before = out / "before"
    if before.exists():
        shutil.rmtree(before)
    shutil.copytree(Path(freetoken_dir) / "freetoken", before / "freetoken",
                    ignore=shutil.ignore_patterns("__pycache__"))
    applies = subprocess.run(["git", "apply", "--check", str(diff.resolve())], cwd=before,
                             capture_output=True, text=True, check=False)
    tests = sorted(str(p.relative_to(pr.change)) for p in pr.change.rglob("test_*.py"))
    for rel in tests:   # the tests alone, on FreeToken as released
        (before / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(tree / rel, before / rel)
    version = (Path(freetoken_dir) / "freetoken" / "version.py").read_text()
    return {"kind": "pr_tests", "pr": number, "title": pr.title,
            "freetoken": version.split('"')[1] if '"' in version else version.strip(),
            "command": ["python", "-m", "pytest", *tests], "machine": machine(),
            "diff_applies": applies.returncode == 0, "diff_check_stderr": applies.stderr[-2000:],
            "before": _pytest(before, tests), "after": _pytest(tree, tests)}
