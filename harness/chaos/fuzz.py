"""Bad inputs from a seed: each must be refused with the project's own error, naming what is wrong,
and leave nothing changed.

```
 case i of kind k: rng(seed, k, i) ─► one mutation of a valid input ─► the entry point users reach
   batch    a producer's batch (pack_groups) ─► ReplayQueue.commit   BatchError naming the column; the queue's
                                                                     snapshot and status equal (rejected_batches
                                                                     + 1), and the valid batch still commits
   config   launch/default.toml, --set ─► load_config                ConfigError naming the field (or the file)
   cli      argv ─► streamrl.cli.main                                exit 2 with one line (argparse: its usage);
                                                                     no run directory (launch itself is a trap)
   dataset  a prompt file ─► read_rows, FileTask                     ValueError naming the file and the row
 verdict: refused as expected │ accepted │ wrong error (type or words) │ state changed
```
Each kind has its module (`bad_batches`, `bad_configs`, `bad_cli`, `bad_rows`; `cases` holds the
verdict). Only inputs the contract really forbids are generated: a mutation that could leave the input
valid is not made. A bad input that is accepted is a bug in the component, not in the fuzzer.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from harness.chaos.bad_batches import BatchFuzzer
from harness.chaos.bad_cli import CliFuzzer
from harness.chaos.bad_configs import ConfigFuzzer
from harness.chaos.bad_rows import DatasetFuzzer
from harness.chaos.cases import Fuzzer, judge

FUZZERS: dict[str, type[Fuzzer]] = {"batch": BatchFuzzer, "config": ConfigFuzzer, "cli": CliFuzzer,
                                    "dataset": DatasetFuzzer}
KINDS = tuple(FUZZERS)
EXAMPLES = 10  # accepted and wrong inputs described in the result, at most


def run_bad_input_campaign(count: int, seed: int, *, kinds: Sequence[str] = KINDS) -> dict[str, Any]:
    """Try `count` bad inputs, shared evenly over `kinds`; deterministic for a seed.

    Returns `tried`, `accepted`, `wrong_error` and `state_changed` in total and `by_kind`, with short
    descriptions of the first accepted (`accepted_examples`) and wrongly refused (`wrong_examples`) ones,
    and `digest`, a hash of every case's description: equal digests, equal campaigns.
    """
    unknown = set(kinds) - set(KINDS)
    if unknown:
        raise ValueError(f"unknown kinds {sorted(unknown)}; choose from {KINDS}")
    by_kind: dict[str, dict[str, int]] = {}
    accepted: list[str] = []
    wrong: list[str] = []
    digest = hashlib.blake2b(digest_size=8)
    with tempfile.TemporaryDirectory(prefix="streamrl-fuzz-") as tmp:
        for position, kind in enumerate(kinds):
            share = count // len(kinds) + (position < count % len(kinds))
            counts = Counter({"tried": 0, "accepted": 0, "wrong_error": 0, "state_changed": 0})
            workdir = Path(tmp) / kind
            workdir.mkdir()
            with FUZZERS[kind](workdir, seed) as fuzzer:
                for index in range(share):
                    rng = np.random.default_rng([seed, KINDS.index(kind), index])
                    case = fuzzer.case(index, rng)
                    verdict, problem = judge(case)
                    digest.update(f"{kind}: {case.description}\n".encode())
                    counts["tried"] += 1
                    if verdict != "refused":
                        counts[verdict] += 1
                    if verdict == "accepted" and len(accepted) < EXAMPLES:
                        accepted.append(f"{kind}: {case.description}")
                    elif verdict in ("wrong_error", "state_changed") and len(wrong) < EXAMPLES:
                        wrong.append(f"{kind}: {case.description}: {problem}".replace(tmp, "<tmp>"))
            by_kind[kind] = dict(counts)
    totals = Counter()
    for counts in by_kind.values():
        totals.update(counts)
    return {"tried": totals["tried"], "accepted": totals["accepted"], "wrong_error": totals["wrong_error"],
            "state_changed": totals["state_changed"], "by_kind": by_kind, "accepted_examples": accepted,
            "wrong_examples": wrong, "digest": digest.hexdigest()}


def main(argv: list[str] | None = None) -> int:
    """`python -m harness.chaos.fuzz [COUNT] [SEED]`: run the campaign and print its result as JSON."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    count, seed = (int(args[0]) if args else 1000), (int(args[1]) if len(args) > 1 else 0)
    started = time.perf_counter()
    result = run_bad_input_campaign(count, seed)
    result["seconds"] = round(time.perf_counter() - started, 2)
    print(json.dumps(result, indent=2))
    return 0 if result["accepted"] == 0 and result["wrong_error"] == 0 and result["state_changed"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
