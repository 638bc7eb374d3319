"""The trainer's arithmetic replaced by the timing model: a step takes `train_s_per_token` per
response token (scaled), then the weights of `weights_mb` are published for real by the shell."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from streamrl.engine.sim import sim_weights
from streamrl.sim.workload import SimWorkload
from streamrl.weights.arrays import state_arrays


class SimLearner:
    """A `streamrl.trainer.learner.Learner` whose step is the timing model's sleep. Not a step backend:
    running the step plan would add the very arithmetic whose cost the model stands for."""

    tokenizer = None  # no model, no tokens to decode

    def __init__(self, workload: SimWorkload, version: int = 0):
        self.workload = workload
        self.version = version
        self.model = sim_weights(workload)
        self.seconds_per_token = workload.calibrated_train_s_per_token() * workload.time_scale

    def train(self, table: pa.Table) -> dict[str, float]:
        started = time.perf_counter()
        response_tokens = int(pc.sum(pc.list_value_length(table.column("response_ids"))).as_py())
        prompt_tokens = int(pc.sum(pc.list_value_length(table.column("prompt_ids"))).as_py())
        time.sleep(response_tokens * self.seconds_per_token)
        self.version += 1
        self.model.arrays["weight"][0] = self.version  # new contents each version, as after a real optimizer step
        return {"response_tokens": response_tokens, "trained_tokens": response_tokens + prompt_tokens,
                "samples": table.num_rows, "train_s": time.perf_counter() - started}

    def weights(self) -> dict[str, np.ndarray]:
        return state_arrays(self.model, copy=False)

    def evaluate(self, task: Any, *, limit: int | None = None, max_new_tokens: int) -> dict[str, float]:
        return {}  # nothing is learned, so there is nothing to evaluate

    # ---- checkpoints: the version is the whole state -----------------------------------------------
    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "trainer.json").write_text(json.dumps({"version": self.version}))

    def load_optimizer(self, directory: str | Path) -> None:
        self.version = json.loads((Path(directory) / "trainer.json").read_text())["version"]

    def offload(self) -> None:
        """Nothing lives on a device."""

    def onload(self) -> None:
        """Nothing lives on a device."""

    def close(self) -> None:
        """Nothing to leave."""
