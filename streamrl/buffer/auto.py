"""`queue.max_staleness = "auto"`: the staleness budget η chosen, step by step, from what the data says.

```
 each step's metrics ─► EMA of ESS, KL(behaviour → proximal), masked + clipped fraction, trainer wait
   off-policy:  ESS < ess_min  or  KL > kl_max  or  masked + clipped > mask_max   ─► η − 1   (≥ auto_min)
   starved:     trainer waited > wait_min of its step, and not off-policy          ─► η + 1   (≤ auto_max)
   idle:        waited < wait_low for probe_steps at this η, above the floor       ─► η − 1   (a probe)
   otherwise                                                                        ─► η
 at most one change per `cooldown` steps: a new η reaches the trainer's data only as the groups
 admitted under it arrive, about η steps later
 floor: a probe that starved the trainer marks the η it had to rise back to; no probe goes below it
        for 5 × probe_steps steps
```
More staleness buys throughput only while the trainer waits for data (what generation did not hide);
it costs learning through the weights the data needs (low ESS), the distance the correction has to
bridge (KL(b → p)) and the tokens the objective clips or masks. Where producers outrun the trainer the
queue fills to whatever budget it is given, so every consumed group is about η versions old: a budget
larger than the trainer needs is pure cost (measured: `docs/benchmarks.md`, "where the reward goes").
So the controller looks for the smallest η that keeps the trainer fed: it raises η while the trainer
waits and the data stays within bounds, lowers it as soon as a bound is crossed, and while the trainer
is fed it tries one less every `probe_steps`. It only chooses; the queue enforces whatever η is in
force (`ReplayQueue.set_max_staleness`) at admission, by the staleness formula: a lowered η recalls
nothing already admitted (each group keeps the budget it was admitted under, `ReplayQueue.budget_of`),
so a probe costs no generated data.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from streamrl.buffer.config import QueueConfig


@dataclass(frozen=True)
class Decision:
    eta: int  # in force from now on
    reason: str  # starved | off_policy | idle | steady | cooldown | no_signal
    signals: dict[str, float]  # the smoothed signals the decision read


class AutoStaleness:
    """The controller; `update(metrics)` after each step returns the η to put in force."""

    def __init__(self, config: QueueConfig, *, eta: int | None = None):
        self.config = config
        self.eta = config.auto_min if eta is None else eta
        self._smoothed: dict[str, float] = {}
        self._since_change = 0
        self._last_reason = ""  # why η last changed
        self._floor, self._floor_age = config.auto_min, 0  # the lowest η an idle probe may try

    def update(self, metrics: dict[str, Any]) -> Decision:
        c = self.config
        self._since_change += 1
        self._floor_age += 1
        if self._floor_age > 5 * c.auto_probe_steps:  # what starved the trainer then may not now
            self._floor = c.auto_min
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
        elif (s["wait_fraction"] < c.auto_wait_low and self.eta > self._floor
              and self._since_change >= c.auto_probe_steps):
            wanted, reason = self.eta - 1, "idle"
        else:
            return Decision(self.eta, "steady", s)
        wanted = min(max(wanted, c.auto_min), c.auto_max)
        if wanted == self.eta:
            return Decision(self.eta, reason, s)  # at the end of the range
        if self._since_change < c.auto_cooldown:
            return Decision(self.eta, "cooldown", s)
        if reason == "starved" and self._last_reason == "idle":  # the probe went one too low
            self._floor, self._floor_age = wanted, 0
        self.eta, self._since_change, self._last_reason = wanted, 0, reason
        return Decision(self.eta, reason, s)

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps, so that a resumed run goes on from the same η and smoothing."""
        return {"eta": self.eta, "smoothed": dict(self._smoothed), "since_change": self._since_change,
                "last_reason": self._last_reason, "floor": self._floor, "floor_age": self._floor_age}

    def restore(self, state: dict[str, Any]) -> None:
        """Go on from a checkpoint's `state()`; a malformed one is refused naming the field, and changes nothing."""
        def field(name: str, convert: Callable[[Any], Any], default: Any = None) -> Any:
            if name not in state and default is None:
                raise ValueError(f"auto_staleness: the saved state has no {name!r}")
            try:
                return convert(state.get(name, default))
            except (TypeError, ValueError, AttributeError) as exc:
                raise ValueError(f"auto_staleness.{name}: {state.get(name)!r} is malformed ({exc})") from exc

        eta = field("eta", int)
        if not self.config.auto_min <= eta <= self.config.auto_max:
            raise ValueError(f"a saved η of {eta} is outside [auto_min, auto_max] = "
                             f"[{self.config.auto_min}, {self.config.auto_max}]")
        smoothed = field("smoothed", lambda d: {str(k): float(v) for k, v in d.items()})
        since_change = field("since_change", int)
        # checkpoints written before idle probes lack these: no probe had set a floor
        last_reason = field("last_reason", str, "")
        floor = field("floor", int, self.config.auto_min)
        floor_age = field("floor_age", int, 0)
        self.eta, self._smoothed, self._since_change = eta, smoothed, since_change
        self._last_reason, self._floor, self._floor_age = last_reason, floor, floor_age


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
