#!/usr/bin/env bash
# Every GPU measurement of the project in as few device calls as possible, from the repo root:
#
#   OUT=/some/dir bash benchmarks/gpu_all.sh kernels   # decode, prefill, gate (~8 min)
#   OUT=/some/dir bash benchmarks/gpu_all.sh serve     # transformers e2e + 2-GPU tensor parallel
#
# Each step runs under its own timeout; a failing step is reported and the next one runs.
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
  local t0=$(date +%s)
  echo "=== $name (limit ${limit}s): $*"
  timeout --signal=TERM --kill-after=10 "$limit" "$@" >"$work/$name.log" 2>&1
  local rc=$?
  echo "=== $name: rc=$rc in $(( $(date +%s) - t0 ))s"
  tail -n 25 "$work/$name.log"
}

case "$part" in
  kernels)
    step decode 230 python3 benchmarks/bench_decode.py --out "$work/decode"
    step prefill 190 python3 benchmarks/bench_prefill.py ${PREFILL_ARGS:-} --out "$work/prefill"
    step gate 140 python3 benchmarks/bench_gate.py --out "$work/gate-report" --record "$work/gate.jsonl" \
      --sass-dir "$work/gate-sass" --time-budget 100
    ;;
  serve)
    step gpu_tests 120 python3 -m pytest -q -p no:cacheprovider -m "not slow" -rs \
      tests/test_decode.py tests/test_attention.py tests/test_prefill.py tests/test_checks.py -k "cuda or graph or gpu"
    step e2e 330 env OUT="$work/e2e" bash benchmarks/e2e_gpu.sh
    ;;
esac
tar czf "$OUT/$part.tgz" -C "$OUT" "$part"
ls -la "$OUT"
