"""A producer's side of weight streaming: fetch newer weights in the background, load them at a
decode-step boundary.

```
 poll thread: fetch(have, wait ≤ poll_s) ─► (version, arrays) staged as `pending`   (overlaps generation)
 sampler:     at each decode-step boundary ─► apply(model): load `pending` if any ─► current version
```
Loading is a copy into the model's own tensors (the KV cache and the optimizer-free model stay), so
it takes microseconds per megabyte and never waits for another producer or for the trainer.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from streamrl.models.hf import load_state_arrays

# fetch(have, timeout): newer weights than `have`, waiting up to `timeout` seconds for them (a long poll).
Fetch = Callable[[int | None, float], tuple[int, dict[str, np.ndarray]] | None]


class WeightReceiver:
    def __init__(self, fetch: Fetch, *, version: int | None = None, poll_s: float = 0.05):
        self._fetch = fetch
        self._poll_s = poll_s
        self._cond = threading.Condition()
        self._pending: tuple[int, dict[str, np.ndarray]] | None = None
        self._staged_version = version  # newest version fetched (loaded or pending)
        self.version = version  # version loaded in the model
        self.history: list[tuple[float, int]] = []  # (wall time, version) of every load
        self.staged_at: float | None = None  # wall time the newest weights finished arriving
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._poll, name="weight-receiver", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _poll(self) -> None:
        try:
            while not self._stop.is_set():
                self.fetch_now(self._poll_s)
        except BaseException as exc:  # recorded and re-raised in the generating thread by `apply`
            self.error = exc
            with self._cond:
                self._cond.notify_all()

    def fetch_now(self, timeout: float = 0.0) -> bool:
        """Fetch newer weights, waiting up to `timeout` for them; True when some were staged."""
        got = self._fetch(self._staged_version, timeout)
        if got is None:
            return False
        with self._cond:
            self._pending = got
            self._staged_version = got[0]
            self.staged_at = time.time()
            self._cond.notify_all()
        return True

    def apply(self, model: torch.nn.Module) -> int:
        """Load the staged weights, if any, and return the version now in the model."""
        if self.error is not None:
            raise RuntimeError("fetching weights failed") from self.error
        with self._cond:
            pending, self._pending = self._pending, None
        if pending is not None:
            load_state_arrays(model, pending[1])
            self.version = pending[0]
            self.history.append((time.time(), self.version))
        if self.version is None:
            raise RuntimeError("no weights were published yet")
        return self.version

    def wait_newer(self, than: int | None, timeout: float) -> bool:
        """Block until weights newer than `than` are staged (or timeout)."""
        with self._cond:
            return self._cond.wait_for(
                lambda: self.error is not None or (self._staged_version is not None and
                                                   (than is None or self._staged_version > than)),
                timeout)

    def status(self) -> dict[str, Any]:
        return {"version": self.version, "staged": self._staged_version, "loads": len(self.history)}
