"""What every benchmark in `benchmarks/` writes: a table, a JSON report in one shape, targets checked
with the size of any miss, and ratios against a stored baseline (so a regression shows as a number).

```
 {"benchmark", "machine", "workload", "results", "targets": {key: {target, op, measured, met, off_by}},
  "vs_baseline": {key: current / baseline}}
```
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from harness import CHECKOUT

BASELINES = CHECKOUT / "benchmarks" / "results"


def positive_int(text: str) -> int:
    """An argparse type: a count of at least 1 (0 or less measured nothing, then failed on an empty list)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not at least 1")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a finite number above 0 (seconds, megabytes)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (0 < value < float("inf")):
        raise argparse.ArgumentTypeError(f"{text} is not a finite number above 0")
    return value


def check_report_paths(parser: argparse.ArgumentParser, out: Path, baseline: Path | None = None) -> None:
    """Refuse, before anything is measured, a report path that cannot be written and a named baseline that
    cannot be read: found only at the end, either lost every result measured."""
    if out.is_dir():
        parser.error(f"--out {out} is a directory: name the JSON file to write")
    parent = next((p for p in [out.parent, *out.parent.parents] if p.exists()), None)
    if parent is None or not parent.is_dir() or not os.access(parent, os.W_OK):
        parser.error(f"--out {out}: {parent} cannot hold it (not a writable directory)")
    if baseline is not None:
        try:
            json.loads(baseline.read_text())["results"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            parser.error(f"--baseline {baseline} is not a benchmark report ({type(exc).__name__}: {exc})")


def machine() -> dict[str, Any]:
    import ray
    import torch

    return {"cpus": os.cpu_count(), "python": platform.python_version(), "ray": ray.__version__,
            "torch": torch.__version__}


def lookup(results: dict[str, Any], dotted: str) -> Any:
    value: Any = results
    for part in dotted.split("."):
        value = value[part]
    return value


@dataclass(frozen=True)
class Target:
    key: str  # dotted path into `results`
    op: str  # ">=" or "<="
    value: float

    def check(self, results: dict[str, Any]) -> dict[str, Any]:
        measured = lookup(results, self.key)
        if self.op not in (">=", "<="):
            raise ValueError(f"target {self.key}: unknown comparison {self.op!r}")
        met = measured >= self.value if self.op == ">=" else measured <= self.value
        # How far off, as a factor of the target: 0.8 means 20% short of a ">=" target.
        off_by = measured / self.value if self.value else None
        return {"target": self.value, "op": self.op, "measured": measured, "met": bool(met), "off_by": off_by}


def compare(results: dict[str, Any], baseline: dict[str, Any], keys: list[str]) -> dict[str, float]:
    """current / baseline for each key both reports hold."""
    ratios = {}
    for key in keys:
        try:
            old = lookup(baseline["results"], key)
        except (KeyError, TypeError):
            continue  # the baseline predates this metric
        if old:
            ratios[key] = lookup(results, key) / old
    return ratios


def workload_differences(current: dict[str, Any], stored: Any) -> list[str]:
    """The workload keys whose values differ between this run and a stored report (every key, when the
    stored report has no workload)."""
    if not isinstance(stored, dict):
        return sorted(current)
    return sorted(key for key in set(current) | set(stored) if current.get(key) != stored.get(key))


def finish(name: str, out: Path, *, workload: dict[str, Any], results: dict[str, Any], targets: list[Target],
           headline: list[str], baseline: Path | None = None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Check targets, compare with the baseline, print both, write the report; returns it."""
    checked = {t.key: t.check(results) for t in targets}
    report = {"benchmark": name, "machine": machine(), "workload": workload, "results": results,
              "targets": checked, **(extra or {})}
    console = Console(width=150)
    if checked:
        table = Table(title=f"{name}: targets")
        for column in ("metric", "measured", "target", ""):
            table.add_column(column, justify="right")
        for key, t in checked.items():
            if t["met"]:
                verdict = "met"
            elif t["off_by"] is None:  # a bound of 0 (nothing lost): no factor to give
                verdict = f"MISSED (by {t['measured'] - t['target']:+,.3f})"
            else:
                verdict = f"MISSED ({t['off_by']:.2f}x of target)"
            table.add_row(key, f"{t['measured']:,.3f}", f"{t['op']} {t['target']:,}", verdict)
        console.print(table)
    if baseline is not None and baseline.is_file():
        stored = json.loads(baseline.read_text())
        ratios = compare(results, stored, headline)
        differs = workload_differences(workload, stored.get("workload"))
        report["vs_baseline"] = {"file": str(baseline), "ratios": ratios, "workload_differs": differs}
        if differs and ratios:  # said beside the ratios, not hidden: a user's --set is often the point
            print(f"vs baseline {baseline.name}: its workload differs in {', '.join(differs)}; the ratios "
                  "compare different workloads")
        for key, ratio in ratios.items():
            print(f"vs baseline {baseline.name}: {key} = {ratio:.2f}x")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    return report
