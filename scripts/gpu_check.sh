#!/usr/bin/env bash
# The GPU check (scripts/gpu_check.py): it prints its plan first (each phase, what it counts, its estimated
# cost on an H200 and where each cost comes from; the default run is planned within 360 s), then runs the
# phases, each under a time limit, saving into --out after each one: rungs (every rung on the tiny model),
# checkpoint, kernels (our Triton kernels), bench (the full shape beside transformers), serve (the contest's
# load). --full widens them (its plan says by how much).
# Usage: bash scripts/gpu_check.sh [--dry-run] [--full] [--plan] [--out DIR]
#   --dry-run: the H200 plan, then the same phases on the CPU with the tiny model (CI runs this)
# On the lent H200 (its own Python, torch and transformers; no registry): bash scripts/gpu_check.sh --out "$OUT",
# carrying .whl: the serve phase's wheels, fetched here by `python3 scripts/gpu_check.py --fetch-wheels .whl` and
# installed there by the install phase (--no-deps, beside the machine's packages). Without them serve skips.
set -uo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
exec python3 scripts/gpu_check.py "$@"
