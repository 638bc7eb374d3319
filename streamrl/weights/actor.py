"""The weights registry as a Ray actor (no torch: it only holds object references)."""

from __future__ import annotations

from typing import Any

import ray

from streamrl.weights.registry import WeightRegistry


class WeightsActor:
    def __init__(self) -> None:
        self.registry = WeightRegistry()

    def publish(self, version: int, refs: list[ray.ObjectRef]) -> None:
        # The trainer put the weights (one copy, measured in benchmarks/weights.py); this actor only
        # borrows the reference, so the object lives while the registry or a producer holds it.
        # If the trainer dies its weights go with it, which costs nothing: producers keep what they
        # loaded, and a restarted trainer publishes again from its checkpoint.
        (ref,) = refs
        self.registry.publish(version, ref)

    def acquire(self, holder: int, have: int | None, timeout: float = 0.0) -> tuple[int, list] | None:
        got = self.registry.acquire(holder, have, timeout)
        return None if got is None else (got[0], [got[1]])  # in a list: the caller receives the reference

    def drop_holder(self, holder: int) -> None:
        self.registry.drop_holder(holder)

    def status(self) -> dict[str, Any]:
        return self.registry.status()
