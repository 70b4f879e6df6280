#!/usr/bin/env bash
# The project's test command (README), for a fresh CPU machine: its own virtual environment built
# from the lock, lint, unit tests, a CPU rehearsal of the GPU check, every chapter notebook (offline
# random checkpoint, CPU), the book build and its browser check (required here: a missing browser
# fails the run, it is not skipped).
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 PIP_DISABLE_PIP_VERSION_CHECK=1 TOKENIZERS_PARALLELISM=false

# A virtual environment of the test's own, built from the lock (requirements-lock.txt), so that
# leftover packages on the machine cannot make a run green. Reused while the lock is unchanged.
venv=${ENGINE_LIB_TEST_VENV:-.test-venv}
# pip, minus one warning per package about this machine's empty local index folders
pip_() { "$venv/bin/python" -m pip "$@" 2>&1 | { grep -v "^WARNING: Location 'file:.*is ignored" || true; }; }
key=$( (cat requirements-lock.txt; python3 --version) | sha256sum | cut -d' ' -f1)
if [[ -f "$venv/lock.sha256" && "$(cat "$venv/lock.sha256")" == "$key" ]]; then
  echo "test env: reusing $venv (the lock is unchanged)"
else
  echo "test env: building $venv from requirements-lock.txt (first run: a few minutes)"
  rm -rf "$venv"
  python3 -m venv "$venv"
  pip_ install -q -r requirements-lock.txt  # torch==2.13.0: the machine's CPU wheel
  echo "$key" > "$venv/lock.sha256"
fi
pip_ install -q --no-deps --no-build-isolation -e .  # this checkout, nothing else
# shellcheck disable=SC1091
source "$venv/bin/activate"
python scripts/check_env.py requirements-lock.txt  # prints the versions; fails on any drift from the lock
python -m pip check  # and the locked set satisfies every package's own requirements, ours included

if ! command -v chromium >/dev/null; then
  apt-get update -qq && apt-get install -y -qq chromium >/dev/null
fi
# Node.js and npm build the book's live tokenizer (scripts/build_tokenizer_js.sh); no fallback.
if ! command -v npm >/dev/null; then
  apt-get update -qq && apt-get install -y -qq nodejs npm >/dev/null
fi

echo "  $(chromium --version 2>/dev/null | head -1), node $(node --version)"
ruff check engine_lib tests scripts
# two workers (pytest-xdist), a test file each at a time: most of a test's time is single-threaded
# (compiles, Python), so two at once fill two cores. Notebooks likewise, two at a time.
python -m pytest -q -n auto --maxprocesses 2 --dist loadfile --durations=15 tests --ignore=tests/test_book_site.py
bash scripts/gpu_check.sh --dry-run  # the GPU check's phases on the CPU, tiny model: keeps the script honest
NOTEBOOK_WORKERS=2 bash scripts/build_book.sh --execute
BOOK_SITE_REQUIRED=1 python -m pytest -q tests/test_book_site.py
