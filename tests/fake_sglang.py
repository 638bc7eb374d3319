"""A loopback stand-in for an sglang server: the HTTP routes streamrl drives, with sglang's JSON shapes and
its refusals, and a toy model behind them (a seeded random distribution per weight version and context),
so the client's protocol can be tested without a GPU. Run as a script:

    python tests/fake_sglang.py --port 30001 [--token-delay-s 0.002] [--update-delay-s 0.5] [--api-key KEY]
                                [--tp-size 2] [--sglang-version 0.5.23] [--pause-poll-s 1.0] [--health-s 1.0]

It behaves as sglang 0.5.21–0.5.23 does (read from their source; `SERVED` lists its routes, each one
the real server has — `benchmarks/sglang_conformance.py` checks that):
- weight-update sessions: `/update_weights_from_tensor` and `/update_weights_from_distributed` are
  refused (400) outside `/begin_weight_update` … `/end_weight_update`; a second begin is refused;
- `/health` and `/health_generate` generate a token (≥ `--health-s`); on a paused server they wait
  at the pause gate and answer 503 after `--health-timeout-s`;
- `/pause_generation` ("abort") aborts the running requests and returns only once none runs, checking
  every `--pause-poll-s` (sglang: 1 s); a request that arrives while paused waits at the gate, out of
  reach of any abort, and runs after `/continue_generation` with the weights then loaded;
- `/release_memory_occupation` on a server that is running a request fails sglang's idle assertion,
  which ends the server (here: the process exits without answering);
- a load with `flush_cache` true (sglang's default) while a request runs changes the weights, then
  answers 400; `/flush_cache` answers 400 while a request runs;
- unknown `sampling_params` keys are refused (400); the tensor payloads are decoded with strict base64
  and unpickled by an allow-list (torch tensor rebuilds and plain containers; anything else is refused);
- with `--tp-size N` every TP rank joins an update group (rank = rank_offset + tp rank) and receives
  each broadcast, and a tensor load needs one payload per rank.
`GET /fake/calls` lists the calls in order; `GET /fake/weights_digest` is a sha256 over the received
names and bytes (`weights_digest`). With `--api-key`, as sglang: every path but `/health*` needs
`Authorization: Bearer KEY`, else 401 `{"error": "Unauthorized"}` (the refused request is not recorded).
torch is imported only when weights arrive by tensor or broadcast.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import math
import os
import pickle
import random
import secrets
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

SERVED = (  # (method, path) of every route served, as the real server has it; /fake/* are the tests' own
    ("POST", "/generate"), ("POST", "/abort_request"), ("POST", "/pause_generation"),
    ("POST", "/continue_generation"), ("POST", "/update_weight_version"), ("POST", "/begin_weight_update"),
    ("POST", "/end_weight_update"), ("POST", "/update_weights_from_disk"), ("POST", "/init_weights_update_group"),
    ("POST", "/destroy_weights_update_group"), ("POST", "/update_weights_from_distributed"),
    ("POST", "/update_weights_from_tensor"), ("POST", "/flush_cache"), ("POST", "/release_memory_occupation"),
    ("POST", "/resume_memory_occupation"), ("GET", "/health"), ("GET", "/health_generate"),
    ("GET", "/model_info"), ("GET", "/server_info"), ("GET", "/get_server_info"),
    ("GET", "/fake/calls"), ("GET", "/fake/weights_digest"),
)

SAMPLING_KEYS = {  # sglang's SamplingParams fields a request may set (0.5.22+ refuses any other)
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema", "regex",
    "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
    "stream_interval", "logit_bias", "sampling_seed", "custom_params"}

NOT_IN_SESSION = "{} must run between begin_weight_update() and end_weight_update()"
NOT_FLUSHED = ("Weights were updated, but the cache was not flushed because requests are still running or "
               "queued. Retract or finish them, then call /flush_cache.")


class ToyModel:
    def __init__(self, vocab_size: int, seed: int):
        self.vocab_size, self.seed = vocab_size, seed

    def distribution(self, version: str, context: list[int], temperature: float) -> list[float]:
        rng = random.Random(f"{self.seed}/{version}/{context[-2:]}")
        logits = [rng.gauss(0.0, 2.0) / max(temperature, 1e-6) for _ in range(self.vocab_size)]
        top = max(logits)
        weights = [math.exp(x - top) for x in logits]
        total = sum(weights)
        return [w / total for w in weights]


class State:
    def __init__(self, args):
        self.args = args
        self.model = ToyModel(args.vocab_size, args.seed)
        self.token_delay_s, self.update_delay_s = args.token_delay_s, args.update_delay_s
        self.calls_log = args.calls_log  # every POST appended as a line "PORT PATH" (see log_call)
        self.cond = threading.Condition()
        self.paused = False  # the tokenizer's gate: new requests wait while it is set
        self.released = False
        self.session = False  # a weight-update session is open
        self.weight_version = "default"
        self.running: dict[str, bool] = {}  # rid -> abort requested; only requests past the gate
        self.calls: list[dict] = []
        self.next_rid = 0
        self.groups: dict = {}  # group name -> [torch process group of each TP rank]
        self.weights: dict = {}  # name -> tensor received by broadcast or tensor handle


def log_call(state: State, what: str) -> None:
    """A line "PORT WHAT" of the calls log (`--calls-log`), for tests to read after a run."""
    if state.calls_log:
        with open(state.calls_log, "a") as log:
            log.write(f"{state.args.port} {what}\n")


def check_context_length(context: int, prompt: int, max_new: int) -> None:
    """sglang's tokenizer refuses, past its pause gate (`_validate_one_request` of 0.5.21 and 0.5.23), a
    prompt as long as the context and a prompt + max_new_tokens longer than it (no --allow-auto-truncate)."""
    if prompt >= context:
        raise ValueError(f"The input ({prompt} tokens) is longer than the model's context length ({context} tokens).")
    if prompt + max_new > context:
        raise ValueError(f"Requested token count exceeds the model's maximum context length of {context} tokens. "
                         f"You requested a total of {prompt + max_new} tokens: {prompt} tokens from the input "
                         f"messages and {max_new} tokens for the completion.")


def generate(state: State, body: dict) -> tuple[int, dict]:
    ids = body.get("input_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
        raise ValueError("input_ids must be a non-empty list of token ids")
    params = body.get("sampling_params") or {}
    unknown = sorted(set(params) - SAMPLING_KEYS)
    if unknown:
        return 400, {"error": {"message": f"Unexpected keyword argument {unknown[0]!r} in sampling_params"}}
    max_new = int(params.get("max_new_tokens", 128))
    stop_ids = set(params.get("stop_token_ids") or [])
    temperature = float(params.get("temperature", 1.0))
    with state.cond:
        rid = body.get("rid") or f"fake-{state.next_rid}"
        state.next_rid += 1
        # The tokenizer's gate: no abort reaches a request here. sglang holds a request that arrives while its
        # memory is released at this gate like any other (the client pauses before it releases, and a request
        # it sent before the pause may arrive after the release); it checks nothing about the memory.
        state.cond.wait_for(lambda: not state.paused)
        if state.released:  # let through while the memory is away: sglang's scheduler would run it without any
            raise ValueError("memory is released: resume_memory_occupation first")
        check_context_length(state.args.context_length, len(ids), max_new)
        state.running[rid] = False
        log_call(state, "generate:scheduled")  # past the gate (the calls log has its arrival as "/generate")
    rng = random.Random(f"{params.get('sampling_seed', 0)}/{rid}/{len(ids)}")
    context, out, logprobs, finish = list(ids), [], [], {"type": "length", "length": max_new}
    try:
        while len(out) < max_new:
            time.sleep(state.token_delay_s)
            with state.cond:
                if state.running[rid]:
                    finish = {"type": "abort", "message": "Abort before generation finished."}
                    break
                version = state.weight_version
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
            version = state.weight_version  # sglang fills it in when it answers
            state.cond.notify_all()
    return 200, {"output_ids": out, "meta_info": {
        "id": rid, "finish_reason": finish, "prompt_tokens": len(ids), "completion_tokens": len(out),
        "output_token_logprobs": logprobs, "weight_version": version}}


def health(state: State) -> int:
    """sglang's `/health` and `/health_generate`: a one-token request through the gate; 503 when nothing
    comes back within the timeout (a paused server holds it at the gate)."""
    deadline = time.monotonic() + state.args.health_timeout_s
    with state.cond:
        if not state.cond.wait_for(lambda: not state.paused, timeout=state.args.health_timeout_s):
            return 503
    time.sleep(min(state.args.health_s, max(0.0, deadline - time.monotonic())))
    return 200


def pause(state: State, body: dict) -> tuple[int, dict]:
    """Abort what runs, then wait, re-aborting every `pause_poll_s`, until nothing does (sglang's loop)."""
    with state.cond:
        state.paused = True
        if body.get("mode", "abort") != "abort":
            return 200, {"message": "Generation paused successfully.", "status": "ok"}
    while True:
        with state.cond:
            for rid in state.running:
                state.running[rid] = True
            if not state.running:
                return 200, {"message": "Generation paused successfully.", "status": "ok"}
        time.sleep(state.args.pause_poll_s)


def weights_digest(named_bytes) -> str:
    """sha256 over (name, raw bytes) pairs in name order: what the sender and the server compare."""
    import hashlib

    digest = hashlib.sha256()
    for name, data in sorted(named_bytes):
        digest.update(name.encode() + b"\0" + data)
    return digest.hexdigest()


def loaded(state: State, body: dict, update) -> tuple[int, dict]:
    """Apply `update` (under the lock), label the version, then flush as sglang does: a flush refused
    because a request runs fails the call after the weights changed."""
    with state.cond:
        update()
        if body.get("weight_version") is not None:
            state.weight_version = str(body["weight_version"])
        if body.get("flush_cache", True) and state.running:
            return 400, {"success": False, "message": NOT_FLUSHED}
    return 200, {"success": True, "message": "Succeeded to update model weights."}


def init_weights_update_group(state: State, body: dict) -> tuple[int, dict]:
    """Every TP rank joins (rank = rank_offset + tp rank), as sglang's do from their own processes; here
    each rank is a gloo backend of its own over the key layout torch gives a group named `group_name`
    (a registered group per rank would clash by name inside one process)."""
    import datetime

    import torch.distributed as dist

    offset, world, name = int(body["rank_offset"]), int(body["world_size"]), str(body["group_name"])
    if body.get("backend", "nccl") != "gloo":
        return 400, {"success": False, "message": "Failed to initialize custom process group: the stand-in "
                                                  "has no GPU (backend gloo only)."}
    if offset + state.args.tp_size > world:
        return 400, {"success": False, "message": f"Failed to initialize custom process group: ranks "
                                                  f"{offset}..{offset + state.args.tp_size - 1} outside world {world}."}
    timeout = datetime.timedelta(seconds=60)
    groups: list = [None] * state.args.tp_size

    def join(tp_rank: int) -> None:
        store = dist.TCPStore(body["master_address"], int(body["master_port"]), world, False, timeout=timeout)
        keys = dist.PrefixStore("cpu/", dist.PrefixStore(f"{name}/", dist.PrefixStore(name, store)))
        groups[tp_rank] = dist.ProcessGroupGloo(keys, offset + tp_rank, world, timeout)

    run_ranks(join, state.args.tp_size)
    with state.cond:
        state.groups[name] = groups
    return 200, {"success": True, "message": "Succeeded to initialize custom process group."}


def run_ranks(fn, tp_size: int) -> None:
    """fn(tp_rank) for every rank at once (they meet in collectives); the first error raises."""
    errors: list[BaseException] = []

    def rank(tp_rank: int) -> None:
        try:
            fn(tp_rank)
        except BaseException as exc:  # re-raised below, in the request's thread
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(tp_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise RuntimeError(str(errors[0])) from errors[0]


def destroy_weights_update_group(state: State, body: dict) -> tuple[int, dict]:
    with state.cond:
        groups = state.groups.pop(body.get("group_name", "weight_update_group"), None)
    if groups is None:
        return 400, {"success": False, "message": "The group to be destroyed does not exist."}
    return 200, {"success": True, "message": "Succeeded to destroy custom process group."}


def update_weights_from_distributed(state: State, body: dict) -> tuple[int, dict]:
    import torch

    with state.cond:  # refused before joining any broadcast: the sender's side waits until its group closes
        if not state.session:
            return 400, {"success": False, "message": NOT_IN_SESSION.format("update_weights_from_distributed")}
        groups = state.groups.get(body.get("group_name", "weight_update_group"))
    if groups is None:
        return 400, {"success": False, "message": f"Failed to receive weights: Group {body.get('group_name')} "
                                                  f"not in {list(state.groups)}."}
    time.sleep(state.update_delay_s)  # loading takes time; the sender's broadcast waits for it
    received: list[list] = [[] for _ in groups]

    def receive(tp_rank: int) -> None:
        tensors = [torch.empty(shape, dtype=getattr(torch, dtype))
                   for dtype, shape in zip(body["dtypes"], body["shapes"], strict=True)]
        for work in [groups[tp_rank].broadcast(t, 0) for t in tensors]:
            work.wait()
        received[tp_rank] = tensors

    run_ranks(receive, len(groups))
    return loaded(state, body, lambda: state.weights.update(zip(body["names"], received[0], strict=True)))


class AllowListUnpickler(pickle.Unpickler):
    """sglang's `SafeUnpickler` rule: only data containers and torch's tensor rebuilds; anything else
    (a callable that runs code) is refused."""

    ALLOWED = {("builtins", n) for n in ("bool", "bytearray", "bytes", "dict", "float", "int", "list", "set",
                                         "str", "tuple", "slice", "frozenset", "complex", "range")} | {
        ("collections", "OrderedDict"), ("torch", "Size"), ("torch", "device"), ("torch", "dtype"),
        ("torch._utils", "_rebuild_tensor"), ("torch._utils", "_rebuild_tensor_v2"),
        ("torch._utils", "_rebuild_parameter"), ("torch.nn.parameter", "Parameter"),
        ("torch.storage", "UntypedStorage"), ("torch.storage", "TypedStorage"),
        ("torch.multiprocessing.reductions", "rebuild_tensor"),
        ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
        ("torch.multiprocessing.reductions", "rebuild_storage_fd"),
        ("torch.multiprocessing.reductions", "rebuild_storage_filename"),
        ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
    } | {("torch", n) for n in ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int8", "uint8",
                                "bool", "FloatStorage", "HalfStorage", "BFloat16Storage", "LongStorage")}

    def find_class(self, module, name):
        if (module, name) == ("torch.storage", "_load_from_bytes"):  # as sglang: a weights-only load
            import torch

            return lambda data: torch.load(io.BytesIO(data), weights_only=True)
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise RuntimeError(f"Blocked unsafe global ({module}.{name}) during pickle deserialization")


def update_weights_from_tensor(state: State, body: dict) -> tuple[int, dict]:
    """sglang's `MultiprocessingSerializer` payloads, one per TP rank: strict base64 of a pickle of
    [(name, tensor)] (CUDA tensors as IPC handles, opened by unpickling); copied out, as sglang does."""
    with state.cond:
        if not state.session:
            return 400, {"success": False, "message": NOT_IN_SESSION.format("update_weights_from_tensor")}
    if body.get("load_format") is not None:
        return 400, {"success": False, "message": f"load_format {body['load_format']!r} is not the stand-in's"}
    payloads = body["serialized_named_tensors"]
    if len(payloads) != state.args.tp_size:
        return 400, {"success": False, "message": f"{len(payloads)} payloads for {state.args.tp_size} TP ranks"}
    ranks = [AllowListUnpickler(io.BytesIO(base64.b64decode(entry, validate=True))).load() for entry in payloads]
    if any([n for n, _ in rank] != [n for n, _ in ranks[0]] for rank in ranks[1:]):
        return 400, {"success": False, "message": "every TP rank needs the same named tensors"}
    time.sleep(state.update_delay_s)
    return loaded(state, body, lambda: state.weights.update(
        (name, tensor.detach().to("cpu", copy=True)) for name, tensor in ranks[0]))


def update_weights_from_disk(state: State, body: dict) -> tuple[int, dict]:
    time.sleep(state.update_delay_s)  # loading takes time; other servers keep generating meanwhile
    if not (Path(body.get("model_path", "")) / "config.json").is_file():
        return 400, {"success": False, "message": f"no model at {body.get('model_path')!r}"}
    return loaded(state, body, lambda: None)


def session(state: State, path: str) -> tuple[int, dict]:
    with state.cond:
        if path == "/begin_weight_update":
            if state.session:
                return 400, {"success": False, "message": "a weight-update session is already open; "
                                                          "call end_weight_update() first"}
            state.session = True
        else:
            if not state.session:
                return 400, {"success": False, "message": "no weight-update session is open; "
                                                          "call begin_weight_update() first"}
            state.session = False
    return 200, {"success": True, "message": "Success"}


def release(state: State) -> tuple[int, dict]:
    with state.cond:
        if state.running:  # sglang: `assert is_fully_idle()` in the scheduler, which then dies, and the server
            os._exit(1)
        state.released = True
    return 200, {}


def handle(state: State, path: str, body: dict) -> tuple[int, dict]:
    if path == "/generate":
        return generate(state, body)
    if path == "/pause_generation":
        return pause(state, body)
    if path in ("/begin_weight_update", "/end_weight_update"):
        return session(state, path)
    if path == "/init_weights_update_group":
        return init_weights_update_group(state, body)  # blocks until every rank has joined
    if path == "/destroy_weights_update_group":
        return destroy_weights_update_group(state, body)
    if path == "/update_weights_from_distributed":
        return update_weights_from_distributed(state, body)
    if path == "/update_weights_from_tensor":
        return update_weights_from_tensor(state, body)
    if path == "/update_weights_from_disk":
        return update_weights_from_disk(state, body)
    if path == "/release_memory_occupation":
        return release(state)
    with state.cond:
        if path == "/continue_generation":
            state.paused = False
            state.cond.notify_all()
            return 200, {"message": "Generation continued successfully.", "status": "ok"}
        if path == "/abort_request":  # reaches running requests only (not those at the gate)
            for rid in state.running:
                if body.get("abort_all") or rid.startswith(body.get("rid") or "\0"):  # prefix, as sglang
                    state.running[rid] = True
            state.cond.notify_all()
            return 200, {}
        if path == "/update_weight_version":
            if body.get("abort_all_requests", True):
                for rid in state.running:
                    state.running[rid] = True
            state.weight_version = str(body["new_version"])
            return 200, {"success": True, "message": f"Weight version updated to {state.weight_version}",
                         "new_version": state.weight_version}
        if path == "/flush_cache":
            if state.running:
                return 400, {"message": "Flush cache failed.\n"}
            return 200, {}
        if path == "/resume_memory_occupation":
            state.released = False
            return 200, {}
    return 404, {"detail": "Not Found"}


def authorized(api_key: str | None, path: str, authorization: str | None) -> bool:
    """sglang's rule (`decide_request_auth`): health checks are open, the rest needs the bearer key."""
    if api_key is None or path.startswith("/health"):
        return True
    scheme, _, token = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token.encode(), api_key.encode())


def serve(args) -> None:
    state = State(args)
    served = {path for method, path in SERVED if method == "POST"}

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
                return self._reply(health(state), {})
            if self.path == "/model_info":
                return self._reply(200, {"model_path": args.model_path, "weight_version": state.weight_version,
                                         "is_generation": True})
            if self.path in ("/server_info", "/get_server_info"):
                return self._reply(200, {"version": args.sglang_version, "tp_size": args.tp_size})
            if self.path == "/fake/weights_digest":
                with state.cond:
                    received = [(n, t.numpy().tobytes()) for n, t in state.weights.items()]  # CPU tensors
                return self._reply(200, {"digest": weights_digest(received), "names": sorted(state.weights)})
            if self.path == "/fake/calls":
                with state.cond:
                    return self._reply(200, {"calls": list(state.calls)})
            return self._reply(404, {"detail": "Not Found"})

        def do_POST(self):  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            if self._refused():
                return
            if self.path not in served:
                return self._reply(404, {"detail": "Not Found"})
            with state.cond:
                recorded = dict(body)
                if "serialized_named_tensors" in body:  # the payload's size, not its bytes
                    recorded["serialized_named_tensors"] = [len(e) for e in body["serialized_named_tensors"]]
                state.calls.append({"path": self.path, "t": time.time(), "body": recorded})
                log_call(state, self.path)
            try:
                status, payload = handle(state, self.path, body)
            except (ValueError, KeyError, RuntimeError, pickle.UnpicklingError) as exc:  # RuntimeError: torch's
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
    parser.add_argument("--context-length", type=int, default=32768, help="the model's max_position_embeddings")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--token-delay-s", type=float, default=0.002)
    parser.add_argument("--update-delay-s", type=float, default=0.2)
    parser.add_argument("--pause-poll-s", type=float, default=1.0, help="sglang re-aborts once a second")
    parser.add_argument("--health-s", type=float, default=1.0, help="sglang's health check sleeps 1 s first")
    parser.add_argument("--health-timeout-s", type=float, default=20.0)
    parser.add_argument("--sglang-version", default="0.5.23", help="what /server_info reports")
    parser.add_argument("--calls-log")
    # sglang's own flags, used as sglang uses them
    parser.add_argument("--api-key", help="require it as sglang does")
    parser.add_argument("--tp-size", "--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--model-path", default="")
    # Started as `producers.sglang.launcher`, it receives sglang's other flags: accepted, not used.
    args, _sglang_flags = parser.parse_known_args()
    serve(args)
