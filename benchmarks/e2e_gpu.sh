#!/usr/bin/env bash
# End-to-end GPU run of issue 6 ("Serve it") on a 2x H200 box, from the repo root:
#
#   OUT=/some/dir bash benchmarks/e2e_gpu.sh
#   OUT=/some/dir E2E_SKIP_TESTS=1 bash benchmarks/e2e_gpu.sh   # without step 1 (tests already run)
#
# Steps (each guarded by a timeout; a failing step is reported and the next one runs):
#   1. GPU tests: torch.library ops under CUDA-graph capture/replay (changing seq_lens and
#      block tables) and inductor; transformers generate(), CUDA-graph decode == eager decode.
#   2. benchmarks/bench_e2e.py: accuracy vs transformers SDPA BF16 (256 greedy steps),
#      tokens/s at batch 1 and 32 with 8k prompts (eager and CUDA graph; one child process
#      per path and batch), op overhead, profiler proof of the kernels that ran.
#   3. benchmarks/tp_generate.py under torchrun on 2 GPUs: transformers tensor parallel with an
#      int8attn cache per rank; tokens vs one GPU; per-GPU throughput.
# Everything lands under $OUT (at most 8 files): summary.md, e2e.jsonl, tp_e2e.jsonl,
# e2e_summary.md, tests.log, bench.log, tp.log. Copy the .jsonl files into benchmarks/results/.
# Typical run: ~4 minutes; worst case bounded by the step timeouts (~9 minutes; ~7.5 with
# E2E_SKIP_TESTS=1).

set -u
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
# NVLink multicast off: it can take the host's shared GPUs out of service.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
OUT=${OUT:-/tmp/int8attn_e2e}
mkdir -p "$OUT"
SUMMARY="$OUT/summary.md"
T0=$(date +%s)
STEPS=()

run_step() {  # run_step NAME TIMEOUT_S LOGFILE CMD...
  local name=$1 limit=$2 logfile=$3
  shift 3
  local start rc
  start=$(date +%s)
  echo "=== $name (limit ${limit}s): $*"
  timeout --signal=TERM --kill-after=15 "$limit" "$@" >"$logfile" 2>&1
  rc=$?
  local took=$(( $(date +%s) - start ))
  local status="ok"
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then status="TIMEOUT"; elif [ $rc -ne 0 ]; then status="FAILED (rc=$rc)"; fi
  STEPS+=("| $name | $status | ${took}s |")
  echo "=== $name: $status in ${took}s"
  if [ "$status" != "ok" ]; then
    echo "--- last lines of $logfile:"
    tail -n 40 "$logfile"
  fi
}

{
  echo "# int8attn end-to-end GPU run"
  echo
  echo '```'
  nvidia-smi -L 2>&1 || true
  python3 -c "import torch, triton, transformers, sys; print('python', sys.version.split()[0], '| torch', torch.__version__, '| triton', triton.__version__, '| transformers', transformers.__version__, '| GPUs', torch.cuda.device_count())" 2>&1
  git rev-parse --short HEAD 2>/dev/null || true
  echo '```'
  echo
} >"$SUMMARY"
cat "$SUMMARY"

if [ "${E2E_SKIP_TESTS:-0}" = "1" ]; then
  STEPS+=("| gpu tests | SKIPPED (E2E_SKIP_TESTS=1) | 0s |")
  echo "(gpu tests skipped: E2E_SKIP_TESTS=1)" >"$OUT/tests.log"
else
  run_step "gpu tests" 100 "$OUT/tests.log" \
    python3 -m pytest -q -p no:cacheprovider tests/test_library.py tests/test_integration_transformers.py \
    -k "cuda_graph or inductor or generate_end_to_end or attention_op_matches or continuous_batching"
fi

# E2E_ARGS / TP_ARGS add arguments (e.g. --tiny for a dry run without a GPU; E2E_TP_FORCE=1 then
# runs the 2-process tensor-parallel step on the CPU with gloo).
# shellcheck disable=SC2086
run_step "bench_e2e" 330 "$OUT/bench.log" \
  python3 benchmarks/bench_e2e.py --out "$OUT" ${E2E_ARGS:-}

NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [ "${NGPU:-0}" -ge 2 ] || [ "${E2E_TP_FORCE:-0}" = "1" ]; then
  # shellcheck disable=SC2086
  run_step "tp_generate (2 GPUs)" 130 "$OUT/tp.log" \
    torchrun --standalone --nproc-per-node 2 benchmarks/tp_generate.py --out "$OUT" ${TP_ARGS:-}
else
  STEPS+=("| tp_generate (2 GPUs) | SKIPPED (${NGPU} GPU) | 0s |")
fi

{
  echo "## Steps"
  echo
  echo "| step | status | time |"
  echo "|---|---|---|"
  printf '%s\n' "${STEPS[@]}"
  echo
  echo "total $(( $(date +%s) - T0 ))s"
  echo
  echo "## Tests"
  echo
  echo '```'
  tail -n 6 "$OUT/tests.log" 2>/dev/null
  echo '```'
  echo
  echo "## End to end (bench_e2e.py)"
  echo
  cat "$OUT/e2e_summary.md" 2>/dev/null || echo "(no summary: see bench.log)"
  echo
  echo "## Tensor parallel (tp_generate.py)"
  echo
  python3 - "$OUT/tp_e2e.jsonl" <<'EOF' 2>&1 || true
import json, sys
try:
    rows = [json.loads(l) for l in open(sys.argv[1])]
except OSError:
    print("(no tp_e2e.jsonl: see tp.log)")
    sys.exit(0)
for r in rows:
    if r.get("section") == "tp_tokens":
        print(f"- tokens TP=2 vs one GPU (int8attn, batch {r['batch']}, prompt {r['prompt_len']}, {r['steps']} steps): "
              f"identical={r['tokens_match_single_gpu']}, agreement {r['token_agreement']:.3f}, first divergence "
              f"{r['first_divergence_step']}; teacher-forced logits rel L2 median {r['teacher_forced_logits_rel_l2_median']:.2e}, "
              f"max {r['teacher_forced_logits_rel_l2_max']:.2e}; SDPA control agreement {r['sdpa_token_agreement']:.3f}, "
              f"teacher-forced logits rel L2 median {r.get('sdpa_teacher_forced_logits_rel_l2_median', float('nan')):.2e}; "
              f"int8attn vs SDPA rel L2 median one GPU {r.get('int8attn_vs_sdpa_rel_l2_median_single_gpu', float('nan')):.2e}, "
              f"TP {r.get('int8attn_vs_sdpa_rel_l2_median_tp', float('nan')):.2e}; local heads per rank: "
              f"{r['local_q_heads']} q / {r['local_kv_heads']} KV; sharded tensors differing from the reference: "
              f"{r.get('sharded_state_mismatches', 'n/a')}")
print()
print("| setup | mode | batch | tokens/s | per GPU | ms/step | per-GPU vs one GPU |")
print("|---|---|---|---|---|---|---|")
for r in rows:
    if r.get("section") == "tp_throughput":
        per = r.get("per_gpu_tokens_per_s", r["tokens_per_s"])
        rel = r.get("per_gpu_vs_single_gpu")
        print(f"| {r['setup']} | {r['mode']} | {r['batch']} | {r['tokens_per_s']:.1f} | {per:.1f} | {r['ms_per_step']:.3f} | "
              f"{'' if rel is None else f'{rel:.2f}x'} |")
for r in rows:
    if r.get("section") == "tp_error":
        print(f"- FAILED: {r['error']}")
EOF
} >>"$SUMMARY"

echo
cat "$SUMMARY"
ls -la "$OUT"
