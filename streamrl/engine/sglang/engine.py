"""One sglang server: samples with the exact policy version of every token, and weight updates that
pause that server alone.

```
 sample (a coroutine on the producer's event loop; hundreds in flight, no thread each):
          generate(prompt + tokens so far) ─► segment (tokens, log-probs, finish, the server's weight_version)
            finish = abort (a weight update cut it): continue from where it stopped, with the new weights
            every token of a segment is stamped with the version the server reports for it
 update (the weights thread, blocking):
          close the gate (no new request from here) ─► pause_generation(abort): returns once nothing runs
            ─► load (tensor and distributed paths: inside begin/end_weight_update) ─► update_weight_version
            ─► flush_cache ─► continue_generation ─► open the gate
 crash:   a request that cannot reach its server (or gets no answer in time), as an update: take the
          update lock, close the gate, restart it unless it answers, reload and label the newest weights,
          open the gate; then raise EngineLost: the caller gives the group's prompt back (the other
          requests it failed find it alive: one restart). An update that cannot reach its server
          restarts it and loads again; one that finds it alive raises (the same load would fail again)
 colocated with the trainer: release (pause, flush, free GPU memory) ─► trainer steps ─► resume
```
A request sent just before the gate here closed can reach the server after its pause began: it waits
at the server's own gate (no abort reaches it there) and runs after the update with the new weights.
The segment's `weight_version`, which sglang fills in when it answers, says so, so the update need not
wait for it (before, it waited for every request to come back, up to `drain_timeout_s`). The gate and
the in-flight count live on the event loop; the blocking side reaches them through `EventLoopThread.call`.
Only the holder of the update lock moves the gate, and an update, a release and a restart each hold it
throughout: a restarted server gets no request before its weights are reloaded and labelled (it would
answer with its startup weights), and no update's load falls between a reload and its label.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
import uuid
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from streamrl.buffer.schema import LENGTH, STOP
from streamrl.engine.sglang.server import ServerProcess
from streamrl.sglang.client import EngineTimeout, EngineUnreachable, SglangClient, SglangError

if TYPE_CHECKING:  # the type only: the weight paths pull in torch and safetensors
    from streamrl.weights.server_paths import Loader

log = logging.getLogger(__name__)

T = TypeVar("T")


class EngineLost(RuntimeError):
    """A request failed on its server (it died, or did not answer in time); a server that does not answer
    was restarted with the newest weights; the sample is lost."""


class EventLoopThread:
    """An asyncio event loop running in a thread of its own, for coroutines submitted from other threads."""

    def __init__(self, name: str = "sglang-io"):
        self.loop = asyncio.new_event_loop()
        self._closers: list[Callable[[], Coroutine[Any, Any, None]]] = []  # run on the loop before it stops
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def on_close(self, closer: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """`closer()` is awaited on the loop when it closes (e.g. an HTTP session made on it)."""
        self._closers.append(closer)

    def submit(self, coroutine: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def call(self, coroutine: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return self.submit(coroutine).result(timeout)

    def close(self) -> None:
        if self.loop.is_closed():
            return
        for closer in self._closers:
            self.call(closer(), timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()


@dataclass
class Completion:
    tokens: np.ndarray  # int32, stop token included
    logprobs: np.ndarray  # float32, behaviour log-prob per token
    versions: np.ndarray  # int32, policy version per token
    finish: int  # STOP or LENGTH
    segments: int  # generate calls it took (> 1: continued across weight updates)


class SglangEngine:
    def __init__(self, client: SglangClient, io: EventLoopThread, *, server: ServerProcess | None = None,
                 version: int = 0):
        if server is not None and client.api_key is None:
            client.api_key = server.spec.api_key  # a client made from the server's URL alone
        self.client, self.server, self.io = client, server, io
        io.on_close(self._close_async)
        self.version = version
        self.closing = False  # set before the producer stops its servers: a failed request is not a crash
        self._released = False  # colocated: the server gave its GPU memory to the trainer
        self._open = asyncio.Event()  # the gate, on the loop: closed while weights load (update, restart, release)
        self._open.set()
        self._in_flight = 0  # requests sent and not returned, counted on the loop
        self._update_lock = threading.Lock()  # one update, release or restart of this server at a time
        self._loaded: tuple[int, Loader] | None = None  # the newest weights, to reload after a restart
        self._aborts: set[asyncio.Task[None]] = set()  # aborts of cancelled requests, held until they end
        self.stats = {"segments": 0, "continued": 0, "updates": 0, "update_s": 0.0, "restarts": 0, "tokens": 0}

    @property
    def in_flight(self) -> int:
        return self._in_flight

    # ---- generation (on the event loop) ----------------------------------------------------------------
    async def sample(self, prompt: Sequence[int], *, max_new_tokens: int, stop_token_ids: Sequence[int] = (),
                     temperature: float = 1.0, top_p: float = 1.0, seed: int | None = None) -> Completion:
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        segments = 0
        while True:
            await self._open.wait()
            self._in_flight += 1
            version, rid = self.version, uuid.uuid4().hex  # fixed width: sglang matches ids by prefix
            try:
                segment = await self.client.generate_async(
                    list(prompt) + tokens, max_new_tokens=max_new_tokens - len(tokens), temperature=temperature,
                    top_p=top_p, stop_token_ids=list(stop_token_ids), seed=seed, rid=rid)
            except (EngineUnreachable, EngineTimeout) as exc:
                await asyncio.get_running_loop().run_in_executor(None, self._recover, exc)
                raise EngineLost(f"{self.client.url} failed a request: {exc}") from exc
            except asyncio.CancelledError:  # the group was stopped: the server need not finish it
                abort = asyncio.get_running_loop().create_task(self._abort_quietly(rid))
                self._aborts.add(abort)  # the loop holds tasks weakly
                abort.add_done_callback(self._aborts.discard)
                raise
            finally:
                self._in_flight -= 1
            version = self._segment_version(segment.weight_version, version)
            segments += 1
            self.stats["segments"] += 1
            self.stats["tokens"] += len(segment.tokens)
            tokens += segment.tokens
            logprobs += segment.logprobs
            versions += [version] * len(segment.tokens)
            if segment.finish != "abort" or len(tokens) >= max_new_tokens:
                break
            self.stats["continued"] += 1  # cut by a weight update: go on with the new weights
        finish = STOP if segment.finish == "stop" else LENGTH
        return Completion(np.asarray(tokens, np.int32), np.asarray(logprobs, np.float32),
                          np.asarray(versions, np.int32), finish, segments)

    async def _abort_quietly(self, rid: str) -> None:
        try:
            await self.client.abort_async(rid)
        except (EngineUnreachable, SglangError):
            pass  # the request is gone either way: the server died, or it had finished

    async def _close_async(self) -> None:
        """On the loop as it closes: aborts still waiting for their server are dropped (it is being stopped),
        then the client's connections close."""
        for abort in list(self._aborts):
            abort.cancel()
        await asyncio.gather(*self._aborts, return_exceptions=True)
        await self.client.close_async()

    def _segment_version(self, reported: str | None, submitted: int) -> int:
        """The version that generated a segment: the server's own `weight_version`, set when it answered
        — exact even for a request that waited out an update at the server's pause gate. "default" is
        the weights the server started with: version 0."""
        if reported is None:
            raise SglangError(f"{self.client.url} did not report the weight_version of a generation (sent at "
                              f"version {submitted}); streamrl needs a server that does (sglang >= 0.5.21)")
        if reported == "default":
            if self._loaded is not None and self._loaded[0] != 0:
                raise SglangError(f"{self.client.url} generated with the weights it started with after streamrl "
                                  f"loaded version {self._loaded[0]} (it restarted without them?)")
            return 0
        if not reported.isdigit():
            raise SglangError(f"{self.client.url} reports weight_version {reported!r}, not one streamrl set")
        return int(reported)

    # ---- weights (blocking: the producer's weights thread) ----------------------------------------------
    def update_weights(self, version: int, load: Loader) -> float:
        """Pause this server, load `version` with `load`, resume; the seconds it was paused. A failed
        load leaves the server paused and raises (its weights are then unknown); one that could not reach
        the server restarts it (if it died) and loads again."""
        with self._update_lock:
            self._close_gate()
            started = time.perf_counter()
            try:
                try:
                    self._swap(version, load)
                except EngineUnreachable as exc:  # the server died: restart it, then load this version into it
                    if not self._restart(exc):
                        raise  # the server is alive: the failure was not a death
                    self._swap(version, load)
            finally:
                self._open_gate()
        paused = time.perf_counter() - started
        self.stats["updates"] += 1
        self.stats["update_s"] += paused
        return paused

    # ---- colocated with the trainer: the server gives its GPU memory up while the trainer steps ------
    def release(self) -> None:
        """Stop generating (running requests return and wait to continue) and free the server's GPU
        memory (torch-memory-saver, `--enable-memory-saver`). Weight updates and restarts wait until `resume`."""
        self._update_lock.acquire()  # held until resume: no update while the memory is away
        self._close_gate()
        try:
            self.client.pause_generation("abort")
            # sglang asserts an idle scheduler on release (and ends itself if not); flush answers 200 only then
            self.client.flush_cache()
            self.client.release_memory_occupation()
            self._released = True
        except BaseException:
            try:
                self.client.continue_generation()
            finally:
                self._open_gate()  # even when the server is gone: samples must not wait forever
                self._update_lock.release()
            raise

    def resume(self) -> None:
        """Take the GPU back after `release` (a no-op on an engine that was not released)."""
        if not self._released:
            return
        try:
            self.client.resume_memory_occupation()
            self.client.continue_generation()
            self._released = False
        finally:
            self._open_gate()
            self._update_lock.release()

    def _close_gate(self) -> None:
        self.io.call(_clear(self._open))

    def _open_gate(self) -> None:
        self.io.call(_set(self._open))

    def _swap(self, version: int, load: Loader) -> None:
        self.client.pause_generation("abort")  # returns once no request runs on the server
        load(self.client)
        self._label(version, load)
        self.client.continue_generation()

    def _label(self, version: int, load: Loader) -> None:
        """Name the weights just loaded and drop the KV computed by the old ones (a load's own flush
        would fail after the weights changed, leaving weights and label apart)."""
        self.client.update_weight_version(version)
        self._loaded = (version, load)
        self.version = version
        self.client.flush_cache()

    def _recover(self, cause: BaseException) -> None:
        """A request could not reach the server: restart it as an update loads, under the update lock with
        the gate closed (blocking: from an executor thread, never the loop). Requests that find it dead
        together restart it once: the first does, the others then find it alive."""
        with self._update_lock:
            self._close_gate()
            try:
                self._restart(cause)  # False when alive: restarted by another request, or the request's failure
            finally:
                self._open_gate()

    def _restart(self, cause: BaseException) -> bool:
        """Restart a dead server and reload the newest weights into it (True); the caller holds the update
        lock and the gate closed, so no request reaches the new server before they are labelled. A server
        that turns out alive is left as it is (False): it was not a death, and the caller decides."""
        if self.server is None or self.closing:
            raise EngineLost(f"{self.client.url} did not answer"
                             f"{' (stopping)' if self.closing else ' and streamrl did not start it'}") from cause
        if self.server.alive() and self.client.alive():
            return False  # another request already restarted it, or the failure was not the server's
        log.warning("the sglang server at %s died (%s): restarting it", self.client.url, cause)
        self.server.restart()
        self.stats["restarts"] += 1
        if self._loaded is not None:
            version, load = self._loaded
            load(self.client)
            self._label(version, load)
        return True


async def _clear(event: asyncio.Event) -> None:
    event.clear()


async def _set(event: asyncio.Event) -> None:
    event.set()
