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


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A 2-layer, hidden-32 Qwen2 with the reverse task's character tokenizer (built, never downloaded)."""
    from streamrl.config import ModelSection
    from streamrl.models.tiny import build_tiny_model

    section = ModelSection(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_positions=32)
    return build_tiny_model(section, tmp_path_factory.mktemp("tiny-model"), seed=0)


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray instance for every Ray test (starting one costs ~7 s on two cores)."""
    import ray  # here, not at the top: the GPU smoke machine runs the `gpu` tests without Ray

    from streamrl.runtime.connect import start_local  # as `streamrl launch` does: loopback only

    start_local(2, log_to_driver=True)
    yield
    ray.shutdown()
