#!/usr/bin/env bash
# README command 1: set up a fresh Debian 12 machine, build the release preset and run the main
# job: the single-stream decode and prefill benchmark of the Qwen3-30B-A3B geometry with dummy
# NVFP4 experts when a GPU is there (issue 4's headline numbers, against the bytes floor), else
# the CPU backend: generation on the tiny Qwen3-MoE fixture (the reference path) and the CPU MoE
# layer benchmark on a small geometry.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cmake --preset release
cmake --build --preset release
bin=./build/release/moebius
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
  "$bin" bench generate --geometry qwen3-30b-a3b --load-format dummy --experts nvfp4 --context 1024,10240 \
    --prefill 1024
else
  echo "no GPU here: the CPU backend on the tiny Qwen3-MoE fixture (tests/data/tiny-qwen3-moe)"
  "$bin" generate --model tests/data/tiny-qwen3-moe --prompt-ids 1,17,301,5,9 --max-tokens 16 --temperature 0
  "$bin" bench moe --backend cpu --geometry 1024,512,32,4 --format nvfp4 --tokens 1,16,128
fi
