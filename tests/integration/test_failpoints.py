"""Fail points fire where and when they are told, once per run; damaged checkpoints are refused."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from harness.chaos.faults import tiny_settings as tiny
from streamrl import failpoints
from streamrl.config import RunConfig
from streamrl.runtime.actors import GroupAudit, StepResult
from streamrl.runtime.interrupts import interrupts_deferred
from streamrl.runtime.launch import Run, prepare
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


@pytest.mark.parametrize("damage, named", [
    (lambda c: (c / "checksums.json").write_text("[]"), "checksums.json is not a mapping"),
    (lambda c: (c / "checksums.json").write_text("{}"), "checksums.json does not list meta.json"),
    (lambda c: (c / "checksums.json").write_bytes(b"\xff\xfe{"), "checksums.json is not valid JSON"),
    (lambda c: _rewrite_meta(c, {"written_at": 1.0}), "meta.json's step is None"),
    (lambda c: _rewrite_meta(c, ["step", 4]), "meta.json is not a JSON object"),
])
def test_checkpoint_files_of_the_wrong_shape_are_refused_as_damaged(tmp_path, damage, named):
    """Valid JSON of the wrong shape crashed the resume with AttributeError or KeyError."""
    run_dir = write_checkpoints(tmp_path)
    damage(run_dir.step_dir(4))
    with pytest.raises(RunDirError, match=named):
        run_dir.verified_checkpoint()


def _rewrite_meta(checkpoint, meta):
    """meta.json changed and its checksum with it: well formed, wrongly shaped."""
    from streamrl.runtime.rundir import sha256_file

    (checkpoint / "meta.json").write_text(json.dumps(meta))
    listing = json.loads((checkpoint / "checksums.json").read_text())
    listing["meta.json"] = sha256_file(checkpoint / "meta.json")
    (checkpoint / "checksums.json").write_text(json.dumps(listing))


def test_a_latest_pointer_that_is_not_text_is_refused(tmp_path):
    run_dir = write_checkpoints(tmp_path)
    (run_dir.checkpoints / "latest").write_bytes(b"\xffstep")
    with pytest.raises(RunDirError, match="does not name a checkpoint"):
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
    """Ctrl-C between the rename and `latest` (seen in CI; now only a second Ctrl-C can land there): the
    final checkpoint at the same step adopts the directory instead of failing on it."""
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


def test_a_held_ctrl_c_is_raised_after_the_block_a_second_one_at_once():
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    finished = []
    try:
        with pytest.raises(KeyboardInterrupt):
            with interrupts_deferred():
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)  # the handler has run by now: without the hold it would have raised here
                finished.append(True)
        assert finished == [True] and signal.getsignal(signal.SIGINT) is signal.default_int_handler
        with interrupts_deferred():  # nothing came: nothing is raised
            finished.append(True)
        with pytest.raises(KeyboardInterrupt):  # Ctrl-C twice: at once
            with interrupts_deferred():
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)
                finished.append(True)
        assert finished == [True, True] and signal.getsignal(signal.SIGINT) is signal.default_int_handler
        noticed = []
        with interrupts_deferred(raise_after=False, notice=lambda: noticed.append(True)):  # the stop itself
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
            finished.append(True)
        assert finished == [True, True, True] and noticed == [True]
        with pytest.raises(KeyboardInterrupt):  # and twice aborts it
            with interrupts_deferred(raise_after=False):
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)
                finished.append(True)
        assert finished == [True, True, True] and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_ctrl_c_while_a_step_is_recorded_leaves_its_metrics_audit_and_counter_in_agreement(tmp_path, monkeypatch):
    """Seen in CI: a Ctrl-C between the step counter and metrics.jsonl gave a checkpoint at step 5 and a
    summary of 4 steps. The step is now recorded whole and `finish` sees nothing left to record."""
    config, run_dir, _ = prepare(None, tiny(tmp_path, "recording"))
    run = Run(config, run_dir)
    run._pending = "a finished step's reference"
    monkeypatch.setattr(run, "_queue_status", lambda: {"queued_groups": 0, "running": 0, "admitted": 0,
                                                       "over_budget": 0})
    real_append = run_dir.append

    def interrupted_append(name, record):
        if name == "metrics.jsonl":
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
        real_append(name, record)

    monkeypatch.setattr(run_dir, "append", interrupted_append)
    result = StepResult(version=1, trained_tokens=40, reward_mean=0.5, staleness_mean=0.0, staleness_max=0, max_staleness=1,
                        trainer_wait_s=0.1, metrics={"loss": 0.2},
                        audit=GroupAudit(group_ids=["g"], prompt_ids=[3], producer_ids=[0], staleness=[0]))
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            run._record(result, step_wall=1.0, started=time.perf_counter())
    finally:
        signal.signal(signal.SIGINT, previous)
    metrics = [json.loads(line) for line in (run_dir.path / "metrics.jsonl").read_text().splitlines()]
    audit = [json.loads(line) for line in (run_dir.path / "groups.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [a["step"] for a in audit] == [run.step] == [1]
    assert run.trained_tokens == 40 and run._pending is None and result.version == 1  # the result is untouched


def test_a_resume_removes_checkpoints_of_later_steps_that_latest_never_pointed_to(tmp_path, monkeypatch):
    """A launcher killed between a checkpoint's rename and `latest` leaves a complete step_6 that is not
    in force; the resumed run trains steps 4-6 again and must write its own step_6, not adopt that one."""
    _, run_dir, _ = prepare(None, tiny(tmp_path, "orphan", "run.steps=10"))
    run_dir.write_checkpoint(3, lambda tmp: None, {"step": 3}, keep=3)
    def killed(target, keep):
        raise KeyboardInterrupt  # stands for the SIGKILL right after the rename

    monkeypatch.setattr(run_dir, "make_latest", killed)
    with pytest.raises(KeyboardInterrupt):
        run_dir.write_checkpoint(6, lambda tmp: None, {"step": 6}, keep=3)
    monkeypatch.undo()
    assert run_dir.step_dir(6).is_dir() and run_dir.latest_checkpoint().name == "step_000003"
    config, opened, checkpoint = prepare(None, ["logging.progress=none"], resume=str(run_dir.path))
    assert checkpoint.name == "step_000003"
    assert sorted(p.name for p in opened.checkpoints.glob("step_*")) == ["step_000003", "step_000006"]  # not yet
    assert opened.rewind(3, config) == ["step_000006"]  # once the resumed run has started (`launch`)
    assert sorted(p.name for p in opened.checkpoints.glob("step_*")) == ["step_000003"]
