"""sglang's HTTP endpoints, one method each (token ids in, token ids out).

Shapes follow sglang's `http_server.py` / `io_struct.py` for the versions `protocol.SUPPORTED` names (every
route and field used here is listed in `protocol.py` and checked against the real source by
`benchmarks/sglang_conformance.py`). A non-2xx answer raises `SglangError` with the server's message, a
server that cannot be reached, or whose connection breaks under a request, raises `EngineUnreachable` (the
caller restarts it), and one that takes the connection but does not answer within the request's timeout
raises `EngineTimeout` (a busy server is alive: restarting it would not help). With an API key every
request carries `Authorization: Bearer KEY`, which a server started with `--api-key` requires (401
without it). Control calls (weights, pause, memory) are blocking, over the standard library; `/generate`
and the abort of one request are also offered as coroutines (`generate_async`, `abort_async`, aiohttp),
so that one event loop keeps hundreds of samples in flight, and stops them, without a thread each.
"""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

ABORT_TIMEOUT_S = 30.0  # an abort a server does not answer in this long is given up: the request ends anyway


class SglangError(RuntimeError):
    """The server answered, with an error (or, `EngineTimeout`, did not answer in time)."""


class EngineUnreachable(ConnectionError):
    """The server did not answer: it died, or never started."""


class EngineTimeout(SglangError, TimeoutError):
    """The server took the request but did not answer within its timeout: it may be alive and busy (or
    stuck), so this is not `EngineUnreachable`."""


@dataclass
class Segment:
    """What one `/generate` call produced: a whole response, or its prefix when aborted."""

    tokens: list[int]
    logprobs: list[float]
    finish: str  # "stop", "length" or "abort"
    weight_version: str | None  # the version of the weights that generated every token of it


class SglangClient:
    def __init__(self, url: str, *, api_key: str | None = None, timeout_s: float = 3600.0):
        parts = urlsplit(url)
        self.url, self.host, self.port = url, parts.hostname or "127.0.0.1", parts.port or 80
        self.api_key = api_key
        self.timeout_s = timeout_s
        self._session = None  # generate_async's aiohttp session, made in its event loop

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.api_key is not None:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    def call(self, path: str, payload: dict[str, Any] | None = None, *, method: str = "POST",
             timeout_s: float | None = None) -> dict[str, Any]:
        timeout = timeout_s or self.timeout_s
        connection = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            try:
                connection.connect()
            except OSError as exc:  # refused, no route, or no connection in time: nothing serves there
                raise EngineUnreachable(f"sglang server {self.url}{path}: {exc}") from exc
            try:
                body = None if payload is None else json.dumps(payload)
                connection.request(method, path, body=body, headers=self._headers())
                response = connection.getresponse()
                data = response.read()
            except TimeoutError as exc:  # connected, then silence: the server may well be alive
                raise EngineTimeout(f"sglang server {self.url}{path}: no answer within {timeout:g} s") from exc
            except (http.client.HTTPException, OSError) as exc:  # the connection broke under the request
                raise EngineUnreachable(f"sglang server {self.url}{path}: {exc}") from exc
        finally:
            connection.close()
        return self._answer(path, response.status, data)

    def _answer(self, path: str, status: int, data: bytes) -> dict[str, Any]:
        try:
            answer = json.loads(data) if data else {}
        except ValueError:  # a plain-text error page (e.g. uvicorn's 500)
            answer = {"message": data[:200].decode(errors="replace")}
        if status >= 300 or (isinstance(answer, dict) and answer.get("success") is False):
            raise SglangError(f"sglang server {self.url}{path} answered {status}: {_message(answer)}")
        return answer

    # ---- generation ------------------------------------------------------------------------------------
    def generate(self, input_ids: list[int], *, max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
                 stop_token_ids: list[int] | None = None, rid: str | None = None, seed: int | None = None
                 ) -> Segment:
        payload = _generate_payload(input_ids, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                    stop_token_ids=stop_token_ids, rid=rid, seed=seed)
        return _segment(self.call("/generate", payload))

    async def generate_async(self, input_ids: list[int], *, max_new_tokens: int, temperature: float = 1.0,
                             top_p: float = 1.0, stop_token_ids: list[int] | None = None, rid: str | None = None,
                             seed: int | None = None) -> Segment:
        """`generate` as a coroutine of the calling event loop (one connection pool per client and loop)."""
        payload = _generate_payload(input_ids, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                    stop_token_ids=stop_token_ids, rid=rid, seed=seed)
        return _segment(await self._call_async("/generate", payload))

    async def abort_async(self, rid: str) -> None:
        """`abort(rid)` as a coroutine: a cancelled sample's request ends on the server without a thread."""
        await self._call_async("/abort_request", {"rid": rid, "abort_all": False}, timeout_s=ABORT_TIMEOUT_S)

    async def _call_async(self, path: str, payload: dict[str, Any], timeout_s: float | None = None
                          ) -> dict[str, Any]:
        import aiohttp  # here: the blocking calls (and the GPU smoke test's machine) need no aiohttp

        timeout = timeout_s or self.timeout_s

        if self._session is None:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                                  timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        try:
            async with self._session.post(f"http://{self.host}:{self.port}{path}", json=payload,
                                          headers=self._headers(),
                                          timeout=aiohttp.ClientTimeout(total=timeout)) as response:
                status, data = response.status, await response.read()
        except aiohttp.ConnectionTimeoutError as exc:  # a TimeoutError too, but it never connected
            raise EngineUnreachable(f"sglang server {self.url}{path}: {exc!r}") from exc
        except TimeoutError as exc:
            raise EngineTimeout(f"sglang server {self.url}{path}: no answer within {timeout:g} s") from exc
        except (aiohttp.ClientError, OSError) as exc:  # refused, broken, or not HTTP (as `call`'s HTTPException)
            raise EngineUnreachable(f"sglang server {self.url}{path}: {exc!r}") from exc
        return self._answer(path, status, data)

    async def close_async(self) -> None:
        """Close `generate_async`'s connections (in the loop that made them)."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    def abort(self, rid: str | None = None) -> None:
        """Abort one request (sglang matches ids by prefix: use fixed-width ids) or, without `rid`, all."""
        self.call("/abort_request", {"rid": rid or "", "abort_all": rid is None})

    # ---- weights ---------------------------------------------------------------------------------------
    def pause_generation(self, mode: str = "abort") -> None:
        """"abort": running requests end now and return what they made (their callers continue them
        once generation resumes, with the new weights). Blocks until no request holds the engine (the
        server re-aborts once a second); a request sent meanwhile waits at the server's gate and runs
        after `continue_generation`."""
        self.call("/pause_generation", {"mode": mode})

    def continue_generation(self) -> None:
        self.call("/continue_generation", {})

    def update_weight_version(self, version: int | str) -> None:
        # abort_all_requests defaults to true in sglang; the caller has already paused
        self.call("/update_weight_version", {"new_version": str(version), "abort_all_requests": False})

    def begin_weight_update(self) -> None:
        """Open the session that `/update_weights_from_tensor` and `/update_weights_from_distributed`
        require (sglang ≥ 0.5.21 refuses them outside one); a second begin without an end is refused."""
        self.call("/begin_weight_update", {})

    def end_weight_update(self) -> None:
        self.call("/end_weight_update", {})

    @contextmanager
    def weight_update_session(self) -> Iterator[None]:
        """begin … end around a version's loads; ended on failure too (an open session refuses the next begin)."""
        self.begin_weight_update()
        try:
            yield
        finally:
            self.end_weight_update()

    def update_weights_from_disk(self, model_path: str) -> None:
        # flush_cache false: sglang flushes after the load and answers 400 when it cannot, with the new
        # weights already in; the caller flushes on its own, once the version label matches them
        self.call("/update_weights_from_disk", {"model_path": model_path, "load_format": "auto", "flush_cache": False})

    def init_weights_update_group(self, *, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str, backend: str = "nccl",
                                  timeout_s: float | None = None) -> None:
        """The server's ranks join a process group with the caller (who must join too, concurrently)."""
        self.call("/init_weights_update_group", {"master_address": master_address, "master_port": master_port,
                                                 "rank_offset": rank_offset, "world_size": world_size,
                                                 "group_name": group_name, "backend": backend}, timeout_s=timeout_s)

    def destroy_weights_update_group(self, group_name: str, timeout_s: float = 30.0) -> None:
        """The server leaves the group (a failed load leaves it joined otherwise)."""
        self.call("/destroy_weights_update_group", {"group_name": group_name}, timeout_s=timeout_s)

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]], *,
                                        group_name: str, timeout_s: float | None = None) -> None:
        """Announce one bucket the group's rank 0 broadcasts (each tensor, in this order); it answers
        once the server has received and loaded them. Inside a weight-update session."""
        self.call("/update_weights_from_distributed", {"names": names, "dtypes": dtypes, "shapes": shapes,
                                                       "group_name": group_name, "flush_cache": False},
                  timeout_s=timeout_s)

    def update_weights_from_tensor(self, serialized_named_tensors: list[str]) -> None:
        """Tensors serialised in sglang's `MultiprocessingSerializer` form, one payload per server TP rank
        (CUDA tensors as IPC handles). Inside a weight-update session."""
        self.call("/update_weights_from_tensor", {"serialized_named_tensors": serialized_named_tensors,
                                                  "load_format": None, "flush_cache": False})

    # ---- memory (colocated with the trainer, torch-memory-saver) ----------------------------------------
    def release_memory_occupation(self) -> None:
        """sglang asserts its scheduler is idle (a failed assertion ends the server): pause and flush first."""
        self.call("/release_memory_occupation", {})

    def resume_memory_occupation(self) -> None:
        self.call("/resume_memory_occupation", {})

    # ---- state --------------------------------------------------------------------------------------------
    def model_info(self, timeout_s: float = 5.0) -> dict[str, Any]:
        return self.call("/model_info", method="GET", timeout_s=timeout_s)

    def alive(self) -> bool:
        """The server answers (`/model_info`: it generates nothing, so a paused server is alive too —
        `/health` runs a generation, which a paused server holds until it reports itself unhealthy)."""
        return self._answers("/model_info", timeout_s=5.0)

    def server_version(self) -> str:
        """The sglang version the server runs (`/server_info`)."""
        return str(self.call("/server_info", method="GET", timeout_s=30.0)["version"])

    def flush_cache(self, attempts: int = 50, wait_s: float = 0.1) -> None:
        """Empty the radix cache; sglang refuses (400) while requests are running or queued, so retry."""
        for _ in range(attempts):
            try:
                self.call("/flush_cache", {})
                return
            except EngineTimeout:
                raise  # not a refusal: the flush did not answer
            except SglangError:
                time.sleep(wait_s)
        raise SglangError(f"sglang server {self.url}/flush_cache: still busy after {attempts} attempts")

    def healthy(self) -> bool:
        """`/health_generate`: a one-token generation (≥ 1 s on sglang): ready to generate."""
        return self._answers("/health_generate", timeout_s=30.0)

    def _answers(self, path: str, *, timeout_s: float) -> bool:
        try:
            self.call(path, method="GET", timeout_s=timeout_s)
            return True
        except (EngineUnreachable, SglangError):
            return False


def _generate_payload(input_ids: list[int], *, max_new_tokens: int, temperature: float, top_p: float,
                      stop_token_ids: list[int] | None, rid: str | None, seed: int | None) -> dict[str, Any]:
    sampling = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p, "top_k": -1,
                "stop_token_ids": stop_token_ids or [], "skip_special_tokens": False, "no_stop_trim": True}
    if seed is not None:
        sampling["sampling_seed"] = seed
    payload: dict[str, Any] = {"input_ids": input_ids, "sampling_params": sampling, "return_logprob": True,
                               "logprob_start_len": -1}  # log-probs of the output tokens only
    if rid is not None:
        payload["rid"] = rid
    return payload


def _segment(answer: dict[str, Any]) -> Segment:
    meta = answer["meta_info"]
    # The tokens come from the log-prob entries [logprob, token_id, text]: some 0.5.x builds prefix
    # `output_ids` with prompt tokens (sglang issues #10896, #17240).
    entries = meta.get("output_token_logprobs") or []
    missing = [i for i, entry in enumerate(entries) if entry[0] is None]
    if missing:  # sglang leaves a log-prob null where it did not compute one: no behaviour log-prob to train on
        raise SglangError(f"sglang returned no log-prob for output tokens {missing[:8]} of request "
                          f"{meta.get('id')!r}; streamrl needs one for every sampled token")
    return Segment(tokens=[int(entry[1]) for entry in entries], logprobs=[float(entry[0]) for entry in entries],
                   finish=str(meta["finish_reason"]["type"]) if meta.get("finish_reason") else "abort",
                   weight_version=meta.get("weight_version"))


def _message(answer: Any) -> str:
    if isinstance(answer, dict):
        error = answer.get("error")
        if isinstance(error, dict):
            return str(error.get("message", error))
        return str(answer.get("message") or error or answer)
    return str(answer)
