#!/usr/bin/env bash
# README command 1: set up a fresh Debian 12 machine, build the release preset and run the main
# job. For now that is the CPU MoE layer benchmark on a small geometry.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cmake --preset release
cmake --build --preset release
./build/release/moebius bench moe --backend cpu --geometry 1024,512,32,4 --format nvfp4 --tokens 1,16,128
