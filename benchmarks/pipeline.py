"""Throughput of the three schedules on one workload, side by side in one run.

    streamrl bench pipeline --engine sim --out benchmarks/results/pipeline.json
    streamrl bench pipeline --sweep --out benchmarks/results/pipeline_sweep.json   (and a .png beside it)

Schedules, through the real Ray actors, Arrow batches, queue and weight publishing:
  sync      generate a batch, train on it, update the weights (max_staleness = 0)
  one_step  generation of step k + 1 overlaps training of step k, but waits for step k's batch to
            finish (max_staleness = 1, admission = per_step)
  async     continuous admission within the staleness budget η (--eta)

`--engine sim` replaces the model's arithmetic with the calibrated timing model of
`streamrl.sim.workload` (continuous batching, a long-tailed length distribution, training time per
token, real weights of `weights_mb`); everything else is real. The ideal is the slower of generation
alone and training alone, both measured in the same run. `--engine torch` runs the built-in model
for real through `streamrl launch`'s actors (short responses, so no long tail).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import ray
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from streamrl.benchreport import BASELINES, Target, finish
from streamrl.config import ConfigError, apply_overrides
from streamrl.runtime.connect import start_local
from streamrl.sim.pipeline import (
    Schedule,
    SimPool,
    generation_alone,
    measure_schedule,
    standard_schedules,
    training_alone,
)
from streamrl.sim.workload import SimWorkload

TARGETS = [Target("speedup_async_vs_sync", ">=", 2.5), Target("speedup_async_vs_one_step", ">=", 1.3),
           Target("efficiency_async", ">=", 0.9)]
HEADLINE = ["sync.tokens_per_s", "one_step.tokens_per_s", "async.tokens_per_s", "efficiency_async"]


def pacing(schedule: Schedule, window_s: float) -> dict[str, Any]:
    """Warm-up and minimum steps: a synchronous step lasts as long as its longest response, so it
    needs fewer, longer steps than the streaming schedules to fill the same window."""
    if schedule.max_staleness == 0:
        return {"warmup_steps": 1, "min_steps": 4, "window_s": 0.0}
    if schedule.admission == "per_step":
        return {"warmup_steps": 2, "min_steps": 4, "window_s": 0.0}
    return {"warmup_steps": 3 + schedule.max_staleness, "min_steps": 8, "window_s": window_s}


def run_schedules(pool: SimPool, work: SimWorkload, eta: int, window_s: float, console: Console) -> dict[str, Any]:
    phases = {"generation_alone": lambda: generation_alone(pool, work, warmup_s=3.0, window_s=window_s / 2),
              "training_alone": lambda: training_alone(pool, work, steps=10)}
    for schedule in standard_schedules(eta):
        phases[schedule.name] = lambda s=schedule: measure_schedule(pool, work, s, **pacing(s, window_s))
    results: dict[str, Any] = {}
    for name, measure in phases.items():
        started = time.time()
        results[name] = {**measure(), "phase_wall_s": time.time() - started}
        console.print(f"{name}: {results[name]['tokens_per_s']:,.0f} tokens/s ({results[name]['phase_wall_s']:.0f} s)")
    return results


def print_schedules(results: dict[str, Any], console: Console, title: str) -> None:
    table = Table(title=title)
    for column in ("schedule", "η", "tokens/s", "samples/s", "vs ideal", "trainer busy", "producer busy",
                   "staleness mean/max", "stall/update", "wasted"):
        table.add_column(column, justify="right")
    for name in ("sync", "one_step", "async"):
        r = results[name]
        stall = r["stall_per_update_s"]
        table.add_row(name, str(r["max_staleness"]), f"{r['tokens_per_s']:,.0f}", f"{r['samples_per_s']:,.1f}",
                      f"{r['tokens_per_s'] / results['ideal_tokens_per_s']:.2f}", f"{r['trainer_busy']:.0%}",
                      f"{r['producer_busy']:.0%}", f"{r['staleness']['mean']:.2f} / {r['staleness']['max']}",
                      f"{stall['median'] * 1e3:.2f} ms" if stall.get("count") else "—",
                      f"{max(r['wasted_fraction'], 0):.0%}")
    gen, train = results["generation_alone"], results["training_alone"]
    table.add_row("gen alone", "∞", f"{gen['tokens_per_s']:,.0f}", "", "", "", f"{gen['producer_busy']:.0%}",
                  "", "", "")
    table.add_row("train alone", "∞", f"{train['tokens_per_s']:,.0f}", "", "", f"{train['trainer_busy']:.0%}",
                  "", "", "", "")
    console.print(table)
    console.print(f"async vs sync {results['speedup_async_vs_sync']:.2f}x · async vs one-step "
                  f"{results['speedup_async_vs_one_step']:.2f}x · async efficiency {results['efficiency_async']:.2f}")


def sweep(pool: SimPool, base: SimWorkload, etas: list[int], tails: list[float], producer_counts: list[int],
          window_s: float, console: Console) -> dict[str, Any]:
    """Throughput against η for each schedule, per tail heaviness and producer count. The trainer's
    speed stays calibrated to the default workload, so more producers means generation outruns it."""
    points = []
    train_s = base.calibrated_train_s_per_token()
    variants = [("p99_ratio", t) for t in tails] + [("producers", n) for n in producer_counts
                                                   if n != base.producers]
    for field, value in variants:
        work = base.model_copy(update={field: value, "train_s_per_token": train_s})
        schedules = [Schedule("sync", 0)] + [Schedule(f"{kind}", eta, admission)
                                             for kind, admission in (("one_step", "per_step"), ("async", "continuous"))
                                             for eta in etas if eta > 0]
        for schedule in schedules:
            started = time.time()
            r = measure_schedule(pool, work, schedule, **pacing(schedule, window_s))
            point = {"p99_ratio": work.p99_ratio, "producers": work.producers, **r}
            points.append(point)
            console.print(f"{field}={value} {schedule.name} η={schedule.max_staleness}: "
                          f"{r['tokens_per_s']:,.0f} tok/s ({time.time() - started:.0f} s)")
    return {"points": points, "etas": etas, "tails": tails, "producer_counts": producer_counts}


def plot(sweep_results: dict[str, Any], base: SimWorkload, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = sweep_results["points"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    panels = [("p99_ratio", "tail: p99 / median = {}", lambda p: p["producers"] == base.producers),
              ("producers", "{} producers", lambda p: p["p99_ratio"] == base.p99_ratio)]
    for ax, (field, label, keep) in zip(axes, panels):
        for value in sorted({p[field] for p in points if keep(p)}):
            mine = [p for p in points if keep(p) and p[field] == value]
            sync = next((p for p in mine if p["schedule"] == "sync"), None)
            for kind, style in (("async", "-o"), ("one_step", "--s")):
                series = sorted((p["max_staleness"], p["tokens_per_s"]) for p in mine if p["schedule"] == kind)
                if sync is not None:
                    series = [(0, sync["tokens_per_s"])] + series
                line, = ax.plot(*zip(*series), style, label=f"{kind}, {label.format(value)}")
            if sync is not None:
                ax.axhline(sync["tokens_per_s"], color=line.get_color(), alpha=0.3, linestyle=":")
        ax.set_xlabel("staleness budget η")
        ax.set_ylabel("trained tokens/s")
        ax.set_title(f"vary {field} (η = 0 is the synchronous loop)")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def torch_schedules(eta: int, steps: int, warmup_steps: int, overrides: list[str], console: Console) -> dict:
    """The three schedules with the built-in model for real, each a short `streamrl launch` run. The
    ideal comes from the same runs: the trainer's tokens per second of its own compute and the
    producers' tokens per second of generating, each measured while it worked."""
    import tempfile

    from streamrl.runtime.launch import launch, prepare

    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="streamrl-bench-") as tmp:
        for schedule in standard_schedules(eta):
            console.print(f"{schedule.name} (η = {schedule.max_staleness}, {schedule.admission}) ...")
            config, run_dir, _ = prepare(None, [
                f"run.steps={steps}", "run.eval_every=0", "run.checkpoint_every=0", "run.time_limit_s=null",
                f"run.output_dir='{tmp}'", f"run.name='bench-{schedule.name}'", "logging.progress='none'",
                f"queue.max_staleness={schedule.max_staleness}", f"queue.admission='{schedule.admission}'",
                *overrides])
            summary = launch(config, run_dir)
            results[schedule.name] = torch_measure(schedule, run_dir.read("metrics.jsonl"), summary, warmup_steps)
    train_rates = [r["trainer_compute_tokens_per_s"] for r in results.values()]
    gen_rates = [r["generation_compute_tokens_per_s"] for r in results.values()]
    results["generation_alone"] = {"tokens_per_s": max(gen_rates), "producer_busy": 1.0}
    results["training_alone"] = {"tokens_per_s": max(train_rates), "trainer_busy": 1.0}
    return results


def torch_measure(schedule: Schedule, metrics: list[dict], summary: dict, warmup_steps: int) -> dict[str, Any]:
    window = metrics[warmup_steps:]
    span = window[-1]["elapsed_s"] - metrics[warmup_steps - 1]["elapsed_s"]
    tokens = sum(m["response_tokens"] for m in window)
    producers = summary["producers"]
    generated = sum(p["generated_tokens"] for p in producers)
    generate_s = sum(p["generate_s"] for p in producers)
    staleness = [m["staleness_mean"] for m in window]
    return {
        "schedule": schedule.name, "max_staleness": schedule.max_staleness, "admission": schedule.admission,
        "steps_measured": len(window), "window_s": span, "tokens_per_s": tokens / span,
        "samples_per_s": sum(m["samples"] for m in window) / span,
        "trainer_busy": sum(m["train_s"] for m in window) / span,
        "producer_busy": generate_s / (len(producers) * summary["elapsed_s"]),
        "trainer_compute_tokens_per_s": tokens / sum(m["train_s"] for m in window),
        "generation_compute_tokens_per_s": generated / generate_s * len(producers),
        "staleness": {"mean": float(sum(staleness) / len(staleness)),
                      "max": max(m["staleness_max"] for m in window), "histogram": {}},
        "stall_per_update_s": {},
        "regenerated_groups": summary["queue"]["over_budget"],
        "aborted_groups": 0,
        "wasted_fraction": 1 - sum(m["response_tokens"] for m in metrics) / max(1, generated),
    }


def ratios(results: dict[str, Any]) -> dict[str, Any]:
    ideal = min(results["generation_alone"]["tokens_per_s"], results["training_alone"]["tokens_per_s"])
    async_rate = results["async"]["tokens_per_s"]
    return {"ideal_tokens_per_s": ideal, "speedup_async_vs_sync": async_rate / results["sync"]["tokens_per_s"],
            "speedup_async_vs_one_step": async_rate / results["one_step"]["tokens_per_s"],
            "efficiency_async": async_rate / ideal}


def sim_workload(overrides: list[str]) -> SimWorkload:
    try:
        return SimWorkload.model_validate(apply_overrides(SimWorkload().model_dump(), overrides))
    except (ValidationError, ConfigError) as exc:
        raise SystemExit(f"pipeline: bad --set for the sim workload: {exc}") from exc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=["sim", "torch"], default="sim")
    parser.add_argument("--eta", type=int, default=8, help="the async schedule's staleness budget")
    parser.add_argument("--window-s", type=float, default=25.0, help="measured seconds per schedule (sim)")
    parser.add_argument("--steps", type=int, default=40, help="train steps per schedule (torch)")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="sim: change the workload (streamrl.sim.workload.SimWorkload, e.g. p99_ratio=16); "
                             "torch: a `streamrl launch` config override (e.g. producers.count=3)")
    parser.add_argument("--sweep", action="store_true", help="sim: η × tail × producers sweep, with a PNG plot")
    parser.add_argument("--sweep-etas", type=int, nargs="+", default=[0, 1, 2, 4, 8])
    parser.add_argument("--sweep-tails", type=float, nargs="+", default=[1, 8, 16])
    parser.add_argument("--sweep-producers", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--baseline", type=Path, help="report to compare with (default: the stored baseline)")
    args = parser.parse_args()
    if args.sweep and args.engine != "sim":
        parser.error("--sweep runs the sim engine")

    console = Console(width=150)  # the tables stay whole in logs and pipes
    started = time.time()
    if args.engine == "torch":
        warmup = max(2, args.steps // 8)
        results = torch_schedules(args.eta, args.steps, warmup, args.set, console)
        workload: dict[str, Any] = {"engine": "torch", "config": "launch/default.toml", "overrides": args.set,
                                    "steps": args.steps, "warmup_steps": warmup, "async_eta": args.eta}
    else:
        work = sim_workload(args.set)
        workload = {"engine": "sim", **work.model_dump(), "mean_tokens": work.mean_length(),
                    "calibrated_train_s_per_token": work.calibrated_train_s_per_token(),
                    "model_generation_tokens_per_s": work.generation_tokens_per_s(), "async_eta": args.eta}
        start_local(2, namespace="streamrl", logging_level="WARNING",
                 log_to_driver=False)
        try:
            pool = SimPool()
            if args.sweep:
                results = sweep(pool, work, args.sweep_etas, args.sweep_tails, args.sweep_producers,
                                args.window_s / 2, console)
            else:
                results = run_schedules(pool, work, args.eta, args.window_s, console)
            pool.close()
        finally:
            ray.shutdown()
    results["wall_s"] = time.time() - started
    if args.sweep:
        out = args.out or Path("benchmarks/results/pipeline_sweep.json")
        finish("pipeline_sweep", out, workload=workload, results=results, targets=[], headline=[])
        plot(results, work, out.with_suffix(".png"))
        print(f"wrote {out.with_suffix('.png')}")
        return
    results.update(ratios(results))
    print_schedules(results, console, f"streamrl pipeline ({args.engine} engine, wall {results['wall_s']:.0f} s)")
    default = "pipeline" if args.engine == "sim" else "pipeline_torch"
    finish("pipeline", args.out or Path(f"benchmarks/results/{default}.json"), workload=workload, results=results,
           targets=TARGETS if args.engine == "sim" else [], headline=HEADLINE,
           baseline=args.baseline or BASELINES / f"baseline_{default}.json")


if __name__ == "__main__":
    main()
