"""The map is true: imports flow loaders <- native <- moe_offload <- freetoken_patch, never back."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ORDER = ["loaders", "native", "moe_offload", "freetoken_patch"]


def _imports(path: Path):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name.split(".")[0], node.lineno
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module.split(".")[0], node.lineno


def test_imports_flow_one_way():
    bad = []
    for pkg in ORDER:
        allowed = set(ORDER[:ORDER.index(pkg) + 1])
        for f in (ROOT / pkg).rglob("*.py"):
            for mod, line in _imports(f):
                if mod in ORDER and mod not in allowed:
                    bad.append(f"{f.relative_to(ROOT)}:{line} imports {mod}")
    assert not bad, "wrong-way imports:\n" + "\n".join(bad)


def test_loaders_never_imports_torch():
    bad = [f"{f.relative_to(ROOT)}:{line}" for f in (ROOT / "loaders").rglob("*.py")
           for mod, line in _imports(f) if mod == "torch"]
    assert not bad, bad


def test_every_package_lists_its_public_names():
    for pkg in ORDER:
        init = (ROOT / pkg / "__init__.py").read_text()
        assert init.lstrip().startswith('"""'), f"{pkg}/__init__.py needs a docstring listing its public names"


def _py_files(*dirs):
    for d in dirs:
        yield from (ROOT / d).rglob("*.py")


def test_no_runtime_or_server_module_grows_past_450_lines():
    long = [f"{f.relative_to(ROOT)}: {n} lines" for f in _py_files("moe_offload", "freetoken_patch/server")
            if (n := len(f.read_text(encoding="utf-8").splitlines())) > 450]
    assert not long, "split these by job:\n" + "\n".join(long)


def test_the_app_layer_imports_only_moe_offloads_public_names():
    import moe_offload
    public, bad = set(moe_offload.__all__), []
    for f in _py_files("freetoken_patch"):
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                    and node.module.startswith("moe_offload"):
                if node.module != "moe_offload":
                    bad.append(f"{f.relative_to(ROOT)}:{node.lineno} from {node.module}")
                bad += [f"{f.relative_to(ROOT)}:{node.lineno} {a.name}" for a in node.names
                        if node.module == "moe_offload" and a.name not in public]
            elif isinstance(node, ast.Import):
                bad += [f"{f.relative_to(ROOT)}:{node.lineno} import {a.name}" for a in node.names
                        if a.name.startswith("moe_offload.")]
    assert not bad, "internals of moe_offload used by the app layer:\n" + "\n".join(bad)


def test_docs_and_docstrings_cite_only_files_in_the_repo():
    """A clone has no ../shared: nothing may send a reader there."""
    files = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"),
             *_py_files("loaders", "native", "moe_offload", "freetoken_patch", "tests")]
    files += [*(ROOT / "native" / "csrc").rglob("*.h"), *(ROOT / "native" / "csrc").rglob("*.c*")]
    needle = "shared" + "/docs"   # (spelled apart: this file is checked too)
    bad = [f"{f.relative_to(ROOT)}" for f in files
           if needle in f.read_text(encoding="utf-8", errors="replace")]
    assert not bad, bad


def test_the_reading_path_names_files_and_functions_that_exist():
    """ARCHITECTURE.md's reading path: every file it names exists, every Class.method it names
    is defined in a file of the repo."""
    import re
    doc = (ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    path = doc[doc.index("## Reading path"):doc.index("## Packages and the one-way rule")]
    files = set(re.findall(r"`([\w/]+\.py)`", path))
    assert files, "the reading path names no file"
    missing = [p for p in files if not any((ROOT / d / p).exists() for d in (
        "", "moe_offload", "freetoken_patch", "freetoken_patch/server"))]
    assert not missing, missing
    source = "\n".join(f.read_text(encoding="utf-8") for f in _py_files("moe_offload", "freetoken_patch"))
    names = set(re.findall(r"`(?:[\w.]+\.)?([A-Z]\w+)\.(\w+)`", path))
    assert names, "the reading path names no Class.method"
    absent = []
    for cls, meth in names:
        m = re.search(rf"^class {cls}\b.*?(?=^class |\Z)", source, re.S | re.M)
        if m is None or not re.search(rf"^    (async )?def {meth}\b", m.group(0), re.M):
            absent.append(f"{cls}.{meth}")
    assert not absent, absent
