"""The learning rate of each optimizer step: a linear warm-up, then constant, cosine or linear decay.

```
 step s (optimizer steps taken before this one; 0 for the first)
 warm-up   s < W:        lr · (s + 1) / W
 constant:               lr
 cosine:   W ≤ s < D:    lr · (r + (1 − r) · ½ (1 + cos(π · (s − W) / (D − W))))      r = min_lr_ratio
 linear:   W ≤ s < D:    lr · (r + (1 − r) · (1 − (s − W) / (D − W)))
           s ≥ D:        lr · r
```
A pure function of the step count, which the trainer saves with its checkpoint: a resumed run goes on
with exactly the learning rates an uninterrupted one would have used.
"""

from __future__ import annotations

import math

SCHEDULES = ("constant", "cosine", "linear")


def lr_at(step: int, *, lr: float, schedule: str = "constant", warmup_steps: int = 0, decay_steps: int | None = None,
          min_lr_ratio: float = 0.0) -> float:
    """The learning rate of optimizer step `step` (0-based). `decay_steps`: the step (counted from the
    start, warm-up included) at which the decay reaches `lr · min_lr_ratio`."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown learning-rate schedule {schedule!r} (one of {', '.join(SCHEDULES)})")
    if schedule != "constant" and (decay_steps is None or decay_steps <= warmup_steps):
        raise ValueError(f"a {schedule} schedule needs decay_steps > warmup_steps ({decay_steps} ≤ {warmup_steps})")
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return lr
    progress = min(1.0, (step - warmup_steps) / (decay_steps - warmup_steps))
    shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if schedule == "cosine" else 1.0 - progress
    return lr * (min_lr_ratio + (1.0 - min_lr_ratio) * shape)
