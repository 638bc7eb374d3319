"""What streamrl asks of an sglang server, in one place: every route, method and request field the
client sends, every sampling key, every launch flag, and the response keys it reads.

The versions in `SUPPORTED` are the ones this protocol was read against (their source, not their
documentation): `benchmarks/sglang_conformance.py` downloads a wheel and checks every entry here
against its route table, request structs and server arguments, and the client refuses a server
outside the range at start-up (`check_server_version`). The stand-in (`tests/fake_sglang.py`) serves
no route that is missing here.

Facts of the supported versions that shape the client (read in 0.5.21–0.5.23):
- `/update_weights_from_tensor` and `/update_weights_from_distributed` are refused (400) outside a
  session that `/begin_weight_update` opens and `/end_weight_update` closes; a second begin fails.
- `/health` and `/health_generate` share one handler that generates a token (≥ 1 s; a paused server
  holds it at its pause gate and answers 503 after 20 s): liveness is asked of `/model_info`.
- `/pause_generation` in "abort" mode aborts what the scheduler runs, once a second, until no request
  holds the engine; a request arriving meanwhile waits at the tokenizer's gate (no abort reaches it)
  and runs after `/continue_generation`, reporting the weight version then in force.
- A load with `flush_cache = true` answers 400 *after* the weights changed when the cache cannot be
  flushed: streamrl loads without it and flushes afterwards.
- Returned log-probs are of `log_softmax(logits / temperature)` before top-p/top-k: behaviour
  log-probs only with top-p = 1 and top-k = -1.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

SUPPORTED = ((0, 5, 21), (0, 6, 0))  # [lowest, first refused): the `gpu` extra pins the same range
REQUIREMENT = "sglang>=0.5.21,<0.6"


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    request: str | None  # the request struct in sglang/srt/managers/io_struct.py the body is read into
    fields: tuple[str, ...] = ()  # the body's keys that streamrl sends


ROUTES = (
    Route("POST", "/generate", "GenerateReqInput",
          ("input_ids", "sampling_params", "return_logprob", "logprob_start_len", "rid")),
    Route("POST", "/abort_request", "AbortReq", ("rid", "abort_all")),
    Route("POST", "/pause_generation", "PauseGenerationReqInput", ("mode",)),
    Route("POST", "/continue_generation", "ContinueGenerationReqInput"),
    Route("POST", "/update_weight_version", "UpdateWeightVersionReqInput", ("new_version", "abort_all_requests")),
    Route("POST", "/begin_weight_update", "BeginWeightUpdateReqInput"),
    Route("POST", "/end_weight_update", "EndWeightUpdateReqInput"),
    Route("POST", "/update_weights_from_disk", "UpdateWeightFromDiskReqInput",
          ("model_path", "load_format", "flush_cache")),
    Route("POST", "/init_weights_update_group", "InitWeightsUpdateGroupReqInput",
          ("master_address", "master_port", "rank_offset", "world_size", "group_name", "backend")),
    Route("POST", "/destroy_weights_update_group", "DestroyWeightsUpdateGroupReqInput", ("group_name",)),
    Route("POST", "/update_weights_from_distributed", "UpdateWeightsFromDistributedReqInput",
          ("names", "dtypes", "shapes", "group_name", "flush_cache")),
    Route("POST", "/update_weights_from_tensor", "UpdateWeightsFromTensorReqInput",
          ("serialized_named_tensors", "load_format", "flush_cache")),
    Route("POST", "/flush_cache", None),
    Route("POST", "/release_memory_occupation", "ReleaseMemoryOccupationReqInput"),
    Route("POST", "/resume_memory_occupation", "ResumeMemoryOccupationReqInput"),
    Route("GET", "/model_info", None),  # liveness (no generation) and the weight version in force
    Route("GET", "/server_info", None),  # the server's version, checked at start-up
    Route("GET", "/health_generate", None),  # readiness at start-up: one generated token
)

# sglang/srt/sampling/sampling_params.py: SamplingParams; from 0.5.22 `/generate` is first validated against
# sglang/api/v1/api_types.py, whose SamplingParams refuses unknown keys (400)
SAMPLING_KEYS = ("max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "skip_special_tokens",
                 "no_stop_trim", "sampling_seed")

# `python -m sglang.launch_server` flags `ServerSpec.command` may pass
LAUNCH_FLAGS = ("--model-path", "--host", "--port", "--tp-size", "--mem-fraction-static", "--random-seed",
                "--api-key", "--skip-tokenizer-init", "--base-gpu-id", "--enable-memory-saver",
                "--enable-weights-cpu-backup")

# response keys read, and the source file (under sglang/srt/) whose string literals must hold them
RESPONSE_KEYS = {
    "managers/tokenizer_manager.py": ("meta_info", "output_token_logprobs", "finish_reason", "weight_version"),
    "entrypoints/http_server.py": ("version", "weight_version"),
}


def route(path: str) -> Route:
    for candidate in ROUTES:
        if candidate.path == path:
            return candidate
    raise KeyError(f"{path} is not a route streamrl uses (streamrl/sglang/protocol.py)")


def parse_version(text: str) -> tuple[int, ...]:
    """"0.5.23" / "0.5.15.post1" / "0.5.22rc1+cu128" → (0, 5, 23) …: the numeric release part."""
    match = re.match(r"\s*v?(\d+(?:\.\d+)*)", str(text))
    if match is None:
        raise ValueError(f"not a version: {text!r}")
    return tuple(int(part) for part in match.group(1).split("."))


def check_server_version(text: str, url: str = "the sglang server") -> tuple[int, ...]:
    """The server's version, or ValueError naming the supported range."""
    version = parse_version(text)
    lowest, refused = SUPPORTED
    if not lowest <= version < refused:
        raise ValueError(f"{url} runs sglang {text}; streamrl speaks the protocol of {REQUIREMENT} "
                         f"(install it with `pip install \"streamrl[gpu]\"`)")
    return version
