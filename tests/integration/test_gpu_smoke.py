"""benchmarks/gpu_smoke.py on the CPU: the script a GPU session runs first must not fail on a typo."""

import json
import os
import subprocess
import sys

from checkout import BENCHMARKS

SCRIPT = BENCHMARKS / "gpu_smoke.py"


def test_the_gpu_smoke_run_streams_and_reports_on_cpu(tmp_path):
    out = tmp_path / "smoke.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--steps", "3", "--hidden", "32",
                           "--layers", "2", "--groups-per-step", "4", "--group-size", "4", "--out", str(out)],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(BENCHMARKS.parent)})  # as gpu_smoke.sh runs it
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    assert result["steps"] == 3 and result["trainer"] == "megatron" and result["device"] == "cpu"
    assert result["generated_tokens_per_s"] > 0 and result["trained_tokens_per_s"] > 0
    assert 0 < result["publish_s"]["median"] <= result["publish_s"]["max"]
