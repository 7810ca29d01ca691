#!/usr/bin/env bash
# Every GPU test file in parallel pytest workers (pytest-xdist when installed, else one shard
# per group of files; compilation dominates their time and the GPU box has 16 cores), with
# compute-sanitizer memcheck over the bad-metadata cases alongside, from the repo root:
#
#   OUT=/some/dir bash benchmarks/gpu_tests.sh            # SHARDS=8 LIMIT=240 by default
#
#   FILES="tests/test_decode.py ..." MEMCHECK_OPS="decode" OUT=... bash benchmarks/gpu_tests.sh   # a subset
# No -x: every failure is listed. Writes $OUT/tests.log (all shards, failures first) and
# $OUT/memcheck.log ("ERROR SUMMARY: 0 errors" per run expected).
set -u
export PYTHONPATH=src:benchmarks${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/int8attn_gpu_tests}
SHARDS=${SHARDS:-8}
LIMIT=${LIMIT:-240}
mkdir -p "$OUT"
tmp=$(mktemp -d)
files=${FILES:-$(ls tests/test_*.py)}
# shards by file (test ids hold spaces and brackets), larger files first onto the lightest shard
python3 - "$tmp" "$SHARDS" $files <<'PY'
import os, sys
tmp, n, files = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
load = [[0, []] for _ in range(n)]
for f in sorted(files, key=os.path.getsize, reverse=True):
    s = min(load, key=lambda x: x[0])
    s[0] += os.path.getsize(f)
    s[1].append(f)
for i, (_, fs) in enumerate(load):
    open(f"{tmp}/ids.{i:02d}", "w").write(" ".join(fs))
PY
echo "$(echo $files | wc -w) test files in $SHARDS shards (limit ${LIMIT}s)" | tee "$OUT/tests.log"
SAN=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
(
  for op in ${MEMCHECK_OPS:-write producer prefill decode}; do
    INT8ATTN_CHECK_VALUES=0 timeout $([ $op = decode ] && echo 240 || echo 90) "$SAN" --tool memcheck --error-exitcode 9 \
      python3 benchmarks/memcheck_cases.py --op $op 2>&1 | tail -3
  done
) >"$OUT/memcheck.log" 2>&1 &
san=$!
if [ "${XDIST:-1}" != 0 ] && python3 -c "import xdist" 2>/dev/null; then
  # pytest-xdist spreads single tests over the workers (a file's compiles no longer sit on one);
  # -v names each test as it finishes, so a run cut by LIMIT still says which ones passed
  echo "pytest-xdist: one run, $SHARDS workers" | tee -a "$OUT/tests.log"
  rm -f "$tmp"/ids.??
  timeout "$LIMIT" python3 -m pytest -v -p no:cacheprovider -n "$SHARDS" --dist load -rfE --tb=short $files \
    >"$tmp/ids.00.log" 2>&1
else
  for f in "$tmp"/ids.??; do
    timeout "$LIMIT" python3 -m pytest -q -p no:cacheprovider -rfE --tb=short $(cat "$f") >"$f.log" 2>&1 &
  done
fi
wait
for f in "$tmp"/ids.??.log; do grep -E "^(FAILED|ERROR) " "$f"; done | tee -a "$OUT/tests.log"
for f in "$tmp"/ids.??.log; do echo "--- shard $f: $(tail -1 "$f")"; done | tee -a "$OUT/tests.log"
for f in "$tmp"/ids.??.log; do cat "$f"; done >>"$OUT/tests.log"
wait $san 2>/dev/null
grep -h "ERROR SUMMARY\|failure" "$OUT/memcheck.log"
