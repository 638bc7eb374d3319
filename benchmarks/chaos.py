"""The fault and bad-input campaign: faults injected into one real run, bad inputs of every kind, a soak.

    streamrl bench chaos [--quick] --out benchmarks/results/chaos.json

1. faults (`harness.chaos.faults`): one run launched and resumed through `streamrl launch` while
   producers, the trainer, the queue and the launcher are SIGKILLed and Ctrl-C / SIGTERM land in every
   phase; then every prompt is accounted for (`groups_lost`, `groups_duplicated`).
2. bad inputs (`harness.chaos.fuzz`): Arrow batches, config files, CLI arguments and dataset rows, each
   checked to be refused with an error that names the problem and to leave the state as it was.
3. soak (`harness.chaos.soak`): many producers admitting and committing at full rate against the queue
   actor, its memory and the object store sampled over time.
`--quick` fits in 10 minutes on two cores; the full campaign tries 10x the bad inputs and soaks longer.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import ray
from rich.console import Console
from rich.table import Table

from harness.benchreport import BASELINES, Target, check_report_paths, finish
from harness.chaos.faults import run_campaign
from harness.chaos.fuzz import run_bad_input_campaign
from harness.chaos.soak import FULL as SOAK_FULL
from harness.chaos.soak import QUICK as SOAK_QUICK
from harness.chaos.soak import run_soak
from streamrl.runtime.connect import start_local

TARGETS = [Target("faults_injected", ">=", 10), Target("segments_not_as_expected", "<=", 0),
           Target("run_finished", ">=", 1), Target("groups_lost", "<=", 0), Target("groups_duplicated", "<=", 0),
           Target("bad_inputs_tried", ">=", 1000), Target("bad_inputs_accepted", "<=", 0),
           Target("bad_inputs_wrong_error", "<=", 0), Target("bad_inputs_state_changed", "<=", 0),
           Target("soak.memory_bounded", ">=", 1), Target("soak.object_store_bounded", ">=", 1)]
HEADLINE = ["soak.admit_ms.p99", "soak.commit_ms.p99", "soak.commits_per_s", "soak.queue_actor_peak_mb"]


def print_faults(faults: dict) -> None:
    table = Table(title="faults: one run, launched and resumed")
    for column in ("segment", "exit", "expected", "faults", "checkpoint after", "steps after", "wall s", "ok"):
        table.add_column(column, justify="right")
    for s in faults["segments"]:
        table.add_row(s["segment"], str(s["exit_status"]), str(s["expected"]), str(s["faults_injected"]),
                      str(s["checkpoint"]), str(s["steps_after"]), f"{s['wall_s']:.0f}", "yes" if s["ok"] else "NO")
    Console(width=170).print(table)
    for s in faults["segments"]:
        if not s["ok"]:
            print(f"--- {s['segment']}: exit {s['exit_status']}, expected {s['expected']}\n{s['output_tail']}")


def print_summary(results: dict) -> None:
    table = Table(title="chaos")
    for column in ("measure", "value"):
        table.add_column(column, justify="right")
    for key in ("faults_injected", "runs_completed", "groups_lost", "groups_duplicated", "bad_inputs_tried",
                "bad_inputs_accepted", "bad_inputs_wrong_error", "bad_inputs_state_changed"):
        table.add_row(key, f"{results[key]:,}")
    soak = results["soak"]
    for name in ("admit_ms", "commit_ms"):
        table.add_row(f"soak {name} p50 / p99 / max",
                      " / ".join(f"{soak[name][p]:.2f}" for p in ("p50", "p99", "max")))
    table.add_row("soak commits/s", f"{soak['commits_per_s']:,.0f}")
    table.add_row("soak queue actor peak RSS MB (growth)",
                  f"{soak['queue_actor_peak_mb']:.0f} ({soak['memory']['private_growth_mb']:+.1f})")
    table.add_row("soak object store peak MB (bound)",
                  f"{soak['object_store']['peak_mb']:.0f} ({soak['object_store']['bound_run_mb']:.0f})")
    Console(width=150).print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the 10-minute campaign")
    parser.add_argument("--out", type=Path, help="default: benchmarks/results/chaos[_quick].json")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--baseline", type=Path, help="report to compare with (default: the stored baseline)")
    args = parser.parse_args()
    bad_inputs = 1_200 if args.quick else 12_000
    soak_knobs = dict(SOAK_QUICK if args.quick else SOAK_FULL)
    out = args.out or Path(f"benchmarks/results/chaos{'_quick' if args.quick else ''}.json")
    check_report_paths(parser, out, args.baseline)

    started = time.perf_counter()
    start_local(2, logging_level="WARNING")
    try:
        with tempfile.TemporaryDirectory(prefix="streamrl-chaos-") as root:
            faults = run_campaign(Path(root))
        print_faults(faults)
        soak = run_soak(seed=args.seed, **soak_knobs)
    finally:
        ray.shutdown()
    fuzz = run_bad_input_campaign(bad_inputs, args.seed)
    soak["queue_actor_peak_mb"] = soak["memory"]["private_peak_mb"]  # its own heap: RSS counts object-store pages
    soak.pop("samples", None)  # the time series stays in benchmarks/results/soak.json
    results = {
        "faults_injected": faults["faults_injected"], "runs_completed": faults["runs_completed"],
        "segments": len(faults["segments"]),
        "segments_not_as_expected": len(faults["segments"]) - faults["runs_completed"],
        "run_finished": int(faults["finished"]), "groups_lost": faults["groups_lost"],
        "groups_duplicated": faults["groups_duplicated"], "fault_audit": faults["audit"],
        "fault_segments": faults["segments"],
        "bad_inputs_tried": fuzz["tried"], "bad_inputs_accepted": fuzz["accepted"],
        "bad_inputs_wrong_error": fuzz["wrong_error"], "bad_inputs_state_changed": fuzz["state_changed"],
        "bad_inputs_by_kind": fuzz["by_kind"], "bad_inputs_accepted_examples": fuzz["accepted_examples"],
        "bad_inputs_wrong_examples": fuzz["wrong_examples"],
        "soak": soak, "wall_s": time.perf_counter() - started,
    }
    print_summary(results)
    print(f"wall {results['wall_s']:.0f} s")
    workload = {"quick": args.quick, "bad_inputs": bad_inputs, "soak": soak_knobs, "seed": args.seed,
                "fault_run": "2-layer model, 2-digit reversal, 2 producers, checkpoint every 2 steps"}
    report = finish("chaos", out, workload=workload, results=results, targets=TARGETS, headline=HEADLINE,
                    baseline=args.baseline or BASELINES / f"baseline_{out.stem}.json")
    missed = [key for key, target in report["targets"].items() if not target["met"]]
    if missed:  # a campaign that found a defect does not end as if it had found none
        raise SystemExit(f"chaos: {', '.join(missed)} missed (see the tables above; the report is {out})")


if __name__ == "__main__":
    main()
