"""pr_notes/: the builder's merge rules, every PR's diff applied to FreeToken 0.2.1's files with
its tests failing before and passing after, and every PR text rendered from its evidence JSON."""
from __future__ import annotations

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

        import torch

        LIMIT = 1


        def f():
            return 1


        def g():
            return f()


        __all__ = ["f"]
        ''')
    fragment = textwrap.dedent('''\
        import os
        from concurrent.futures import ThreadPoolExecutor

        # why the limit is 2
        LIMIT = 2


        def h():
            return 3


        def f():
            return 2
        ''')
    got = prbuild.merge_module(original, fragment, "m.py")
    ns: dict = {}
    exec(compile(got, "m.py", "exec"), ns)
    assert (ns["f"](), ns["g"](), ns["h"](), ns["LIMIT"]) == (2, 2, 3, 2)
    assert got.index("from concurrent.futures") < got.index("import torch")
    assert got.index("def h") < got.index("__all__") and got.count("import os") == 1


def test_insert_needs_one_anchor():
    text = "a\nb\na\n"
    assert prbuild.apply_insert("a\nb\n", {"after": "a", "text": "x"}, "t") == "a\nx\nb\n"
    with pytest.raises(CLIError, match="occurs 2 times"):
        prbuild.apply_insert(text, {"before": "a", "text": "x"}, "t")


def test_diffs_name_freetoken_paths(freetoken, tmp_path):
    for n in PRS:
        _, diff = prbuild.build(n, Path(freetoken.__file__).parents[1], tmp_path / str(n), NOTES)
        heads = [line for line in diff.read_text().splitlines() if line.startswith(("--- ", "+++ "))]
        assert heads and all(h[4:].startswith(("a/freetoken/", "b/freetoken/", "b/tests/", "/dev/null"))
                             for h in heads), heads


@pytest.mark.slow
@pytest.mark.parametrize("number", PRS)
def test_pr_applies_and_its_tests_fail_before_pass_after(freetoken, tmp_path, number):
    rec = prbuild.check(number, Path(freetoken.__file__).parents[1], tmp_path, NOTES)
    assert rec["diff_applies"], rec["diff_check_stderr"]
    assert rec["after"]["returncode"] == 0 and rec["after"]["outcomes"].get("passed"), rec["after"]["tail"]
    assert rec["before"]["returncode"] != 0, rec["before"]["tail"]


@pytest.mark.parametrize("number", PRS)
def test_pr_text_renders_from_its_evidence(number):
    pr = prbuild.find_pr(number, NOTES)
    text = evidence.render_pr(pr)
    assert "{{" not in text and text.startswith(f"# {pr.title}")
