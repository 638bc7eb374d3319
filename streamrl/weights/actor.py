"""The weights registry as a Ray actor (no torch: it only holds object references and arrays).

```
 trainer ──put(arrays)──► object store;  publish(v, [ref], nbytes) ──► WeightsActor
 producer ──acquire(holder, have) (long poll)──► small versions: the arrays in the answer (one hop)
                                                 large ones (or by_reference): [ref] ─► ray.get
```
A version of at most `INLINE_MAX_BYTES` is read once by this actor when it is published and handed out
by value: a producer's long poll returns the arrays themselves, instead of a reference it must then
resolve with another round trip to the trainer (three hops of ~5 ms made publish + fetch 3–4.5× one
put + get at 1–16 MB). Above it the copies dominate and each producer reads the trainer's object
itself. Producers that pass the version on (sglang's broadcast from the trainer) ask for the reference.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import ray

from streamrl.weights.registry import WeightRegistry

INLINE_MAX_BYTES = 64 << 20


def publish_weights(weights: ray.actor.ActorHandle, version: int, arrays: dict[str, np.ndarray]) -> ray.ObjectRef:
    """Put `version`'s arrays in the object store (one copy, owned by the caller) and announce it to the
    weights actor; returns the announcement's reference (get it to see an error)."""
    nbytes = sum(array.nbytes for array in arrays.values())
    return weights.publish.remote(version, [ray.put(arrays)], nbytes)  # in a list: by reference


class WeightsActor:
    def __init__(self) -> None:
        self.registry = WeightRegistry()

    def publish(self, version: int, refs: list[ray.ObjectRef], nbytes: int | None = None) -> None:
        # The trainer put the weights; this actor borrows the reference, so the object lives while the
        # registry or a producer holds it. If the trainer dies its weights go with it, which costs
        # nothing: producers keep what they loaded, and a restarted trainer publishes again.
        (ref,) = refs
        inline = ray.get(ref) if nbytes is not None and nbytes <= INLINE_MAX_BYTES else None
        self.registry.publish(version, (ref, inline))

    def acquire(self, holder: int, have: int | None, timeout: float = 0.0,
                by_reference: bool = False) -> tuple[int, Any] | None:
        """(version, arrays) for a small version, else (version, [ref]); `by_reference`: always [ref]."""
        got = self.registry.acquire(holder, have, timeout)
        if got is None:
            return None
        version, (ref, inline) = got
        return (version, inline) if inline is not None and not by_reference else (version, [ref])

    def drop_holder(self, holder: int) -> None:
        self.registry.drop_holder(holder)

    def status(self) -> dict[str, Any]:
        return self.registry.status()
