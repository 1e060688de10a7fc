#!/usr/bin/env bash
# Builds the release preset here and copies just the binaries the GPU machine runs into
# .device/release (git-ignored), keeping the build tree's layout so scripts/gpu.sh finds them.
# Carry `.device/release` with the device call; the whole build tree would not fit its limit.
set -euo pipefail
cd "$(dirname "$0")/.."
cmake --preset release >/dev/null
cmake --build --preset release
rm -rf .device/release
mkdir -p .device/release/tests
cp build/release/moebius .device/release/
for t in moebius_tests moebius_cuda_host_tests moebius_gpu_tests; do
  [ -x "build/release/tests/$t" ] && cp "build/release/tests/$t" .device/release/tests/
done
for d in build/release/dev_*; do [ -x "$d" ] && cp "$d" .device/release/; done
# The CUPTI kernel timeline that scripts/gpu.sh's trace-decode step preloads (built where CUPTI is).
[ -f build/release/libmoebius_kernel_trace.so ] && cp build/release/libmoebius_kernel_trace.so .device/release/
du -sh .device/release
