"""GPU smoke run: the torch engine and a trainer (megatron by default) on CUDA, streaming in one process.

    bash benchmarks/gpu_smoke.sh            (on a machine with a GPU: installs the carried wheels, runs this)
    python -m benchmarks.gpu_smoke --steps 30 --out smoke.json

No Ray (a GPU machine may not have it): the in-process replay queue, weight registry and producer
loop that the Ray actors wrap. One producer thread generates with the torch engine while the main
thread trains; after each step the trainer's weights are exported in Hugging Face names and
published, and the producer switches to them at a decode-step boundary. Prints and writes generated
and trained tokens/s, step time and weight-publish time (export + publish). Runs on CPU too
(`--device cpu` is what CI checks).
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

from harness.benchreport import positive_int
from streamrl.buffer import QueueClosed, QueueConfig, ReplayQueue
from streamrl.buffer.queue import assemble
from streamrl.config import ModelSection, TaskSection, TrainerSection
from streamrl.correction import LossConfig
from streamrl.engine.local_weights import LocalWeights
from streamrl.engine.torch_engine import TorchEngine
from streamrl.models.hf import load_policy, quiet_transformers
from streamrl.models.tiny import build_tiny_model
from streamrl.rollout.producer import RolloutProducer
from streamrl.tasks import make_task
from streamrl.weights.receiver import WeightReceiver
from streamrl.weights.registry import WeightRegistry


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"median": 0.0, "p99": 0.0, "max": 0.0}
    return {"median": float(np.median(values)), "p99": float(np.percentile(values, 99)), "max": float(max(values))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=positive_int, default=30)
    parser.add_argument("--trainer", choices=["megatron", "torch"], default="megatron")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--hidden", type=positive_int, default=512)
    parser.add_argument("--layers", type=positive_int, default=8)
    parser.add_argument("--groups-per-step", type=positive_int, default=32)
    parser.add_argument("--group-size", type=positive_int, default=8)
    parser.add_argument("--max-staleness", type=int, choices=range(0, 65), metavar="0..64", default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but torch sees no GPU")
    if args.device == "cpu":
        torch.cuda.is_available = lambda: False  # the trainers follow what the process sees

    quiet_transformers()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="streamrl-gpu-smoke-") as tmp:
        section = ModelSection(hidden_size=args.hidden, num_layers=args.layers, num_heads=max(2, args.hidden // 64),
                               intermediate_size=4 * args.hidden, max_positions=64)
        model_dir = build_tiny_model(section, Path(tmp) / "model", seed=0)
        trainer_section = TrainerSection(backend=args.trainer, lr=3e-4)
        loss = LossConfig(name="decoupled_ppo")
        if args.trainer == "megatron":
            from streamrl.trainer.megatron_trainer import MegatronTrainer as Trainer
        else:
            from streamrl.trainer.torch_trainer import TorchTrainer as Trainer
        trainer = Trainer(model_dir, trainer=trainer_section, loss=loss, group_size=args.group_size)
        policy, tokenizer = load_policy(model_dir)
        policy.to(args.device)
        task = make_task(TaskSection(), tokenizer)
        queue = ReplayQueue(QueueConfig(group_size=args.group_size, groups_per_step=args.groups_per_step,
                                        max_staleness=args.max_staleness,
                                        max_in_flight=2 * args.groups_per_step, vocab_size=len(tokenizer)))
        registry = WeightRegistry()
        registry.publish(0, trainer.weights())
        receiver = WeightReceiver(lambda have, timeout: registry.acquire(0, have, timeout), poll_s=0.05,
                                  standby=copy.deepcopy(policy))
        engine = TorchEngine(LocalWeights(policy, receiver), pad_id=tokenizer.pad_token_id or 0,
                             stop_ids=task.stop_token_ids, max_new_tokens=task.max_new_tokens(),
                             capacity=args.groups_per_step * args.group_size)
        producer = RolloutProducer(0, queue=queue, engine=engine, task=task, group_size=args.group_size,
                                   max_staleness=args.max_staleness)
        stop, errors = threading.Event(), []

        def produce():
            try:
                producer.run(stop)
            except QueueClosed:
                pass  # the loop below closed it: the run is over
            except BaseException as exc:  # re-raised below, in the main thread
                errors.append(exc)

        thread = threading.Thread(target=produce, name="producer")
        thread.start()
        steps, publish_s, rewards = [], [], []
        try:
            loop_started = time.perf_counter()
            for step in range(args.steps):
                got = queue.get(timeout=300)
                if errors:
                    break  # the producer's error is raised below
                if got is None:  # a short run must not read as a complete one
                    raise RuntimeError(f"no batch of {args.groups_per_step} groups within 300 s at step {step + 1} "
                                       f"of {args.steps}: is the producer generating?")
                metrics = trainer.train(assemble(got.groups))
                queue.set_version(trainer.version)
                t = time.perf_counter()
                registry.publish(trainer.version, trainer.weights())
                publish_s.append(time.perf_counter() - t)
                steps.append(metrics)
                rewards.append(float(np.mean([g.payload.column("reward").to_numpy().mean() for g in got.groups])))
            loop_s = time.perf_counter() - loop_started
        finally:
            stop.set()
            queue.close()
            thread.join(timeout=60)
        if errors:
            raise errors[0]
        if hasattr(trainer, "close"):
            trainer.close()

    result = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "trainer": args.trainer, "model": {"hidden": args.hidden, "layers": args.layers,
                                           "parameters": sum(p.numel() for p in policy.parameters())},
        "steps": len(steps), "loop_s": loop_s, "wall_s": time.perf_counter() - started,
        "generated_tokens_per_s": producer.stats.generated_tokens / loop_s,
        "trained_tokens_per_s": sum(m["response_tokens"] for m in steps) / loop_s,  # the loss's: responses only
        "step_s": percentiles([m["train_s"] for m in steps]),
        "publish_s": percentiles(publish_s),
        "reward_first": rewards[0] if rewards else None, "reward_last": rewards[-1] if rewards else None,
    }
    for key in ("device", "trainer", "steps", "generated_tokens_per_s", "trained_tokens_per_s"):
        print(f"{key:>24}: {result[key]}")
    for key in ("step_s", "publish_s"):
        print(f"{key:>24}: median {result[key]['median'] * 1e3:.1f} ms, max {result[key]['max'] * 1e3:.1f} ms")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
