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
