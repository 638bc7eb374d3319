"""A fresh run directory that never trained is removed whole, with the parent folders made for it."""

import pytest

from streamrl.config import RunConfig
from streamrl.runtime.rundir import RunDir


def test_discarding_an_unstarted_run_removes_the_parent_folders_it_made(tmp_path):
    run_dir = RunDir.create(tmp_path / "made" / "deeper" / "run", RunConfig())
    run_dir.discard_unstarted()
    assert list(tmp_path.iterdir()) == []


def test_a_parent_folder_that_existed_or_gained_another_run_stays(tmp_path):
    (tmp_path / "kept").mkdir()
    run_dir = RunDir.create(tmp_path / "kept" / "made" / "run", RunConfig())
    RunDir.create(tmp_path / "kept" / "made" / "other", RunConfig())  # another launch meanwhile
    run_dir.discard_unstarted()
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == [
        "kept", "kept/made", "kept/made/other", "kept/made/other/config.toml"]
    RunDir.open(tmp_path / "kept" / "made" / "other").discard_unstarted()  # opened, not made: parents stay
    assert [p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")] == ["kept", "kept/made"]


def test_a_config_that_cannot_be_written_leaves_no_run_directory(tmp_path, monkeypatch):
    def interrupted(self, config):
        (self.path / "config.toml").write_text("[run]\n")  # half done when the Ctrl-C lands
        raise KeyboardInterrupt

    monkeypatch.setattr(RunDir, "save_config", interrupted)
    with pytest.raises(KeyboardInterrupt):
        RunDir.create(tmp_path / "made" / "run", RunConfig())
    assert list(tmp_path.iterdir()) == []
