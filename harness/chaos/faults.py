"""The fault campaign of `streamrl bench chaos`: one run, launched and resumed through `streamrl launch`
as a user would, with a fault in every segment, then audited for lost and repeated groups.

```
 segment k: streamrl launch (fresh) or --resume RUN ─► fail points armed (STREAMRL_FAILPOINTS) and/or
            an actor SIGKILLed, a signal sent when a phase is reached ─► exit status as expected?
            checkpoint verifies? launcher's process group gone?
 the end:   audit_run(RUN): every prompt handed out trained once or still waiting
```
The drivers join a Ray instance the campaign owns (`--address`), so each segment starts in seconds and
a killed driver cannot take the cluster with it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from harness.chaos.audit import audit_run
from streamrl import failpoints
from streamrl.buffer.actor import NAMESPACE
from streamrl.runtime.rundir import RunDir, RunDirError

# A 2-layer model on 2-digit reversal: a step takes well under a second on two cores.
TINY = ["model.hidden_size=32", "model.num_layers=2", "model.num_heads=2", "model.intermediate_size=64",
        "task.digits=2", "queue.group_size=4", "queue.groups_per_step=4", "queue.max_in_flight=8",
        "producers.groups_per_batch=2", "run.eval_every=3", "run.checkpoint_every=3", "task.eval_size=16",
        "logging.progress=none", "run.time_limit_s=null"]


def tiny_settings(root: str | Path, name: str, *extra: str) -> list[str]:
    """`--set` items of a tiny run named `name` under `root`."""
    return [*TINY, f"run.output_dir={json.dumps(str(root))}", f"run.name={name}", *extra]


# Start the command with Ctrl-C and Ctrl-\ at their defaults, as a terminal's foreground job has them. A
# process started in the background of a script inherits both ignored (bash does that to `cmd &` when job
# control is off), Python then never raises KeyboardInterrupt, and a run sent SIGINT would go on training.
_AS_FROM_A_TERMINAL = ("import os, signal, sys; "
                       "signal.signal(signal.SIGINT, signal.SIG_DFL); signal.signal(signal.SIGQUIT, signal.SIG_DFL); "
                       "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])")


def launch_process(sets: list[str], *, address: str | None = None, resume: Path | None = None,
                   env: dict[str, str] | None = None) -> subprocess.Popen:
    """`streamrl launch` as a user starts it from a terminal, in a session of its own (so its whole group
    can be signalled); its pid is the driver's."""
    command = [sys.executable, "-c", _AS_FROM_A_TERMINAL, "-m", "streamrl.cli", "launch",
               *(["--address", address] if address else []),
               *(["--resume", str(resume)] if resume else []), *[a for s in sets for a in ("--set", s)]]
    return subprocess.Popen(command, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, **(env or {})})


@dataclass(frozen=True)
class Segment:
    """One launch of the run and the faults it meets."""

    name: str
    points: str = ""  # fail points armed for this launch
    signal_at: str | None = None  # send `signum` to the launcher when this fail point fires
    signum: int = signal.SIGINT
    kill: str | None = None  # an actor role to SIGKILL ...
    kill_after_steps: int = 2  # ... once this many steps were trained in this segment
    expect: int = 130  # the launcher's exit status
    final_steps: int | None = None  # run.steps of a segment that is to finish the run

    @property
    def faults(self) -> int:
        """Kills and signals; a `sleep` fail point only holds a phase open for the signal."""
        return len(_destructive(self.points)) + (self.kill is not None) + (self.signal_at is not None)


def _destructive(spec: str) -> set[str]:
    return {name for name, (action, _) in failpoints.parse(spec).items() if not action.startswith("sleep:")}


QUICK_CHAIN = [
    Segment("producers die mid-generation and after a commit; Ctrl-C in a training step",
            points="producer.generate=kill@2;producer.after_commit=kill@3;trainer.train=sleep:3@5",
            signal_at="trainer.train"),
    Segment("SIGTERM while weights are published", points="trainer.publish=sleep:3@3", signal_at="trainer.publish",
            signum=signal.SIGTERM),
    Segment("Ctrl-C during generation", points="producer.generate=sleep:3@3", signal_at="producer.generate"),
    Segment("Ctrl-C while a checkpoint is written", points="checkpoint.write=sleep:3", signal_at="checkpoint.write"),
    Segment("the trainer dies mid-step", points="trainer.train=kill@2", expect=1),
    Segment("the queue actor is killed", kill="queue", expect=1),
    Segment("the launcher is killed half way through a checkpoint", points="checkpoint.write=kill", expect=-9),
    Segment("a producer is killed; the run finishes", kill="producer-1", kill_after_steps=1, expect=0,
            final_steps=4),
]


def _steps_trained(run_dir: Path) -> int:
    metrics = run_dir / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.is_file() else 0


def _actor_pid(run_name: str, role: str) -> int:
    actor = ray.get_actor(f"{run_name}/{role}", namespace=NAMESPACE)
    return ray.get(actor.pid.remote() if role == "queue" else actor.ready.remote(), timeout=60)


def run_segment(segment: Segment, *, root: Path, name: str, address: str, fresh: bool,
                timeout_s: float = 240) -> dict[str, Any]:
    """Launch (or resume) the run with the segment's faults and report how it ended."""
    run_dir = root / name
    points_dir = root / f"failpoints-{int(time.time() * 1000)}"
    points_dir.mkdir()
    env = {failpoints.ENV_SPEC: segment.points, failpoints.ENV_DIR: str(points_dir)}
    steps = segment.final_steps if segment.final_steps is not None else 100_000
    sets = tiny_settings(root, name, "producers.count=2", "run.checkpoint_every=2") if fresh else []
    sets.append(f"run.steps={_steps_trained(run_dir) + steps if segment.final_steps else steps}")
    started = time.monotonic()
    proc = launch_process(sets, address=address, resume=None if fresh else run_dir, env=env)
    base_steps, signalled, killed = _steps_trained(run_dir), False, False
    while proc.poll() is None and time.monotonic() - started < timeout_s:
        if segment.signal_at and not signalled and segment.signal_at in failpoints.fired(points_dir):
            # Ctrl-C reaches the terminal's whole foreground group; a scheduler signals the launcher
            (os.killpg if segment.signum == signal.SIGINT else os.kill)(proc.pid, segment.signum)
            signalled = True
        if segment.kill and not killed and _steps_trained(run_dir) >= base_steps + segment.kill_after_steps:
            os.kill(_actor_pid(name, segment.kill), signal.SIGKILL)
            killed = True
        time.sleep(0.1)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    output = proc.communicate()[0]
    try:
        os.killpg(proc.pid, 0)
        left_behind = True
    except ProcessLookupError:
        left_behind = False
    injected = len(_destructive(segment.points) & set(failpoints.fired(points_dir))) + signalled + killed
    checkpoint = None
    try:
        checkpoint = RunDir.open(run_dir).verified_checkpoint().name
    except RunDirError:
        pass  # no checkpoint yet (reported as such, and counted as a failed segment)
    ok = proc.returncode == segment.expect and checkpoint is not None and not left_behind
    return {"segment": segment.name, "exit_status": proc.returncode, "expected": segment.expect, "ok": ok,
            "faults_injected": injected, "faults_planned": segment.faults, "checkpoint": checkpoint,
            "processes_left": left_behind, "steps_after": _steps_trained(run_dir),
            "wall_s": round(time.monotonic() - started, 1),
            "output_tail": "" if ok else output[-2000:]}


def interrupted_start_up(*, root: Path, address: str) -> dict[str, Any]:
    """Ctrl-C while the actors start: nothing trained, nothing left (not even the run directory)."""
    points_dir = root / "failpoints-start-up"
    points_dir.mkdir()
    started = time.monotonic()
    proc = launch_process(tiny_settings(root, "start-up"), address=address,
                          env={failpoints.ENV_SPEC: "launch.start=sleep:3", failpoints.ENV_DIR: str(points_dir)})
    while "launch.start" not in failpoints.fired(points_dir) and proc.poll() is None:
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGINT)
    output = proc.communicate(timeout=120)[0]
    ok = proc.returncode == 130 and not (root / "start-up").exists()
    return {"segment": "Ctrl-C during start-up", "exit_status": proc.returncode, "expected": 130, "ok": ok,
            "faults_injected": 1, "faults_planned": 1, "checkpoint": None, "processes_left": False,
            "steps_after": 0, "wall_s": round(time.monotonic() - started, 1),
            "output_tail": "" if ok else output[-2000:]}


def run_campaign(root: Path, chain: list[Segment] = QUICK_CHAIN) -> dict[str, Any]:
    """Every segment of `chain` on one run, the start-up interruption on another; needs `ray.init` done."""
    address = ray.get_runtime_context().gcs_address
    segments = [run_segment(segment, root=root, name="chaos", address=address, fresh=index == 0)
                for index, segment in enumerate(chain)]
    segments.append(interrupted_start_up(root=root, address=address))
    audit = audit_run(root / "chaos")
    summary = json.loads((root / "chaos" / "summary.json").read_text())
    return {
        "faults_injected": sum(s["faults_injected"] for s in segments),
        "runs_completed": sum(s["ok"] for s in segments),
        "segments": segments,
        "groups_lost": audit["groups_lost"],
        "groups_duplicated": audit["groups_duplicated"],
        "audit": audit,
        "finished": summary["stopped_by"] == "steps",
    }
