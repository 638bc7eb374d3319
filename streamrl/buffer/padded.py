"""Trainer side of the schema: a table of rows as right-padded torch tensors (one copy per column)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch

from streamrl.buffer.schema import list_offsets, list_values


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

    def to(self, device: torch.device | str) -> PaddedBatch:
        """The same batch with every tensor on `device` (a no-op on the device it is on)."""
        return PaddedBatch(**{f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)})


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
