"""Learning under staleness: does off-policy correction keep asynchronous training as good as on-policy?

    streamrl bench staleness --quick --out benchmarks/results/staleness_quick.json   (≤ 10 min)
    streamrl bench staleness --out benchmarks/results/staleness.json                 (the full sweep, ~60 min)
    streamrl bench staleness --config launch/long-tail.toml --etas 0 4 8 auto ...     (the long-tailed task)
    ... --diagnose 5                                      (where the reward goes: streamrl/trainer/diagnostics.py)

Each run is a real `streamrl launch` of the built-in task (the torch engine and trainer) for a fixed
number of steps, with staleness budget η and correction `loss.name`; the same seeds for every pair.
Staleness must really occur, not only be allowed: three producers outrun the one trainer, so the
queue fills up to the budget (the measured staleness is reported next to η).

Reported per (η, correction), over seeds with their spread: the final training reward (mean of the
last 10% of steps), the mean reward over all steps (the area under the curve), held-out accuracy, the
measured staleness, effective sample size and the clipped, truncated and masked fractions, the wall-clock
time to a target reward (80% of the η = 0 runs' final reward), the data figures of the diagnosis
(silent groups, baseline shift, groups regenerated and their length against the trained ones; with
--diagnose the gradient alignment of stale and fresh data and KL of each update); reward against step
and against wall-clock in a PNG. The JSON's `results.headline` holds the issue's three ratios, `targets` their targets.
"""

from __future__ import annotations

import argparse
import itertools
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import ray
from rich.console import Console
from rich.table import Table

from harness.benchreport import BASELINES, Target, check_report_paths, finish, positive_int
from streamrl.config import ConfigError, load_config
from streamrl.runtime.connect import start_local
from streamrl.runtime.launch import launch, prepare

# Four PPO mini-batches per consumed batch: the regime in which the corrections differ (with one
# optimizer step per batch the proximal policy is θ itself and decoupled PPO is truncated IS, see
# streamrl/trainer/torch_trainer.py), and the tiny model learns ~2× more per step.
FULL = {"etas": [0, 2, 4, 8, "auto"], "corrections": ["naive", "decoupled_ppo", "m2po", "topr"], "seeds": [0, 1, 2, 3],
        "steps": 150, "minibatches": 4}
QUICK = {"etas": [0, 4, "auto"], "corrections": ["decoupled_ppo", "topr"], "seeds": [0, 1], "steps": 100,
         "minibatches": 4}
TARGETS = [("best_eta4_over_eta0", ">=", 0.95), ("auto_time_to_target_over_sync", "<=", 0.5),
           ("auto_final_over_eta0", ">=", 0.95)]
TARGET_FRACTION = 0.8  # the target reward: this fraction of the η = 0 runs' final reward
CORRECTIONS = ["naive", "tis", "decoupled_ppo", "masked_is", "ppo_bypass", "reinforce", "m2po", "gspo", "topr"]
# ESS is of the weights a loss applies (1 for naive, which applies none); KL(behaviour → proximal)
# describes the data's off-policyness whatever the objective.
LOSS_METRICS = ("ess", "kl_behavior_proximal", "clipped_fraction", "truncated_fraction", "masked_fraction")
# where the reward goes (streamrl/trainer/diagnostics.py): per step where reported, averaged over the run
DIAGNOSTICS = ("kl_lag1", "update_kl", "grad_cos_stale_halves", "grad_cos_fresh_halves", "grad_cos_stale_fresh",
               "zero_signal_fraction", "baseline_shift")


def alignment(figures: dict[str, Any]) -> float | None:
    """The noise-corrected alignment of stale and fresh gradients (streamrl.trainer.diagnostics) from the
    mean cosines over many diagnosed steps: one step's ratio of small cosines is too noisy to average."""
    same_stale, same_fresh = figures.get("grad_cos_stale_halves_mean"), figures.get("grad_cos_fresh_halves_mean")
    across = figures.get("grad_cos_stale_fresh_mean")
    if None in (same_stale, same_fresh, across) or same_stale <= 0 or same_fresh <= 0:
        return None
    return across / float(np.sqrt(same_stale * same_fresh))


def final_mean(values: list[float]) -> float:
    tail = max(10, len(values) // 10)
    return float(np.mean(values[-tail:]))


def eta_order(eta: str) -> tuple[int, int]:
    """Fixed budgets in order, then "auto"."""
    return (1, 0) if eta == "auto" else (0, int(eta))


def parse_eta(text: str) -> int | str:
    """An argparse type: "auto", or a staleness budget of 0 or more."""
    if text == "auto":
        return text
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a staleness budget (a whole number >= 0, or auto)")
    return int(text)


def smoothed(rewards: list[float], window: int = 10) -> np.ndarray:
    """The trailing mean of the last `window` steps' rewards (fewer at the start)."""
    values = np.asarray(rewards, dtype=float)
    sums = np.cumsum(values)
    counts = np.minimum(np.arange(1, len(values) + 1), window)
    return (sums - np.concatenate([np.zeros(window), sums[:-window]])[:len(values)]) / counts


def time_to(curve: dict[str, list[float]], target: float) -> float | None:
    """Wall-clock seconds until the 10-step mean reward first reaches `target` (None: never)."""
    reached = np.nonzero(smoothed(curve["reward"]) >= target)[0]
    return float(curve["elapsed_s"][reached[0]]) if len(reached) else None


def mean_where_reported(metrics: list[dict[str, Any]], name: str) -> float | None:
    values = [m[name] for m in metrics if isinstance(m.get(name), int | float) and np.isfinite(m[name])]
    return float(np.mean(values)) if values else None


def kl_by_lag(metrics: list[dict[str, Any]]) -> dict[str, float]:
    """KL(behaviour → proximal) per token lag, averaged over the steps that saw that lag."""
    seen: dict[str, list[float]] = {}
    for m in metrics:
        for lag, value in m.get("kl_by_lag", {}).items():
            seen.setdefault(lag, []).append(value)
    return {lag: float(np.mean(v)) for lag, v in sorted(seen.items(), key=lambda kv: int(kv[0]))}


def data_losses(summary: dict[str, Any], metrics: list[dict[str, Any]]) -> dict[str, Any]:
    """What staleness cost in generated data: groups regenerated for being over budget (and how long
    they were against the trained ones: a length bias), groups producers stopped early."""
    queue = summary["queue"]
    trained_groups = max(queue["consumed"], 1)
    trained_tokens = sum(m["trained_tokens"] for m in metrics)
    regenerated = queue["over_budget"]
    return {"regenerated_fraction": regenerated / max(queue["admitted"], 1),
            "regenerated_length_over_trained": (queue.get("regenerated_tokens", 0) / regenerated)
            / (trained_tokens / trained_groups) if regenerated and trained_tokens else None,
            "aborted_groups": sum(p.get("aborted_groups", 0) for p in summary.get("producers", []))}


def run_settings(root: str, eta: int | str, correction: str, seed: int, steps: int, minibatches: int, producers: int,
                 overrides: list[str]) -> list[str]:
    """The `--set` items of one run of the grid."""
    return [f"run.steps={steps}", f"run.seed={seed}", "run.eval_every=0", "run.checkpoint_every=0",
            "run.time_limit_s=null", f"run.output_dir='{root}'", f"run.name='eta{eta}-{correction}-seed{seed}'",
            "logging.progress='none'",
            f"queue.max_staleness={eta!r}" if eta == "auto" else f"queue.max_staleness={eta}",
            f"loss.name='{correction}'", f"trainer.minibatches={minibatches}",
            f"producers.count={producers}",
            f"producers.num_cpus={1 / producers:.4f}", *overrides]


def run_one(root: str, eta: int | str, correction: str, seed: int, steps: int, minibatches: int, producers: int,
            overrides: list[str], config_path: str | None = None) -> dict[str, Any]:
    config, run_dir, _ = prepare(config_path, run_settings(root, eta, correction, seed, steps, minibatches, producers,
                                                           overrides))
    summary = launch(config, run_dir)
    metrics = run_dir.read("metrics.jsonl")
    staleness = [s for row in run_dir.read("groups.jsonl") for s in row["staleness"]]
    rewards = [m["reward_mean"] for m in metrics]
    run = {
        "eta": eta, "correction": correction, "seed": seed, "steps": len(metrics),
        "final_reward": final_mean(rewards), "mean_reward": float(np.mean(rewards)),
        "eval_accuracy": summary.get("eval_accuracy_last"),
        "staleness_mean": float(np.mean(staleness)), "staleness_max": int(max(staleness)),
        "staleness_histogram": {str(k): int(v) for k, v in zip(*np.unique(staleness, return_counts=True))},
        "wall_s": metrics[-1]["elapsed_s"], "over_budget": summary["queue"]["over_budget"],
        **{f"{k}_mean": float(np.mean([m[k] for m in metrics])) for k in LOSS_METRICS},
        **{f"{k}_mean": mean_where_reported(metrics, k) for k in DIAGNOSTICS},
        "kl_by_lag": kl_by_lag(metrics), **data_losses(summary, metrics),
        "step_s": metrics[-1]["elapsed_s"] / len(metrics),
        # the share of the trainer's time spent waiting for data: what generation did not hide
        "wait_fraction": summary["trainer_wait_s_total"] / metrics[-1]["elapsed_s"],
        "curve": {"step": [m["step"] for m in metrics], "reward": rewards,
                  "elapsed_s": [m["elapsed_s"] for m in metrics], "eta": [m["max_staleness"] for m in metrics]},
    }
    run["grad_alignment"] = alignment(run)
    return run


def aggregate(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """results[eta][correction], each over its seeds."""
    results: dict[str, dict[str, Any]] = {}
    on_policy = [r["final_reward"] for r in runs if r["eta"] == 0]
    target = TARGET_FRACTION * float(np.mean(on_policy)) if on_policy else None
    for run in runs:
        run["time_to_target_s"] = None if target is None else time_to(run["curve"], target)
        results.setdefault(str(run["eta"]), {}).setdefault(run["correction"], []).append(run)
    for by_correction in results.values():
        for correction, seeds in by_correction.items():
            finals = [r["final_reward"] for r in seeds]
            std = float(np.std(finals, ddof=1)) if len(finals) > 1 else 0.0
            accuracies = [r["eval_accuracy"] for r in seeds if r["eval_accuracy"] is not None]
            by_correction[correction] = {
                # sample std over seeds (ddof 1) and the standard error of the mean
                "final_reward_mean": float(np.mean(finals)), "final_reward_std": std,
                "final_reward_sem": std / np.sqrt(len(finals)),
                "final_rewards": finals, "seeds": [r["seed"] for r in seeds],
                # the area under the reward curve per step: less noisy than the end of a short run
                "mean_reward_mean": float(np.mean([r["mean_reward"] for r in seeds])),
                "mean_reward_std": float(np.std([r["mean_reward"] for r in seeds])),
                "eval_accuracy_mean": float(np.mean(accuracies)) if accuracies else None,
                "staleness_mean": float(np.mean([r["staleness_mean"] for r in seeds])),
                "staleness_max": max(r["staleness_max"] for r in seeds),
                "wall_s_mean": float(np.mean([r["wall_s"] for r in seeds])),
                "target_reward": target,
                # seeds that never reach the target count as the whole run's wall time (a lower bound)
                "time_to_target_s_mean": float(np.mean([r["wall_s"] if r["time_to_target_s"] is None
                                                        else r["time_to_target_s"] for r in seeds])),
                "reached_target": sum(r["time_to_target_s"] is not None for r in seeds),
                **{f"{k}_mean": float(np.mean([r[f"{k}_mean"] for r in seeds])) for k in LOSS_METRICS},
                **{f"{k}_mean": _mean_of([r.get(f"{k}_mean") for r in seeds]) for k in DIAGNOSTICS},
                "kl_by_lag": {lag: _mean_of([r.get("kl_by_lag", {}).get(lag) for r in seeds])
                              for lag in sorted({lag for r in seeds for lag in r.get("kl_by_lag", {})}, key=int)},
                "regenerated_fraction": _mean_of([r.get("regenerated_fraction") for r in seeds]),
                "regenerated_length_over_trained": _mean_of([r.get("regenerated_length_over_trained") for r in seeds]),
                "aborted_groups": _mean_of([r.get("aborted_groups") for r in seeds]),
                "step_s_mean": _mean_of([r.get("step_s") for r in seeds]),
                "wait_fraction_mean": _mean_of([r.get("wait_fraction") for r in seeds]),
                "runs": seeds,
            }
            by_correction[correction]["grad_alignment"] = alignment(by_correction[correction])
    return results


def _mean_of(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return float(np.mean(present)) if present else None


def expectations(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The issue's expectations, measured (never forced): decoupled PPO at η = 4 within 5% of η = 0's
    final reward per step, and naive at η = 8 measurably worse (by more than twice the standard error
    of the difference of the two means). Each check carries that standard error, so a reader can see
    whether the seeds could resolve it at all."""
    out: dict[str, Any] = {}

    def cell(eta: int, correction: str) -> dict[str, Any] | None:
        return results.get(str(eta), {}).get(correction)

    def difference_se(a: dict[str, Any], b: dict[str, Any]) -> float:
        return float(np.hypot(a["final_reward_sem"], b["final_reward_sem"]))

    dppo_on, naive_on = cell(0, "decoupled_ppo"), cell(0, "naive")
    corrected, naive = cell(4, "decoupled_ppo"), cell(8, "naive")
    if dppo_on and corrected:
        gap = corrected["final_reward_mean"] - dppo_on["final_reward_mean"]
        out["decoupled_ppo_eta4_vs_eta0"] = {
            "ratio": corrected["final_reward_mean"] / dppo_on["final_reward_mean"], "gap": gap,
            "gap_se": difference_se(dppo_on, corrected), "held": gap >= -0.05 * dppo_on["final_reward_mean"]}
    if naive_on and naive:
        gap = naive_on["final_reward_mean"] - naive["final_reward_mean"]
        se = difference_se(naive_on, naive)
        out["naive_eta8_vs_eta0"] = {"gap": gap, "gap_se": se, "held": gap > max(2 * se, 0.02)}
    return out


def headline(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The issue's three figures, each per correction and for the best one: η = 4 ÷ η = 0 final reward
    (same objective; the standard error by the delta method), auto's time to the target ÷ the
    synchronous run's, auto's final reward ÷ η = 0's."""
    def ratio(a: dict[str, Any], b: dict[str, Any]) -> tuple[float, float]:
        r = a["final_reward_mean"] / b["final_reward_mean"]
        return r, abs(r) * float(np.hypot(a["final_reward_sem"] / a["final_reward_mean"],
                                          b["final_reward_sem"] / b["final_reward_mean"]))

    sync, eta4, auto = results.get("0", {}), results.get("4", {}), results.get("auto", {})
    per: dict[str, dict[str, float]] = {}
    for correction in sorted(set(sync) | set(eta4) | set(auto)):
        if correction not in sync:
            continue
        row: dict[str, float] = {}
        if correction in eta4:
            row["eta4_over_eta0"], row["eta4_over_eta0_se"] = ratio(eta4[correction], sync[correction])
        if correction in auto:
            row["auto_final_over_eta0"], _ = ratio(auto[correction], sync[correction])
            row["auto_time_to_target_over_sync"] = (auto[correction]["time_to_target_s_mean"]
                                                    / sync[correction]["time_to_target_s_mean"])
        per[correction] = row
    out: dict[str, Any] = {"per_correction": per}
    corrected = {c: r for c, r in per.items() if c != "naive"}
    if any("eta4_over_eta0" in r for r in corrected.values()):
        best = max((c for c in corrected if "eta4_over_eta0" in corrected[c]),
                   key=lambda c: corrected[c]["eta4_over_eta0"])
        out.update(best_eta4_correction=best, best_eta4_over_eta0=corrected[best]["eta4_over_eta0"],
                   best_eta4_over_eta0_se=corrected[best]["eta4_over_eta0_se"])
    if any("auto_final_over_eta0" in r for r in corrected.values()):
        best = max((c for c in corrected if "auto_final_over_eta0" in corrected[c]),
                   key=lambda c: corrected[c]["auto_final_over_eta0"])
        out.update(auto_correction=best, auto_final_over_eta0=corrected[best]["auto_final_over_eta0"],
                   auto_time_to_target_over_sync=corrected[best]["auto_time_to_target_over_sync"])
    return out


def headline_targets(figures: dict[str, Any]) -> list[Target]:
    """The targets of the headline figures the sweep could compute (a sweep without η = 0 has none)."""
    return [Target(f"headline.{name}", op, bound) for name, op, bound in TARGETS if name in figures]


def plot(results: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(13, 4.8))
    styles = {"naive": ":", "tis": (0, (1, 3)), "decoupled_ppo": "-", "m2po": "-.", "topr": "--", "gspo": (0, (5, 1))}
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, eta in enumerate(sorted(results, key=eta_order)):
        for correction, cell in sorted(results[eta].items()):
            curves = [r["curve"] for r in cell["runs"]]
            length = min(len(c["reward"]) for c in curves)
            reward = np.mean([c["reward"][:length] for c in curves], axis=0)
            window = min(10, length)
            smooth = np.convolve(reward, np.ones(window) / window, mode="valid")
            steps = np.asarray(curves[0]["step"][:length])[window - 1:]
            elapsed = np.mean([c["elapsed_s"][:length] for c in curves], axis=0)[window - 1:]
            label = f"η={eta} {correction}"
            by_step.plot(steps, smooth, styles.get(correction, "-"), color=colors[i % len(colors)], label=label)
            by_time.plot(elapsed, smooth, styles.get(correction, "-"), color=colors[i % len(colors)], label=label)
    by_step.set_xlabel("trainer step")
    by_time.set_xlabel("wall-clock seconds")
    for ax in (by_step, by_time):
        ax.set_ylabel("training reward (10-step mean, averaged over seeds)")
        ax.grid(alpha=0.3)
    by_step.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def print_table(results: dict[str, dict[str, Any]], console: Console) -> None:
    table = Table(title="learning under staleness (final reward = mean of the last 10% of steps)")
    for column in ("η", "correction", "final reward", "± std", "mean reward", "eval acc", "staleness mean / max", "ESS",
                   "KL(b→p)", "clipped", "truncated", "masked", "to target s", "wall s"):
        table.add_column(column, justify="right")
    for eta in sorted(results, key=eta_order):
        for correction, c in sorted(results[eta].items()):
            accuracy = "—" if c["eval_accuracy_mean"] is None else f"{c['eval_accuracy_mean']:.0%}"
            table.add_row(eta, correction, f"{c['final_reward_mean']:.3f}", f"{c['final_reward_std']:.3f}",
                          f"{c['mean_reward_mean']:.3f}", accuracy,
                          f"{c['staleness_mean']:.2f} / {c['staleness_max']}", f"{c['ess_mean']:.3f}",
                          f"{c['kl_behavior_proximal_mean']:.4f}", f"{c['clipped_fraction_mean']:.1%}",
                          f"{c['truncated_fraction_mean']:.1%}", f"{c['masked_fraction_mean']:.1%}",
                          f"{c['time_to_target_s_mean']:.0f} ({c['reached_target']}/{len(c['runs'])})",
                          f"{c['wall_s_mean']:.0f}")
    console.print(table)


DIAGNOSIS_COLUMNS = [("kl_behavior_proximal_mean", ".4f"), ("update_kl_mean", ".4f"),
                     ("grad_cos_stale_halves_mean", ".3f"), ("grad_cos_fresh_halves_mean", ".3f"),
                     ("grad_cos_stale_fresh_mean", ".3f"), ("grad_alignment", ".2f"),
                     ("zero_signal_fraction_mean", ".1%"), ("baseline_shift_mean", ".4f"),
                     ("regenerated_fraction", ".1%"), ("regenerated_length_over_trained", ".2f"),
                     ("step_s_mean", ".3f"), ("wait_fraction_mean", ".0%")]


def print_diagnosis(results: dict[str, dict[str, Any]], console: Console) -> None:
    """Where the reward goes: each cell's diagnostics (— where the runs did not report them)."""
    def fmt(value: float | None, spec: str) -> str:
        return "—" if value is None else format(value, spec)

    table = Table(title="where the reward goes (means over steps and seeds; grad cos and update KL on diagnosed steps)")
    for column in ("η", "correction", "KL(b→p)", "KL by lag", "update KL", "cos stale", "cos fresh", "cos stale/fresh",
                   "alignment", "silent groups", "baseline shift", "regenerated", "regen len ÷ trained", "step s",
                   "wait"):
        table.add_column(column, justify="right")
    for eta in sorted(results, key=eta_order):
        for correction, c in sorted(results[eta].items()):
            lags = " ".join(f"{lag}:{v:.3f}" for lag, v in c.get("kl_by_lag", {}).items() if v is not None)
            table.add_row(eta, correction, *[fmt(c.get(key), spec) for key, spec in DIAGNOSIS_COLUMNS[:1]], lags or "—",
                          *[fmt(c.get(key), spec) for key, spec in DIAGNOSIS_COLUMNS[1:]])
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=f"the quick grid: {QUICK}")
    parser.add_argument("--etas", type=parse_eta, nargs="+", help='budgets η, "auto" among them')
    parser.add_argument("--corrections", nargs="+", choices=CORRECTIONS)
    parser.add_argument("--seeds", type=int, nargs="+")
    parser.add_argument("--steps", type=positive_int)
    parser.add_argument("--minibatches", type=positive_int,
                        help="optimizer steps per consumed batch (trainer.minibatches)")
    parser.add_argument("--producers", type=positive_int, default=3,
                        help="more producers than the trainer can keep up with")
    parser.add_argument("--config", help="a run config (default: the built-in task), e.g. launch/long-tail.toml")
    parser.add_argument("--diagnose", type=int, default=0, metavar="N",
                        help="trainer.diagnose_every: gradient alignment and KL of the update every N steps "
                             "(extra passes: slows the runs, so leave it off for time-to-target figures)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="a `streamrl launch` config override applied to every run")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    grid = dict(QUICK if args.quick else FULL)
    for key in ("etas", "corrections", "seeds", "steps", "minibatches"):
        if getattr(args, key) is not None:
            grid[key] = getattr(args, key)
    out = args.out or Path(f"benchmarks/results/staleness{'_quick' if args.quick else ''}.json")
    check_report_paths(parser, out)
    overrides = [*args.set, f"trainer.diagnose_every={args.diagnose}"]
    try:  # every run's config, before the first starts: a bad one found later lost the runs before it
        for seed, eta, correction in itertools.product(grid["seeds"], grid["etas"], grid["corrections"]):
            load_config(args.config, run_settings("runs", eta, correction, seed, grid["steps"], grid["minibatches"],
                                                  args.producers, overrides))
    except ConfigError as exc:
        raise SystemExit(f"staleness: {exc}") from exc

    console = Console(width=150)
    started = time.time()
    runs = []
    start_local(2, namespace="streamrl", logging_level="WARNING", log_to_driver=False)
    try:
        with tempfile.TemporaryDirectory(prefix="streamrl-staleness-") as root:
            for seed in grid["seeds"]:
                for eta in grid["etas"]:
                    for correction in grid["corrections"]:
                        run = run_one(root, eta, correction, seed, grid["steps"], grid["minibatches"],
                                      args.producers, overrides, args.config)
                        runs.append(run)
                        console.print(f"η={eta} {correction} seed {seed}: final reward {run['final_reward']:.3f}, "
                                      f"staleness {run['staleness_mean']:.2f} (max {run['staleness_max']}), "
                                      f"{run['wall_s']:.0f} s  [{time.time() - started:.0f} s total]")
    finally:
        ray.shutdown()
    results = aggregate(runs)
    print_table(results, console)
    print_diagnosis(results, console)
    checks = expectations(results)
    figures = headline(results)
    console.print(f"headline: {figures}")
    for name, check in checks.items():
        console.print(f"expectation {name}: {'held' if check['held'] else 'did not hold'} ({check})")
    targets = headline_targets(figures)
    finish("staleness", out, workload={"task": args.config or "reverse (built-in)", "producers": args.producers,
                                       "diagnose_every": args.diagnose, "overrides": args.set, **grid},
           results={**results, "headline": figures}, targets=targets, headline=[t.key for t in targets],
           baseline=BASELINES / f"baseline_{out.stem}.json",
           extra={"expectations": checks, "wall_s": time.time() - started})
    plot(results, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
