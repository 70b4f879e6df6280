#!/usr/bin/env bash
# The project's test command (README): install on a fresh CPU machine, lint, unit tests,
# every chapter notebook (offline random checkpoint, CPU), the book build and its browser check.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 PIP_DISABLE_PIP_VERSION_CHECK=1 TOKENIZERS_PARALLELISM=false

python -c "import torch" 2>/dev/null || pip install -q torch==2.13.0  # the CPU wheel; plain 'torch' pulls CUDA
pip install -q -e ".[book,dev]"
if ! command -v chromium >/dev/null; then
  (apt-get update -qq && apt-get install -y -qq chromium >/dev/null) || echo "chromium not installed: the browser check will be skipped"
fi

ruff check engine_lib tests scripts
python -m pytest -q tests --ignore=tests/test_book_site.py
bash scripts/build_book.sh --execute
python -m pytest -q tests/test_book_site.py
