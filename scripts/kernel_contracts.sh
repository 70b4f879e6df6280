#!/usr/bin/env bash
# The kernels' resource contracts (tests/test_kernels_contracts.py) under another Triton than the lock's,
# by default the GPU machine's 3.6.0, in a throwaway virtual environment. No GPU needed:
#   bash scripts/kernel_contracts.sh [TRITON_VERSION]
# The contract compiles every kernel launch for sm_75 and sm_90 with that Triton and its ptxas. Torch is
# only there to import engine_lib and make the (CPU) argument tensors: any CPU build will do
# (TORCH_SPEC, default the lock's, whose CPU wheel this machine serves offline).
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:-3.6.0}
venv=${KERNEL_CONTRACTS_VENV:-/tmp/kernel-contracts-triton-$version}
if [[ ! -x "$venv/bin/python" ]]; then
  python3 -m venv "$venv"
fi
# pip, minus one warning per package about this machine's empty local index folders
"$venv/bin/python" -m pip install -q "triton==$version" "${TORCH_SPEC:-torch==2.13.0}" safetensors numpy pytest 2>&1 \
  | { grep -v "^WARNING: Location 'file:.*is ignored" || true; }
"$venv/bin/python" -c "import torch, triton; print(f'triton {triton.__version__}, torch {torch.__version__}')"
# --noconftest: the suite's conftest builds checkpoints through transformers, which this test never needs
env -u TRITON_INTERPRET "$venv/bin/python" -m pytest --noconftest -q -p no:cacheprovider -rs tests/test_kernels_contracts.py
