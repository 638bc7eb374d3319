"""One sglang server through each weight path, the way a producer drives it: start (its version checked),
load a new version (disk, tensor handles, broadcast), generate, and check that every token is stamped with
that version and that its log-probs are the new weights' own.

    python -m benchmarks.sglang_smoke --out sglang_smoke.json              (a GPU with the `gpu` extra)
    python -m benchmarks.sglang_smoke --stand-in --out x.json               (CPU: tests/fake_sglang.py)

A tiny Qwen2 (built here, no download) is served; version 1 is its weights perturbed with a seeded noise.
With a real server the log-probs sglang returns are compared with the Hugging Face model's under
version 1 (teacher-forced on the sampled tokens; sglang may compute in a lower precision, hence the
tolerance). With the stand-in (a toy model, not the weights) that comparison is skipped; the protocol
and the version stamps are still checked. Prints a table, writes JSON, exits 1 if a check failed.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from streamrl.config import ModelSection  # noqa: E402
from streamrl.engine.sglang.engine import EventLoopThread, SglangEngine  # noqa: E402
from streamrl.engine.sglang.server import ServerProcess, ServerSpec  # noqa: E402
from streamrl.models.hf import load_policy, quiet_transformers  # noqa: E402
from streamrl.models.tiny import build_tiny_model  # noqa: E402
from streamrl.net import free_port  # noqa: E402
from streamrl.sglang.client import SglangClient  # noqa: E402
from streamrl.sglang.protocol import check_server_version  # noqa: E402
from streamrl.weights.arrays import load_state_arrays, state_arrays  # noqa: E402
from streamrl.weights.broadcast import GroupSender, UpdateGroups, distributed_loader  # noqa: E402
from streamrl.weights.disk import DiskWeights  # noqa: E402
from streamrl.weights.tensor_handles import tensor_loader  # noqa: E402

PATHS = ("disk", "tensor", "distributed")
LOGPROB_TOLERANCE = 0.1  # sglang may serve a float32 checkpoint in bfloat16


def perturbed(model: torch.nn.Module, seed: int) -> dict[str, np.ndarray]:
    generator = np.random.default_rng(seed)
    return {name: (array + generator.normal(0.0, 0.05, array.shape)).astype(array.dtype)
            if np.issubdtype(array.dtype, np.floating) else array
            for name, array in state_arrays(model).items()}


def reference_logprobs(model: torch.nn.Module, arrays: dict[str, np.ndarray], prompt: list[int],
                       tokens: list[int], temperature: float) -> np.ndarray:
    """log_softmax(logits / temperature) of each sampled token under `arrays`, teacher-forced."""
    load_state_arrays(model, arrays)
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].double() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0].numpy()


def loader_for(path: str, arrays: dict[str, np.ndarray], model_dir: Path, work: Path, groups: UpdateGroups):
    if path == "disk":
        return DiskWeights(model_dir, work / "versions").loader(1, arrays)
    if path == "tensor":
        on_gpu = torch.cuda.is_available()
        return tensor_loader(arrays, 1 << 20, devices_of=lambda client: [torch.device("cuda", 0)] if on_gpu else None)
    return distributed_loader(groups, arrays, 1 << 20)


def run_path(path: str, *, model_dir: Path, work: Path, launcher: list[str] | None, extra: list[str],
             seed: int) -> dict:
    model, _ = load_policy(model_dir)
    arrays = perturbed(model, seed)
    spec = ServerSpec(model_path=str(model_dir), port=free_port(), mem_fraction=0.3, seed=seed, launcher=launcher,
                      extra_args=extra)
    server = ServerProcess(spec, log_dir=work / "logs", startup_timeout_s=900)
    # one GPU: the sender cannot share the server's device under NCCL, so the smoke broadcasts over gloo
    groups = UpdateGroups(GroupSender(backend="gloo"), timeout_s=300)
    io = EventLoopThread()
    started = time.perf_counter()
    server.start()
    try:
        client = SglangClient(server.url, api_key=spec.api_key)
        version = client.server_version()
        check_server_version(version, server.url)
        start_s = time.perf_counter() - started
        engine = SglangEngine(client, io, server=server)
        update_s = engine.update_weights(1, loader_for(path, arrays, model_dir, work, groups))
        prompt, temperature = [3, 4, 5, 6], 1.0
        got = io.call(engine.sample(prompt, max_new_tokens=16, temperature=temperature, seed=seed))
        client.pause_generation()
        alive_paused = client.alive()
        client.continue_generation()
        result = {"path": path, "sglang_version": version, "start_s": round(start_s, 2), "update_s": round(update_s, 3),
                  "tokens": len(got.tokens), "versions": sorted({int(v) for v in got.versions}),
                  "model_info_version": client.model_info()["weight_version"], "alive_while_paused": alive_paused,
                  "logprobs_finite": bool(np.isfinite(got.logprobs).all())}
        if launcher is None:  # the real server: its log-probs are those of the weights streamrl sent
            expected = reference_logprobs(model, arrays, prompt, got.tokens.tolist(), temperature)
            result["max_abs_logprob_diff"] = float(np.abs(expected - got.logprobs).max())
        result["ok"] = (result["tokens"] > 0 and result["versions"] == [1] and result["model_info_version"] == "1"
                        and alive_paused and result["logprobs_finite"]
                        and result.get("max_abs_logprob_diff", 0.0) <= LOGPROB_TOLERANCE)
        return result
    finally:
        groups.close()
        io.close()
        server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--paths", default=",".join(PATHS), help="comma-separated, of " + ", ".join(PATHS))
    parser.add_argument("--stand-in", action="store_true", help="tests/fake_sglang.py instead of sglang (CPU)")
    parser.add_argument("--extra-args", default="--disable-cuda-graph",
                        help="more flags for a real server (space-separated)")
    args = parser.parse_args(argv)
    quiet_transformers()
    launcher = [sys.executable, str(ROOT / "tests" / "fake_sglang.py"), "--health-s", "0.1",
                "--update-delay-s", "0"] if args.stand_in else None
    extra = [] if args.stand_in else args.extra_args.split()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model_dir = build_tiny_model(ModelSection(hidden_size=256, num_layers=2, num_heads=4, intermediate_size=512,
                                                  max_positions=256), work / "model")
        for seed, path in enumerate(args.paths.split(","), start=1):
            results.append(run_path(path, model_dir=model_dir, work=work, launcher=launcher, extra=extra, seed=seed))
    print(f"{'path':<12} {'sglang':<8} {'start s':>8} {'update s':>9} {'tokens':>6} {'versions':>9} "
          f"{'logprob diff':>12}  ok")
    for r in results:
        diff = r.get("max_abs_logprob_diff")
        print(f"{r['path']:<12} {r['sglang_version']:<8} {r['start_s']:>8.2f} {r['update_s']:>9.3f} {r['tokens']:>6} "
              f"{str(r['versions']):>9} {'-' if diff is None or math.isnan(diff) else f'{diff:.2e}':>12}  {r['ok']}")
    Path(args.out).write_text(json.dumps({"stand_in": args.stand_in, "results": results}, indent=2))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
