#!/usr/bin/env bash
# The GPU check, ready for the moment a GPU machine is available (no network needed there).
#
#   here, once:             bash benchmarks/gpu_smoke.sh --fetch-wheels   # ~7 MB of wheels into .whl/ (git-ignored)
#   on the GPU machine:     bash benchmarks/gpu_smoke.sh                  # with .whl/ carried beside the tree
#
# The GPU image is expected to hold python3 with a CUDA torch, transformers, tokenizers, safetensors,
# numpy and pyarrow; the wheels add what streamrl needs beyond them (megatron-core, pydantic, tomli-w).
# Runs, within ~8 minutes: the tests marked `gpu` (among them the CUDA memory the megatron trainer
# leaves after offload, printed, and a TP = 2 and a PP = 2 step on NCCL where two GPUs are visible),
# then the smoke run (torch engine + megatron trainer on CUDA) and the same with the torch trainer,
# each writing JSON to $OUT (or /tmp);
# then, where sglang is installed (`pip install "streamrl[gpu]"`: sglang>=0.5.21,<0.6 with the torch it
# pins), a real sglang server with a tiny model through each weight path (disk, tensor handles, broadcast):
# benchmarks/sglang_smoke.py, log-probs compared with the Hugging Face model's under the loaded version.
set -euo pipefail
cd "$(dirname "$0")/.."
wheels=.whl
if [[ "${1:-}" == "--fetch-wheels" ]]; then
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$wheels" \
    megatron-core==0.16.1 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
    typing-inspection==0.4.5 tomli-w==1.2.0
  du -sh "$wheels"
  exit 0
fi
out="${OUT:-/tmp}"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$wheels"/*.whl
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, transformers, megatron.core; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'transformers', transformers.__version__)"
timeout 200 python3 -m pytest -q -rP -p no:cacheprovider -m gpu tests/ 2>&1 | tee "$out/gpu_tests.log"
timeout 150 python3 benchmarks/gpu_smoke.py --trainer megatron --steps 30 --out "$out/gpu_smoke_megatron.json"
timeout 120 python3 benchmarks/gpu_smoke.py --trainer torch --steps 30 --out "$out/gpu_smoke_torch.json"
if python3 -c "import sglang" 2>/dev/null; then
  timeout 600 python3 benchmarks/sglang_smoke.py --out "$out/sglang_smoke.json"
else
  echo "sglang is not installed here: the real-server check (benchmarks/sglang_smoke.py) did not run" \
    | tee "$out/sglang_smoke.skipped"
fi
