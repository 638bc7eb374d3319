"""Faults injected into real runs (actors killed with SIGKILL, signals in every phase): the run survives
what it can, stops cleanly with a resumable checkpoint when it cannot, and loses or duplicates nothing."""

import json
import os
import signal
import sys
import threading
import time

import pytest
import ray
from checkout import FAKE_SGLANG
from launching import launch_subprocess, resume_tiny, run_tiny, tiny

from harness.chaos.audit import audit_run
from streamrl import failpoints
from streamrl.buffer.checkpoint import load_queue
from streamrl.runtime.launch import RunFailed
from streamrl.runtime.rundir import RunDir

pytestmark = pytest.mark.ray


@pytest.fixture
def armed(tmp_path, monkeypatch):
    """Arm fail points for this test's runs (the driver hands them to its actors)."""
    directory = tmp_path / "failpoints"
    directory.mkdir()

    def arm(spec: str) -> str:
        monkeypatch.setenv(failpoints.ENV_SPEC, spec)
        monkeypatch.setenv(failpoints.ENV_DIR, str(directory))
        return str(directory)
    return arm


def assert_nothing_lost_or_repeated(run_dir, steps):
    audit = audit_run(run_dir.path)
    assert audit["steps"] == steps and audit["steps_in_order"], audit
    assert audit["groups_lost"] == 0 and audit["groups_duplicated"] == 0, audit


def events(run_dir):
    return [e["event"] for e in run_dir.read("events.jsonl")]


def test_producers_killed_mid_generation_and_right_after_a_commit_are_replaced(ray_local, tmp_path, armed):
    directory = armed("producer.generate=kill@3;producer.after_commit=kill@4")
    summary, run_dir = run_tiny(tmp_path, "producer-deaths", "run.steps=6", "producers.count=2")
    assert sorted(failpoints.fired(directory)) == ["producer.after_commit", "producer.generate"]
    assert summary["stopped_by"] == "steps" and summary["producer_restarts"] == 2
    replaced = run_dir.read("events.jsonl")
    assert [e["event"] for e in replaced] == ["producer_replaced"] * 2
    # the producer killed mid-generation held running groups: they went back and were generated again
    assert sum(e["prompts_returned"] for e in replaced) >= 1
    # a batch committed just before its producer died belongs to the queue: it is trained, nothing is lost
    assert_nothing_lost_or_repeated(run_dir, 6)


def test_a_producer_that_dies_while_the_others_keep_the_trainer_fed_is_replaced(ray_local, tmp_path, armed):
    """The trainer never starves (three producers, a wide staleness budget, no evaluations): every step
    returns within a fraction of a second, yet the dead producer is noticed at once — before, it was looked
    at only while a trainer call took over 0.5 s, so it was never replaced, its running tickets held their
    slots and its weights hold kept old versions alive until the end."""
    directory = armed("producer.generate=kill@4")
    summary, run_dir = run_tiny(tmp_path, "fed", "run.steps=30", "producers.count=3", "producers.num_cpus=0.3", "queue.max_staleness=8",
                                "queue.max_in_flight=24", "run.eval_every=0", "run.checkpoint_every=0")
    assert failpoints.fired(directory) == ["producer.generate"]
    (replaced,) = run_dir.read("events.jsonl")
    assert replaced["event"] == "producer_replaced" and summary["producer_restarts"] == 1
    assert replaced["step"] < 30, "noticed only when the run stopped"
    assert len(summary["producers"]) == 3
    assert summary["queue"]["running"] == 0  # no ticket of the dead producer kept its slot
    logs = run_dir.path / "logs"
    dead = replaced["producer"]
    assert f"producer {dead} died at step" in (logs / "driver.log").read_text()
    assert f"producer {dead} is gone: its running tickets" in (logs / "queue.log").read_text()
    assert f"producer {dead} started" in (logs / f"producer-{dead}-restart1.log").read_text()
    assert_nothing_lost_or_repeated(run_dir, 30)


def test_an_sglang_producer_killed_after_a_commit_is_replaced_and_the_trainer_sends_to_its_new_servers(
        ray_local, tmp_path, armed):
    """Weights by broadcast from the trainer: the dead producer's update groups are closed in the
    trainer, its replacement starts new servers (same ports) and opens new groups under new names."""
    # After a version went into the servers and well before the last step: a commit holds one or two groups,
    # so the 6th is at most 12 of the 32 groups trained (at the 14th, of 20, the run could already be over
    # when the producer died, and nothing was left to replace).
    directory = armed("producer.after_commit=kill@6")
    launcher = json.dumps([sys.executable, str(FAKE_SGLANG),
                           "--token-delay-s", "0.001", "--update-delay-s", "0.01", "--pause-poll-s", "0.05"])
    summary, run_dir = run_tiny(tmp_path, "sglang-death", "run.steps=8", "producers.engine=sglang",
                                "producers.count=1", f"producers.sglang.launcher={launcher}",
                                "producers.sglang.servers=2", "producers.sglang.base_port=31760",
                                "producers.sglang.weights=distributed")
    assert failpoints.fired(directory) == ["producer.after_commit"]
    assert summary["stopped_by"] == "steps" and summary["producer_restarts"] == 1
    (replaced,) = run_dir.read("events.jsonl")
    # groups open lazily, at a server's first load: by the kill one or both servers had theirs
    assert replaced["event"] == "producer_replaced" and replaced["update_groups_closed"] in (1, 2)
    (replacement,) = summary["producers"]
    assert replacement["loads"] >= 1  # versions broadcast into the new servers, over new groups
    assert summary["trainer_weight_broadcasts"]["groups"] >= 2  # each new server's own
    assert_nothing_lost_or_repeated(run_dir, 8)


def test_a_producer_that_keeps_dying_fails_the_run_once_restarts_are_used_up(ray_local, tmp_path, armed):
    armed("producer.generate=kill")
    with pytest.raises(RunFailed, match="producers.max_restarts = 0"):
        run_tiny(tmp_path, "no-restarts", "run.steps=4", "producers.count=1", "producers.max_restarts=0")


def test_a_producer_that_raises_stops_the_run_with_a_checkpoint_that_resumes(ray_local, tmp_path, armed):
    """A producer's own error is not mended by a restart, but the trainer and queue are whole: the run
    stops with a final checkpoint and summary, then fails naming the producer and how to go on (before,
    it failed at once, losing every step since the last periodic checkpoint)."""
    armed("producer.generate=raise@3")
    with pytest.raises(RunFailed, match=r"producer \d: .*FailPointError.*checkpoint at step \d+.*--resume") as caught:
        run_tiny(tmp_path, "producer-raises", "run.steps=100000", "run.checkpoint_every=0", "producers.count=2")
    assert "\n" not in str(caught.value)
    run_dir = RunDir.open(tmp_path / "producer-raises")
    summary = json.loads((run_dir.path / "summary.json").read_text())
    steps = summary["steps"]
    assert summary["stopped_by"] == "producer_failed" and run_dir.latest_checkpoint().name.endswith(f"{steps:06d}")
    assert "producer_failed" in events(run_dir)
    summary = resume_tiny(run_dir, f"run.steps={steps + 2}")
    assert summary["stopped_by"] == "steps"
    assert_nothing_lost_or_repeated(run_dir, steps + 2)


def interrupted_at(point: str, spec: str, tmp_path, sets: list[str], resume=None) -> tuple[int, str]:
    """`streamrl launch` from a terminal with fail points `spec`, and a Ctrl-C once `point` fires (a
    `sleep` there holds the phase open for it): its exit status and output."""
    directory = tmp_path / "failpoints"
    directory.mkdir()
    proc = launch_subprocess(sets, address=ray.get_runtime_context().gcs_address, resume=resume,
                             env={failpoints.ENV_SPEC: spec, failpoints.ENV_DIR: str(directory)})
    deadline = time.monotonic() + 180
    while point not in failpoints.fired(directory):
        if proc.poll() is not None or time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"{point} never fired: {proc.communicate(timeout=60)[0][-2000:]}")
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGINT)
    output = proc.communicate(timeout=120)[0]
    return proc.returncode, output


def ctrl_c_at(point: str, spec: str, tmp_path, name: str, *extra: str) -> tuple[int, str, RunDir]:
    """`interrupted_at` on a fresh tiny run: its exit status, output and run directory."""
    status, output = interrupted_at(point, spec, tmp_path, tiny(tmp_path, name, *extra))
    return status, output, RunDir.open(tmp_path / name)


def test_a_ctrl_c_as_a_fresh_launch_makes_its_run_directory_leaves_no_folder_behind(ray_local, tmp_path):
    """Before: a traceback, and the run directory (with the parent folders made for it) left holding
    only config.toml, so that the same command was then refused as "already exists"."""
    sets = tiny(tmp_path, "fresh", f"run.output_dir={json.dumps(str(tmp_path / 'made' / 'deeper'))}")
    status, output = interrupted_at("launch.run_dir_made", "launch.run_dir_made=sleep:30", tmp_path, sets)
    assert status == 130, output
    assert "streamrl: interrupted before the run started; nothing was trained or changed" in output
    assert "Traceback" not in output
    assert not (tmp_path / "made").exists()


def test_a_ctrl_c_while_a_resume_is_checked_changes_nothing(ray_local, tmp_path):
    _, run_dir = run_tiny(tmp_path, "checked", "run.steps=2")
    before = {path: path.read_bytes() for path in run_dir.path.rglob("*") if path.is_file()}
    status, output = interrupted_at("launch.resume_checked", "launch.resume_checked=sleep:30", tmp_path,
                                    ["run.steps=4"], resume=run_dir.path)
    assert status == 130, output
    assert "interrupted before the run started" in output and "Traceback" not in output
    assert {path: path.read_bytes() for path in run_dir.path.rglob("*") if path.is_file()} == before


def test_a_ctrl_c_just_after_a_step_is_asked_for_records_that_step_and_the_checkpoint_resumes(ray_local, tmp_path):
    """The first step of a launch (and the one after an evaluation or checkpoint) was asked for outside
    the Ctrl-C guard: interrupted there, the trainer trained it unrecorded while the final checkpoint was
    written, whose metadata then said one step less than its trainer and queue (resume refused)."""
    status, output, run_dir = ctrl_c_at("launch.step_asked", "launch.step_asked=sleep:3", tmp_path, "asked",
                                        "run.steps=100000", "run.checkpoint_every=0")
    assert status == 130, output
    summary = json.loads((run_dir.path / "summary.json").read_text())
    assert summary["stopped_by"] == "interrupted" and summary["steps"] == 1
    assert [m["step"] for m in run_dir.read("metrics.jsonl")] == [1]
    assert run_dir.latest_checkpoint().name == "step_000001"
    summary = resume_tiny(run_dir, "run.steps=3")
    assert summary["stopped_by"] == "steps"
    assert_nothing_lost_or_repeated(run_dir, 3)


def test_a_ctrl_c_while_a_failed_producers_run_writes_its_checkpoint_waits_for_it(ray_local, tmp_path):
    """As when a run ends by itself: the first Ctrl-C lets the final checkpoint finish (it deleted the
    half-written checkpoint before, and with checkpoint_every = 0 the run had none)."""
    status, output, run_dir = ctrl_c_at("checkpoint.write", "producer.generate=raise@3;checkpoint.write=sleep:3",
                                        tmp_path, "failed-producer", "run.steps=100000", "run.checkpoint_every=0",
                                        "producers.count=2")
    assert status == 1, output  # the run failed, naming the producer, after its checkpoint
    assert "FailPointError" in output
    assert "interrupted while the finished run stops" in (run_dir.path / "logs" / "driver.log").read_text()
    summary = json.loads((run_dir.path / "summary.json").read_text())
    assert summary["stopped_by"] == "producer_failed"
    assert run_dir.latest_checkpoint().name == f"step_{summary['steps']:06d}"


def test_a_trainer_killed_mid_step_resumes_from_the_last_checkpoint(ray_local, tmp_path, armed):
    armed("trainer.train=kill@4")  # in the 4th step, after the checkpoint of step 2
    with pytest.raises(RunFailed, match=r"the trainer actor died at step 3.*To resume from step_000002") as caught:
        run_tiny(tmp_path, "trainer-death", "run.steps=5", "run.checkpoint_every=2", "producers.count=2")
    assert "streamrl launch --resume" in str(caught.value)
    run_dir = RunDir.open(tmp_path / "trainer-death")
    assert events(run_dir) == ["run_failed"]
    summary = resume_tiny(run_dir)
    assert summary["stopped_by"] == "steps" and summary["steps"] == 5
    # steps 3 trained before the death and the groups generated after the checkpoint are gone with the
    # roll-back: step 3 onwards is trained once, from the checkpoint's queue and regenerated prompts
    assert_nothing_lost_or_repeated(run_dir, 5)


def test_a_trainer_that_raises_mid_step_fails_the_run_in_one_line_naming_the_checkpoint(ray_local, tmp_path, armed):
    """A trainer that raised (alive, its step's state unknown) ended `streamrl launch` in a raw Ray
    traceback, without the resume line a dead trainer gets (outside review: an odd head size, an OOM)."""
    armed("trainer.train=raise@4")
    with pytest.raises(RunFailed, match=r"TrainerActor.step raised at step 3 \(.*FailPointError.*\); the run stopped"
                                        r"\. To resume from step_000002") as caught:
        run_tiny(tmp_path, "trainer-raises", "run.steps=5", "run.checkpoint_every=2", "producers.count=2")
    assert "\n" not in str(caught.value)
    run_dir = RunDir.open(tmp_path / "trainer-raises")
    assert run_dir.read("events.jsonl")[-1]["raised"] == "TrainerActor.step"
    summary = resume_tiny(run_dir)
    assert summary["stopped_by"] == "steps" and summary["steps"] == 5
    assert_nothing_lost_or_repeated(run_dir, 5)


def test_a_killed_queue_stops_the_run_quickly_with_a_resumable_checkpoint(ray_local, tmp_path):
    killed = {}

    def kill_queue_after_step_3():
        metrics = tmp_path / "queue-death" / "metrics.jsonl"
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
            time.sleep(0.1)
        queue = ray.get_actor("queue-death/queue", namespace="streamrl")
        os.kill(ray.get(queue.pid.remote()), signal.SIGKILL)
        killed["at"] = time.monotonic()

    killer = threading.Thread(target=kill_queue_after_step_3, daemon=True)
    killer.start()
    with pytest.raises(RunFailed, match=r"the queue actor died.*To resume from step_00000[24]"):
        run_tiny(tmp_path, "queue-death", "run.steps=1000", "run.checkpoint_every=2", "producers.count=2")
    stopped_within = time.monotonic() - killed["at"]
    assert stopped_within < 30, stopped_within  # no hang: producers and trainer fail fast on the dead queue
    run_dir = RunDir.open(tmp_path / "queue-death")
    summary = resume_tiny(run_dir, "run.steps=6")  # the checkpoint may be step 4: the kill lands in steps 3–5
    assert summary["steps"] == 6
    assert_nothing_lost_or_repeated(run_dir, 6)


def launch_joining(tmp_path, name, *extra, env=None):
    """A launcher that joins the tests' Ray instance."""
    items = tiny(tmp_path, name, "run.steps=100000", "run.checkpoint_every=2", "producers.count=2", *extra)
    return launch_subprocess(items, address=ray.get_runtime_context().gcs_address, env=env)


def wait_for_fail_point(proc, directory, name, timeout=90):
    deadline = time.time() + timeout
    while name not in failpoints.fired(directory):
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            pytest.fail(f"fail point {name} not reached: {proc.communicate()[0][-3000:]}")
        time.sleep(0.1)


def launch_held_at(tmp_path, name, point, *extra):
    """A launcher joining the tests' Ray, returned once it holds fail point `point` (NAME=sleep:S...)."""
    directory = tmp_path / "failpoints"
    directory.mkdir()
    proc = launch_joining(tmp_path, name, *extra, env={failpoints.ENV_SPEC: point, failpoints.ENV_DIR: str(directory)})
    wait_for_fail_point(proc, directory, point.partition("=")[0])
    return proc


def signal_and_wait(proc, signum):
    """Ctrl-C as a terminal sends it (to the whole foreground group), or SIGTERM as a scheduler does; the
    launcher's output once it exited."""
    if signum == signal.SIGINT:
        os.killpg(proc.pid, signal.SIGINT)
    else:
        proc.send_signal(signal.SIGTERM)
    return proc.communicate(timeout=120)[0]


def assert_consistent_final_checkpoint(run_dir):
    checkpoint = run_dir.verified_checkpoint()  # every file matches its checksum
    meta = json.loads((checkpoint / "meta.json").read_text())
    assert load_queue(checkpoint / "queue").version == meta["step"]  # queue and trainer at the same version
    assert not list(run_dir.checkpoints.glob(".step_*"))  # no half-written directory left


def assert_nothing_left(proc, name):
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)  # nothing of the launcher's process group is left
    for role in ("queue", "weights", "trainer", "producer-0", "producer-1"):
        with pytest.raises(ValueError):
            ray.get_actor(f"{name}/{role}", namespace="streamrl")


@pytest.mark.parametrize("phase, point, signum", [
    ("generation", "producer.generate=sleep:4@2", signal.SIGINT),
    ("training step", "trainer.train=sleep:4@3", signal.SIGINT),
    ("training step", "trainer.train=sleep:4@3", signal.SIGTERM),
    ("weight publish", "trainer.publish=sleep:4@3", signal.SIGTERM),
    ("weight publish", "trainer.publish=sleep:4@3", signal.SIGINT),
    ("checkpoint write", "checkpoint.write=sleep:4", signal.SIGINT),
    ("checkpoint write", "checkpoint.write=sleep:4", signal.SIGTERM),
])
def test_a_signal_in_any_phase_stops_cleanly_with_a_consistent_checkpoint(ray_local, tmp_path, phase, point, signum):
    name = "signalled"
    proc = launch_held_at(tmp_path, name, point)
    output = signal_and_wait(proc, signum)
    assert proc.returncode == 130, output[-3000:]
    run_dir = RunDir.open(tmp_path / name)
    summary = json.loads((run_dir.path / "summary.json").read_text())
    assert summary["stopped_by"] == "interrupted"
    assert_consistent_final_checkpoint(run_dir)
    assert_nothing_lost_or_repeated(run_dir, summary["steps"])
    assert_nothing_left(proc, name)


def test_a_resume_of_a_run_still_going_is_refused_and_changes_nothing(ray_local, tmp_path):
    """Accepted, it rewound the live run's files (metrics.jsonl cut from 92 lines to 51 under it) and would
    have trained a second copy of the run into the same directory."""
    from streamrl.runtime.launch import prepare
    from streamrl.runtime.rundir import RunDirError

    proc = launch_joining(tmp_path, "live")
    run_dir = RunDir(tmp_path / "live")  # opened once the launcher has made it
    deadline = time.time() + 90
    while not (run_dir.checkpoints / "latest").is_file() or len(run_dir.read("metrics.jsonl")) < 3:
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.2)
    with pytest.raises(RunDirError, match=rf"in use by another streamrl launch \(pid {proc.pid}\)"):
        prepare(None, ["logging.progress=none"], resume=str(run_dir.path))
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, output[-3000:]
    summary = json.loads((run_dir.path / "summary.json").read_text())
    assert [m["step"] for m in run_dir.read("metrics.jsonl")] == list(range(1, summary["steps"] + 1))
    assert_nothing_left(proc, "live")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_a_finished_run_stops_waits_for_its_final_checkpoint(ray_local, tmp_path, signum):
    """It aborted the stop as a second Ctrl-C would: no final checkpoint, no summary."""
    name = "finishing"
    proc = launch_held_at(tmp_path, name, "launch.stop_producers=sleep:4", "run.steps=6", "run.checkpoint_every=4")
    output = signal_and_wait(proc, signum)
    assert proc.returncode == 0, output[-3000:]
    run_dir = RunDir.open(tmp_path / name)
    assert "the final checkpoint is written first" in (run_dir.path / "logs" / "driver.log").read_text()
    summary = json.loads((run_dir.path / "summary.json").read_text())
    assert summary["stopped_by"] == "steps" and summary["steps"] == 6
    assert run_dir.latest_checkpoint_name() == "step_000006"
    assert_consistent_final_checkpoint(run_dir)
    assert_nothing_left(proc, name)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_during_start_up_leaves_nothing(ray_local, tmp_path, signum):
    proc = launch_held_at(tmp_path, "early", "launch.start=sleep:4")
    output = signal_and_wait(proc, signum)
    assert proc.returncode == 130 and "nothing was trained" in output, output[-3000:]
    assert not (tmp_path / "early").exists()  # the same command can simply be run again
    assert_nothing_left(proc, "early")


def test_a_driver_killed_while_writing_a_checkpoint_resumes_from_the_previous_one(ray_local, tmp_path):
    directory = tmp_path / "failpoints"
    directory.mkdir()
    proc = launch_joining(tmp_path, "torn", env={failpoints.ENV_SPEC: "checkpoint.write=kill@2",
                                                 failpoints.ENV_DIR: str(directory)})
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL, output[-3000:]
    run_dir = RunDir.open(tmp_path / "torn")
    assert list(run_dir.checkpoints.glob(".step_000004.tmp-*"))  # the torn write is still on disk
    assert run_dir.verified_checkpoint().name == "step_000002"  # and the previous checkpoint is in force
    summary = resume_tiny(run_dir, "run.steps=4")
    assert summary["steps"] == 4
    assert not list(run_dir.checkpoints.glob(".step_*"))
    assert_nothing_lost_or_repeated(run_dir, 4)


def test_ctrl_c_on_a_run_that_started_its_own_ray_stops_it_and_leaves_no_process(tmp_path):
    """The default path: no --address, so the launcher's Ray (GCS, raylet, workers) is in the terminal's
    process group and gets the Ctrl-C too; the run still stops with a checkpoint and Ray goes with it."""
    proc = launch_subprocess(tiny(tmp_path, "own-ray", "run.steps=100000", "run.checkpoint_every=2"))
    metrics = tmp_path / "own-ray" / "metrics.jsonl"
    deadline = time.time() + 120
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            pytest.fail(proc.communicate()[0][-3000:])
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, output[-3000:]
    run_dir = RunDir.open(tmp_path / "own-ray")
    assert json.loads((run_dir.path / "summary.json").read_text())["stopped_by"] == "interrupted"
    assert_consistent_final_checkpoint(run_dir)
    deadline = time.time() + 10
    while time.time() < deadline:  # Ray's processes exit a moment after the launcher
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)
