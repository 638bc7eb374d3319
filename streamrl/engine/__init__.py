"""Inference engines that generate rollouts: the built-in torch KV-cache sampler (CPU and GPU)."""

from streamrl.engine.sampler import Generation, TorchSampler

__all__ = ["Generation", "TorchSampler"]
