"""End to end: `streamrl launch` on Ray with tiny settings (a 2-layer model, 2-digit reversal)."""

import json
import os
import signal
import socket
import sys
import threading
import time

import pytest
import ray
from checkout import FAKE_SGLANG
from launching import launch_subprocess, resume_tiny, run_tiny, tiny

from streamrl.buffer import load_queue
from streamrl.buffer.actor import get_queue_actor
from streamrl.cli import main
from streamrl.config import ConfigError
from streamrl.runtime.launch import launch, prepare
from streamrl.runtime.rundir import RunDir
from streamrl.runtime.summary import held_versions_differ

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def finished(ray_local, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("runs")
    summary, run_dir = run_tiny(tmp, "e2e", "run.steps=8", "queue.max_staleness=2", "producers.count=2",
                                "logging.wandb=true")
    return summary, run_dir


def test_a_launch_writes_the_run_directory(finished):
    summary, run_dir = finished
    metrics = run_dir.read("metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, 9))
    required = {"step", "version", "reward_mean", "staleness_mean", "staleness_max", "trained_tokens", "tokens_per_s",
                "trainer_wait_s", "elapsed_s"}
    assert all(required <= set(m) for m in metrics)
    assert all(m["staleness_max"] <= 2 for m in metrics)
    assert [e["step"] for e in run_dir.read("eval.jsonl")] == [0, 3, 6, 8]
    assert run_dir.config() == RunDir.open(run_dir.path).config()  # config.toml reads back
    assert sorted(p.name for p in run_dir.checkpoints.iterdir()) == ["latest", "step_000006", "step_000008"]
    assert (run_dir.checkpoints / "latest").read_text().strip() == "step_000008"
    assert summary["stopped_by"] == "steps" and summary["steps"] == 8 and summary["staleness_bound_held"]
    on_disk = json.loads((run_dir.path / "summary.json").read_text())
    assert on_disk["steps"] == 8 and set(on_disk["learned"]) and len(on_disk["producers"]) == 2
    # the producers run on the trainer's machine: versions reach them through shared memory, not Ray offers
    assert all(p["shared_received"] > 0 for p in on_disk["producers"])
    groups = run_dir.read("groups.jsonl")
    prompts = [p for g in groups for p in g["prompt_ids"]]
    assert len(prompts) == len(set(prompts)) == 8 * 4  # every consumed group is a different prompt
    assert list((run_dir.path / "wandb").glob("offline-run-*"))  # wandb logged offline, no account needed


def test_a_resume_whose_auto_range_excludes_the_checkpoints_budget_is_refused_before_anything_starts(finished):
    """Outside review: the queue actor refused it once Ray and every actor had started, blaming the checkpoint."""
    _, run_dir = finished  # η = 2 at its checkpoint
    before = sorted((p.relative_to(run_dir.path), p.stat().st_mtime_ns) for p in run_dir.path.rglob("*"))
    with pytest.raises(ConfigError, match=r"checkpoint step_000008's queue holds max_staleness 2, outside "
                                          r"queue.auto_min / queue.auto_max = \[0, 1\]: widen them"):
        prepare(None, ["queue.max_staleness='auto'", "queue.auto_max=1", "run.steps=10"], resume=str(run_dir.path))
    assert sorted((p.relative_to(run_dir.path), p.stat().st_mtime_ns) for p in run_dir.path.rglob("*")) == before
    config, opened, _ = prepare(None, ["queue.max_staleness='auto'", "queue.auto_max=3", "run.steps=10"],
                                resume=str(run_dir.path))  # a range holding it is accepted
    opened.release()


def test_a_run_whose_saved_config_this_version_refuses_is_told_which_file_to_mend(finished, tmp_path):
    """A config.toml written before a check was added (here the temperature's lower bound) is refused in one
    line naming the file, not as if the user's --set were wrong."""
    import shutil

    _, run_dir = finished
    copy = tmp_path / "older"
    shutil.copytree(run_dir.path, copy)
    config_file = copy / "config.toml"
    config_file.write_text(config_file.read_text().replace("temperature = 1.0", "temperature = 1e-05"))
    with pytest.raises(ConfigError, match=r"config\.toml no longer passes this version's checks: .*sampling\."
                                          r"temperature.*Mend that field in the file"):
        prepare(None, ["run.steps=10"], resume=str(copy))


def test_every_actor_writes_its_own_log(finished):
    _, run_dir = finished
    logs = run_dir.path / "logs"
    assert {p.name for p in logs.iterdir()} == {"driver.log", "queue.log", "weights.log", "trainer.log",
                                                  "producer-0.log", "producer-1.log"}
    for producer in ("producer-0.log", "producer-1.log"):
        text = (logs / producer).read_text()
        assert "started" in text and "weights version 1 in use (generation held up" in text
    assert "checkpoint of version 8 written" in (logs / "trainer.log").read_text()


def test_the_run_left_no_actor_behind(finished):
    summary, _ = finished
    for role in ("queue", "weights", "trainer", "producer-0", "producer-1"):
        with pytest.raises(ValueError):
            ray.get_actor(f"e2e/{role}", namespace="streamrl")


def test_two_producers_hold_different_versions_at_the_same_moment(finished):
    summary, run_dir = finished
    # A weight load after which the producers held different versions: no barrier lined them up.
    assert summary["weight_loads_with_producers_on_different_versions"] > 0
    # And the trainer trained on groups whose weights were older than its own: it never waited for them.
    assert any(m["staleness_max"] > 0 for m in run_dir.read("metrics.jsonl"))


def test_held_versions_differ_counts_moments_of_disagreement():
    lockstep = [[(1.0, 0), (2.0, 1)], [(1.0, 0), (2.0, 1)]]
    assert held_versions_differ(lockstep) == (1, 1)  # the instant between the two loads at t=2.0
    drifting = [[(1.0, 0), (2.0, 1), (3.0, 2)], [(1.5, 0), (3.5, 2)]]
    assert held_versions_differ(drifting) == (2, 2)  # at t=3.0 one holds 2, the other still 0
    assert held_versions_differ([[(1.0, 0)]]) == (None, None)  # one producer: nothing to compare
    assert held_versions_differ([[(1.0, 0)], []]) == (None, None)  # a producer that reported no load


@pytest.mark.parametrize("eta, admission", [(0, "continuous"), (1, "per_step")])
def test_sync_and_one_step_schedules_run_through_the_same_code_path(ray_local, tmp_path, eta, admission):
    summary, run_dir = run_tiny(tmp_path, f"sched{eta}", "run.steps=4", f"queue.max_staleness={eta}",
                                f"queue.admission={admission}", "producers.count=2")
    metrics = run_dir.read("metrics.jsonl")
    assert len(metrics) == 4 and all(m["staleness_max"] <= eta for m in metrics)
    assert summary["schedule"] == ("synchronous" if eta == 0 else "asynchronous")
    assert summary["queue"]["over_budget"] == 0
    if eta == 0:  # every token is the trainer's own version: the float32 sampler and trainer agree
        assert all(m["mismatch_tokens"] == m["response_tokens"] and m["mismatch_abs_max"] < 1e-4 for m in metrics)


def test_a_bfloat16_run_with_a_kl_penalty_reports_its_mismatch_and_its_distance_to_the_reference(ray_local, tmp_path):
    summary, run_dir = run_tiny(tmp_path, "bf16", "run.steps=3", "queue.max_staleness=0", "producers.count=1",
                                "model.dtype=bfloat16", "model.attention=sdpa", "loss.kl_coef=0.05")
    metrics = run_dir.read("metrics.jsonl")
    assert summary["stopped_by"] == "steps"
    assert all(m["mismatch_tokens"] == m["response_tokens"] for m in metrics)
    assert all(1e-4 < m["mismatch_abs_max"] and 0 < m["mismatch_kl"] < 0.05 for m in metrics)
    assert metrics[0]["kl_ref"] == pytest.approx(0, abs=1e-3)  # the first step's policy is the reference
    assert metrics[-1]["kl_ref"] > 0


@pytest.mark.parametrize("tp, dp, pp", [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2)])
def test_the_megatron_trainer_runs_a_launch_and_resumes_from_its_own_checkpoint(ray_local, tmp_path, tp, dp, pp):
    groups_before = len(ray.util.placement_group_table())
    ranks = tp * dp * pp
    first, run_dir = run_tiny(tmp_path, f"mcore{tp}x{dp}x{pp}", "run.steps=3", "trainer.backend=megatron",
                              "producers.count=1", f"trainer.tensor_parallel={tp}", f"trainer.data_parallel={dp}",
                              f"trainer.pipeline_parallel={pp}", f"trainer.num_cpus={1 / ranks}",
                              "producers.num_cpus=0.5")
    assert first["steps"] == 3 and first["staleness_bound_held"]
    model_dir = run_dir.latest_checkpoint() / "trainer" / "model"
    assert (model_dir / "config.json").is_file() and list(model_dir.glob("*.safetensors"))  # HF format out
    config, opened, checkpoint = prepare(None, ["run.steps=5", "logging.progress=none"], resume=str(run_dir.path))
    second = launch(config, opened, checkpoint)
    assert [m["step"] for m in run_dir.read("metrics.jsonl")] == [1, 2, 3, 4, 5] and second["steps"] == 5
    assert [e["step"] for e in run_dir.read("eval.jsonl")] == [0, 3, 5]  # eval on the megatron weights
    # the ranks ran in one STRICT_PACK placement group, removed with the run
    assert all(pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())
    assert len(ray.util.placement_group_table()) - groups_before == (2 if ranks > 1 else 0)  # one per launch
    # DP rank 0's TP ranks and stages write the optimizer state (the DP ranks' is the same); every DP rank
    # reads it back
    optimizer_files = sorted(p.name for p in run_dir.latest_checkpoint().glob("trainer/optimizer*.pt"))
    assert optimizer_files == {(1, 1): ["optimizer.pt"], (2, 1): ["optimizer.tp0.pt", "optimizer.tp1.pt"],
                               (1, 2): ["optimizer.pp0.pt", "optimizer.pp1.pt"]}[tp, pp]


@pytest.mark.parametrize("weights", ["disk", "distributed", "tensor"])
def test_sglang_producers_run_a_launch_through_stand_in_servers(ray_local, tmp_path, weights):
    # sglang's pause re-checks once a second (tested on its own in test_sglang.py); a 6-step run needs faster
    # updates to load 3 versions into each of two servers in turn. (With 4 steps, broadcast loaded only 2 in
    # about one run of four, before this stop's changes too: a producer whose load falls behind loads the
    # newest version next, skipping the ones between.)
    fake, log = str(FAKE_SGLANG), tmp_path / "calls.log"
    launcher = json.dumps([sys.executable, fake, "--token-delay-s", "0.001", "--update-delay-s", "0.01", "--pause-poll-s", "0.05",
                           "--calls-log", str(log)])
    summary, run_dir = run_tiny(tmp_path, "sgl", "run.steps=6", "producers.engine=sglang", "producers.count=1",
                                f"producers.sglang.launcher={launcher}", "producers.sglang.servers=2",
                                "producers.sglang.base_port=31700", "queue.max_staleness=1",
                                f"producers.sglang.weights={weights}")
    metrics = run_dir.read("metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6] and all(m["staleness_max"] <= 1 for m in metrics)
    (producer,) = summary["producers"]
    assert producer["weight_updates"] >= 3 and producer["groups"] >= 16
    # one producer: the "held different versions" figures say there was nothing to compare, not 0
    assert summary["weight_loads_with_producers_on_different_versions"] is None
    written = list((run_dir.path / "sglang").glob("weights-producer-0/v*"))
    loads = [line.split()[1] for line in log.read_text().splitlines() if "weights_from" in line]
    # tensor and broadcast loads of every version inside one weight-update session per server (sglang >= 0.5.21
    # refuses them outside one); disk loads need none
    text = log.read_text()
    sessions = (text.count("/begin_weight_update"), text.count("/end_weight_update"))
    assert sessions == ((0, 0) if weights == "disk" else (text.count("/update_weight_version"),) * 2)
    if weights == "disk":
        assert len(written) <= 2 and set(loads) == {"/update_weights_from_disk"}  # pruned as it went
    elif weights == "distributed":  # broadcast from the trainer: nothing on disk, one group per server
        assert not written and set(loads) == {"/update_weights_from_distributed"}
        assert log.read_text().count("/init_weights_update_group") == 2
        sent = summary["trainer_weight_broadcasts"]  # the trainer actor was rank 0 of both groups
        assert sent["groups"] == 2 and sent["buckets"] == loads.count("/update_weights_from_distributed")
        assert sent["bytes"] >= 2 * producer["weight_updates"] * 10_000  # the tiny model is ~0.1 MB
    else:  # tensor handles: nothing on disk, no group
        assert not written and set(loads) == {"/update_weights_from_tensor"}
        assert "/init_weights_update_group" not in log.read_text()
    with pytest.raises(OSError):  # the servers stopped with their producer
        socket.create_connection(("127.0.0.1", 31700), timeout=1)


def test_colocated_servers_free_the_gpu_for_every_trainer_step(ray_local, tmp_path):
    fake, log = str(FAKE_SGLANG), tmp_path / "calls.log"
    launcher = json.dumps([sys.executable, fake, "--token-delay-s", "0.001", "--update-delay-s", "0.01", "--pause-poll-s", "0.05",
                           "--calls-log", str(log)])
    seen, done = [], threading.Event()

    def watch_admission():  # the queue's holds and admissions, as often as the queue answers
        queue = None
        while not done.is_set():
            try:
                queue = queue or get_queue_actor("coloc")
                status = ray.get(queue.status.remote())
            except (ValueError, ray.exceptions.RayActorError):  # not started yet, or gone at the end
                time.sleep(0.01)
                continue
            seen.append((status["holds"], status["admitted"]))

    watcher = threading.Thread(target=watch_admission)
    watcher.start()
    try:
        summary, run_dir = run_tiny(tmp_path, "coloc", "run.steps=3", "producers.engine=sglang", "producers.count=1",
                                    f"producers.sglang.launcher={launcher}", "producers.sglang.memory_saver=true",
                                    "producers.sglang.base_port=31720", "trainer.colocated=true", "run.eval_every=0",
                                    "producers.sglang.weights=tensor")
    finally:
        done.set()
        watcher.join()
    assert summary["steps"] == 3
    # admission holds while the trainer has the GPU: no group is admitted for a server that cannot run it
    held = [i for i, (holds, _) in enumerate(seen) if holds == ["colocated"]]
    assert held, seen
    assert all(seen[i][1] == seen[i + 1][1] for i in held if i + 1 in held)
    assert "colocated" not in seen[-1][0]  # released after the last step
    calls = [line.split()[1] for line in log.read_text().splitlines()]
    turns = [c for c in calls if c.endswith("_memory_occupation")]
    assert turns == ["/release_memory_occupation", "/resume_memory_occupation"] * 3  # one turn per step
    released = False
    for call in calls:  # a released server never runs a generation and is never asked to load (its memory is
        # gone); a request the client sent before its pause may arrive later and wait at the pause gate, as in sglang
        released = {"/release_memory_occupation": True, "/resume_memory_occupation": False}.get(call, released)
        assert not (released and call in ("generate:scheduled", "/update_weights_from_tensor"))
    assert calls.count("generate:scheduled") >= 3
    assert calls.count("/update_weight_version") >= 2 and "/update_weights_from_tensor" in calls


def test_resume_continues_without_losing_or_repeating_a_group(ray_local, tmp_path):
    # with a learning-rate schedule across the resume (warm-up, then a cosine decay over all 8 steps)
    first, run_dir = run_tiny(tmp_path, "resumable", "run.steps=4", "queue.max_staleness=2", "producers.count=1",
                              "trainer.lr_schedule=cosine", "trainer.warmup_steps=2", "trainer.lr_decay_steps=8",
                              "run.checkpoint_every=2")
    saved = load_queue(run_dir.latest_checkpoint() / "queue")
    queued_at_checkpoint = {g.group_id for g in saved.queued_groups()}
    assert queued_at_checkpoint  # the producer ran ahead: there is queued data to carry over

    # A resume from the older checkpoint that the cluster refuses leaves everything as it was (it used to
    # have deleted step_000004 and cut the metrics back to step 2 before the refusal).
    latest = run_dir.checkpoints / "latest"
    latest.write_text("step_000002\n")
    before = {name: (run_dir.path / name).read_bytes() for name in ("metrics.jsonl", "groups.jsonl", "config.toml")}
    config, opened, checkpoint = prepare(None, ["run.steps=8", "producers.num_cpus=8"], resume=str(run_dir.path))
    with pytest.raises(ConfigError, match="reserves"):
        launch(config, opened, checkpoint)
    assert {name: (run_dir.path / name).read_bytes() for name in before} == before
    assert sorted(p.name for p in run_dir.checkpoints.glob("step_*")) == ["step_000002", "step_000004"]
    latest.write_text("step_000004\n")

    config, opened, checkpoint = prepare(None, ["run.steps=8", "logging.progress=none"], resume=str(run_dir.path))
    second = launch(config, opened, checkpoint)
    assert RunDir.open(run_dir.path).config().run.steps == 8  # what --set changed holds for the next resume
    metrics = run_dir.read("metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, 9)) and second["steps"] == 8
    from streamrl.trainer.schedule import lr_at

    schedule = dict(lr=1e-3, schedule="cosine", warmup_steps=2, decay_steps=8)
    assert [m["lr"] for m in metrics] == pytest.approx([lr_at(s, **schedule) for s in range(8)], rel=1e-12)
    groups = run_dir.read("groups.jsonl")
    ids = [g for record in groups for g in record["group_ids"]]
    prompts = [p for record in groups for p in record["prompt_ids"]]
    assert len(ids) == len(set(ids)) == 32 and len(prompts) == len(set(prompts))
    resumed_ids = {g for record in groups if record["step"] > 4 for g in record["group_ids"]}
    assert queued_at_checkpoint <= resumed_ids  # the restored groups were trained, not regenerated
    final = load_queue(run_dir.latest_checkpoint() / "queue")
    accounted = set(prompts) | {g.prompt_id for g in final.queued_groups()} | set(final.returned_prompts())
    assert accounted == set(range(final.status()["prompt_cursor"]))  # every prompt handed out is somewhere


def test_admission_pause_stops_admitted_and_resume_restarts_it(ray_local, tmp_path, capsys):
    """A pause longer than `trainer.get_timeout_s` is waited out (the timeout is for producers that deliver
    nothing), and a stop while paused ends the run at once, with the operator's hold kept."""
    stop = threading.Event()
    outcome = {}

    def target():
        outcome["summary"], _ = run_tiny(tmp_path, "paused", "run.steps=100000", "producers.count=1",
                                         "trainer.get_timeout_s=1.5", stop=stop)

    thread = threading.Thread(target=target)
    thread.start()
    try:
        def admitted():
            capsys.readouterr()
            code = main(["admission", "status", "--run", "paused", "--json"])
            out = capsys.readouterr().out
            return json.loads(out)["admitted"] if code == 0 else None  # 2: the run's queue is not up yet

        deadline = time.time() + 120
        while not admitted():
            assert time.time() < deadline and thread.is_alive(), "the run never started admitting"
            time.sleep(0.5)
        assert main(["admission", "pause", "--run", "paused"]) == 0
        time.sleep(1.5)  # running groups finish and are queued
        before = admitted()
        time.sleep(2.0)
        assert admitted() == before
        assert thread.is_alive()  # paused past the trainer's 1.5 s timeout: still running
        assert main(["admission", "resume", "--run", "paused"]) == 0
        time.sleep(2.0)
        assert admitted() > before
        assert main(["admission", "pause", "--run", "paused"]) == 0
        time.sleep(3.0)  # the queue drains: the trainer's step waits for groups that cannot come
    finally:
        stop.set()
        thread.join(timeout=120)
    summary = outcome["summary"]
    assert summary["stopped_by"] == "stopped" and summary["queue"]["holds"] == ["operator"]


def test_the_time_limit_ends_a_run_whose_step_waits_for_groups_the_operator_paused(ray_local, tmp_path):
    """The time limit is checked while a step waits for its groups, not only before the next step is
    asked for: a run the operator paused stops at its limit with its checkpoint (it waited for the resume
    however long that took, past any scheduler's allocation)."""
    from streamrl.buffer.actor import get_queue_actor

    stop, outcome = threading.Event(), {}
    limit = 25.0

    def target():
        outcome["summary"], _ = run_tiny(tmp_path, "limited", "run.steps=100000", "producers.count=1",
                                         f"run.time_limit_s={limit}", "trainer.get_timeout_s=1.0", stop=stop)

    thread = threading.Thread(target=target)
    thread.start()
    try:
        metrics = tmp_path / "limited" / "metrics.jsonl"
        deadline = time.time() + 120
        while not metrics.exists() or not metrics.read_text():
            assert time.time() < deadline and thread.is_alive(), "the run never trained"
            time.sleep(0.2)
        ray.get(get_queue_actor("limited").pause.remote())
        thread.join(timeout=limit + 60)
        assert not thread.is_alive(), "the paused run went on past its time limit"
    finally:
        stop.set()
        thread.join(timeout=120)
    summary = outcome["summary"]
    assert summary["stopped_by"] == "time_limit" and summary["queue"]["holds"] == ["operator"]


def test_a_trainer_that_gets_no_groups_stops_the_run_with_a_checkpoint_and_one_line(ray_local, tmp_path):
    """Producers that deliver nothing (here: admission held by something other than the operator) make
    the trainer's step time out; every actor is alive and the trainer unchanged, so the run ends with a
    final checkpoint and summary and a one-line error saying how to go on."""
    from streamrl.buffer.actor import get_queue_actor
    from streamrl.runtime.launch import RunFailed

    config, run_dir, checkpoint = prepare(None, tiny(tmp_path, "starved", "run.steps=100000",
                                                     "trainer.get_timeout_s=1.5", "run.checkpoint_every=0"))
    outcome = {}

    def target():
        try:
            launch(config, run_dir, checkpoint)
        except RunFailed as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=target)
    thread.start()
    try:
        deadline = time.time() + 120
        while not (run_dir.path / "metrics.jsonl").exists() or not (run_dir.path / "metrics.jsonl").read_text():
            assert time.time() < deadline and thread.is_alive(), "the run never trained"
            time.sleep(0.2)
        ray.get(get_queue_actor("starved").pause.remote("test"))
    finally:
        thread.join(timeout=120)
    assert not thread.is_alive()
    message = str(outcome["error"])
    assert "no batch of" in message and "--resume" in message and "\n" not in message
    summary = json.loads((run_dir.path / "summary.json").read_text())
    assert summary["stopped_by"] == "no_batch"
    lines = (run_dir.path / "metrics.jsonl").read_text().splitlines()
    assert run_dir.latest_checkpoint().name.endswith(f"{len(lines):06d}")  # every recorded step kept


def test_an_operator_pause_while_the_run_shuts_down_is_kept_in_the_checkpoint(ray_local, tmp_path, monkeypatch):
    """The launcher's shutdown hold and the operator's are independent: an operator's pause that lands
    while producers stop survives the launcher's release (a saved-flag resume overwrote it)."""
    from streamrl import failpoints

    monkeypatch.setenv(failpoints.ENV_SPEC, "launch.stop_producers=sleep:3")
    monkeypatch.setenv(failpoints.ENV_DIR, str(tmp_path))
    outcome = {}
    thread = threading.Thread(target=lambda: outcome.update(run=run_tiny(tmp_path, "held", "run.steps=3")))
    thread.start()
    try:
        deadline = time.time() + 120
        while failpoints.fired(tmp_path) != ["launch.stop_producers"]:
            assert time.time() < deadline and thread.is_alive(), "the run never reached its shutdown"
            time.sleep(0.05)
        assert main(["admission", "pause", "--run", "held"]) == 0
    finally:
        thread.join(timeout=120)
    summary, run_dir = outcome["run"]
    assert summary["queue"]["holds"] == ["operator"] and summary["queue"]["paused"]
    manifest = json.loads((run_dir.latest_checkpoint() / "queue" / "manifest.json").read_text())
    assert manifest["holds"] == ["operator"]

    # resumed, the run says it waits for the operator (it looked hung), and goes on once resumed
    thread = threading.Thread(target=lambda: outcome.update(resumed=resume_tiny(run_dir, "run.steps=5")))
    thread.start()
    try:
        driver_log = run_dir.path / "logs" / "driver.log"
        deadline = time.time() + 120
        while "paused by the operator" not in (driver_log.read_text() if driver_log.exists() else ""):
            assert time.time() < deadline and thread.is_alive(), "the resumed run never said it waits"
            time.sleep(0.2)
        assert main(["admission", "resume", "--run", "held"]) == 0
    finally:
        thread.join(timeout=120)
    assert outcome["resumed"]["steps"] == 5 and outcome["resumed"]["queue"]["holds"] == []


def test_ctrl_c_stops_cleanly_with_a_checkpoint(ray_local, tmp_path):
    proc = launch_subprocess(tiny(tmp_path, "interrupted", "run.steps=100000"),
                             address=ray.get_runtime_context().gcs_address)
    metrics = tmp_path / "interrupted" / "metrics.jsonl"
    deadline = time.time() + 120
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        assert proc.poll() is None and time.time() < deadline, proc.stdout.read() if proc.poll() is not None else ""
        time.sleep(0.3)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does to the foreground process group
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, output
    run_dir = RunDir.open(tmp_path / "interrupted")
    summary = json.loads((run_dir.path / "summary.json").read_text())
    assert summary["stopped_by"] == "interrupted"
    assert run_dir.latest_checkpoint().name == f"step_{summary['steps']:06d}"
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)  # nothing of the launcher's process group is left
    for role in ("queue", "trainer", "producer-0"):
        with pytest.raises(ValueError):
            ray.get_actor(f"interrupted/{role}", namespace="streamrl")


def test_wandb_online_without_a_login_is_refused_naming_the_setting_and_leaves_nothing(ray_local, tmp_path,
                                                                                      monkeypatch):
    """Outside review: wandb's UsageError reached the user as a 30-line traceback (exit status 1)."""
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc holding a wandb key
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    config, run_dir, _ = prepare(None, tiny(tmp_path, "online", "logging.wandb=true", "logging.wandb_mode='online'"))
    with pytest.raises(ConfigError, match=r"logging.wandb_mode = 'online': wandb refused to start: UsageError: No API"):
        launch(config, run_dir)
    assert not run_dir.path.exists()  # nothing ran: the same command can run again once logged in


@pytest.mark.parametrize("argv, message", [
    (["launch", "--set", "trainer.lrr=1"], "trainer.lrr: Extra inputs are not permitted"),
    (["launch", "--set", "queue.max_staleness=-2"], "queue.max_staleness: Input should be an integer >= 0, or \"auto\" (got -2)"),
    (["launch", "--set", "oops"], "expected section.key=value"),
    (["launch", "missing.toml"], "config file 'missing.toml' does not exist"),
    (["launch", "--resume", "/nonexistent/run"], "is not a streamrl run directory"),
    # outside review: a traceback (FileNotFoundError; Ray's ValueError) and exit status 1 before
    (["launch", "--set", 'run.output_dir="/proc/nope"'], "cannot create the run directory '/proc/nope/"),
    (["launch", "--address", "http://127.0.0.1:8265"], "not a Ray cluster address: 'http://127.0.0.1:8265'"),
])
def test_bad_config_and_cli_input_give_clear_errors(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("streamrl: error:")
    assert not (tmp_path / "runs").exists()  # nothing was created


def test_an_existing_run_directory_is_not_overwritten(tmp_path):
    prepare(None, tiny(tmp_path, "taken"))
    with pytest.raises(Exception, match="already exists.*--resume"):
        prepare(None, tiny(tmp_path, "taken"))


@pytest.mark.parametrize("change, field", [("queue.group_size=8", "queue.group_size"), ("run.seed=7", "run.seed"),
                                           ("trainer.tensor_parallel=2", "trainer.tensor_parallel"),
                                           ("trainer.pipeline_parallel=2", "trainer.pipeline_parallel")])
def test_resume_refuses_to_change_what_defines_the_data_or_the_optimizer_shards(tmp_path, change, field):
    _, run_dir, _ = prepare(None, tiny(tmp_path, "frozen", "trainer.backend=megatron"))
    with pytest.raises(ConfigError, match=f"{field} cannot change"):
        prepare(None, [change], resume=str(run_dir.path))


def test_unknown_cli_verbs_and_flags_exit_with_usage():
    with pytest.raises(SystemExit) as exc:
        main(["launch", "--bogus"])
    assert exc.value.code == 2


@pytest.mark.parametrize("override, message", [("producers.num_cpus=4", r"reserves 9 CPUs .* the Ray cluster has 2"),
                                               ("trainer.num_gpus=1", r"reserves 1 GPUs .* the Ray cluster has 0")])
def test_a_run_that_needs_more_than_the_cluster_has_is_refused_and_leaves_nothing(ray_local, tmp_path, override,
                                                                                   message):
    config, run_dir, _ = prepare(None, tiny(tmp_path, "greedy", override))
    with pytest.raises(ConfigError, match=message):
        launch(config, run_dir)
    assert not run_dir.path.exists()
    with pytest.raises(ValueError):
        ray.get_actor("greedy/queue", namespace="streamrl")


def test_a_run_whose_model_cannot_load_fails_in_one_line_and_the_same_command_can_run_again(
        ray_local, tmp_path, tiny_model_dir):
    import shutil

    from streamrl.runtime.launch import RunFailed

    broken = tmp_path / "broken-model"
    shutil.copytree(tiny_model_dir, broken)
    for weights in broken.glob("*.safetensors"):
        weights.unlink()  # the config is there, so the checks before Ray pass; the actors cannot load it
    sets = tiny(tmp_path, "unloadable", f"model.path={json.dumps(str(broken))}")
    for _ in range(2):  # the run directory it created is gone: the same command is not refused as taken
        config, run_dir, _ = prepare(None, sets)
        with pytest.raises(RunFailed, match=r"the run could not start: .*safetensors.*nothing ran") as failed:
            launch(config, run_dir)
        assert "\n" not in str(failed.value) and not run_dir.path.exists()


def test_sequences_longer_than_the_model_allows_are_refused_before_anything_starts(tmp_path):
    with pytest.raises(ConfigError, match="task.digits=7: sequences of up to 18 tokens exceed the model's "
                                          "max_position_embeddings=16"):
        prepare(None, tiny(tmp_path, "long", "task.digits=7", "model.max_positions=16"))
    assert not (tmp_path / "long").exists()
    with pytest.raises(ConfigError, match="task.max_digits=28: sequences of up to 60 tokens exceed"):
        prepare(None, tiny(tmp_path, "tail", "task.kind=long_tail", "model.max_positions=32"))


def test_pipeline_stages_that_do_not_split_the_layers_evenly_are_refused_before_anything_starts(tmp_path):
    megatron = ["trainer.backend=megatron", "model.num_layers=3"]
    with pytest.raises(ConfigError, match=r"trainer.pipeline_parallel=2 does not divide the model's 3 layers"):
        prepare(None, tiny(tmp_path, "uneven", *megatron, "trainer.pipeline_parallel=2"))
    assert not (tmp_path / "uneven").exists()
    with pytest.raises(ConfigError, match="trainer.pipeline_parallel=2 needs trainer.backend = 'megatron'"):
        prepare(None, tiny(tmp_path, "torch", "trainer.pipeline_parallel=2"))
    assert prepare(None, tiny(tmp_path, "even", *megatron, "trainer.pipeline_parallel=3"))[0].trainer.ranks == 3


def test_resuming_a_finished_run_asks_for_more_steps(ray_local, tmp_path):
    _, run_dir = run_tiny(tmp_path, "done", "run.steps=2", "producers.count=1")
    with pytest.raises(ConfigError, match=r"already at step 2 .* --set run.steps=N"):
        prepare(None, [], resume=str(run_dir.path))
    # a frozen field edited in config.toml is refused against the checkpoint's record (it got past the
    # comparison of config.toml with the overrides: outside review)
    config_file = run_dir.path / "config.toml"
    config_file.write_text(config_file.read_text().replace("seed = 0", "seed = 7"))
    with pytest.raises(ConfigError, match=r"run.seed is 7 in the run's config.toml, but checkpoint step_000002 was "
                                          r"written with 0"):
        prepare(None, ["run.steps=3"], resume=str(run_dir.path))


def test_a_file_task_with_a_local_checkpoint_and_a_reward_module_runs(ray_local, tmp_path, tiny_model_dir,
                                                                         monkeypatch):
    (tmp_path / "digit_rewards.py").write_text("def first_digit(completion, row):\n"
                                              "    return float(completion[:1] == row['answer'])\n")
    rows = [{"prompt": f"{n}>", "answer": str(n)[-1]} for n in range(10, 30)]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.chdir(tmp_path)  # the reward module is imported from the launch directory
    summary, run_dir = run_tiny(tmp_path, "files", "run.steps=3", "producers.count=1", "task.kind=file",
                                "task.prompts=prompts.jsonl", "task.eval_prompts=prompts.jsonl",
                                "task.reward=digit_rewards:first_digit", "sampling.max_new_tokens=3",
                                f"model.path={json.dumps(str(tiny_model_dir))}")
    assert summary["steps"] == 3 and summary["eval_reward_last"] is not None
    prompts = {p for g in run_dir.read("groups.jsonl") for p in g["prompt_ids"]}
    assert prompts <= set(range(40))
    # resumed from another directory holding a module of the same name: the run's own is imported (the
    # launch directory is recorded; a resume imported whatever the current directory held)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "digit_rewards.py").write_text('raise RuntimeError("not the run\'s reward module")\n')
    monkeypatch.chdir(elsewhere)
    assert run_dir.config().task.reward_dir == str(tmp_path)
    assert resume_tiny(run_dir, "run.steps=4")["steps"] == 4


def test_a_file_task_with_a_missing_reward_module_is_refused_before_anything_starts(tmp_path, tiny_model_dir):
    (tmp_path / "p.jsonl").write_text('{"prompt": "12>"}\n')
    with pytest.raises(ConfigError, match="task: reward 'nowhere:f': cannot import module 'nowhere'"):
        prepare(None, tiny(tmp_path, "nofn", "task.kind=file", f"task.prompts={json.dumps(str(tmp_path / 'p.jsonl'))}",
                           "task.reward=nowhere:f", "sampling.max_new_tokens=3",
                           f"model.path={json.dumps(str(tiny_model_dir))}"))
    assert not (tmp_path / "nofn").exists()


def test_a_file_task_leaves_room_in_the_context_for_a_whole_response(tmp_path, tiny_model_dir, monkeypatch):
    """A prompt is refused when it and `sampling.max_new_tokens` exceed the model's positions (32 here):
    allowed up to positions − 1, it decoded past the context (RoPE: no error; sglang refuses the request)."""
    (tmp_path / "rewards.py").write_text("def score(completion, row):\n    return 0.0\n")
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "1" * 20 + ">"}) + "\n")
    sets = ["task.kind=file", f"task.prompts={json.dumps(str(tmp_path / 'p.jsonl'))}", "task.reward=rewards:score",
            f"model.path={json.dumps(str(tiny_model_dir))}"]
    monkeypatch.chdir(tmp_path)  # the reward module is imported from the launch directory
    with pytest.raises(ConfigError, match="row 0 .* more than the 16 the model's context leaves for a prompt"):
        prepare(None, tiny(tmp_path, "long", *sets, "sampling.max_new_tokens=16"))
    with pytest.raises(ConfigError, match="sampling.max_new_tokens=256 leaves no room for a prompt"):
        prepare(None, tiny(tmp_path, "default", *sets))  # the file task's default response length
    config, run_dir, _ = prepare(None, tiny(tmp_path, "fits", *sets, "sampling.max_new_tokens=8"))
    run_dir.release()


def test_auto_staleness_moves_eta_within_its_range_logs_each_decision_and_resumes_with_it(ray_local, tmp_path):
    summary, run_dir = run_tiny(tmp_path, "auto", "run.steps=12", "queue.max_staleness=auto", "queue.auto_max=3",
                                "queue.auto_cooldown=1", "producers.count=2")
    metrics = run_dir.read("metrics.jsonl")
    assert all({"max_staleness", "auto_eta", "auto_reason", "auto_wait_fraction"} <= set(m) for m in metrics)
    assert all(0 <= m["auto_eta"] <= 3 and m["staleness_max"] <= m["max_staleness"] for m in metrics)
    assert len({m["max_staleness"] for m in metrics}) > 1  # it moved (the trainer waits for 2 tiny producers)
    assert summary["schedule"] == "auto" and summary["max_staleness"] == "auto" and summary["staleness_bound_held"]
    saved = load_queue(run_dir.latest_checkpoint() / "queue")
    assert saved.max_staleness == metrics[-1]["auto_eta"]  # the η in force goes into the checkpoint
    meta = json.loads((run_dir.latest_checkpoint() / "meta.json").read_text())
    assert meta["auto_staleness"]["eta"] == saved.max_staleness  # and the controller's smoothed signals
    resumed = resume_tiny(run_dir, "run.steps=14")
    after = run_dir.read("metrics.jsonl")[len(metrics):]
    assert resumed["staleness_bound_held"] and after[0]["max_staleness"] == saved.max_staleness
