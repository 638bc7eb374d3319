"""The weights registry as a Ray actor (no torch: it only holds object references), and the trainer's
side of publishing.

```
 trainer: write(v, arrays) into shared memory ──datagram──► producers on this machine (SharedWeightsWriter)
          put(arrays) once ──► publish(v, [ref]) ──► WeightsActor (registry: versions kept, long polls)
                          └──► offer_weights(v, [ref]) ──► every other subscribed producer (one hop)
 producer: long poll acquire(holder, have) ◄── a producer that missed an offer, or started later
```
A version reaches a running producer as a direct offer from the trainer: answering the producers'
long polls through the weights actor costs a second hop, ~6 ms more with four producers on two cores
(`benchmarks/weights.py`). Producers on the trainer's machine that load weights into their own process
get versions up to `SHARED_MAX_BYTES` through shared memory (`streamrl.weights.shared_memory`): no Ray
call at all on the way. The long poll stays for producers that join later or missed an offer, and
its `have` keeps the registry's record of what each producer holds current.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np
import ray

from streamrl import logs
from streamrl.weights.registry import WeightRegistry
from streamrl.weights.shared_memory import SHARED_MAX_BYTES, SharedAddress, SharedWeightsWriter

log = logging.getLogger(__name__)


class WeightsActor:
    def __init__(self) -> None:
        logs.setup_actor_logging()
        self.registry = WeightRegistry()

    def publish(self, version: int, refs: list[ray.ObjectRef]) -> None:
        # The trainer put the weights (one copy, measured in benchmarks/weights.py); this actor only
        # borrows the reference, so the object lives while the registry or a producer holds it.
        # If the trainer dies its weights go with it, which costs nothing: producers keep what they
        # loaded, and a restarted trainer publishes again from its checkpoint.
        (ref,) = refs
        self.registry.publish(version, ref)
        log.debug("version %s published", version)

    def acquire(self, holder: int, have: int | None, timeout: float = 0.0,
                grace_s: float = 0.0) -> tuple[int, list] | None:
        got = self.registry.acquire(holder, have, timeout, grace_s)
        return None if got is None else (got[0], [got[1]])  # in a list: the caller receives the reference

    def hold(self, holder: int, version: int) -> None:
        self.registry.hold(holder, version)

    def drop_holder(self, holder: int) -> None:
        self.registry.drop_holder(holder)
        log.info("producer %s holds no version any more", holder)

    def status(self) -> dict[str, Any]:
        return self.registry.status()


class WeightPublisher:
    """The trainer's side: each version put once, announced to the weights actor and offered to every
    subscribed producer, never waited for: through shared memory to those on this machine that gave a
    `SharedAddress` (up to `SHARED_MAX_BYTES`), as `offer_weights(version, [ref])` on the actor of the
    others. Each call checks what the previous one started: the announcement's error is raised; a
    producer whose offer found it dead is unsubscribed (its replacement subscribes again under the same
    id), and one whose shared-memory socket is gone gets Ray offers from then on."""

    def __init__(self, weights: ray.actor.ActorHandle):
        self.weights = weights
        self._lock = threading.Lock()
        self._subscribers: dict[int, ray.actor.ActorHandle] = {}
        self._shared: dict[int, SharedAddress] = {}  # producers on this machine reading shared memory
        self._writer: SharedWeightsWriter | None = None
        self._node: str | None = None
        self._pending: list[tuple[int, ray.actor.ActorHandle, ray.ObjectRef]] = []  # offers not yet returned
        self._announced: ray.ObjectRef | None = None

    def subscribe(self, producer_id: int, producer: ray.actor.ActorHandle,
                  shared: SharedAddress | None = None) -> None:
        if self._node is None:
            self._node = ray.get_runtime_context().get_node_id()
        with self._lock:
            self._subscribers[producer_id] = producer
            self._shared.pop(producer_id, None)
            if shared is not None and shared.node == self._node:
                self._shared[producer_id] = shared

    def publish(self, version: int, arrays: dict[str, np.ndarray]) -> None:
        """Put `arrays` (a copy: the caller may change its weights at once) and hand `version` out."""
        if self._announced is not None:
            ray.get(self._announced)  # had a whole step to finish; keeps versions in order
        reached = self._publish_shared(version, arrays)  # first: no Ray call between the trainer and them
        ref = ray.put(arrays)
        with self._lock:  # the offers first: they are what producers wait for, the announcement is not
            offers = [(pid, producer, producer.offer_weights.remote(version, [ref]))
                      for pid, producer in self._subscribers.items() if pid not in reached]
        self._announced = self.weights.publish.remote(version, [ref])  # in a list: by reference
        self._check_offers()  # the previous ones, after this version is on its way
        with self._lock:
            self._pending += offers

    def _publish_shared(self, version: int, arrays: dict[str, np.ndarray]) -> set[int]:
        """Write `version` into shared memory and announce it to the producers reading it; those reached."""
        with self._lock:
            shared = dict(self._shared)
        if not shared or sum(a.nbytes for a in arrays.values()) > SHARED_MAX_BYTES:
            return set()
        if self._writer is None:
            self._writer = SharedWeightsWriter()
        slot = self._writer.write(version, arrays)
        reached = {pid for pid, address in shared.items() if self._writer.announce(address, version, slot)}
        with self._lock:  # a producer that cannot be reached (replaced, say) gets Ray offers until it subscribes again
            for pid in set(shared) - reached:
                if self._shared.get(pid) is shared[pid]:
                    del self._shared[pid]
        return reached

    def close(self) -> None:
        """Free the shared memory (producers keep what they mapped until they let it go)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def _check_offers(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        if not pending:
            return
        done, _ = ray.wait([offer for _, _, offer in pending], num_returns=len(pending), timeout=0)
        answered = set(done)
        for pid, producer, offer in pending:
            if offer not in answered:
                with self._lock:
                    self._pending.append((pid, producer, offer))  # still copying into its standby model
                continue
            try:
                ray.get(offer)
            except ray.exceptions.ActorDiedError:  # the driver replaces it; its long poll serves the new one
                with self._lock:
                    if self._subscribers.get(pid) is producer:
                        del self._subscribers[pid]
