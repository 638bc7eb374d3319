"""Off-policy correction: advantages, chunked log-probs and policy losses (pure tensor functions).

Names are imported on first use (PEP 562), so that reading a run's config (`LossConfig`) does not import
torch: the simulated engine and trainer run without it.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOME = {
    "broadcast_to_tokens": "advantages", "grpo_advantages": "advantages", "rloo_advantages": "advantages",
    "LossConfig": "config", "make_loss": "config",
    "token_entropy": "logprobs", "token_logprobs": "logprobs",
    **{name: "losses" for name in ("LOSSES", "PolicyBatch", "decoupled_ppo", "gspo", "m2po", "masked_is", "naive",
                                   "ppo_bypass", "reinforce", "tis", "token_means", "topr")},
}

__all__ = sorted(_HOME)


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__

