"""Connecting to Ray: a local instance that only this machine can reach, or a running cluster.

```
 start_local ─► ray.init(node address 127.0.0.1, no dashboard) ─► every Ray server binds loopback
 join_cluster(address) ─► "auto": the cluster running here ─► probe its GCS once, without a token
     answers ─────────────────────────────────────────────────► ray.init(address)
     wants a token ─► Ray's token found ─► probe with it ─ ok ─► ray.init(address), token sent from now on
                      none / refused ─► RayConnectError (one line: what is missing or wrong)
     silent ─► RayConnectError
```
A cluster started with `ray start --head` and a token (RAY_AUTH_MODE=token, or a token file present)
refuses clients without it. Ray's own `ray.init(address=HOST:PORT)` sends the token only when
RAY_AUTH_MODE=token is set, and on a refusal it retries for ~20 s and then says only "Failed to
connect"; the probe answers in a fraction of a second and names what is missing. The token is sent
only to a cluster that asks for it: a client in token mode cannot create actors on a cluster without
token authentication.

Ray reads the token from, in this order: the RAY_AUTH_TOKEN environment variable, the file named by
RAY_AUTH_TOKEN_PATH, then ~/.ray/auth_token (which a local `ray.init()` creates when it is missing).
A cluster on a loopback address is joined on loopback too; joining any other, the driver listens on
all interfaces, since the cluster's workers call back to it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import ray

from streamrl.net import LOOPBACK, cluster_address_problem, is_loopback

AUTH_MODE_VAR, TOKEN_VAR, TOKEN_PATH_VAR = "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"
DEFAULT_TOKEN_FILE = Path("~/.ray/auth_token")


class RayConnectError(RuntimeError):
    """Ray cannot be reached or refuses this client; the message says why in one line."""


@contextmanager
def _node_on_loopback() -> Iterator[None]:
    """Keep this node's address 127.0.0.1 while Ray starts or joins.

    Ray replaces a loopback node address (and a loopback cluster address) with the machine's network
    address unless it runs with clusters disabled, as it does on macOS; its servers (GCS, raylet,
    workers, agents, metrics exporters) then bind that address or all interfaces. With the node
    address left at 127.0.0.1 every one of them binds loopback. Ray reads the switch when it is
    imported, so it is flipped on the module, for the duration of the call.
    """
    from ray._private import ray_constants

    saved = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved


def start_local(num_cpus: int | None = None, **init_kwargs: Any) -> None:
    """Start a single-node Ray instance reachable from this machine only (no dashboard)."""
    with _node_on_loopback():  # "local": a new instance even where `ray start` left a cluster to join
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, _node_ip_address=LOOPBACK,
                 **init_kwargs)
    node_ip = ray.util.get_node_ip_address()
    if not is_loopback(node_ip):  # a Ray release that ignores the switch above: refuse rather than expose
        ray.shutdown()
        raise RayConnectError(f"the local Ray instance came up on {node_ip}, not loopback; refusing to run on it")


def join_cluster(address: str, **init_kwargs: Any) -> None:
    """Join the running cluster at `address` (HOST:PORT, ray://HOST:PORT, or `auto`: RAY_ADDRESS, else the
    one started on this machine)."""
    resolved = _resolve(address)  # checked; `auto`'s RAY_ADDRESS may name a Ray Client server (ray://)
    if resolved.startswith("ray://"):  # Ray Client: its server on the head node does the connecting
        try:
            ray.init(address=resolved, **init_kwargs)
        except ConnectionError as exc:
            raise RayConnectError(f"cannot connect to the Ray client server at {resolved}: {exc}") from exc
        return
    gcs_address = resolved
    host = gcs_address.rsplit(":", 1)[0]
    with _node_on_loopback() if is_loopback(host) else nullcontext():
        _check_token(gcs_address)
        try:
            ray.init(address=gcs_address, **init_kwargs)
        except ConnectionError as exc:
            raise RayConnectError(f"cannot connect to the Ray cluster at {gcs_address}: {exc}") from exc


def local_cluster_addresses() -> list[str]:
    """GCS addresses (HOST:PORT) of the Ray instances on this machine, `RAY_ADDRESS` alone where it is set:
    the cluster `ray start` last started first, then every other one in a fixed order (each `streamrl
    launch` without an address starts an instance of its own, which `auto` picks among at random)."""
    from ray._private.services import find_bootstrap_address, find_gcs_addresses

    named = os.environ.get("RAY_ADDRESS")
    if named:
        return [named]
    latest = find_bootstrap_address(None)
    return [address for address in [latest, *sorted(set(find_gcs_addresses()) - {latest})] if address]


def _resolve(address: str) -> str:
    """`address` checked, `auto` resolved: RAY_ADDRESS (HOST:PORT or ray://HOST:PORT), else the GCS of the
    cluster `ray start` ran here."""
    from ray._private.services import get_ray_address_from_environment

    resolved = address
    if address == "auto":
        try:
            resolved = get_ray_address_from_environment(address, None)
        except ConnectionError as exc:
            raise RayConnectError("no running Ray cluster found on this machine: start the run first, "
                                  "or pass --address HOST:PORT") from exc
    if resolved is None:
        raise RayConnectError(f"not a Ray cluster address: {address!r} (expected HOST:PORT or auto)")
    problem = cluster_address_problem(resolved)
    if problem is not None:  # Ray's own client raises ValueError on some, or waits on a port that cannot be
        raise RayConnectError(problem if resolved == address else f"{problem}, found for {address!r}")
    return resolved


def token_source() -> str | None:
    """Where Ray will read the token from (its own order), or None when it has none."""
    if os.environ.get(TOKEN_VAR):
        return TOKEN_VAR
    named = os.environ.get(TOKEN_PATH_VAR)
    if named:  # Ray reads this file and no other
        return f"{TOKEN_PATH_VAR}={named}" if _holds_token(Path(named).expanduser()) else None
    return str(DEFAULT_TOKEN_FILE) if _holds_token(DEFAULT_TOKEN_FILE.expanduser()) else None


def _holds_token(path: Path) -> bool:
    return path.is_file() and bool(path.read_text().strip())


def _no_token(why: str) -> RayConnectError:
    named = os.environ.get(TOKEN_PATH_VAR)
    if named:
        return RayConnectError(f"{why} but {TOKEN_PATH_VAR}={named} names no file holding one")
    return RayConnectError(f"{why} and none was found: set {TOKEN_VAR}, or {TOKEN_PATH_VAR} to a file holding "
                           f"it, or write it to {DEFAULT_TOKEN_FILE} (`ray get-auth-token` on the head node prints it)")


def _token_mode_on() -> bool:
    from ray._raylet import AuthenticationMode, get_authentication_mode

    return get_authentication_mode() == AuthenticationMode.TOKEN


def _enable_token_mode() -> None:
    """Send Ray's token from now on, in this process and the ones it starts (Ray's own switch)."""
    from ray._raylet import Config

    os.environ[AUTH_MODE_VAR] = "token"
    Config.initialize("")  # Ray caches its config: re-read RAY_AUTH_MODE


def _probe(gcs_address: str) -> bool:
    """True when the GCS answers this client; False when it refuses it for want of the right token."""
    from ray._raylet import GcsClient
    from ray.exceptions import AuthenticationError, RpcError

    try:
        with _stderr_silenced():
            GcsClient(address=gcs_address)  # asks for the cluster id: one authenticated RPC
    except AuthenticationError:
        return False
    except RpcError as exc:
        raise RayConnectError(f"cannot reach a Ray cluster at {gcs_address}: {exc}") from exc
    return True


@contextmanager
def _stderr_silenced() -> Iterator[None]:
    """Ray's C++ client logs each refused or failed attempt straight to file descriptor 2; the probe's
    caller reports the outcome in one line of its own."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _check_token(gcs_address: str) -> None:
    cluster = f"the Ray cluster at {gcs_address}"
    if _token_mode_on() and token_source() is None:  # Ray would abort this process at its first request
        raise _no_token(f"{AUTH_MODE_VAR}=token asks for a token")
    if _probe(gcs_address):
        return
    if not _token_mode_on() and os.environ.get(AUTH_MODE_VAR):  # explicitly off: respected, as Ray does
        raise RayConnectError(f"{cluster} requires a token but {AUTH_MODE_VAR}={os.environ[AUTH_MODE_VAR]}: "
                              "unset it or set it to 'token'")
    source = token_source()
    if source is None:
        raise _no_token(f"{cluster} requires a token")
    if not _token_mode_on():
        _enable_token_mode()
        if _probe(gcs_address):
            return
    raise RayConnectError(f"{cluster} rejected the token from {source}")
