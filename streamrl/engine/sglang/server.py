"""An sglang server as a child process of its producer: started, health-checked, restarted, stopped.

The producer owns its servers (one per GPU group): each runs under a guard (`guard.py`) that ends it
when the producer's process is gone, in its own process group so that stopping it stops its scheduler
and detokenizer children too; a server that dies is restarted by its producer while the other
servers keep generating.

Each server binds loopback (unless `producers.sglang.host` says otherwise) and gets a random API key
of its own (sglang's `--api-key`): every endpoint but `/health*` wants `Authorization: Bearer KEY`,
so a client that only knows the port (a web page reaching localhost, a process of a container
sharing the network, a host elsewhere when the servers bind a public address) cannot generate or
load weights. The producer that started the server holds the key (the same across restarts); it is
kept out of reprs and error messages, but sits on the server's command line, which the machine's
own users can read.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class ServerSpec:
    """How to start one server: `python -m sglang.launch_server` with these settings."""

    model_path: str
    host: str = "127.0.0.1"  # loopback unless the engines must be reached from another node
    port: int = 30000
    tensor_parallel: int = 1
    mem_fraction: float = 0.8
    base_gpu_id: int = 0  # the first of the producer's GPUs this server uses (several servers per producer)
    memory_saver: bool = False  # torch-memory-saver: release and resume when colocated with the trainer
    seed: int = 0
    extra_args: list[str] = field(default_factory=list)
    launcher: list[str] | None = None  # the command before the flags; None: python -m sglang.launch_server
    # hex: a key starting with "-" would be read by the server's argparse as another flag
    api_key: str = field(default_factory=lambda: secrets.token_hex(32), repr=False)

    def command(self) -> list[str]:
        launcher = self.launcher or [sys.executable, "-m", "sglang.launch_server"]
        command = [*launcher, "--model-path", self.model_path,
                   "--host", self.host, "--port", str(self.port), "--tp-size", str(self.tensor_parallel),
                   "--mem-fraction-static", str(self.mem_fraction), "--random-seed", str(self.seed),
                   "--api-key", self.api_key,
                   "--skip-tokenizer-init"]  # streamrl sends and receives token ids only
        if self.base_gpu_id:
            command += ["--base-gpu-id", str(self.base_gpu_id)]
        if self.memory_saver:
            # Keep a host copy of the weights across a release (sglang ≥ 0.5.3): without it the weights
            # come back as garbage after resume_memory_occupation.
            command += ["--enable-memory-saver", "--enable-weights-cpu-backup"]
        return command + self.extra_args

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


class ServerProcess:
    def __init__(self, spec: ServerSpec, *, command: list[str] | None = None, log_dir: str | Path | None = None,
                 startup_timeout_s: float = 600.0):
        self.spec = spec
        self._command = command or spec.command()
        self._log_dir = Path(log_dir) if log_dir else None
        self.startup_timeout_s = startup_timeout_s
        self.port_wait_s = 30.0  # for the port to be free before starting (a replaced server stopping)
        self.process: subprocess.Popen | None = None
        self.restarts = 0

    @property
    def url(self) -> str:
        return self.spec.url

    def start(self, wait: bool = True) -> None:
        """Start the server; with `wait`, return once it is ready (else call `wait_healthy`: several
        servers load their weights in parallel that way)."""
        if self.alive():
            raise RuntimeError(f"the server at {self.url} is already running (pid {self.process.pid})")
        self._wait_port_free()
        log = subprocess.DEVNULL
        if self._log_dir is not None:
            self._log_dir.mkdir(parents=True, exist_ok=True)
            log = open(self._log_dir / f"sglang-{self.spec.port}.log", "ab")  # noqa: SIM115 - the child owns it
        guarded = [sys.executable, "-m", "streamrl.engine.sglang.guard", "--parent", str(os.getpid()), "--",
                   *self._command]
        self.process = subprocess.Popen(guarded, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        if log is not subprocess.DEVNULL:
            log.close()  # the child holds its own descriptor
        if wait:
            self.wait_healthy()

    def _wait_port_free(self) -> None:
        """Another process listening on the port (the server of a producer this one replaces, still
        stopping, or another run with the same `producers.sglang.base_port`) would answer the health check
        for this server, which then fails to bind and exits: wait up to `port_wait_s` for it to go."""
        deadline = time.monotonic() + self.port_wait_s
        while True:
            with socket.socket(socket.AF_INET6 if ":" in self.spec.host else socket.AF_INET) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds: TIME_WAIT is free
                try:
                    probe.bind((self.spec.host, self.spec.port))
                    return
                except OSError as exc:
                    if time.monotonic() >= deadline:
                        raise RuntimeError(f"cannot start the sglang server at {self.url}: port {self.spec.port} is "
                                           f"taken by another process ({exc.strerror}); another run's servers? "
                                           "(producers.sglang.base_port)") from exc
            time.sleep(0.2)

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"the sglang server for {self.url} exited with code {self.process.returncode} "
                                   f"while starting: {' '.join(self._shown_command())}")
            if self.healthy():
                return
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"the sglang server at {self.url} was not healthy within {self.startup_timeout_s:.0f} s")

    def _shown_command(self) -> list[str]:
        """The command with the API key masked, for messages."""
        return ["***" if arg == self.spec.api_key else arg for arg in self._command]

    def healthy(self, timeout: float = 30.0) -> bool:
        """Ready to generate (`/health_generate` runs a one-token generation; `/health` varies by version)."""
        try:
            with urllib.request.urlopen(self.url + "/health_generate", timeout=timeout) as response:
                return response.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def restart(self) -> None:
        self.stop()
        self.restarts += 1
        self.start()

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM to the server's process group (the guard, the server, its scheduler and detokenizer),
        SIGKILL to whatever is left after `grace_s`; returns once the group is gone (port and GPU free)."""
        if self.process is None:
            return
        group = self.process.pid  # the guard leads its own session and process group
        _signal_group(group, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and _group_alive(group):
            self.process.poll()  # reap the guard
            time.sleep(0.05)
        if _group_alive(group):
            _signal_group(group, signal.SIGKILL)
            while _group_alive(group):
                self.process.poll()
                time.sleep(0.05)
        self.process.wait()


def _signal_group(group: int, sig: int) -> None:
    try:
        os.killpg(group, sig)
    except ProcessLookupError:
        pass  # already gone


def _group_alive(group: int) -> bool:
    """Any process of the group that is not a zombie waiting to be reaped."""
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return not Path("/proc").is_dir() or bool(group_members(group))


def group_members(group: int) -> list[int]:
    """The pids of a process group's processes that are not zombies (from /proc)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # the process ended while being read
        if int(fields[2]) == group and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members
