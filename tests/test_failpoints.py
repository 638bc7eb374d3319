"""Fail points fire where and when they are told, once per run; damaged checkpoints are refused."""

import json
import os
import subprocess
import sys

import pytest

from streamrl import failpoints
from streamrl.config import RunConfig
from streamrl.runtime.rundir import RunDir, RunDirError


def test_a_spec_parses_and_a_malformed_one_is_refused():
    assert failpoints.parse("a=kill@2; b=sleep:1.5;c=raise") == {"a": ("kill", 2), "b": ("sleep:1.5", 1),
                                                                "c": ("raise", 1)}
    for bad in ("a", "=kill", "a=explode", "a=sleep:x", "a=kill@0", "a=kill@two"):
        with pytest.raises(ValueError, match="STREAMRL_FAILPOINTS"):
            failpoints.parse(bad)


def test_a_fail_point_fires_on_its_nth_hit_once_per_run(tmp_path, monkeypatch):
    monkeypatch.setenv(failpoints.ENV_SPEC, "step=raise@2")
    monkeypatch.setenv(failpoints.ENV_DIR, str(tmp_path))
    failpoints._hits.clear()
    failpoints.hit("step")  # first hit: armed for the second
    failpoints.hit("elsewhere")
    with pytest.raises(failpoints.FailPointError):
        failpoints.hit("step")
    failpoints._hits.clear()  # as in a replacement process
    failpoints.hit("step")
    failpoints.hit("step")  # claimed already: does not fire again
    assert failpoints.fired(tmp_path) == ["step"]
    assert failpoints.actor_env() == {failpoints.ENV_SPEC: "step=raise@2", failpoints.ENV_DIR: str(tmp_path)}


def test_kill_is_a_sigkill_no_cleanup_runs(tmp_path):
    code = ("import atexit, pathlib; from streamrl import failpoints; "
            f"atexit.register(lambda: pathlib.Path({str(tmp_path / 'cleaned')!r}).touch()); failpoints.hit('x')")
    env = {failpoints.ENV_SPEC: "x=kill", failpoints.ENV_DIR: str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env})
    assert proc.returncode == -9 and not (tmp_path / "cleaned").exists()
    assert failpoints.fired(tmp_path) == ["x"]


def write_checkpoints(tmp_path) -> RunDir:
    run_dir = RunDir.create(tmp_path / "run", RunConfig())
    for step in (2, 4):
        def write(tmp, step=step):
            (tmp / "trainer").mkdir()
            (tmp / "trainer" / "model.safetensors").write_bytes(bytes(range(256)) * 8)
            (tmp / "queue.arrow").write_bytes(b"q" * 100)
        run_dir.write_checkpoint(step, write, {"step": step}, keep=2)
    return run_dir


@pytest.mark.parametrize("damage, named", [
    (lambda p: p.write_bytes(p.read_bytes()[:-7]), "trainer/model.safetensors does not match"),  # truncated
    (lambda p: p.write_bytes(bytes([p.read_bytes()[0] ^ 0x10]) + p.read_bytes()[1:]),
     "trainer/model.safetensors does not match"),  # one bit flipped
    (lambda p: p.unlink(), "trainer/model.safetensors is missing"),
])
def test_a_damaged_checkpoint_is_refused_naming_the_file_and_the_one_that_verifies(tmp_path, damage, named):
    run_dir = write_checkpoints(tmp_path)
    assert run_dir.verified_checkpoint().name == "step_000004"
    damage(run_dir.step_dir(4) / "trainer" / "model.safetensors")
    before = sorted(str(p) for p in run_dir.path.rglob("*"))
    with pytest.raises(RunDirError, match=named) as caught:
        run_dir.verified_checkpoint()
    assert "step_000002 verifies" in str(caught.value)
    assert sorted(str(p) for p in run_dir.path.rglob("*")) == before  # refusing changed nothing


def test_a_checkpoint_without_its_checksums_is_refused(tmp_path):
    run_dir = write_checkpoints(tmp_path)
    (run_dir.step_dir(4) / "checksums.json").unlink()
    with pytest.raises(RunDirError, match="checksums.json is missing"):
        run_dir.verified_checkpoint()


def test_a_write_killed_half_way_leaves_the_previous_checkpoint_in_force(tmp_path):
    run_dir = write_checkpoints(tmp_path)

    def interrupted(tmp):
        (tmp / "meta.json").write_text(json.dumps({"step": 6}))
        raise KeyboardInterrupt  # stands for the process dying here; a SIGKILL leaves the temporary directory

    with pytest.raises(KeyboardInterrupt):
        run_dir.write_checkpoint(6, interrupted, {"step": 6}, keep=2)
    assert run_dir.verified_checkpoint().name == "step_000004"
    stale = run_dir.checkpoints / ".step_000006.tmp-deadbeef"  # what a SIGKILL mid-write leaves
    stale.mkdir()
    run_dir.write_checkpoint(6, lambda tmp: None, {"step": 6}, keep=2)
    assert not stale.exists() and run_dir.verified_checkpoint().name == "step_000006"


def test_a_write_interrupted_after_its_directory_is_in_place_is_finished_not_written_twice(tmp_path, monkeypatch):
    """Ctrl-C between the rename and `latest` (seen in CI): the final checkpoint at the same step
    adopts the directory instead of failing on it."""
    run_dir = write_checkpoints(tmp_path)
    real = run_dir.make_latest
    calls = []

    def interrupted_once(target, keep):
        calls.append(target.name)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real(target, keep)

    monkeypatch.setattr(run_dir, "make_latest", interrupted_once)
    with pytest.raises(KeyboardInterrupt):
        run_dir.write_checkpoint(6, lambda tmp: None, {"step": 6}, keep=2)
    assert run_dir.step_dir(6).is_dir() and run_dir.latest_checkpoint().name == "step_000004"
    with pytest.raises(FileExistsError):  # what the launcher did before: write the same step again
        run_dir.write_checkpoint(6, lambda tmp: None, {"step": 6}, keep=2)
    run_dir.make_latest(run_dir.step_dir(6), keep=2)  # what it does now (Run.checkpoint)
    assert run_dir.verified_checkpoint().name == "step_000006"
    assert sorted(p.name for p in run_dir.checkpoints.glob("step_*")) == ["step_000004", "step_000006"]
