"""Ray actors of the simulated pipeline: the real queue, weights actor and trainer shell, with the
simulated engine and learner inside (see `benchmarks/pipeline.py`)."""

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
    def __init__(self, run_name: str, producer_id: int, workload: dict[str, Any], seed: int):
        import torch

        torch.set_num_threads(1)
        work = SimWorkload.model_validate(workload)
        engine = SimEngine(work, seed=seed)
        self.weights = ray.get_actor(actor_name(run_name, "weights"), namespace=NAMESPACE)
        self.receiver = WeightReceiver(remote_fetch(self.weights, producer_id), poll_s=1.0,
                                       standby=copy.deepcopy(engine.model))
        self.producer = ContinuousProducer(producer_id, queue=RemoteQueue(get_queue_actor(run_name)),
                                           receiver=self.receiver, engine=engine, task=SimTask(work),
                                           group_size=work.group_size)
        self._stop = threading.Event()

    def ready(self) -> int:
        return os.getpid()

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
    def __init__(self, run_name: str, workload: dict[str, Any], get_timeout_s: float = 300.0):
        import torch

        torch.set_num_threads(1)
        work = SimWorkload.model_validate(workload)
        super().__init__(run_name, SimLearner(work), groups_per_step=work.groups_per_step,
                         get_timeout_s=get_timeout_s)
