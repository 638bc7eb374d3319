"""A producer's side of weight streaming: fetch newer weights in the background, switch to them at a
decode-step boundary.

```
 offer(version, arrays): the trainer's direct offer, staged at once if newer (one hop)
 poll thread: fetch(have, wait ≤ poll_s) ─► (version, handle) ─► arrays, if not taken already
                                                                    (a long poll; overlaps generation)
    double-buffered: copy the arrays into the standby model ─► ready   (still overlapping generation)
    in place:        keep the arrays as `pending`
 sampler, at each decode-step boundary: apply(model) ─► (model to use, its version)
    double-buffered: swap live and standby when the standby is ready — a pointer swap, no copy
    in place:        copy `pending` into the live model (the stall grows with the model's size)
```
Double buffering costs a second copy of the model in memory and makes the stall per update
independent of the model's size (measured in benchmarks/weights.py). Neither mode waits for another
producer or for the trainer; the KV cache is kept across the switch, and every token records the
version of the weights that computed its logits.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from streamrl.weights.arrays import load_state_arrays, resolve

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    import torch

    from streamrl.weights.arrays import ArrayModel

Arrays = dict[str, np.ndarray]
# fetch(have, timeout): newer weights than `have`, waiting up to `timeout` seconds for them (a long poll):
# (version, their arrays or `[object reference]`), read (`resolve`) only if the version is taken.
Fetch = Callable[[int | None, float], tuple[int, Any] | None]
SWAP_WAIT_S = 0.5  # how long a new version waits for the generating thread to switch to the staged one


class WeightReceiver:
    def __init__(self, fetch: Fetch, *, version: int | None = None, poll_s: float = 0.05,
                 standby: torch.nn.Module | ArrayModel | None = None):
        self._fetch = fetch
        self._poll_s = poll_s
        self._cond = threading.Condition()
        self._pending: tuple[int, dict[str, np.ndarray]] | None = None  # in place: arrays to copy
        self._standby = standby  # double-buffered: the model the next version is copied into
        self._standby_lock = threading.Lock()  # held while the poll thread writes the standby
        self._stage_lock = threading.Lock()  # one version staged at a time
        self._standby_version: int | None = None  # version the standby holds once fully written
        self._staged_version = version  # newest version fetched (loaded, pending or in the standby)
        self._offered = -1  # newest version offered (by an offer or the long poll), staged or on its way
        self.version = version  # version of the model in use
        self.history: list[tuple[float, int]] = []  # (wall time, version) of every switch
        self.fetched_at: float | None = None  # wall time the newest weights arrived in this process
        self.staged_at: float | None = None  # wall time they were ready to switch to (after the standby copy)
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def double_buffered(self) -> bool:
        return self._standby is not None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._poll, name="weight-receiver", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()  # an offer waiting for a switch
        if self._thread is not None:  # a long poll is not interrupted: it ends within its own wait
            self._thread.join(timeout=self._poll_s + 10)
            if self._thread.is_alive():  # its fetch outlived its own timeout: the weights actor is not answering
                log.warning("the weight receiver's poll thread did not stop within %g s", self._poll_s + 10)

    def _poll(self) -> None:
        try:
            while not self._stop.is_set():
                self.fetch_now(self._poll_s)
        except BaseException as exc:
            self.fail(exc)

    def fail(self, exc: BaseException) -> None:
        """Staging weights failed in another thread (the poll, an offer): re-raised in the generating
        thread by `apply`, so the producer stops with it."""
        self.error = exc
        with self._cond:
            self._cond.notify_all()

    def fetch_now(self, timeout: float = 0.0) -> bool:
        """Fetch newer weights, waiting up to `timeout` for them; True when some were staged."""
        got = self._fetch(self._staged_version, timeout)
        if got is None:
            return False
        version, handle = got
        # Read only once taken: an offer of the same version may be fetching it now (the long poll answers
        # a version an offer has not brought within its grace, as a slow fetch from another node may not).
        return self.offer(version, lambda: dict(resolve(handle)))

    def offer(self, version: int, arrays: Arrays | Callable[[], Arrays],
              hold: Callable[[int], Any] | None = None) -> bool:
        """Stage `version` if it is newer than what is staged (from the long poll or an offer; thread-safe);
        True when it was. `arrays` may be a function that fetches them: called only once the version is
        taken. `hold(version)` is called once it is fetched, before it is copied (the registry's: the long
        poll, which waits `OFFER_GRACE_S` for offers, need not fetch it too).

        Offers coalesce: one that a newer offer has overtaken while it waited returns at once (False), so a
        producer slower to copy than the trainer to publish copies the newest version, not each in turn;
        and a standby staged but not yet switched to is left to the generating thread for a moment
        (`SWAP_WAIT_S`) before the next version overwrites it."""
        with self._cond:
            self._offered = max(self._offered, version)
        with self._stage_lock:  # the poll thread and an offer may bring the same version at once
            if self._superseded(version):
                return False
            arrays = arrays() if callable(arrays) else arrays
            self.fetched_at = time.time()
            if hold is not None:  # after the fetch (a read of shared memory, on the latency path)
                hold(version)
            if self._standby is not None:
                with self._cond:  # the generating thread switches at its next decode step: notified by _swap
                    self._cond.wait_for(self._standby_taken, timeout=SWAP_WAIT_S)
                if self._superseded(version):
                    return False
                with self._standby_lock:  # the generating thread never swaps in a half-written standby
                    # unlabelled while it is written: a copy that fails partway leaves no version to switch to
                    # (it kept the previous label, which the next decode step could swap in, torn)
                    self._standby_version = None
                    load_state_arrays(self._standby, arrays)
                    self._standby_version = version
            with self._cond:
                if self._standby is None:
                    self._pending = (version, arrays)
                self._staged_version = version
                self.staged_at = time.time()
                self._cond.notify_all()
        return True

    def _superseded(self, version: int) -> bool:
        """Staged already, or a newer version has been offered since (it is on its way)."""
        return (self._staged_version is not None and version <= self._staged_version) or version < self._offered

    def _standby_taken(self) -> bool:
        ready = self._standby_version
        return self._stop.is_set() or ready is None or (self.version is not None and ready <= self.version)

    def apply(self, model: torch.nn.Module | ArrayModel) -> tuple[torch.nn.Module | ArrayModel, int]:
        """The model to generate with from this decode step on, and its version (newer if any is ready)."""
        if self.error is not None:
            raise RuntimeError("fetching weights failed") from self.error
        if self._standby is not None:
            model = self._swap(model)
        else:
            with self._cond:
                pending, self._pending = self._pending, None
            if pending is not None:
                load_state_arrays(model, pending[1])
                self._switched(pending[0])
        if self.version is None:
            raise RuntimeError("no weights were published yet")
        return model, self.version

    def _swap(self, live: torch.nn.Module | ArrayModel) -> torch.nn.Module | ArrayModel:
        # A version being written into the standby (unlabelled until it is whole): keep generating with the
        # live model and switch at a later step — unless nothing is in use yet (the first version, overwritten
        # by the next one while it was staged: a resumed trainer can publish again before a new producer has
        # started), which waits for the write. An uncontended lock per decode step costs nanoseconds.
        if not self._standby_lock.acquire(blocking=self.version is None):
            return live
        try:
            ready = self._standby_version
            if ready is None or (self.version is not None and ready <= self.version):
                return live
            fresh = self._standby
            self._standby = live  # the old weights become the buffer for the next version
            self._switched(ready)
        finally:
            self._standby_lock.release()
        with self._cond:
            self._cond.notify_all()  # a version waiting to be copied into the standby may go on
        return fresh

    def _switched(self, version: int) -> None:
        self.version = version
        self.history.append((time.time(), version))

    def wait_newer(self, than: int | None, timeout: float) -> bool:
        """Block until weights newer than `than` are staged (or timeout)."""
        with self._cond:
            return self._cond.wait_for(
                lambda: self.error is not None or (self._staged_version is not None and
                                                   (than is None or self._staged_version > than)),
                timeout)

    def status(self) -> dict[str, Any]:
        return {"version": self.version, "staged": self._staged_version, "loads": len(self.history),
                "double_buffered": self.double_buffered}
