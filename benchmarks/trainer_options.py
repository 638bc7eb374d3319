"""What the trainer's options cost per step, measured side by side in one process.

    streamrl bench trainer_options [--out benchmarks/results/trainer_options.json]

The torch trainer on the default model (a 2-layer, hidden-64 Qwen2) and a default-sized batch (32
groups of 8, prompts of 5 tokens, responses of 2–8), one trainer per variant, the variants' steps
interleaved round by round so that a noisy machine slows them alike. Reported: the median step time
and its ratio to the plain float32 step.

    float32           the default
    kl_reference      loss.kl_coef > 0: one more forward pass, through the frozen reference copy
    kl_offloaded      the same with trainer.reference_offload (on a CPU-only machine: no copy to make)
    bfloat16          model.dtype = bfloat16: bf16 autocast over float32 master weights
    checkpointing     trainer.gradient_checkpointing: activations recomputed in the backward pass
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from harness.benchreport import BASELINES, check_report_paths, finish, positive_int
from harness.synthetic import synthetic_batch
from streamrl.buffer import QueueConfig, ReplayQueue
from streamrl.config import ModelSection, TrainerSection
from streamrl.correction import LossConfig
from streamrl.models.hf import quiet_transformers
from streamrl.models.tiny import build_tiny_model
from streamrl.trainer.torch_trainer import TorchTrainer

VARIANTS = {
    "float32": ({}, {}, {}),
    "kl_reference": ({}, {}, {"kl_coef": 0.05}),
    "kl_offloaded": ({}, {"reference_offload": True}, {"kl_coef": 0.05}),
    "bfloat16": ({"dtype": "bfloat16"}, {}, {}),
    "checkpointing": ({}, {"gradient_checkpointing": True}, {}),
}


def batch(seed: int):
    queue = ReplayQueue(QueueConfig(group_size=8, groups_per_step=32, max_in_flight=64))
    return synthetic_batch(queue.admit(0, 32).tickets, 8, prompt_len=5, response_len=(2, 8), vocab_size=17,
                           rng=np.random.default_rng(seed))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=positive_int, default=30)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/trainer_options.json"))
    args = parser.parse_args()
    check_report_paths(parser, args.out)
    quiet_transformers()
    torch.set_num_threads(1)  # as the trainer actor (trainer.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(ModelSection(), tmp)
        trainers = {name: TorchTrainer(model_dir, trainer=TrainerSection(**section), loss=LossConfig(**loss),
                                       group_size=8, **model)
                    for name, (model, section, loss) in VARIANTS.items()}
        times: dict[str, list[float]] = {name: [] for name in VARIANTS}
        for step in range(args.steps + 2):  # the first two rounds warm up
            data = batch(step)
            for name, trainer in trainers.items():
                started = time.perf_counter()
                trainer.train(data)
                if step >= 2:
                    times[name].append(time.perf_counter() - started)
    base = statistics.median(times["float32"])
    rows = {name: {"step_ms": 1000 * statistics.median(t), "ratio": statistics.median(t) / base}
            for name, t in times.items()}
    print(f"{'variant':<16}{'step (ms)':>12}{'× float32':>12}")
    for name, row in rows.items():
        print(f"{name:<16}{row['step_ms']:>12.1f}{row['ratio']:>12.2f}")
    workload = {"steps": args.steps, "model": ModelSection().model_dump(), "groups_per_step": 32, "group_size": 8,
                "prompt_tokens": 5, "response_tokens": [2, 8], "torch_threads": 1}
    finish("trainer_options", args.out, workload=workload, results={"variants": rows}, targets=[],
           headline=[f"variants.{name}.ratio" for name in rows], baseline=BASELINES / "baseline_trainer_options.json")


if __name__ == "__main__":
    main()
