"""`queue.max_staleness = "auto"`: the staleness budget η chosen, step by step, from what the data says.

```
 each step's metrics ─► EMA of ESS, KL(behaviour → proximal), masked + clipped fraction, trainer wait
   off-policy:  ESS < ess_min  or  KL > kl_max  or  masked + clipped > mask_max   ─► η − 1   (≥ auto_min)
   starved:     trainer waited > wait_min of its step, and not off-policy          ─► η + 1   (≤ auto_max)
   otherwise                                                                        ─► η
 at most one change per `cooldown` steps: a new η reaches the trainer's data only as the groups
 admitted under it arrive, about η steps later
```
More staleness buys throughput only while the trainer waits for data (what generation did not hide);
it costs learning through the weights the data needs (low ESS), the distance the correction has to
bridge (KL(b → p)) and the tokens the objective clips or masks. The controller raises η while the
first holds and the others stay within bounds, and lowers it as soon as one does not. It only
chooses; the queue enforces whatever η is in force (`ReplayQueue.set_max_staleness`): admission by
the staleness formula, and a group over the new budget is regenerated, its prompt given back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from streamrl.buffer.config import QueueConfig


@dataclass(frozen=True)
class Decision:
    eta: int  # in force from now on
    reason: str  # starved | off_policy | steady | cooldown | no_signal
    signals: dict[str, float]  # the smoothed signals the decision read


class AutoStaleness:
    """The controller; `update(metrics)` after each step returns the η to put in force."""

    def __init__(self, config: QueueConfig, *, eta: int | None = None):
        self.config = config
        self.eta = config.auto_min if eta is None else eta
        self._smoothed: dict[str, float] = {}
        self._since_change = 0

    def update(self, metrics: dict[str, Any]) -> Decision:
        c = self.config
        self._since_change += 1
        observed = _signals(metrics)
        for name, value in observed.items():
            old = self._smoothed.get(name)
            self._smoothed[name] = value if old is None else old + c.auto_smoothing * (value - old)
        s = dict(self._smoothed)
        if "wait_fraction" not in s:
            return Decision(self.eta, "no_signal", s)
        off_policy = (s.get("ess", 1.0) < c.auto_ess_min or s.get("kl_behavior_proximal", 0.0) > c.auto_kl_max
                      or s.get("off_policy_fraction", 0.0) > c.auto_mask_max)
        if off_policy:
            wanted, reason = self.eta - 1, "off_policy"
        elif s["wait_fraction"] > c.auto_wait_min:
            wanted, reason = self.eta + 1, "starved"
        else:
            return Decision(self.eta, "steady", s)
        wanted = min(max(wanted, c.auto_min), c.auto_max)
        if wanted == self.eta:
            return Decision(self.eta, reason, s)  # at the end of the range
        if self._since_change < c.auto_cooldown:
            return Decision(self.eta, "cooldown", s)
        self.eta, self._since_change = wanted, 0
        return Decision(self.eta, reason, s)

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps, so that a resumed run goes on from the same η and smoothing."""
        return {"eta": self.eta, "smoothed": dict(self._smoothed), "since_change": self._since_change}

    def restore(self, state: dict[str, Any]) -> None:
        eta = int(state["eta"])
        if not self.config.auto_min <= eta <= self.config.auto_max:
            raise ValueError(f"a saved η of {eta} is outside [auto_min, auto_max] = "
                             f"[{self.config.auto_min}, {self.config.auto_max}]")
        self.eta, self._smoothed = eta, {k: float(v) for k, v in state["smoothed"].items()}
        self._since_change = int(state["since_change"])


def _signals(metrics: dict[str, Any]) -> dict[str, float]:
    """The step's signals, those it reports (a learner without a correction reports no ESS)."""
    out = {}
    for name in ("ess", "kl_behavior_proximal"):
        if isinstance(metrics.get(name), int | float) and math.isfinite(metrics[name]):
            out[name] = float(metrics[name])
    fractions = [metrics[k] for k in ("masked_fraction", "clipped_fraction") if isinstance(metrics.get(k), int | float)]
    if fractions:
        out["off_policy_fraction"] = float(sum(fractions))
    if metrics.get("step_s"):
        out["wait_fraction"] = float(metrics.get("trainer_wait_s", 0.0)) / float(metrics["step_s"])
    return out
