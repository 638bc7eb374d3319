"""Off-policy correction: advantages, chunked log-probs and policy losses (pure tensor functions).

Names are imported on first use (PEP 562), so that reading a run's config (`LossConfig`) does not import
torch: the simulated engine and trainer run without it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_HOME = {
    "broadcast_to_tokens": "advantages", "grpo_advantages": "advantages", "rloo_advantages": "advantages",
    "LossConfig": "config", "make_loss": "config",
    "token_entropy": "logprobs", "token_logprobs": "logprobs",
    **{name: "losses" for name in ("LOSSES", "PolicyBatch", "decoupled_ppo", "gspo", "m2po", "masked_is", "naive",
                                   "ppo_bypass", "reinforce", "tis", "topr")},
}

__all__ = [
    "LOSSES", "LossConfig", "PolicyBatch", "broadcast_to_tokens", "decoupled_ppo", "grpo_advantages",
    "gspo", "m2po", "make_loss", "masked_is", "naive", "ppo_bypass", "reinforce", "rloo_advantages", "tis",
    "token_entropy", "token_logprobs", "topr",
]


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__


if TYPE_CHECKING:
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
