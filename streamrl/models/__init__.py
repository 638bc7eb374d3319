"""Policies in Hugging Face format: the built-in tiny model, loading, and weights as numpy arrays."""

from streamrl.models.hf import load_policy, load_state_arrays, state_arrays
from streamrl.models.tiny import build_tiny_model

__all__ = ["build_tiny_model", "load_policy", "load_state_arrays", "state_arrays"]
