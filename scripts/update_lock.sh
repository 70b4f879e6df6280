#!/usr/bin/env bash
# Refresh requirements-lock.txt on purpose: resolve pyproject.toml's ranges afresh in a new,
# empty virtual environment (CPU torch 2.13.0, the book, dev, serve, kernels and eval extras), write the exact
# versions to the lock, then run the whole test command on them. Commit the lock only if the
# tests pass; the diff of the lock says what moved.
#
#   bash scripts/update_lock.sh            refresh and test
#   bash scripts/update_lock.sh --no-test  refresh only (then run scripts/test.sh yourself)
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1

run_tests=1
for arg in "$@"; do
  case "$arg" in
    --no-test) run_tests=0 ;;
    -h|--help) sed -n '2,8p' "$0"; exit 0 ;;
    *) echo "unknown argument: $arg (use --no-test or nothing)" >&2; exit 2 ;;
  esac
done

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m venv "$tmp/venv"
"$tmp/venv/bin/python" -m pip install -q torch==2.13.0  # the CPU wheel here; plain 'torch' pulls CUDA
"$tmp/venv/bin/python" -m pip install -q -e ".[book,dev,serve,kernels,eval]"
{
  sed -n '1,/^[^#]/p' requirements-lock.txt | grep '^#'  # keep the header comment
  "$tmp/venv/bin/python" -m pip freeze --all --exclude-editable | grep -v '^pip==' | sed 's/^torch==\([0-9.]*\)+cpu$/torch==\1/'
} > "$tmp/lock.txt"
mv "$tmp/lock.txt" requirements-lock.txt
git --no-pager diff --stat -- requirements-lock.txt || true
if [[ $run_tests == 1 ]]; then
  bash scripts/test.sh  # a changed lock rebuilds the test environment from it
fi
