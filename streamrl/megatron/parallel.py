"""Process groups for the megatron trainer: torch.distributed (NCCL on GPUs, gloo on CPU) and
megatron-core's tensor / pipeline / data parallel groups over it."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from streamrl.megatron.versions import check_megatron_core
from streamrl.net import free_port


def initialize(*, rank: int = 0, world_size: int = 1, tensor_parallel: int = 1, data_parallel: int = 1,
               pipeline_parallel: int = 1, master_addr: str = "127.0.0.1", master_port: int | None = None,
               seed: int = 0, timeout_s: float = 600.0) -> None:
    """Join (or, with world size 1, form) the trainer's process group and split it into model-parallel
    groups. Without CUDA, megatron-core's two CUDA calls are replaced (see `streamrl.megatron.cpu`).
    `timeout_s` bounds joining and every collective, on the world group and on each of megatron-core's
    tensor / data / pipeline parallel groups: a rank that died fails the others instead of leaving them
    waiting.

    megatron-core derives the data-parallel size as world / (TP × PP) and numbers ranks TP-fastest (its
    default order `tp-cp-ep-dp-pp`): global rank = (PP rank × DP + DP rank) × TP + TP rank, so a TP
    group is a run of adjacent ranks, the first pipeline stage is ranks 0..TP × DP − 1 and global rank
    0 is TP, DP and PP rank 0."""
    check_megatron_core()
    if world_size != tensor_parallel * data_parallel * pipeline_parallel:
        raise ValueError(f"{world_size} trainer ranks are not tensor parallel {tensor_parallel} × data parallel "
                         f"{data_parallel} × pipeline parallel {pipeline_parallel}")
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        timeout = datetime.timedelta(seconds=timeout_s)
        if world_size == 1:  # an in-memory store: no rendezvous port is opened at all
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        else:  # torch's TCP rendezvous (unauthenticated, as in every torch.distributed job: see docs/security.md)
            os.environ["MASTER_ADDR"] = master_addr
            os.environ["MASTER_PORT"] = str(master_port if master_port is not None else free_port())
            dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)
    # megatron-core gives the groups it creates its own timeout (30 minutes by default), not the world
    # group's: a rank stuck in a tensor/data/pipeline collective would hold the others that long
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel,  # DP = world / (TP × PP)
                                             pipeline_model_parallel_size=pipeline_parallel,
                                             distributed_timeout_minutes=timeout_s / 60)
    tensor_rank = parallel_state.get_tensor_model_parallel_rank()
    if torch.cuda.is_available():
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed)
    else:
        from streamrl.megatron.cpu import use_cpu

        use_cpu(seed, tensor_rank)
    torch.manual_seed(seed)  # the same initial weights and data order on every rank


def shutdown() -> None:
    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
