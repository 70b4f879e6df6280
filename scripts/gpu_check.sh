#!/usr/bin/env bash
# GPU check: the GPU-only tests, then the full benchmark at the real 1.5B shape, in under 8 minutes on one GPU.
# Writes book/results/<device>.json, .md and .png. Usage: bash scripts/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_DISABLE_PROGRESS_BARS=1
python - <<'PY'
import torch
assert torch.cuda.is_available(), "scripts/gpu_check.sh needs a CUDA GPU"
print("GPU:", torch.cuda.get_device_name(), "| torch", torch.__version__, "| capability", torch.cuda.get_device_capability())
PY
pip install -q -e . 2>/dev/null || pip install -q --no-build-isolation -e .
python -m pytest -q -m gpu tests/test_gpu.py
DEVICE=$(python -c "import torch, re; print(re.sub(r'[^a-z0-9]+', '-', torch.cuda.get_device_name().lower()).strip('-'))")
# the real model when the hub is reachable, else the random checkpoint of the same shape (speed does not depend on values)
MODEL=$(python - <<'PY'
from engine_lib.cli import _resolve_auto_model
print(_resolve_auto_model("auto-bench"))
PY
)
python -m engine_lib bench --model "$MODEL" --out book/results --name "$DEVICE" --contexts 64 512 2048 4096
echo "results: book/results/$DEVICE.{json,md,png}"
