"""Throughput of the three schedules on one workload, each a `streamrl launch` run, side by side in one run.

    streamrl bench pipeline --engine sim --out benchmarks/results/pipeline.json
    streamrl bench pipeline --engine torch --out benchmarks/results/pipeline_torch.json
    streamrl bench pipeline --sweep --out benchmarks/results/pipeline_sweep.json   (and a .png beside it)

Schedules, each launched as a user launches a run (the same driver, actors, queue, Arrow batches, weight
publishing and stop path), differing only in the queue's admission:
  sync      generate a batch, train on it, update the weights (max_staleness = 0)
  one_step  generation of step k + 1 overlaps training of step k, but waits for step k's batch to
            finish (max_staleness = 1, admission = per_step)
  async     continuous admission within the staleness budget η (--eta)

`--engine sim` runs `launch/sim.toml`: the model's arithmetic replaced by the calibrated timing model
of `streamrl.sim.workload` (continuous batching, a long-tailed length distribution, training time per
token, real weights of `weights_mb`). Its ideal is the slower of generation alone (a trainer that takes
no time) and training alone (engines that take no time), both launched the same way. `--engine torch`
runs the built-in model on the long-tailed task (`launch/long-tail.toml`); its ideal comes from the same
runs: the trainer's tokens/s while it computes and the engines' while they decode. Figures are read from
each run's directory (metrics after the warm-up steps), whose path the report keeps per schedule.
Ctrl-C stops the run under way, as it stops any `streamrl launch`, and the benchmark: no report is written.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import ray
from rich.console import Console
from rich.table import Table

from harness.benchreport import BASELINES, Target, check_report_paths, finish, positive_float, positive_int
from streamrl.config import ConfigError, RunConfig, load_config
from streamrl.runtime.connect import start_local
from streamrl.runtime.launch import launch, prepare
from streamrl.runtime.rundir import RunDir

LAUNCH = Path(__file__).resolve().parent.parent / "launch"
CONFIGS = {"sim": LAUNCH / "sim.toml", "torch": LAUNCH / "long-tail.toml"}
# What the benchmark sets for each run (Launcher.settings, schedule_overrides, pacing): not a user's --set
BENCHMARK_SETS = {"run.name", "run.output_dir", "logging.progress", "run.eval_every", "run.checkpoint_every",
                  "queue.max_staleness", "queue.admission", "run.steps", "run.time_limit_s"}
UNBOUNDED = 10**6  # a staleness budget that never binds: generation or training alone
DEFAULT_WINDOW_S, DEFAULT_STEPS = 25.0, 40  # sim: measured seconds of async; torch: measured steps per schedule
TARGETS = {"sim": [Target("speedup_async_vs_sync", ">=", 7.0), Target("speedup_async_vs_one_step", ">=", 6.0),
                   Target("efficiency_async", ">=", 0.95)],
           "torch": [Target("speedup_async_vs_sync", ">=", 2.5)]}
HEADLINE = ["sync.tokens_per_s", "one_step.tokens_per_s", "async.tokens_per_s", "speedup_async_vs_sync",
            "speedup_async_vs_one_step", "efficiency_async"]
SCHEDULES = {"sync": ["queue.max_staleness=0", "queue.admission='continuous'"],
             "one_step": ["queue.max_staleness=1", "queue.admission='per_step'"]}


def schedule_overrides(name: str, eta: int) -> list[str]:
    return SCHEDULES.get(name, [f"queue.max_staleness={eta}", "queue.admission='continuous'"])


SYNC_STEPS = 10  # measured steps of sync and one-step in the sim: each is as long as its longest response


def pacing(name: str, eta: int, window_s: float, steps: int | None = None) -> tuple[int, list[str]]:
    """Warm-up steps and the run length: a synchronous step lasts as long as its longest response, so
    it needs fewer, longer steps than the streaming schedules to fill the same window (with 4, the
    sampling of 128 response lengths alone moved async ÷ sync by ±0.7). With `steps` (the torch engine,
    whose policy learns as it is measured, so response lengths move), every schedule measures the same
    steps: that many after the streaming schedules' warm-up."""
    streaming_warmup = 3 + min(eta, 8)
    if steps is not None:
        return streaming_warmup, [f"run.steps={streaming_warmup + steps}", "run.time_limit_s=900"]
    if name in ("sync", "one_step"):
        warmup = {"sync": 1, "one_step": 2}[name]
        return warmup, [f"run.steps={warmup + SYNC_STEPS}", "run.time_limit_s=300"]
    return streaming_warmup, ["run.steps=100000", f"run.time_limit_s={window_s + 6 + 0.8 * streaming_warmup}"]


class Launcher:
    """Runs one configuration after another through `streamrl launch` in this process (Ray started once);
    each run's directory stays under `root`."""

    def __init__(self, base: Path, overrides: list[str], root: Path, console: Console):
        self.base, self.overrides, self.root, self.console = base, overrides, root, console

    def settings(self, name: str, extra: list[str]) -> list[str]:
        return [*self.overrides, *extra, f"run.name='{name}'", f"run.output_dir='{self.root}'",
                "logging.progress='none'", "run.eval_every=0", "run.checkpoint_every=0"]

    def config(self, name: str, extra: list[str]) -> RunConfig:
        return load_config(self.base, self.settings(name, extra))

    def run(self, name: str, extra: list[str], warmup: int) -> dict[str, Any]:
        started = time.time()
        config, run_dir, _ = prepare(str(self.base), self.settings(name, extra))
        summary = launch(config, run_dir)
        # a Ctrl-C stopped this run, or came while it stopped by itself: it ends the benchmark
        if summary["stopped_by"] == "interrupted" or summary.get("interrupted_while_stopping"):
            raise KeyboardInterrupt(f"during the {name} run ({run_dir.path})")
        result = {**measure(run_dir, summary, warmup), "run_dir": str(run_dir.path),
                  "phase_wall_s": time.time() - started}
        self.console.print(f"{name}: {result['tokens_per_s']:,.0f} tokens/s over {result['steps_measured']} steps "
                           f"({result['phase_wall_s']:.0f} s with start-up)")
        return result


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"count": 0}
    array = np.asarray(values)
    return {"count": len(values), "median": float(np.median(array)), "p99": float(np.percentile(array, 99)),
            "max": float(array.max())}


def _median_of(records: list[dict[str, Any]], key: str) -> float | None:
    values = [m[key] for m in records if key in m]
    return float(np.median(values)) if values else None


def measure(run_dir: RunDir, summary: dict[str, Any], warmup: int) -> dict[str, Any]:
    """Trained tokens and samples per second once the pipeline is full, and what kept it from more."""
    metrics, groups = run_dir.read("metrics.jsonl"), run_dir.read("groups.jsonl")
    if len(metrics) <= warmup + 1:
        raise RuntimeError(f"{run_dir.path}: {len(metrics)} steps, not enough after {warmup} warm-up steps")
    window = metrics[warmup:]
    span = window[-1]["elapsed_s"] - metrics[warmup - 1]["elapsed_s"]
    staleness = [s for record in groups[warmup:] for s in record["staleness"]]
    producers = summary["producers"]
    engine_s = sum(p["engine_s"] for p in producers)
    tokens = sum(m["response_tokens"] for m in window)
    return {
        "steps_measured": len(window), "window_s": span,
        "tokens_per_s": tokens / span,
        "samples_per_s": sum(m["samples"] for m in window) / span,
        "trainer_busy": sum(m["train_s"] for m in window) / span,
        "producer_busy": sum(p["busy_slot_s"] for p in producers) / max(
            1e-9, sum(p["capacity"] * p["run_s"] for p in producers)),
        "trainer_compute_tokens_per_s": tokens / max(1e-9, sum(m["train_s"] for m in window)),
        "generation_compute_tokens_per_s": sum(p["generated_tokens"] for p in producers) / max(1e-9, engine_s)
        * len(producers),
        "step_s_mean": float(np.mean([m["step_s"] for m in window])),
        "trainer_wait_s_mean": float(np.mean([m["trainer_wait_s"] for m in window])),
        "staleness": {"mean": float(np.mean(staleness)), "max": int(max(staleness)),
                      "histogram": {str(k): v for k, v in sorted(Counter(staleness).items())}},
        # the responses trained in the window: a learning policy's lengths, not the task's answers
        "response_length": {"mean": tokens / max(1, sum(m["samples"] for m in window)),
                            "p50_median_over_steps": _median_of(window, "response_length_p50"),
                            "p99_median_over_steps": _median_of(window, "response_length_p99"),
                            "max": max((m.get("response_length_max", 0) for m in window), default=0),
                            "truncated_fraction": sum(m.get("truncated_fraction", 0.0) * m["samples"] for m in window)
                            / max(1, sum(m["samples"] for m in window))},
        # whole run, not the window: what producers and weight updates did from start to stop
        "stall_per_update_s": _percentiles([x for p in producers for x in p["stalls"]]),
        "regenerated_groups": summary["queue"]["over_budget"],  # finished, then found over the budget
        "aborted_groups": sum(p["aborted_groups"] for p in producers),  # stopped as soon as certain to be
    }


def schedule_runs(engine: str, eta: int, window_s: float, steps: int | None) -> list[tuple[str, list[str], int]]:
    """(name, overrides, warm-up steps) of the three schedules' runs."""
    runs = []
    for name in ("sync", "one_step", "async"):
        warmup, length = pacing(name, eta, window_s, steps if engine == "torch" else None)
        runs.append((name, schedule_overrides(name, eta) + length, warmup))
    return runs


def run_schedules(launcher: Launcher, engine: str, eta: int, window_s: float, steps: int | None) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, extra, warmup in schedule_runs(engine, eta, window_s, steps):
        results[name] = {"max_staleness": {"sync": 0, "one_step": 1}.get(name, eta),
                         "admission": "per_step" if name == "one_step" else "continuous",
                         **launcher.run(name, extra, warmup)}
    if engine == "sim":
        results.update(sim_ideal(launcher, eta, window_s))
    else:  # the trainer and the engines, each at the rate it kept while it computed
        schedules = list(results.values())
        results["generation_alone"] = {"tokens_per_s": max(r["generation_compute_tokens_per_s"] for r in schedules)}
        results["training_alone"] = {"tokens_per_s": max(r["trainer_compute_tokens_per_s"] for r in schedules)}
    return results


def sim_ideal(launcher: Launcher, eta: int, window_s: float) -> dict[str, Any]:
    """Generation alone (a trainer that takes no time) and training alone (engines that take no time),
    both with a budget that never binds. The trainer keeps its calibrated speed in the second. Each is
    measured as the async run is (its warm-up and window): with half the window and fewer warm-up steps,
    the ideal drew fewer response lengths, and async came out above its own ideal (1.03)."""
    work = launcher.config("probe", []).sim_workload()
    warmup, length = pacing("async", eta, window_s)
    unbounded = [f"queue.max_staleness={UNBOUNDED}", "queue.admission='continuous'", *length]
    step_tokens = work.groups_per_step * work.group_size * (work.prompt_tokens + work.mean_length())
    instant_engines = ["sim.decode_base_s=0.0", "sim.decode_per_seq_s=0.0", "sim.prefill_per_token_s=0.0",
                       f"sim.train_s_per_token={work.calibrated_train_s_per_token()}",
                       f"queue.capacity_tokens={int(4 * step_tokens)}"]  # a few steps ahead, not the whole run
    return {"generation_alone": launcher.run("generation_alone", [*unbounded, "sim.train_s_per_token=0.0"], warmup),
            "training_alone": launcher.run("training_alone", [*unbounded, *instant_engines], warmup)}


def ratios(results: dict[str, Any]) -> dict[str, Any]:
    ideal = min(results["generation_alone"]["tokens_per_s"], results["training_alone"]["tokens_per_s"])
    async_rate = results["async"]["tokens_per_s"]
    # In samples too: a run's tokens/s moves with the mean length of the responses it happened to draw
    # (about ±2% over a window's ~2,300 samples), its samples/s does not.
    ideal_samples = [results[name].get("samples_per_s") for name in ("generation_alone", "training_alone")]
    samples = ({"efficiency_async_samples": results["async"]["samples_per_s"] / min(ideal_samples)}
               if all(ideal_samples) else {})
    return {**samples, "ideal_tokens_per_s": ideal,
            "speedup_async_vs_sync": async_rate / results["sync"]["tokens_per_s"],
            "speedup_async_vs_one_step": async_rate / results["one_step"]["tokens_per_s"],
            "ideal_speedup_vs_sync": ideal / results["sync"]["tokens_per_s"],
            "ideal_speedup_vs_one_step": ideal / results["one_step"]["tokens_per_s"],
            "samples_speedup_async_vs_sync": results["async"]["samples_per_s"] / results["sync"]["samples_per_s"],
            "efficiency_async": async_rate / ideal}


def print_schedules(results: dict[str, Any], console: Console, title: str) -> None:
    table = Table(title=title)
    for column in ("schedule", "η", "tokens/s", "samples/s", "vs ideal", "trainer busy", "producer busy",
                   "staleness mean/max", "stall/update", "stopped early / regenerated"):
        table.add_column(column, justify="right")
    for name in ("sync", "one_step", "async"):
        r = results[name]
        stall = r["stall_per_update_s"]
        table.add_row(name, str(r["max_staleness"]), f"{r['tokens_per_s']:,.0f}", f"{r['samples_per_s']:,.1f}",
                      f"{r['tokens_per_s'] / results['ideal_tokens_per_s']:.2f}", f"{r['trainer_busy']:.0%}",
                      f"{r['producer_busy']:.0%}", f"{r['staleness']['mean']:.2f} / {r['staleness']['max']}",
                      f"{stall['median'] * 1e3:.2f} ms" if stall.get("count") else "—",
                      f"{r['aborted_groups']} / {r['regenerated_groups']}")
    for name in ("generation_alone", "training_alone"):
        table.add_row(name.replace("_", " "), "∞", f"{results[name]['tokens_per_s']:,.0f}", *[""] * 7)
    console.print(table)
    console.print(f"async vs sync {results['speedup_async_vs_sync']:.2f}x (ideal "
                  f"{results['ideal_speedup_vs_sync']:.2f}x) · async vs one-step "
                  f"{results['speedup_async_vs_one_step']:.2f}x (ideal {results['ideal_speedup_vs_one_step']:.2f}x) · "
                  f"async efficiency {results['efficiency_async']:.2f}" + (
                      f" (in samples/s {results['efficiency_async_samples']:.2f})"
                      if "efficiency_async_samples" in results else ""))


def sweep_runs(launcher: Launcher, etas: list[int], tails: list[float], producer_counts: list[int],
               window_s: float) -> list[tuple[str, list[str], int, str, int]]:
    """(name, overrides, warm-up steps, schedule, η) of every run of the sweep. The trainer's speed stays
    calibrated to the base workload, so more producers means generation outruns it."""
    base = launcher.config("probe", [])
    train_s = base.sim_workload().calibrated_train_s_per_token()
    variants = [("sim.p99_ratio", t) for t in tails] + [("producers.count", n) for n in producer_counts
                                                        if n != base.producers.count]
    runs = []
    for field, value in variants:
        for kind, admission in (("sync", "continuous"), ("one_step", "per_step"), ("async", "continuous")):
            for eta in ([0] if kind == "sync" else etas):
                warmup, length = pacing(kind, eta, window_s)
                extra = [f"{field}={value}", f"sim.train_s_per_token={train_s}", f"queue.max_staleness={eta}",
                         f"queue.admission='{admission}'", *length]
                runs.append((f"{field.split('.')[-1]}-{value}-{kind}-{eta}", extra, warmup, kind, eta))
    return runs


def sweep(launcher: Launcher, runs: list[tuple[str, list[str], int, str, int]], etas: list[int], tails: list[float],
          producer_counts: list[int]) -> dict[str, Any]:
    """Throughput against η for each schedule, per tail heaviness and producer count (`sweep_runs`)."""
    points = []
    for name, extra, warmup, kind, eta in runs:
        r = launcher.run(name, extra, warmup)
        config = launcher.config(name, extra)
        points.append({"p99_ratio": config.sim.p99_ratio, "producers": config.producers.count,
                       "schedule": kind, "max_staleness": eta, **r})
    return {"points": points, "etas": etas, "tails": tails, "producer_counts": producer_counts}


def plot(sweep_results: dict[str, Any], base: RunConfig, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = sweep_results["points"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    panels = [("p99_ratio", "tail: p99 / median = {}", lambda p: p["producers"] == base.producers.count),
              ("producers", "{} producers", lambda p: p["p99_ratio"] == base.sim.p99_ratio)]
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


def refuse_unused_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """An argument the chosen mode does not read is refused (it was ignored in silence), then the
    defaults of those it reads are filled in."""
    unused = [("--steps", args.steps is not None and args.engine == "sim", "--engine torch"),
              ("--window-s", args.window_s is not None and args.engine == "torch", "--engine sim"),
              ("--sweep", args.sweep and args.engine != "sim", "--engine sim"),
              *((f"--sweep-{name}", getattr(args, f"sweep_{name}") is not None and not args.sweep, "--sweep")
                for name in ("etas", "tails", "producers"))]
    for flag, ignored, needs in unused:
        if ignored:
            parser.error(f"{flag} is read with {needs} only")
    args.steps = DEFAULT_STEPS if args.steps is None else args.steps
    args.window_s = DEFAULT_WINDOW_S if args.window_s is None else args.window_s
    args.sweep_etas = args.sweep_etas or [1, 2, 4, 8]
    args.sweep_tails = args.sweep_tails or [1, 8, 16]
    args.sweep_producers = args.sweep_producers or [2, 4, 8]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=["sim", "torch"], default="sim")
    parser.add_argument("--eta", type=positive_int, default=8, help="the async schedule's staleness budget")
    parser.add_argument("--window-s", type=positive_float, help="sim: measured seconds of the async schedule "
                        f"(default {DEFAULT_WINDOW_S:g})")
    parser.add_argument("--steps", type=positive_int, help="torch: measured steps per schedule, after warm-up "
                        f"(default {DEFAULT_STEPS})")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="a `streamrl launch` config override (e.g. sim.p99_ratio=16, producers.count=3)")
    parser.add_argument("--sweep", action="store_true", help="sim: η × tail × producers sweep, with a PNG plot")
    parser.add_argument("--sweep-etas", type=positive_int, nargs="+")
    parser.add_argument("--sweep-tails", type=positive_float, nargs="+")
    parser.add_argument("--sweep-producers", type=positive_int, nargs="+")
    parser.add_argument("--runs", type=Path, help="where the runs' directories go (default: beside --out)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--baseline", type=Path, help="report to compare with (default: the stored baseline)")
    args = parser.parse_args()
    refuse_unused_arguments(parser, args)
    default = {"sim": "pipeline", "torch": "pipeline_torch"}[args.engine] + ("_sweep" if args.sweep else "")
    out = args.out or Path(f"benchmarks/results/{default}.json")
    check_report_paths(parser, out, args.baseline)
    for item in args.set:
        key = item.partition("=")[0].strip()
        if key in BENCHMARK_SETS:  # applied first, the benchmark's own would silently replace it
            parser.error(f"--set {key}: the benchmark sets it for each run (--eta, --window-s, --steps, --runs)")
        if key.startswith("ray."):
            parser.error(f"--set {key}: the benchmark starts one local Ray instance for all its runs")
    root = (args.runs or out.parent / f"{out.stem}-runs").resolve() / time.strftime("%Y%m%d-%H%M%S")
    console = Console(width=160)  # the tables stay whole in logs and pipes
    launcher = Launcher(CONFIGS[args.engine], args.set, root, console)
    try:  # every run's config, before the first starts: a bad one found later lost the runs before it
        load_config(CONFIGS[args.engine], args.set)
        planned = (sweep_runs(launcher, args.sweep_etas, args.sweep_tails, args.sweep_producers, args.window_s / 2)
                   if args.sweep else schedule_runs(args.engine, args.eta, args.window_s, args.steps))
        for name, extra, *_ in planned:
            launcher.config(name, extra)
    except ConfigError as exc:
        raise SystemExit(f"pipeline: {exc}") from exc
    started = time.time()
    try:
        start_local(None, namespace="streamrl", logging_level="WARNING", log_to_driver=False)
        if args.sweep:
            results = sweep(launcher, planned, args.sweep_etas, args.sweep_tails, args.sweep_producers)
        else:
            results = run_schedules(launcher, args.engine, args.eta, args.window_s, args.steps)
    except KeyboardInterrupt as exc:
        print(f"pipeline: interrupted {exc}".rstrip() + "; no report written", file=sys.stderr)
        raise SystemExit(130) from None
    finally:
        ray.shutdown()
    results["wall_s"] = time.time() - started
    results["runs"] = str(root)  # where the run directories are (not the workload: it differs every time)
    base = launcher.config("probe", [])
    workload = {"engine": args.engine, "config": str(CONFIGS[args.engine].relative_to(LAUNCH.parent)),
                "overrides": args.set, "async_eta": args.eta,
                "producers": base.producers.count, "group_size": base.queue.group_size,
                "groups_per_step": base.queue.groups_per_step}
    if args.engine == "sim":
        work = base.sim_workload()
        model = work.schedule_rates()
        workload.update(sim=work.model_dump(), mean_tokens=work.mean_length(),
                        calibrated_train_s_per_token=work.calibrated_train_s_per_token(),
                        model_generation_tokens_per_s=work.generation_tokens_per_s(),
                        model_schedule_tokens_per_s=model,  # the timing model's own, in model seconds
                        model_ideal_speedup_vs_sync=model["async"] / model["sync"],
                        model_ideal_speedup_vs_one_step=model["async"] / model["one_step"])
    if args.sweep:
        finish("pipeline_sweep", out, workload=workload, results=results, targets=[], headline=[])
        plot(results, base, out.with_suffix(".png"))
        print(f"wrote {out.with_suffix('.png')}")
        return
    results.update(ratios(results))
    if args.engine == "sim":
        # The measured ideal's training-alone run carries the trainer's own per-step costs (get, fetch,
        # publish, the driver's round trip), as async does: when the trainer binds, efficiency_async is ~1
        # whatever they cost. The model's streaming rate has none of them.
        results["model_async_tokens_per_s"] = model["async"] / work.time_scale
        results["efficiency_async_vs_model"] = results["async"]["tokens_per_s"] / results["model_async_tokens_per_s"]
    print_schedules(results, console, f"streamrl pipeline ({args.engine} engine, wall {results['wall_s']:.0f} s)")
    lengths = {name: results[name]["response_length"] for name in ("sync", "one_step", "async")}
    console.print("response tokens per sample (mean / p99, median over steps / cut at the limit): " + " · ".join(
        f"{name} {r['mean']:.1f} / {r['p99_median_over_steps'] or 0:.0f} / {r['truncated_fraction']:.0%}"
        for name, r in lengths.items()))
    if args.engine == "sim":
        console.print(f"the timing model's own ideal, with no overhead at all: async ÷ sync "
                      f"{workload['model_ideal_speedup_vs_sync']:.2f}x, async ÷ one-step "
                      f"{workload['model_ideal_speedup_vs_one_step']:.2f}x; async reaches "
                      f"{results['efficiency_async_vs_model']:.2f} of the model's streaming rate "
                      f"({results['model_async_tokens_per_s']:,.0f} tokens/s)")
    finish("pipeline", out, workload=workload, results=results, targets=TARGETS[args.engine], headline=HEADLINE,
           baseline=args.baseline or BASELINES / f"baseline_{default}.json")


if __name__ == "__main__":
    main()
