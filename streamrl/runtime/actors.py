"""Ray actor shells for one run: weights, producers and the trainer (the queue's is in `streamrl.buffer.actor`).

```
 driver ──step()──► TrainerActor ──get(B)──► QueueActor ◄──admit / commit── ProducerActor ×N
                        │ train, version + 1                                      ▲  (generation never waits)
                        └──publish(v, arrays)──► WeightsActor ──acquire (long poll)┘
```
Each actor holds a plain class that carries the logic (and is tested without Ray); these shells
only connect them: what they hold is built by `runtime.build`, what they call goes through
`runtime.clients`. Weights cross the object store as numpy arrays.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import ray

from streamrl import failpoints, logs
from streamrl.buffer.actor import NAMESPACE, fetch_table, get_queue_actor
from streamrl.buffer.queue import OPERATOR_HOLD, QueueClosed, TrainGroups
from streamrl.buffer.schema import FINISH_REASONS, LENGTH, list_offsets
from streamrl.config import RunConfig
from streamrl.engine.base import accept_offer
from streamrl.engine.local_weights import LocalWeights
from streamrl.rollout.producer import ProducerCounters, clean_up_after
from streamrl.runtime.build import make_engine, make_learner
from streamrl.runtime.clients import RemoteHold, RemoteQueue, actor_name
from streamrl.weights.actor import WeightPublisher
from streamrl.weights.shared_memory import SharedAddress, SharedWeightsListener

if TYPE_CHECKING:  # the type only: the shell needs none of the trainers' modules
    from streamrl.trainer.learner import Learner

log = logging.getLogger(__name__)


def _reward_failures(task: Any) -> dict[str, Any]:
    """A file task's failed rewards (counts by kind, the last few messages); built-in rewards cannot fail."""
    return {"reward_failures": getattr(task, "reward_failures", dict)(),
            "reward_failures_recent": getattr(task, "recent_reward_failures", list)()}


def shared_weights_listener(weights: Any, hold: Callable[[int], Any], node: str) -> SharedWeightsListener | None:
    """A listener for versions through shared memory, for an engine whose weights live in this process and
    are fetched in the background (torch, sim); None for the others (sglang: its servers load them).
    `node`: this process's Ray node id."""
    if not isinstance(weights, LocalWeights) or weights.receiver is None:
        return None
    receiver = weights.receiver
    return SharedWeightsListener(lambda version, arrays: accept_offer(weights, version, arrays, hold),
                                 node=node, copy=not receiver.double_buffered,
                                 on_error=receiver.fail)


class ProducerActor:
    """A rollout producer over the engine `producers.engine` names (`streamrl.runtime.build`)."""

    def __init__(self, run_name: str, producer_id: int, config: dict[str, Any], model_dir: str, seed: int,
                 search_path: str | None = None, work_dir: str | None = None):
        from streamrl.rollout.producer import RolloutProducer

        logs.setup_actor_logging()
        cfg = RunConfig.model_validate(config)
        if cfg.producers.engine != "sim":  # the simulator's processes never import transformers
            from streamrl.models.hf import quiet_transformers

            quiet_transformers()
        self.weights = ray.get_actor(actor_name(run_name, "weights"), namespace=NAMESPACE)
        self.trainer = ray.get_actor(actor_name(run_name, "trainer"), namespace=NAMESPACE)
        engine, task = make_engine(cfg, run_name=run_name, producer_id=producer_id, model_dir=model_dir, seed=seed,
                                   weights=self.weights, search_path=search_path, work_dir=work_dir)
        self.producer = RolloutProducer(producer_id, queue=RemoteQueue(get_queue_actor(run_name), producer_id),
                                        engine=engine, task=task, group_size=cfg.queue.group_size,
                                        max_staleness=cfg.queue.untrainable_after)
        self._stop = threading.Event()
        self._hold = RemoteHold(self.weights, producer_id)  # called under the engine's staging lock: one at a time
        self._shared = shared_weights_listener(engine.weights, self._hold, ray.get_runtime_context().get_node_id())
        log.info("producer %s started (pid %s): %s engine, capacity %s sequences, seed %s", producer_id, os.getpid(),
                 cfg.producers.engine, engine.capacity, seed)

    def ready(self) -> int:
        return os.getpid()

    def run(self) -> ProducerStatus:
        """Generate until `stop()` or until the queue closes; returns the producer's statistics. Leaving
        releases the weights version this producer held."""
        failure: BaseException | None = None
        try:
            if self._shared is not None:
                self._shared.start()
            ray.get(self.trainer.subscribe.remote(self.producer.producer_id, ray.get_runtime_context().current_actor,
                                                  None if self._shared is None else self._shared.address))
            self.producer.run(self._stop)
        except QueueClosed:
            pass  # the run is ending: the queue closed while this producer waited for a slot or committed
        except BaseException as exc:
            failure = exc
            raise
        finally:  # a clean-up step that fails while the producer fails is noted on its error, not raised instead
            try:
                if self._shared is not None:
                    clean_up_after(failure, "stopping the shared-memory weights listener", self._shared.stop)
                clean_up_after(failure, "closing the engine", self.producer.engine.close)  # sglang: servers, groups
            finally:
                clean_up_after(failure, "releasing the weights version this producer held", lambda: ray.get(
                    self.weights.drop_holder.remote(self.producer.producer_id), timeout=30))
        return self.status()

    def stop(self) -> None:
        self._stop.set()

    def take_batch(self, key: int) -> pa.RecordBatch:
        """The queue actor fetching a batch this producer commits (see `RemoteQueue`)."""
        return self.producer.queue.outbox.take(key)

    def offer_weights(self, version: int, weights: list[ray.ObjectRef]) -> None:
        """The trainer offering a new version directly (`WeightPublisher`): staged now if newer, and then
        the registry told, so that this producer's long poll does not fetch it again."""
        accept_offer(self.producer.engine.weights, version, weights, self._hold)

    def status(self) -> ProducerStatus:
        engine, task = self.producer.engine, self.producer.task
        weights = engine.weights.status()
        if self._shared is not None:  # versions that came through shared memory, and those overwritten first
            weights |= {"shared_received": self._shared.received, "shared_skipped": self._shared.skipped}
        return ProducerStatus(producer_id=self.producer.producer_id, counters=copy.copy(self.producer.stats),
                              weights=weights, capacity=engine.capacity,
                              stalls=list(self.producer.stalls), blocked_by=self.producer.last_blocked_by,
                              **_reward_failures(task))

    def weight_history(self) -> list[tuple[float, int]]:
        return list(self.producer.engine.weights.history)

    def release_gpu(self) -> None:
        """Colocated (sglang): hand the GPU to the trainer (servers paused, memory freed)."""
        self.producer.engine.release()

    def resume_gpu(self) -> None:
        self.producer.engine.resume()


@dataclass(frozen=True)
class ProducerStatus:
    """What a producer reports when it stops (a Ray call's result); `record()` is its `summary.json` entry."""

    producer_id: int
    counters: ProducerCounters
    weights: dict[str, Any]  # its engine's weights (`EngineWeights.status`: the version held, loads, ...)
    capacity: int  # sequences generated at once
    stalls: list[float]  # seconds each weight switch held up the decode loop
    blocked_by: str | None  # the last reason admission refused it
    reward_failures: dict[str, int]  # a file task's failed rewards by kind
    reward_failures_recent: list[str]

    def record(self) -> dict[str, Any]:
        return {"producer_id": self.producer_id, **dataclasses.asdict(self.counters), **self.weights,
                "capacity": self.capacity, "stalls": self.stalls, "blocked_by": self.blocked_by,
                "reward_failures": self.reward_failures, "reward_failures_recent": self.reward_failures_recent}


@dataclass(frozen=True)
class GroupAudit:
    """The groups one step consumed, in the order trained: `groups.jsonl`'s audit trail."""

    group_ids: list[str]
    prompt_ids: list[int]
    producer_ids: list[int]
    staleness: list[int]  # each group's: the trainer's version minus the group's oldest token's


@dataclass(frozen=True)
class StepResult:
    """What one trainer step returns to the driver (a Ray call's result)."""

    version: int  # the trainer's version after the step (= the step number)
    trained_tokens: int  # the tokens of the rows this step trained on (prompts and responses)
    reward_mean: float
    staleness_mean: float
    staleness_max: int
    max_staleness: int  # the bound the groups were held to (TrainGroups.max_staleness; moves with η = "auto")
    trainer_wait_s: float  # waiting for the queue: what generation did not hide
    audit: GroupAudit
    metrics: dict[str, Any]  # the learner's (loss, clip and mask fractions, kl_by_lag, ...) and the step's phases


def _log_failure(taking: Future) -> None:
    if (error := taking.exception()) is not None:
        log.info("taking the next step's groups failed (the step that asks for them raises it): %s", error)


@dataclass(frozen=True)
class _Taken:
    groups: TrainGroups
    table: pa.Table
    fetch_s: float


COLOCATED_HOLD = "colocated"  # the trainer's admission hold while colocated servers have given it their GPUs


class TrainerShell:
    """Steps a learner against the queue and publishes its weights; the backend-independent half of
    the trainer actor."""

    def __init__(self, run_name: str, learner: Learner, *, groups_per_step: int, get_timeout_s: float,
                 colocated_producers: int = 0):
        self.trainer = learner
        self.groups_per_step, self.get_timeout_s = groups_per_step, get_timeout_s
        self.run_name, self.colocated_producers = run_name, colocated_producers
        self._colocated: list[ray.actor.ActorHandle] | None = None
        self.queue = get_queue_actor(run_name)
        self.weights = ray.get_actor(actor_name(run_name, "weights"), namespace=NAMESPACE)
        self.publisher = WeightPublisher(self.weights)
        self._cancel = threading.Event()
        # The next step's groups are taken and fetched while this step publishes, its answer travels to the
        # driver and the next call comes back (and while an evaluation runs): the queue is at the new version
        # once a step has set it, so they are the groups that step would take. Taken but not trained, they are
        # the queue's `_in_training`: a checkpoint meanwhile queues them again.
        self._taking = ThreadPoolExecutor(max_workers=1, thread_name_prefix="take")
        self._next: Future[_Taken | None] | None = None

    def ready(self) -> int:
        return os.getpid()

    def cancel_step(self) -> None:
        """Make a step that is still waiting for groups return None (a step already training finishes)."""
        self._cancel.set()

    def subscribe(self, producer_id: int, producer: ray.actor.ActorHandle,
                  shared: SharedAddress | None = None) -> None:
        """A producer asks for every new version to be offered to it directly (`WeightPublisher`), through
        shared memory if it gave an address and runs on this machine."""
        self.publisher.subscribe(producer_id, producer, shared)

    def publish(self) -> int:
        """Hand the current weights out and return at once: no producer is waited for (the previous
        publication, which has had a whole step to finish, is checked first)."""
        failpoints.hit("trainer.publish")
        self.publisher.publish(self.trainer.version, self.trainer.weights())
        return self.trainer.version

    def _take(self) -> _Taken | None:
        """B groups within the staleness budget, fetched; None when `cancel_step` came first."""
        self._cancel.clear()
        deadline = time.perf_counter() + self.get_timeout_s
        groups = None
        while groups is None:  # short waits, so a cancel is seen while admission is paused
            if self._cancel.is_set():
                return None
            if time.perf_counter() > deadline:
                if OPERATOR_HOLD in ray.get(self.queue.status.remote())["holds"]:
                    # Waiting is what the operator asked for: the timeout is for producers that deliver nothing.
                    deadline = time.perf_counter() + self.get_timeout_s
                    log.info("admission is paused by the operator: the trainer waits for `streamrl admission resume`")
                    continue
                raise NoBatchError(f"no batch of {self.groups_per_step} groups arrived within "
                                   f"{self.get_timeout_s} s (trainer.get_timeout_s): are the producers generating?")
            groups = ray.get(self.queue.get.remote(None, 0.5))
        if groups.version != self.trainer.version:
            raise RuntimeError(f"the queue is at version {groups.version}, the trainer at {self.trainer.version}")
        started = time.perf_counter()
        table = fetch_table(groups)
        return _Taken(groups, table, fetch_s=time.perf_counter() - started)

    def step(self) -> StepResult | None:
        """Take B groups within the staleness budget (taken ahead, see `__init__`), train on them, publish
        the new version and start taking the next step's. None when `cancel_step` was called before any
        group was taken."""
        started = time.perf_counter()
        taking, self._next = self._next or self._taking.submit(self._take), None
        taken = taking.result()  # the taker's error (NoBatchError, a dead queue) raises here
        if taken is None:
            return None
        groups, table = taken.groups, taken.table
        waited = time.perf_counter() - started  # what taking the groups ahead did not hide of this step
        failpoints.hit("trainer.train")
        with self._gpu_turn():
            metrics = {f"token_{k}" if k.startswith("staleness") else k: v
                       for k, v in self.trainer.train(table).items()}
            trained = time.perf_counter()
            # The queue learns the new version before any producer can hold it: the queue refuses tokens
            # stamped with a version it has not reached, so publishing first would let a fast producer
            # load v + 1, commit, and have its batch rejected (and its run fail) while the queue is at v.
            ray.get(self.queue.set_version.remote(self.trainer.version))
            self._next = self._taking.submit(self._take)  # the queue is at the new version: beside the publish
            self._next.add_done_callback(_log_failure)  # seen even if no step asks for them (the run stopping)
            self.publish()
            published = time.perf_counter()
        rewards = table.column("reward").to_numpy()
        return StepResult(
            version=self.trainer.version,
            trained_tokens=int(metrics.pop("trained_tokens")),
            reward_mean=float(rewards.mean()),
            staleness_mean=float(np.mean(groups.staleness)),
            staleness_max=int(max(groups.staleness)),
            max_staleness=groups.max_staleness,
            trainer_wait_s=waited,
            audit=GroupAudit(group_ids=[g.group_id for g in groups.groups],
                             prompt_ids=[g.prompt_id for g in groups.groups],
                             producer_ids=[g.producer_id for g in groups.groups], staleness=list(groups.staleness)),
            metrics={
                **metrics,
                **response_lengths(table),
                "reward_std": float(rewards.std()),
                "fetch_s": taken.fetch_s,  # the groups' rows out of the object store (hidden, if taken ahead)
                "publish_s": published - trained,  # the queue's version, then the weights put and announced
                "step_s": time.perf_counter() - started,
                "ended_at": time.time(),
            })

    @contextmanager
    def _gpu_turn(self) -> Iterator[None]:
        """Colocated (trainer and sglang servers on the same GPUs): the servers free the GPUs, the
        trainer loads itself onto them, trains and publishes, offloads, and the servers take them back.
        Generation stops for the step; everything else (queue, staleness, versions) is unchanged."""
        if not self.colocated_producers:
            yield
            return
        if self._colocated is None:  # looked up once: the producers exist by the first step
            self._colocated = [ray.get_actor(actor_name(self.run_name, f"producer-{i}"), namespace=NAMESPACE)
                               for i in range(self.colocated_producers)]
        producers = self._colocated
        # Admission holds for the turn: a group admitted now would wait in a released server, its ticket
        # counted in flight (and ageing toward ticket_timeout_s) while nothing can generate it.
        ray.get(self.queue.pause.remote(COLOCATED_HOLD))
        try:
            try:
                ray.get([p.release_gpu.remote() for p in producers])
                self.trainer.onload()
                try:
                    yield
                finally:
                    self.trainer.offload()
            finally:
                ray.get([p.resume_gpu.remote() for p in producers])
        finally:
            ray.get(self.queue.resume.remote(COLOCATED_HOLD))


def response_lengths(table: pa.Table | pa.RecordBatch) -> dict[str, float]:
    """How long the step's responses ran, and the share cut at the length limit (a policy that learns to
    ramble shows here before its reward moves; a benchmark's tail is the one these figures show)."""
    lengths = np.diff(list_offsets(table.column("response_ids")))
    truncated = pc.sum(pc.equal(table.column("finish_reason"), FINISH_REASONS[LENGTH])).as_py() or 0
    return {"response_length_mean": float(lengths.mean()), "response_length_p50": float(np.median(lengths)),
            "response_length_p99": float(np.percentile(lengths, 99)), "response_length_max": int(lengths.max()),
            "truncated_fraction": truncated / len(lengths)}


class NoBatchError(TimeoutError):
    """The trainer waited `trainer.get_timeout_s` for a step's groups and none came, admission not paused by
    the operator: nothing in the trainer changed, so the run can stop with a checkpoint."""


class TrainerActor(TrainerShell):
    def __init__(self, run_name: str, config: dict[str, Any], model_dir: str, resume_dir: str | None = None,
                 search_path: str | None = None, rank_group: Any = None, reference_dir: str | None = None):
        """`model_dir`: the weights to train from (a checkpoint's when resuming); `reference_dir`: the run's
        initial weights, the reference policy of a KL penalty (default: `model_dir`)."""
        from streamrl.tasks import make_task

        logs.setup_actor_logging()
        cfg = self.config = RunConfig.model_validate(config)
        if cfg.trainer.backend != "sim":  # the simulator's processes import neither torch nor transformers
            import torch

            from streamrl.models.hf import quiet_transformers

            quiet_transformers()
            torch.set_num_threads(cfg.trainer.threads)
        trainer = make_learner(run_name, cfg, config, model_dir, resume_dir, rank_group,
                                reference_dir=reference_dir or model_dir)
        if resume_dir is not None:
            trainer.load_optimizer(resume_dir)
        colocated = cfg.producers.count if cfg.trainer.colocated else 0
        if colocated:
            trainer.offload()  # the servers start while the trainer waits off the GPU
        super().__init__(run_name, trainer, groups_per_step=cfg.queue.groups_per_step,
                         get_timeout_s=cfg.trainer.get_timeout_s, colocated_producers=colocated)
        self.task = make_task(cfg.task, trainer.tokenizer, seed=cfg.run.seed,
                              search_path=search_path, sim=cfg.sim_workload())
        self.max_new_tokens = cfg.sampling.max_new_tokens or self.task.max_new_tokens()
        if cfg.trainer.diagnose_every:  # the torch learner (the config refuses the others)
            trainer.diagnose_with(self.task, max_new_tokens=self.max_new_tokens, temperature=cfg.sampling.temperature,
                                  top_p=cfg.sampling.top_p)
        self._group_sender, self._sender_lock = None, threading.Lock()

    def evaluate(self, limit: int | None = None) -> dict[str, float]:
        result = self.trainer.evaluate(self.task, limit=limit or self.config.task.eval_size,
                                       max_new_tokens=self.max_new_tokens)
        failures = _reward_failures(self.task)["reward_failures"]
        return {**result, "eval_reward_failures": sum(failures.values())}  # since the trainer started

    def checkpoint(self, directory: str) -> None:
        self.trainer.save(Path(directory))
        log.info("checkpoint of version %s written to %s", getattr(self.trainer, "version", None), directory)

    # ---- rank 0 of the sglang update groups (producers.sglang.weights = "distributed") -------------------
    # Called by the producer that owns each server, in this actor's other threads while a step runs; the
    # bytes leave from this process's GPU (see streamrl.weights.broadcast).
    def _sender(self):
        with self._sender_lock:
            if self._group_sender is None:
                from streamrl.weights.broadcast import GroupSender

                self._group_sender = GroupSender(node=ray.util.get_node_ip_address())
            return self._group_sender

    def open_update_group(self, name: str, world: int, server: tuple[str, int], node: str | None,
                          timeout_s: float) -> tuple[str, int, str]:
        return self._sender().open_group(name, world, server=tuple(server), node=node, timeout_s=timeout_s)

    def join_update_group(self, name: str, timeout_s: float) -> None:
        self._sender().joined(name, timeout_s)

    def weights_manifest(self, weights: list[ray.ObjectRef]) -> dict[str, Any]:
        return self._sender().manifest(weights)

    def broadcast_weights(self, name: str, weights: list[ray.ObjectRef], names: list[str], timeout_s: float) -> None:
        self._sender().broadcast(name, weights, names, timeout_s)

    def close_update_group(self, name: str) -> None:
        self._sender().close_group(name)

    def close_update_groups(self, prefix: str) -> int:
        """Leave a dead producer's groups (it cannot): their stores and threads go with them."""
        return 0 if self._group_sender is None else self._group_sender.close_groups(prefix)

    def weight_broadcasts(self) -> dict[str, int]:
        """Groups joined, buckets and bytes sent as rank 0 so far ({} when none was opened)."""
        return {} if self._group_sender is None else dict(self._group_sender.stats)
