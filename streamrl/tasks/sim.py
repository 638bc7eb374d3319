"""Prompts and rewards of the simulated workload: deterministic per prompt id, cheap, never learned."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from streamrl.sim.workload import SimWorkload


class SimTask:
    name = "sim"
    stop_token_ids: Sequence[int] = ()

    def __init__(self, workload: SimWorkload):
        self.workload = workload

    def prompt(self, prompt_id: int) -> list[int]:
        rng = np.random.default_rng(prompt_id)
        return rng.integers(0, self.workload.vocab_size, size=self.workload.prompt_tokens).tolist()

    def reward(self, prompt_id: int, response_ids: Sequence[int]) -> float:
        return float((prompt_id + len(response_ids)) % 2)  # varies within a group, so advantages are not all 0

    def eval_prompts(self, limit: int | None = None) -> list[list[int]]:
        return []  # nothing is learned, so nothing is evaluated

    def eval_reward(self, index: int, response_ids: Sequence[int]) -> float:
        raise IndexError("the simulated task has no held-out prompts")

    def max_new_tokens(self) -> int:
        return self.workload.max_tokens
