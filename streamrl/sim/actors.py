"""Ray actors of the simulated pipeline: the real queue, weights actor and trainer shell, with the
simulated engine and learner inside (see `streamrl.sim.pipeline`).

A process is started once and `attach`ed to the queue and weights actor of each run in turn, with
fresh state: starting a process that imports torch costs seconds on two cores, attaching costs
milliseconds."""

from __future__ import annotations

import copy
import os
import threading
from typing import Any

import ray

from streamrl.buffer.actor import NAMESPACE, get_queue_actor
from streamrl.rollout.continuous import ContinuousProducer
from streamrl.runtime.actors import RemoteQueue, TrainerShell, actor_name, receiving, remote_fetch
from streamrl.sim.engine import SimEngine
from streamrl.sim.learner import SimLearner
from streamrl.sim.task import SimTask
from streamrl.sim.workload import SimWorkload
from streamrl.weights.receiver import WeightReceiver


class SimProducerActor:
    def __init__(self) -> None:
        import torch

        torch.set_num_threads(1)
        self.producer: ContinuousProducer | None = None

    def ready(self) -> int:
        return os.getpid()

    def attach(self, run_name: str, producer_id: int, workload: dict[str, Any], seed: int,
               max_staleness: int | None = None) -> None:
        """Fresh engine, receiver and producer for the run `run_name`."""
        work = SimWorkload.model_validate(workload)
        engine = SimEngine(work, seed=seed)
        self.weights = ray.get_actor(actor_name(run_name, "weights"), namespace=NAMESPACE)
        self.receiver = WeightReceiver(remote_fetch(self.weights, producer_id), poll_s=1.0,
                                       standby=copy.deepcopy(engine.model))
        self.producer = ContinuousProducer(producer_id, queue=RemoteQueue(get_queue_actor(run_name), producer_id),
                                           receiver=self.receiver, engine=engine, task=SimTask(work),
                                           group_size=work.group_size, max_staleness=max_staleness)
        self._stop = threading.Event()

    def run(self) -> dict[str, Any]:
        with receiving(self.receiver, self.weights, self.producer.producer_id):
            self.producer.run(self._stop)
        return self.status()

    def stop(self) -> None:
        self._stop.set()

    def status(self) -> dict[str, Any]:
        return {"producer_id": self.producer.producer_id, **self.producer.stats,
                "capacity": self.producer.engine.capacity, "stalls": list(self.producer.stalls),
                "blocked_by": self.producer.last_blocked_by}


class SimTrainerActor(TrainerShell):
    def __init__(self) -> None:
        import torch

        torch.set_num_threads(1)

    def attach(self, run_name: str, workload: dict[str, Any], get_timeout_s: float = 300.0) -> None:
        """A fresh learner at version 0, stepping against the queue of `run_name`."""
        work = SimWorkload.model_validate(workload)
        TrainerShell.__init__(self, run_name, SimLearner(work), groups_per_step=work.groups_per_step,
                              get_timeout_s=get_timeout_s)
