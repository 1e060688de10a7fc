#!/usr/bin/env bash
# Builds the release preset here and stages just the binaries the GPU machine runs, keeping the
# build tree's layout so scripts/gpu.sh finds them. Carry the staged folder with the device call
# (its `carry` limit is 64 MiB in all): the binaries are stripped and xz-compressed (moebius and the
# GPU tests are ~45 MB each unstripped, ~20 MB each staged: mostly device code), and gpu.sh unpacks
# them there.
#
#   scripts/stage_device.sh [BUILD_DIR [DEST]]
#     BUILD_DIR  default build/release (built with the release preset first when it is that one)
#     DEST       default .device/release (git-ignored)
#   MOEBIUS_STAGE  what to stage, default "moebius gpu-tests trace" (~40 MB); add cpu-tests (~21 MB),
#                  host-tests (<1 MB) and probes (~12 MB) when the call has room for them: all of
#                  it is ~71 MB, over the carry limit.
# For an A/B against another commit: build it in a worktree, stage its moebius alone
# (MOEBIUS_STAGE=moebius scripts/stage_device.sh <worktree>/build/release .device/b; +20 MB), carry
# both and run gpu.sh with MOEBIUS_AB_BUILD=.device/b (its ab-bench-moe step).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build/release}
DEST=${2:-.device/release}
if [ "$BUILD" = build/release ]; then
  cmake --preset release >/dev/null
  cmake --build --preset release
fi
rm -rf "$DEST"
mkdir -p "$DEST/tests"
stage() {  # stage FILE DEST_FILE: stripped and xz'd (DEST_FILE.xz)
  cp "$1" "$2"
  strip "$2" 2>/dev/null || true
  xz -T2 -6 -f "$2"
}
WANT=" ${MOEBIUS_STAGE:-moebius gpu-tests trace} "
wants() { [[ $WANT == *" $1 "* ]]; }
wants moebius && stage "$BUILD/moebius" "$DEST/moebius"
wants gpu-tests && stage "$BUILD/tests/moebius_gpu_tests" "$DEST/tests/moebius_gpu_tests"
wants cpu-tests && stage "$BUILD/tests/moebius_tests" "$DEST/tests/moebius_tests"
wants host-tests && stage "$BUILD/tests/moebius_cuda_host_tests" "$DEST/tests/moebius_cuda_host_tests"
if wants probes; then
  for d in "$BUILD"/dev_*; do [ -x "$d" ] && stage "$d" "$DEST/$(basename "$d")"; done
fi
# The CUPTI kernel timeline that scripts/gpu.sh's trace-decode step preloads (built where CUPTI is).
if wants trace && [ -f "$BUILD/libmoebius_kernel_trace.so" ]; then
  cp "$BUILD/libmoebius_kernel_trace.so" "$DEST/"
fi
du -sh "$DEST"
