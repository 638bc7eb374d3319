"""Validation of trajectory batches before the queue accepts them.

Every check is vectorised over the flat Arrow buffers: a batch of millions of tokens is validated at
memory speed. The first problem found is raised as one `BatchError` naming the column, the row (the
batch's row index, or None when the problem is not tied to a row) and what is wrong.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from streamrl.buffer.schema import (
    FINISH_REASONS,
    SCHEMA_VERSION,
    SCHEMA_VERSION_KEY,
    TRAJECTORY_SCHEMA,
    list_offsets,
    list_values,
)


class BatchError(ValueError):
    """A trajectory batch the queue refuses. Nothing in the queue changed."""

    def __init__(self, column: str | None, row: int | None, problem: str):
        self.column, self.row, self.problem = column, row, problem
        where = [f"column {column!r}" if column else None, f"row {row}" if row is not None else None]
        prefix = ", ".join(part for part in where if part)
        super().__init__(f"{prefix}: {problem}" if prefix else problem)

    def __reduce__(self):
        # Rebuilt from its parts when it crosses a process boundary (a Ray call): the default would call
        # __init__ with the message alone, and the caller would get Ray's "failed to deserialize" instead.
        return type(self), (self.column, self.row, self.problem)


class GroupSpan(NamedTuple):
    """One group's rows inside a validated batch."""

    group_id: int
    prompt_id: int
    row_start: int
    row_count: int
    min_version: int
    num_tokens: int  # prompt + response tokens over the group's samples
    producer_id: int


def as_record_batch(batch: pa.RecordBatch | pa.Table) -> pa.RecordBatch:
    if isinstance(batch, pa.RecordBatch):
        return batch
    if isinstance(batch, pa.Table):
        if batch.num_rows == 0:
            return pa.RecordBatch.from_pylist([], batch.schema)
        batches = batch.combine_chunks().to_batches()
        if len(batches) != 1:  # a column past one chunk's limits (2^31 list values) stays split
            raise BatchError(None, None, f"a table of {batch.num_rows} rows does not combine into one record "
                                         f"batch ({len(batches)} chunks): commit it in smaller batches")
        return batches[0]
    raise BatchError(None, None, f"expected an Arrow RecordBatch or Table, got {type(batch).__name__}")


def _check_schema(batch: pa.RecordBatch) -> None:
    expected = {field.name: field for field in TRAJECTORY_SCHEMA}
    names = batch.schema.names
    if len(set(names)) != len(names):
        raise BatchError(next(n for n in names if names.count(n) > 1), None, "duplicate column")
    for field in batch.schema:
        if field.name not in expected:
            raise BatchError(field.name, None, "unexpected column")
        if not field.type.equals(expected[field.name].type):
            raise BatchError(field.name, None, f"type {field.type}, expected {expected[field.name].type}")
        if field.nullable:  # accepted, it would split the queue's batches into two schemas no table can join
            raise BatchError(field.name, None, "nullable field, expected not null (build batches with "
                             "TRAJECTORY_SCHEMA)")
    for name in expected:
        if batch.schema.get_field_index(name) < 0:
            raise BatchError(name, None, "missing column")
    if batch.schema.names != TRAJECTORY_SCHEMA.names:
        raise BatchError(None, None, f"columns out of order: {batch.schema.names}")
    version = (batch.schema.metadata or {}).get(SCHEMA_VERSION_KEY)
    if version != str(SCHEMA_VERSION).encode():
        raise BatchError(None, None, f"schema version {version!r}, expected {SCHEMA_VERSION}")


def _first_row_where(bad: np.ndarray) -> int:
    return int(np.flatnonzero(bad)[0])


def _row_of_flat_index(offsets: np.ndarray, index: int) -> int:
    return int(np.searchsorted(offsets, index, side="right") - 1)


def _check_no_nulls(batch: pa.RecordBatch) -> None:
    for name, column in zip(batch.schema.names, batch.columns):
        if column.null_count:
            row = _first_row_where(np.asarray(column.is_null()))
            raise BatchError(name, row, "null value")
        if not pa.types.is_list(column.type):
            continue
        flat = column.flatten()  # not .values: a sliced column's child array also holds the rows outside the slice
        if flat.null_count:
            where = np.asarray(flat.is_null())
            raise BatchError(name, _row_of_flat_index(list_offsets(column), _first_row_where(where)), "null element")


def _below(values: np.ndarray, limit: int) -> bool:
    """Whether every int32 value lies in [0, limit), in one pass: read as unsigned, a negative value is
    2**31 or more, and every value in [0, limit) is below min(limit, 2**31)."""
    return int(values.view(np.uint32).max()) < min(limit, 2**31)


def _check_token_range(name: str, column: pa.ListArray, vocab_size: int | None) -> None:
    values = list_values(column)
    if not len(values):
        return
    # Reductions first: they allocate nothing; the row is looked for only when something is wrong.
    if vocab_size is None and values.min() >= 0 or vocab_size is not None and _below(values, vocab_size):
        return
    bad = (values < 0) | (values >= vocab_size if vocab_size is not None else False)
    flat = _first_row_where(bad)
    allowed = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
    raise BatchError(name, _row_of_flat_index(list_offsets(column), flat),
                     f"token id {int(values[flat])} outside {allowed}")


def validate_batch(
    batch: pa.RecordBatch | pa.Table,
    *,
    group_size: int,
    trainer_version: int,
    vocab_size: int | None = None,
) -> tuple[pa.RecordBatch, list[GroupSpan]]:
    """Check one batch on its own (no queue state) and split it into groups.

    A group's rows must be contiguous and hold sample indices 0..group_size-1 exactly once, all with
    the same prompt id. Returns the batch as a RecordBatch and its groups in row order.
    """
    batch = as_record_batch(batch)
    _check_schema(batch)
    if batch.num_rows == 0:
        raise BatchError(None, None, "empty batch")
    _check_no_nulls(batch)

    prompt_lengths = np.diff(list_offsets(batch.column("prompt_ids")))
    response_offsets = list_offsets(batch.column("response_ids"))
    response_lengths = np.diff(response_offsets)
    if (prompt_lengths == 0).any():
        raise BatchError("prompt_ids", _first_row_where(prompt_lengths == 0), "empty prompt")
    if (response_lengths == 0).any():
        raise BatchError("response_ids", _first_row_where(response_lengths == 0), "empty response")
    for name in ("behavior_logprobs", "versions"):
        lengths = np.diff(list_offsets(batch.column(name)))
        if (lengths != response_lengths).any():
            row = _first_row_where(lengths != response_lengths)
            raise BatchError(name, row,
                             f"length {lengths[row]} differs from response_ids length {response_lengths[row]}")

    _check_token_range("prompt_ids", batch.column("prompt_ids"), vocab_size)
    _check_token_range("response_ids", batch.column("response_ids"), vocab_size)

    logprobs = list_values(batch.column("behavior_logprobs"))
    # max() is NaN when any value is NaN, so two reductions decide the common, valid case.
    if not (np.isfinite(logprobs.min()) and logprobs.max() <= 1e-3):
        flat = _first_row_where(~np.isfinite(logprobs) | (logprobs > 1e-3))
        raise BatchError("behavior_logprobs", _row_of_flat_index(response_offsets, flat),
                         f"log-probability {logprobs[flat]} is not finite and <= 0")

    versions = list_values(batch.column("versions"))
    if not _below(versions, trainer_version + 1):
        flat = _first_row_where((versions < 0) | (versions > trainer_version))
        raise BatchError("versions", _row_of_flat_index(response_offsets, flat),
                         f"version {int(versions[flat])} outside [0, trainer version {trainer_version}]")

    rewards = batch.column("reward").to_numpy()
    if not np.isfinite(rewards).all():
        raise BatchError("reward", _first_row_where(~np.isfinite(rewards)), "reward is not finite")
    finish = batch.column("finish_reason")
    known = np.asarray(pc.is_in(finish, value_set=pa.array(FINISH_REASONS)))
    if not known.all():
        row = _first_row_where(~known)
        raise BatchError("finish_reason", row, f"{finish[row].as_py()!r} is not one of {FINISH_REASONS}")

    row_min_version = np.minimum.reduceat(versions, response_offsets[:-1])
    row_tokens = prompt_lengths + response_lengths
    return batch, _split_groups(batch, group_size, row_min_version, row_tokens)


def _split_groups(batch: pa.RecordBatch, group_size: int, row_min_version: np.ndarray,
                  row_tokens: np.ndarray) -> list[GroupSpan]:
    group_ids = batch.column("group_id").to_numpy()
    starts = np.flatnonzero(np.r_[True, group_ids[1:] != group_ids[:-1]])
    counts = np.diff(np.r_[starts, len(group_ids)])
    firsts = group_ids[starts]
    if len(np.unique(firsts)) != len(starts):
        order = np.argsort(firsts, kind="stable")
        repeated = order[1:][firsts[order[1:]] == firsts[order[:-1]]]
        row = int(starts[repeated.min()])
        raise BatchError("group_id", row, f"rows of group {group_ids[row]} are not contiguous")
    if (counts != group_size).any():
        bad = _first_row_where(counts != group_size)
        raise BatchError("group_id", int(starts[bad]),
                         f"group {firsts[bad]} has {counts[bad]} samples, expected {group_size}")

    # Every group now spans exactly group_size consecutive rows: check them as a [groups, G] grid.
    def grid(name: str) -> np.ndarray:
        return batch.column(name).to_numpy().reshape(-1, group_size)

    indices = np.sort(grid("sample_index"), axis=1)
    bad_groups = (indices != np.arange(group_size)).any(axis=1)
    if bad_groups.any():
        g = _first_row_where(bad_groups)
        raise BatchError("sample_index", int(starts[g]), f"group {firsts[g]} has sample indices "
                         f"{indices[g].tolist()}, expected 0..{group_size - 1} once each")
    for name, what in (("prompt_id", "prompt ids"), ("producer_id", "producer ids")):
        values = grid(name)
        mixed = values != values[:, :1]
        if mixed.any():
            flat = _first_row_where(mixed.ravel())
            raise BatchError(name, flat, f"group {group_ids[flat]} mixes {what}")

    min_version = np.minimum.reduceat(row_min_version, starts)
    tokens = np.add.reduceat(row_tokens, starts)
    prompts, producers = grid("prompt_id")[:, 0], grid("producer_id")[:, 0]
    return [
        GroupSpan(group_id=g, prompt_id=p, row_start=r, row_count=group_size, min_version=v, num_tokens=t,
                  producer_id=q)
        for g, p, r, v, t, q in zip(firsts.tolist(), prompts.tolist(), starts.tolist(), min_version.tolist(),
                                    tokens.tolist(), producers.tolist())
    ]
