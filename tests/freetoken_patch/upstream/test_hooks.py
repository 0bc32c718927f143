"""The patch mechanism: version and RECORD checks, idempotent apply, revert, spawned children."""
from __future__ import annotations

import importlib.metadata as md
import pickle
import shutil

import pytest

from freetoken_patch.upstream import doctor, hooks, target
from freetoken_patch.upstream.errors import PatchRefused


def _fake_install(tmp_path, *, version="0.2.1", tamper=None):
    """A copy of the installed dist-info and the touched files, optionally changed."""
    real = target.inspect()
    info = next(real.root.glob("freetoken-*.dist-info"))
    dst_info = tmp_path / info.name
    shutil.copytree(info, dst_info)
    for rel in target.TOUCHED:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(real.root / rel, tmp_path / rel)
    if version != "0.2.1":
        meta = dst_info / "METADATA"
        meta.write_text(meta.read_text().replace("Version: 0.2.1", f"Version: {version}", 1))
    if tamper:
        with open(tmp_path / tamper, "a") as f:
            f.write("\n# changed\n")
    return md.PathDistribution(dst_info)


def test_untouched_copy_passes(freetoken, tmp_path):
    t = target.check(_fake_install(tmp_path))
    assert t.version == "0.2.1" and all(f.ok for f in t.files)


def test_changed_file_refused_in_one_line(freetoken, tmp_path):
    dist = _fake_install(tmp_path, tamper="freetoken/models/gguf/experts.py")
    with pytest.raises(PatchRefused, match="experts.py differs from the wheel's RECORD") as e:
        target.check(dist)
    assert "\n" not in str(e.value)
    r = doctor.report(dist, spawn_child=False)
    assert r["refused"] and not doctor.healthy(r)
    assert "CHANGED  freetoken/models/gguf/experts.py" in doctor.render(r)


def test_other_version_refused(freetoken, tmp_path):
    with pytest.raises(PatchRefused, match="FreeToken 0.2.2 is installed; this patch is for 0.2.1"):
        target.check(_fake_install(tmp_path, version="0.2.2"))


def test_apply_is_idempotent_and_reversible(freetoken):
    from freetoken.models.gguf import experts
    from freetoken.server import args, launch
    before = (experts.load_gguf_expert_banks, args.parse_args, launch._run_scheduler,
              launch._run_tokenize_worker)
    try:
        hooks.apply()
        once = (experts.load_gguf_expert_banks, args.parse_args, launch._run_scheduler)
        hooks.apply()
        assert (experts.load_gguf_expert_banks, args.parse_args, launch._run_scheduler) == once
        assert all(hooks.applied().values())
        assert hooks.original("freetoken.server.launch", "_run_scheduler") is before[2]
    finally:
        hooks.revert()
    assert (experts.load_gguf_expert_banks, args.parse_args, launch._run_scheduler,
            launch._run_tokenize_worker) == before
    assert not any(hooks.applied().values())


def test_spawned_child_applies_the_patch(patched):
    """What `ft serve` spawns is pickled by reference to our wrappers; a spawned child that
    imports them applies the patch from the environment the parent set."""
    from freetoken.server import launch
    for name in ("_run_scheduler", "_run_tokenize_worker"):
        assert b"freetoken_patch.upstream.spawn" in pickle.dumps(getattr(launch, name))
    assert all(doctor.spawned_child_hooks().values())


def test_child_of_reverted_parent_is_unpatched(freetoken):
    hooks.apply()
    hooks.revert()
    assert not any(doctor.spawned_child_hooks().values())


def test_doctor_healthy_here(patched):
    r = doctor.report()
    assert doctor.healthy(r), doctor.render(r)
    assert "spawn target _run_scheduler -> freetoken_patch.upstream.spawn.run_scheduler" in doctor.render(r)
