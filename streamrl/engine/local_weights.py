"""Weights an engine holds in its own process: a torch module (the torch engine) or an `ArrayModel` (the
simulated engine).

A `WeightReceiver` fetches newer versions in the background; `refresh()` switches to one at a decode-step
boundary (a pointer swap when double-buffered) and reports how long generation was held up. Without a
receiver the weights are fixed (evaluation, tests).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from streamrl.weights.arrays import resolve
from streamrl.weights.receiver import WeightReceiver

if TYPE_CHECKING:
    import torch

    from streamrl.weights.arrays import ArrayModel


class LocalWeights:
    def __init__(self, model: torch.nn.Module | ArrayModel, receiver: WeightReceiver | None = None, *,
                 version: int | None = 0):
        self.model = model
        self.receiver = receiver
        self.version = receiver.version if receiver is not None else version
        self._fixed_history: list[tuple[float, int]] = []

    @property
    def history(self) -> list[tuple[float, int]]:
        return self.receiver.history if self.receiver is not None else self._fixed_history

    def start(self) -> None:
        if self.receiver is not None:
            self.receiver.start()

    def stop(self) -> None:
        if self.receiver is not None:
            self.receiver.stop()

    def refresh(self) -> float | None:
        if self.receiver is None:
            return None
        started = time.perf_counter()
        self.model, version = self.receiver.apply(self.model)
        if version == self.version:
            return None
        self.version = version
        return time.perf_counter() - started

    def offer(self, version: int, weights: Any, hold: Callable[[int], Any]) -> bool:
        """A version handed to this process directly (arrays, or `[object reference]`): staged if newer
        (True; fetched only then). A failure stops the producer at its next step (not the caller: the
        trainer that offered it)."""
        if self.receiver is None:
            return False
        try:
            return self.receiver.offer(version, lambda: dict(resolve(weights)), hold)
        except BaseException as exc:
            self.receiver.fail(exc)
            return False

    def wait_newer(self, than: int | None, timeout: float) -> bool:
        """Block until weights newer than `than` are staged (True): ready for the next `refresh`, not yet
        in use. False once `timeout` passes."""
        if self.receiver is None:
            time.sleep(timeout)
            return False
        return self.receiver.wait_newer(than, timeout)

    def status(self) -> dict[str, Any]:
        return self.receiver.status() if self.receiver is not None else {"version": self.version, "loads": 0}
