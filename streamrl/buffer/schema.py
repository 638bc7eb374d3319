"""The Arrow trajectory schema: one row per sample, every token stamped with its policy version.

Producers build batches from flat numpy buffers plus offsets (`build_batch`), so the hot path never
creates a Python object per token; the trainer turns a table of rows into padded tensors with one
copy per column (`to_padded`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch

SCHEMA_VERSION = 1
SCHEMA_VERSION_KEY = b"streamrl.schema_version"

FINISH_REASONS = ("stop", "length", "abort")

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


@dataclass(frozen=True)
class PaddedBatch:
    """Right-padded training tensors, aligned to token positions.

    `input_ids[i, t]` is the t-th token of prompt + response; `behavior_logprobs[i, t]` and
    `versions[i, t]` describe that token, and `loss_mask[i, t]` is true where it is a response token.
    Logits at position t - 1 predict token t, so a trainer compares against the `[:, 1:]` slices.
    """

    input_ids: torch.Tensor  # [N, L] int64
    attention_mask: torch.Tensor  # [N, L] bool
    loss_mask: torch.Tensor  # [N, L] bool
    behavior_logprobs: torch.Tensor  # [N, L] float32 (0 outside the loss mask)
    versions: torch.Tensor  # [N, L] int64 (-1 outside the loss mask)
    rewards: torch.Tensor  # [N] float32
    group_ids: torch.Tensor  # [N] int64
    prompt_lengths: torch.Tensor  # [N] int64
    response_lengths: torch.Tensor  # [N] int64


def _scatter_positions(row_starts: np.ndarray, lengths: np.ndarray, width: int) -> np.ndarray:
    """Flat indices into an [N, width] buffer for each row's tokens placed from `row_starts`."""
    total = int(lengths.sum())
    row_of = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)
    first_flat = np.cumsum(lengths) - lengths
    within = np.arange(total, dtype=np.int64) - np.repeat(first_flat, lengths)
    return row_of * width + np.repeat(row_starts, lengths) + within


def to_padded(table: pa.Table | pa.RecordBatch, pad_id: int = 0) -> PaddedBatch:
    """Concatenate prompt and response per row into right-padded tensors (one copy per column)."""
    prompt_col, response_col = table.column("prompt_ids"), table.column("response_ids")
    prompt_len = np.diff(list_offsets(prompt_col))
    response_len = np.diff(list_offsets(response_col))
    rows = len(prompt_len)
    width = int((prompt_len + response_len).max()) if rows else 0

    prompt_pos = _scatter_positions(np.zeros(rows, np.int64), prompt_len, width)
    response_pos = _scatter_positions(prompt_len, response_len, width)

    input_ids = np.full(rows * width, pad_id, dtype=np.int64)
    input_ids[prompt_pos] = list_values(prompt_col)
    input_ids[response_pos] = list_values(response_col)
    loss_mask = np.zeros(rows * width, dtype=bool)
    loss_mask[response_pos] = True
    logprobs = np.zeros(rows * width, dtype=np.float32)
    logprobs[response_pos] = list_values(table.column("behavior_logprobs"))
    versions = np.full(rows * width, -1, dtype=np.int64)
    versions[response_pos] = list_values(table.column("versions"))
    attention = np.arange(width)[None, :] < (prompt_len + response_len)[:, None]

    def grid(flat: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(flat.reshape(rows, width))

    def column(name: str, dtype) -> torch.Tensor:
        # A copy: [N] is small, and a zero-copy view of an Arrow buffer would be read-only.
        return torch.from_numpy(np.array(table.column(name).to_numpy(), dtype=dtype))

    return PaddedBatch(
        input_ids=grid(input_ids),
        attention_mask=torch.from_numpy(attention),
        loss_mask=grid(loss_mask),
        behavior_logprobs=grid(logprobs),
        versions=grid(versions),
        rewards=column("reward", np.float32),
        group_ids=column("group_id", np.int64),
        prompt_lengths=torch.from_numpy(prompt_len),
        response_lengths=torch.from_numpy(response_len),
    )
