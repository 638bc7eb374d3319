"""Configuration of the replay queue and its admission control."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class QueueConfig(BaseModel):
    """What the queue admits, holds and hands to the trainer."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    group_size: int = Field(8, ge=1, le=4096)
    """G: samples generated per prompt; a committed group must hold exactly this many rows."""

    groups_per_step: int = Field(32, ge=1)
    """B: groups the trainer consumes per optimizer step."""

    max_staleness: int = Field(1, ge=0)
    """η: a group consumed at trainer version v was sampled by versions >= v - η. 0 is on-policy."""

    max_in_flight: int = Field(64, ge=1)
    """Groups admitted but not yet committed, over all producers."""

    capacity_tokens: int = Field(4_000_000, ge=1)
    """Admission stops while the queued groups hold this many tokens (prompt + response) or more."""

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

    ticket_timeout_s: float | None = Field(None, gt=0)
    """A group running longer than this is abandoned (its prompt goes back) and its ticket expires."""

    @model_validator(mode="after")
    def _in_flight_can_fill_a_step(self) -> QueueConfig:
        # Fewer slots than one step's groups would make the trainer wait forever at η = 0.
        if self.max_in_flight < self.groups_per_step and self.max_staleness == 0:
            raise ValueError(
                f"max_in_flight={self.max_in_flight} < groups_per_step={self.groups_per_step} with "
                "max_staleness=0: a synchronous step could never be filled"
            )
        return self
