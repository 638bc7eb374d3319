"""Off-policy correction: advantages, chunked log-probs and policy losses (pure tensor functions)."""

from streamrl.correction.advantages import broadcast_to_tokens, grpo_advantages, rloo_advantages
from streamrl.correction.config import LossConfig, make_loss
from streamrl.correction.logprobs import token_entropy, token_logprobs
from streamrl.correction.losses import (
    LOSSES,
    PolicyBatch,
    decoupled_ppo,
    gspo,
    m2po,
    masked_is,
    naive,
    ppo_bypass,
    reinforce,
    tis,
    topr,
)

__all__ = [
    "LOSSES", "LossConfig", "PolicyBatch", "broadcast_to_tokens", "decoupled_ppo", "grpo_advantages",
    "gspo", "m2po", "make_loss", "masked_is", "naive", "ppo_bypass", "reinforce", "rloo_advantages", "tis",
    "token_entropy", "token_logprobs", "topr",
]
