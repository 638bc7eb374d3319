"""Soak of the queue actor: many producers admitting and committing at full rate for a bounded time.

    streamrl bench soak --quick                    30 s, 8 producers  -> benchmarks/results/soak_quick.json
    streamrl bench soak                           120 s, 16 producers -> benchmarks/results/soak.json

Reports admit and commit latency percentiles (ms, per call, through Ray), commits/s and groups/s, the
queue actor's memory over time (growth after warm-up), the object store's use over time and after
the drain (old weight versions and consumed batches released), and that every committed group was
consumed exactly once or regenerated. Latencies and rates depend on the machine and what else runs on
it; the bounds and the accounting must hold anywhere. See `harness.chaos.soak` for the bounds.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import ray
from rich.console import Console
from rich.table import Table

from harness.benchreport import BASELINES, Target, check_report_paths, finish, positive_float, positive_int
from harness.chaos.soak import FULL, QUICK, run_soak
from streamrl.runtime.connect import start_local

TARGETS = [Target("accounting.lost", "<=", 0), Target("accounting.duplicated_consumed", "<=", 0),
           Target("memory.private_growth_mb", "<=", 50.0), Target("object_store.peak_over_bound", "<=", 1.0),
           Target("object_store.after_drain_over_bound", "<=", 1.0)]
HEADLINE = ["groups_per_s", "commits_per_s", "admit_ms.p99", "commit_ms.p99"]


def print_tables(results: dict, console: Console) -> None:
    table = Table(title="soak: call latency through Ray (ms)")
    for column in ("call", "n", "p50", "p90", "p99", "max"):
        table.add_column(column, justify="right")
    for key in ("admit_ms", "commit_ms", "consumer_get_ms", "consumer_publish_ms"):
        p = results[key]
        table.add_row(key.removesuffix("_ms"), f"{p['n']:,}", *(f"{p[q]:,.1f}" for q in ("p50", "p90", "p99", "max")))
    console.print(table)
    mem, store, acc = results["memory"], results["object_store"], results["accounting"]
    table = Table(title="soak: throughput, memory and the object store")
    for column in ("metric", "value"):
        table.add_column(column, justify="right")
    rows = {
        "commits/s": f"{results['commits_per_s']:,.1f}", "groups/s": f"{results['groups_per_s']:,.1f}",
        "steps/s": f"{results['steps_per_s']:,.1f}",
        "refused admits (s lost)": ", ".join(f"{k}: {n} ({results['admit_blocked_s'][k]:.1f} s)"
                                             for k, n in results["admit_blocked"].items()) or "none",
        "queue actor RSS peak / growth": f"{mem['rss_peak_mb']:,.1f} / {mem['rss_growth_mb']:+,.1f} MB",
        "queue actor private peak / growth": f"{mem['private_peak_mb']:,.1f} / {mem['private_growth_mb']:+,.1f} MB "
                                             f"({mem['private_slope_mb_per_min']:+,.1f} MB/min)",
        "object store peak / bound": f"{store['peak_after_warmup_mb']:,.1f} / {store['bound_run_mb']:,.1f} MB",
        "object store after drain / bound": f"{store['after_drain_mb']:,.1f} / {store['bound_drained_mb']:,.1f} MB",
        "weight versions released / kept": f"{store['weights_released_versions']:,} / "
                                           f"{store['weights_stored_versions']}",
        "queued tokens peak / bound": f"{results['queue']['queued_tokens_peak']:,} / "
                                      f"{results['queue']['queued_tokens_bound']:,}",
        "committed / consumed / regenerated / lost": f"{acc['committed']:,} / {acc['consumed'] + acc['drained']:,}"
                                                     f" / {acc['regenerated']:,} / {acc['lost']:,}",
        "memory_bounded": str(results["memory_bounded"]),
        "object_store_bounded": str(results["object_store_bounded"]),
    }
    for key, value in rows.items():
        table.add_row(key, value)
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=f"a shorter soak: {QUICK}")
    parser.add_argument("--producers", type=positive_int)
    parser.add_argument("--duration", type=positive_float, help="seconds of load")
    parser.add_argument("--weights-mb", type=positive_float, default=4.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    load = dict(QUICK if args.quick else FULL)
    if args.producers is not None:
        load["producers"] = args.producers
    if args.duration is not None:
        load["duration_s"] = args.duration
    out = args.out or Path(f"benchmarks/results/soak{'_quick' if args.quick else ''}.json")
    check_report_paths(parser, out)

    # address="local": a Ray of its own even where a cluster is running (its figures are this run's).
    start_local(2, logging_level="WARNING", log_to_driver=False)
    try:
        results = run_soak(**load, weights_mb=args.weights_mb, seed=args.seed)
    finally:
        ray.shutdown()
    store = results["object_store"]
    store["peak_over_bound"] = store["peak_after_warmup_mb"] / store["bound_run_mb"]
    store["after_drain_over_bound"] = store["after_drain_mb"] / store["bound_drained_mb"]
    print_tables(results, Console(width=150))
    workload = {**results["config"]}
    finish("soak", out, workload=workload, results=results, targets=TARGETS, headline=HEADLINE,
           baseline=BASELINES / f"baseline_{out.stem}.json")
    if not (results["accounting"]["ok"] and results["memory_bounded"] and results["object_store_bounded"]):
        raise SystemExit("soak: a bound or the accounting did not hold (see the tables above)")


if __name__ == "__main__":
    main()
