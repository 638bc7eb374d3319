"""Trajectory batches and the versioned replay queue with admission control."""

from streamrl.buffer.checkpoint import CheckpointError, load_queue, save_queue
from streamrl.buffer.config import QueueConfig
from streamrl.buffer.queue import Admission, QueueClosed, QueuedGroup, ReplayQueue, Ticket, TrainGroups, assemble
from streamrl.buffer.schema import FINISH_REASONS, TRAJECTORY_SCHEMA, PaddedBatch, build_batch, to_padded
from streamrl.buffer.validate import BatchError, validate_batch

__all__ = [
    "Admission", "BatchError", "CheckpointError", "FINISH_REASONS", "PaddedBatch", "QueueClosed",
    "QueueConfig", "QueuedGroup", "ReplayQueue", "TRAJECTORY_SCHEMA", "Ticket", "TrainGroups",
    "assemble", "build_batch", "load_queue", "save_queue", "to_padded", "validate_batch",
]
