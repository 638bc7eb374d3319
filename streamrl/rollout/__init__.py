"""Rollout producers: admit slots, generate groups, score them, pack Arrow batches, commit."""

from streamrl.rollout.producer import QueueClient, RolloutProducer, pack_groups

__all__ = ["QueueClient", "RolloutProducer", "pack_groups"]
