"""sglang's disk weights path: each version a Hugging Face directory, written whole."""

import json

import numpy as np
from safetensors.numpy import load_file

from streamrl.weights.disk import DiskWeights


def make_base(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    return base


def test_a_version_already_on_disk_is_replaced_whole_and_torn_writes_are_cleared(tmp_path):
    base = make_base(tmp_path)
    root = tmp_path / "weights-producer-0"
    before = DiskWeights(base, root)  # the producer that died, or the run before a resume
    before.write(7, {"w": np.zeros(4, np.float32)})
    before.write(8, {"w": np.zeros(4, np.float32)})
    (root / "v00000009.partial").mkdir()  # its writer was killed mid-write

    after = DiskWeights(base, root)  # its replacement keeps the producer id, so the directory
    assert not (root / "v00000009.partial").exists()
    written = after.write(8, {"w": np.ones(4, np.float32)})  # a rewound run's version 8: other weights
    np.testing.assert_array_equal(load_file(str(written / "model.safetensors"))["w"], np.ones(4, np.float32))
    assert (written / "config.json").is_file()
    after.write(9, {"w": np.ones(4, np.float32)})
    assert sorted(p.name for p in root.iterdir()) == ["v00000008", "v00000009"]  # the newest two


def test_a_resumed_run_keeps_the_versions_it_writes_below_those_of_the_run_before(tmp_path):
    """The run before trained to v120 past its checkpoint at v100: the resumed producer's v100 and v101
    stay on disk for its servers to load (sorted by name, v119 and v120 outranked them)."""
    base, root = make_base(tmp_path), tmp_path / "weights-producer-0"
    before = DiskWeights(base, root)
    for version in (119, 120):
        before.write(version, {"w": np.zeros(4, np.float32)})

    resumed = DiskWeights(base, root)
    assert resumed.write(100, {"w": np.ones(4, np.float32)}).is_dir()
    resumed.write(101, {"w": np.ones(4, np.float32)})
    resumed.write(102, {"w": np.ones(4, np.float32)})
    assert sorted(p.name for p in root.iterdir()) == ["v00000101", "v00000102"]
