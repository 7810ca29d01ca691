#!/usr/bin/env bash
# Every GPU measurement of the project in as few device calls as possible, from the repo root:
#
#   OUT=/some/dir bash benchmarks/gpu_all.sh smoke     # decode + prefill at toy sizes, every peer (~2 min)
#   OUT=/some/dir bash benchmarks/gpu_all.sh kernels   # decode, producer, prefill, head_dim, decode_safe, timeline,
#                                                      # host, gate (~16 min)
#   OUT=/some/dir bash benchmarks/gpu_all.sh tests     # the kernel test files on the GPU
#   OUT=/some/dir bash benchmarks/gpu_all.sh serve     # transformers e2e + 2-GPU tensor parallel
#   STEPS="decode producer" OUT=... bash benchmarks/gpu_all.sh kernels   # only these steps
#
# Each step runs under its own timeout; a failing step is reported and the next one runs.
# Peers (FlashInfer, FlashAttention-4) are timed when importable (put them on PYTHONPATH);
# their first calls JIT-compile, so give a run with peers more time, e.g.
# BENCH_DEADLINE_S=300 DECODE_LIMIT=400 PREFILL_ARGS="--budget-s 300" PREFILL_LIMIT=480.
# Everything lands in $OUT/<part>.tgz (the device tool returns at most 8 files), plus a log.
set -u
part=${1:-kernels}
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/int8attn_gpu}
work="$OUT/$part"
mkdir -p "$work"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,utilization.gpu --format=csv 2>&1 | tee "$work/nvidia-smi.txt"

step() {  # step NAME TIMEOUT_S CMD...
  local name=$1 limit=$2
  shift 2
  if [ -n "${STEPS:-}" ] && [[ " $STEPS " != *" $name "* ]]; then
    echo "=== $name: not in STEPS, skipped"
    return
  fi
  local t0=$(date +%s)
  echo "=== $name (limit ${limit}s): $*"
  timeout --signal=TERM --kill-after=10 "$limit" "$@" >"$work/$name.log" 2>&1
  local rc=$?
  echo "=== $name: rc=$rc in $(( $(date +%s) - t0 ))s"
  tail -n 25 "$work/$name.log"
}

case "$part" in
  smoke)
    step decode "${DECODE_LIMIT:-240}" python3 benchmarks/bench_decode.py --smoke --out "$work/decode"
    step prefill "${PREFILL_LIMIT:-300}" python3 benchmarks/bench_prefill.py --smoke --out "$work/prefill"
    ;;
  kernels)
    step decode "${DECODE_LIMIT:-230}" python3 benchmarks/bench_decode.py ${DECODE_ARGS:-} --out "$work/decode"
    # the write paths of an older commit (default: the last one with row-major 8-bit V
    # pages), side by side with today's; PRODUCER_BASE_FILE for a checkout without git
    git show "${PRODUCER_BASE:-889bb9f}:src/int8attn/kernels/quantize.py" >"$work/quantize_base.py" 2>/dev/null \
      || cp "${PRODUCER_BASE_FILE:-/dev/null}" "$work/quantize_base.py"
    step producer 150 env OUT="$work" INT8ATTN_CHECK_VALUES=0 PYTHONPATH="src:benchmarks" \
      python3 benchmarks/compare_producer_rounds.py "$work/quantize_base.py" rows_v transposed_v vt_layout
    step prefill "${PREFILL_LIMIT:-190}" python3 benchmarks/bench_prefill.py ${PREFILL_ARGS:-} --out "$work/prefill"
    step head_dim "${HEAD_DIM_LIMIT:-120}" python3 benchmarks/bench_head_dim.py --out "$work/head_dim"
    step decode_safe "${DECODE_SAFE_LIMIT:-120}" python3 benchmarks/bench_decode_safe.py --out "$work/decode_safe"
    step timeline "${TIMELINE_LIMIT:-120}" python3 benchmarks/timeline_decode.py --out "$work/timeline"
    step host "${HOST_LIMIT:-120}" python3 benchmarks/bench_host_overhead.py --out "$work/host"
    step gate "${GATE_LIMIT:-140}" python3 benchmarks/bench_gate.py --out "$work/gate-report" --record "$work/gate.jsonl" \
      --sass-dir "$work/gate-sass" --time-budget 100
    ;;
  tests)
    step gpu_tests 300 python3 -m pytest -q -p no:cacheprovider -rs tests/test_cache.py tests/test_write.py \
      tests/test_producer.py tests/test_decode.py tests/test_prefill.py tests/test_attention.py \
      tests/test_library.py tests/test_checks.py
    ;;
  serve)
    step gpu_tests 120 python3 -m pytest -q -p no:cacheprovider -m "not slow" -rs \
      tests/test_decode.py tests/test_attention.py tests/test_prefill.py tests/test_checks.py -k "cuda or graph or gpu"
    step e2e 330 env OUT="$work/e2e" bash benchmarks/e2e_gpu.sh
    ;;
esac
tar czf "$OUT/$part.tgz" -C "$OUT" "$part"
ls -la "$OUT"
