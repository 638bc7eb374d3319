"""Weights into sglang servers by tensor handle (`producers.sglang.weights = "tensor"`):
`/update_weights_from_tensor`, the path for a server on a GPU this process can reach (always the case:
a producer reserves the GPUs of the servers it starts).

```
 load one version (the engine has paused that server), bucket by bucket:
   arrays ─copy─► each server TP rank's GPU ─pickle (CUDA IPC handles)─► base64 ─► POST, a payload per rank
   the server opens the handles and copies into its weights; the call returns ─► the bucket is freed
 all buckets inside one weight-update session (begin … end: sglang ≥ 0.5.21 refuses tensor loads outside)
```
The payload is sglang's `MultiprocessingSerializer` format: base64 of a pickle of `[(name, tensor), …]`
(`load_format` None). A CUDA tensor is pickled by torch's multiprocessing reductions, so the bytes hold
an IPC handle, not the data: one bucket per server GPU in this process for the length of a call, no
disk, no NCCL group.
Without CUDA (tests, the stand-in server) the tensors are pickled with their bytes, the same format.
The server unpickles what it is sent (sglang's design): only a holder of its API key can post.
"""

from __future__ import annotations

import base64
import io
import pickle
from collections.abc import Callable, Mapping
from multiprocessing.reduction import ForkingPickler

import numpy as np
import torch
import torch.multiprocessing  # noqa: F401 - registers torch's reductions (CUDA IPC handles) with ForkingPickler

from streamrl.sglang.client import SglangClient
from streamrl.weights.arrays import read_only_tensors
from streamrl.weights.broadcast import plan_buckets


def serialize_named_tensors(named: list[tuple[str, torch.Tensor]]) -> str:
    """base64 of a pickle of `named`; CUDA tensors travel as IPC handles (keep them alive until the
    server has loaded them), CPU tensors with their bytes."""
    buffer = io.BytesIO()
    on_device = any(tensor.is_cuda for _, tensor in named)
    (ForkingPickler(buffer) if on_device else pickle.Pickler(buffer)).dump(named)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def tensor_loader(arrays: Mapping[str, np.ndarray], bucket_bytes: int, *, tensor_parallel: int = 1,
                  devices_of: Callable[[SglangClient], list[torch.device] | None] = lambda client: None
                  ) -> Callable[[SglangClient], None]:
    """A `load(client)` for `SglangEngine.update_weights`: `arrays` bucket by bucket through
    `/update_weights_from_tensor`. Every server TP rank gets the whole bucket and loads its shard of
    it: with `devices_of(client)` (that server's GPUs, one per TP rank) each rank's copy is on its own
    GPU for as long as the call lasts; None: host memory, one payload for all ranks."""
    buckets = plan_buckets(arrays, bucket_bytes)

    def load(client: SglangClient) -> None:
        devices = devices_of(client)
        with client.weight_update_session():  # sglang refuses tensor loads outside one
            for names in buckets:
                named = list(zip(names, read_only_tensors(arrays, names)))
                if devices is None:
                    payloads = [serialize_named_tensors(named)] * tensor_parallel
                else:
                    copies = [[(name, tensor.to(device)) for name, tensor in named] for device in devices]
                    for device in devices:
                        torch.cuda.synchronize(device)  # the copies are done before another process reads them
                    payloads = [serialize_named_tensors(copy) for copy in copies]
                client.update_weights_from_tensor(payloads)
                del named, payloads  # the server has copied the bucket: its memory can go
                if devices is not None:
                    del copies
                    torch.cuda.empty_cache()  # back to the server (colocated, the GPU is shared)
                    torch.cuda.ipc_collect()

    return load
