"""`streamrl bench pipeline` end to end on a tiny simulated workload: every schedule is a `streamrl launch`
run whose directory the report names, and the report holds what it promises."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from checkout import ROOT

from streamrl import failpoints

BENCH = [sys.executable, "-m", "benchmarks.pipeline"]  # run from the checkout root (it imports harness)
TINY = ["producers.count=2", "sim.sequences_per_producer=8", "queue.groups_per_step=4", "queue.max_in_flight=16",
        "sim.prompt_tokens=8", "sim.median_tokens=16", "sim.p99_ratio=4", "sim.max_tokens=64", "sim.weights_mb=0.05",
        "sim.time_scale=0.02"]


@pytest.mark.ray
def test_the_pipeline_report_holds_every_schedule_its_run_and_ratio(tmp_path):
    out = tmp_path / "pipeline.json"
    args = [*BENCH, "--window-s", "2", "--eta", "2", "--out", str(out)]
    for item in TINY:
        args += ["--set", item]
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=420)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    results = report["results"]
    for schedule, eta in (("sync", 0), ("one_step", 1), ("async", 2)):
        assert results[schedule]["tokens_per_s"] > 0
        assert results[schedule]["staleness"]["max"] <= eta
        run = Path(results[schedule]["run_dir"])  # the run a user would have launched, kept
        metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert len(metrics) > results[schedule]["steps_measured"] >= 2
        config = (run / "config.toml").read_text()
        assert 'engine = "sim"' in config and f"max_staleness = {eta}" in config
    for key in ("speedup_async_vs_sync", "speedup_async_vs_one_step", "efficiency_async"):
        assert results[key] == pytest.approx(report["targets"][key]["measured"])
    assert results["efficiency_async"] == pytest.approx(
        results["async"]["tokens_per_s"] / min(results["generation_alone"]["tokens_per_s"],
                                               results["training_alone"]["tokens_per_s"]))
    assert results["efficiency_async_samples"] == pytest.approx(
        results["async"]["samples_per_s"] / min(results["generation_alone"]["samples_per_s"],
                                                 results["training_alone"]["samples_per_s"]))
    model_rate = report["workload"]["model_schedule_tokens_per_s"]["async"] / 0.02  # model seconds to real ones
    assert results["efficiency_async_vs_model"] == pytest.approx(results["async"]["tokens_per_s"] / model_rate)
    lengths = results["async"]["response_length"]
    assert 1 <= lengths["p99_median_over_steps"] <= lengths["max"] <= 64 and 0 <= lengths["truncated_fraction"] <= 1
    assert lengths["mean"] == pytest.approx(sum(m["response_tokens"] for m in metrics[-results["async"]["steps_measured"]:])
                                            / sum(m["samples"] for m in metrics[-results["async"]["steps_measured"]:]))
    assert report["workload"]["producers"] == 2 and report["workload"]["async_eta"] == 2
    assert "vs_baseline" in report  # compared with the stored baseline


def interrupt_bench(tmp_path, ready, env=None) -> tuple[int, str, Path, Path]:
    """Run the benchmark, send SIGINT once `ready(runs, pid)` holds; its exit status, output, runs and report."""
    out, runs, log = tmp_path / "pipeline.json", tmp_path / "runs", tmp_path / "bench.log"
    args = [*BENCH, "--window-s", "30", "--eta", "2", "--out", str(out), "--runs", str(runs)]
    for item in TINY:
        args += ["--set", item]
    with log.open("w") as output:  # a file, not a pipe nobody reads until the end
        bench = subprocess.Popen(args, cwd=ROOT, stdout=output, stderr=subprocess.STDOUT,
                                 env={**os.environ, **(env or {})})
    try:
        deadline = time.monotonic() + 180
        while not ready(runs, bench.pid):
            assert bench.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        bench.send_signal(signal.SIGINT)
        bench.wait(timeout=120)
    finally:
        if bench.poll() is None:  # a second Ctrl-C aborts; the benchmark still shuts its Ray down
            bench.send_signal(signal.SIGINT)
            try:
                bench.wait(timeout=60)
            except subprocess.TimeoutExpired:
                bench.kill()
                bench.wait()
    return bench.returncode, log.read_text(), runs, out


def gcs_server_of(pid: int) -> int | None:
    """The pid of the Ray GCS server that process `pid` started (its `ray.init` is under way), if any."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue  # it exited meanwhile
        name, fields = text[text.index("(") + 1:text.rindex(")")], text[text.rindex(")") + 2:].split()
        if name == "gcs_server" and int(fields[1]) == pid:
            return int(stat.parent.name)
    return None


@pytest.mark.ray
def test_ctrl_c_while_the_benchmark_starts_ray_exits_130_and_leaves_no_ray_process(tmp_path):
    """Ray's start-up was outside the benchmark's interrupt handling: a traceback and exit status 1."""
    gcs = []
    status, output, runs, out = interrupt_bench(tmp_path, lambda runs, pid: gcs.append(gcs_server_of(pid)) or gcs[-1])
    assert status == 130, output
    assert "pipeline: interrupted; no report written" in output and "Traceback" not in output
    assert not list(runs.glob("*/*")) and not out.exists()
    deadline = time.monotonic() + 10
    while running(gcs[-1]) and time.monotonic() < deadline:
        time.sleep(0.1)  # Ray's shutdown ends it
    assert not running(gcs[-1])


def running(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead and not yet reaped, does not)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return text[text.rindex(")") + 2:].split()[0] != "Z"


@pytest.mark.ray
@pytest.mark.parametrize("when", ["training", "stopping"])
def test_ctrl_c_stops_the_benchmark_not_only_the_schedule_running(tmp_path, when):
    """Before, the interrupted schedule's run stopped and the next schedule started; a Ctrl-C while a run
    stopped by itself (its time limit reached, its final checkpoint being written) was held for the
    checkpoint and then forgotten."""
    if when == "training":
        status, output, runs, out = interrupt_bench(
            tmp_path, lambda runs, pid: any(m.stat().st_size for m in runs.glob("*/sync/metrics.jsonl")))
    else:  # the driver held a few seconds in the stop, after the sync run's time limit
        held = tmp_path / "failpoints"
        held.mkdir()
        status, output, runs, out = interrupt_bench(
            tmp_path, lambda runs, pid: failpoints.fired(held) == ["launch.stop_producers"],
            env={failpoints.ENV_SPEC: "launch.stop_producers=sleep:5", failpoints.ENV_DIR: str(held)})
        (driver_log,) = runs.glob("*/sync/logs/driver.log")
        assert "interrupted while the finished run stops" in driver_log.read_text()
    assert status == 130, output
    assert "pipeline: interrupted during the sync run" in output and "no report written" in output
    assert [p.name for p in runs.glob("*/*")] == ["sync"] and not out.exists()


def test_a_bad_setting_is_refused_by_name():
    done = subprocess.run([*BENCH, "--set", "sim.p99_ratio=0.5"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode != 0
    assert "p99_ratio" in done.stderr and "greater than or equal to 1" in done.stderr
