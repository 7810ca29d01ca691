#!/usr/bin/env bash
# The GPU side of the non-finite / bad-metadata / head_dim work, one device call (<= 5 min
# on an H200, compilation included), from the repo root:
#
#   OUT=/some/dir bash benchmarks/safety_gpu.sh
#
# Steps (each under its own timeout; a failing step is reported and the next one runs):
#   tests     write_kv / producer test files on the GPU, and prefill's GPU tests (padded
#             head_dims, poisoned token + inf query + bad block id at default tiles, the
#             existing default-config / PTX checks)
#   memcheck  compute-sanitizer memcheck over benchmarks/memcheck_cases.py (value checks
#             off), one process per op: zero errors expected, every case prints "ok"
#   head_dim  prefill D=96 against D=128 (benchmarks/bench_head_dim.py)
# Logs land in $OUT/*.log, benchmark rows in $OUT/head_dim.jsonl; a summary is printed.
set -u
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/int8attn_safety}
mkdir -p "$OUT"
status=0

step() {  # step NAME TIMEOUT_S CMD...
  local name=$1 limit=$2
  shift 2
  local t0=$(date +%s)
  echo "=== $name (limit ${limit}s): $*"
  timeout --signal=TERM --kill-after=10 "$limit" "$@" >>"$OUT/$name.log" 2>&1
  local rc=$?
  echo "=== $name: rc=$rc in $(( $(date +%s) - t0 ))s"
  tail -n 4 "$OUT/$name.log"
  [ $rc -eq 0 ] || status=1
}

step tests 150 python3 -m pytest -q -p no:warnings tests/test_write.py tests/test_producer.py \
  "tests/test_prefill.py::test_gpu_padded_head_dims" \
  "tests/test_prefill.py::test_gpu_default_tiles_poisoned_token_query_and_bad_block_id" \
  "tests/test_prefill.py::test_gpu_default_config" "tests/test_prefill.py::test_gpu_8bit_pv_needs_32_key_tiles"
SAN=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
for op in write producer prefill decode; do
  step memcheck 90 env INT8ATTN_CHECK_VALUES=0 "$SAN" --tool memcheck --error-exitcode 1 \
    python3 benchmarks/memcheck_cases.py --op $op
done
grep -h "ERROR SUMMARY\|failure(s)" "$OUT/memcheck.log"
step head_dim 90 python3 benchmarks/bench_head_dim.py --out "$OUT"
exit $status
