"""Reverse digit strings of very different lengths: the built-in task with a long tail of responses.

Prompt `<bos> d1 … dL >`, answer `dL … d1 <eos>`, scored as `reverse` (fraction of positions right,
halved without `<eos>`). The length L of each prompt's string is drawn so that response lengths
(L + 1 tokens) follow a lognormal whose 99th percentile is `tail` × its median: most answers are a few
tokens, one in a hundred is `tail` times longer. A synchronous step waits for its longest answer, so
this is the workload on which streaming generation pays — with the real model, not a timing model.
About a tenth of all strings (by a fixed hash) are held out for evaluation and never trained on.
"""

from __future__ import annotations

import functools
import math
import zlib
from collections.abc import Sequence

import numpy as np

from streamrl.tasks.reverse import BOS, EOS, CharVocab, grade

Z_99 = 2.3263478740408408  # standard normal 99th percentile
EVAL_SEED = 20261203  # the held-out set is the same for every run seed


class ReverseLongTail:
    name = "long_tail"
    stop_token_ids = (EOS,)

    def __init__(self, median_digits: int = 2, max_digits: int = 28, tail: float = 8.0, seed: int = 0):
        if not 1 <= median_digits <= max_digits:
            raise ValueError(f"need 1 <= median_digits ({median_digits}) <= max_digits ({max_digits})")
        if tail < 1:
            raise ValueError(f"tail (p99 / median of the response length) must be >= 1, got {tail}")
        self.median_digits, self.max_digits, self.tail, self.seed = median_digits, max_digits, tail, seed
        self.vocab = CharVocab()

    def draw_digits(self, rng: np.random.Generator) -> str:
        """One string: response length (L + 1) lognormal around median_digits + 1, L clipped to [1, max]."""
        sigma = math.log(self.tail) / Z_99
        response = (self.median_digits + 1) * math.exp(sigma * rng.standard_normal())
        length = int(min(self.max_digits, max(1, round(response) - 1)))
        return "".join(map(str, rng.integers(0, 10, size=length)))

    @staticmethod
    def is_held_out(digits: str) -> bool:
        return zlib.crc32(digits.encode()) % 10 == 0  # fixed: independent of the seed and of how strings are drawn

    @functools.lru_cache(maxsize=4096)  # noqa: B019 -- one task per process; rewards ask G times per prompt
    def digits(self, prompt_id: int) -> str:
        """The training string of a prompt id: deterministic, never a held-out one."""
        rng = np.random.default_rng([self.seed, prompt_id])
        while True:
            digits = self.draw_digits(rng)
            if not self.is_held_out(digits):
                return digits

    def prompt_ids(self, digits: str) -> list[int]:
        return [BOS, *self.vocab.encode(f"{digits}>")]

    def prompt(self, prompt_id: int) -> list[int]:
        return self.prompt_ids(self.digits(prompt_id))

    def target(self, digits: str) -> list[int]:
        return self.vocab.encode(digits[::-1])

    def reward(self, prompt_id: int, response_ids: Sequence[int]) -> float:
        return grade(self.target(self.digits(prompt_id)), response_ids)

    @functools.cached_property
    def _held_out(self) -> list[str]:
        rng, strings = np.random.default_rng(EVAL_SEED), []
        while len(strings) < 512:
            digits = self.draw_digits(rng)
            if self.is_held_out(digits):
                strings.append(digits)
        return strings

    def eval_prompts(self, limit: int | None = None) -> list[list[int]]:
        return [self.prompt_ids(d) for d in self._held_out[:limit]]

    def eval_reward(self, index: int, response_ids: Sequence[int]) -> float:
        return grade(self.target(self._held_out[index]), response_ids)

    def max_new_tokens(self) -> int:
        return self.max_digits + 2
