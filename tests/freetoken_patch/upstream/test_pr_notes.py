"""pr_notes/: the builder's merge rules, every PR's patch series `git am`-applied to FreeToken
0.2.1's files at the repository's paths with its tests failing before (for the reason pr.toml
names) and passing after, and every PR text rendered from its evidence JSON."""
from __future__ import annotations

import re
import shutil
import textwrap
from pathlib import Path

import pytest

from freetoken_patch.errors import CLIError
from freetoken_patch.upstream import evidence, prbuild

NOTES = Path(__file__).resolve().parents[3] / "pr_notes"   # the checkout's, installed or not
PRS = [pr.number for pr in prbuild.list_prs(NOTES)]


def test_merge_replaces_adds_and_imports():
    original = textwrap.dedent('''\
        """doc"""
        import os
        from typing import Any

        import torch

        LIMIT = 1


        # why f
        def f():
            return 1


        def g():
            return f()


        __all__ = ["f"]
        ''')
    fragment = textwrap.dedent('''\
        """new doc"""
        import math
        import os
        from concurrent.futures import ThreadPoolExecutor
        from typing import NamedTuple

        A = 1
        B = 2


        def h():
            return 3


        # why f is 2
        def f():
            return 2
        ''')
    got = prbuild.merge_module(original, fragment, "m.py")
    ns: dict = {}
    exec(compile(got, "m.py", "exec"), ns)
    assert (ns["f"](), ns["g"](), ns["h"](), ns["LIMIT"], ns["A"] + ns["B"]) == (2, 2, 3, 1, 3)
    assert got.startswith('"""new doc"""') and "why f\n" not in got and "# why f is 2" in got
    # imports in isort's place in the first group; a `from` of a module already there, one line
    assert got.index("import math") < got.index("import os") < got.index("from concurrent")
    assert "from typing import Any, NamedTuple\n" in got and got.count("import os") == 1
    assert got.index("from concurrent") < got.index("import torch")
    # new definitions before the first one replaced; consecutive constants stay together
    assert got.index("A = 1\nB = 2\n\n\ndef h") < got.index("def f")


def test_edits_need_one_place():
    assert prbuild.apply_edit("a\nb\n", {"after": "a", "text": "x"}, "t") == "a\nx\nb\n"
    assert prbuild.apply_edit("a\nb\nc\n", {"old": "a\nb", "new": "z"}, "t") == "z\nc\n"
    with pytest.raises(CLIError, match="occurs 2 times"):
        prbuild.apply_edit("a\nb\na\n", {"before": "a", "text": "x"}, "t")
    with pytest.raises(CLIError, match="occur 0 times"):
        prbuild.apply_edit("a\n", {"old": "b", "new": "c"}, "t")


def test_take_copies_the_shared_definitions(tmp_path):
    src = tmp_path / "m.py"
    src.write_text('SHARED = ("X", "f")\n\n# x\nX = 1\n\n\ndef f():\n    return X\n\n\ndef g():\n    pass\n')
    got = prbuild.take_definitions(src)
    assert got == "# x\nX = 1\n\n\ndef f():\n    return X\n" and "def g" not in got
    with pytest.raises(CLIError, match="no top-level definition named nope"):
        prbuild.take_definitions(src, ["nope"])


def test_header_reader_is_the_runtime_patch_code():
    """PR 1's reader takes its parser from freetoken_patch/upstream/header.py, as it is."""
    pr = prbuild.find_pr(1, NOTES)
    assert [t["source"] for t in pr.takes] == ["freetoken_patch/upstream/header.py"]
    text = prbuild.take_definitions(pr.checkout / pr.takes[0]["source"])
    assert "def _read_header(path: str) -> GgufHeader:" in text
    assert "ftpatch" not in text   # nothing of ours leaks into FreeToken's module


@pytest.mark.parametrize("number", PRS)
def test_changes_use_the_repository_layout(number):
    """Code under python/freetoken/, tests as flat files tests/<subsystem>/test_*.py."""
    pr = prbuild.find_pr(number, NOTES)
    for rel in prbuild.changed_files(pr):
        assert re.fullmatch(r"python/freetoken/[\w/]+\.py|tests/\w+/test_\w+\.py", rel), rel


@pytest.mark.parametrize("number", PRS)
def test_series_applies_with_git_am(freetoken, tmp_path, number):
    ft = Path(freetoken.__file__).parents[1]
    paths = prbuild.build(number, ft, tmp_path / "b", NOTES, text=False, author="T <t@example.com>")
    patches = sorted(paths["patches"].glob("*.patch"))
    pr = prbuild.find_pr(number, NOTES)
    assert len(patches) == len(pr.commits())
    for p in patches:
        text = p.read_text()
        assert text.startswith("From 0000000000000000000000000000000000000000")
        heads = re.findall(r"^diff --git a/(\S+) b/(\S+)$", text, re.M)
        assert heads and all(a == b and re.match(r"python/freetoken/|tests/\w+/test_", a)
                             for a, b in heads), heads
    am = tmp_path / "am"
    prbuild.base_repo(ft, am)
    got = prbuild._git(am, "am", *map(str, patches), check=False)
    assert got.returncode == 0, got.stderr
    assert prbuild._git(am, "diff", "--stat", str(paths["base"]), "HEAD").stdout == \
        prbuild._git(paths["repo"], "diff", "--stat", str(paths["base"]), "HEAD").stdout


def test_check_refuses_a_failure_for_the_wrong_reason():
    def before(*details):
        return {"failures": [{"test": f"t::{i}", "message": d.splitlines()[0], "detail": d}
                             for i, d in enumerate(details)]}
    ok, _ = prbuild.behavioural(before("ValueError: x has no general.architecture"),
                                ["no general.architecture"])
    assert ok
    ok, why = prbuild.behavioural(before("ImportError: cannot import name 'resolve'"),
                                  ["no general.architecture"])
    assert not ok and "missing name or import" in why[0]
    ok, why = prbuild.behavioural(before(), ["x"])
    assert not ok and why == ["no test failed on 0.2.1"]


@pytest.mark.slow
@pytest.mark.parametrize("number", PRS)
def test_pr_tests_fail_on_0_2_1_for_the_reason_and_pass_after(freetoken, tmp_path, number):
    rec = prbuild.check(number, Path(freetoken.__file__).parents[1], tmp_path, NOTES)
    assert rec["series_applies"], rec["am_stderr"]
    assert rec["before_behavioural"], (rec["before_problems"], rec["before"]["tail"])
    assert rec["after"]["returncode"] == 0 and rec["after"]["outcomes"].get("passed"), \
        rec["after"]["tail"]
    assert not rec["after"]["skipped"], rec["after"]["skipped"]   # the vocabulary test ran


@pytest.mark.parametrize("number", PRS)
def test_pr_text_renders_from_its_evidence(number):
    pr = prbuild.find_pr(number, NOTES)
    text = evidence.render_pr(pr)
    assert "{{" not in text and text.startswith(f"# {pr.title}")
    tests = evidence.json.loads((pr.folder / "evidence" / "tests.json").read_text())
    assert tests["series_applies"] and tests["before_behavioural"]


def test_withdrawn_and_review_folders():
    """The parallel bank fill is withdrawn (no gain measured); #154's idea is a review."""
    names = sorted(p.name for p in NOTES.iterdir() if p.is_dir())
    assert not any("parallel" in n for n in names)
    assert prbuild.find_pr(2, NOTES).kind == "review"


def test_build_needs_a_freetoken_folder(tmp_path):
    with pytest.raises(CLIError, match="not a folder holding an unpacked `freetoken`"):
        prbuild.build(1, tmp_path, tmp_path / "out", NOTES)
    shutil.rmtree(tmp_path / "out", ignore_errors=True)
