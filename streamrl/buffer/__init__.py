"""Trajectory batches and the versioned replay queue with admission control (torch-free; the
trainer's padded tensors are in `streamrl.buffer.padded`)."""

from streamrl.buffer.checkpoint import CheckpointError, load_queue, save_queue
from streamrl.buffer.config import QueueConfig
from streamrl.buffer.queue import (
    OPERATOR_HOLD,
    Admission,
    LeaseRevoked,
    QueueClosed,
    QueuedGroup,
    ReplayQueue,
    Ticket,
    TrainGroups,
    assemble,
)
from streamrl.buffer.schema import FINISH_REASONS, TRAJECTORY_SCHEMA, build_batch
from streamrl.buffer.validate import BatchError, validate_batch

__all__ = [
    "Admission", "BatchError", "CheckpointError", "FINISH_REASONS", "LeaseRevoked", "OPERATOR_HOLD", "QueueClosed",
    "QueueConfig", "QueuedGroup", "ReplayQueue", "TRAJECTORY_SCHEMA", "Ticket", "TrainGroups",
    "assemble", "build_batch", "load_queue", "save_queue", "validate_batch",
]
