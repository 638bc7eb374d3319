"""Model weights as a dict of numpy arrays: how they cross the Ray object store (numpy is zero-copy
there; torch tensors are pickled and 2–6× slower). Tied parameters appear once. No transformers
import here, and torch only once a torch module is handed in: the simulated engine and trainer hold
their weights as an `ArrayModel`, so their processes start without importing torch (~4 s of CPU each)."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch


class ArrayModel:
    """Weights held as numpy arrays, for engines with no arithmetic (the simulator): published, copied
    into and swapped exactly as a torch module's are (`state_arrays`, `load_state_arrays`)."""

    def __init__(self, arrays: dict[str, np.ndarray]):
        self.arrays = arrays


def state_arrays(model: torch.nn.Module | ArrayModel, *, copy: bool = True) -> dict[str, np.ndarray]:
    """The model's parameters and buffers as numpy arrays, each tied tensor once. `copy=False` gives
    views of the live tensors: only for a consumer that copies at once (`ray.put` does)."""
    if isinstance(model, ArrayModel):
        return {name: array.copy() if copy else array for name, array in model.arrays.items()}
    arrays: dict[str, np.ndarray] = {}
    seen: set[int] = set()
    for name, tensor in model.state_dict().items():
        if tensor.numel():  # tied tensors share storage; empty ones may all point at 0 and are each kept
            if tensor.data_ptr() in seen:
                continue
            seen.add(tensor.data_ptr())
        array = tensor.detach().to("cpu").numpy()
        arrays[name] = array.copy() if copy else array
    return arrays


def load_state_arrays(model: torch.nn.Module | ArrayModel, arrays: dict[str, np.ndarray]) -> None:
    """Copy published weights into `model` in place. Every tensor of `arrays` must match one of the model's
    by name, shape and kind of number (a float array may change precision: float32 into bf16), and every
    tensor of the model must be there once (tied tensors through any of their names): a version missing
    one would leave that tensor at the previous version while every token is stamped with the new one.
    Checked before anything is copied, so a refused version leaves the model as it was."""
    if isinstance(model, ArrayModel):
        _check(arrays, model.arrays, [[name] for name in model.arrays])
        for name, array in arrays.items():
            np.copyto(model.arrays[name], array, casting="unsafe")
        return
    import torch

    state = model.state_dict()
    _check(arrays, state, _tied_names(state))
    with torch.no_grad():
        for name, tensor in zip(arrays, read_only_tensors(arrays, list(arrays))):
            state[name].copy_(tensor)


def _check(arrays: Mapping[str, np.ndarray], state: Mapping[str, Any], tied: list[list[str]]) -> None:
    """`arrays` can be loaded into `state` (tensors or arrays; `tied`: names of one storage together)."""
    unknown = sorted(set(arrays) - set(state))
    if unknown:
        raise KeyError(f"published weights hold tensors the model does not have: {unknown[:5]}")
    missing = [names[0] for names in tied if not any(name in arrays for name in names)]
    if missing:
        raise KeyError(f"published weights lack tensors of the model: {missing[:5]}")
    doubled = [[name for name in names if name in arrays] for names in tied]
    doubled = [names for names in doubled if len(names) > 1]
    if doubled:  # an untied exporter: the tensor would hold whichever copy came last
        raise ValueError(f"published weights hold one tied tensor of the model under several names {doubled[0]}: "
                         "publish it once")
    for name, array in arrays.items():
        target = state[name]
        if tuple(target.shape) != array.shape:
            raise ValueError(f"weight {name}: shape {array.shape} does not match the model's {tuple(target.shape)}")
        if _number_kind(target.dtype) != _number_kind(array.dtype):
            raise TypeError(f"weight {name}: {array.dtype} values cannot be loaded into the model's {target.dtype}")


def _tied_names(state: Mapping[str, torch.Tensor]) -> list[list[str]]:
    """The state's names, those of one tied tensor (one storage) together, as `state_arrays` keeps them."""
    tied: dict[object, list[str]] = {}
    for name, tensor in state.items():
        key = tensor.data_ptr() if tensor.numel() else name  # empty tensors may all point at 0
        tied.setdefault(key, []).append(name)
    return list(tied.values())


def _number_kind(dtype: torch.dtype | np.dtype) -> str:
    """"f", "b" or "i" (signed or not) of a torch or numpy dtype: what a copy between them keeps."""
    if not isinstance(dtype, np.dtype):  # a torch dtype
        import torch

        return "f" if dtype.is_floating_point else "b" if dtype == torch.bool else "i"
    return "i" if dtype.kind == "u" else dtype.kind


def read_only_tensors(arrays: Mapping[str, np.ndarray], names: list[str]) -> list[torch.Tensor]:
    """Tensors over the arrays `names`, without a copy where they are contiguous: for reading only
    (arrays from the object store are read-only, which torch warns of)."""
    import torch

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
