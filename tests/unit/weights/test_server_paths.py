"""The one factory of the sglang weight paths, each path driven against a client that records the calls
(the stand-in server's end of them is tested in tests/integration/test_sglang.py)."""

import base64
import contextlib
import pickle

import numpy as np
import pytest
from safetensors.numpy import load_file

from streamrl.config import SglangSection
from streamrl.weights.server_paths import ServerSlot, server_weight_path


class RecordingClient:
    def __init__(self, url: str):
        self.url = url
        self.calls: list[tuple[str, object]] = []

    @contextlib.contextmanager
    def weight_update_session(self):
        self.calls.append(("begin", None))
        yield
        self.calls.append(("end", None))

    def update_weights_from_disk(self, path: str) -> None:
        self.calls.append(("disk", path))

    def update_weights_from_tensor(self, payloads: list[str]) -> None:
        self.calls.append(("tensor", [pickle.loads(base64.b64decode(p)) for p in payloads]))


def arrays(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"a": rng.standard_normal((4, 8)).astype(np.float32), "b": rng.standard_normal(16).astype(np.float32)}


def test_disk_writes_a_version_once_and_every_server_loads_that_directory(tmp_path):
    path = server_weight_path(SglangSection(weights="disk"), [ServerSlot("http://a"), ServerSlot("http://b")],
                              model_dir=str(tmp_path), directory=tmp_path / "versions", group_prefix="g-")
    version = arrays(0)
    load = path.loader_for(3, version)
    clients = [RecordingClient("http://a"), RecordingClient("http://b")]
    for client in clients:
        load(client)
    (kind_a, dir_a), = clients[0].calls
    assert path.name == "disk" and kind_a == "disk" and clients[1].calls == [("disk", dir_a)]
    written = load_file(f"{dir_a}/model.safetensors")
    assert all(np.array_equal(written[k], v) for k, v in version.items())
    assert len(list((tmp_path / "versions").iterdir())) == 1
    path.close()


def test_tensor_sends_every_tp_rank_the_whole_version_inside_one_session(tmp_path):
    section = SglangSection(weights="tensor", tensor_parallel=2, bucket_mb=1)
    path = server_weight_path(section, [ServerSlot("http://a", first_gpu=0)], model_dir=str(tmp_path),
                              directory=tmp_path, group_prefix="g-")
    version = arrays(1)
    client = RecordingClient("http://a")
    path.loader_for(1, version)(client)
    assert path.name == "tensor" and [kind for kind, _ in client.calls] == ["begin", "tensor", "end"]
    payloads = client.calls[1][1]
    assert len(payloads) == 2  # one per TP rank
    for payload in payloads:
        assert {name: tensor.numpy().tolist() for name, tensor in payload} == \
               {name: value.tolist() for name, value in version.items()}


def test_a_path_the_factory_does_not_know_is_refused_by_name(tmp_path):
    section = SglangSection().model_copy(update={"weights": "carrier-pigeon"})
    with pytest.raises(ValueError, match="carrier-pigeon"):
        server_weight_path(section, [], model_dir=str(tmp_path), directory=tmp_path, group_prefix="g-")
