"""The Arrow trajectory schema: one row per sample, every token stamped with its policy version.

Producers build batches from flat numpy buffers plus offsets (`build_batch`), so the hot path never
creates a Python object per token; the trainer turns a table of rows into padded tensors with one
copy per column (`streamrl.buffer.padded`). No torch here: the queue actor never needs it.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

SCHEMA_VERSION = 1
SCHEMA_VERSION_KEY = b"streamrl.schema_version"

FINISH_REASONS = ("stop", "length", "abort")
STOP, LENGTH, ABORT = range(len(FINISH_REASONS))  # finish codes as producers write them

TRAJECTORY_SCHEMA = pa.schema(
    [
        pa.field("group_id", pa.int64(), nullable=False),
        pa.field("prompt_id", pa.int64(), nullable=False),
        pa.field("sample_index", pa.int32(), nullable=False),
        pa.field("producer_id", pa.int32(), nullable=False),
        pa.field("prompt_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("response_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("behavior_logprobs", pa.list_(pa.float32()), nullable=False),
        pa.field("versions", pa.list_(pa.int32()), nullable=False),
        pa.field("reward", pa.float32(), nullable=False),
        pa.field("finish_reason", pa.string(), nullable=False),
        pa.field("t_start", pa.float64(), nullable=False),
        pa.field("t_end", pa.float64(), nullable=False),
    ],
    metadata={SCHEMA_VERSION_KEY: str(SCHEMA_VERSION).encode()},
)

_FINISH_DICTIONARY = pa.array(FINISH_REASONS, pa.string())


def _list_column(values: np.ndarray, offsets: np.ndarray, dtype: np.dtype) -> pa.ListArray:
    """Zero-copy list column from flat values and int32 offsets (len = rows + 1)."""
    return pa.ListArray.from_arrays(
        pa.array(np.ascontiguousarray(offsets, dtype=np.int32)),
        pa.array(np.ascontiguousarray(values, dtype=dtype)),
    )


def build_batch(
    *,
    group_id: np.ndarray,
    prompt_id: np.ndarray,
    sample_index: np.ndarray,
    producer_id: int | np.ndarray,
    prompt_tokens: np.ndarray,
    prompt_offsets: np.ndarray,
    response_tokens: np.ndarray,
    response_offsets: np.ndarray,
    behavior_logprobs: np.ndarray,
    versions: np.ndarray,
    reward: np.ndarray,
    finish_reason: np.ndarray,
    t_start: np.ndarray | float = 0.0,
    t_end: np.ndarray | float = 0.0,
) -> pa.RecordBatch:
    """A trajectory batch from flat buffers.

    `response_tokens`, `behavior_logprobs` and `versions` share `response_offsets`; `finish_reason`
    holds indices into `FINISH_REASONS`. Shapes are not checked here: the queue validates every
    batch it is given, and a builder that silently fixed shapes would hide producer bugs.
    """
    rows = len(group_id)

    def per_row(value, dtype):
        array = np.asarray(value, dtype=dtype)
        return np.full(rows, array, dtype=dtype) if array.ndim == 0 else array

    finish = pa.DictionaryArray.from_arrays(
        pa.array(np.asarray(finish_reason, dtype=np.int8)), _FINISH_DICTIONARY
    ).cast(pa.string())
    columns = [
        pa.array(per_row(group_id, np.int64)),
        pa.array(per_row(prompt_id, np.int64)),
        pa.array(per_row(sample_index, np.int32)),
        pa.array(per_row(producer_id, np.int32)),
        _list_column(prompt_tokens, prompt_offsets, np.int32),
        _list_column(response_tokens, response_offsets, np.int32),
        _list_column(behavior_logprobs, response_offsets, np.float32),
        _list_column(versions, response_offsets, np.int32),
        pa.array(per_row(reward, np.float32)),
        finish,
        pa.array(per_row(t_start, np.float64)),
        pa.array(per_row(t_end, np.float64)),
    ]
    return pa.RecordBatch.from_arrays(columns, schema=TRAJECTORY_SCHEMA)


def list_offsets(column: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """Row offsets of a list column as int64, rebased to start at 0 (slices keep parent offsets)."""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    offsets = array.offsets.to_numpy().astype(np.int64)
    return offsets - offsets[0]


def list_values(column: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """The flat values of a list column for exactly its rows (zero-copy where Arrow allows)."""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    return array.flatten().to_numpy(zero_copy_only=False)
