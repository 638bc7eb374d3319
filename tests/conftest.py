import numpy as np
import pytest

from streamrl.buffer import QueueConfig, ReplayQueue


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture
def small_config():
    return QueueConfig(group_size=4, groups_per_step=2, max_staleness=1, max_in_flight=8,
                       capacity_tokens=10_000, vocab_size=32)


@pytest.fixture
def queue(small_config):
    return ReplayQueue(small_config)
