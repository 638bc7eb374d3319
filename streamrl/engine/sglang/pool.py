"""A producer's sglang servers behind the one engine interface (`streamrl.engine.base.Engine`).

```
 add(key, prompt, n) ─► n sample coroutines on the event loop, each sent to the least busy server
 step()              ─► the samples that ended since the last call (waits up to poll_s for the first)
                        a server that died under a sample (EngineLost): the group is reported by lost()
 cancel / abort      ─► the coroutines are cancelled and their requests aborted on the server
 weights thread      ─► newest version (long poll) ─► server by server: pause, load, version, continue
                        (the others keep generating); refresh() reports the pause at the next step
```
The servers batch continuously themselves; the producer only keeps their slots full. Nothing here
holds a thread per sample: every request is a coroutine of one event loop.
"""

from __future__ import annotations

import asyncio
import logging
import queue as stdlib_queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from streamrl.engine.base import Sample
from streamrl.engine.sglang.engine import EngineLost, EventLoopThread, SglangEngine
from streamrl.weights.receiver import Fetch
from streamrl.weights.server_paths import LoaderFor

log = logging.getLogger(__name__)


class SglangWeights:
    """The servers follow the trainer: a thread fetches each new version and rolls it through the
    servers one at a time. `version` is the oldest any server holds (what admission may count on)."""

    def __init__(self, engines: Sequence[SglangEngine], fetch: Fetch | None = None, loader_for: LoaderFor | None = None,
                 *, poll_s: float = 1.0):
        if (fetch is None) != (loader_for is None):
            raise ValueError("weights need both a fetch function and a loader_for (how a version enters a server)")
        self.engines, self.fetch, self.loader_for, self.poll_s = list(engines), fetch, loader_for, poll_s
        self.history: list[tuple[float, int]] = []  # (wall time, version) once every server holds it
        self.error: BaseException | None = None
        self._cond = threading.Condition()
        self._unreported_pause: float | None = None  # seconds servers were paused for loads not yet refreshed
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.pause_s = 0.0

    @property
    def version(self) -> int:
        return min(engine.version for engine in self.engines)

    def start(self) -> None:
        if self.fetch is not None:
            self._thread = threading.Thread(target=self._follow, name="weights", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)

    def _follow(self) -> None:
        """Newest weights into each server in turn. The loader is kept by each engine to reload a
        restarted server: the distributed one opens a new group for it."""
        have: int | None = None
        try:
            while not self._stop.is_set():
                got = self.fetch(have, self.poll_s)
                if got is None:
                    continue
                version, weights = got
                load = self.loader_for(version, weights)
                paused = sum(engine.update_weights(version, load) for engine in self.engines)
                have = version
                log.info("weights version %s loaded into %d servers (paused %.3f s in all)", version,
                         len(self.engines), paused)
                with self._cond:
                    self.history.append((time.time(), version))
                    self.pause_s += paused
                    self._unreported_pause = (self._unreported_pause or 0.0) + paused
                    self._cond.notify_all()
        except BaseException as exc:  # raised in the generating thread by `refresh`
            self.error = exc
            with self._cond:
                self._cond.notify_all()

    def refresh(self) -> float | None:
        """The seconds servers were paused for versions loaded since the last call (None: none was);
        the servers switch between segments by themselves."""
        if self.error is not None:
            raise RuntimeError("loading weights into the sglang servers failed") from self.error
        with self._cond:
            paused, self._unreported_pause = self._unreported_pause, None
        return paused

    def offer(self, version: int, weights: Any, hold: Callable[[int], Any]) -> bool:
        """Not taken (False): the servers take each version from this producer's long poll, which answers
        as soon as it is published (a load into a server takes far longer than the hop an offer saves).
        Counting an offer as held would hide that version from the long poll: a producer busy loading
        the one before would then wait for a version after it, forever if the trainer waits for it."""
        return False

    def wait_newer(self, than: int | None, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self.error is not None or than is None or self.version > than,
                                       timeout)

    def status(self) -> dict[str, Any]:
        return {"version": self.version, "loads": len(self.history), "update_pause_s": self.pause_s}


class SglangPool:
    def __init__(self, engines: Sequence[SglangEngine], io: EventLoopThread, *, capacity: int, max_new_tokens: int,
                 stop_token_ids: Sequence[int] = (), temperature: float = 1.0, top_p: float = 1.0,
                 weights: SglangWeights | None = None, poll_s: float = 0.05,
                 on_close: Callable[[], None] | None = None):
        if not engines:
            raise ValueError("an sglang pool needs at least one server")
        self.engines, self.io, self.capacity = list(engines), io, capacity
        self.weights = weights if weights is not None else SglangWeights(engines)
        self.sampling = {"max_new_tokens": max_new_tokens, "stop_token_ids": list(stop_token_ids),
                         "temperature": temperature, "top_p": top_p}
        self.poll_s, self._on_close = poll_s, on_close
        self._lock = threading.Lock()
        self._groups: dict[int, list[Any]] = {}  # key -> its samples' futures
        self._remaining: dict[int, int] = {}  # key -> samples not returned yet
        self._events: stdlib_queue.Queue[tuple[str, int, Any]] = stdlib_queue.Queue()
        self._lost: list[int] = []
        self.last_step_s = 0.0
        self._last_step_end = time.perf_counter()

    @property
    def active(self) -> int:
        with self._lock:
            return sum(self._remaining.values())

    @property
    def generated_tokens(self) -> int:
        return sum(engine.stats["tokens"] for engine in self.engines)

    def add(self, key: int, prompt: Sequence[int], n: int) -> None:
        if len(prompt) == 0:
            raise ValueError("every prompt needs at least one token")
        with self._lock:
            if key in self._groups:
                raise ValueError(f"group {key} is already running")
            if sum(self._remaining.values()) + n > self.capacity:
                raise ValueError(f"engine full: {sum(self._remaining.values())} + {n} sequences > capacity "
                                 f"{self.capacity}")
            self._remaining[key] = n
            self._groups[key] = [self.io.submit(self._sample(key, index, list(prompt))) for index in range(n)]

    async def _sample(self, key: int, index: int, prompt: list[int]) -> None:
        engine = min(self.engines, key=lambda e: e.in_flight)  # on the loop: the counts are current
        try:
            done = await engine.sample(prompt, **self.sampling)
        except EngineLost:
            self._events.put(("lost", key, None))
            return
        except BaseException as exc:
            if not isinstance(exc, asyncio.CancelledError):
                self._events.put(("error", key, exc))
            raise
        self._events.put(("done", key, Sample(key, index, done.tokens, done.logprobs, done.versions, done.finish)))

    def step(self) -> list[Sample]:
        """The samples that ended since the last call; waits up to `poll_s` for the first."""
        finished: list[Sample] = []
        try:
            events = [self._events.get(timeout=self.poll_s)]
        except stdlib_queue.Empty:
            events = []
        while True:
            try:
                events.append(self._events.get_nowait())
            except stdlib_queue.Empty:
                break
        for kind, key, value in events:
            if kind == "error":
                raise value
            with self._lock:
                if key not in self._remaining:
                    continue  # the group was cancelled or lost meanwhile
                if kind == "lost":
                    self._lost.append(key)
                    self._drop(key)
                    continue
                self._remaining[key] -= 1
                if self._remaining[key] == 0:
                    del self._remaining[key], self._groups[key]
            finished.append(value)
        now = time.perf_counter()
        self.last_step_s, self._last_step_end = now - self._last_step_end, now
        return finished

    def lost(self) -> list[int]:
        with self._lock:
            lost, self._lost = self._lost, []
        return lost

    def cancel(self, key: int) -> None:
        with self._lock:
            self._drop(key)

    def abort(self) -> None:
        with self._lock:
            for key in list(self._groups):
                self._drop(key)

    def _drop(self, key: int) -> None:
        for future in self._groups.pop(key, []):
            future.cancel()
        self._remaining.pop(key, None)

    # ---- colocated with the trainer -----------------------------------------------------------------
    def release(self) -> None:
        """Free every server's GPU memory for the trainer (all or none)."""
        released = []
        try:
            for engine in self.engines:
                engine.release()
                released.append(engine)
        except BaseException:
            for engine in released:  # the ones already released go back to generating
                engine.resume()
            raise

    def resume(self) -> None:
        """Resume every released server (one that was not released answers its resume anyway)."""
        errors = []
        for engine in self.engines:
            try:
                engine.resume()
            except BaseException as exc:
                errors.append(exc)
        if errors:
            raise errors[0]

    def close(self) -> None:
        """Stop everything this pool runs: samples, the weights thread, then what `on_close` owns (the
        servers, their update groups), and the event loop."""
        for engine in self.engines:
            engine.closing = True  # requests cut by the stop below are not crashes to recover from
        self.abort()
        try:
            self.weights.stop()
            if self._on_close is not None:
                self._on_close()
        finally:
            self.io.close()
