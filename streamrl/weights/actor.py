"""The weights registry as a Ray actor (no torch: it only holds object references), and the trainer's
side of publishing.

```
 trainer: write(v, arrays) into shared memory ──message──► producers on this machine (SharedWeightsWriter)
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
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import ray

from streamrl import logs
from streamrl.weights.registry import WeightRegistry
from streamrl.weights.shared_memory import SHARED_MAX_BYTES, SharedAddress, SharedWeightsWriter, sealing_supported

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
        self._executor: ThreadPoolExecutor | None = None
        self._background: Future | None = None  # the object store's side of the last shared-memory publication

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
        """Hand `version` out (`arrays` are copied: the caller may change its weights at once)."""
        if self._background is not None:
            self._background.result()  # had a whole step to finish; its error is raised here
            self._background = None
        if self._announced is not None:
            ray.get(self._announced)  # keeps versions in order
        slot, reached = self._publish_shared(version, arrays)  # first: no Ray call between the trainer and them
        if slot is None:
            self._publish_through_ray(version, arrays, reached)
            return
        # The object store's copy (the registry's, and the offers to any other producers) is made from the
        # slot while the trainer goes on: made here, it competed for the cores with the producers' copies out
        # of shared memory (32 MB in the sim: the trainer's publish took 30-45 ms instead of 6-15). The slot
        # is not written again before the next publish, which waits for this one.
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="weights-put")
        self._background = self._executor.submit(self._publish_through_ray, version, self._writer.views(slot),
                                                 reached)

    def _publish_through_ray(self, version: int, arrays: dict[str, np.ndarray], reached: set[int]) -> None:
        """Put `arrays` once, offer them to the subscribers not `reached` through shared memory, announce them
        to the weights actor."""
        ref = ray.put(arrays)
        with self._lock:  # the offers first: they are what producers wait for, the announcement is not
            offers = [(pid, producer, producer.offer_weights.remote(version, [ref]))
                      for pid, producer in self._subscribers.items() if pid not in reached]
        self._announced = self.weights.publish.remote(version, [ref])  # in a list: by reference
        self._check_offers()  # the previous ones, after this version is on its way
        with self._lock:
            self._pending += offers

    def _publish_shared(self, version: int, arrays: dict[str, np.ndarray]) -> tuple[Any, set[int]]:
        """Write `version` into shared memory and announce it to the producers reading it: (the slot, those
        reached); (None, none) when no producer reads shared memory or the version is too large for it."""
        with self._lock:
            shared = dict(self._shared)
        if not shared or sum(a.nbytes for a in arrays.values()) > SHARED_MAX_BYTES or not sealing_supported():
            return None, set()
        if self._writer is None:
            self._writer = SharedWeightsWriter()
        slot = self._writer.write(version, arrays)
        reached = {pid for pid, address in shared.items() if self._writer.announce(address, version, slot)}
        with self._lock:  # a producer that cannot be reached (replaced, say) gets Ray offers until it subscribes again
            for pid in set(shared) - reached:
                if self._shared.get(pid) is shared[pid]:
                    del self._shared[pid]
        return slot, reached

    def close(self) -> None:
        """Finish the last publication, free the shared memory (producers keep what they mapped until they
        let it go)."""
        try:
            if self._background is not None:
                self._background.result()
        finally:
            self._background = None
            if self._executor is not None:
                self._executor.shutdown()
                self._executor = None
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
