#!/usr/bin/env bash
# Every decode GPU check and measurement in one command of at most 8 minutes, from the
# repo root:
#
#   OUT=/some/dir bash benchmarks/decode_gpu.sh
#
# Steps (each under its own timeout; a failing step is reported and the next one runs):
#   tests     decode / attention / safety tests on the GPU (graph capture included), in
#             parallel pytest processes (compilation dominates), no -x: every failure is
#             listed; compute-sanitizer memcheck over the bad-metadata tests (block ids
#             out of range, seq_lens beyond the table, metadata changed after planning)
#             runs alongside and must report "ERROR SUMMARY: 0 errors"
#   goals     benchmarks/bench_decode_goals.py: SASS, q1 vs q4 at bs16 L32k, bs1/16/64 x
#             L8k/32k graph + eager (default, fused merge, merge kernel, our BF16), the
#             FlashInfer / SDPA peers when importable (PYTHONPATH may name FlashInfer's
#             site dir), a goals table
#   host      benchmarks/bench_host_overhead.py (real launches): wall time per call of
#             AttentionPlan.run and attention() over 200 back-to-back calls, bs1/16 L8k
# Six files land directly in $OUT: tests.log (GPU state first), memcheck.log, goals.log,
# decode_goals.jsonl, host.log, host_overhead.jsonl.
set -u
export PYTHONPATH=src:benchmarks${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/fi_ws}
export FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0a}
[ -d /usr/local/cuda ] && export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
OUT=${OUT:-/tmp/int8attn_gpu}
mkdir -p "$OUT"
SHARDS=${SHARDS:-6}
T_START=$(date +%s)

step() {  # step NAME TIMEOUT_S CMD...  (output appended to $OUT/NAME.log)
  local name=$1 limit=$2
  shift 2
  if [ -n "${STEPS:-}" ] && [[ " $STEPS " != *" $name "* ]]; then
    echo "=== $name: not in STEPS, skipped"
    return
  fi
  local t0=$(date +%s)
  echo "=== $name (limit ${limit}s): $*" | tee -a "$OUT/$name.log"
  timeout --signal=TERM --kill-after=10 "$limit" "$@" >>"$OUT/$name.log" 2>&1
  local rc=$?
  echo "=== $name: rc=$rc in $(( $(date +%s) - t0 ))s" | tee -a "$OUT/$name.log"
  tail -n 25 "$OUT/$name.log"
}

tests_and_memcheck() {
  local ids="$OUT/.test_ids" pids=() i rc=0
  python3 -m pytest --collect-only -q -p no:cacheprovider tests/test_decode_safety.py tests/test_decode.py \
    tests/test_attention.py -k "${TESTS_K:-not pipelined}" 2>/dev/null | grep "::" >"$ids"
  echo "$(wc -l <"$ids") tests in $SHARDS shards"
  SAN=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
  ( echo "=== memcheck: ${SAN:-compute-sanitizer} over tests/test_decode_safety.py"
    "${SAN:-compute-sanitizer}" --tool memcheck --target-processes all --error-exitcode 9 \
      python3 -m pytest -q -p no:cacheprovider tests/test_decode_safety.py
    echo "=== memcheck: rc=$?" ) >"$OUT/memcheck.log" 2>&1 &
  local san_pid=$!
  for i in $(seq 0 $((SHARDS - 1))); do
    awk -v n="$SHARDS" -v k="$i" 'NR % n == k' "$ids" >"$ids.$i"
    [ -s "$ids.$i" ] || continue
    python3 -m pytest -q -p no:cacheprovider -rfEs $(cat "$ids.$i") >"$ids.$i.log" 2>&1 &
    pids+=($!)
  done
  for i in "${!pids[@]}"; do wait "${pids[$i]}" || rc=1; done
  for i in $(seq 0 $((SHARDS - 1))); do
    [ -f "$ids.$i.log" ] && { echo "--- shard $i"; cat "$ids.$i.log"; }
  done
  wait "$san_pid"
  grep -h "ERROR SUMMARY" "$OUT/memcheck.log" | tail -1
  rm -f "$ids" "$ids".*
  return $rc
}

if [ "${1:-}" = "--tests" ]; then  # the tests step, run under its timeout by the line below
  tests_and_memcheck
  exit $?
fi

nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv >"$OUT/tests.log" 2>&1
step tests 170 bash "$0" --tests
grep -h "passed\|failed\|ERROR SUMMARY" "$OUT/tests.log" "$OUT/memcheck.log" | tail -n $((SHARDS + 2))
step goals 250 python3 benchmarks/bench_decode_goals.py --out "$OUT" --deadline 215
step host 45 python3 benchmarks/bench_host_overhead.py --mode real --batches 1,16 --out "$OUT" --deadline 35
echo "total $(( $(date +%s) - T_START ))s"
ls -la "$OUT"
