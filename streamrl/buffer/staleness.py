"""The staleness rule, in one place.

A group admitted as the k-th live group (k counted from 0 over running + queued + consumed groups)
at trainer version v may be admitted only if k < (v + η + 1) · B. When groups are consumed in
admission order, group k is trained at version floor(k / B) <= v + η, so a producer holding the
weights of version v at admission yields data at most η versions old when it is trained.
"""

from __future__ import annotations


def staleness(trainer_version: int, behavior_version: int) -> int:
    """Versions between the weights that sampled a group and the weights it is trained at."""
    return trainer_version - behavior_version


def admission_budget(*, trainer_version: int, max_staleness: int, groups_per_step: int,
                     admitted_live: int) -> int:
    """How many more groups may be admitted now (never negative)."""
    return max(0, (trainer_version + max_staleness + 1) * groups_per_step - admitted_live)


def weights_fresh_enough(*, trainer_version: int, max_staleness: int, weights_version: int) -> bool:
    """A producer may start work only with weights inside the budget at admission time."""
    return staleness(trainer_version, weights_version) <= max_staleness
