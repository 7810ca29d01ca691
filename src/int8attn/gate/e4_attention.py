"""E4 -- our INT8 decode and chunked prefill vs the same kernels on a BF16 cache.

The headline rows: Qwen3.5-27B full-attention layer (24 query heads, 4 KV heads, head_dim
256, block_size 16) on an INT8 cache (native INT8 QK and PV, query quantized inside the
call) against a BF16 cache holding the same tokens, through the same route for both:

* decode: what a serving engine runs per layer. Each path gets an
  :class:`int8attn.AttentionPlan` made once, outside the timed window
  (``plan_attention``: one host sync that checks the metadata values and sizes the split
  count and workspace); the window times ``plan.run(...)``, the per-layer call (INT8:
  the query quantization runs inside it). The plan's own host time is in the case notes;
* prefill: ``int8attn.ops.prefill.prefill_attention`` (milliseconds per call: host
  costs do not matter there).

* decode: batch x context in {16 x 8192, 16 x 32768, 1 x 32768, 64 x 8192}, one new token
  per sequence, plus multi-token decode (4 query tokens per sequence) at 16 x 8192;
* prefill: one chunk of 4096 query tokens over a cached prefix of 0 and 28672 tokens.

Accuracy: decode output rows all checked; prefill checks the first and last 64 query rows
of the chunk, against float64 attention over the exact BF16 tokens. Prefill cases run
only when ``int8attn.ops.prefill`` is present.
"""

from __future__ import annotations

import statistics
import time

import torch

from . import metrics
from .attn_common import (
    build_cache_set, decode_scales, head_shape, kv_bytes, make_queries, missing_modules, planned_attention_call,
    reference_attention,
)
from .results import ExperimentResult, ScaleInfo
from .runner import GateContext, PathSpec, ProofSpec, StepSpec, run_case

KEY = "E4"
TITLE = "INT8 KV decode and chunked prefill vs BF16 KV, our kernels"
CLAIM = ("Design target (docs/design.md §3): decode is memory-bound, so INT8 K+V can reach up to ~2x BF16 "
         "decode; prefill is matrix-bound and INT8 tensor cores double the rate, ~2x at most. Calibration: a "
         "plain Triton split-K INT8 decode reached 1.78x SDPA BF16 at bs16 L32k.")
ACCURACY_BOUND = 0.05
ACCURACY_NOTE = "attention output vs float64 attention over the exact BF16 tokens: rel-L2 <= 0.05"
REQUIRES = ("int8attn.ops.decode", "int8attn.ops.write")

SIZES = {
    "tiny": dict(heads=(6, 1), head_dim=128,
                 decode=[(2, 80, 1), (1, 120, 2)],
                 prefill=[(48, 0), (40, 64)]),
    "default": dict(heads=(24, 4), head_dim=256,
                    decode=[(16, 8192, 1), (16, 32768, 1), (1, 32768, 1), (64, 8192, 1), (16, 8192, 4)],
                    prefill=[(4096, 0), (4096, 28672)]),
    "full": dict(heads=(24, 4), head_dim=256,
                 decode=[(16, 8192, 1), (16, 32768, 1), (1, 32768, 1), (64, 8192, 1), (64, 32768, 1), (16, 8192, 2),
                         (16, 8192, 4)],
                 prefill=[(4096, 0), (4096, 8192), (4096, 28672)]),
}
PREFILL_SAMPLE_ROWS = 64


def availability(ctx) -> str | None:
    missing = missing_modules(REQUIRES)
    if missing:
        return f"not available yet: {', '.join(missing)} not in this build (E4 runs once the decode kernel lands)"
    return None


def _pair(name_suffix, label, run_bf16, run_int8, out_bf16, out_int8, kernel, traffic_bf16, traffic_int8, flops,
          scales, conversion):
    return [
        PathSpec(name="bf16", label=f"BF16 cache, {label}", precision="bf16", role="baseline",
                 per_call=[StepSpec(f"{name_suffix} (bf16 cache)", "compute", run_bf16)],
                 output=out_bf16, proofs=[ProofSpec(kernel, "BF16")], traffic=traffic_bf16, flops=flops,
                 conversion="none"),
        PathSpec(name=f"int8_{name_suffix}", label=f"INT8 cache, {label}", precision="int8", role="candidate",
                 per_call=[StepSpec(f"{name_suffix} (int8 cache, q quantized in the call)", "compute", run_int8)],
                 output=out_int8, proofs=[ProofSpec(kernel, "INT8")], traffic=traffic_int8, flops=flops,
                 scales=scales, conversion=conversion),
    ]


#: plan_attention calls timed per case for the notes (median)
PLAN_TIMING_CALLS = 5


def _plan_host_us(ctx, make_plan) -> float:
    """Median host time of ``make_plan()`` in microseconds (its sync included)."""
    times = []
    for _ in range(PLAN_TIMING_CALLS):
        ctx.sync()
        t0 = time.perf_counter()
        make_plan()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def _decode_cases(ctx, exp, size, hq, hkv, d, scale):
    from ..ops.attention import plan_attention

    group = hq // hkv
    by_batch: dict = {}
    for batch, length, q_len in size["decode"]:
        by_batch[batch] = max(by_batch.get(batch, 0), length)
    for batch in sorted(by_batch, reverse=True):
        if ctx.skip_if_out_of_time(exp, f"decode bs{batch}"):
            continue
        cs = build_cache_set(ctx, num_seqs=batch, capacity=by_batch[batch], num_q_heads=hq, num_kv_heads=hkv,
                             head_dim=d, kv_dtypes=["int8"], seed_offset=batch)
        if not any("decode inputs" in n for n in exp.notes):
            exp.notes.append(f"decode inputs: {cs.source}; {hq} query heads, {hkv} KV heads, head_dim {d}")
        for b, length, q_len in size["decode"]:
            if b != batch:
                continue
            tokens = batch * q_len
            query = make_queries(ctx, tokens, hq, d, seed_offset=length + q_len)
            seq_lens = torch.full((batch,), length, dtype=torch.int32, device=ctx.device)
            qsl = (torch.arange(batch + 1, dtype=torch.int32, device=ctx.device) * q_len).contiguous()
            bt = cs.block_table[:, : -(-length // cs.bf16.block_size)].contiguous()
            ref = reference_attention(cs, query, [length] * batch, [q_len] * batch, scale)
            outs = {k: torch.empty_like(query) for k in ("bf16", "int8")}
            caches = {"bf16": cs.bf16, "int8": cs.caches["int8"]}
            # planned once per batch, outside the timed window, as a serving engine plans a step
            runs = {k: planned_attention_call(c, bt, seq_lens, qsl, query, scale, outs[k]) for k, c in caches.items()}
            plan_us = {k: _plan_host_us(ctx, lambda c=c: plan_attention(c, bt, seq_lens, qsl, hq))
                       for k, c in caches.items()}

            n_tok = batch * length
            io = 2 * 2 * tokens * hq * d
            specs = _pair("decode", "decode", runs["bf16"], runs["int8"],
                          lambda: outs["bf16"], lambda: outs["int8"], "_decode_split_kernel",
                          metrics.Traffic().add("decode", kv_bytes(n_tok, hkv, d, "bf16") + io // 2, io // 2),
                          metrics.Traffic().add("decode", kv_bytes(n_tok, hkv, d, "int8") + io // 2, io // 2),
                          4.0 * tokens * hq * length * d, decode_scales("int8", group, q_len),
                          "no conversion in the hot loop: INT8 K/V feed the INT8 matrix instruction (QK and PV); "
                          "the query is quantized once per call inside AttentionPlan.run (in the window)")
            name = f"decode bs{batch} L{length}" + (f" q{q_len}" if q_len > 1 else "")
            exp.cases.append(run_case(ctx, name, {"batch": batch, "L": length, "q_len": q_len}, specs, ref,
                                      tag=KEY))
            timing = "" if ctx.on_gpu and not ctx.interpret else " (CPU/interpreter: meaningless)"
            exp.cases[-1].notes.append(
                "timed call: AttentionPlan.run, the per-layer call of a planned step; plan_attention (outside "
                f"the window, once per batch, one host sync) took {plan_us['bf16']:.0f} us (bf16) / "
                f"{plan_us['int8']:.0f} us (int8) of host time{timing}, shared by every attention layer of "
                f"the step (e.g. 16 layers: {plan_us['int8'] / 16:.1f} us each)")
        del cs
        if ctx.on_gpu:
            torch.cuda.empty_cache()


def _prefill_cases(ctx, exp, size, hq, hkv, d, scale):
    from ..ops.prefill import prefill_attention

    group = hq // hkv
    for q_len, prefix in size["prefill"]:
        if ctx.skip_if_out_of_time(exp, f"prefill {q_len} over {prefix}"):
            continue
        seq_len = prefix + q_len
        cs = build_cache_set(ctx, num_seqs=1, capacity=seq_len, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                             kv_dtypes=["int8"], seed_offset=7 + prefix)
        query = make_queries(ctx, q_len, hq, d, seed_offset=prefix)
        seq_lens = torch.tensor([seq_len], dtype=torch.int32, device=ctx.device)
        qsl = torch.tensor([0, q_len], dtype=torch.int32, device=ctx.device)
        n = min(PREFILL_SAMPLE_ROWS, q_len)
        halves = [(0, n // 2), (q_len - (n - n // 2), q_len)]
        ref = torch.cat([reference_attention(cs, query, [seq_len], [q_len], scale, rows=[r]) for r in halves])
        outs = {k: torch.empty_like(query) for k in ("bf16", "int8")}
        block_table = cs.block_table

        def run(cache, key):
            def fn():
                prefill_attention(query, cache, block_table, seq_lens, qsl, softmax_scale=scale, out=outs[key],
                                  max_query_len=q_len)
            return fn

        def sample(key):
            return lambda: torch.cat([outs[key][a:b] for a, b in halves])

        # causal: query j sees prefix + j + 1 keys
        pairs = q_len * prefix + q_len * (q_len + 1) / 2
        flops = 4.0 * hq * d * pairs
        io = 2 * 2 * q_len * hq * d
        specs = _pair("prefill", "chunked prefill", run(cs.bf16, "bf16"), run(cs.caches["int8"], "int8"),
                      sample("bf16"), sample("int8"), "_prefill_kernel",
                      metrics.Traffic().add("prefill", kv_bytes(seq_len, hkv, d, "bf16") + io // 2, io // 2),
                      metrics.Traffic().add("prefill", kv_bytes(seq_len, hkv, d, "int8") + io // 2, io // 2),
                      flops,
                      [ScaleInfo("K/V scales", "per (key token, KV head)", "the cache's lifetime (written once)",
                                 f"used by {group} query heads x every query row of the chunk", group * q_len),
                       ScaleInfo("Q scale", "per (query token, query head)", "one call",
                                 "used by every KV tile the row visits", recomputed_every_call=True)],
                      "no conversion in the hot loop (INT8 QK and PV); each query row is quantized once as the "
                      "kernel loads it (in the window)")
        exp.cases.append(run_case(ctx, f"prefill {q_len} over {prefix}", {"q_len": q_len, "prefix": prefix}, specs,
                                  ref, tag=KEY))
        exp.cases[-1].notes.append(f"accuracy on query rows {halves} of the chunk")
        del cs
        if ctx.on_gpu:
            torch.cuda.empty_cache()


def run(ctx: GateContext) -> ExperimentResult:
    size = SIZES[ctx.size]
    hq, hkv, d = head_shape(ctx, size)
    exp = ExperimentResult(key=KEY, title=f"{TITLE} ({hq}q/{hkv}kv heads, D={d})", claim=CLAIM,
                           accuracy_bound=ACCURACY_BOUND, accuracy_note=ACCURACY_NOTE, x_label="case")
    scale = d ** -0.5
    _decode_cases(ctx, exp, size, hq, hkv, d, scale)
    if missing_modules(("int8attn.ops.prefill",)):
        exp.notes.append("prefill cases: not available yet (int8attn.ops.prefill is not in this build)")
    else:
        _prefill_cases(ctx, exp, size, hq, hkv, d, scale)
    exp.headline_cases = [c.name for c in exp.cases if c.params.get("L", 0) >= 8192 and c.params.get("batch", 1) >= 16
                          or c.params.get("prefix", -1) > 0] or [c.name for c in exp.cases]
    return exp
