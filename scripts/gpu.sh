#!/usr/bin/env bash
# The one script for the GPU machine: everything that needs the device, in one call, with a short
# table printed last. Device time is scarce, so this batches the work.
#
# Usage on the device (through the device tool, in the repository root):
#   scripts/gpu.sh [carried-build-dir]
# Here, stage the binaries first (scripts/stage_device.sh) and carry .device/release.
# The build is made HERE (Debian 12) with the release preset and carried; its binaries link the
# C++/OpenMP runtimes statically, so they run on the device's Ubuntu without our packages.
# Steps:
#   1. the CPU test suite from the carried build (shows the carried binaries run there);
#   2. the CUDA-header parity tests;
#   3. the GPU op tests (every CUDA kernel against its CPU reference);
#   4. the CPU MoE benchmark on a small geometry;
#   5. the CUDA MoE layer and attention benchmarks;
#   6. generate --backend cuda on the tiny fixture, and bench generate (Qwen3-30B-A3B, dummy nvfp4).
# GPU op tests and CUDA benchmarks join this list as the CUDA MoE kernels land.
set -uo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build/release}
OUT=${OUT:-/tmp/moebius-out}
mkdir -p "$OUT"
export MOEBIUS_TEST_DATA_DIR="$PWD/tests/data"

declare -a rows
step() {  # step NAME COMMAND...
  local name=$1; shift
  local t0=$(date +%s%N)
  "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  local ms=$(( ($(date +%s%N) - t0) / 1000000 ))
  rows+=("$(printf '%-24s %-5s %8d ms  %s' "$name" "$([ $rc -eq 0 ] && echo ok || echo FAIL)" "$ms" "$(tail -n 1 "$OUT/$name.log" | cut -c1-70)")")
  return $rc
}

echo "== machine"; uname -a; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
echo "== dynamic libraries of the carried binaries"
ldd "$BUILD/moebius" "$BUILD/tests/moebius_gpu_tests" 2>&1 | sort -u | tee "$OUT/ldd.log"

[ -x "$BUILD/tests/moebius_tests" ] && step cpu-tests "$BUILD/tests/moebius_tests" --gtest_brief=1
[ -x "$BUILD/tests/moebius_cuda_host_tests" ] && step cuda-header-parity "$BUILD/tests/moebius_cuda_host_tests" --gtest_brief=1
[ -x "$BUILD/tests/moebius_gpu_tests" ] && step gpu-op-tests "$BUILD/tests/moebius_gpu_tests" --gtest_brief=1
probes() {  # the dev/cuda hardware probes that answer open questions in docs/PERF.md
  for p in probe_pdl_graph probe_decode_stream; do
    [ -x "$BUILD/dev_$p" ] && { echo "== $p"; "$BUILD/dev_$p" || return 1; }
  done
  return 0
}
step probes probes
step bench-moe-cpu "$BUILD/moebius" bench moe --backend cpu --geometry 1024,512,32,4 --format nvfp4 --tokens 1,16,128

# The CUDA MoE layer benchmarks (docs/PERF.md records them): Qwen3-30B-A3B in every format, and
# Qwen3-235B-A22B in NVFP4. All go to one log (the device returns at most 8 files).
bench_cuda() {
  for fmt in nvfp4 int4 int2 bf16; do
    "$BUILD/moebius" bench moe --backend cuda --geometry qwen3-30b-a3b --format $fmt --tokens 1,8,64,256,1024,4096 || return 1
  done
  "$BUILD/moebius" bench moe --backend cuda --geometry qwen3-235b-a22b --format nvfp4 --tokens 1,8,64,1024 || return 1
  # Where the prefill path starts to pay: both paths forced at the sizes around the switch.
  for p in decode prefill; do
    "$BUILD/moebius" bench moe --backend cuda --geometry qwen3-30b-a3b --format nvfp4 --tokens 128,256,512 --gemm-path $p || return 1
  done
}
step bench-moe-cuda bench_cuda
# Hardware counters for the decode GEMMs (MOEBIUS_NCU=1): where the T=1 time goes. ncu works on
# the Firecracker runtime only (KINDS.md); --clock-control none leaves the clocks alone.
if [ "${MOEBIUS_NCU:-0}" = 1 ] && command -v ncu >/dev/null; then
  step ncu-decode ncu --clock-control none --kernel-name regex:moe_ --launch-skip 40 --launch-count 6 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
    --section LaunchStats "$BUILD/moebius" bench moe --backend cuda --geometry qwen3-30b-a3b --format nvfp4 \
    --tokens 1 --iters 2
fi

# Per-kernel device time of whole-model decode steps (MOEBIUS_NCU_MODEL=1): which kernels the
# 4.2 ms per token of Qwen3-30B-A3B decode goes to (docs/PERF.md). Short context so the prefill
# part stays small; ncu serializes kernels, so this is kernel time without launch gaps.
if [ "${MOEBIUS_NCU_MODEL:-0}" = 1 ] && command -v ncu >/dev/null; then
  step ncu-model ncu --clock-control none --metrics gpu__time_duration.sum --print-summary per-kernel \
    "$BUILD/moebius" bench generate --geometry qwen3-30b-a3b --load-format dummy --experts nvfp4 \
    --context 256 --prefill 256 --decode-steps 4
fi

# The paged attention kernels, Qwen3-30B-A3B attention (nh 32, nkv 4, hd 128): decode GB/s of KV
# bytes and prefill TFLOP/s, a few configurations.
bench_attention() {
  "$BUILD/moebius" bench attention --mode decode --heads 32 --kv-heads 4 --head-dim 128 --context 1024,10240 --batch 1,8,64 || return 1
  "$BUILD/moebius" bench attention --mode prefill --heads 32 --kv-heads 4 --head-dim 128 --context 1024,8192 --batch 1,4 || return 1
}
step bench-attention bench_attention

# The whole CUDA model: generate on the tiny fixture (greedy, prints the logits hash), then
# Qwen3-30B-A3B with dummy NVFP4 experts: prefill tok/s and batch-1 decode tok/s at 1k and 10k
# context against the bytes floor.
step generate-tiny-cuda "$BUILD/moebius" generate --model tests/data/tiny-qwen3-moe --prompt-ids 1,2,3,4,5 \
  --max-tokens 16 --temperature 0 --backend cuda
step eval-logprobs-tiny-cuda "$BUILD/moebius" eval logprobs --model tests/data/tiny-qwen3-moe \
  --ref tests/data/tiny-qwen3-moe/logprobs_ref.safetensors --backend cuda --chunk 7
bench_generate() {
  "$BUILD/moebius" bench generate --geometry qwen3-30b-a3b --load-format dummy --experts nvfp4 \
    --context 1024,10240 --prefill 1024 --decode-steps 64 || return 1
}
step bench-generate bench_generate
cat "$OUT/gpu-op-tests.log" | grep -E "nmse|FAILED|Failure|PASSED" | head -120
cat "$OUT/bench-moe-cuda.log"
cat "$OUT/bench-attention.log"
cat "$OUT/probes.log"
cat "$OUT/generate-tiny-cuda.log"
cat "$OUT/eval-logprobs-tiny-cuda.log"
cat "$OUT/bench-generate.log"

echo
echo "== summary"
printf '%s\n' "${rows[@]}"
