"""megatron-core on a machine without CUDA.

The library asks for CUDA in two places only: the RNG tracker that forks a CUDA generator around
dropout and weight initialisation, and `torch.cuda.current_device()` when it places the rotary
frequencies. On CPU the tracker is replaced by one that forks torch's CPU generator under the same
names, and `current_device` answers "cpu". Both are process-wide: call `use_cpu` once, in a process
that runs megatron-core on CPU only (the trainer actor, a test worker).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

MODEL_PARALLEL_RNG = "model-parallel-rng"  # the name megatron-core forks for tensor-parallel regions


class CpuRngTracker:
    """Named, independent streams of torch's CPU generator, with the CUDA tracker's interface."""

    def __init__(self):
        self.states: dict[str, torch.Tensor] = {}

    def reset(self) -> None:
        self.states = {}

    def is_initialized(self) -> bool:
        return bool(self.states)

    def get_states(self) -> dict[str, torch.Tensor]:
        return {name: state.clone() for name, state in self.states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states = {name: state.clone() for name, state in states.items()}

    def add(self, name: str, seed: int) -> None:
        if name in self.states:
            raise ValueError(f"rng state {name!r} already exists")
        generator = torch.Generator()
        generator.manual_seed(seed)
        self.states[name] = generator.get_state()

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        if name not in self.states:
            raise KeyError(f"rng state {name!r} was never added")
        outside = torch.get_rng_state()
        torch.set_rng_state(self.states[name])
        try:
            yield
        finally:
            self.states[name] = torch.get_rng_state()
            torch.set_rng_state(outside)


def use_cpu(seed: int, tensor_rank: int = 0) -> CpuRngTracker:
    """Install the CPU tracker (seeded like megatron-core's own: one stream per tensor-parallel rank)
    and the CPU `current_device`. A no-op answer on a machine with CUDA would be wrong, so refuse."""
    if torch.cuda.is_available():
        raise RuntimeError("use_cpu() is for machines without CUDA; megatron-core uses the GPU here")
    from megatron.core.tensor_parallel import random as megatron_random

    tracker = CpuRngTracker()
    tracker.add(MODEL_PARALLEL_RNG, seed + 2718 + tensor_rank)
    megatron_random._CUDA_RNG_STATE_TRACKER = tracker
    megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    torch.cuda.current_device = _cpu_device
    return tracker


def _cpu_device() -> str:
    return "cpu"
