#!/usr/bin/env bash
# The GPU check: every rung on the tiny model under each SDPA kernel, then a benchmark at the real 1.5B shape,
# in 6 minutes or less on a bare GPU machine (no network, no hub). Each phase has its own timeout and leaves a record:
# book/results/<device>.check.json (phases), <device>.rungs.json (the rung matrix) and <device>.{json,md,png}
# (benchmark).
# Usage: bash scripts/gpu_check.sh [--dry-run] [--full]   (--dry-run: the same phases on the CPU, tiny model)
# Phases and H200 estimates (scripts/gpu_check.py): install ~10 s, rungs (tiny model, every rung x SDPA kernel x
# dtype, eager and compiled) ~120 s, checkpoint ~20 s, bench (full shape, one compile each for fused and int8)
# ~180 s: about 5.5 minutes. --full adds the GPU tests and the focused bench with int4 (~8 minutes more).
set -uo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
exec python scripts/gpu_check.py "$@"
