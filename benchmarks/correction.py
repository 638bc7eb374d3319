"""Peak memory and time of token log-probs: chunked vs a full log_softmax + gather, side by side.

    python -m benchmarks.correction --out benchmarks/results/correction.json

Batch 16, length 1024, vocabulary 32,768, float32 logits on the CPU (2.1 GB of logits). Each variant
runs in a fresh subprocess; its peak is the growth of the process's peak RSS over what it held once the
logits existed, so the two numbers are comparable and the logits themselves are not counted. The
logits are contiguous, as the trainer's are (it has the model compute them for the positions it needs,
`logits_to_keep`; the slice `logits[:, :-1]` it took before made autograd widen the gradient into a
second 2.1 GB buffer). The headline is the forward and backward pass, as the trainer runs it (the
gradient of the logits, 2.1 GB, is in both variants' peaks); the forward pass alone, what `logprobs`
without gradients costs, is reported beside it (`forward_*`). Earlier reports gave only the forward pass.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

from harness.benchreport import BASELINES, Target, check_report_paths, finish, positive_int

BATCH, LENGTH, VOCAB, CHUNK = 16, 1024, 32_768, 1024


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * resource.getpagesize() / 2**20


def worker(variant: str, repeats: int) -> dict:
    from streamrl.correction import token_logprobs

    torch.manual_seed(0)
    logits = torch.randn(BATCH, LENGTH, VOCAB, requires_grad=True)
    targets = torch.randint(0, VOCAB, (BATCH, LENGTH))
    weights = torch.randn(BATCH, LENGTH)  # a loss's per-token weights: every position gets a gradient
    before = _rss_mb()

    def logprobs() -> torch.Tensor:
        if variant == "naive":
            return torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1)
        return token_logprobs(logits, targets, chunk=CHUNK)

    forward_times, times = [], []
    with torch.no_grad():  # the forward pass alone first: the process's peak only grows
        for _ in range(repeats):
            t0 = time.perf_counter()
            out = logprobs()
            forward_times.append(time.perf_counter() - t0)
            del out
    forward_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    for _ in range(repeats):
        logits.grad = None
        t0 = time.perf_counter()
        out = logprobs()
        (out * weights).sum().backward()
        times.append(time.perf_counter() - t0)
        checksum = float(out.detach().sum()) + float(logits.grad[0, :8].sum())
        del out
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"peak_mb": peak - before, "time_s": min(times), "forward_peak_mb": forward_peak - before,
            "forward_time_s": min(forward_times), "checksum": checksum}


def run_variant(variant: str, repeats: int) -> dict:
    # a fresh process per variant, so that each peak is its own
    command = [sys.executable, "-m", "benchmarks.correction", "--worker", variant, "--repeats", str(repeats)]
    out = subprocess.run(command, cwd=Path(__file__).resolve().parents[1], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/correction.json"))
    parser.add_argument("--repeats", type=positive_int, default=2)
    parser.add_argument("--baseline", type=Path, help="report to compare with (default: the stored baseline)")
    parser.add_argument("--worker", choices=["naive", "chunked"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.repeats)))
        return
    check_report_paths(parser, args.out, args.baseline)

    naive, chunked = run_variant("naive", args.repeats), run_variant("chunked", args.repeats)
    if abs(naive["checksum"] - chunked["checksum"]) > 1e-3 * abs(naive["checksum"]):
        raise SystemExit(f"the two variants disagree: {naive['checksum']} vs {chunked['checksum']}")
    results = {
        "naive_peak_mb": naive["peak_mb"], "chunked_peak_mb": chunked["peak_mb"],
        "naive_time_s": naive["time_s"], "chunked_time_s": chunked["time_s"],
        "peak_ratio": chunked["peak_mb"] / naive["peak_mb"], "time_ratio": chunked["time_s"] / naive["time_s"],
        "forward_naive_peak_mb": naive["forward_peak_mb"], "forward_chunked_peak_mb": chunked["forward_peak_mb"],
        "forward_peak_ratio": chunked["forward_peak_mb"] / naive["forward_peak_mb"],
        "forward_time_ratio": chunked["forward_time_s"] / naive["forward_time_s"],
    }
    for key, value in results.items():
        print(f"{key:<18}{value:>12.3f}")
    workload = {"batch": BATCH, "length": LENGTH, "vocab": VOCAB, "chunk_rows": CHUNK, "dtype": "float32"}
    finish("correction", args.out, workload=workload, results=results,
           targets=[Target("peak_ratio", "<=", 0.25), Target("time_ratio", "<=", 1.5)],
           headline=["chunked_peak_mb", "chunked_time_s"],
           baseline=args.baseline or BASELINES / "baseline_correction.json")


if __name__ == "__main__":
    main()
