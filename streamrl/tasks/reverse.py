"""Reverse a string of digits: the built-in task a ~1M-parameter model learns by RL in minutes on a CPU.

Prompt `<bos> d1 d2 d3 >`, answer `d3 d2 d1 <eos>`. The reward is the fraction of answer positions
that are right, halved when the answer does not end with `<eos>`, so partial progress is rewarded and
a group rarely has all-equal rewards (the failure mode of exact-match rewards at this scale).
About a tenth of all digit strings are held out for evaluation and never used as training prompts.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

CHARS = "0123456789+=>,"
PAD, BOS, EOS = 0, 1, 2
SPECIALS = ("<pad>", "<bos>", "<eos>")


class CharVocab:
    """Pad, bos, eos and one token per character of `CHARS` (17 tokens)."""

    def __init__(self) -> None:
        self.tokens = [*SPECIALS, *CHARS]
        self._ids = {ch: i for i, ch in enumerate(self.tokens)}

    def __len__(self) -> int:
        return len(self.tokens)

    def encode(self, text: str) -> list[int]:
        unknown = sorted(set(text) - set(CHARS))
        if unknown:
            raise ValueError(f"characters {unknown} are not in the vocabulary {CHARS!r}")
        return [self._ids[ch] for ch in text]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.tokens[i] if i >= len(SPECIALS) else "" for i in ids)


def grade(target: Sequence[int], response_ids: Sequence[int]) -> float:
    """Fraction of answer positions right (over the longer of answer and target), halved without a
    final `<eos>`."""
    response = list(response_ids)
    ended = EOS in response
    answer = response[: response.index(EOS)] if ended else response
    right = sum(a == t for a, t in zip(answer, target))
    score = right / max(len(target), len(answer))
    return score if ended else score / 2


class ReverseDigits:
    name = "reverse"

    def __init__(self, digits: int = 3, seed: int = 0):
        if not 1 <= digits <= 12:
            raise ValueError(f"digits must be in [1, 12], got {digits}")
        self.digits, self.seed, self.vocab = digits, seed, CharVocab()
        self._held_out: list[int] = []  # found so far, in increasing order (`eval_numbers`)
        self._next_candidate = 0

    def is_held_out(self, number: int) -> bool:
        # A fixed multiplicative hash: the split does not depend on the seed or on how prompts are drawn.
        return (number * 2654435761 + self.digits) % 2**32 % 10 == 0

    @functools.lru_cache(maxsize=4096)  # noqa: B019 -- one task per process; rewards ask G times per prompt
    def number(self, prompt_id: int) -> int:
        """The training number for a prompt id: deterministic, never a held-out one."""
        rng = np.random.default_rng([self.seed, prompt_id])
        while True:
            n = int(rng.integers(0, 10**self.digits))
            if not self.is_held_out(n):
                return n

    def prompt_ids(self, number: int) -> list[int]:
        return [BOS, *self.vocab.encode(f"{number:0{self.digits}d}>")]

    def prompt(self, prompt_id: int) -> list[int]:
        return self.prompt_ids(self.number(prompt_id))

    def target(self, number: int) -> list[int]:
        return self.vocab.encode(f"{number:0{self.digits}d}"[::-1])

    def score(self, number: int, response_ids: Sequence[int]) -> float:
        return grade(self.target(number), response_ids)

    def eval_numbers(self, limit: int | None = None) -> list[int]:
        """The first `limit` held-out numbers in increasing order (all of them with None). Found lazily:
        at 12 digits there are 10^11 of them, and an evaluation asks for a few hundred."""
        while limit is None or len(self._held_out) < limit:
            if self._next_candidate >= 10**self.digits:
                break
            n, self._next_candidate = self._next_candidate, self._next_candidate + 1
            if self.is_held_out(n):
                self._held_out.append(n)
        return self._held_out[:limit]

    # ---- the Task interface (streamrl.tasks.Task) ----------------------------------------------------
    stop_token_ids = (EOS,)

    def reward(self, prompt_id: int, response_ids: Sequence[int]) -> float:
        return self.score(self.number(prompt_id), response_ids)

    def eval_prompts(self, limit: int | None = None) -> list[list[int]]:
        return [self.prompt_ids(n) for n in self.eval_numbers(limit)]

    def eval_reward(self, index: int, response_ids: Sequence[int]) -> float:
        return self.score(self.eval_numbers(index + 1)[index], response_ids)

    def max_new_tokens(self) -> int:
        return self.digits + 2
