#!/usr/bin/env bash
# Hopper prefill kernel on the H200 (sm_90), one command, under 7 minutes:
#   1. GPU tests of tests/test_prefill_hopper.py (float64 reference + portable kernel; the
#      synchronous and the pipelined schedule)                                    <= 215 s
#   2. benchmarks/bench_prefill_hopper.py: Hopper (synchronous, pipelined) vs portable vs
#      SDPA / FA4 BF16 (FA4 when `flash_attn.cute` imports), s8 GEMM floor; ends with a
#      table: us, TOP/s, x portable, x SDPA, x FA4                                 <= 185 s
# (The sm_90 SASS checks run on CPU in CI: tests/test_prefill_hopper.py -k compiles.)
# Writes 4 files directly under $OUT (default ./hopper_out): env.log, gpu_tests.log,
# bench.log, prefill_hopper.jsonl. Each step runs even if an earlier one failed.
# Usage (repo root): OUT=/some/dir bash benchmarks/hopper_gpu.sh
set -u
OUT=${OUT:-$PWD/hopper_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-hopper}
PY=${PY:-python3}
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())
try:
    import flash_attn.cute; print('flash_attn.cute importable')
except Exception as e:
    print('flash_attn.cute not importable:', repr(e)[:200])" > "$OUT/env.log" 2>&1
cat "$OUT/env.log"
timeout 215 $PY -m pytest -q -p no:cacheprovider tests/test_prefill_hopper.py -m gpu -rfE --tb=short --durations=5 \
    > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.log" | tail -25
timeout 185 $PY benchmarks/bench_prefill_hopper.py --out "$OUT" > "$OUT/bench.log" 2>&1
echo "bench rc=$?"; sed -n '/^case /,$p' "$OUT/bench.log"
