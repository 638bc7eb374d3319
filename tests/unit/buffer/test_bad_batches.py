"""Each kind of bad batch is refused with an error naming the problem, and changes no queue state."""

import numpy as np
import pyarrow as pa
import pytest

from harness.synthetic import synthetic_batch
from streamrl.buffer import BatchError
from streamrl.buffer.schema import TRAJECTORY_SCHEMA


def replace(batch: pa.RecordBatch, name: str, values) -> pa.RecordBatch:
    index = batch.schema.get_field_index(name)
    array = values if isinstance(values, pa.Array) else pa.array(values, type=batch.schema.field(name).type)
    return batch.set_column(index, pa.field(name, array.type, nullable=False), array)


def edit_list(batch, name, row, fn):
    rows = batch.column(name).to_pylist()
    rows[row] = fn(list(rows[row]))
    return replace(batch, name, rows)


def edit_scalar(batch, name, row, value):
    rows = batch.column(name).to_pylist()
    rows[row] = value
    return replace(batch, name, rows)


def drop_rows(batch, rows):
    keep = [i for i in range(batch.num_rows) if i not in rows]
    return batch.take(pa.array(keep))


BAD_BATCHES = {
    "missing column": (lambda b: b.drop_columns(["versions"]), "versions", "missing column"),
    "extra column": (lambda b: b.append_column("extra", pa.array([0] * b.num_rows)), "extra", "unexpected column"),
    "wrong type": (lambda b: replace(b, "reward", pa.array(b.column("reward").to_numpy().astype(np.float64))),
                   "reward", "type double"),
    "wrong list type": (lambda b: replace(b, "versions", pa.array(b.column("versions").to_pylist(), pa.list_(pa.int64()))),
                        "versions", "type list<item: int64>"),
    "no schema version": (lambda b: b.replace_schema_metadata({}), None, "schema version"),
    "future schema version": (lambda b: b.replace_schema_metadata({b"streamrl.schema_version": b"99"}), None, "schema version"),
    "logprobs shorter": (lambda b: edit_list(b, "behavior_logprobs", 5, lambda v: v[:-1]), "behavior_logprobs", "differs"),
    "versions longer": (lambda b: edit_list(b, "versions", 2, lambda v: v + [0]), "versions", "differs"),
    "nan logprob": (lambda b: edit_list(b, "behavior_logprobs", 3, lambda v: [float("nan")] + v[1:]), "behavior_logprobs", "not finite"),
    "inf logprob": (lambda b: edit_list(b, "behavior_logprobs", 3, lambda v: [float("-inf")] + v[1:]), "behavior_logprobs", "not finite"),
    "positive logprob": (lambda b: edit_list(b, "behavior_logprobs", 3, lambda v: [0.5] + v[1:]), "behavior_logprobs", "<= 0"),
    "negative version": (lambda b: edit_list(b, "versions", 6, lambda v: [-1] + v[1:]), "versions", "version -1"),
    "future version": (lambda b: edit_list(b, "versions", 6, lambda v: [7] + v[1:]), "versions", "version 7"),
    "token above vocabulary": (lambda b: edit_list(b, "response_ids", 1, lambda v: [32] + v[1:]), "response_ids", "token id 32"),
    "negative prompt token": (lambda b: edit_list(b, "prompt_ids", 1, lambda v: [-3] + v[1:]), "prompt_ids", "token id -3"),
    "empty response": (lambda b: edit_list(edit_list(edit_list(b, "response_ids", 4, lambda v: []),
                                                     "behavior_logprobs", 4, lambda v: []), "versions", 4, lambda v: []),
                       "response_ids", "empty response"),
    "null reward": (lambda b: edit_scalar(b, "reward", 2, None), "reward", "null"),
    "nan reward": (lambda b: edit_scalar(b, "reward", 2, float("nan")), "reward", "not finite"),
    "unknown finish reason": (lambda b: edit_scalar(b, "finish_reason", 0, "exploded"), "finish_reason", "exploded"),
    "missing sample": (lambda b: drop_rows(b, [3]), "group_id", "has 3 samples"),
    "extra sample": (lambda b: pa.concat_batches([b.slice(0, 1), b]), "group_id", "has 5 samples"),
    "duplicate sample index": (lambda b: edit_scalar(b, "sample_index", 1, 0), "sample_index", "0..3 once each"),
    "group not contiguous": (lambda b: b.take(pa.array([0, 1, 4, 5, 2, 3, 6, 7])), "group_id", "not contiguous"),
    "mixed prompts in a group": (lambda b: edit_scalar(b, "prompt_id", 2, 999), "prompt_id", "mixes prompt ids"),
    "wrong prompt for ticket": (lambda b: replace(b, "prompt_id", [99] * 4 + b.column("prompt_id").to_pylist()[4:]),
                                "prompt_id", "ticket prompt"),
    "wrong producer for ticket": (lambda b: replace(b, "producer_id", [5] * b.num_rows), "producer_id", "producer 5"),
    "empty batch": (lambda b: b.slice(0, 0), None, "empty batch"),
    # Accepted, it split the queue into two schemas: the trainer's table and every checkpoint failed.
    "nullable fields": (lambda b: pa.RecordBatch.from_arrays(b.columns, names=b.schema.names)
                        .replace_schema_metadata(b.schema.metadata), "group_id", "nullable field"),
}


@pytest.mark.parametrize("kind", sorted(BAD_BATCHES))
def test_bad_batch_is_refused_and_changes_nothing(queue, rng, kind):
    mutate, column, words = BAD_BATCHES[kind]
    tickets = queue.admit(producer_id=0, max_groups=2).tickets
    good = synthetic_batch(tickets, 4, version=0, rng=rng)
    before, queued_before = queue.status(), queue.queued_groups()
    with pytest.raises(BatchError) as err:
        queue.commit(mutate(good))
    assert err.value.column == column, str(err.value)
    assert words in str(err.value)
    after = queue.status()
    assert after.pop("rejected_batches") == before.pop("rejected_batches") + 1
    assert after == before and queue.queued_groups() == queued_before
    assert queue.commit(good) == [t.ticket_id for t in tickets]  # the tickets are still usable


def test_error_names_the_row(queue, rng):
    tickets = queue.admit(0, 2).tickets
    bad = edit_list(synthetic_batch(tickets, 4, rng=rng), "behavior_logprobs", 6, lambda v: v[:-1] + [float("inf")])
    with pytest.raises(BatchError, match=r"column 'behavior_logprobs', row 6: log-probability inf"):
        queue.commit(bad)


def test_not_an_arrow_batch(queue):
    with pytest.raises(BatchError, match="expected an Arrow RecordBatch or Table, got dict"):
        queue.commit({"group_id": [0]})


def test_unknown_expired_and_already_committed_tickets(queue, rng):
    from streamrl.buffer import Ticket

    tickets = queue.admit(0, 3).tickets
    queue.commit(synthetic_batch(tickets[:1], 4, rng=rng))
    queue.abandon([tickets[1].ticket_id])
    cases = [
        ([tickets[0]], "already committed"),
        ([tickets[1]], "expired"),
        ([Ticket(77, 0, 0, 0, 0.0)], "unknown"),
        ([tickets[2], tickets[0]], "already committed"),  # one bad group rejects the whole batch
    ]
    for batch_tickets, words in cases:
        before = queue.status()
        with pytest.raises(BatchError, match=words):
            queue.commit(synthetic_batch(batch_tickets, 4, rng=rng))
        after = queue.status()
        after["rejected_batches"] -= 1
        assert after == before
    assert queue.ticket_state(tickets[2].ticket_id) == "running"


def test_schema_constant_is_what_validation_expects(queue, rng):
    tickets = queue.admit(0, 1).tickets
    batch = synthetic_batch(tickets, 4, rng=rng)
    assert batch.schema == TRAJECTORY_SCHEMA
    assert queue.commit(pa.Table.from_batches([batch.slice(0, 2), batch.slice(2, 2)])) == [0]


@pytest.mark.parametrize("vocab_size", [2**31 + 1, 2**32])
def test_negative_token_ids_are_refused_whatever_the_vocabulary_size(rng, vocab_size):
    from streamrl.buffer import QueueConfig, ReplayQueue

    queue = ReplayQueue(QueueConfig(group_size=4, groups_per_step=1, max_staleness=1, max_in_flight=8,
                                    vocab_size=vocab_size))
    bad = edit_list(synthetic_batch(queue.admit(0, 1).tickets, 4, rng=rng), "response_ids", 1,
                    lambda v: [-(2**31)] + v[1:])
    with pytest.raises(BatchError, match=r"row 1: token id -2147483648 outside"):
        queue.commit(bad)
