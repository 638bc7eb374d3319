"""The one interface every inference engine offers the producer, and the sample type they all return.

```
 producer                                   engine (torch | sim | sglang)
   weights.refresh()  ── step boundary ──►  switch to newer weights if ready (the stall is returned)
   add(key, prompt, n) ─────────────────►   n sequences of one group join at the next step
   step() ◄───────────── finished Samples   torch / sim: one decode step over every active sequence
                                            sglang: the requests that ended since the last call
   cancel(key) / abort() ───────────────►   a group's sequences (or all) leave; their slots free at once
```
A slot frees the moment its sequence ends, so a long response holds one slot, not a batch. Every token
carries the version of the weights that computed its logits; a group's sequences may be stopped at
any step (their prompt is then generated again elsewhere).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import numpy as np

from streamrl.engine.generation import Generation


class Sample(NamedTuple):
    """One finished sequence: the response to one prompt, with what the trainer needs to correct for it."""

    key: int  # the group it belongs to (the producer uses the ticket id)
    index: int  # its index within the group
    tokens: np.ndarray  # int32, the stop token included
    logprobs: np.ndarray  # float32, log-prob of each token under the distribution it was drawn from
    versions: np.ndarray  # int32, the weights version that computed each token's logits
    finish: int  # STOP or LENGTH (streamrl.buffer.schema)


class EngineWeights(Protocol):
    """How an engine's weights follow the trainer: fetched in the background, switched between steps."""

    version: int | None  # the version new tokens are computed with (for sglang: the oldest a server holds)
    history: list[tuple[float, int]]  # (wall time, version) of every switch

    def start(self) -> None:
        """Start fetching in the background; the first version is waited for by the caller."""

    def stop(self) -> None: ...

    def refresh(self) -> float | None:
        """At a step boundary: switch to newer weights if they are ready. The seconds the switch held up
        generation, or None when nothing changed."""

    def offer(self, version: int, weights: Any, hold: Callable[[int], Any]) -> bool:
        """The trainer hands a version over directly (arrays or `[object reference]`); staged if newer.
        True when this offer staged it. `hold(version)` is called once the version is taken and fetched,
        before it is staged: only then does it count as held (the registry is told, and the long poll does
        not fetch it as well)."""

    def wait_newer(self, than: int | None, timeout: float) -> bool:
        """Block until weights newer than `than` are ready (True) or `timeout` passes (False)."""

    def status(self) -> dict[str, Any]: ...


def accept_offer(weights: EngineWeights, version: int, handle: Any, hold: Callable[[int], Any]) -> bool:
    """A version the trainer offered: staged by `weights` if it takes offers and the version is newer,
    and only then recorded as held (`hold(version)`, the registry's, after the fetch, before the copy),
    so that the long poll does not fetch it too. True when taken."""
    return weights.offer(version, handle, hold)


class Engine(Protocol):
    capacity: int  # sequences it runs at once
    weights: EngineWeights
    last_step_s: float  # what the slots were busy for during the last step (device time where modelled)
    generated_tokens: int  # every token generated so far, kept or not (cancelled sequences' too)

    @property
    def active(self) -> int:
        """Sequences running or waiting to join."""

    def add(self, key: int, prompt: Sequence[int], n: int) -> None:
        """`n` sequences answering `prompt` join at the next step (the prompt is prefilled once)."""

    def step(self) -> list[Sample]:
        """Advance and return the sequences that ended."""

    def cancel(self, key: int) -> None:
        """The sequences of group `key` leave now; nothing of them is returned."""

    def abort(self) -> None:
        """Every sequence leaves (the run is stopping)."""

    def lost(self) -> list[int]:
        """Groups the engine lost since the last call (a server died under them): their sequences are
        gone and the caller gives their prompts back. Engines in this process never lose one."""

    def close(self) -> None:
        """Release what the engine runs (sglang: its servers, update groups and event loop)."""


def to_generation(samples: Sequence[Sample]) -> Generation:
    """Samples as flat buffers, in the order given (row i is samples[i])."""
    if not samples:
        empty = np.zeros(0, np.int32)
        return Generation(tokens=empty, offsets=np.zeros(1, np.int64), logprobs=np.zeros(0, np.float32),
                          versions=empty, finish=np.zeros(0, np.int8))
    lengths = np.fromiter((len(s.tokens) for s in samples), dtype=np.int64, count=len(samples))
    offsets = np.zeros(len(samples) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return Generation(tokens=np.concatenate([s.tokens for s in samples]).astype(np.int32, copy=False),
                      offsets=offsets,
                      logprobs=np.concatenate([s.logprobs for s in samples]).astype(np.float32, copy=False),
                      versions=np.concatenate([s.versions for s in samples]).astype(np.int32, copy=False),
                      finish=np.array([s.finish for s in samples], dtype=np.int8))


def generate(engine: Engine, prompts: Sequence[Sequence[int]], *, samples_per_prompt: int = 1) -> Generation:
    """Run `prompts` to completion through an idle engine (group keys 0, 1, ...), as many at once as its
    capacity allows; rows ordered prompt by prompt. Evaluation and tests; the producer drives `step` itself."""
    n = samples_per_prompt
    if n > engine.capacity:
        raise ValueError(f"{n} samples per prompt exceed the engine's capacity {engine.capacity}")
    waiting = list(enumerate(prompts))[::-1]
    done: dict[tuple[int, int], Sample] = {}
    while waiting or engine.active:
        while waiting and engine.active + n <= engine.capacity:
            key, prompt = waiting.pop()
            engine.add(key, prompt, n)
        for sample in engine.step():
            done[(sample.key, sample.index)] = sample
    return to_generation([done[(key, i)] for key in range(len(prompts)) for i in range(n)])
