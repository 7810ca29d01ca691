"""E2 -- the second article's FP8 KV paged decode, on our decode kernel.

Decode (one new token per sequence) over a paged cache, Qwen3.5-27B layer (24 query heads,
4 KV heads, head_dim 256, block_size 16), batch 16, KV length 8192 / 16384 / 32768, timed
under CUDA-graph replay (and eagerly). Each decode runs as a serving engine's layer call
does: ``AttentionPlan.run`` of a plan made once per batch (``plan_attention``, outside the
timed window). Paths on the same tokens:

* ``bf16``             our decode kernel on a BF16 cache -- the baseline;
* ``fp8_dequant_bf16`` the article's route: the FP8 pages of the batch are dequantized to
  BF16 by PyTorch inside the timed window (``page.to(bf16) * scale`` into a BF16 scratch
  cache), then the same BF16 decode kernel runs (article: 0.357x-0.410x of BF16, geo-mean
  0.3786x, rel-L2 ~0.0386 vs BF16);
* ``fp8_native``       our decode kernel reading the FP8 cache directly: e4m3 QK and PV on
  the FP8 tensor cores, scales folded in registers.

Accuracy: every output row against float64 attention over the exact (BF16) tokens.
"""

from __future__ import annotations


import torch

from . import metrics
from .attn_common import (
    build_cache_set, decode_scales, head_shape, kv_bytes, make_queries, missing_modules, planned_attention_call,
    reference_attention,
)
from .results import ExperimentResult, ScaleInfo
from .runner import GateContext, PathSpec, ProofSpec, StepSpec, run_case

KEY = "E2"
TITLE = "FP8 KV paged decode vs BF16"
CLAIM = ("Second article, on a gfx936 DCU: FP8 e4m3 KV decode (paged NHD, dequantize then BF16) ran at "
         "0.357x-0.410x of BF16 (geo-mean 0.3786x), rel-L2 ~0.0386-0.0388 vs BF16.")
ACCURACY_BOUND = 0.05
ACCURACY_NOTE = "decode output vs float64 attention over the exact BF16 tokens: rel-L2 <= 0.05"
REQUIRES = ("int8attn.ops.decode", "int8attn.ops.write")

SIZES = {
    "tiny": dict(batch=2, lengths=(48, 96), heads=(6, 1), head_dim=128),
    "default": dict(batch=16, lengths=(8192, 16384, 32768), heads=(24, 4), head_dim=256),
    "full": dict(batch=16, lengths=(8192, 16384, 32768), heads=(24, 4), head_dim=256),
}
DECODE_KERNEL = "_decode_split_kernel"  # the merge kernel (no matrix product) runs only with splits


def availability(ctx) -> str | None:
    missing = missing_modules(REQUIRES)
    if missing:
        return f"not available yet: {', '.join(missing)} is not in this build (E2 runs once the decode kernel lands)"
    return None


def run(ctx: GateContext) -> ExperimentResult:
    size = SIZES[ctx.size]
    hq, hkv, d = head_shape(ctx, size)
    batch, lengths = size["batch"], size["lengths"]
    timed = ", CUDA-graph timed" if ctx.on_gpu and not ctx.interpret else ""
    exp = ExperimentResult(key=KEY, title=(f"{TITLE} (KV {'/'.join(map(str, lengths))}, batch {batch}, "
                                           f"{hq}q/{hkv}kv heads, D={d}{timed})"),
                           claim=CLAIM, accuracy_bound=ACCURACY_BOUND, accuracy_note=ACCURACY_NOTE,
                           x_label="KV length")
    scale = d ** -0.5
    cs = build_cache_set(ctx, num_seqs=batch, capacity=max(lengths), num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                         kv_dtypes=["fp8"])
    exp.notes.append(f"Inputs: {cs.source}; batch {batch}, {hq} query heads, {hkv} KV heads, head_dim {d}, "
                     f"block_size {cs.bf16.block_size}; one query token per sequence.")
    exp.notes.append("The FP8 cache smooths keys (subtracts a per-channel mean, which softmax ignores); the "
                     "dequantize route therefore dequantizes the stored (smoothed) keys, as a serving engine would.")
    query = make_queries(ctx, batch, hq, d)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=ctx.device)
    fp8 = cs.caches["fp8"]
    scratch = type(fp8)(fp8.num_blocks, fp8.block_size, hkv, d, kv_dtype="bf16", device=ctx.device)
    group = hq // hkv

    for length in lengths:
        if ctx.skip_if_out_of_time(exp, f"L={length}"):
            continue
        seq_lens = torch.full((batch,), length, dtype=torch.int32, device=ctx.device)
        n_blocks = -(-length // cs.bf16.block_size)
        bt = cs.block_table[:, :n_blocks].contiguous()
        used = bt.reshape(-1).long()
        ref = reference_attention(cs, query, [length] * batch, [1] * batch, scale)
        outs = {name: torch.empty_like(query) for name in ("bf16", "fp8_dequant_bf16", "fp8_native")}

        def decode(cache, name):
            return planned_attention_call(cache, bt, seq_lens, qsl, query, scale, outs[name])

        def dequantize_pages():
            # The article's route: FP8 pages -> BF16 (x per-token scale) by plain PyTorch ops.
            for src, src_scale, dst in ((fp8.key, fp8.key_scale, scratch.key),
                                        (fp8.value_rows, fp8.value_scale, scratch.value)):
                pages = src.index_select(0, used).to(torch.float32) * src_scale.index_select(0, used)[..., None]
                dst.index_copy_(0, used, pages.to(torch.bfloat16))

        tokens = batch * length
        q_bytes, o_bytes = 2 * batch * hq * d, 2 * batch * hq * d
        flops = 4.0 * batch * hq * length * d
        specs = [
            PathSpec(name="bf16", label="BF16 cache, our decode kernel", precision="bf16", role="baseline",
                     per_call=[StepSpec("decode (bf16 cache)", "compute", decode(cs.bf16, "bf16"))],
                     output=lambda: outs["bf16"], proofs=[ProofSpec(DECODE_KERNEL, "BF16")],
                     traffic=metrics.Traffic().add("decode", kv_bytes(tokens, hkv, d, "bf16") + q_bytes, o_bytes),
                     flops=flops, conversion="none"),
            PathSpec(name="fp8_dequant_bf16", label="FP8 cache, dequantize pages to BF16 (torch), BF16 decode",
                     precision="fp8", role="candidate",
                     per_call=[StepSpec("dequantize FP8 pages -> BF16 (torch)", "convert", dequantize_pages),
                               StepSpec("decode (bf16 scratch cache)", "compute", decode(scratch, "fp8_dequant_bf16"))],
                     main_step="decode (bf16 scratch cache)",
                     output=lambda: outs["fp8_dequant_bf16"],
                     proofs=[ProofSpec(DECODE_KERNEL, "BF16")],
                     traffic=(metrics.Traffic()
                              .add("dequantize", kv_bytes(tokens, hkv, d, "fp8"), kv_bytes(tokens, hkv, d, "bf16"))
                              .add("decode", kv_bytes(tokens, hkv, d, "bf16") + q_bytes, o_bytes)),
                     flops=flops,
                     conversion="inside the timed window: every call converts all FP8 pages of the batch to a BF16 "
                                "scratch cache (PyTorch ops), then reads them again in BF16",
                     scales=[ScaleInfo("K and V scales", "per (key token, KV head)",
                                       "the cache's lifetime (written once)",
                                       "re-applied by the dequantize op to every element of its token, every call",
                                       reuse_count=d, recomputed_every_call=False)]),
            PathSpec(name="fp8_native", label="FP8 cache, native FP8 decode (e4m3 QK/PV)", precision="fp8",
                     role="candidate",
                     per_call=[StepSpec("decode (fp8 cache, q quantized in the call)", "compute",
                                        decode(fp8, "fp8_native"))],
                     output=lambda: outs["fp8_native"], proofs=[ProofSpec(DECODE_KERNEL, "FP8")],
                     traffic=metrics.Traffic().add("decode", kv_bytes(tokens, hkv, d, "fp8") + q_bytes, o_bytes),
                     flops=flops,
                     conversion="no conversion in the hot loop: FP8 K/V feed the FP8 matrix instruction; the query "
                                "is quantized once per call and reused by every split",
                     scales=decode_scales("fp8", group, 1)),
        ]
        case = run_case(ctx, f"L={length}", {"L": length, "batch": batch}, specs, ref, tag=KEY)
        exp.cases.append(case)
    exp.headline_cases = [c.name for c in exp.cases]
    for name in ("fp8_dequant_bf16", "fp8_native"):
        g = metrics.geomean([c.path(name).speedup.get("graph") for c in exp.cases if c.path(name)])
        if g:
            exp.notes.append(f"{name}: geo-mean {g:.4f}x of BF16 under CUDA graphs (article: 0.3786x)")
    return exp
