#!/usr/bin/env bash
# A CPU rehearsal of the GPU check under the lent H200's versions (issue 26), so that an API difference
# from the lock shows here first: a virtual environment outside the checkout with Python 3.12, torch 2.11.0,
# triton 3.6.0, transformers 5.17.0 and the image's other versions that KINDS.md gives; the rest the tests
# need at the lock's versions. The project goes in with --no-deps and the serve phase's wheels (.whl, from
# `python3 scripts/gpu_check.py --fetch-wheels .whl`) as the device gets them: --target, no dependencies.
# Then the GPU check's dry run and the unit tests where torch, Triton and transformers' APIs are used (TESTS
# below: the model against transformers, loading, the cache, sampling, the compiled step, quantization, our
# kernels, the SDPA contracts, the server); the whole suite takes over an hour on a busy 2-core CPU. Arguments
# replace the selection: `... tests` runs everything.
# PyPI's torch 2.11 for Linux is a CUDA build (several GB); it runs on the CPU too. The first run downloads it.
# Usage: bash scripts/rehearse_device_versions.sh [pytest args]
#   env: ENGINE_LIB_REHEARSAL_VENV (default /tmp/device-venv), ENGINE_LIB_REHEARSAL_PYTHON (default python3.12)
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 PIP_DISABLE_PIP_VERSION_CHECK=1 TOKENIZERS_PARALLELISM=false
venv=${ENGINE_LIB_REHEARSAL_VENV:-/tmp/device-venv}
py=${ENGINE_LIB_REHEARSAL_PYTHON:-}
for c in python3.12 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12; do  # the device's Python
  [[ -z "$py" ]] && "$c" --version >/dev/null 2>&1 && py=$c
done
if [[ -z "$py" ]]; then echo "no Python 3.12 here (set ENGINE_LIB_REHEARSAL_PYTHON)" >&2; exit 2; fi
# the H200 image's versions (.library/device/KINDS.md, read 2026-11)
device="torch==2.11.0 triton==3.6.0 transformers==5.17.0 numpy==2.5.2 safetensors==0.8.0 tokenizers==0.23.2
        huggingface_hub==1.33.0"
# what the tests import beyond those, at the lock's versions (the image has most of them; versions unread)
others=$(grep -iE '^(pytest|matplotlib|tqdm|httpx|anyio|h11|idna|click|jsonschema|llguidance|pyyaml)==' \
         requirements-lock.txt | tr '\n' ' ')
pip_() { "$venv/bin/python" -m pip "$@" 2>&1 | { grep -v "^WARNING: Location 'file:.*is ignored" || true; }; }

key=$( (echo "$device $others"; "$py" --version) | sha256sum | cut -d' ' -f1)
if [[ -f "$venv/rehearsal.sha256" && "$(cat "$venv/rehearsal.sha256")" == "$key" ]]; then
  echo "rehearsal env: reusing $venv"
else
  echo "rehearsal env: building $venv with $("$py" --version) (the first time: several GB)"
  [[ -d "$venv" ]] || "$py" -m venv "$venv"
  # shellcheck disable=SC2086
  pip_ install -q $device $others
  echo "$key" > "$venv/rehearsal.sha256"
fi
pip_ install -q --no-deps --no-build-isolation -e .
if compgen -G ".whl/*.whl" >/dev/null; then  # the serve phase's wheels, exactly as the device installs them
  pip_ install -q --no-index --no-deps --no-compile --upgrade --target "$venv/carried" .whl/*.whl
  export PYTHONPATH="$venv/carried${PYTHONPATH:+:$PYTHONPATH}"
else
  echo "no .whl/: the serve phase and the serving tests will skip (python3 scripts/gpu_check.py --fetch-wheels .whl)"
fi
# shellcheck disable=SC1091
source "$venv/bin/activate"
python -c "import sys, torch, triton, transformers; print(f'Python {sys.version.split()[0]}, torch {torch.__version__}, '
  f'triton {triton.__version__}, transformers {transformers.__version__}')"

status=0
bash scripts/gpu_check.sh --dry-run --wheels .whl || status=1
TESTS="model_qwen2 model_loader model_layers cache_contiguous model_config model_tokenizer engine sampling
       sampling_streaming model_half_precision model_fp16_overflow step_compiled quant_int8_decode quant_linear
       cpu_kernels cpu_matmul speculative loop_cuda_contracts kernels_triton_rung kernels_add_rmsnorm
       kernels_decode_attention kernels_int8_matvec kernels_rope_kv_write kernels_rounding loop_scheduler
       serve_http loop_model_runner scripts_gpu_check"
args=("$@")
if [[ ${#args[@]} -eq 0 ]]; then
  for t in $TESTS; do
    [[ -f tests/test_$t.py ]] || { echo "rehearsal: tests/test_$t.py is not there (renamed?)" >&2; exit 2; }
    args+=("tests/test_$t.py")
  done
fi
python -m pytest -q -p no:cacheprovider -rfE --durations=10 "${args[@]}" || status=1
echo "rehearsal under the device's versions: $([[ $status == 0 ]] && echo green || echo FAILED)"
exit $status
