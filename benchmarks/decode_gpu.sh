#!/usr/bin/env bash
# Every decode GPU check and measurement of the one-launch / safe-metadata / host-path work,
# in one command of at most ~8 minutes, from the repo root:
#
#   OUT=/some/dir bash benchmarks/decode_gpu.sh
#
# Steps (each under its own timeout; a failing step is reported and the next one runs):
#   tests     decode / attention / safety tests on the GPU (graph capture included)
#   memcheck  compute-sanitizer memcheck over the bad-metadata tests (block ids out of
#             range, seq_lens beyond the table, metadata changed after planning): must
#             report "ERROR SUMMARY: 0 errors"
#   goals     benchmarks/bench_decode_goals.py: SASS (IGMMA / QGMMA in the split kernel),
#             q1 vs q4 at bs16 L32k, bs1/16/64 x L8k/32k graph + eager, fused merge vs the
#             merge kernel
#   host      benchmarks/bench_host_overhead.py (real launches): wall time per call of
#             AttentionPlan.run and attention() over 200 back-to-back calls, bs1/16 L8k
# Everything lands in $OUT/decode_gpu.tgz plus $OUT/decode_gpu/*.log.
set -u
export PYTHONPATH=src:benchmarks${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/int8attn_gpu}
work="$OUT/decode_gpu"
mkdir -p "$work"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv 2>&1 | tee "$work/nvidia-smi.txt"

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
  tail -n 30 "$work/$name.log"
}

step tests 130 python3 -m pytest -q -p no:cacheprovider -rs -x tests/test_decode_safety.py tests/test_decode.py \
  tests/test_attention.py -k "not pipelined"
SAN=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
step memcheck 110 "${SAN:-compute-sanitizer}" --tool memcheck --target-processes all --error-exitcode 9 \
  python3 -m pytest -q -p no:cacheprovider -x tests/test_decode_safety.py
grep -h "ERROR SUMMARY" "$work/memcheck.log" | tail -3
step goals 160 python3 benchmarks/bench_decode_goals.py --out "$work"
step host 70 python3 benchmarks/bench_host_overhead.py --mode real --batches 1,16 --out "$work" --deadline 45
tar czf "$OUT/decode_gpu.tgz" -C "$OUT" decode_gpu
ls -la "$OUT"
