"""`ftpatch pr-notes build | check`: turn `pr_notes/<N>-<slug>/` into a patch series that `git am`
applies to FreeToken at its repository's paths, and check that its tests fail on 0.2.1 for the
reason the change is about and pass with it.

Layout. FreeToken's repository keeps the package under `python/freetoken/` and its tests as flat
files `tests/<subsystem>/test_*.py` (its public snapshot, github.com/FlashML-org/FreeToken); the
0.2.1 wheel holds the same package at `freetoken/`. The public snapshot stops at 0.1.2, older than
0.2.1's GGUF code, so every series is made against the 0.2.1 wheel's files placed at the
repository's paths: `BUILD/upstream` is a git repository whose first commit is that package at
`python/freetoken/`, and the PR's commits follow it.

A folder holds:
  pr.toml   title (a conventional-commit line, the squash-merge subject), kind ("pr", or "review":
            a suggested change for someone else's pull request), links, base, [[commit]] (subject,
            body, files), [[edit]] (a block of lines of a FreeToken file, `old`, that must occur
            once, replaced by `new`), [[take]] (definitions copied from one of our modules, named
            by its SHARED tuple, so the runtime patch and the PR run the same code),
            before_fails_with (what the tests' failures on 0.2.1 must say), [test_env]
  change/   files at the repository's paths. For a file FreeToken has, the fragment's module
            docstring, top-level functions, classes and assignments replace FreeToken's of the
            same name; new ones go before the first one replaced (or before `__all__`, or at the
            end); imports not yet present join FreeToken's first import group in sorted place.
            A file FreeToken lacks (a test) is added whole.
  PR.md     the text; `{{evidence:NAME}}` is rendered from `evidence/NAME.json` (our tools write
            it; see `evidence.py`) and `{{checklist}}` from pr.toml and the tests' evidence
Nothing of FreeToken is stored here: the builder reads it from the --freetoken folder.
"""
from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import CLIError

NOTES_ENV = "FTPATCH_PR_NOTES"
PACKAGE_DIR = "python"          # the repository folder holding the `freetoken` package
EVIDENCE_RE = re.compile(r"\{\{evidence:([\w.-]+)\}\}")
REPO_ROOT = Path(__file__).resolve().parents[2]   # the checkout, when run from one
# what a failure that is not the behaviour under test looks like (a missing name, a broken import)
NOT_BEHAVIOURAL = ("ImportError", "ModuleNotFoundError", "NameError", "AttributeError: module",
                   "SyntaxError", "fixture '")


def notes_root() -> Path:
    """pr_notes/: $FTPATCH_PR_NOTES, else the source checkout's (beside this package), else
    ./pr_notes. An installed wheel ships no pr_notes/: run from the repository root."""
    for cand in (os.environ.get(NOTES_ENV), REPO_ROOT / "pr_notes", Path.cwd() / "pr_notes"):
        if cand and Path(cand).is_dir():
            return Path(cand)
    raise CLIError("no pr_notes/ folder found: run from the repository root or set "
                   f"{NOTES_ENV}")


@dataclass(frozen=True)
class PR:
    number: int
    folder: Path
    title: str
    meta: dict = field(repr=False)

    @property
    def change(self) -> Path:
        return self.folder / "change"

    @property
    def checkout(self) -> Path:
        """The ftpatch checkout this pr_notes/ folder is in (`take` sources, `test_env` paths)."""
        return self.folder.parent.parent

    @property
    def kind(self) -> str:
        return self.meta.get("kind", "pr")

    @property
    def edits(self) -> list[dict]:
        return list(self.meta.get("edit", ()))

    @property
    def takes(self) -> list[dict]:
        return list(self.meta.get("take", ()))

    def tests(self) -> list[str]:
        return sorted(str(p.relative_to(self.change)) for p in self.change.rglob("test_*.py"))

    def commits(self) -> list[dict]:
        """[[commit]] entries; without any, one commit of every changed file named by the title."""
        commits = list(self.meta.get("commit", ()))
        return commits or [{"subject": self.title, "body": "", "files": sorted(changed_files(self))}]


def find_pr(number: int, root: Path | None = None) -> PR:
    root = root or notes_root()
    hits = [p for p in sorted(root.iterdir()) if p.is_dir() and p.name.split("-")[0] == f"{number}"]
    if not hits:
        have = ", ".join(p.name for p in sorted(root.iterdir()) if (p / "pr.toml").is_file())
        raise CLIError(f"no pull request {number} in {root} (have: {have or 'none'})")
    folder = hits[0]
    meta = tomllib.loads((folder / "pr.toml").read_text())
    return PR(number, folder, meta["title"], meta)


def list_prs(root: Path | None = None) -> list[PR]:
    root = root or notes_root()
    return [find_pr(int(p.name.split("-")[0]), root) for p in sorted(root.iterdir())
            if (p / "pr.toml").is_file()]


def wheel_path(rel: str) -> str:
    """A repository path's place in the wheel (python/freetoken/x.py -> freetoken/x.py)."""
    return rel[len(PACKAGE_DIR) + 1:] if rel.startswith(PACKAGE_DIR + "/freetoken/") else rel


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


def _docstring(tree: ast.Module) -> ast.Expr | None:
    first = tree.body[0] if tree.body else None
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and \
            isinstance(first.value.value, str):
        return first
    return None


def _import_key(node: ast.stmt) -> tuple[int, str]:
    """isort's default order inside a section: `import x` lines, then `from x import y`, by name."""
    if isinstance(node, ast.Import):
        return 0, node.names[0].name
    return 1, node.module or ""


def take_definitions(source: Path, names: list[str] | None = None) -> str:
    """The text of `names` (default: the module's SHARED tuple) from one of our modules, in order,
    each with the comment lines right above it."""
    text = source.read_text()
    tree = ast.parse(text)
    if names is None:
        shared = next((n for n in tree.body if isinstance(n, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "SHARED" for t in n.targets)), None)
        if shared is None:
            raise CLIError(f"{source}: no SHARED tuple naming the definitions to take")
        names = list(ast.literal_eval(shared.value))
    named, lines = _named_nodes(tree), text.splitlines(keepends=True)
    missing = [n for n in names if n not in named]
    if missing:
        raise CLIError(f"{source}: no top-level definition named {', '.join(missing)}")
    return "\n\n".join(_source(lines, named[n], comments=True) for n in names)


def merge_module(original: str, fragment: str, name: str) -> str:
    """FreeToken's module `original` with `fragment`'s docstring, definitions and imports merged in."""
    try:
        otree, ftree = ast.parse(original), ast.parse(fragment)
    except SyntaxError as e:
        raise CLIError(f"{name}: {e}") from None
    olines = original.splitlines(keepends=True)
    flines = fragment.splitlines(keepends=True)
    onamed = _named_nodes(otree)
    replace: dict[int, tuple[int, str]] = {}   # start line -> (end line, new text)
    odoc, fdoc = _docstring(otree), _docstring(ftree)
    if odoc is not None and fdoc is not None:
        replace[_span(odoc)[0]] = (_span(odoc)[1], _source(flines, fdoc))
    new_defs: list[str] = []
    def_starts: list[int] = []
    prev_assign = False
    for fname, fnode in _named_nodes(ftree).items():
        text = _source(flines, fnode, comments=True)
        if fname in onamed:
            a, b = _span(onamed[fname])
            while a > 0 and olines[a - 1].lstrip().startswith("#"):   # its comment goes with it
                a -= 1
            replace[a] = (b, text)
            def_starts.append(a)
            continue
        # two blank lines between definitions, none between consecutive constants
        assign = isinstance(fnode, ast.Assign)
        if new_defs:
            new_defs[-1] += "" if (assign and prev_assign) else "\n\n"
        new_defs.append(text)
        prev_assign = assign
    have = {ast.unparse(n) for n in otree.body if isinstance(n, (ast.Import, ast.ImportFrom))}
    new_imports = [n for n in ftree.body if isinstance(n, (ast.Import, ast.ImportFrom))
                   and ast.unparse(n) not in have
                   and not (isinstance(n, ast.ImportFrom) and n.module == "__future__")]
    # `from m import x` where the module already has a one-line `from m import ...`: one line
    ofrom = {(n.module, n.level): n for n in otree.body if isinstance(n, ast.ImportFrom)
             and n.lineno == n.end_lineno}
    for n in [n for n in new_imports if isinstance(n, ast.ImportFrom) and (n.module, n.level) in ofrom]:
        o = ofrom[(n.module, n.level)]
        names = {a.name: a for a in [*o.names, *n.names]}
        merged = ast.ImportFrom(o.module, [names[k] for k in sorted(names)], o.level)
        replace[o.lineno - 1] = (o.lineno, ast.unparse(merged) + "\n")
        new_imports.remove(n)
    # new imports join the module's first import group (the standard library's, by convention)
    imports = [n for n in otree.body if isinstance(n, (ast.Import, ast.ImportFrom))
               and not (isinstance(n, ast.ImportFrom) and n.module == "__future__")]
    group: list[ast.stmt] = []
    for n in imports:
        if group and n.lineno != group[-1].end_lineno + 1:
            break
        group.append(n)
    at_import: dict[int, list[str]] = {}   # line index -> new import lines placed before it
    for n in sorted(new_imports, key=_import_key):
        later = next((g for g in group if _import_key(g) > _import_key(n)), None)
        pos = (later.lineno - 1) if later is not None else (group[-1].end_lineno if group else 0)
        at_import.setdefault(pos, []).append(_source(flines, n))
    all_node = next((n for n in otree.body if isinstance(n, ast.Assign) and any(
        isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets)), None)
    if def_starts:
        defs_at = min(def_starts)
    else:
        defs_at = (all_node.lineno - 1) if all_node is not None else len(olines)

    out: list[str] = []
    i = 0
    while i <= len(olines):
        out.extend(at_import.pop(i, []))
        if i == defs_at and new_defs:
            out.extend(new_defs)
            out.append("\n\n")
        if i == len(olines):
            break
        if i in replace:
            end, text = replace[i]
            out.append(text)
            i = end
            continue
        out.append(olines[i])
        i += 1
    return "".join(out)


def apply_edit(text: str, edit: dict, name: str) -> str:
    """`old` (whole lines) -> `new`; or `text` placed before / after the one line `before` /
    `after`. The anchor must occur exactly once."""
    if "old" in edit:
        old, new = edit["old"], edit["new"]
        old = old if old.endswith("\n") else old + "\n"
        new = new if new.endswith("\n") or not new else new + "\n"
        lines = text.splitlines(keepends=True)
        n = old.count("\n")
        hits = [i for i in range(len(lines) - n + 1) if "".join(lines[i:i + n]) == old]
        if len(hits) != 1:
            raise CLIError(f"{name}: the lines to replace occur {len(hits)} times (want once): "
                           f"{old.splitlines()[0]!r}")
        return "".join(lines[:hits[0]]) + new + "".join(lines[hits[0] + n:])
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
    """Repository path -> fragment text (None: touched by edits or takes only)."""
    out: dict[str, str | None] = {}
    if pr.change.is_dir():
        for f in sorted(pr.change.rglob("*")):
            if f.is_file() and "__pycache__" not in f.parts:
                out[str(f.relative_to(pr.change))] = f.read_text()
    for e in (*pr.edits, *pr.takes):
        out.setdefault(e["file"], None)
    return out


def patched_text(pr: PR, freetoken_dir: Path, rel: str, fragment: str | None) -> tuple[str | None, str]:
    """(FreeToken 0.2.1's text or None for a new file, the patched text) of repository path `rel`."""
    src = freetoken_dir / wheel_path(rel)
    original = src.read_text() if src.is_file() else None
    takes = [take_definitions(pr.checkout / t["source"], t.get("names")) for t in pr.takes
             if t["file"] == rel]
    if takes:
        fragment = _with_takes(fragment or "", takes)
    text = original
    if fragment is not None:
        text = fragment if original is None else merge_module(original, fragment, rel)
    if text is None:
        raise CLIError(f"{rel}: pr.toml edits a file FreeToken does not have")
    for e in pr.edits:
        if e["file"] == rel:
            text = apply_edit(text, e, rel)
    return original, text


def _with_takes(fragment: str, takes: list[str]) -> str:
    """The fragment with the taken definitions after its docstring and imports, before its own."""
    tree = ast.parse(fragment)
    head = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom)) or n is _docstring(tree)]
    rest = [n for n in tree.body if n not in head]
    lines = fragment.splitlines(keepends=True)
    cut = _span(rest[0])[0] if rest else len(lines)
    while cut > 0 and rest and lines[cut - 1].lstrip().startswith("#"):
        cut -= 1
    return "".join(lines[:cut]) + "\n\n" + "\n\n\n".join(takes) + "\n\n\n" + "".join(lines[cut:])


def _git(cwd: Path, *args: str, env: dict | None = None, check: bool = True,
         input: str | None = None) -> subprocess.CompletedProcess:
    """git in `cwd` with no user or system config, ftpatch's identity unless `env` gives one."""
    ident = {"GIT_AUTHOR_NAME": "ftpatch", "GIT_AUTHOR_EMAIL": "ftpatch@localhost",
             "GIT_COMMITTER_NAME": "ftpatch", "GIT_COMMITTER_EMAIL": "ftpatch@localhost",
             "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull}
    proc = subprocess.run(["git", "-c", "commit.gpgsign=false", "-c", "core.autocrlf=false", *args],
                          cwd=cwd, env={**os.environ, **ident, **(env or {})}, input=input,
                          capture_output=True, text=True, check=False)
    if check and proc.returncode:
        raise CLIError(f"git {' '.join(args[:2])} failed in {cwd}: {proc.stderr.strip()[-500:]}")
    return proc


def _check_freetoken(freetoken_dir: Path) -> Path:
    ft = Path(freetoken_dir)
    if not (ft / "freetoken" / "__init__.py").is_file():
        raise CLIError(f"{ft}: not a folder holding an unpacked `freetoken` package "
                       "(want DIR/freetoken/__init__.py)")
    return ft


def base_repo(freetoken_dir: Path, dest: Path) -> str:
    """A git repository at `dest` holding FreeToken's package at python/freetoken/ (one commit);
    its commit id."""
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(freetoken_dir / "freetoken", dest / PACKAGE_DIR / "freetoken",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    _git(dest, "init", "-q", "-b", "main")
    _git(dest, "add", "-A")
    version = _version(freetoken_dir)
    _git(dest, "commit", "-q", "-m", f"FreeToken {version} (the wheel's package at {PACKAGE_DIR}/)",
         env=_dates("2026-01-01T00:00:00+00:00"))
    return _git(dest, "rev-parse", "HEAD").stdout.strip()


def _dates(date: str) -> dict:
    return {"GIT_AUTHOR_DATE": date, "GIT_COMMITTER_DATE": date}


def _version(freetoken_dir: Path) -> str:
    text = (freetoken_dir / "freetoken" / "version.py").read_text()
    return text.split('"')[1] if '"' in text else text.strip()


def build(number: int, freetoken_dir: str | Path, out: str | Path, root: Path | None = None,
          text: bool = True, author: str | None = None) -> dict[str, Path]:
    """Write BUILD/upstream (the repository at 0.2.1 with the PR's commits), BUILD/patches/*.patch
    (`git format-patch` of those commits), BUILD/<N>.diff (all of it as one diff) and, with
    `text`, BUILD/<N>.md (the text with evidence and checklist rendered). Returns those paths."""
    from . import evidence
    pr = find_pr(number, root)
    ft = _check_freetoken(Path(freetoken_dir))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    repo = out / "upstream"
    base = base_repo(ft, repo)
    files = changed_files(pr)
    in_commits = [f for c in pr.commits() for f in c["files"]]
    if sorted(in_commits) != sorted(files):
        raise CLIError(f"{pr.folder}/pr.toml: the commits' files {sorted(in_commits)} are not the "
                       f"changed files {sorted(files)} (each once)")
    name, email = _author(author)
    for c in pr.commits():
        for rel in c["files"]:
            _, after = patched_text(pr, ft, rel, files[rel])
            dst = repo / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_text(after)
        _git(repo, "add", "-A")
        message = c["subject"] + ("\n\n" + c["body"].strip() + "\n" if c.get("body") else "\n")
        _commit(repo, message, name, email, pr.meta.get("date"))
    patches = out / "patches"
    if patches.exists():
        shutil.rmtree(patches)
    _git(repo, "format-patch", "-q", "--no-signature", "--zero-commit", "-o", str(patches), base)
    diff = out / f"{number}.diff"
    diff.write_text(_git(repo, "diff", base, "HEAD").stdout)
    paths = {"repo": repo, "patches": patches, "diff": diff, "base": Path(base)}
    if text:
        md = out / f"{number}.md"
        md.write_text(evidence.render_pr(pr))
        paths["text"] = md
    return paths


def _author(author: str | None) -> tuple[str, str]:
    """The patches' author: `Name <email>`, else git's user.name / user.email here, else a
    placeholder to replace before sending."""
    if not author:
        name = subprocess.run(["git", "config", "user.name"], capture_output=True, text=True).stdout.strip()
        email = subprocess.run(["git", "config", "user.email"], capture_output=True, text=True).stdout.strip()
        if name and email:
            return name, email
        author = "Your Name <you@example.com>"
    m = re.fullmatch(r"\s*(.+?)\s*<([^>]+)>\s*", author)
    if not m:
        raise CLIError(f"--author {author!r}: want 'Name <email>'")
    return m.group(1), m.group(2)


def _commit(repo: Path, message: str, name: str, email: str, date: str | None) -> None:
    _git(repo, "commit", "-q", "-F", "-", input=message,
         env={"GIT_AUTHOR_NAME": name, "GIT_AUTHOR_EMAIL": email, "GIT_COMMITTER_NAME": name,
              "GIT_COMMITTER_EMAIL": email, **_dates(date or "2026-01-01T00:00:00+00:00")})


# -- check: the series applies to 0.2.1, its tests fail before (for the reason) and pass after -----
def _pytest(tree: Path, tests: list[str], env_extra: dict[str, str]) -> dict:
    import xml.etree.ElementTree as ET
    report = tree / "junit.xml"
    # the tree's package first; what the caller's path adds (FreeToken's dependencies) after it
    path = os.pathsep.join(p for p in (str(tree / PACKAGE_DIR), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONPATH=path, FREETOKEN_SKIP_BANK_PIN="1", **env_extra)
    env.pop("FTPATCH_FREETOKEN_PATCH", None)   # FreeToken as built, never our runtime patch
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-o", "addopts=", f"--junitxml={report}", *tests], cwd=tree, env=env,
                          capture_output=True, text=True, check=False)
    outcomes: dict[str, int] = {}
    failures = []
    if report.is_file():
        for case in ET.parse(report).getroot().iter("testcase"):
            bad = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
            kind = {"failure": "failed", "error": "errors"}.get(bad.tag, bad.tag) if bad is not None else "passed"
            outcomes[kind] = outcomes.get(kind, 0) + 1
            if kind in ("failed", "errors"):
                detail = (bad.get("message") or "") + "\n" + (bad.text or "")
                failures.append({"test": f"{case.get('classname')}::{case.get('name')}",
                                 "message": (bad.get("message") or "").splitlines()[0][:300]
                                 if bad.get("message") else "", "detail": detail[-4000:]})
            elif kind == "skipped":
                failures.append({"test": f"{case.get('classname')}::{case.get('name')}",
                                 "skipped": (bad.get("message") or "")[:300]})
    return {"returncode": proc.returncode, "outcomes": outcomes,
            "failures": [f for f in failures if "skipped" not in f],
            "skipped": [f for f in failures if "skipped" in f], "tail": proc.stdout[-3000:]}


def _test_env(pr: PR) -> dict[str, str]:
    """pr.toml's [test_env], paths taken relative to this repository's root."""
    return {k: str(pr.checkout / v) if not os.path.isabs(v) else v
            for k, v in pr.meta.get("test_env", {}).items()}


def behavioural(before: dict, expected: list[str]) -> tuple[bool, list[str]]:
    """Did the tests fail on 0.2.1 only for the reasons pr.toml names? (ok, why not)"""
    problems = []
    if not before["failures"]:
        problems.append("no test failed on 0.2.1")
    for f in before["failures"]:
        detail = f["detail"]
        if any(s in detail for s in NOT_BEHAVIOURAL) and not any(s in detail for s in expected):
            problems.append(f"{f['test']} failed on a missing name or import: {f['message']}")
        elif not any(s in detail for s in expected):
            problems.append(f"{f['test']} failed for another reason: {f['message']}")
    return not problems, problems


def check(number: int, freetoken_dir: str | Path, out: str | Path, root: Path | None = None) -> dict:
    """Build PR `number`; `git am` its series onto a clean repository at 0.2.1; run its tests on
    0.2.1 with only the test files added (they must fail, for the reasons pr.toml names) and on
    the patched tree (they must pass). A JSON-able record (evidence kind `pr_tests`)."""
    from .measure import machine
    ft = _check_freetoken(Path(freetoken_dir))
    out = Path(out)
    paths = build(number, ft, out, root, text=False)
    pr = find_pr(number, root)
    tests = pr.tests()
    env = _test_env(pr)
    # the series onto a fresh copy of the base commit
    am = out / "am"
    if am.exists():
        shutil.rmtree(am)
    base = str(paths["base"])
    _git(out, "clone", "-q", "--no-checkout", str(paths["repo"]), str(am))
    _git(am, "checkout", "-q", "-b", "review", base)
    series = sorted(paths["patches"].glob("*.patch"))
    applied = _git(am, "am", "-q", *map(str, series), check=False)
    # before: 0.2.1 as released, with the PR's test files alone added
    before = out / "before"
    if before.exists():
        shutil.rmtree(before)
    shutil.copytree(ft / "freetoken", before / PACKAGE_DIR / "freetoken",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for rel in tests:
        (before / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(paths["repo"] / rel, before / rel)
    rec_before = _pytest(before, tests, env)
    rec_after = _pytest(am, tests, env) if applied.returncode == 0 else \
        {"returncode": None, "outcomes": {}, "failures": [], "skipped": [], "tail": "not run: the series did not apply"}
    expected = list(pr.meta.get("before_fails_with", ()))
    ok, problems = behavioural(rec_before, expected)
    return {"kind": "pr_tests", "pr": number, "title": pr.title, "freetoken": _version(ft),
            "layout": f"{PACKAGE_DIR}/freetoken/..., tests/<subsystem>/test_*.py",
            "patches": [p.name for p in series], "command": ["python", "-m", "pytest", *tests],
            "test_env": {k: pr.meta.get("test_env_shown", {}).get(k) or os.path.relpath(v, pr.checkout)
                         for k, v in env.items()},
            "machine": machine(), "series_applies": applied.returncode == 0,
            "am_stderr": applied.stderr[-2000:], "before": rec_before, "after": rec_after,
            "before_fails_with": expected, "before_behavioural": ok, "before_problems": problems}
