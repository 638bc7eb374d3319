"""What a trainer step reports about the responses it trained on."""

import numpy as np
import pytest

from streamrl.buffer.schema import LENGTH, STOP, build_batch
from streamrl.runtime.actors import response_lengths


def test_response_lengths_and_the_share_cut_at_the_limit():
    lengths = np.array([1, 2, 3, 10])
    batch = build_batch(group_id=np.zeros(4), prompt_id=np.zeros(4), sample_index=np.arange(4), producer_id=0,
                        prompt_tokens=np.ones(4, np.int32), prompt_offsets=np.arange(5),
                        response_tokens=np.ones(lengths.sum(), np.int32), response_offsets=np.r_[0, np.cumsum(lengths)],
                        behavior_logprobs=np.zeros(lengths.sum(), np.float32),
                        versions=np.zeros(lengths.sum(), np.int32), reward=np.zeros(4),
                        finish_reason=np.array([STOP, STOP, STOP, LENGTH]))
    figures = response_lengths(batch)
    assert figures == {"response_length_mean": 4.0, "response_length_p50": 2.5,
                       "response_length_p99": pytest.approx(np.percentile(lengths, 99)),
                       "response_length_max": 10, "truncated_fraction": 0.25}
