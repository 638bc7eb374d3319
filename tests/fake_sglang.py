"""A loopback stand-in for an sglang server: the HTTP endpoints streamrl drives, with sglang's JSON
shapes, and a toy model behind them (a seeded random distribution per weight version and context),
so the client's protocol can be tested without a GPU. Run as a script:

    python tests/fake_sglang.py --port 30001 [--token-delay-s 0.002] [--update-delay-s 0.5] [--api-key KEY]

Requests queue while generation is paused; `pause_generation` with mode "abort" ends the running
requests with finish reason abort and the tokens made so far. `GET /fake/calls` lists the calls in order.
`/init_weights_update_group` joins the sender's process group (as sglang: a TCPStore at the master
address, a `PrefixStore` named after the group; gloo here) and `/update_weights_from_distributed`
receives each announced tensor by broadcast from rank 0; `/update_weights_from_tensor` unpickles
sglang's serialized tensors (CUDA IPC handles on a GPU); `GET /fake/weights_digest` is a sha256 over
the received names and bytes (`weights_digest`). torch is imported only when those are used.
With `--api-key`, as sglang: every path but `/health*` needs `Authorization: Bearer KEY`, else 401
`{"error": "Unauthorized"}` (the refused request is not recorded).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import secrets
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class ToyModel:
    def __init__(self, vocab_size: int, seed: int):
        self.vocab_size, self.seed = vocab_size, seed

    def distribution(self, version: str, context: list[int], temperature: float) -> list[float]:
        rng = random.Random(f"{self.seed}/{version}/{context[-2:]}")
        logits = [rng.gauss(0.0, 2.0) / temperature for _ in range(self.vocab_size)]
        top = max(logits)
        weights = [math.exp(x - top) for x in logits]
        total = sum(weights)
        return [w / total for w in weights]


class State:
    def __init__(self, args):
        self.model = ToyModel(args.vocab_size, args.seed)
        self.token_delay_s, self.update_delay_s = args.token_delay_s, args.update_delay_s
        self.calls_log = args.calls_log  # every POST appended as a line "PORT PATH", for tests after the run
        self.cond = threading.Condition()
        self.paused = False
        self.released = False
        self.weight_version = "default"
        self.running: dict[str, bool] = {}  # rid -> abort requested
        self.calls: list[dict] = []
        self.next_rid = 0
        self.groups: dict = {}  # group name -> torch process group (weights by broadcast)
        self.weights: dict = {}  # name -> tensor received by broadcast


def generate(state: State, body: dict) -> dict:
    ids = body.get("input_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
        raise ValueError("input_ids must be a non-empty list of token ids")
    params = body.get("sampling_params") or {}
    max_new = int(params.get("max_new_tokens", 128))
    stop_ids = set(params.get("stop_token_ids") or [])
    temperature = float(params.get("temperature", 1.0))
    with state.cond:
        if state.released:
            raise ValueError("memory is released: resume_memory_occupation first")
        rid = body.get("rid") or f"fake-{state.next_rid}"
        state.next_rid += 1
        state.running[rid] = False  # waiting counts: an abort reaches requests held by a pause too
        state.cond.wait_for(lambda: not state.paused or state.running[rid])  # held while paused
        version = state.weight_version
    rng = random.Random(f"{params.get('sampling_seed', 0)}/{rid}/{len(ids)}")
    context, out, logprobs, finish = list(ids), [], [], {"type": "length", "length": max_new}
    try:
        while len(out) < max_new:
            time.sleep(state.token_delay_s)
            with state.cond:
                if state.running[rid]:
                    finish = {"type": "abort", "message": "Abort before generation finished."}
                    break
            probs = state.model.distribution(version, context, temperature)
            token = rng.choices(range(len(probs)), probs)[0]
            out.append(token)
            logprobs.append([math.log(probs[token]), token, None])
            context.append(token)
            if token in stop_ids:
                finish = {"type": "stop", "matched": token}
                break
    finally:
        with state.cond:
            del state.running[rid]
    return {"output_ids": out, "meta_info": {
        "id": rid, "finish_reason": finish, "prompt_tokens": len(ids), "completion_tokens": len(out),
        "output_token_logprobs": logprobs, "weight_version": version}}


def weights_digest(named_bytes) -> str:
    """sha256 over (name, raw bytes) pairs in name order: what the sender and the server compare."""
    import hashlib

    digest = hashlib.sha256()
    for name, data in sorted(named_bytes):
        digest.update(name.encode() + b"\0" + data)
    return digest.hexdigest()


def init_weights_update_group(state: State, body: dict) -> dict:
    import datetime

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    rank, world, name = int(body["rank_offset"]), int(body["world_size"]), str(body["group_name"])
    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore(body["master_address"], int(body["master_port"]), world, False, timeout=timeout)
    group, _ = c10d._new_process_group_helper(world, rank, [], body.get("backend", "nccl"),
                                              dist.PrefixStore(name, store), group_name=name, timeout=timeout)
    c10d._world.pg_group_ranks[group] = {r: r for r in range(world)}
    with state.cond:
        state.groups[name] = group
    return {"success": True, "message": "Succeeded to initialize custom process group."}


def update_weights_from_distributed(state: State, body: dict) -> tuple[int, dict]:
    import torch
    import torch.distributed as dist

    with state.cond:
        group = state.groups.get(body.get("group_name"))
    if group is None:
        return 400, {"success": False, "message": f"no update group {body.get('group_name')!r}"}
    time.sleep(state.update_delay_s)  # loading takes time; the sender's broadcast waits for it
    tensors = [torch.empty(shape, dtype=getattr(torch, dtype))
               for dtype, shape in zip(body["dtypes"], body["shapes"], strict=True)]
    for work in [dist.broadcast(t, group_src=0, group=group, async_op=True) for t in tensors]:
        work.wait()
    with state.cond:
        state.weights.update(zip(body["names"], tensors, strict=True))
        if body.get("weight_version") is not None:
            state.weight_version = str(body["weight_version"])
    return 200, {"success": True, "message": "Succeeded to update parameter online."}


def update_weights_from_tensor(state: State, body: dict) -> tuple[int, dict]:
    """sglang's `MultiprocessingSerializer` payload, one per server TP rank: base64 of a pickle of
    [(name, tensor)] (CUDA tensors as IPC handles, opened by unpickling); copied out, as sglang does."""
    import base64
    import pickle

    if body.get("load_format") is not None:
        return 400, {"success": False, "message": f"load_format {body['load_format']!r} is not the stand-in's"}
    ranks = [pickle.loads(base64.b64decode(entry)) for entry in body["serialized_named_tensors"]]
    if not ranks or any([n for n, _ in rank] != [n for n, _ in ranks[0]] for rank in ranks[1:]):
        return 400, {"success": False, "message": "every TP rank needs the same named tensors"}
    time.sleep(state.update_delay_s)
    with state.cond:
        state.weights.update((name, tensor.detach().to("cpu", copy=True)) for name, tensor in ranks[0])
        if body.get("weight_version") is not None:
            state.weight_version = str(body["weight_version"])
    return 200, {"success": True, "message": "Succeeded to update model weights."}


def handle(state: State, path: str, body: dict) -> tuple[int, dict]:
    if path == "/generate":
        return 200, generate(state, body)
    if path == "/init_weights_update_group":
        return 200, init_weights_update_group(state, body)  # blocks until every rank has joined
    if path == "/update_weights_from_distributed":
        return update_weights_from_distributed(state, body)
    if path == "/update_weights_from_tensor":
        return update_weights_from_tensor(state, body)
    with state.cond:
        if path == "/pause_generation":
            state.paused = True
            if body.get("mode", "abort") == "abort":
                for rid in state.running:
                    state.running[rid] = True
                state.cond.notify_all()
            return 200, {"success": True, "message": "Generation paused."}
        if path == "/continue_generation":
            state.paused = False
            state.cond.notify_all()
            return 200, {"success": True, "message": "Generation continued."}
        if path == "/abort_request":
            for rid in state.running:
                if body.get("abort_all") or rid.startswith(body.get("rid") or "\0"):  # prefix, as sglang
                    state.running[rid] = True
            state.cond.notify_all()
            return 200, {}
        if path == "/update_weight_version":
            state.weight_version = str(body["new_version"])
            return 200, {"success": True, "new_version": state.weight_version}
        if path == "/flush_cache":
            if state.running:
                return 400, {"success": False, "message": "Cache not flushed: requests are running."}
            return 200, {}
        if path in ("/release_memory_occupation", "/resume_memory_occupation"):
            state.released = path == "/release_memory_occupation"
            return 200, {"success": True}
    if path == "/update_weights_from_disk":
        time.sleep(state.update_delay_s)  # loading takes time; other servers keep generating meanwhile
        if not (Path(body.get("model_path", "")) / "config.json").is_file():
            return 400, {"success": False, "message": f"no model at {body.get('model_path')!r}"}
        with state.cond:
            if body.get("weight_version") is not None:
                state.weight_version = str(body["weight_version"])
        return 200, {"success": True, "message": "Succeeded to update model weights."}
    return 404, {"error": f"unknown endpoint {path}"}


def authorized(api_key: str | None, path: str, authorization: str | None) -> bool:
    """sglang's rule (`add_api_key_middleware`): health checks are open, the rest needs the bearer key."""
    if api_key is None or path.startswith("/health"):
        return True
    scheme, _, token = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token.encode(), api_key.encode())


def serve(args) -> None:
    state = State(args)

    class Handler(BaseHTTPRequestHandler):
        def _reply(self, status: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _refused(self) -> bool:
            if authorized(args.api_key, self.path, self.headers.get("Authorization")):
                return False
            self._reply(401, {"error": "Unauthorized"})
            return True

        def do_GET(self):  # noqa: N802 - http.server's naming
            if self._refused():
                return
            if self.path in ("/health", "/health_generate"):
                return self._reply(200, {})
            if self.path == "/get_weight_version":
                return self._reply(200, {"weight_version": state.weight_version})
            if self.path == "/fake/weights_digest":
                with state.cond:
                    received = [(n, t.numpy().tobytes()) for n, t in state.weights.items()]  # CPU tensors
                return self._reply(200, {"digest": weights_digest(received), "names": sorted(state.weights)})
            if self.path == "/fake/calls":
                with state.cond:
                    return self._reply(200, {"calls": list(state.calls)})
            return self._reply(404, {"error": f"unknown endpoint {self.path}"})

        def do_POST(self):  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            if self._refused():
                return
            with state.cond:
                recorded = dict(body)
                if "serialized_named_tensors" in body:  # the payload's size, not its bytes
                    recorded["serialized_named_tensors"] = [len(e) for e in body["serialized_named_tensors"]]
                state.calls.append({"path": self.path, "t": time.time(), "body": recorded})
                if state.calls_log:
                    with open(state.calls_log, "a") as log:
                        log.write(f"{args.port} {self.path}\n")
            try:
                status, payload = handle(state, self.path, body)
            except (ValueError, KeyError, RuntimeError) as exc:  # RuntimeError: torch.distributed's
                status, payload = 400, {"error": {"message": str(exc)}}
            self._reply(status, payload)

        def log_message(self, *args):  # quiet
            pass

    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    server.daemon_threads = True
    server.serve_forever()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--vocab-size", type=int, default=17)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--token-delay-s", type=float, default=0.002)
    parser.add_argument("--update-delay-s", type=float, default=0.2)
    parser.add_argument("--calls-log")
    parser.add_argument("--api-key", help="require it as sglang does (sglang's own flag)")
    # Started as `producers.sglang.launcher`, it receives sglang's own flags: accepted, not used.
    args, _sglang_flags = parser.parse_known_args()
    serve(args)
