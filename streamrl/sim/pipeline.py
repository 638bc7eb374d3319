"""Run the simulated pipeline under one schedule through the real Ray actors, and measure it.

```
 driver ──step()──► SimTrainerActor ──get(B)──► QueueActor ◄──admit / commit── SimProducerActor ×N
                        └──publish(v, weights)──► WeightsActor ──acquire (long poll)──┘
 measured: from the end of the warm-up steps to the end of the last step (the pipeline is full)
```
The same workload runs under every schedule; only the queue's admission changes:
`sync` (η = 0), `one_step` (η = 1, whole batches behind a barrier), `async` (continuous, budget η).
The ideal is measured in the same way: generation alone (no trainer, no staleness limit) and
training alone (a queue filled in advance, no producers).
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import ray

from streamrl.buffer.actor import create_queue_actor
from streamrl.buffer.config import QueueConfig
from streamrl.buffer.synthetic import synthetic_batch
from streamrl.runtime.actors import create_actor
from streamrl.sim.actors import SimProducerActor, SimTrainerActor
from streamrl.sim.engine import weights_module
from streamrl.sim.workload import SimWorkload
from streamrl.weights.actor import WeightsActor
from streamrl.weights.arrays import state_arrays

UNBOUNDED = 10**9  # a staleness budget that never binds: generation or training alone


@dataclass(frozen=True)
class Schedule:
    name: str
    max_staleness: int
    admission: Literal["continuous", "per_step"] = "continuous"


def standard_schedules(eta: int) -> list[Schedule]:
    return [Schedule("sync", 0), Schedule("one_step", 1, "per_step"), Schedule("async", eta)]


def queue_config(work: SimWorkload, max_staleness: int, admission: str = "continuous") -> QueueConfig:
    # A group holds its in-flight slot until its slowest sample ends, while the engine refills the slots
    # of its finished samples: a cap of one group per G engine slots would leave slots idle behind
    # the long tail, so the cap here is one group per slot (the engines' own capacity binds first).
    slots = work.producers * work.sequences_per_producer
    return QueueConfig(group_size=work.group_size, groups_per_step=work.groups_per_step,
                       max_staleness=max_staleness, admission=admission,
                       max_in_flight=max(slots, work.groups_per_step), capacity_tokens=10**9)


class SimPool:
    """Trainer and producer processes started once and attached to a fresh queue and weights actor
    for each run (see `streamrl.sim.actors`)."""

    def __init__(self) -> None:
        self.trainer = ray.remote(num_cpus=0, max_concurrency=2)(SimTrainerActor).remote()
        self.producers: list[ray.actor.ActorHandle] = []
        self._runs = 0
        ray.get(self.trainer.ready.remote(), timeout=120)

    def _grow(self, count: int) -> None:
        cls = ray.remote(num_cpus=0, max_concurrency=3)(SimProducerActor)
        new = [cls.remote() for _ in range(count - len(self.producers))]
        ray.get([p.ready.remote() for p in new], timeout=120)
        self.producers += new

    @contextmanager
    def run(self, work: SimWorkload, queue_cfg: QueueConfig, *, producers: bool = True, trainer: bool = True,
            seed: int = 0) -> Iterator[dict[str, Any]]:
        """The actors of one run: a new queue and weights actor, the pool's processes attached to them."""
        self._runs += 1
        name = f"sim-pipeline-{os.getpid()}-{self._runs}"
        spec = work.model_dump()
        queue = create_queue_actor(name, queue_cfg)
        weights = create_actor(WeightsActor, name, "weights", max_concurrency=work.producers + 4)
        try:
            used = []
            if producers:
                self._grow(work.producers)
                used = self.producers[:work.producers]
                ray.get([p.attach.remote(name, i, spec, seed + i, queue_cfg.max_staleness)
                         for i, p in enumerate(used)])
            if trainer:
                ray.get(self.trainer.attach.remote(name, spec))
            yield {"name": name, "queue": queue, "weights": weights, "producers": used,
                   "trainer": self.trainer if trainer else None}
        finally:
            ray.kill(queue)
            ray.kill(weights)

    def close(self) -> None:
        for actor in (self.trainer, *self.producers):
            ray.kill(actor)


def _producer_totals(producers: list) -> dict[str, float]:
    statuses = ray.get([p.status.remote() for p in producers], timeout=60)
    return {"at": time.time(), "busy_slot_s": sum(s["busy_slot_s"] for s in statuses),
            "generated_tokens": sum(s["generated_tokens"] for s in statuses),
            "capacity": sum(s["capacity"] for s in statuses)}


def _stop_producers(producers: list, runs: list) -> list[dict[str, Any]]:
    for producer in producers:
        producer.stop.remote()
    return ray.get(runs, timeout=120)


def _summary(values: list[float]) -> dict[str, float]:
    if not values:
        return {"count": 0}
    array = np.asarray(values)
    return {"count": len(values), "median": float(np.median(array)), "p99": float(np.percentile(array, 99)),
            "max": float(array.max())}


def measure_schedule(pool: SimPool, work: SimWorkload, schedule: Schedule, *, warmup_steps: int, min_steps: int,
                     window_s: float, max_s: float = 300.0, seed: int = 0) -> dict[str, Any]:
    """Tokens and samples trained per second once the pipeline is full, with what kept it from more."""
    with pool.run(work, queue_config(work, schedule.max_staleness, schedule.admission), seed=seed) as c:
        trainer, producers = c["trainer"], c["producers"]
        ray.get(trainer.publish.remote())
        runs = [p.run.remote() for p in producers]
        started, steps, mark = time.time(), [], None
        pending = trainer.step.remote()
        while True:
            result = ray.get(pending, timeout=max_s)
            steps.append(result)
            measured = len(steps) - warmup_steps
            enough = measured >= min_steps and (result["ended_at"] - mark["at"] >= window_s
                                                or time.time() - started > max_s)
            if not enough:
                pending = trainer.step.remote()  # before reading producer counters: the trainer never waits on us
            if measured == 0:
                mark = _producer_totals(producers)
                mark["at"] = result["ended_at"]
            if enough:
                break
        end = _producer_totals(producers)
        end["at"] = steps[-1]["ended_at"]
        stats = _stop_producers(producers, runs)
        queue = ray.get(c["queue"].status.remote())
    window = steps[warmup_steps:]
    span = end["at"] - mark["at"]
    staleness = [s for step in window for s in step["staleness"]]
    return {
        "schedule": schedule.name, "max_staleness": schedule.max_staleness, "admission": schedule.admission,
        "steps_measured": len(window), "window_s": span,
        "tokens_per_s": sum(s["response_tokens"] for s in window) / span,
        "samples_per_s": sum(s["samples"] for s in window) / span,
        "generated_tokens_per_s": (end["generated_tokens"] - mark["generated_tokens"]) / span,
        "trainer_busy": sum(s["train_s"] for s in window) / span,
        "producer_busy": (end["busy_slot_s"] - mark["busy_slot_s"]) / (end["capacity"] * span),
        "step_s_mean": float(np.mean([s["step_s"] for s in window])),
        "trainer_wait_s_mean": float(np.mean([s["trainer_wait_s"] for s in window])),
        "staleness": {"mean": float(np.mean(staleness)), "max": int(max(staleness)),
                      "histogram": {str(k): v for k, v in sorted(Counter(staleness).items())}},
        "stall_per_update_s": _summary([x for s in stats for x in s["stalls"]]),
        "regenerated_groups": queue["over_budget"],  # finished, then found over the budget
        "aborted_groups": sum(s["aborted_groups"] for s in stats),  # stopped as soon as certain to be
        "wasted_fraction": 1 - sum(s["response_tokens"] for s in window) / max(
            1, end["generated_tokens"] - mark["generated_tokens"]),
    }


def generation_alone(pool: SimPool, work: SimWorkload, *, warmup_s: float, window_s: float,
                     seed: int = 0) -> dict[str, Any]:
    """Tokens/s of the producers with nothing limiting admission and no trainer."""
    with pool.run(work, queue_config(work, UNBOUNDED), trainer=False, seed=seed) as c:
        producers = c["producers"]
        ray.get(c["weights"].publish.remote(0, [ray.put(state_arrays(weights_module(work)))]))
        runs = [p.run.remote() for p in producers]
        time.sleep(warmup_s)
        mark = _producer_totals(producers)
        time.sleep(window_s)
        end = _producer_totals(producers)
        _stop_producers(producers, runs)
    span = end["at"] - mark["at"]
    return {"tokens_per_s": (end["generated_tokens"] - mark["generated_tokens"]) / span,
            "producer_busy": (end["busy_slot_s"] - mark["busy_slot_s"]) / (end["capacity"] * span),
            "window_s": span}


def training_alone(pool: SimPool, work: SimWorkload, *, steps: int, seed: int = 0) -> dict[str, Any]:
    """Tokens/s of the trainer consuming a queue filled in advance (the first step is warm-up)."""
    rng = np.random.default_rng(seed)
    with pool.run(work, queue_config(work, UNBOUNDED), producers=False, seed=seed) as c:
        queue, trainer = c["queue"], c["trainer"]
        for _ in range(steps):
            admission = ray.get(queue.admit.remote(0, work.groups_per_step))
            rows = len(admission.tickets) * work.group_size
            ray.get(queue.commit.remote(synthetic_batch(
                admission.tickets, work.group_size, prompt_len=work.prompt_tokens,
                response_len=work.sample_lengths(rng, rows), vocab_size=work.vocab_size, rng=rng)))
        ray.get(trainer.publish.remote())
        results = [ray.get(trainer.step.remote(), timeout=300) for _ in range(steps)]
    span = results[-1]["ended_at"] - results[0]["ended_at"]
    return {"tokens_per_s": sum(r["response_tokens"] for r in results[1:]) / span,
            "trainer_busy": sum(r["train_s"] for r in results[1:]) / span, "window_s": span}
