"""The loss as a tagged choice in the config, and the one factory that binds it to a function."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

if TYPE_CHECKING:
    import torch

    LossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]


class LossConfig(BaseModel):
    """Policy loss and off-policy correction. Unused fields of other variants are ignored."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    name: Literal["decoupled_ppo", "ppo_bypass", "tis", "masked_is", "reinforce", "naive", "m2po",
                  "gspo", "topr"] = "decoupled_ppo"
    """Which objective; `decoupled_ppo` corrects for stale data by default, `naive` is the baseline;
    `m2po` and `gspo` are trust regions meant for data many versions stale; `topr` imitates the better
    samples and tapers the worse ones by their sequence ratio."""
    clip_low: float = Field(0.2, gt=0, lt=1)
    """PPO ε: the ratio is clipped below at 1 − ε."""
    clip_high: float = Field(0.2, gt=0)
    """PPO ε_high: the ratio is clipped above at 1 + ε_high (DAPO's clip-higher when > clip_low)."""
    is_cap: float = Field(2.0, ge=1)
    """C: the behaviour importance weight is truncated at C (decoupled_ppo, tis, reinforce, gspo)."""
    level: Literal["token", "sequence", "geometric"] = "token"
    """masked_is: whether the ratio is checked per token, per sequence (product) or by geometric mean."""
    lo: float = Field(0.5, ge=0, le=1)
    """masked_is: tokens or sequences with ratio below this are masked."""
    hi: float = Field(2.0, ge=1)
    """masked_is: tokens or sequences with ratio above this are masked."""
    reweight: bool = True
    """masked_is: weight kept tokens by the ratio (masked IS) or by 1 (rejection)."""
    m2_tau: float = Field(0.04, gt=0)
    """m2po: τ, the largest mean second moment (log p/b)² the trust-region tokens may keep (the
    paper's single setting, 0.04)."""
    seq_clip_low: float = Field(3e-4, gt=0, lt=1)
    """gspo: ε of the sequence-level clip, below (GSPO's 3e-4)."""
    seq_clip_high: float = Field(4e-4, gt=0)
    """gspo: ε_high of the sequence-level clip, above (GSPO's 4e-4)."""
    aggregation: Literal["token_mean", "seq_mean_token_sum", "seq_mean_token_mean"] = "token_mean"
    """How per-token losses become one number."""
    kl_coef: float = Field(0.0, ge=0)
    """Weight of a KL penalty to the reference policy, a frozen copy of the run's initial weights that
    the trainer keeps (0: none, and no reference copy)."""
    kl_estimator: Literal["k1", "k3"] = "k3"

    @model_validator(mode="after")
    def _bounds(self) -> LossConfig:
        if self.lo >= self.hi:
            raise ValueError(f"lo={self.lo} must be below hi={self.hi}")
        return self

    @property
    def needs_proximal(self) -> bool:
        """Whether the trainer must compute p (one extra no-grad forward per step)."""
        from streamrl.correction.losses import NEEDS_PROXIMAL  # torch: the config is read where it is not

        return NEEDS_PROXIMAL[self.name]


_PARAMS = {
    "decoupled_ppo": ("clip_low", "clip_high", "is_cap"),
    "ppo_bypass": ("clip_low", "clip_high"),
    "tis": ("is_cap",),
    "masked_is": ("level", "lo", "hi", "reweight", "clip_low", "clip_high"),
    "reinforce": ("is_cap",),
    "naive": ("clip_low", "clip_high"),
    "m2po": ("m2_tau",),
    "gspo": ("seq_clip_low", "seq_clip_high", "is_cap"),
    "topr": (),
}


def make_loss(config: LossConfig) -> LossFn:
    """`fn(batch: PolicyBatch, *, denominator=None, trainer_version=None) -> (loss, metrics)`."""
    from streamrl.correction.losses import LOSSES

    params = {key: getattr(config, key) for key in _PARAMS[config.name]}
    return partial(LOSSES[config.name], aggregation=config.aggregation, kl_coef=config.kl_coef,
                   kl_estimator=config.kl_estimator, **params)


__all__ = ["LossConfig", "make_loss"]
