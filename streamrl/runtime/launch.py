"""`streamrl launch`: start the actors of a run, drive the trainer step by step, stop cleanly.

```
 validate config ─► run directory ─► Ray (local instance or cluster) ─► actors:
    RUN/queue (restored on --resume) · RUN/weights · RUN/trainer · RUN/producer-i (run free)
 loop: trainer.step() ─► metrics.jsonl, groups.jsonl, progress ─► eval / checkpoint every N steps
 stop (steps done, time limit, Ctrl-C): the shutdown hold on admission ─► producers stop ─► hold released
    ─► final eval ─► checkpoint ─► summary.json ─► actors killed, local Ray shut down
```
Producers are watched all the time, not only while the trainer waits for data: the driver waits on the
trainer's call and every producer's run at once, so one that dies while the others keep the trainer fed
is replaced within a second.
The driver is the only place that knows the whole run; everything it does between steps sees a
consistent state (the trainer is idle), which is what makes its checkpoints exact.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import signal
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import ray

from streamrl import failpoints, logs
from streamrl.buffer import OPERATOR_HOLD
from streamrl.buffer.actor import NAMESPACE, create_queue_actor
from streamrl.buffer.auto import AutoStaleness
from streamrl.config import ConfigError, RunConfig
from streamrl.runtime.actors import NoBatchError, StepResult, TrainerActor
from streamrl.runtime.clients import create_actor
from streamrl.runtime.connect import RayConnectError, join_cluster, start_local
from streamrl.runtime.interrupts import interrupts_deferred
from streamrl.runtime.preflight import (
    QUEUE_PART,
    Plan,
    check_checkpoint_settings,
    check_model_and_task,
    check_resume_overrides,
    check_saved_staleness,
    frozen_settings,
    preflight,
    resolve_paths,
    reward_dir,
)
from streamrl.runtime.progress import ProgressView
from streamrl.runtime.rundir import (
    EVAL_FILE,
    EVENTS_FILE,
    GROUPS_FILE,
    METRICS_FILE,
    STEP_FILES,
    SUMMARY_FILE,
    RunDir,
    RunDirError,
)
from streamrl.runtime.summary import summarize
from streamrl.runtime.supervision import (
    ProducerFailed,
    Producers,
    RunActors,
    RunFailed,
    first_line,
    last_line,
    raised_in,
)
from streamrl.weights.actor import WeightsActor

__all__ = ["Run", "RunFailed", "launch", "prepare"]

log = logging.getLogger(__name__)

SHUTDOWN_HOLD = "shutdown"  # the launcher's admission hold while producers stop (the operator's is its own)


def trainer_placement(config: RunConfig):
    """A STRICT_PACK placement group with one bundle per trainer rank, TP × DP × PP (None for one rank):
    the TP ranks talk at every layer, the PP stages at every micro-batch, the DP ranks at every
    optimizer step; DP rank 0's TP and PP ranks write their optimizer shards into one checkpoint
    directory and every DP rank reads them back on resume."""
    ranks = config.trainer.ranks
    if ranks == 1:
        return None
    bundle = {"CPU": config.trainer.num_cpus or 0.001}  # a bundle may not be empty
    if config.trainer.num_gpus:
        bundle["GPU"] = config.trainer.num_gpus
    group = ray.util.placement_group([dict(bundle) for _ in range(ranks)], strategy="STRICT_PACK")
    ready, _ = ray.wait([group.ready()], timeout=300)
    if not ready:
        ray.util.remove_placement_group(group)
        raise ConfigError(f"no node can hold the trainer's {ranks} ranks (trainer.tensor_parallel × "
                          f"data_parallel × pipeline_parallel, {bundle} each) together")
    return group


def connect_ray(config: RunConfig) -> bool:
    """Join the configured cluster or start a local instance; True when this call started Ray."""
    if ray.is_initialized():
        return False
    try:
        # log_to_driver off: actors' output and Ray's worker-death dumps stay in their log files (RUN_DIR/logs,
        # Ray's session logs); the driver prints one line of its own for what the user must know
        if config.ray.address:
            join_cluster(config.ray.address, namespace=NAMESPACE, logging_level="WARNING", log_to_driver=False)
        else:
            start_local(config.ray.num_cpus, namespace=NAMESPACE, logging_level="WARNING", log_to_driver=False)
    except RayConnectError as exc:
        raise ConfigError(f"ray.address: {exc}" if config.ray.address else str(exc)) from exc
    return True


class Run:
    """One run as the driver sees it: started from a plan, stepped, recorded, stopped. Between steps the
    trainer is idle, so what the driver records and checkpoints there is a consistent state."""

    def __init__(self, config: RunConfig, run_dir: RunDir, *, resume_from: Path | None = None):
        self.config, self.run_dir, self.resume_from = config, run_dir, resume_from
        self.name = config.run.name
        self.meta = json.loads((resume_from / "meta.json").read_text()) if resume_from else {}
        self.start_step: int = self.meta.get("step", 0)
        self.elapsed_before: float = self.meta.get("elapsed_s", 0.0)
        # ---- set by start()
        self.plan: Plan | None = None
        self.actors = RunActors()
        self.producers: Producers | None = None
        self.trainer_group = None  # the placement group of a multi-rank trainer
        self.model_dir: Path | None = None
        self._wandb = None
        # ---- the loop's state
        self.step: int = self.start_step
        self.trained_tokens: int = self.meta.get("trained_tokens", 0)
        self.last_metrics: dict[str, Any] = {}
        self.last_checkpoint_step: int | None = self.start_step if resume_from else None
        self.stopped_by: str | None = None  # steps, time_limit, stopped, interrupted, no_batch, producer_failed
        self._pending: ray.ObjectRef | None = None  # the trainer's step asked for, not yet recorded
        self._started = time.perf_counter()  # reset when training starts
        self._last_end = self._started  # when the last recorded step returned
        self._view: ProgressView | None = None
        self._paused_at_start = False  # a checkpoint's operator hold: the run waits for a resume
        self.auto: AutoStaleness | None = None  # queue.max_staleness = "auto": chooses η after each step

    @property
    def queue(self) -> ray.actor.ActorHandle:
        return self.actors.queue

    @property
    def trainer(self) -> ray.actor.ActorHandle:
        return self.actors.trainer

    @property
    def trainer_sends_weights(self) -> bool:
        return self.plan is not None and self.plan.trainer_sends_weights

    # ---- start -------------------------------------------------------------------------------------------
    def _model_dir(self) -> Path:
        if self.config.model.path is not None:
            return Path(self.config.model.path).expanduser().resolve()
        if self.config.task.kind == "sim":
            return self.run_dir.initial_model  # never built: the simulator has no model
        if self.resume_from is None and not self.run_dir.initial_model.exists():
            from streamrl.models.hf import quiet_transformers
            from streamrl.models.tiny import build_tiny_model

            quiet_transformers()
            build_tiny_model(self.config.model, self.run_dir.initial_model, seed=self.config.run.seed)
        return self.run_dir.initial_model

    def start(self) -> None:
        cfg = self.config
        self.plan = plan = preflight(cfg, ray.cluster_resources(), self.resume_from)
        self.model_dir = model_dir = self._model_dir()
        search_path = reward_dir(cfg)
        actors = self.actors
        actors.queue = actors.add(create_queue_actor(self.name, plan.queue, restore_from=plan.queue_restore))
        actors.weights = actors.add(create_actor(WeightsActor, self.name, "weights",
                                                 max_concurrency=cfg.producers.count + 4))
        config_dict = cfg.model_dump(mode="json")
        self.trainer_group = trainer_placement(cfg)  # the trainer's ranks kept on one node
        actors.trainer = actors.add(create_actor(
            TrainerActor, self.name, "trainer", self.name, config_dict, plan.trainer_model or str(model_dir),
            plan.trainer_resume, search_path, self.trainer_group, str(model_dir), num_cpus=cfg.trainer.num_cpus,
            num_gpus=cfg.trainer.num_gpus, max_concurrency=plan.trainer_concurrency,
            placement=(self.trainer_group, 0)))
        self.producers = Producers(cfg, plan, actors, self.run_dir, start_step=self.start_step,
                                   model_dir=str(model_dir), search_path=search_path, notify=self._notify)
        producers = self.producers.create_all()
        failpoints.hit("launch.start")
        # sglang producers start their servers in their constructor (weights loaded, CUDA graphs captured)
        ray.get([a.ready.remote() for a in [actors.trainer, *producers]], timeout=plan.ready_timeout_s)
        version = ray.get(actors.trainer.publish.remote())
        if version != self.start_step:
            raise RunDirError(f"the checkpoint's trainer is at version {version}, its metadata says step "
                              f"{self.start_step}")
        queue_status = ray.get(actors.queue.status.remote())
        queue_version = queue_status["version"]
        if cfg.queue.auto:  # from the η the queue holds, and on resume the checkpoint's smoothed signals
            self.auto = AutoStaleness(cfg.queue, eta=queue_status["max_staleness"])
            if "auto_staleness" in self.meta:
                self.auto.restore(self.meta["auto_staleness"])
                if self.auto.eta != queue_status["max_staleness"]:
                    raise RunDirError(f"the checkpoint's queue holds max_staleness {queue_status['max_staleness']}, "
                                      f"its controller {self.auto.eta}")
        if queue_version != version:
            raise RunDirError(f"the checkpoint's queue is at version {queue_version}, its trainer at {version}")
        self._paused_at_start = OPERATOR_HOLD in queue_status["holds"]
        if self._paused_at_start:
            log.warning("admission is paused by the operator (kept in the checkpoint): the run waits for "
                        "`streamrl admission resume --run %s`", self.name)
        self.producers.start_all()
        if cfg.logging.wandb:
            import wandb

            try:
                self._wandb = wandb.init(project=cfg.logging.wandb_project, name=self.name,
                                         dir=str(self.run_dir.path), mode=cfg.logging.wandb_mode,
                                         config=config_dict, resume="allow")
            except (wandb.errors.UsageError, wandb.errors.AuthenticationError) as exc:  # online, no login
                raise ConfigError(f"logging.wandb_mode = {cfg.logging.wandb_mode!r}: wandb refused to start: "
                                  f"{first_line(exc)} (log in with `wandb login` or WANDB_API_KEY, or use "
                                  f"'offline')") from exc

    def _notify(self, text: str) -> None:
        if self._view is not None:
            self._view.print(text)

    # ---- the loop ------------------------------------------------------------------------------------------
    def _await(self, ref: ray.ObjectRef, stopping: Callable[[], str | None] | None = None, *,
               watch_producers: bool = True) -> Any:
        """Wait for a trainer call and, at the same time (`watch_producers`), for any producer's run to end:
        a producer that died is replaced at once (however fast the trainer's calls return), one that failed
        fails the run. While `stopping` gives a reason (a stop asked for, or the time limit passed), a step
        that still waits for its groups (admission paused, say) is cancelled and returns None; `stopped_by`
        says why."""
        while True:
            runs = self.producers.watched if self.producers is not None and watch_producers else []
            # a bounded wait, so that Ctrl-C reaches the driver between waits
            ready, _ = ray.wait([ref, *runs], num_returns=1, timeout=1.0)
            reason = stopping() if stopping is not None else None
            if reason is not None:
                # Again each second: a cancel that lands before the step starts is cleared by it. A step
                # already training finishes and is recorded.
                self.stopped_by = reason
                self.trainer.cancel_step.remote()
            if not ready:
                continue
            if ready[0] == ref:
                return ray.get(ref)
            self.producers.ended(ready[0], step=self.step)

    def failure(self, exc: BaseException) -> RunFailed | None:
        """What to tell the user when the loop failed because a queue, weights or trainer actor died, or
        raised an error of its own (a step's state is then unknown: no checkpoint is written after it);
        None for a NoBatchError (every actor is fine: the caller stops with a checkpoint) or an error
        that is not an actor's (it propagates as it is)."""
        role = self.actors.dead_core_actor()
        if role is not None:
            what, detail, record = f"the {role} actor died", first_line(exc), {"dead": role}
        elif isinstance(exc, ray.exceptions.RayTaskError) and not isinstance(exc.cause, NoBatchError):
            task = raised_in(exc)
            what, detail, record = f"{task} raised", last_line(exc), {"raised": task}
        else:
            return None
        checkpoint = self.run_dir.latest_checkpoint_name()
        resume = (f"To resume from {checkpoint}: streamrl launch --resume {self.run_dir.path}" if checkpoint else
                  "No checkpoint was written yet (run.checkpoint_every): start the run again under another "
                  f"run.name, or remove {self.run_dir.path} (it keeps the run's logs)")
        log.error("%s at step %s (%s)", what, self.step, first_line(exc))
        self.run_dir.append(EVENTS_FILE, {"event": "run_failed", **record, "step": self.step,
                                          "error": first_line(exc), "at": time.time()})
        return RunFailed(f"{what} at step {self.step} ({detail}); the run stopped. {resume}")

    def _evaluate(self, started: float) -> dict[str, Any]:
        result = {"step": self.step, "elapsed_s": self._elapsed(started), **self._await(self.trainer.evaluate.remote())}
        self.run_dir.append(EVAL_FILE, result)
        return result

    def _elapsed(self, started: float) -> float:
        return self.elapsed_before + time.perf_counter() - started

    def train(self, view: ProgressView, stop: threading.Event) -> None:
        """Step the trainer until the run is done. The next step is asked for as soon as one returns,
        before that one is recorded (the trainer does not wait for the driver's bookkeeping), except
        where the trainer must be idle after a step: an evaluation or a checkpoint is due, or the run ends."""
        cfg = self.config.run
        self._view = view
        if self._paused_at_start:  # else a resumed run that waits for it looks hung
            view.print(f"admission is paused by the operator, as the checkpoint was: nothing is generated until "
                       f"streamrl admission resume --run {self.name}")
        started = time.perf_counter()
        self._started = started
        if self.start_step == 0:
            first = self._evaluate(started)
            if "eval_accuracy" in first:
                view.print(f"step {self.step}: held-out accuracy {first['eval_accuracy']:.2f}")
        self._last_end = time.perf_counter()
        while self.step < cfg.steps:
            if self._pending is None:
                self.stopped_by = self._stopping(stop, started)
                if self.stopped_by is not None:
                    return
                with interrupts_deferred():  # asked for and held in one move: a Ctrl-C now stops after this step
                    asked = self.trainer.step.remote()
                    failpoints.hit("launch.step_asked")
                    self._pending = asked  # cleared by `_record` once the step is recorded
            result = self._await(self._pending, lambda: self._stopping(stop, started))
            if result is None:
                if self.stopped_by is None:
                    raise RuntimeError("the trainer's step was cancelled while the run was training")
                self._pending = None
                return
            self.stopped_by = None  # the step had started training when the cancel came: it was not stopped
            now, step = time.perf_counter(), result.version
            eval_due = cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.steps
            checkpoint_due = cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and step < cfg.steps
            with interrupts_deferred():  # a Ctrl-C lands before the next step is asked for, or after it is pending
                following = None
                if not (eval_due or checkpoint_due) and step < cfg.steps and self._stopping(stop, started) is None:
                    following = self.trainer.step.remote()
                self._record(result, step_wall=now - self._last_end, started=started)
                self._pending = following
            self._last_end = now
            view.step(self.last_metrics)
            if eval_due:
                ev = self._evaluate(started)
                view.print(f"step {self.step}: held-out accuracy {ev.get('eval_accuracy', float('nan')):.2f}, "
                           f"reward {ev.get('eval_reward', float('nan')):.3f}")
            if checkpoint_due:
                with interrupts_deferred():  # a Ctrl-C now stops the run with this checkpoint, written once
                    self.checkpoint(started)
        self.stopped_by = "steps"

    def _stopping(self, stop: threading.Event, started: float) -> str | None:
        """Why no further step may start now (None: it may)."""
        limit = self.config.run.time_limit_s
        if limit is not None and time.perf_counter() - started >= limit:
            return "time_limit"
        return "stopped" if stop.is_set() else None

    def _queue_status(self) -> dict[str, Any]:
        return ray.get(self.queue.status.remote())

    def _record(self, result: StepResult, *, step_wall: float, started: float) -> None:
        """Record a finished step: its metrics, its groups' audit and the step counter, all or none
        (a Ctrl-C that lands between them would leave a checkpoint labelled with a step whose metrics
        are missing); `_pending` is cleared with them, so `finish` records an interrupted step once."""
        queue = self._queue_status()
        step = result.version
        trained_tokens = self.trained_tokens + result.trained_tokens
        metrics = {
            **result.metrics,  # first: a learner metric can never overwrite one of the run's own below
            "step": step,
            "version": step,
            "reward_mean": result.reward_mean,
            "staleness_mean": result.staleness_mean,
            "staleness_max": result.staleness_max,
            "trained_tokens": result.trained_tokens,  # this step's; the run's total is in the checkpoint
            "tokens_per_s": result.trained_tokens / max(step_wall, 1e-9),
            "trainer_wait_s": result.trainer_wait_s,
            "elapsed_s": self._elapsed(started),
            "queued_groups": queue["queued_groups"],
            "running_groups": queue["running"],
            "admitted": queue["admitted"],
            "over_budget": queue["over_budget"],
            "max_staleness": result.max_staleness,  # the bound this step's groups were held to (see TrainGroups)
        }
        decision, eta_before = None, None
        if self.auto is not None:
            eta_before, decision = self.auto.eta, self.auto.update(metrics)
            metrics.update(auto_eta=decision.eta, auto_reason=decision.reason,
                           **{f"auto_{name}": value for name, value in decision.signals.items()})
        with interrupts_deferred():
            self.run_dir.append(METRICS_FILE, metrics)
            self.run_dir.append(GROUPS_FILE, {"step": step, "staleness_max": metrics["staleness_max"],
                                              **dataclasses.asdict(result.audit)})
            self.step, self.trained_tokens, self.last_metrics = step, trained_tokens, metrics
            self._pending = None
        if decision is not None and decision.eta != eta_before:
            ray.get(self.queue.set_max_staleness.remote(decision.eta))  # admission follows at once
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in metrics.items() if isinstance(v, int | float)}, step=self.step)

    # ---- checkpoints and the end -------------------------------------------------------------------------
    def checkpoint(self, started: float) -> Path | None:
        if self.last_checkpoint_step == self.step:
            return None
        written = self.run_dir.step_dir(self.step)
        # In place (renamed whole) when a second Ctrl-C cut its writer short: this run's (a resume removes
        # later steps' checkpoints), so finish that one.
        if written.is_dir():
            self.last_checkpoint_step = self.step
            return self.run_dir.make_latest(written, self.config.run.keep_checkpoints)

        def write(tmp: Path) -> None:
            ray.get(self.trainer.checkpoint.remote(str(tmp / "trainer")))
            failpoints.hit("checkpoint.write")  # half written: the trainer's part is there, the queue's is not
            ray.get(self.queue.checkpoint.remote(str(tmp / QUEUE_PART)))

        meta = {"step": self.step, "version": self.step, "elapsed_s": self._elapsed(started),
                "trained_tokens": self.trained_tokens, "written_at": time.time(),
                "frozen": frozen_settings(self.config),  # what a resume may not change, beyond config.toml's reach
                **({} if self.auto is None else {"auto_staleness": self.auto.state()})}
        path = self.run_dir.write_checkpoint(self.step, write, meta, keep=self.config.run.keep_checkpoints)
        self.last_checkpoint_step = self.step
        return path

    def stop_producers(self, timeout: float = 60.0) -> None:
        """Hold admission and stop the producers: each commits the groups it has finished and gives the
        running ones back (their prompts are generated again, by this run or a resumed one)."""
        if self.producers is None or not self.producers.handles:
            return
        ray.get(self.queue.pause.remote(SHUTDOWN_HOLD))
        failpoints.hit("launch.stop_producers")  # held: an operator's pause or resume may land now
        self.producers.stop_all(timeout)
        # Released before the checkpoint, which keeps only the holds that outlive the run (the operator's).
        ray.get(self.queue.resume.remote(SHUTDOWN_HOLD))

    def finish(self, view: ProgressView) -> dict[str, Any]:
        view.close()
        if self._pending is not None:  # interrupted mid-step: a step already training finishes and is recorded
            # cancelled again each second until it returns: a cancel that lands before the step starts is lost.
            # Producers are not watched: the run is stopping, and one that ends now is dealt with at their stop.
            result = self._await(self._pending, lambda: self.stopped_by or "stopped", watch_producers=False)
            if result is None:
                self._pending = None
            else:
                self._record(result, step_wall=time.perf_counter() - self._last_end, started=self._started)
        self.stop_producers()
        final_eval = self._evaluate(self._started)
        self.checkpoint(self._started)
        summary = summarize(self.run_dir, self.config, stopped_by=self.stopped_by, final_eval=final_eval,
                            producers=[status.record() for status in self.producers.stats],
                            weight_histories=self.producers.weight_histories,
                            queue=ray.get(self.queue.status.remote()))
        summary["producer_restarts"] = self.producers.restarts
        if self.trainer_sends_weights:
            summary["trainer_weight_broadcasts"] = ray.get(self.trainer.weight_broadcasts.remote())
        self.run_dir.write_json(SUMMARY_FILE, summary)
        log.info("run stopped by %s at step %s; summary in %s", self.stopped_by, summary.get("steps"),
                 self.run_dir.path / SUMMARY_FILE)
        if self.producers.failed:  # after the checkpoint: the trainer and queue were whole
            failed = "; ".join(f"producer {pid}: {error}" for pid, error in sorted(self.producers.failed.items()))
            raise RunFailed(f"{failed}. The run stopped with a checkpoint at step {self.step}; "
                            f"to go on: streamrl launch --resume {self.run_dir.path}")
        return summary

    def finish_without_step(self, view: ProgressView, stopped_by: str) -> dict[str, Any]:
        """`finish` after the pending step failed without changing the trainer (`NoBatchError`)."""
        self._pending, self.stopped_by = None, stopped_by
        return self.finish(view)

    def teardown(self) -> None:
        if self._wandb is not None:
            import wandb

            self._wandb.finish()
            wandb.teardown()  # stop the wandb-core service this run started
            self._wandb = None
        self.actors.kill_all()
        if self.trainer_group is not None:
            ray.util.remove_placement_group(self.trainer_group)
            self.trainer_group = None


def prepare(config_path: str | None = None, overrides: list[str] | None = None, *,
            resume: str | None = None) -> tuple[RunConfig, RunDir, Path | None]:
    """Validate everything that can be checked before Ray starts, and create or open the run directory,
    held by this process (one launcher per run directory) until `launch` returns."""
    overrides = list(overrides or [])
    if resume is not None:
        if config_path is not None:
            raise ConfigError("--resume reads the run's own config.toml; drop the CONFIG argument "
                              "(use --set to change what may change)")
        run_dir = RunDir.open(resume)
        run_dir.hold()  # held until `launch` returns: no other launcher resumes it meanwhile
        try:
            try:
                saved = run_dir.config()
            except ConfigError as exc:  # written by an earlier streamrl, whose checks were looser
                raise ConfigError(f"{run_dir.config_file} no longer passes this version's checks: {exc}. Mend that "
                                  "field in the file (frozen fields cannot change) and resume again") from exc
            config = run_dir.config(overrides)
            check_resume_overrides(saved, config)
            check_model_and_task(config)
            checkpoint = run_dir.verified_checkpoint()
            for name in STEP_FILES:  # a damaged record is refused before anything starts (the rewind reads them)
                run_dir.read(name)
            meta = json.loads((checkpoint / "meta.json").read_text())
            check_checkpoint_settings(meta.get("frozen", {}), config, checkpoint.name)  # none before 2026-12-07
            check_saved_staleness(checkpoint, config)
            failpoints.hit("launch.resume_checked")
            step = meta["step"]
            if step >= config.run.steps:
                raise ConfigError(f"the run is already at step {step} and run.steps = {config.run.steps}; "
                                  f"continue it with --set run.steps=N (N > {step})")
        except BaseException:
            run_dir.release()
            raise
        return config, run_dir, checkpoint  # rewound to the checkpoint once the run has started (`launch`)
    from streamrl.config import load_config

    config = resolve_paths(load_config(config_path, overrides))
    check_model_and_task(config)
    if config.run.name is None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        named = config.run.model_copy(update={"name": f"{config.task.kind}-{stamp}"})
        config = config.model_copy(update={"run": named})
    run_dir = RunDir.create(Path(config.run.output_dir) / config.run.name, config)
    try:
        failpoints.hit("launch.run_dir_made")
        run_dir.hold()
    except BaseException:  # Ctrl-C: the directory just made holds nothing yet
        run_dir.discard_unstarted()
        raise
    return config, run_dir, None


def launch(config: RunConfig, run_dir: RunDir, resume_from: Path | None = None,
           stop: threading.Event | None = None, sigterm_stops: bool = False) -> dict[str, Any]:
    """Run to completion, Ctrl-C, or until `stop` is set, and return the summary; Ray is left as it was found.
    `sigterm_stops`: SIGTERM (a scheduler, `kill`) stops the run like Ctrl-C, with a checkpoint. A Ctrl-C
    while a finished run stops waits for its checkpoint; the summary returned then says
    `interrupted_while_stopping` (`stopped_by` stays what ended the run)."""
    run = Run(config, run_dir, resume_from=resume_from)
    if sigterm_stops:
        signal.signal(signal.SIGTERM, signal.default_int_handler)
    logs.configure_run(run_dir.path / "logs", config.logging.level)  # Ray's start-up notices too
    try:
        started_ray = connect_ray(config)
    except BaseException:
        logs.end_run()
        if resume_from is None:
            run_dir.discard_unstarted()  # an unreachable cluster, or Ctrl-C while joining it: nothing ran
        run_dir.release()
        raise
    if sigterm_stops:  # again: Ray's core worker installs its own SIGTERM handler, which exits at once
        signal.signal(signal.SIGTERM, signal.default_int_handler)
    view = ProgressView(config.logging.progress, config.run.steps, run.start_step, config.logging.line_every)
    view.print(f"streamrl run {config.run.name!r} → {run_dir.path}")
    log.info("run %r %s at step %s: %s producers (%s engine), %s trainer", config.run.name,
             "resumed" if resume_from else "started", run.start_step, config.producers.count,
             config.producers.engine, config.trainer.backend)
    try:
        try:
            run.start()
        except BaseException as exc:
            if resume_from is None:
                run_dir.discard_unstarted()  # nothing ran: the same command can be fixed and run again
            if isinstance(exc, ray.exceptions.RayError):  # an actor that could not start: its own error
                where = (f"logs in {run_dir.path / 'logs'}" if resume_from else
                         "nothing ran: its run directory was removed, the same command can run again")
                raise RunFailed(f"the run could not start: {last_line(exc)} ({where})") from exc
            raise
        if resume_from is not None:
            # Only now that the run has started: a resume refused for its input (too few CPUs, a model
            # that does not load) leaves the run directory as it was.
            run_dir.rewind(run.start_step, config)
        # A run that stops by itself (its steps or time done, a producer failed, no batch could be made): a
        # first Ctrl-C or SIGTERM while it does (producers finishing, the final evaluation and checkpoint)
        # waits for the checkpoint instead of losing it; a second aborts.
        interrupted: list[bool] = []

        def notice() -> None:
            interrupted.append(True)
            log.warning("interrupted while the finished run stops: the final checkpoint is written first")
            view.print("the run is stopping: the final checkpoint is being written (Ctrl-C again to abort)")

        def stopping_by_itself() -> AbstractContextManager[None]:
            return interrupts_deferred(raise_after=False, notice=notice)

        try:
            run.train(view, stop or threading.Event())
        except KeyboardInterrupt:
            run.stopped_by = "interrupted"
            view.print("interrupted: stopping producers and writing a checkpoint (Ctrl-C again to abort)")
        except ProducerFailed as exc:
            failed = run.failure(exc)  # a producer that failed because the queue or weights actor died
            if failed is not None:
                raise failed from exc
            run.stopped_by = "producer_failed"
            view.print(f"{exc}: stopping the run with a checkpoint")
            with stopping_by_itself():
                return run.finish(view)  # raises RunFailed, naming the producer, once the checkpoint is written
        except ray.exceptions.RayError as exc:
            failed = run.failure(exc)
            if failed is not None:
                raise failed from exc
            cause = getattr(exc, "cause", None)
            if not isinstance(cause, NoBatchError):
                raise
            # Every actor is alive and the trainer unchanged: stop with a final checkpoint, then say why.
            view.print(f"{first_line(cause)}: stopping the run with a checkpoint")
            with stopping_by_itself():
                run.finish_without_step(view, "no_batch")
            raise RunFailed(f"{first_line(cause)}; the run stopped with a checkpoint at step {run.step}. "
                            f"To go on: streamrl launch --resume {run_dir.path}") from exc
        if run.stopped_by == "interrupted":
            return run.finish(view)  # a Ctrl-C now is the second: it aborts
        with stopping_by_itself():
            summary = run.finish(view)
        if interrupted:  # the run was over; a caller running one launch after another stops here too
            summary["interrupted_while_stopping"] = True
        return summary
    finally:
        view.close()
        try:
            run.teardown()
        finally:
            logs.end_run()
            try:
                if started_ray:
                    ray.shutdown()
            finally:
                run_dir.release()  # the run is over: it may be resumed
