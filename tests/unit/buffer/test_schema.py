import numpy as np
import pyarrow as pa
import torch

from harness.synthetic import synthetic_batch
from streamrl.buffer import TRAJECTORY_SCHEMA, Ticket, build_batch
from streamrl.buffer.padded import to_padded
from streamrl.buffer.schema import SCHEMA_VERSION_KEY


def tickets(n, producer=0):
    return [Ticket(i, 100 + i, producer, 0, 0.0) for i in range(n)]


def test_build_batch_matches_schema_and_round_trips_values(rng):
    batch = synthetic_batch(tickets(3), 2, version=[0, 1, 2], prompt_len=(1, 5), response_len=(1, 9), rng=rng)
    assert batch.schema.equals(TRAJECTORY_SCHEMA, check_metadata=True)
    assert batch.schema.metadata[SCHEMA_VERSION_KEY] == b"1"
    rows = batch.to_pylist()
    assert [r["group_id"] for r in rows] == [0, 0, 1, 1, 2, 2]
    assert [r["sample_index"] for r in rows] == [0, 1, 0, 1, 0, 1]
    for row in rows:
        assert len(row["response_ids"]) == len(row["behavior_logprobs"]) == len(row["versions"])
        assert set(row["versions"]) == {row["group_id"]}


def test_build_batch_is_zero_copy_for_token_buffers():
    tokens = np.arange(10, dtype=np.int32)
    batch = build_batch(
        group_id=np.array([0, 0]), prompt_id=np.array([0, 0]), sample_index=np.array([0, 1]), producer_id=0,
        prompt_tokens=np.array([1, 2], np.int32), prompt_offsets=np.array([0, 1, 2]),
        response_tokens=tokens, response_offsets=np.array([0, 4, 10]),
        behavior_logprobs=np.zeros(10, np.float32), versions=np.zeros(10, np.int32),
        reward=np.zeros(2, np.float32), finish_reason=np.array([0, 1]),
    )
    values = batch.column("response_ids").values
    assert values.buffers()[1].address == tokens.ctypes.data
    assert batch.column("finish_reason").to_pylist() == ["stop", "length"]


def reference_padding(table: pa.Table, pad_id: int):
    rows = table.to_pylist()
    width = max(len(r["prompt_ids"]) + len(r["response_ids"]) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    logp = torch.zeros((len(rows), width))
    for i, r in enumerate(rows):
        p, resp = r["prompt_ids"], r["response_ids"]
        ids[i, : len(p) + len(resp)] = torch.tensor(p + resp)
        mask[i, len(p): len(p) + len(resp)] = True
        logp[i, len(p): len(p) + len(resp)] = torch.tensor(r["behavior_logprobs"])
    return ids, mask, logp


def test_to_padded_agrees_with_a_per_row_reference_on_sliced_tables(rng):
    batch = synthetic_batch(tickets(5), 3, prompt_len=(1, 6), response_len=(1, 12), rng=rng)
    # Slices keep their parent's offsets: the conversion must rebase them.
    table = pa.Table.from_batches([batch.slice(3, 6), batch.slice(12, 3)])
    padded = to_padded(table, pad_id=31)
    ids, mask, logp = reference_padding(table, 31)
    assert torch.equal(padded.input_ids, ids)
    assert torch.equal(padded.loss_mask, mask)
    assert torch.equal(padded.behavior_logprobs, logp)
    lengths = padded.prompt_lengths + padded.response_lengths
    assert torch.equal(padded.attention_mask, torch.arange(ids.shape[1]) < lengths[:, None])
    assert padded.versions[~mask].eq(-1).all()
    assert padded.group_ids.tolist() == table.column("group_id").to_pylist()
