#!/usr/bin/env bash
# Hopper prefill kernel on the H200 (sm_90), one command, under 7 minutes:
#   1. GPU tests of tests/test_prefill_hopper.py (float64 reference + portable kernel):
#      pipelined / warp-specialized kernels and dispatch (<= TEST_LIMIT s), then the rest (<= 160 s)
#   1b. benchmarks/memcheck_hopper.py under compute-sanitizer memcheck
#   2. benchmarks/bench_prefill_hopper.py: Hopper (synchronous, pipelined) vs portable vs
#      SDPA / FA4 BF16 (FA4 when `flash_attn.cute` imports), s8 GEMM floor; ends with a
#      table: us, TOP/s, x portable, x SDPA, x FA4 (<= 150 s; a timeout still prints
#      the table of what was measured)
# (The sm_90 SASS checks run on CPU in CI: tests/test_prefill_hopper.py -k compiles.)
# Writes 5 files directly under $OUT (default ./hopper_out): env.log, gpu_tests.log,
# memcheck.log, bench.log, prefill_hopper.jsonl (with NCU=1 also ncu_prefill.txt: Nsight
# Compute of one warp-specialized launch, benchmarks/ncu_prefill_hopper.py). Each step runs
# even if an earlier one failed.
# Usage (repo root): OUT=/some/dir bash benchmarks/hopper_gpu.sh
set -u
OUT=${OUT:-$PWD/hopper_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-hopper}
PY=${PY:-python3}
export PATH=$PATH:/usr/local/cuda/bin
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())
try:
    import flash_attn.cute; print('flash_attn.cute importable')
except Exception as e:
    print('flash_attn.cute not importable:', repr(e)[:200])" > "$OUT/env.log" 2>&1
cat "$OUT/env.log"
# the changed paths first (TESTS: a pytest -k expression), then the rest unless SKIP_REST=1
NEW=${TESTS:-"pipelined or warp_specialized or route or auto_takes"}
timeout ${TEST_LIMIT:-95} $PY -m pytest -q -p no:cacheprovider tests/test_prefill_hopper.py -m gpu -k "$NEW" -rfE --tb=short \
    > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests ($NEW) rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.log" | tail -15
if [ "${SKIP_REST:-0}" != 1 ]; then
  timeout 160 $PY -m pytest -q -p no:cacheprovider tests/test_prefill_hopper.py -m gpu -k "not ($NEW)" -rfE --tb=short \
      --durations=5 >> "$OUT/gpu_tests.log" 2>&1
  echo "gpu tests (the rest) rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.log" | tail -15
fi
# the warp-specialized kernel under compute-sanitizer memcheck (shared and global accesses)
timeout ${MEMCHECK_LIMIT:-120} compute-sanitizer --tool memcheck --error-exitcode 1 $PY benchmarks/memcheck_hopper.py \
    > "$OUT/memcheck.log" 2>&1
echo "memcheck rc=$?"; grep -E "^(ok|FAIL)|ERROR SUMMARY|Invalid" "$OUT/memcheck.log" | head -20
[ "${SKIP_BENCH:-0}" = 1 ] && exit 0
timeout ${BENCH_LIMIT:-150} $PY benchmarks/bench_prefill_hopper.py --out "$OUT" ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1
echo "bench rc=$?"; sed -n '/^case /,$p' "$OUT/bench.log"
[ "${NCU:-0}" = 1 ] || exit 0
# Nsight Compute of one warp-specialized launch (benchmarks/ncu_prefill_hopper.py, int8 D256
# prefix 28672), its details page and the per-instruction table read by ncu_source_table.py
timeout ${NCU_LIMIT:-150} ncu --clock-control none --kernel-name regex:_prefill_hopper_ws --launch-skip 3 \
    --launch-count 1 --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
    --section MemoryWorkloadAnalysis_Tables --section InstructionStats --section SourceCounters \
    -f -o /tmp/ncu_prefill env PYTHONPATH=$PYTHONPATH:$PWD/benchmarks $PY benchmarks/ncu_prefill_hopper.py \
    > "$OUT/ncu_prefill.txt" 2>&1
echo "ncu rc=$?"
ncu -i /tmp/ncu_prefill.ncu-rep --page details >> "$OUT/ncu_prefill.txt" 2>&1
ncu -i /tmp/ncu_prefill.ncu-rep --page source --csv --print-source sass > /tmp/ncu_prefill.csv 2>&1
$PY benchmarks/ncu_source_table.py /tmp/ncu_prefill.csv >> "$OUT/ncu_prefill.txt" 2>&1
grep -E "Duration|Issue Slots Busy|No Eligible|excessive|excess|samples" "$OUT/ncu_prefill.txt" | head -24
