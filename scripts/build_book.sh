#!/usr/bin/env bash
# Build the book (Jupyter Book 1.x) into _build/html.
#
#   bash scripts/build_book.sh             build from the notebooks as they are
#   bash scripts/build_book.sh --execute   first run every chapter (and the exercises' worked
#                                          solutions) on CPU with the offline
#                                          random-weight checkpoint, in a copy of the book's
#                                          sources under executed/ (the committed notebooks
#                                          stay clean), then build from that copy
#
# The build itself never executes a notebook (execute_notebooks: "off" in _config.yml), so
# it never runs GPU code and never downloads a model. Warnings are errors (-W).
set -euo pipefail
cd "$(dirname "$0")/.."

execute=0
for arg in "$@"; do
  case "$arg" in
    --execute) execute=1 ;;
    -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
    *) echo "unknown argument: $arg (use --execute or nothing)" >&2; exit 2 ;;
  esac
done

# The live tokenizer of chapter 01 (JavaScript): into book/, so executed/ below gets it too.
bash scripts/build_tokenizer_js.sh

src=.
if [[ $execute == 1 ]]; then
  src=executed  # not under _build/: nbmake skips any path with a _build folder in it
  rm -rf "$src" && mkdir -p "$src"
  cp -r _config.yml _toc.yml _static book chapters solutions "$src"/
  rm -rf "$src/book/tokenizer_js/node_modules"  # the built bundle in dist/ is all the site needs
  cp scripts/notebook_conftest.py "$src/conftest.py"  # kernels over IPC sockets, not TCP ports (see it)
  # Offline: the chapters fall back to the random checkpoint; no tqdm widget state.
  # NOTEBOOK_WORKERS=2 (the test command): two notebooks at a time (pytest-xdist); the published
  # site runs them one at a time, so each one's timings are taken on an otherwise quiet machine
  workers=()
  notebooks=(chapters/ solutions/)
  if [[ ${NOTEBOOK_WORKERS:-1} -gt 1 ]]; then
    workers=(-n "$NOTEBOOK_WORKERS" --dist load)
    # the longest chapters first (CI's durations: 3 to 5 minutes each), so that the two workers end
    # together instead of one finishing a long chapter alone at the end
    long=(10 09 08 05 07 04)
    notebooks=()
    for n in "${long[@]}"; do notebooks+=(chapters/"$n"_*.ipynb); done
    for nb in chapters/*.ipynb; do
      [[ " ${long[*]} " == *" $(basename "$nb" | cut -c1-2) "* ]] || notebooks+=("$nb")
    done
    notebooks+=(solutions/*.ipynb)
  fi
  (cd "$src" && HF_HUB_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 \
    python -m pytest --nbmake --nbmake-timeout=900 --overwrite -p no:cacheprovider --durations=0 "${workers[@]}" \
      "${notebooks[@]}")
fi

jupyter-book build "$src" -W -n --keep-going
if [[ $src != . ]]; then
  mkdir -p _build && rm -rf _build/html && cp -r "$src/_build/html" _build/html
fi
echo "book: $(pwd)/_build/html/index.html"
