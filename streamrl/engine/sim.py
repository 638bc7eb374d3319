"""A continuous-batching engine whose arithmetic is replaced by the timing model of `SimWorkload`.

```
 add(key, prompt, n):  n sequences join (lengths drawn now); their prefill is charged to the next step
 step():               sleep (prefill owed + decode_step_s(active)) · time_scale, then every active
                       sequence has one more token, stamped with the weights' version; returns the
                       sequences that ended
```
Everything around it is real: the weights it holds (`weights.model`) are an array of `weights_mb` that
the producer's receiver really copies and swaps (numpy, not torch: a simulated process never imports
torch), and its samples become real Arrow batches. Pacing is by deadline: a step starts when the
previous one ended, or when the host asks if it is more than a step late.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Sequence

import numpy as np

from streamrl.buffer.schema import LENGTH, STOP
from streamrl.engine.base import Sample
from streamrl.engine.local_weights import LocalWeights
from streamrl.sim.workload import SimWorkload
from streamrl.weights.arrays import ArrayModel


def sim_weights(workload: SimWorkload) -> ArrayModel:
    """The simulated policy's weights: one float32 array of `weights_mb`."""
    return ArrayModel({"weight": np.zeros(int(workload.weights_mb * 2**20) // 4, dtype=np.float32)})


class SimEngine:
    def __init__(self, workload: SimWorkload, weights: LocalWeights | None = None, *, seed: int = 0,
                 sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.perf_counter):
        """`weights`: what follows the trainer (default: the workload's weights, fixed at version 0)."""
        self.workload = workload
        self.capacity = workload.sequences_per_producer
        self.weights = weights if weights is not None else LocalWeights(sim_weights(workload), version=0)
        self._rng = np.random.default_rng(seed)
        self._sleep, self._clock = sleep, clock
        self._steps = 0
        self._version_from: list[int] = []  # decode step at which each logged version began
        self._version_of: list[int] = []
        self._running: dict[tuple[int, int], tuple[int, int]] = {}  # (key, index) -> (first step, length)
        self._ends: list[tuple[int, int, int]] = []  # heap of (step it ends at, key, index)
        self._prefill_owed_s = 0.0
        self._last_end: float | None = None
        self.last_step_s = 0.0
        self.generated_tokens = 0

    @property
    def active(self) -> int:
        return len(self._running)

    def add(self, key: int, prompt: Sequence[int], n: int) -> None:
        if self.active + n > self.capacity:
            raise ValueError(f"engine full: {self.active} + {n} sequences > capacity {self.capacity}")
        self._prefill_owed_s += len(prompt) * self.workload.prefill_per_token_s  # once: the prefix is shared
        for index, length in enumerate(self.workload.sample_lengths(self._rng, n)):
            self._running[(key, index)] = (self._steps, int(length))
            heapq.heappush(self._ends, (self._steps + int(length), key, index))

    def step(self) -> list[Sample]:
        """One decode step (with any prefill owed); the sequences that produced their last token."""
        if not self._running:
            raise RuntimeError("step() with no active sequence")
        version = self.weights.version
        model_s = self._prefill_owed_s + self.workload.decode_step_s(self.active)
        self._prefill_owed_s = 0.0
        self.last_step_s = model_s * self.workload.time_scale
        self._pace(self.last_step_s)
        if not self._version_of or self._version_of[-1] != version:
            self._version_from.append(self._steps)
            self._version_of.append(version)
        self._steps += 1
        self.generated_tokens += len(self._running)
        finished = []
        while self._ends and self._ends[0][0] <= self._steps:
            _, key, index = heapq.heappop(self._ends)
            if (key, index) in self._running:  # not cancelled
                finished.append(self._finish(key, index))
        self._idle_if_empty()
        return finished

    def _idle_if_empty(self) -> None:
        # Idle: the next step starts when asked. Its one step of slack from the last end would make the
        # first step after every idle gap free (a synchronous batch's prefills and first decode, each step).
        if not self._running:
            self._last_end = None

    def _pace(self, seconds: float) -> None:
        # The engine may run up to one step ahead of its host (as overlap schedulers do): a host that
        # is late by less than a step (Python overhead, a late wake-up on a busy machine) costs nothing;
        # later than that, the engine idles and the throughput drops, as it would on a GPU.
        now = self._clock()
        start = now if self._last_end is None else max(self._last_end, now - seconds)
        self._last_end = start + seconds
        if self._last_end > now:
            self._sleep(self._last_end - now)

    def _finish(self, key: int, index: int) -> Sample:
        first, length = self._running.pop((key, index))
        steps = np.arange(first, first + length)
        log = np.searchsorted(np.asarray(self._version_from), steps, side="right") - 1
        return Sample(
            key=key, index=index,
            tokens=self._rng.integers(0, self.workload.vocab_size, size=length, dtype=np.int32),
            logprobs=-self._rng.exponential(1.0, size=length).astype(np.float32),
            versions=np.asarray(self._version_of, dtype=np.int32)[log],
            finish=LENGTH if length >= self.workload.max_tokens else STOP,
        )

    def cancel(self, key: int) -> None:
        """Drop the sequences of one group; their slots are free at the next step."""
        for index in [i for k, i in self._running if k == key]:
            del self._running[(key, index)]
        self._idle_if_empty()

    def abort(self) -> None:
        """Drop every running sequence (the producer gives their groups back to the queue)."""
        self._running.clear()
        self._ends.clear()
        self._prefill_owed_s = 0.0
        self._last_end = None

    def lost(self) -> list[int]:
        return []

    def close(self) -> None:
        self.abort()
