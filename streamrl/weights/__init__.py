"""Weights without a global barrier: the trainer publishes `(version, weights)` and moves on; each
producer picks up the newest version on its own schedule."""

from streamrl.weights.arrays import load_state_arrays, state_arrays
from streamrl.weights.receiver import WeightReceiver
from streamrl.weights.registry import WeightRegistry

__all__ = ["WeightReceiver", "WeightRegistry", "load_state_arrays", "state_arrays"]
