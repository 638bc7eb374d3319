import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
from checkout import ROOT

from streamrl.buffer import QueueConfig
from streamrl.buffer.actor import create_queue_actor
from streamrl.cli import main


def test_bench_lists_and_refuses_unknown_names(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert main(["bench"]) == 0
    listed = capsys.readouterr().out
    assert "buffer" in listed and "pipeline" in listed and "weights" in listed
    assert main(["bench", "nonexistent"]) == 2
    assert "unknown benchmark 'nonexistent'" in capsys.readouterr().err


def test_bench_outside_a_checkout_says_it_needs_one(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "buffer"]) == 2
    assert "runs the benchmarks of a source checkout" in capsys.readouterr().err


def test_a_benchmark_runs_through_the_cli_from_the_checkout(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "correction.json"
    assert main(["bench", "correction", "--repeats", "1", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["results"]


@pytest.mark.parametrize("argv, message", [
    (["pipeline", "--eta", "0"], "argument --eta: 0 is not at least 1"),
    (["pipeline", "--set", "queue.max_staleness=3"], "--set queue.max_staleness: the benchmark sets it"),
    (["pipeline", "--set", "ray.num_cpus=1"], "--set ray.num_cpus: the benchmark starts one local Ray instance"),
    (["pipeline", "--steps", "10"], "--steps is read with --engine torch only"),
    (["pipeline", "--engine", "torch", "--window-s", "10"], "--window-s is read with --engine sim only"),
    (["pipeline", "--sweep-etas", "2"], "--sweep-etas is read with --sweep only"),
    (["pipeline", "--engine", "torch", "--sweep"], "--sweep is read with --engine sim only"),
    (["staleness", "--etas", "0", "-1"], "'-1' is not a staleness budget"),
    (["staleness", "--quick", "--set", "trainer.lrr=1"], "staleness: invalid config: trainer.lrr"),
    (["buffer", "--repeats", "0"], "argument --repeats: 0 is not at least 1"),
    (["weights", "--out", "."], "--out . is a directory"),
])
def test_a_benchmark_refuses_bad_arguments_before_it_measures_anything(argv, message, capfd, monkeypatch):
    """Outside review: each of these started Ray and failed later with a traceback; the staleness grid ran
    its good runs first and then discarded them, and pipeline silently replaced a user's --set."""
    monkeypatch.chdir(ROOT)
    assert main(["bench", *argv]) != 0
    err = capfd.readouterr().err
    assert message in err and "Traceback" not in err


def test_bad_verb_and_action_exit_nonzero(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["admission", "explode", "--run", "x"])
    assert exc.value.code == 2 and "invalid choice: 'explode'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["admission", "status"])  # --run is required
    assert "--run" in capsys.readouterr().err


@pytest.mark.parametrize("address", ["127.0.0.1:notaport", "http://127.0.0.1:8265", "127.0.0.1:", "ray://head:0"])
def test_admission_refuses_a_malformed_cluster_address_in_one_line(address, capsys):
    """Ray's client raised ValueError on some of these (a traceback, exit status 1)."""
    assert main(["admission", "status", "--run", "x", "--address", address]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"streamrl: error: not a Ray cluster address: {address!r}") and err.count("\n") == 1


def test_auto_naming_a_ray_client_server_joins_it_through_ray_client(monkeypatch):
    """RAY_ADDRESS=ray://… resolved from `auto` was taken for a GCS address (probed, and refused)."""
    import ray

    from streamrl.runtime import connect

    joined = []
    monkeypatch.setenv("RAY_ADDRESS", "ray://127.0.0.1:10001")
    monkeypatch.setattr(ray, "init", lambda address, **kwargs: joined.append(address))
    connect.join_cluster("auto")
    assert joined == ["ray://127.0.0.1:10001"]


@pytest.mark.ray
def test_admission_pause_resume_status_against_a_named_queue(ray_local, capsys):
    queue = create_queue_actor("cli-run", QueueConfig(group_size=1, groups_per_step=1))
    try:
        assert main(["admission", "pause", "--run", "cli-run"]) == 0
        assert "admission paused" in capsys.readouterr().out
        assert main(["admission", "pause", "--run", "cli-run"]) == 0
        assert "it already was, by the operator" in capsys.readouterr().out
        assert ray.get(queue.admit.remote(0, 1)).blocked_by == "paused"
        assert main(["admission", "status", "--run", "cli-run", "--json"]) == 0
        status = json.loads(capsys.readouterr().out)
        assert status["paused"] is True and status["holds"] == ["operator"]
        # the launcher's shutdown hold is its own: the operator's resume leaves it in place, and says so
        assert ray.get(queue.pause.remote("shutdown")) is False
        assert main(["admission", "resume", "--run", "cli-run"]) == 0
        out = capsys.readouterr().out
        assert "admission resumed by the operator" in out and "stays paused while held by: shutdown" in out
        assert ray.get(queue.admit.remote(0, 1)).blocked_by == "paused"
        assert ray.get(queue.resume.remote("shutdown")) is True
        assert main(["admission", "resume", "--run", "cli-run"]) == 0
        assert "the operator had not paused admission" in capsys.readouterr().out
        assert len(ray.get(queue.admit.remote(0, 1)).tickets) == 1
        # --json for pause and resume too (it was ignored): what the action found and the status after it
        for action, was_set, paused in (("pause", False, True), ("pause", True, True), ("resume", True, False)):
            assert main(["admission", action, "--run", "cli-run", "--json"]) == 0
            answer = json.loads(capsys.readouterr().out)
            assert answer["action"] == action and answer["operator_hold_was_set"] is was_set
            assert answer["run"] == "cli-run" and answer["status"]["paused"] is paused
        assert main(["admission", "status", "--run", "no-such-run"]) == 2
        assert "no running streamrl run named 'no-such-run'" in capsys.readouterr().err
    finally:
        ray.kill(queue)


@pytest.mark.ray
def test_admission_against_a_run_that_ends_after_its_queue_is_found_says_so(ray_local, capsys, monkeypatch):
    """The run ending between the lookup of its queue and the call escaped as a RayActorError traceback."""
    import streamrl.buffer.actor

    found = streamrl.buffer.actor.get_queue_actor

    def found_then_ended(run):
        queue = found(run)
        ray.kill(queue)  # the run's shutdown, just after the lookup
        return queue

    queue = create_queue_actor("cli-ending", QueueConfig(group_size=2, groups_per_step=1))  # held: it lives
    monkeypatch.setattr(streamrl.buffer.actor, "get_queue_actor", found_then_ended)
    assert main(["admission", "pause", "--run", "cli-ending"]) == 2
    captured = capsys.readouterr()
    assert captured.err == "streamrl: error: run 'cli-ending' has ended: its queue actor is gone\n" and not captured.out
    ray.kill(queue)  # dead already (killed after the lookup); held until here, it lived until then


def test_the_final_line_handles_a_run_stopped_before_its_first_step():
    from streamrl.cli import describe_summary

    summary = {"stopped_by": "interrupted", "steps": 0, "elapsed_s": 0.0, "reward_first_10pct": None,
               "reward_last_10pct": None, "eval_accuracy_first": 0.0, "eval_accuracy_last": None,
               "staleness_max": 0, "max_staleness": 2}
    line = describe_summary(summary)
    assert line.startswith("interrupted at step 0") and "reward n/a → n/a" in line and "0.00 → n/a" in line


HOLDER = """
import sys
import ray
from streamrl.buffer import QueueConfig
from streamrl.buffer.actor import create_queue_actor
from streamrl.runtime.connect import start_local
start_local(num_cpus=1)  # as `streamrl launch` without an address: a Ray instance of its own
queue = create_queue_actor(sys.argv[1], QueueConfig(group_size=1, groups_per_step=1))
ray.get(queue.status.remote())
print("ready", flush=True)
sys.stdin.read()  # until the test closes it
"""


@pytest.mark.ray
def test_admission_finds_its_run_among_several_local_ray_instances(tmp_path):
    """Two runs launched on one machine each start their own Ray instance; `auto` picked one of them at
    random, so `--run A` answered "no running streamrl run named 'A'" about half the time."""
    from leftovers import track

    holders = [track(subprocess.Popen([sys.executable, "-c", HOLDER, name], stdin=subprocess.PIPE, text=True,
                                      stdout=subprocess.PIPE, start_new_session=True))
               for name in ("run-a", "run-b")]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}

    def admission(*args):
        return subprocess.run([sys.executable, "-m", "streamrl.cli", "admission", *args], capture_output=True,
                              text=True, timeout=120, env=env)
    try:
        for holder in holders:
            assert holder.stdout.readline().strip() == "ready"
        for name in ("run-a", "run-b", "run-a", "run-b"):
            done = admission("status", "--run", name, "--json")
            assert done.returncode == 0, done.stderr
        assert admission("pause", "--run", "run-b").returncode == 0
        assert json.loads(admission("status", "--run", "run-b", "--json").stdout)["holds"] == ["operator"]
        assert json.loads(admission("status", "--run", "run-a", "--json").stdout)["holds"] == []
        missing = admission("status", "--run", "run-c")
        assert missing.returncode == 2 and "no running streamrl run named 'run-c'" in missing.stderr
    finally:
        for holder in holders:
            holder.stdin.close()
            holder.wait(timeout=60)


def _processes() -> dict[int, tuple[int, int, int]]:
    """Every live process on this machine: pid → (parent pid, process group, start time); zombies are not live."""
    found = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue  # it exited meanwhile
        fields = stat[stat.rindex(")") + 2:].split()  # state, ppid, pgrp, ... starttime (the 20th)
        if fields[0] not in "ZX":
            found[int(entry.name)] = (int(fields[1]), int(fields[2]), int(fields[19]))
    return found


def _descendants(root: int) -> set[tuple[int, int]]:
    """(pid, start time) of `root` and every process below it: a pid alone could be another process's later."""
    processes, found = _processes(), {root}
    while grown := {pid for pid, (ppid, _, _) in processes.items() if ppid in found} - found:
        found |= grown
    return {(pid, processes[pid][2]) for pid in found if pid in processes}


def _still_running(started: set[tuple[int, int]]) -> set[tuple[int, int]]:
    return {(pid, since) for pid, (_, _, since) in _processes().items()} & started


@pytest.mark.ray
def test_sigterm_to_streamrl_bench_stops_the_benchmark_and_everything_it_started(tmp_path):
    """`timeout 60 streamrl bench pipeline` signalled `streamrl bench` alone: it died, and the benchmark
    with its Ray instance and actors ran on without it (outside review)."""
    from leftovers import track
    from test_bench_pipeline import TINY

    out = tmp_path / "pipeline.json"
    command = [sys.executable, "-m", "streamrl.cli", "bench", "pipeline", "--window-s", "600", "--out", str(out)]
    for item in TINY:
        command += ["--set", item]
    with open(tmp_path / "bench.log", "w") as log:
        bench = track(subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True))
    started: set[tuple[int, int]] = set()
    try:
        deadline = time.monotonic() + 300
        while not any(p.stat().st_size for p in tmp_path.glob("pipeline-runs/*/*/metrics.jsonl")):  # training
            assert bench.poll() is None and time.monotonic() < deadline, (tmp_path / "bench.log").read_text()
            time.sleep(0.5)
        started = _descendants(bench.pid) - {(bench.pid, _processes()[bench.pid][2])}
        benchmark = next(pid for pid, (ppid, _, _) in _processes().items() if ppid == bench.pid)
        group = _processes()[benchmark][1]
        assert len(started) > 3  # the benchmark, Ray's processes and the run's actors
        os.kill(bench.pid, signal.SIGTERM)  # as `timeout` or `kill` does: this process only
        assert bench.wait(timeout=120) != 0  # the benchmark's status: Ray's handler makes its SIGTERM an abort
        assert not [pid for pid, (_, pgid, _) in _processes().items() if pgid == group]  # its group ended with it
        assert not _still_running(started)  # and so did Ray's workers outside it: the run's actors
    finally:  # a failed check leaves nothing running either
        for pid, _ in _still_running(started):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
