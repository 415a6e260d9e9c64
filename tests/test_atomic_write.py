"""A file is replaced whole or not at all, with the permissions of the file it replaces."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from synthetic import make_profile

import autosplit
from autosplit import atomic_write
from autosplit.atomic_write import write_text_atomic


def failing_rename(src: str, dst: str) -> None:
    raise OSError(28, "No space left on device")


def test_a_failed_rename_leaves_the_old_file_and_no_temporary(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    target = tmp_path / "plan.json"
    target.write_text("the previous plan")
    monkeypatch.setattr(atomic_write.os, "replace", failing_rename)
    with pytest.raises(OSError, match="No space left"):
        write_text_atomic(target, "the new plan")
    assert target.read_text() == "the previous plan"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]


def test_the_replaced_files_permissions_are_kept(tmp_path: Path) -> None:
    target = tmp_path / "profile.json"
    target.write_text("{}")
    os.chmod(target, 0o640)
    write_text_atomic(target, "new")
    assert target.read_text() == "new"
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o640


def test_a_new_file_gets_the_umasks_permissions(tmp_path: Path) -> None:
    umask = os.umask(0o022)
    try:
        write_text_atomic(tmp_path / "new.json", "x")
    finally:
        os.umask(umask)
    assert stat.S_IMODE(os.stat(tmp_path / "new.json").st_mode) == 0o644


def test_plan_and_profile_save_replace_the_file_whole(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    prof = make_profile([1, 2], [[1.0, 1.0]] * 4, batch_size=4)
    plan = autosplit.plan(prof, 2)
    for record, name in ((prof, "profile.json"), (plan, "plan.json")):
        path = tmp_path / name
        path.write_text("kept")
        with monkeypatch.context() as patched:
            patched.setattr(atomic_write.os, "replace", failing_rename)
            with pytest.raises(OSError):
                record.save(path)
        assert path.read_text() == "kept"
        record.save(path)
        assert type(record).load(path) == record
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json", "profile.json"]
