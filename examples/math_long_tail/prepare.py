"""Make this example's data and checkpoint: `python -m examples.math_long_tail.prepare [--out DIR]`.

Task: subtraction from a number of nines, `99…9 − n`, answered digit by digit. The length of `n` is
long-tailed (mostly 1–3 digits, now and then up to 12), so answers are too: most groups finish in a
few tokens while a few run four times longer — the workload where a trainer that waits for its slowest
rollout idles. The reward extracts the answer's digits and checks each against the difference.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from examples.checkpoint import char_tokenizer, main, write_example
from streamrl.models.hf import quiet_transformers

HERE = Path(__file__).parent
MAX_DIGITS = 12


def draw_lengths(rng: np.random.Generator, count: int) -> np.ndarray:
    """Digits of n: P(k) ∝ k^-2.5 for k in 1..12 (median 1, mean ≈ 1.9, 1 in 40 at 7 or more)."""
    k = np.arange(1, MAX_DIGITS + 1)
    p = k ** -2.5
    return rng.choice(k, size=count, p=p / p.sum())


def row(n: str) -> dict:
    return {"prompt": f"{'9' * len(n)}-{n}=", "answer": "".join(str(9 - int(d)) for d in n)}


def prepare(out: Path, seed: int = 0, train: int = 20000, held_out: int = 256) -> None:
    quiet_transformers()
    rng = np.random.default_rng(seed)
    numbers = ["".join(map(str, rng.integers(0, 10, k))) for k in draw_lengths(rng, train + held_out)]
    write_example(out, {"train": [row(n) for n in numbers[:train]], "eval": [row(n) for n in numbers[train:]]},
                  char_tokenizer("0123456789-="), seed)


if __name__ == "__main__":
    main(prepare, __doc__, HERE)
