"""Chunked prefill on the GPU in one short run (<= 3 minutes on an H200, compilation
included): a 4096-token chunk over a cached prefix (docs/design.md §4), INT8 / FP8 / BF16
caches through the same kernel, against PyTorch SDPA BF16 on contiguous K/V, ratios from
the same run.

Sections, in order of importance (each guarded: a failure is logged and recorded, the run
goes on; ``--budget-s`` skips whatever would start after the budget is spent):

1. parallel compilation of every kernel variant in worker processes (Triton's on-disk
   cache), then everything runs in the main process;
2. per case (shape, prefix): every variant of the case's sweep -- a handful of configs per
   (cache dtype, PV precision) family chosen from the sm_90 compile analysis in
   benchmarks/notes/prefill.md -- is checked and timed; later cases of the same shape run
   only each family's best and the library default. Per variant: accuracy of sampled query
   rows (4 blocks of 32, last token included) against float64 attention over the raw bf16
   K/V ("e2e", quantization included), over the dequantized cache and with the query
   quantized too; every output row written (NaN-poisoned first); the compiled kernel's SASS
   (matrix instructions, registers, spills, local-memory instructions); median time (CUDA
   events, L2 flushed) and TFLOP/s counting only unmasked work
   ``4 * D * Hq * (q_len * prefix + q_len * (q_len + 1) / 2)``;
3. SDPA BF16 on the same tokens with contiguous K/V expanded to all query heads, through
   the fastest exact backend measured in round 1 (cuDNN: non-causal prefix + causal chunk
   merged by log-sum-exp; cuDNN causal at prefix 0; FlashAttention with
   ``causal_lower_right`` as the fallback), checked against the float64 rows;
4. a mixed decode + prefill batch through ``attention()``: without a plan, with a plan,
   with a plan made from host bounds only, and the planned run captured in a CUDA graph and
   replayed, each checked against float64 (all rows) and timed;
5. a causal batch of 4 x 4096 tokens (prefix 0, 24q/4kv/D256): each family's library
   default against cuDNN SDPA, FlashInfer and FlashAttention-4;
6. peers, when installed (benchmarks/_peers.py; rows carry their version), on every case:
   FlashInfer paged prefill ``backend="fa3"`` (BF16) and FlashAttention-4 dense BF16 (causal
   bottom-right), each checked against float32 attention; they run after our cases so
   their JIT compilation never costs our rows;
7. query quantization alone and inside the fused producer (``--extras``).

Cases: 24q/4kv/D256 at prefix 28672 (sweep), then 32q/8kv/D128 at 28672 (sweep), then
24q/4kv/D256 at 8192 and 0, then 32q/8kv/D128 at 0. ``--only REGEX`` keeps only the
variants whose name matches (plus each family's default), runs them in every selected
case (no best-of-sweep pruning) and skips the mixed batch: a short side-by-side run, e.g.
``--only 'm64w4|flat' --cases 0,1,3,4``. Rows go to ``<out>/prefill.jsonl`` and a Markdown summary to
``<out>/prefill_summary.md`` (copy both to ``benchmarks/results/``); the table is printed at
the end. ``--smoke`` runs a tiny version of every section with every peer attempted: on the
GPU (library defaults, chunk 256) as a first check, without one under the CPU interpreter
(timings meaningless). The command line, sections, rows, logging, the compile pool, SASS
summaries and peer attempts are benchmarks/_harness.py; this script is the setup and the
cases.

Usage: ``PYTHONUNBUFFERED=1 PYTHONPATH=src python3 benchmarks/bench_prefill.py [--smoke] --out DIR``
"""

from __future__ import annotations

import functools
import json
import re
import sys

import torch

import _harness as H
import _peers as P

SMOKE = "--smoke" in sys.argv
INTERPRET = H.start(SMOKE)   # before the kernels are imported
DEV = "cpu" if INTERPRET else "cuda"


SHAPES = {"24q4kv_d256": (24, 4, 256), "32q8kv_d128": (32, 8, 128)}
#: (shape, prefix, sweep?) in run order: the headline first.
CASES = (("24q4kv_d256", 28672, True), ("32q8kv_d128", 28672, True), ("24q4kv_d256", 8192, False),
         ("24q4kv_d256", 0, False), ("32q8kv_d128", 0, False))
CHUNK = 4096
BLOCK_SIZE = 16
SEED = 7
#: Families reported per case: (kv dtype, PV precision); "bf16" PV is fp16 for 8-bit caches.
FAMILIES = (("int8", "bf16"), ("int8", "int8"), ("fp8", "bf16"), ("fp8", "fp8"), ("bf16", "bf16"))
#: the causal batch: sequences x tokens (prefix 0) at the headline shape
BATCH_SEQS = 4


# --------------------------------------------------------------------------- variants
def _v(kv, pv, block_n=64, dv=None, late=False, stages=2, asm=None, lazy=True, prequant=False, default=False,
       m=128, warps=8, flat=False):
    name = f"{kv}_pv{pv}_n{block_n}_dv{dv}" + ("_late" if late else "") + (f"_s{stages}" if stages != 2 else "")
    if (m, warps) != (128, 8):
        name += f"_m{m}w{warps}"
    if flat:
        name += "_flat"
    if asm is False:
        name += "_noasm"
    if not lazy:
        name += "_eager"
    if prequant:
        name += "_preq"
    cfg = dict(block_m=m, block_n=block_n, dv=dv, num_warps=warps, num_stages=stages, v_late=late, cvt_asm=asm,
               lazy_rescale=lazy, v_flat=flat)
    return {"name": name, "kv": kv, "pv": pv, "cfg": cfg, "prequant": prequant, "default": default}


def _library_default(kv: str, head_dim: int, pv: str) -> dict:
    """What ``default_config`` returns on a GPU (its interpreter branch bypassed, so a CPU
    dry run labels the same rows)."""
    import int8attn.ops.prefill as ops_prefill

    saved = ops_prefill.interpret_mode
    ops_prefill.interpret_mode = lambda: False
    try:
        c = ops_prefill.default_config(kv, head_dim, pv)
    finally:
        ops_prefill.interpret_mode = saved
    return dict(block_m=c.block_m, block_n=c.block_n, dv=c.dv or head_dim, num_warps=c.num_warps,
                num_stages=c.num_stages, v_late=bool(c.v_late), v_flat=bool(getattr(c, "v_flat", False)))


def _mark_defaults(variants: list[dict], head_dim: int) -> list[dict]:
    """``default`` = the variant equal to ``default_config`` for its family (derived, not
    hand-labelled); a family whose default is not in the list gets it appended."""
    for kv, pv in FAMILIES:
        want = _library_default(kv, head_dim, pv)
        found = False
        for v in variants:
            if (v["kv"], v["pv"]) != (kv, pv):
                continue
            c = v["cfg"]
            got = dict(block_m=c["block_m"], block_n=c["block_n"], dv=c["dv"] or head_dim,
                       num_warps=c["num_warps"], num_stages=c["num_stages"], v_late=bool(c["v_late"]),
                       v_flat=bool(c.get("v_flat", False)))
            v["default"] = (got == want and c.get("cvt_asm") is None and c.get("lazy_rescale", True)
                            and not v["prequant"] and not found)
            found = found or v["default"]
        if not found:
            d = _v(kv, pv, want["block_n"], want["dv"], late=want["v_late"], stages=want["num_stages"],
                   m=want["block_m"], warps=want["num_warps"], flat=want["v_flat"])
            d["cfg"].update(block_m=want["block_m"], num_warps=want["num_warps"])
            d["default"] = True
            variants.append(d)
    return variants


def sweep(head_dim: int) -> list[dict]:
    """The tuning sweep per head_dim: the library default of each family (``default``,
    derived from ``default_config``) plus the alternatives the sm_90 compile analysis left
    open; at head_dim 256 each round-2 change is also undone once (``_eager``: rescale
    every tile; no ``_late``: V prefetched before QK; ``_noasm``: portable int8 -> fp16) to
    measure what it gives. At head_dim 128 the 128-key tiles with V prefetched before QK
    (no ``_late``) are timed next to the default: with transposed 8-bit V pages they are the
    variant without spills in the diagonal loop (round 4, benchmarks/notes/prefill.md).

    Round 5 (``_m64w4``): one warp group per program (BLOCK_M 64, 4 warps), so two
    independent programs share an SM (<= 255 registers x 128 threads and <= 99 KB of shared
    memory each, sm_90 compile) and one's MMAs can overlap the other's softmax; ``_flat``:
    8-bit V pages loaded as flat runs (bank-conflict-free staging, ``PrefillConfig.v_flat``)."""
    if head_dim == 256:
        return _mark_defaults([
            _v("int8", "bf16", 64, 128, late=True),
            _v("int8", "bf16", 64, 128, late=True, lazy=False),
            _v("int8", "bf16", 64, 128, late=False),
            _v("int8", "bf16", 64, 128, late=True, asm=False),
            _v("int8", "int8", 64, 64, late=True),
            _v("fp8", "bf16", 64, 128, late=True),
            _v("fp8", "fp8", 64, 64, late=True),
            _v("bf16", "bf16", 64, 256),
            _v("bf16", "bf16", 64, 256, lazy=False),
            _v("int8", "bf16", 64, 128, late=True, m=64, warps=4),
            _v("int8", "bf16", 64, 128, late=True, m=64, warps=4, lazy=False),
            _v("int8", "bf16", 64, 256, late=True, m=64, warps=4),
            _v("int8", "int8", 64, 64, late=True, m=64, warps=4),
            _v("int8", "bf16", 64, 128, late=True, flat=True),
        ], head_dim)
    return _mark_defaults([
        _v("int8", "bf16", 128, 128, late=True),
        _v("int8", "bf16", 128, 128, late=False),
        _v("int8", "bf16", 128, 64, late=True),
        _v("int8", "bf16", 64, 128),
        _v("int8", "bf16", 64, 128, lazy=False),
        _v("int8", "int8", 64, 128, late=True),
        _v("fp8", "bf16", 128, 128, late=True),
        _v("fp8", "bf16", 128, 128, late=False),
        _v("fp8", "bf16", 64, 128),
        _v("bf16", "bf16", 128, 128),
        _v("bf16", "bf16", 64, 128),
        _v("int8", "bf16", 128, 128, m=64, warps=4),
        _v("int8", "bf16", 128, 128, late=True, m=64, warps=4),
        _v("int8", "bf16", 64, 128, m=64, warps=4),
        _v("int8", "int8", 64, 128, late=True, m=64, warps=4),
        _v("int8", "bf16", 128, 128, flat=True),
        _v("int8", "bf16", 128, 128, m=64, warps=4, flat=True),
        _v("fp8", "bf16", 128, 128, late=True, flat=True),
        _v("int8", "int8", 64, 128, late=True, flat=True),
    ], head_dim)


def smoke_sweep(head_dim: int) -> list[dict]:
    small = dict(block_m=32, block_n=16, dv=None, num_warps=4, num_stages=1)
    out = []
    for kv, pv in FAMILIES:
        for late in (False, True):
            out.append({"name": f"{kv}_pv{pv}_small" + ("_late" if late else ""), "kv": kv, "pv": pv,
                        "cfg": {**small, "v_late": late}, "prequant": False, "default": not late})
    return out


# --------------------------------------------------------------------------- data
def unmasked_flops(num_q_heads: int, head_dim: int, q_len: int, prefix: int) -> float:
    return 4.0 * head_dim * num_q_heads * (q_len * prefix + q_len * (q_len + 1) / 2)


def build_batch(shape, prefix, chunk, kv, device, block_size=BLOCK_SIZE):
    from int8attn import testing

    hq, hkv, d = shape
    return testing.make_paged_batch([prefix + chunk], [chunk], num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                                    block_size=block_size, kv_dtype=kv, seed=SEED, device=device)


def with_cache(raw, kv):
    """The same tokens (keys, values, pages, query) stored in a cache of dtype ``kv``."""
    import dataclasses

    from int8attn import reference
    from int8attn.cache import PagedKVCache

    c = raw.cache
    cache = PagedKVCache(c.num_blocks, c.block_size, c.num_kv_heads, c.head_dim, kv_dtype=kv, device=c.device)
    reference.write_kv_reference(cache, raw.key, raw.value, raw.slot_mapping)
    return dataclasses.replace(raw, cache=cache)


def run_variant(batch, var, out=None):
    from int8attn.ops.prefill import PrefillConfig, prefill_attention
    from int8attn.ops.producer import quantize_query

    cfg = PrefillConfig(**var["cfg"])
    kw = {}
    if var["prequant"] and batch.cache.quantized:
        kw["q_quant"], kw["q_scale"] = quantize_query(batch.query, batch.cache.kv_dtype)
    return lambda: prefill_attention(batch.query, batch.cache, batch.block_table, batch.seq_lens,
                                     batch.query_start_loc, out=out, pv_mode=var["pv"], config=cfg, **kw)


def _warm_worker(job):
    """Compile one variant (or the mixed-batch kernels) in a worker process."""
    shape, var = job
    if var == "mixed":
        mixed_batch_check(None, warm_only=True)
        return "mixed batch kernels"
    batch = build_batch(shape, 0, 256, var["kv"], "cuda")
    run_variant(batch, var)()
    torch.cuda.synchronize()
    return var["name"]


def sample_rows(chunk: int) -> list[tuple[int, int]]:
    """(start, end) token blocks of the chunk checked against float64 (4 blocks of 32)."""
    return P.sample_rows(chunk, 32)


def reference_rows(query, k, v, prefix, rows, scale, query_kv_dtype=None):
    """float64 attention of the sampled query rows; k, v [L, Hkv, D] (float64 or raw)."""
    from int8attn import reference

    q = query
    if query_kv_dtype is not None:
        qq, qs = reference.quantize_rows(query, query_kv_dtype)
        q = reference.dequantize_rows(qq, qs)
    outs = []
    for s, e in rows:
        end = prefix + e
        outs.append(reference.attend(q[s:e], k[:end], v[:end], prefix + s, scale))
    return torch.cat(outs)


def take_rows(out, rows):
    return torch.cat([out[s:e] for s, e in rows])


def run_case(r, args, shape_name, prefix, do_sweep, variants, best, chunk):
    """Check and time the case's variants and SDPA; returns the summary rows."""
    from int8attn import reference
    from int8attn.reference import gather_kv

    hq, hkv, d = SHAPES[shape_name]
    dev = r.device
    scale = d ** -0.5
    flops = unmasked_flops(hq, d, chunk, prefix)
    rows = sample_rows(chunk)
    raw = build_batch((hq, hkv, d), prefix, chunk, "bf16", dev)
    ref_e2e = reference_rows(raw.query, raw.key.to(torch.float64), raw.value.to(torch.float64), prefix, rows, scale)
    case = {"shape": shape_name, "num_q_heads": hq, "num_kv_heads": hkv, "head_dim": d, "q_len": chunk,
            "prefix": prefix, "block_size": BLOCK_SIZE, "unmasked_flops": flops}
    times = {}
    for kv in ("int8", "fp8", "bf16"):
        todo = [v for v in variants if v["kv"] == kv and (do_sweep or v["default"] or v["name"] in best.values())]
        if not todo:
            continue
        batch = with_cache(raw, kv)
        kd, vd = gather_kv(batch.cache, batch.block_table[0], prefix + chunk)
        ref_deq = reference_rows(batch.query, kd, vd, prefix, rows, scale)
        ref_q = reference_rows(batch.query, kd, vd, prefix, rows, scale, query_kv_dtype=kv if kv != "bf16" else None)
        del kd, vd
        for var in todo:
            name = var["name"]
            try:
                out = torch.full(batch.query.shape, float("nan"), dtype=torch.bfloat16, device=dev)
                fn = run_variant(batch, var, out=out)
                fn()
                r.sync()
                all_written = bool(torch.isfinite(out).all())
                got = take_rows(out, rows)
                acc = {"e2e": reference.error_stats(got, ref_e2e),
                       "vs_dequant_cache": reference.error_stats(got, ref_deq),
                       "vs_quantized_query": reference.error_stats(got, ref_q)}
                sass = {} if INTERPRET else H.sass_summary(H.launched("_prefill_kernel"))
                us = r.time(fn, rep_ms=args.rep_ms)
                tflops = flops / (us * 1e-6) / 1e12
                ok = all_written and acc["e2e"]["rel_l2"] <= 0.05
                if ok:
                    times[name] = (us, var)
                loop = sass.get("main_loop", {})
                r.log(f"{shape_name} prefix={prefix:5d} {name:30s} {us / 1e3:8.3f} ms {tflops:6.1f} TFLOP/s "
                    f"e2e={acc['e2e']['rel_l2']:.4f} deq={acc['vs_dequant_cache']['rel_l2']:.4f} "
                    f"qq={acc['vs_quantized_query']['rel_l2']:.4f} written={all_written} "
                    f"regs={sass.get('n_regs')} spills={sass.get('n_spills')} "
                    f"main_loop_ins={loop.get('instructions')} loop_LDL_STL={loop.get('LDL_STL')} mma={sass.get('mma')}")
                r.row(kind="prefill_kernel", variant=name, kv_dtype=kv, pv_mode=var["pv"], config=var["cfg"],
                        library_default=var["default"], prequantized_q=var["prequant"], time_us=us,
                        effective_tflops=tflops, all_rows_written=all_written, accuracy=acc, sass=sass,
                        timing="MEANINGLESS (interpreter)" if INTERPRET else "eager (do_bench median, L2 flushed)",
                        **case)
            except Exception as e:
                r.log(f"{shape_name} prefix={prefix} {name} FAILED {e!r}"[:600])
                r.row(kind="prefill_kernel", variant=name, kv_dtype=kv, error=repr(e)[:500], **case)
        del batch

    # ---- SDPA BF16 on contiguous K/V (all query heads), same tokens: fastest exact backend
    sdpa_best = None
    # attempted under the interpreter too: the rows record why it cannot run there
    try:
        g = hq // hkv
        q4 = raw.query.transpose(0, 1).unsqueeze(0).contiguous()
        k4 = raw.key.repeat_interleave(g, dim=1).transpose(0, 1).unsqueeze(0).contiguous()
        v4 = raw.value.repeat_interleave(g, dim=1).transpose(0, 1).unsqueeze(0).contiguous()
        for name, fn in P.sdpa_prefill(q4, k4, v4, prefix, chunk, scale):
            try:
                o = fn()
                r.sync()
                err = reference.error_stats(take_rows(o[0].transpose(0, 1), rows), ref_e2e)
                us = r.time(fn, rep_ms=args.rep_ms)
                tflops = flops / (us * 1e-6) / 1e12
                r.log(f"{shape_name} prefix={prefix:5d} {name:30s} {us / 1e3:8.3f} ms {tflops:6.1f} TFLOP/s "
                    f"e2e={err['rel_l2']:.4f}")
                r.row(kind="sdpa_bf16", variant=name, time_us=us, effective_tflops=tflops,
                      accuracy={"e2e": err}, exact_problem=True, peer_version=P.sdpa_version(), **case)
                if err["rel_l2"] < 0.02:
                    sdpa_best = (name, us)
                    break  # the fastest backend worked: the fallback is not needed
            except Exception as e:
                r.log(f"{shape_name} prefix={prefix} {name} unavailable: {e!r}"[:400])
                r.row(kind="sdpa_bf16", variant=name, error=repr(e)[:300], **case)
        del q4, k4, v4
    except Exception as e:
        r.log(f"{shape_name} prefix={prefix} SDPA section failed {e!r}"[:400])

    # ---- best per family (the sweep's winners are reused by later cases of this shape)
    fam_best = {}
    for name, (us, var) in times.items():
        key = (var["kv"], var["pv"])
        if var["prequant"]:
            continue
        if key not in fam_best or us < fam_best[key][1]:
            fam_best[key] = (name, us, var)
    if do_sweep:
        for key, (name, _, _) in fam_best.items():
            best[key] = name
    bf = fam_best.get(("bf16", "bf16"))
    summary = []
    for key in FAMILIES:
        if key not in fam_best:
            continue
        name, us, var = fam_best[key]
        default = next((times[v["name"]][0] for v in variants
                        if v["default"] and (v["kv"], v["pv"]) == key and v["name"] in times), None)
        row = {"kind": "prefill_summary", "kv_dtype": key[0], "pv_mode": key[1], "best_variant": name,
               "time_us": us, "effective_tflops": flops / (us * 1e-6) / 1e12, "library_default_time_us": default,
               "ratio_vs_own_bf16_cache": (bf[1] / us) if bf else None,
               "sdpa_best": sdpa_best[0] if sdpa_best else None, "sdpa_time_us": sdpa_best[1] if sdpa_best else None,
               "ratio_vs_sdpa_bf16": (sdpa_best[1] / us) if sdpa_best else None, **case}
        r.row(**row)
        summary.append(row)
    return summary


def mixed_batch_check(r, warm_only=False):
    """Decode + prefill sequences in one attention() call, checked against float64 on every
    row: no plan, a plan read from the batch, a plan from host bounds only (no read), and
    the planned run captured in a CUDA graph and replayed."""
    from int8attn import reference, testing
    from int8attn.ops.attention import attention, plan_attention
    from int8attn.ops.decode import MAX_DECODE_QUERY_LEN

    if SMOKE:
        seq_lens, q_lens, shape = [20, 33, 9, 40], [1, 20, 9, 3], (4, 2, 64)
    else:
        seq_lens, q_lens, shape = [2048] * 8 + [1200, 300], [1] * 6 + [4, 8] + [500, 100], (24, 4, 256)
    hq, hkv, d = shape
    b = testing.make_paged_batch(seq_lens, q_lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, kv_dtype="int8",
                                 seed=3, device=DEV)
    args = (b.query, b.cache, b.block_table, b.seq_lens, b.query_start_loc)
    out = testing.poisoned_like(torch.empty(b.query.shape, dtype=torch.bfloat16, device=b.query.device))
    attention(*args, out=out)
    plan = plan_attention(b.cache, b.block_table, b.seq_lens, b.query_start_loc, hq)
    bound_plan = plan_attention(b.cache, b.block_table, b.seq_lens, b.query_start_loc, hq,
                                num_tokens=sum(q_lens), max_query_len=max(q_lens), has_decode=True, has_prefill=True)
    out_plan = testing.poisoned_like(out)
    attention(*args, out=out_plan, plan=plan)
    out_bound = testing.poisoned_like(out)
    attention(*args, out=out_bound, plan=bound_plan)
    if warm_only:
        return
    ref = reference.attention_reference(*args)
    ref_q = reference.attention_reference_quantized(*args)
    is_decode = torch.tensor([1 <= q <= MAX_DECODE_QUERY_LEN for q in q_lens for _ in range(q)])
    row = {"kind": "mixed_batch", "seq_lens": seq_lens, "q_lens": q_lens, "num_q_heads": hq, "num_kv_heads": hkv,
           "head_dim": d, "kv_dtype": "int8", "launches": list(plan.launches)}
    for tag, o in (("no_plan", out), ("plan", out_plan), ("bound_plan", out_bound)):
        err = reference.error_stats(o, ref)
        row[f"{tag}_all_written"] = bool(torch.isfinite(o).all())
        row[f"{tag}_rel_l2"] = err["rel_l2"]
    row["rel_l2_vs_quantized_query_ref"] = reference.error_stats(out, ref_q)["rel_l2"]
    oc = out.float().cpu()
    row["decode_rows_rel_l2"] = reference.error_stats(oc[is_decode], ref[is_decode])["rel_l2"]
    row["prefill_rows_rel_l2"] = reference.error_stats(oc[~is_decode], ref[~is_decode])["rel_l2"]
    row["plan_equals_no_plan"] = bool(torch.equal(out, out_plan))
    row["bound_plan_equals_plan"] = bool(torch.equal(out_bound, out_plan))
    r.log(f"mixed batch: written={row['no_plan_all_written']}/{row['plan_all_written']}/{row['bound_plan_all_written']} "
          f"rel_l2 no-plan={row['no_plan_rel_l2']:.4f} plan={row['plan_rel_l2']:.4f} "
        f"bound-plan={row['bound_plan_rel_l2']:.4f} (decode rows {row['decode_rows_rel_l2']:.4f}, "
        f"prefill rows {row['prefill_rows_rel_l2']:.4f}) plan==no-plan {row['plan_equals_no_plan']} "
        f"launches={plan.launches}")
    if not INTERPRET:
        row["eager_no_plan_us"] = r.time(lambda: attention(*args, out=out))
        row["eager_plan_us"] = r.time(lambda: attention(*args, out=out_plan, plan=plan))
        try:
            out_graph = testing.poisoned_like(out)
            row["graph_plan_us"] = r.time(lambda: attention(*args, out=out_graph, plan=bound_plan), True,
                                          replays=5, repeats=5)
            row["graph_all_written"] = bool(torch.isfinite(out_graph).all())
            row["graph_equals_eager"] = bool(torch.equal(out_graph, out_bound))
            row["graph_rel_l2"] = reference.error_stats(out_graph, ref)["rel_l2"]
            # a graph replayed after the inputs changed in place sees the new values
            out_graph.fill_(float("nan"))
            g = torch.cuda.CUDAGraph()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                attention(*args, out=out_graph, plan=bound_plan)
            torch.cuda.current_stream().wait_stream(s)
            with torch.cuda.graph(g):
                attention(*args, out=out_graph, plan=bound_plan)
            out_graph.fill_(float("nan"))
            q_saved = b.query.clone()
            b.query.mul_(0.5)
            g.replay()
            torch.cuda.synchronize()
            ref_half = reference.attention_reference(*args)
            row["graph_replay_new_inputs_rel_l2"] = reference.error_stats(out_graph, ref_half)["rel_l2"]
            row["graph_replay_new_inputs_all_written"] = bool(torch.isfinite(out_graph).all())
            b.query.copy_(q_saved)
            del g
        except Exception as e:
            row["graph_error"] = repr(e)[:300]
        r.log(f"mixed batch: eager no-plan {row['eager_no_plan_us']:.1f} us, plan {row['eager_plan_us']:.1f} us, "
            f"graph replay {row.get('graph_plan_us', float('nan')):.1f} us, graph==eager "
            f"{row.get('graph_equals_eager')}, graph rel_l2 {row.get('graph_rel_l2', float('nan')):.4f}, "
            f"replay with new inputs rel_l2 {row.get('graph_replay_new_inputs_rel_l2', float('nan')):.4f} "
            f"{row.get('graph_error', '')}")
    r.row(**row)
    return row


def extras(r):
    """Query quantization alone and inside the fused producer (4096 tokens, 24q/4kv/D256)."""
    from int8attn import reference as R
    from int8attn.cache import PagedKVCache
    from int8attn.ops.producer import quantize_query, rope_quantize_and_write

    q = torch.randn(CHUNK, 24, 256, device="cuda").to(torch.bfloat16)
    us = r.time(lambda: quantize_query(q, "int8"))
    r.log(f"quantize_query 4096x24x256 int8: {us:.1f} us")
    r.row(kind="quantize_query", num_tokens=CHUNK, num_heads=24, head_dim=256, kv_dtype="int8", time_us=us)
    cache = PagedKVCache(CHUNK // 16 + 4, 16, 4, 256, kv_dtype="int8", device="cuda")
    kx = torch.randn(CHUNK, 4, 256, device="cuda").to(torch.bfloat16)
    vx = torch.randn(CHUNK, 4, 256, device="cuda").to(torch.bfloat16)
    pos = torch.arange(CHUNK, device="cuda")
    cs = R.rope_cos_sin_cache(CHUNK, 64, device="cuda")
    slots = torch.arange(CHUNK, device="cuda")
    rope_quantize_and_write(q, kx, vx, pos, cs, cache, slots)
    us = r.time(lambda: rope_quantize_and_write(q, kx, vx, pos, cs, cache, slots))
    r.log(f"fused producer (RoPE 64 of 256 + K/V write + Q quant) 4096 tokens 24q/4kv/D256: {us:.1f} us")
    r.row(kind="fused_producer", num_tokens=CHUNK, num_q_heads=24, num_kv_heads=4, head_dim=256, rotary_dim=64,
          kv_dtype="int8", time_us=us)



# --------------------------------------------------------------------------- causal batch
def causal_batch(r, args, variants, chunk):
    """BATCH_SEQS sequences of ``chunk`` tokens each, causal from token 0, in one call: each
    family's library default (sampled rows of the first and last sequence checked against
    float64, every row written) and the peers on the same tokens. Returns the summary row."""
    from int8attn import reference
    from int8attn.ops.prefill import PrefillConfig, prefill_attention

    shape_name = "smoke" if INTERPRET else "24q4kv_d256"
    hq, hkv, d = SHAPES[shape_name]
    scale = d ** -0.5
    n = 2 if SMOKE else BATCH_SEQS
    raw = testing_batch([chunk] * n, [chunk] * n, (hq, hkv, d), "bf16")
    rows = sample_rows(chunk)
    flops = n * unmasked_flops(hq, d, chunk, 0)
    case = {"shape": shape_name, "num_q_heads": hq, "num_kv_heads": hkv, "head_dim": d, "num_seqs": n,
            "q_len": chunk, "prefix": 0, "block_size": BLOCK_SIZE, "unmasked_flops": flops}
    kf, vf = raw.key.to(torch.float64), raw.value.to(torch.float64)
    refs = [reference_rows(raw.query[i * chunk:(i + 1) * chunk], kf[i * chunk:(i + 1) * chunk],
                           vf[i * chunk:(i + 1) * chunk], 0, rows, scale) for i in (0, n - 1)]
    times = {}
    for kv, pv in FAMILIES:
        var = next(v for v in variants if v["default"] and (v["kv"], v["pv"]) == (kv, pv))
        try:
            batch = with_cache(raw, kv)
            out = torch.full(batch.query.shape, float("nan"), dtype=torch.bfloat16, device=r.device)
            fn = lambda: prefill_attention(batch.query, batch.cache, batch.block_table, batch.seq_lens,  # noqa: E731
                                           batch.query_start_loc, out=out, pv_mode=pv,
                                           config=PrefillConfig(**var["cfg"]))
            fn()
            r.sync()
            written = bool(torch.isfinite(out).all())
            err = max(reference.error_stats(take_rows(out[i * chunk:(i + 1) * chunk], rows), ref)["rel_l2"]
                      for i, ref in zip((0, n - 1), refs))
            us = r.time(fn, rep_ms=args.rep_ms)
            times[(kv, pv)] = us
            r.log(f"batch {n}x{chunk} {var['name']:30s} {us / 1e3:8.3f} ms {flops / us / 1e6:6.1f} TFLOP/s "
                  f"rel_l2={err:.4f} written={written}")
            r.row(kind="prefill_batch", variant=var["name"], kv_dtype=kv, pv_mode=pv, config=var["cfg"],
                  time_us=us, effective_tflops=flops / us / 1e6, rel_l2_max=err, all_rows_written=written, **case)
        except Exception as e:
            r.log(f"batch {n}x{chunk} {var['name']} FAILED {e!r}"[:600])
            r.row(kind="prefill_batch", variant=var["name"], kv_dtype=kv, pv_mode=pv, error=repr(e)[:500], **case)
    summary = {"kind": "prefill_batch_summary", **case, **{f"{kv}_pv{pv}_us": t for (kv, pv), t in times.items()}}
    # cuDNN SDPA causal over the batch (heads expanded), then the optional peers
    g = hq // hkv
    q4 = raw.query.view(n, chunk, hq, d).transpose(1, 2)
    k4 = raw.key.view(n, chunk, hkv, d).repeat_interleave(g, dim=2).transpose(1, 2)
    v4 = raw.value.view(n, chunk, hkv, d).repeat_interleave(g, dim=2).transpose(1, 2)
    for name, fn in P.sdpa_prefill(q4, k4, v4, 0, chunk, scale)[:1]:
        try:
            o = fn()
            r.sync()
            err = reference.error_stats(take_rows(o[0].transpose(0, 1), rows), refs[0])["rel_l2"]
            us = r.time(fn, rep_ms=args.rep_ms)
            summary["sdpa_cudnn_us"] = us
            r.row(kind="peer", peer="torch_sdpa", peer_version=P.sdpa_version(), variant=name, time_us=us,
                  effective_tflops=flops / us / 1e6, rel_l2=err, **case)
            r.log(f"batch {n}x{chunk} {name:30s} {us / 1e3:8.3f} ms {flops / us / 1e6:6.1f} TFLOP/s rel_l2={err:.4f}")
        except Exception as e:
            r.log(f"batch {n}x{chunk} {name} unavailable: {e!r}"[:400])
            r.row(kind="peer_unavailable", peer="torch_sdpa", variant=name, reason=repr(e)[:300], **case)
    del q4, k4, v4
    if not args.no_peers:
        calls = {"flashinfer": lambda: P.flashinfer_prefill(r, raw.query, raw.key, raw.value, [chunk] * n, [chunk] * n),
                 "fa4": lambda: P.fa4_prefill(r, raw.query.view(n, chunk, hq, d), raw.key.view(n, chunk, hkv, d),
                                              raw.value.view(n, chunk, hkv, d))}
        for peer, call in calls.items():
            res = run_peer(r, peer, call, flops, case, f"batch {n}x{chunk}")
            if res:
                summary[f"{peer}_us"] = res["eager_us"]
    r.row(**summary)
    return summary


def testing_batch(seq_lens, q_lens, shape, kv):
    from int8attn import testing

    hq, hkv, d = shape
    return testing.make_paged_batch(seq_lens, q_lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                                    block_size=BLOCK_SIZE, kv_dtype=kv, seed=SEED, device=DEV)


# --------------------------------------------------------------------------- peers
def run_peer(r, peer, call, flops, case, label):
    """One peer timing: its row (version, time, TFLOP/s, rel-L2 vs float32) or why it is missing."""
    res = H.peer(r, peer, call, label, fields=case)
    if res is None:
        return None
    res["effective_tflops"] = flops / res["eager_us"] / 1e6
    r.row(kind="peer", **{**case, **res})
    r.log(f"{label} {peer:30s} {res['eager_us'] / 1e3:8.3f} ms {res['effective_tflops']:6.1f} TFLOP/s "
          f"rel_l2={res['rel_l2']:.4f} ({res['peer_kernel']} {res['peer_version']})")
    return res


def peers(r, cases, chunk):
    """FlashInfer fa3 paged prefill and FlashAttention-4 dense on every case's tokens (the
    same seed as the case: the same tokens our kernels saw); returns {(shape, prefix): {peer: us}}."""
    out = {}
    for shape_name, prefix, _ in cases:
        if r.late(f"peers {shape_name} prefix {prefix}"):
            break
        hq, hkv, d = SHAPES[shape_name]
        raw = build_batch((hq, hkv, d), prefix, chunk, "bf16", r.device)
        L = prefix + chunk
        case = {"shape": shape_name, "num_q_heads": hq, "num_kv_heads": hkv, "head_dim": d, "q_len": chunk,
                "prefix": prefix, "block_size": BLOCK_SIZE}
        flops = unmasked_flops(hq, d, chunk, prefix)
        calls = {"flashinfer": functools.partial(P.flashinfer_prefill, r, raw.query, raw.key, raw.value, [L], [chunk]),
                 "fa4": functools.partial(P.fa4_prefill, r, raw.query[None], raw.key[None], raw.value[None])}
        for peer, call in calls.items():
            res = run_peer(r, peer, call, flops, case, f"{shape_name} prefix={prefix:5d}")
            if res:
                out.setdefault((shape_name, prefix), {})[peer] = res["eager_us"]
        del raw, calls
    return out


# --------------------------------------------------------------------------- summary
def summary_text(summary, mixed, batch, peer_times) -> str:
    """Markdown: best variant per case and family against SDPA and the peers; the causal
    batch; the mixed batch."""
    ms = lambda us: us and us / 1e3  # noqa: E731
    lines = []
    for s in summary:
        pt = peer_times.get((s["shape"], s["prefix"]), {})
        lines.append([s["shape"], s["prefix"], s["kv_dtype"], s["pv_mode"], s["best_variant"], f"{s['time_us'] / 1e3:.3f}",
                      f"{s['effective_tflops']:.0f}", H.fmt(ms(s["library_default_time_us"]), "{:.3f}", "-"),
                      H.fmt(s["ratio_vs_own_bf16_cache"], "{:.2f}", "-"), H.fmt(s["ratio_vs_sdpa_bf16"], "{:.2f}", "-"),
                      f"{H.fmt(ms(s['sdpa_time_us']), '{:.3f}', '-')} ({s['sdpa_best']})",
                      H.fmt(ms(pt.get("fa4")), "{:.3f}", "-"), H.fmt(ms(pt.get("flashinfer")), "{:.3f}", "-")])
    md = H.table(["shape", "prefix", "cache", "PV", "best variant", "ms", "TFLOP/s", "default ms", "vs own BF16",
                  "vs SDPA BF16", "SDPA ms (backend)", "FA4 ms", "FlashInfer fa3 ms"], lines)
    if batch:
        md += ["", f"Causal batch {batch['num_seqs']} x {batch['q_len']} ({batch['shape']}), ms: "
               + ", ".join(f"{k[:-3]} {v / 1e3:.3f}" for k, v in batch.items() if k.endswith("_us"))]
    if mixed:
        md += ["", "Mixed batch (attention(), int8 cache): "
               + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in mixed.items()
                           if k not in ("kind",))]
    return "\n".join(md) + "\n"


def main():
    ap = H.parser("prefill", out_default="benchmarks/results", budget_s=150,
                  out_help="directory for prefill.jsonl, prefill_summary.md and the log (default: benchmarks/results)",
                  smoke_help="tiny version of every section and peer (CPU: interpreter)")
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--rep-ms", type=float, default=30)
    ap.add_argument("--cases", default="", help="subset of case indices into CASES, e.g. 0,2")
    ap.add_argument("--extras", action="store_true", help="also time quantize_query and the fused producer")
    ap.add_argument("--only", default="", help="regex: keep only matching variants (+ defaults), in every case")
    ap.add_argument("--no-peers", action="store_true", help="skip FlashInfer / FlashAttention-4 even if installed")
    args = ap.parse_args()
    r = H.Run("prefill", args.out, deadline_s=args.budget_s, interpret=INTERPRET)
    chunk = 40 if INTERPRET else (256 if SMOKE else CHUNK)
    cases = [CASES[int(i)] for i in args.cases.split(",")] if args.cases else list(CASES)
    if INTERPRET:
        cases = [("smoke", 33, True), ("smoke", 0, False)]
        SHAPES["smoke"] = (4, 2, 64)
    elif SMOKE:
        cases = [("32q8kv_d128", 512, True), ("24q4kv_d256", 0, False)]

    def variants_of(name):
        d = SHAPES[name][2]
        vs = smoke_sweep(d) if INTERPRET else _mark_defaults([], d) if SMOKE else sweep(d)
        return [v for v in vs if v["default"] or not args.only or re.search(args.only, v["name"])]

    variants = {name: variants_of(name) for name in {c[0] for c in cases}}
    run_batch = not args.only and not args.cases
    batch_shape = "smoke" if INTERPRET else "24q4kv_d256"
    batch_variants = [v for v in variants.get(batch_shape) or variants_of(batch_shape) if v["default"]]
    r.log("env", json.dumps(r.env))

    # every kernel variant of the run compiled in parallel worker processes
    jobs = ([] if args.only else [(None, "mixed")]) + [(SHAPES[name], v) for name in variants for v in variants[name]]
    if run_batch and batch_shape not in variants:
        jobs += [(SHAPES[batch_shape], v) for v in batch_variants]
    H.precompile(r, _warm_worker, jobs, workers=args.workers)

    # the cases, the mixed batch right after the headline case
    summary, mixed, batch, best = [], None, None, {}
    for i, (shape_name, prefix, do_sweep) in enumerate(cases):
        name = f"case {shape_name} prefix {prefix}"
        if r.late(name):
            continue
        summary += H.attempt(r, name, run_case, r, args, shape_name, prefix, do_sweep or bool(args.only),
                             variants[shape_name], best.setdefault(shape_name, {}), chunk) or []
        if not INTERPRET:
            torch.cuda.empty_cache()
        if i == 0 and not args.only and not r.late("mixed batch"):
            mixed = H.attempt(r, "mixed batch", mixed_batch_check, r)

    # the causal batch, then the peers (after our rows: their JIT never costs ours), the extras
    if run_batch and not r.late("causal batch"):
        batch = H.attempt(r, "causal batch", causal_batch, r, args, batch_variants, chunk)
    peer_times = {} if args.no_peers else H.attempt(r, "peers", peers, r, cases, chunk) or {}
    if args.extras and not INTERPRET and not r.late("extras"):
        H.attempt(r, "extras", extras, r)
    H.finish(r, "prefill_summary.md", lambda: summary_text(summary, mixed, batch, peer_times))


if __name__ == "__main__":
    main()
