"""`summary.json`: what a finished run learned, how fast, and whether the staleness bound held."""

from __future__ import annotations

from typing import Any

import numpy as np

from streamrl.config import RunConfig
from streamrl.runtime.rundir import EVAL_FILE, METRICS_FILE, RunDir


def held_versions_differ(histories: list[list[tuple[float, int]]]) -> tuple[int, int] | tuple[None, None]:
    """(weight loads after which producers held different versions, the largest spread of versions held
    at one moment). Each history is (wall time, version) per load, in order. A barrier that moved every
    producer to each new version together would keep the spread at most 1 (between two loads of
    the same version); producers that pick up weights on their own schedules drift further apart.
    (None, None) when fewer than two producers reported loads: there is nothing to compare, not zero."""
    histories = [history for history in histories if history]
    if len(histories) < 2:
        return None, None
    events = sorted((t, i, v) for i, history in enumerate(histories) for t, v in history)
    held: dict[int, int] = {}
    differing = spread = 0
    for _, producer, version in events:
        held[producer] = version
        if len(held) == len(histories):
            differing += len(set(held.values())) > 1
            spread = max(spread, max(held.values()) - min(held.values()))
    return differing, spread


def _fraction_mean(values: np.ndarray, first: bool) -> float | None:
    if len(values) == 0:
        return None
    n = max(1, len(values) // 10)
    return float(values[:n].mean() if first else values[-n:].mean())


def summarize(run_dir: RunDir, config: RunConfig, *, stopped_by: str | None, final_eval: dict[str, Any],
              producers: list[dict[str, Any]], weight_histories: list[list[tuple[float, int]]],
              queue: dict[str, Any]) -> dict[str, Any]:
    metrics = run_dir.read(METRICS_FILE)
    evals = run_dir.read(EVAL_FILE)
    rewards = np.array([m["reward_mean"] for m in metrics])
    first_reward, last_reward = _fraction_mean(rewards, True), _fraction_mean(rewards, False)
    first_eval = evals[0] if evals else {}
    eta = config.queue.max_staleness  # an int, or "auto": each step records the η in force
    staleness_max = max((m["staleness_max"] for m in metrics), default=0)
    bound_held = all(m["staleness_max"] <= m.get("max_staleness", eta) for m in metrics)
    gain = None if first_reward is None else last_reward - first_reward
    accuracy_first, accuracy_last = first_eval.get("eval_accuracy"), final_eval.get("eval_accuracy")
    return {
        "name": config.run.name,
        "run_dir": str(run_dir.path),
        "stopped_by": stopped_by,
        "steps": metrics[-1]["step"] if metrics else 0,
        "elapsed_s": metrics[-1]["elapsed_s"] if metrics else 0.0,
        "schedule": "auto" if eta == "auto" else "synchronous" if eta == 0 else "asynchronous",
        "max_staleness": eta,
        "staleness_max": staleness_max,
        "staleness_bound_held": bound_held,
        "staleness_mean": float(np.mean([m["staleness_mean"] for m in metrics])) if metrics else 0.0,
        "reward_first_10pct": first_reward,
        "reward_last_10pct": last_reward,
        "reward_gain": gain,
        "eval_accuracy_first": accuracy_first,
        "eval_accuracy_last": accuracy_last,
        "eval_reward_first": first_eval.get("eval_reward"),
        "eval_reward_last": final_eval.get("eval_reward"),
        "learned": {
            "eval_accuracy_from_le_0.2_to_ge_0.8": accuracy_first is not None and accuracy_last is not None
            and accuracy_first <= 0.2 and accuracy_last >= 0.8,
            "reward_gain_ge_0.3": gain is not None and gain >= 0.3,
        },
        "trained_tokens": sum(m["trained_tokens"] for m in metrics),  # each line holds its step's
        "tokens_per_s_mean": float(np.mean([m["tokens_per_s"] for m in metrics if np.isfinite(m["tokens_per_s"])]))
        if metrics else 0.0,
        "trainer_wait_s_total": float(sum(m["trainer_wait_s"] for m in metrics)),
        "queue": queue,
        "producers": producers,
        **dict(zip(("weight_loads_with_producers_on_different_versions", "producer_version_spread_max"),
                   held_versions_differ(weight_histories))),
    }
