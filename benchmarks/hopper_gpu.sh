#!/usr/bin/env bash
# Hopper prefill kernel on the H200 (sm_90), one command, ~6 minutes:
#   1. SASS check: every variant compiled for sm_90 (tests/test_prefill_hopper.py -k compiles)
#   2. GPU tests of tests/test_prefill_hopper.py (float64 reference + portable kernel)
#   3. benchmarks/bench_prefill_hopper.py (Hopper vs portable vs SDPA / FA4 BF16, s8 GEMM floor)
# Logs and rows under $OUT (default ./hopper_out). Each step runs even if an earlier one failed.
# Usage (repo root): OUT=/some/dir bash benchmarks/hopper_gpu.sh
set -u
OUT=${OUT:-$PWD/hopper_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-hopper}
PY=${PY:-python3}
python_info() { $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"; }
python_info 2>&1 | tee "$OUT/env.log"
timeout 120 $PY -m pytest -q -x -p no:cacheprovider tests/test_prefill_hopper.py -k compiles -rA > "$OUT/sass_check.log" 2>&1
echo "sass check rc=$?"; tail -3 "$OUT/sass_check.log"
timeout 210 $PY -m pytest -q -p no:cacheprovider tests/test_prefill_hopper.py -m gpu -rfE --tb=short --durations=10 > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$?"; tail -5 "$OUT/gpu_tests.log"
timeout 240 $PY benchmarks/bench_prefill_hopper.py --out "$OUT" > "$OUT/bench.log" 2>&1
echo "bench rc=$?"; grep -v "^ " "$OUT/bench.log" | tail -40
