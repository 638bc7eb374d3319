"""Model weights as a dict of numpy arrays: how they cross the Ray object store (numpy is zero-copy
there; torch tensors are pickled and 2–6× slower). Tied parameters appear once. No transformers
import here, so processes that only receive weights start quickly."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch


def state_arrays(model: torch.nn.Module, *, copy: bool = True) -> dict[str, np.ndarray]:
    """The model's parameters and buffers as numpy arrays, each tied tensor once. `copy=False` gives
    views of the live tensors: only for a consumer that copies at once (`ray.put` does)."""
    arrays: dict[str, np.ndarray] = {}
    seen: set[int] = set()
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        array = tensor.detach().to("cpu").numpy()
        arrays[name] = array.copy() if copy else array
    return arrays


@torch.no_grad()
def load_state_arrays(model: torch.nn.Module, arrays: dict[str, np.ndarray]) -> None:
    """Copy published weights into `model` in place (every tensor of `arrays` must match by name and shape)."""
    state = model.state_dict()
    unknown = sorted(set(arrays) - set(state))
    if unknown:
        raise KeyError(f"published weights hold tensors the model does not have: {unknown[:5]}")
    for name, array in arrays.items():
        target = state[name]
        if tuple(target.shape) != array.shape:
            raise ValueError(f"weight {name}: shape {array.shape} does not match the model's {tuple(target.shape)}")
    for name, tensor in zip(arrays, read_only_tensors(arrays, list(arrays))):
        state[name].copy_(tensor)


def read_only_tensors(arrays: Mapping[str, np.ndarray], names: list[str]) -> list[torch.Tensor]:
    """Tensors over the arrays `names`, without a copy where they are contiguous: for reading only
    (arrays from the object store are read-only, which torch warns of)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not writable.*")
        return [torch.from_numpy(np.ascontiguousarray(arrays[name])) for name in names]


def resolve(weights: Any) -> Mapping[str, np.ndarray]:
    """A version's arrays from a weights handle: a mapping as it is, or `[object reference]` (a list,
    so Ray passes the reference through calls instead of its value) read from the object store."""
    if isinstance(weights, Mapping):
        return weights
    import ray

    (ref,) = weights
    return ray.get(ref)
