"""Trainers: consume groups, compute the corrected loss, step the optimizer, advance the version.

Each backend is imported from its own module (`streamrl.trainer.torch_trainer`, `.megatron_trainer`,
`.sim`), so the simulated trainer's process imports neither torch nor transformers.
"""
