"""The trust boundary: what streamrl exposes and what it loads.

- A Ray instance started by streamrl listens on loopback only (every TCP socket of its processes).
- A cluster that requires Ray's token: `streamrl admission` / `launch --address` without it fail with
  one line naming what is missing; with it they connect.
- An sglang server (the loopback stand-in, enforcing the key as sglang does) refuses requests
  without its API key.
- A checkpoint's optimizer file is loaded without unpickling code: a crafted one is refused and
  runs nothing.
"""

import importlib
import json
import os
import pickle
import secrets
import select
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from checkout import FAKE_SGLANG, ROOT

from streamrl.net import free_port, is_loopback

FAKE = FAKE_SGLANG
CLUSTER_MARK = "STREAMRL_TEST_CLUSTER"  # in the environment of every process of the test cluster


def _psutil():
    """Ray's own copy of psutil (ray/thirdparty_files), on sys.path once ray is imported."""
    import ray  # noqa: F401

    return importlib.import_module("psutil")


def _clean_env(**extra: str) -> dict[str, str]:
    """This environment without Ray's address and token settings (an earlier `ray.init` in this
    process sets RAY_AUTH_MODE)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**env, **extra}


def _read_line(process: subprocess.Popen, timeout_s: float) -> str:
    ready, _, _ = select.select([process.stdout], [], [], timeout_s)
    if not ready:
        raise TimeoutError(f"no output from the child within {timeout_s:.0f} s")
    return process.stdout.readline()


def _listening(psutil, root, seconds: float) -> dict[tuple[str, int], str]:
    """Every listening TCP socket of `root` and its descendants, polled for `seconds` (agents and
    metrics exporters open theirs a little after Ray is up)."""
    found: dict[tuple[str, int], str] = {}
    deadline = time.monotonic() + seconds
    while True:
        processes = {p.pid: p for p in [root, *root.children(recursive=True)]}
        for conn in psutil.net_connections("tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.pid in processes:
                try:
                    found[(conn.laddr.ip, conn.laddr.port)] = processes[conn.pid].name()
                except psutil.NoSuchProcess:
                    continue
        if time.monotonic() >= deadline:
            return found
        time.sleep(0.5)


def _end(psutil, processes) -> None:
    """Terminate these processes (found by pid, never by name), kill what is left after 5 s."""
    alive = []
    for process in processes:
        try:
            process.terminate()
            alive.append(process)
        except psutil.NoSuchProcess:
            pass
    _, left = psutil.wait_procs(alive, timeout=5)
    for process in left:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass


# ---- Ray: loopback -----------------------------------------------------------------------------------
LOCAL_RAY = """
import os, sys
import ray
from streamrl.runtime.connect import start_local

start_local(1, logging_level="ERROR")

@ray.remote
def pid():
    return os.getpid()

print(ray.get(pid.remote()), flush=True)  # a worker is up: it runs a gRPC server of its own
sys.stdin.readline()
ray.shutdown()
"""


@pytest.mark.ray
def test_a_ray_instance_started_by_streamrl_listens_on_loopback_only(tmp_path):
    psutil = _psutil()
    # Own HOME: a local ray.init writes its token to ~/.ray/auth_token.
    driver = subprocess.Popen([sys.executable, "-c", LOCAL_RAY], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env=_clean_env(HOME=str(tmp_path)))
    session = []
    try:
        worker = int(_read_line(driver, timeout_s=90))
        root = psutil.Process(driver.pid)
        sockets = _listening(psutil, root, seconds=4)
        session = [root, *root.children(recursive=True)]
        assert worker in {p.pid for p in session}
        names = set(sockets.values())
        assert {"gcs_server", "raylet"} <= names, names  # the check sees Ray's own servers
        exposed = {address: name for address, name in sockets.items() if not is_loopback(address[0])}
        assert not exposed, f"Ray sockets bound beyond loopback: {exposed}"
    finally:
        driver.stdin.close()  # the driver shuts Ray down
        try:
            driver.wait(timeout=60)
        except subprocess.TimeoutExpired:
            driver.kill()
        _end(psutil, session)


# ---- Ray: token authentication -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def token_cluster():
    """`ray start --head` with token authentication, on loopback, with its own temp dir, HOME and token.

    Stopped by ending the processes that carry this cluster's mark in their environment: `ray stop`
    would end every Ray instance on the machine, other test runs' included."""
    psutil = _psutil()
    root = Path(tempfile.mkdtemp(prefix="srl-", dir="/tmp"))  # short: Ray's socket paths must fit 107 bytes
    (root / "home").mkdir()
    token = root / "token"
    token.write_text(secrets.token_hex(32))
    client_env = _clean_env(HOME=str(root / "home"))
    head_env = {**client_env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token),
                "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # the head on 127.0.0.1 (connect._node_on_loopback)
                CLUSTER_MARK: root.name}
    port = free_port()
    try:
        with open(root / "ray-start.log", "w") as log:  # not a pipe: the daemons keep their output open
            subprocess.run([str(Path(sys.executable).with_name("ray")), "start", "--head", f"--port={port}",
                            "--num-cpus=1", "--disable-usage-stats", "--include-dashboard=false",
                            f"--ray-client-server-port={free_port()}", f"--temp-dir={root / 'ray'}"],
                           env=head_env, stdout=log, stderr=subprocess.STDOUT, check=True, timeout=90)
        yield {"address": f"127.0.0.1:{port}", "token_file": token, "env": client_env, "root": root}
    finally:
        _end(psutil, _cluster_processes(psutil, root.name))
        shutil.rmtree(root, ignore_errors=True)


def _cluster_processes(psutil, mark: str) -> list:
    """The processes `ray start` left running (they carry the mark) and their descendants: Ray's agents
    and workers rename themselves over their environment, so they are found as the raylet's children."""
    found = {}
    for process in psutil.process_iter():
        try:
            if process.environ().get(CLUSTER_MARK) == mark:
                found.update({p.pid: p for p in [process, *process.children(recursive=True)]})
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return list(found.values())


def _streamrl(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "streamrl.cli", *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=60)


def _error_line(result: subprocess.CompletedProcess) -> str:
    lines = [line for line in result.stderr.splitlines() if line.startswith("streamrl: error:")]
    assert result.returncode == 2 and len(lines) == 1, (result.returncode, result.stderr[-2000:])
    return lines[0]


@pytest.mark.ray
def test_admission_needs_the_token_of_a_cluster_that_requires_one(token_cluster):
    address, env, root = token_cluster["address"], token_cluster["env"], token_cluster["root"]
    status = ["admission", "status", "--run", "no-such-run", "--address", address]

    missing = _error_line(_streamrl(status, env, root))
    assert f"the Ray cluster at {address} requires a token and none was found" in missing
    assert "RAY_AUTH_TOKEN" in missing and "RAY_AUTH_TOKEN_PATH" in missing

    wrong = _error_line(_streamrl(status, {**env, "RAY_AUTH_TOKEN": secrets.token_hex(32)}, root))
    assert f"the Ray cluster at {address} rejected the token from RAY_AUTH_TOKEN" in wrong

    # With the token (Ray's own variable), without RAY_AUTH_MODE: it connects, and finds no such run.
    found = _error_line(_streamrl(status, {**env, "RAY_AUTH_TOKEN_PATH": str(token_cluster["token_file"])}, root))
    assert "no running streamrl run named 'no-such-run'" in found


@pytest.mark.ray
def test_launch_on_a_cluster_without_its_token_fails_with_one_line(token_cluster):
    address, root = token_cluster["address"], token_cluster["root"]
    launched = _streamrl(["launch", "--address", address, "--name", "no-token",
                          "--set", f"run.output_dir={json.dumps(str(root / 'runs'))}"], token_cluster["env"], root)
    line = _error_line(launched)
    assert f"ray.address: the Ray cluster at {address} requires a token and none was found" in line


# ---- sglang: per-server API key ------------------------------------------------------------------------
def test_a_server_started_by_streamrl_gets_a_random_key_kept_out_of_messages():
    from streamrl.engine.sglang.server import ServerSpec

    first, second = ServerSpec(model_path="m"), ServerSpec(model_path="m")
    assert first.api_key != second.api_key and len(first.api_key) >= 32
    command = first.command()
    assert command[command.index("--api-key") + 1] == first.api_key
    assert command[command.index("--host") + 1] == "127.0.0.1"
    assert first.api_key not in repr(first)
    # a key starting with "-" is read by the server's argparse as a flag and the server exits (code 2):
    # with urlsafe base64 keys that was 1 start in 64
    assert not any(ServerSpec(model_path="m").api_key.startswith("-") for _ in range(1000))


def test_the_fake_server_refuses_requests_without_the_key_as_sglang_does():
    from streamrl.engine.sglang.engine import EventLoopThread, SglangEngine
    from streamrl.engine.sglang.server import ServerProcess, ServerSpec
    from streamrl.sglang.client import SglangClient, SglangError

    port = free_port()
    spec = ServerSpec(model_path="unused", port=port, launcher=[sys.executable, str(FAKE)])
    server = ServerProcess(spec, startup_timeout_s=30)  # the fake gets sglang's flags, --api-key among them
    server.start()
    try:
        assert server.healthy()  # /health* stays open, as in sglang (probes carry no secret)
        prompt = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}
        for key in (None, "wrong-" + spec.api_key):
            with pytest.raises(SglangError, match="answered 401: Unauthorized"):
                SglangClient(server.url, api_key=key).call("/generate", prompt)
            with pytest.raises(SglangError, match="answered 401"):
                SglangClient(server.url, api_key=key).update_weight_version(7)
        io = EventLoopThread()
        try:
            engine = SglangEngine(SglangClient(server.url), io, server=server)  # the client takes its server's key
            assert len(io.call(engine.sample([1, 2], max_new_tokens=3)).tokens) == 3
        finally:
            io.close()
        calls = SglangClient(server.url, api_key=spec.api_key).call("/fake/calls", method="GET")["calls"]
        assert [call["path"] for call in calls] == ["/generate"]  # refused requests never reached the model
    finally:
        server.stop()


# ---- checkpoints: no unpickling --------------------------------------------------------------------------
class _Payload:
    """Unpickling this runs `open(marker, "w")`."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_a_crafted_optimizer_file_is_refused_and_runs_nothing(tiny_model_dir, tmp_path):
    from streamrl.config import TrainerSection
    from streamrl.correction import LossConfig
    from streamrl.trainer.megatron_trainer import MegatronTrainer
    from streamrl.trainer.torch_trainer import TorchBackend, TorchTrainer

    marker = tmp_path / "pwned"
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    with open(checkpoint / TorchBackend.optimizer_file, "wb") as f:
        pickle.dump({"state": {}, "param_groups": [], "x": _Payload(marker)}, f, protocol=2)  # as torch.save
    (checkpoint / "trainer.json").write_text('{"version": 3}')
    trainer = TorchTrainer(tiny_model_dir, trainer=TrainerSection(), loss=LossConfig(name="decoupled_ppo"),
                           group_size=4)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        trainer.load_optimizer(checkpoint)
    assert not marker.exists()
    assert trainer.version == 0
    assert MegatronTrainer.load_optimizer is TorchTrainer.load_optimizer  # its shards go through the same loader


def test_a_model_directory_with_pickled_weights_is_refused_and_runs_nothing(tiny_model_dir, tmp_path):
    from streamrl.models.hf import load_policy

    marker = tmp_path / "pwned"
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    for weights in model_dir.glob("*.safetensors"):
        weights.unlink()
    with open(model_dir / "pytorch_model.bin", "wb") as f:
        pickle.dump({"model.embed_tokens.weight": _Payload(marker)}, f, protocol=2)
    with pytest.raises(Exception) as refused:  # transformers wraps torch's refusal in its own error type
        load_policy(model_dir)
    assert "weights_only" in str(refused.value) or "Weights only" in str(refused.value), refused.value
    assert not marker.exists()
