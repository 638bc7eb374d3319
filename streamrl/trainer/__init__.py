"""Trainers: consume groups, compute the corrected loss, step the optimizer, advance the version."""

from streamrl.trainer.torch_trainer import TorchTrainer

__all__ = ["TorchTrainer"]
