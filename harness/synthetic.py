"""Synthetic trajectory batches for tests and benchmarks (random tokens, valid by construction)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from streamrl.buffer.queue import Ticket
from streamrl.buffer.schema import build_batch


def synthetic_batch(
    tickets: Sequence[Ticket],
    group_size: int,
    *,
    version: int | Sequence[int] = 0,
    prompt_len: int | tuple[int, int] = 8,
    response_len: int | tuple[int, int] | np.ndarray = 16,
    vocab_size: int = 32,
    rng: np.random.Generator | None = None,
) -> pa.RecordBatch:
    """One batch holding a complete group per ticket.

    Lengths are fixed, drawn uniformly from an inclusive (low, high) range, or (responses) given per
    row as an array; `version` is the version stamped on every token, or one per ticket.
    """
    rng = rng or np.random.default_rng(0)
    rows = len(tickets) * group_size

    def lengths(spec: int | tuple[int, int] | np.ndarray) -> np.ndarray:
        if isinstance(spec, np.ndarray):
            if spec.shape != (rows,):
                raise ValueError(f"lengths of shape {spec.shape} given for {rows} rows")
            return spec.astype(np.int64)
        if isinstance(spec, tuple):
            return rng.integers(spec[0], spec[1] + 1, size=rows)
        return np.full(rows, spec, dtype=np.int64)

    prompt_lengths, response_lengths = lengths(prompt_len), lengths(response_len)
    prompt_offsets = np.r_[0, np.cumsum(prompt_lengths)]
    response_offsets = np.r_[0, np.cumsum(response_lengths)]
    total = int(response_offsets[-1])
    per_ticket_version = np.broadcast_to(np.asarray(version), (len(tickets),))
    row_version = np.repeat(per_ticket_version, group_size)
    return build_batch(
        group_id=np.repeat([t.ticket_id for t in tickets], group_size),
        prompt_id=np.repeat([t.prompt_id for t in tickets], group_size),
        sample_index=np.tile(np.arange(group_size), len(tickets)),
        producer_id=np.repeat([t.producer_id for t in tickets], group_size),
        prompt_tokens=rng.integers(0, vocab_size, size=int(prompt_offsets[-1])),
        prompt_offsets=prompt_offsets,
        response_tokens=rng.integers(0, vocab_size, size=total),
        response_offsets=response_offsets,
        behavior_logprobs=-rng.random(total, dtype=np.float32) * 4,
        versions=np.repeat(row_version, response_lengths),
        reward=rng.random(rows, dtype=np.float32),
        finish_reason=np.zeros(rows, dtype=np.int8),
    )
