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
from typing import Any


class WeightRegistry:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._published = threading.Condition(self._lock)
        self._handles: dict[int, Any] = {}
        self._held: dict[int, int] = {}  # holder -> version
        self._latest: int | None = None
        self.released: list[int] = []  # every version dropped so far, oldest first

    def publish(self, version: int, handle: Any) -> None:
        with self._lock:
            if self._latest is not None and version <= self._latest:
                raise ValueError(f"version {version} is not newer than the published version {self._latest}")
            self._handles[version] = handle
            self._latest = version
            self._collect()
            self._published.notify_all()

    def acquire(self, holder: int, have: int | None = None, timeout: float = 0.0) -> tuple[int, Any] | None:
        """The newest weights if newer than `have`, now held by `holder`; None when `have` is still the
        newest after waiting up to `timeout` seconds (a long poll: a new version is seen at once)."""
        with self._lock:
            if not self._published.wait_for(lambda: self._newer_than(have), timeout):
                return None
            self._held[holder] = self._latest
            self._collect()
            return self._latest, self._handles[self._latest]

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
