"""Configuration of the replay queue and its admission control."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

# The most any duration or timeout of a run may be (a year): a wait much longer overflows (threading.TIMEOUT_MAX
# is ~9.2e9 s, and deadlines are added to the clock), deep inside an actor rather than in the config check.
LONGEST_WAIT_S = 365 * 24 * 3600.0


class QueueConfig(BaseModel):
    """What the queue admits, holds and hands to the trainer."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    group_size: int = Field(8, ge=1, le=4096)
    """G: samples generated per prompt; a committed group must hold exactly this many rows."""

    groups_per_step: int = Field(32, ge=1)
    """B: groups the trainer consumes per optimizer step."""

    max_staleness: Annotated[int, Field(ge=0)] | Literal["auto"] = 1
    """η: a group consumed at trainer version v was sampled by versions >= v - η. 0 is on-policy.
    `"auto"`: η moves within [auto_min, auto_max], chosen each step from what the data says
    (`streamrl.buffer.auto`); the bound holds for the η in force."""

    auto_min: int = Field(0, ge=0)
    """auto: the smallest η (and the first)."""
    auto_max: int = Field(8, ge=0)
    """auto: the largest η."""
    auto_ess_min: float = Field(0.9, gt=0, le=1)
    """auto: η falls while the smoothed effective sample size of the importance weights is below this."""
    auto_kl_max: float = Field(0.05, gt=0)
    """auto: η falls while the smoothed KL(behaviour → proximal) is above this."""
    auto_mask_max: float = Field(0.1, gt=0)
    """auto: η falls while the smoothed clipped + masked fraction of tokens is above this."""
    auto_wait_min: float = Field(0.05, ge=0, lt=1)
    """auto: η rises while the trainer waits for data more than this fraction of its step (and the
    data is not too off-policy): more staleness buys throughput only then."""
    auto_wait_low: float = Field(0.01, ge=0, lt=1)
    """auto: η falls (one step per `auto_probe_steps`) while the trainer waits less than this fraction of
    its step: the budget is more than the trainer needs, and its staleness buys nothing."""
    auto_probe_steps: int = Field(10, ge=1)
    """auto: steps at one η before a fed trainer's η is lowered to try one less; an η that lowering
    showed to starve the trainer is not tried again for 5 × this many steps."""
    auto_cooldown: int = Field(2, ge=1)
    """auto: steps between two changes of η."""
    auto_smoothing: float = Field(0.3, gt=0, le=1)
    """auto: the weight of the newest step in the signals' exponential moving average."""

    max_in_flight: int = Field(64, ge=1)
    """Groups admitted but not yet committed, over all producers."""

    capacity_tokens: int = Field(4_000_000, ge=1)
    """Admission stops while the queued groups hold this many tokens (prompt + response) or more, unless
    fewer groups are queued and running than one train step takes (a trainer would wait for them forever)."""

    admission: Literal["continuous", "per_step"] = "continuous"
    """`continuous`: a slot opens as soon as the staleness formula allows (streaming). `per_step`: the
    B groups of one train step are handed out as a batch, and the next batch opens only when every
    group of the previous one is committed — the one-step-ahead loop at η = 1 (generation of step
    k + 1 overlaps training of step k, but waits for step k's slowest sample), the synchronous loop
    at η = 0. The schedules users compare against, through the same queue."""

    over_budget: Literal["regenerate", "train"] = "regenerate"
    """What happens to a queued group whose staleness exceeds η (rare: producers lagging on weights,
    or long generations finishing out of order). `regenerate` discards it and sends its prompt back
    to be generated again, so the bound holds and no prompt is lost; `train` trains on it anyway. Both
    are counted in `over_budget`."""

    vocab_size: int | None = Field(None, ge=1)
    """When set, token ids outside [0, vocab_size) are refused."""

    ticket_timeout_s: float | None = Field(None, gt=0, le=LONGEST_WAIT_S)
    """A group running longer than this is abandoned (its prompt goes back) and its ticket expires."""

    @field_validator("max_staleness", mode="before")
    @classmethod
    def _budget(cls, value: object) -> object:
        """One message for a bad budget, not one per member of the union."""
        if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
            return value
        raise PydanticCustomError("staleness_budget", 'Input should be an integer >= 0, or "auto"')

    @model_validator(mode="after")
    def _in_flight_can_fill_a_step(self) -> QueueConfig:
        # Fewer slots than one step's groups would make the trainer wait forever at η = 0.
        if self.auto_min > self.auto_max:
            raise ValueError(f"auto_min={self.auto_min} must not exceed auto_max={self.auto_max}")
        if self.auto_wait_low > self.auto_wait_min:
            raise ValueError(f"auto_wait_low={self.auto_wait_low} must not exceed auto_wait_min={self.auto_wait_min}")
        if self.max_in_flight < self.groups_per_step and self.eta_start == 0:
            raise ValueError(
                f"max_in_flight={self.max_in_flight} < groups_per_step={self.groups_per_step} with "
                "max_staleness=0: a synchronous step could never be filled"
            )
        return self

    @property
    def auto(self) -> bool:
        return self.max_staleness == "auto"

    @property
    def eta_start(self) -> int:
        """The η in force when the queue starts."""
        return self.auto_min if self.max_staleness == "auto" else self.max_staleness

    @property
    def eta_bound(self) -> int:
        """The largest η that can ever be in force."""
        return self.auto_max if self.max_staleness == "auto" else self.max_staleness

    @property
    def untrainable_after(self) -> int | None:
        """The age past which a running group can never be trained, so its producer may stop it: η's bound
        when over-budget groups are regenerated, None when they are trained anyway."""
        return self.eta_bound if self.over_budget == "regenerate" else None
