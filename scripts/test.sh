#!/usr/bin/env bash
# The project's test command (README): install on a fresh CPU machine, lint, unit tests, a CPU
# rehearsal of the GPU check, every chapter notebook (offline random checkpoint, CPU), the book
# build and its browser check (required here: a missing browser fails the run, it is not skipped).
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 PIP_DISABLE_PIP_VERSION_CHECK=1 TOKENIZERS_PARALLELISM=false

python -c "import torch" 2>/dev/null || pip install -q torch==2.13.0  # the CPU wheel; plain 'torch' pulls CUDA
pip install -q -e ".[book,dev,serve]"
if ! command -v chromium >/dev/null; then
  apt-get update -qq && apt-get install -y -qq chromium >/dev/null
fi
# Node.js and npm build the book's live tokenizer (scripts/build_tokenizer_js.sh); no fallback.
if ! command -v npm >/dev/null; then
  apt-get update -qq && apt-get install -y -qq nodejs npm >/dev/null
fi

ruff check engine_lib tests scripts
python -m pytest -q tests --ignore=tests/test_book_site.py
bash scripts/gpu_check.sh --dry-run  # the GPU check's phases on the CPU, tiny model: keeps the script honest
bash scripts/build_book.sh --execute
BOOK_SITE_REQUIRED=1 python -m pytest -q tests/test_book_site.py
