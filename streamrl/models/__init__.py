"""Policies in Hugging Face format: the built-in tiny model and loading (weights move as numpy arrays:
`streamrl.weights.arrays`)."""

from streamrl.models.hf import load_policy
from streamrl.models.tiny import build_tiny_model

__all__ = ["build_tiny_model", "load_policy"]
