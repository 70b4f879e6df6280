#!/usr/bin/env bash
# The GPU check: GPU tests, then a focused benchmark at the real 1.5B shape, in 6 minutes or less
# on a bare GPU machine (no network, no hub). Each phase has its own timeout and leaves a record:
# book/results/<device>.check.json (phases) and book/results/<device>.{json,md,png} (benchmark).
# Usage: bash scripts/gpu_check.sh [--dry-run]   (--dry-run: the same phases on the CPU, tiny model)
set -uo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
exec python scripts/gpu_check.py "$@"
