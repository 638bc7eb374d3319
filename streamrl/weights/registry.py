"""Which weight versions exist, who holds which, and when an old one can be released.

```
 trainer ──publish(v, handle)──► registry keeps: the latest version + every version a holder still uses
 producer ──acquire(id, have)──► (newest version, handle), recorded as held by `id`;
                                 the version it held before is released once nobody else holds it
```
A handle is whatever carries the weights (an object reference on Ray, the arrays in process): the
registry only decides how long it lives. Plain and thread-safe; the Ray actor wraps it.
"""

from __future__ import annotations

import threading
import time
from typing import Any


class WeightRegistry:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._published = threading.Condition(self._lock)
        self._handles: dict[int, Any] = {}
        self._held: dict[int, int] = {}  # holder -> version
        self._latest: int | None = None
        self._latest_at = 0.0  # monotonic time the latest version was published
        self.released: list[int] = []  # every version dropped so far, oldest first

    def publish(self, version: int, handle: Any) -> None:
        with self._lock:
            if self._latest is not None and version <= self._latest:
                raise ValueError(f"version {version} is not newer than the published version {self._latest}")
            self._handles[version] = handle
            self._latest, self._latest_at = version, time.monotonic()
            self._collect()
            self._published.notify_all()

    def acquire(self, holder: int, have: int | None = None, timeout: float = 0.0,
                grace_s: float = 0.0) -> tuple[int, Any] | None:
        """The newest weights if newer than what `holder` has, now held by it; None when nothing newer came
        within `timeout` seconds (a long poll: a new version is seen at once). `have` is what the holder
        has; a holder the trainer offers versions to directly (`hold` records them) sets `grace_s`: a
        version is answered only once it is that old, so the long poll fetches only what an offer missed."""
        deadline = time.monotonic() + timeout
        seen_newer: float | None = None  # since when this poll has seen a version newer than the holder's
        with self._lock:
            if have is not None and have in self._handles and have >= self._held.get(holder, -1):
                self._held[holder] = have
                self._collect()
            while True:
                newer = have is not None and self._newer_than(self._has(holder, have))
                seen_newer = (seen_newer or time.monotonic()) if newer else None
                if self._answerable(holder, have, grace_s, seen_newer):
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                if seen_newer is not None:  # newer, but an offer may still bring it
                    remaining = min(remaining, min(self._latest_at, seen_newer) + grace_s - time.monotonic())
                self._published.wait(max(remaining, 0.0))
            self._held[holder] = self._latest
            self._collect()
            return self._latest, self._handles[self._latest]

    def hold(self, holder: int, version: int) -> None:
        """`holder` was handed `version` directly (the trainer's offer): its long poll need not fetch it."""
        with self._lock:
            if version in self._handles and version >= self._held.get(holder, -1):
                self._held[holder] = version
                self._collect()
                self._published.notify_all()

    def _has(self, holder: int, have: int | None) -> int | None:
        held = self._held.get(holder)
        return held if have is None or (held is not None and held > have) else have

    def _answerable(self, holder: int, have: int | None, grace_s: float, seen_newer: float | None) -> bool:
        if have is None:
            return self._latest is not None  # the first version: at once
        # The grace counts from the newest publish or from when this poll first saw a newer version,
        # whichever came first: a trainer that publishes faster than the grace must not hold every answer back.
        return seen_newer is not None and time.monotonic() - min(self._latest_at, seen_newer) >= grace_s

    def _newer_than(self, have: int | None) -> bool:
        return self._latest is not None and (have is None or have < self._latest)

    def drop_holder(self, holder: int) -> None:
        """A holder left (stopped or died): its version no longer keeps old weights alive."""
        with self._lock:
            self._held.pop(holder, None)
            self._collect()

    def _collect(self) -> None:
        keep = {self._latest, *self._held.values()}
        for version in sorted(set(self._handles) - keep):
            del self._handles[version]
            self.released.append(version)

    @property
    def latest(self) -> int | None:
        return self._latest

    def status(self) -> dict[str, Any]:
        with self._lock:
            return {"latest": self._latest, "stored": sorted(self._handles), "held": dict(self._held),
                    "released": len(self.released)}
