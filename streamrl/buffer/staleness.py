"""The staleness rule, in one place.

A group admitted as the k-th live group (k counted from 0 over running + queued + consumed groups)
by a producer holding the weights of version w (never newer than the trainer's v) may be admitted
only if k < (w + η + 1) · B. When groups are consumed in admission order, group k is trained at
version floor(k / B) <= w + η, and every token of it was sampled by weights >= w, so it is at most
η versions old when it is trained. Using v instead of w would let a producer that has not yet
loaded the newest weights admit data that ends up η + 1 old (measured: ~20% of the groups of a
fast CPU run were regenerated that way).
"""

from __future__ import annotations


def staleness(trainer_version: int, behavior_version: int) -> int:
    """Versions between the weights that sampled a group and the weights it is trained at."""
    return trainer_version - behavior_version


def admission_budget(*, trainer_version: int, max_staleness: int, groups_per_step: int,
                     admitted_live: int, weights_version: int | None = None) -> int:
    """How many more groups may be admitted now (never negative) by a producer holding
    `weights_version` (None: a producer that holds the trainer's version)."""
    base = trainer_version if weights_version is None else min(trainer_version, weights_version)
    return max(0, (base + max_staleness + 1) * groups_per_step - admitted_live)


def weights_fresh_enough(*, trainer_version: int, max_staleness: int, weights_version: int) -> bool:
    """A producer may start work only with weights inside the budget at admission time."""
    return staleness(trainer_version, weights_version) <= max_staleness
