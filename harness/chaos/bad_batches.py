"""Bad Arrow batches for `ReplayQueue.commit`: a valid producer batch, mutated one way per case."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from harness.chaos.cases import Case, Fuzzer, pick, short
from streamrl.buffer.config import QueueConfig
from streamrl.buffer.queue import ReplayQueue, Ticket
from streamrl.buffer.schema import SCHEMA_VERSION, SCHEMA_VERSION_KEY, TRAJECTORY_SCHEMA
from streamrl.buffer.validate import BatchError
from streamrl.engine.generation import Generation
from streamrl.rollout.producer import pack_groups

GROUP_SIZE, TRAINER_VERSION, VOCAB = 4, 3, 32
BATCH_QUEUE = QueueConfig(group_size=GROUP_SIZE, groups_per_step=2, max_staleness=2, max_in_flight=16,
                          capacity_tokens=1_000_000, vocab_size=VOCAB)
COLUMNS = TRAJECTORY_SCHEMA.names
LIST_COLUMNS = ("prompt_ids", "response_ids", "behavior_logprobs", "versions")


def producer_batch(tickets: Sequence[Ticket], rng: np.random.Generator) -> pa.RecordBatch:
    """A valid batch built as a producer builds it: G samples per ticket packed by `pack_groups`."""
    prompts = [rng.integers(0, VOCAB, size=int(rng.integers(1, 9))).tolist() for _ in tickets]
    rows = len(tickets) * GROUP_SIZE
    lengths = rng.integers(1, 13, size=rows)
    offsets = np.zeros(rows + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    total = int(offsets[-1])
    row_versions = rng.integers(TRAINER_VERSION - BATCH_QUEUE.max_staleness, TRAINER_VERSION + 1, size=rows)
    generation = Generation(tokens=rng.integers(0, VOCAB, size=total).astype(np.int32), offsets=offsets,
                            logprobs=-rng.exponential(1.0, size=total).astype(np.float32),
                            versions=np.repeat(row_versions, lengths).astype(np.int32),
                            finish=rng.integers(0, 2, size=rows).astype(np.int8))
    return pack_groups(tickets, prompts, generation, rng.random(rows).astype(np.float32), group_size=GROUP_SIZE,
                       producer_id=0, t_start=1.7e9, t_end=1.7e9 + 1)


@dataclass
class Scene:
    """A queue at version 3 holding a committed group, an abandoned ticket, a running ticket of another
    producer, and two running tickets of producer 0 whose valid batch is `good`."""

    queue: ReplayQueue
    tickets: list[Ticket]
    good: pa.RecordBatch
    committed: Ticket
    abandoned: Ticket
    foreign: Ticket


def make_scene(rng: np.random.Generator) -> Scene:
    queue = ReplayQueue(BATCH_QUEUE)
    queue.set_version(TRAINER_VERSION)
    committed = queue.admit(0, 1).tickets[0]
    queue.commit(producer_batch([committed], rng))
    abandoned = queue.admit(0, 1).tickets[0]
    queue.abandon([abandoned.ticket_id])
    foreign = queue.admit(1, 1).tickets[0]
    tickets = queue.admit(0, 2).tickets
    return Scene(queue, tickets, producer_batch(tickets, rng), committed, abandoned, foreign)


def _set_column(batch: pa.RecordBatch, name: str, values: list | pa.Array) -> pa.RecordBatch:
    array = values if isinstance(values, pa.Array) else pa.array(values, type=batch.schema.field(name).type)
    index = batch.schema.get_field_index(name)
    return batch.set_column(index, pa.field(name, array.type, nullable=False), array)


def _edit(batch: pa.RecordBatch, name: str, row: int, fn: Callable[[Any], Any]) -> pa.RecordBatch:
    values = batch.column(name).to_pylist()
    values[row] = fn(values[row])
    return _set_column(batch, name, values)


def _take(batch: pa.RecordBatch, rows: Sequence[int]) -> pa.RecordBatch:
    return batch.take(pa.array(rows, pa.int64()))


def _row(rng: np.random.Generator, batch: pa.RecordBatch) -> int:
    return int(rng.integers(batch.num_rows))


def _group_rows(rng: np.random.Generator, batch: pa.RecordBatch) -> list[int]:
    group = int(rng.integers(batch.num_rows // GROUP_SIZE))
    return list(range(group * GROUP_SIZE, (group + 1) * GROUP_SIZE))


def _relabel(batch: pa.RecordBatch, rows: list[int], **columns: int) -> pa.RecordBatch:
    for name, value in columns.items():
        values = batch.column(name).to_pylist()
        for row in rows:
            values[row] = value
        batch = _set_column(batch, name, values)
    return batch


# Each mutation: (scene, rng) -> (bad input, columns BatchError may name, words its message holds, description).
BatchMutation = Callable[[Scene, np.random.Generator], tuple[Any, set, str, str]]

_OTHER_TYPES = {
    pa.int64(): (pa.int32(), pa.uint64(), pa.float64()),
    pa.int32(): (pa.int64(), pa.int16(), pa.float32()),
    pa.float32(): (pa.float64(), pa.int32()),
    pa.float64(): (pa.float32(), pa.int64()),
    pa.string(): (pa.large_string(), pa.binary()),
    pa.list_(pa.int32()): (pa.list_(pa.int64()), pa.large_list(pa.int32()), pa.list_(pa.float32())),
    pa.list_(pa.float32()): (pa.list_(pa.float64()), pa.large_list(pa.float32())),
}


def m_drop(s, rng):
    name = pick(rng, COLUMNS)
    return s.good.drop_columns([name]), {name}, "missing column", f"column {name} dropped"


def m_rename_new(s, rng):
    name = pick(rng, COLUMNS)
    candidates = (f"{name}_{int(rng.integers(100))}", name.upper(), name[:-1], f" {name}")
    new = pick(rng, [c for c in candidates if c not in COLUMNS])  # prompt_ids[:-1] is another column
    names = [new if n == name else n for n in COLUMNS]
    return s.good.rename_columns(names), {new}, "unexpected column", f"column {name} renamed {new!r}"


def m_rename_taken(s, rng):
    name, other = rng.choice(COLUMNS, size=2, replace=False).tolist()
    names = [other if n == name else n for n in COLUMNS]
    return s.good.rename_columns(names), {other}, "duplicate column", f"column {name} renamed to {other}, twice"


def m_retype(s, rng):
    name = pick(rng, COLUMNS)
    column = s.good.column(name)
    new_type = pick(rng, _OTHER_TYPES[column.type])
    array = column.cast(new_type, safe=False)
    return _set_column(s.good, name, array), {name}, "type", f"column {name} retyped {new_type}"


def m_reorder(s, rng):
    i, j = sorted(rng.choice(len(COLUMNS), size=2, replace=False).tolist())
    order = list(range(len(COLUMNS)))
    order[i], order[j] = j, i
    schema = pa.schema([s.good.schema.field(k) for k in order], metadata=s.good.schema.metadata)
    bad = pa.RecordBatch.from_arrays([s.good.column(k) for k in order], schema=schema)
    return bad, {None}, "out of order", f"columns {COLUMNS[i]} and {COLUMNS[j]} swapped"


def m_schema_version(s, rng):
    future = str(SCHEMA_VERSION + 1 + int(rng.integers(100))).encode()
    metadata = pick(rng, (None, {}, {SCHEMA_VERSION_KEY: future}, {SCHEMA_VERSION_KEY: b"0"},
                           {SCHEMA_VERSION_KEY: b"-1"}, {SCHEMA_VERSION_KEY: b"v1"}, {SCHEMA_VERSION_KEY: b""},
                           {b"streamrl.schema": str(SCHEMA_VERSION).encode()}))
    return s.good.replace_schema_metadata(metadata), {None}, "schema version", f"schema metadata {metadata}"


def m_list_length(s, rng):
    name, row = pick(rng, ("behavior_logprobs", "versions")), _row(rng, s.good)
    extra = int(rng.integers(1, 4))
    if rng.random() < 0.5:
        bad = _edit(s.good, name, row, lambda v: v[:-extra] if len(v) > extra else [])
        what = "shorter"
    else:
        bad = _edit(s.good, name, row, lambda v: v + v[-1:] * extra)
        what = "longer"
    return bad, {name}, "differs", f"row {row}: {name} {what} than response_ids"


def m_response_length(s, rng):
    row = _row(rng, s.good)
    tokens = rng.integers(0, VOCAB, size=int(rng.integers(1, 4))).tolist()
    bad = _edit(s.good, "response_ids", row, lambda v: v + tokens)
    return bad, {"behavior_logprobs"}, "differs", f"row {row}: {len(tokens)} response tokens without log-probs"


def _flat_edit(s, rng, name, value):
    row = _row(rng, s.good)
    values = s.good.column(name).to_pylist()
    at = int(rng.integers(len(values[row])))
    values[row][at] = value
    return _set_column(s.good, name, values), row


def m_logprob_not_finite(s, rng):
    value = pick(rng, (math.nan, math.inf, -math.inf))
    bad, row = _flat_edit(s, rng, "behavior_logprobs", value)
    return bad, {"behavior_logprobs"}, "log-probability", f"row {row}: log-prob {value}"


def m_logprob_positive(s, rng):
    value = float(rng.uniform(0.01, 50.0))
    bad, row = _flat_edit(s, rng, "behavior_logprobs", value)
    return bad, {"behavior_logprobs"}, "log-probability", f"row {row}: log-prob {value:.3g} > 0"


def m_reward_not_finite(s, rng):
    value, row = pick(rng, (math.nan, math.inf, -math.inf)), _row(rng, s.good)
    return _edit(s.good, "reward", row, lambda _: value), {"reward"}, "not finite", f"row {row}: reward {value}"


def m_version_future(s, rng):
    value = TRAINER_VERSION + 1 + int(rng.integers(1000))
    bad, row = _flat_edit(s, rng, "versions", value)
    return bad, {"versions"}, f"version {value}", f"row {row}: version {value} from the future"


def m_version_negative(s, rng):
    value = -1 - int(rng.integers(1000))
    bad, row = _flat_edit(s, rng, "versions", value)
    return bad, {"versions"}, f"version {value}", f"row {row}: version {value}"


def m_token_range(s, rng):
    name = pick(rng, ("prompt_ids", "response_ids"))
    value = VOCAB + int(rng.integers(1000)) if rng.random() < 0.5 else -1 - int(rng.integers(1000))
    bad, row = _flat_edit(s, rng, name, value)
    return bad, {name}, f"token id {value}", f"row {row}: {name} token {value}"


def m_group_short(s, rng):
    row = _row(rng, s.good)
    bad = _take(s.good, [r for r in range(s.good.num_rows) if r != row])
    return bad, {"group_id"}, "samples", f"row {row} removed: a group of {GROUP_SIZE - 1}"


def m_group_long(s, rng):
    row = _row(rng, s.good)
    copies = int(rng.integers(1, 3))
    order = [r for r in range(s.good.num_rows) for _ in range(1 + copies * (r == row))]
    return _take(s.good, order), {"group_id"}, "samples", f"row {row} repeated {copies}x: a group too large"


def m_group_duplicated(s, rng):
    rows = _group_rows(rng, s.good)
    order = list(range(s.good.num_rows)) + rows
    return _take(s.good, order), {"group_id"}, "group", f"the group at row {rows[0]} sent twice"


def m_groups_interleaved(s, rng):
    a, b = int(rng.integers(GROUP_SIZE)), GROUP_SIZE + int(rng.integers(GROUP_SIZE))
    order = list(range(s.good.num_rows))
    order[a], order[b] = b, a
    return _take(s.good, order), {"group_id"}, "not contiguous", f"rows {a} and {b} of two groups swapped"


def m_sample_index(s, rng):
    rows = _group_rows(rng, s.good)
    row = pick(rng, rows)
    value = pick(rng, ((row + 1 + int(rng.integers(GROUP_SIZE - 1))) % GROUP_SIZE,
                        GROUP_SIZE + int(rng.integers(100)), -1 - int(rng.integers(100))))
    return (_edit(s.good, "sample_index", row, lambda _: value), {"sample_index"}, "once each",
            f"row {row}: sample index {value}")


def m_mixed_ids(s, rng):
    name = pick(rng, ("prompt_id", "producer_id"))
    row = pick(rng, [r for r in range(s.good.num_rows) if r % GROUP_SIZE])  # not a group's first row
    value = 1000 + int(rng.integers(1000))
    return _edit(s.good, name, row, lambda _: value), {name}, "mixes", f"row {row}: {name} {value} inside a group"


def m_ticket_unknown(s, rng):
    rows = _group_rows(rng, s.good)
    value = 10_000 + int(rng.integers(10**9)) if rng.random() < 0.7 else -1 - int(rng.integers(1000))
    return _relabel(s.good, rows, group_id=value), {"group_id"}, "unknown", f"group id {value} never issued"


def _on_ticket(s, rng, ticket, column: str, problem: str, what: str):
    """A group relabelled onto `ticket` (its prompt too), which the queue must refuse."""
    bad = _relabel(s.good, _group_rows(rng, s.good), group_id=ticket.ticket_id, prompt_id=ticket.prompt_id)
    return bad, {column}, problem, what


def m_ticket_expired(s, rng):
    return _on_ticket(s, rng, s.abandoned, "group_id", "expired", "a group on an abandoned ticket")


def m_ticket_committed(s, rng):
    return _on_ticket(s, rng, s.committed, "group_id", "already committed", "a group on a committed ticket")


def m_ticket_foreign(s, rng):
    return _on_ticket(s, rng, s.foreign, "producer_id", "producer", "a group on another producer's ticket")


def m_ticket_prompt(s, rng):
    rows = _group_rows(rng, s.good)
    value = 1000 + int(rng.integers(1000))
    return (_relabel(s.good, rows, prompt_id=value), {"prompt_id"}, "ticket prompt",
            f"a group with prompt {value}, not its ticket's")


def m_empty(s, rng):
    bad = pick(rng, (s.good.slice(0, 0), pa.Table.from_batches([], s.good.schema), s.good.slice(3, 0)))
    return bad, {None}, "empty batch", f"an empty {type(bad).__name__}"


def m_null(s, rng):
    name, row = pick(rng, COLUMNS), _row(rng, s.good)
    if name in LIST_COLUMNS and rng.random() < 0.5:
        bad, row = _flat_edit(s, rng, name, None)
        return bad, {name}, "null", f"row {row}: a null inside {name}"
    return _edit(s.good, name, row, lambda _: None), {name}, "null", f"row {row}: {name} null"


def m_finish_reason(s, rng):
    row = _row(rng, s.good)
    value = pick(rng, ("", "STOP", "exploded", "stop ", "timeout", "None"))
    return _edit(s.good, "finish_reason", row, lambda _: value), {"finish_reason"}, "is not one of", \
        f"row {row}: finish reason {value!r}"


def m_empty_prompt(s, rng):
    row = _row(rng, s.good)
    return _edit(s.good, "prompt_ids", row, lambda _: []), {"prompt_ids"}, "empty prompt", f"row {row}: no prompt"


def m_empty_response(s, rng):
    row = _row(rng, s.good)
    bad = s.good
    for name in ("response_ids", "behavior_logprobs", "versions"):
        bad = _edit(bad, name, row, lambda _: [])
    return bad, {"response_ids"}, "empty response", f"row {row}: no response"


def _ipc_bytes(batch: pa.RecordBatch) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    return sink.getvalue().to_pybytes()


def m_not_arrow(s, rng):
    good = s.good
    makers = {
        "dict": lambda: good.to_pydict(), "IPC bytes": lambda: _ipc_bytes(good), "None": lambda: None,
        "list of rows": lambda: good.to_pylist(), "str": lambda: "group_id,prompt_id", "int": lambda: 7,
        "numpy array": lambda: np.zeros((good.num_rows, len(COLUMNS))), "Array": lambda: good.column("reward"),
        "ChunkedArray": lambda: pa.chunked_array([good.column("group_id")]),
        "RecordBatchReader": lambda: pa.RecordBatchReader.from_batches(good.schema, [good]),
    }
    what = pick(rng, sorted(makers))
    return makers[what](), {None}, "expected an Arrow", f"a {what} instead of a batch"


# Mutations whose result keeps the schema and at least two rows: they also go in as multi-chunk tables.
CONTENT = (m_list_length, m_response_length, m_logprob_not_finite, m_logprob_positive, m_reward_not_finite,
           m_version_future, m_version_negative, m_token_range, m_group_short, m_group_long, m_group_duplicated,
           m_groups_interleaved, m_sample_index, m_mixed_ids, m_ticket_unknown, m_ticket_expired,
           m_ticket_committed, m_ticket_foreign, m_ticket_prompt, m_null, m_finish_reason, m_empty_prompt,
           m_empty_response)


def m_chunked(s, rng):
    bad, columns, words, what = pick(rng, CONTENT)(s, rng)
    cuts = sorted(set(rng.integers(1, bad.num_rows, size=int(rng.integers(1, 3))).tolist()))
    bounds = [0, *cuts, bad.num_rows]
    table = pa.Table.from_batches([bad.slice(a, b - a) for a, b in zip(bounds, bounds[1:])])
    return table, columns, words, f"{what}, in a table of {len(bounds) - 1} chunks"


BATCH_MUTATIONS: tuple[BatchMutation, ...] = (
    m_drop, m_rename_new, m_rename_taken, m_retype, m_reorder, m_schema_version, m_empty, m_not_arrow,
    m_chunked, *CONTENT)


def _queue_state(queue: ReplayQueue) -> tuple[dict, dict, int]:
    snap, status = queue.snapshot(), queue.status()
    rejected = snap["counters"].pop("rejected_batches")
    status.pop("rejected_batches")
    return snap, status, rejected


def _one_more_rejection(before: tuple, after: tuple) -> str | None:
    if after[:2] != before[:2]:
        changed = [k for k in before[1] if before[1][k] != after[1].get(k)] or ["snapshot"]
        return f"queue state changed: {changed}"
    if after[2] != before[2] + 1:
        return f"rejected_batches went from {before[2]} to {after[2]}, not up by one"
    return None


class BatchFuzzer(Fuzzer):
    def case(self, index: int, rng: np.random.Generator) -> Case:
        scene = make_scene(rng)
        bad, columns, words, what = BATCH_MUTATIONS[index % len(BATCH_MUTATIONS)](scene, rng)

        def expect(exc: BaseException) -> str | None:
            if not isinstance(exc, BatchError):
                return f"{type(exc).__name__}: {short(exc)}"
            if exc.column not in columns or words not in str(exc):
                return f"BatchError {short(exc)!r}, expected column {columns} and {words!r}"
            return None

        def still_commits() -> str | None:
            # every other case sends the valid batch as a multi-chunk table: both forms must commit
            good = scene.good if index % 2 else pa.Table.from_batches([scene.good.slice(0, 3), scene.good.slice(3)])
            try:
                ids = scene.queue.commit(good)
            except BatchError as exc:
                return f"the valid batch no longer commits: {exc}"
            expected = [t.ticket_id for t in scene.tickets]
            return None if ids == expected else f"the valid batch committed {ids}, expected {expected}"

        return Case(what, lambda: scene.queue.commit(bad), expect, state=lambda: _queue_state(scene.queue),
                    settle=_one_more_rejection, after=still_commits)


