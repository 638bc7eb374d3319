"""The rollout producer: admit slots, run groups through an engine, score them, pack Arrow batches, commit."""

from streamrl.rollout.producer import QueueClient, RolloutProducer, commit_or_give_back, pack_groups

__all__ = ["QueueClient", "RolloutProducer", "commit_or_give_back", "pack_groups"]
