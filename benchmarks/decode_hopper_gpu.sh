#!/usr/bin/env bash
# The Hopper multi-token decode kernels on the H200 (sm_90), one command, under 9 minutes:
#   1. GPU tests of tests/test_decode_hopper.py (+ TEST_FILES), xdist when installed
#   2. benchmarks/memcheck_hopper.py --decode-only under compute-sanitizer memcheck
#   3. benchmarks/bench_decode_hopper.py (BENCH_ARGS, default: int8 q4 and q2, splits 2 and 4)
#   4. the launched kernels' SASS (cuobjdump of the cubins in the Triton cache): MMA counts
#   5. with NCU=1: Nsight Compute of one keys-on-M launch with two and three consumers
#      (benchmarks/ncu_decode_hopper.py; <= NCU_LIMIT s each), its details page and the
#      per-instruction table read by benchmarks/ncu_source_table.py
# Writes under $OUT: env.log, tests.log, memcheck.log, bench.log, sass.log, decode_hopper.jsonl
# (and ncu_2.txt, ncu_3.txt).
# Usage (repo root): OUT=/some/dir bash benchmarks/decode_hopper_gpu.sh
set -u
OUT=${OUT:-$PWD/decode_hopper_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-decode-hopper}
export PATH=$PATH:/usr/local/cuda/bin
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, \
torch.cuda.get_device_name())" > "$OUT/env.log" 2>&1
cat "$OUT/env.log"
XD=$(python3 -c "import xdist" 2>/dev/null && echo "-n 12 --dist load")
# SIGINT: pytest prints its summary (failure names) when the limit cuts it
timeout -s INT ${TEST_LIMIT:-170} python3 -m pytest -q -p no:cacheprovider $XD -rfE --tb=short \
    tests/test_decode_hopper.py ${TEST_FILES:-} > "$OUT/tests.log" 2>&1
echo "tests rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.log" | tail -25
timeout ${MEMCHECK_LIMIT:-150} compute-sanitizer --tool memcheck --error-exitcode 1 \
    python3 benchmarks/memcheck_hopper.py --decode-only > "$OUT/memcheck.log" 2>&1
echo "memcheck rc=$?"; grep -E "^(ok|FAIL)|ERROR SUMMARY|Invalid" "$OUT/memcheck.log" | head -30
timeout -s INT ${BENCH_LIMIT:-240} python3 benchmarks/bench_decode_hopper.py --out "$OUT" \
    ${BENCH_ARGS:---kv int8 --q 4,2 --splits 2,4 --budget-s 220} > "$OUT/bench.log" 2>&1
echo "bench rc=$?"; tail -40 "$OUT/bench.log"
for f in $(find "$TRITON_CACHE_DIR" -name "_decode_hopper*.cubin"); do
  echo "== $f"; cuobjdump --dump-sass "$f" | grep -oE "\b(IGMMA|QGMMA|HGMMA|IMMA)[.A-Z0-9]*" | sort | uniq -c
  cuobjdump --dump-sass "$f" | grep -cE "\b(LDL|STL)\b" | sed 's/^/local-memory instructions: /'
done > "$OUT/sass.log" 2>&1
cat "$OUT/sass.log"
[ "${NCU:-0}" = 1 ] || exit 0
for n in 2 3; do
  timeout ${NCU_LIMIT:-120} ncu --clock-control none --kernel-name regex:_decode_hopper_swapped --launch-skip 3 \
      --launch-count 1 --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
      --section MemoryWorkloadAnalysis_Tables --section InstructionStats --section SourceCounters \
      -f -o /tmp/ncu_$n python3 benchmarks/ncu_decode_hopper.py --consumers $n > "$OUT/ncu_$n.txt" 2>&1
  echo "ncu consumers=$n rc=$?"
  ncu -i /tmp/ncu_$n.ncu-rep --page details >> "$OUT/ncu_$n.txt" 2>&1
  ncu -i /tmp/ncu_$n.ncu-rep --page source --csv --print-source sass > /tmp/ncu_$n.csv 2>&1
  python3 benchmarks/ncu_source_table.py /tmp/ncu_$n.csv >> "$OUT/ncu_$n.txt" 2>&1
  grep -E "Duration|Issue Slots Busy|No Eligible|excessive|excess|samples" "$OUT/ncu_$n.txt" | head -24
done
