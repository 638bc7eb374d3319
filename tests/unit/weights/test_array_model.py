"""Weights held as numpy arrays (the simulated engine and trainer): loaded and refused exactly as a torch
module's (that the simulated processes never import torch: tests/integration/test_sim.py)."""

import numpy as np
import pytest

from streamrl.weights.arrays import ArrayModel, load_state_arrays, state_arrays
from streamrl.weights.receiver import WeightReceiver


def test_array_weights_round_trip_through_a_double_buffered_receiver():
    published = ArrayModel({"weight": np.arange(6, dtype=np.float32), "step": np.array(3, dtype=np.int64)})
    live = ArrayModel({"weight": np.zeros(6, np.float32), "step": np.array(0, dtype=np.int64)})
    standby = ArrayModel({"weight": np.zeros(6, np.float32), "step": np.array(0, dtype=np.int64)})
    receiver = WeightReceiver(lambda have, timeout: None, standby=standby)
    assert receiver.offer(1, state_arrays(published))
    model, version = receiver.apply(live)
    assert model is standby and version == 1
    assert np.array_equal(model.arrays["weight"], published.arrays["weight"]) and model.arrays["step"] == 3
    views = state_arrays(model, copy=False)
    assert views["weight"] is model.arrays["weight"]  # `copy=False`: the live arrays, as for a torch module
    copies = state_arrays(model)
    copies["weight"][0] = 99
    assert model.arrays["weight"][0] == 0


@pytest.mark.parametrize("bad, error, match", [
    ({"weight": np.ones(6, np.float32), "other": np.ones(1, np.float32)}, KeyError, "does not have: \\['other'\\]"),
    ({}, KeyError, "lack tensors of the model: \\['weight'\\]"),
    ({"weight": np.ones(5, np.float32)}, ValueError, "weight: shape \\(5,\\)"),
    ({"weight": np.ones(6, np.int32)}, TypeError, "weight: int32 values"),
])
def test_a_malformed_version_is_refused_and_the_array_weights_left_as_they_were(bad, error, match):
    model = ArrayModel({"weight": np.full(6, 2.0, np.float32)})
    with pytest.raises(error, match=match):
        load_state_arrays(model, bad)
    assert (model.arrays["weight"] == 2.0).all()
    load_state_arrays(model, {"weight": np.ones(6, np.float64)})  # another precision of the same kind: allowed
    assert model.arrays["weight"].dtype == np.float32 and (model.arrays["weight"] == 1.0).all()
