"""The Hopper (Gluon) prefill kernel against the portable Triton kernel and BF16 peers, on
one H200 run: a 4096-token causal chunk over prefix 0 and 28672, 24q/4kv D256 and
32q/8kv D128, block size 16.

Per case: the Hopper kernel per (cache dtype, PV precision) with the query codes passed in
(the producer quantizes Q once; its own time is a separate row), the portable kernel's
default on the same cache, FlashAttention-4 BF16 dense (``flash_attn.cute``, when
importable) and PyTorch SDPA BF16 on contiguous K/V (lower-right causal mask; the backend
PyTorch picks). Every output is checked against the portable kernel (rel-L2) before it is
timed. TOP/s count unmasked work only: ``4 * D * Hq * (q * prefix + q * (q + 1) / 2)``.
Then the 8-bit floor: a plain pipelined Gluon wgmma s8 GEMM (TMA ring, 8192^3).

Every section is guarded (an error is printed and recorded, the run goes on). Rows go to
``benchmarks/results/prefill_hopper.jsonl`` (or ``--out DIR/prefill_hopper.jsonl``).
Timings are medians (CUDA events, L2 flushed); nothing is asserted.

Usage: ``PYTHONPATH=src python benchmarks/bench_prefill_hopper.py [--out DIR] [--quick] [--only-ws] [--routed]
[--batches] [--graph]`` (``--routed``: of the Hopper kernels, only the warp-specialized configs "auto" runs) (``--graph``: every attention row also by CUDA-graph replay, a second table; at
prefix 0 the eager figures of short launches can include host time, see
``benchmarks/timing_methods_prefill_hopper.py``)
(``--batches``: also the per-token cost of a plan over one 4096-token chunk, a 4 x 4096 batch
and a mixed batch of 16 decode sequences beside one chunk.)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import traceback
from dataclasses import replace

import torch

from int8attn import bench, reference, testing
from int8attn.ops import prefill_hopper as hop
from int8attn.ops.prefill import DEFAULT_PV, prefill_attention
from int8attn.ops.producer import quantize_query

SHAPES = {"24q4kv_d256": (24, 4, 256), "32q8kv_d128": (32, 8, 128), "16q4kv_d64": (16, 4, 64)}
#: the shapes timed unless --shapes names others
DEFAULT_SHAPES = ("24q4kv_d256", "32q8kv_d128")
PREFIXES = (28672, 0)
CHUNK = 4096
#: (cache, PV) routes timed: the 8-bit PV routes (the pipelined kernel's) and the 8-bit caches'
#: 16-bit PV (their default)
ROUTES = (("int8", "int8"), ("int8", "bf16"), ("fp8", "fp8"), ("fp8", "bf16"), ("bf16", "bf16"))
#: --only-ws: of the Hopper kernels, time the warp-specialized configs only
ONLY_WS = False
#: --routed: of the Hopper kernels, the warp-specialized route configs only (what "auto" runs)
ROUTED = False
#: --labels: of the Hopper kernels, exactly these configs (by label; overrides --routed / --only-ws)
LABELS: tuple = ()
#: --graph: every attention row also timed by CUDA-graph replay (``graph_us``): eager figures
#: of short launches include host time whenever the call's host work outlasts do_bench's L2
#: flush (benchmarks/timing_methods_prefill_hopper.py)
GRAPH = False


def _timed(fn) -> dict:
    """``us`` (eager, L2 flushed) and, with --graph, ``graph_us`` (replays of ~20 ms)."""
    us = bench.time_eager(fn)
    out = dict(us=us)
    if GRAPH:
        try:
            out["graph_us"] = bench.time_graph(fn, replays=max(2, min(50, int(20000 / us))), repeats=7)
        except Exception as e:  # noqa: BLE001 - a launch that cannot be captured keeps its eager figure
            out["graph_error"] = repr(e)[:200]
    return out


def unmasked_ops(hq: int, d: int, q: int, prefix: int) -> float:
    return 4.0 * d * hq * (q * prefix + q * (q + 1) / 2)


def _rel_l2(a, b) -> float:
    return reference.error_stats(a, b)["rel_l2"]


def _record(rec, **row):
    print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    rec.add(**row)


def hopper_configs(kv_dtype: str, d: int, pv: str) -> list:
    """:func:`_all_hopper_configs`, each config once (its first label: a variant equal to the
    route's config is not timed twice)."""
    seen, out = set(), []
    for label, config in _all_hopper_configs(kv_dtype, d, pv):
        if config not in seen:
            seen.add(config)
            out.append((label, config))
    return out


def _all_hopper_configs(kv_dtype: str, d: int, pv: str) -> list:
    """(label, config) of the Hopper kernel to time per route: the synchronous default; for
    8-bit PV the pipelined config too, and block_m 64 (one warpgroup per program: two
    programs per SM run unsynchronised, where 128 rows share one CTA barrier per KV tile)
    of the pipelined config, or of the synchronous one where no pipelined config exists;
    the warp-specialized config of every route ("hopper-ws")."""
    if kv_dtype == "bf16":  # the warp-specialized kernel only: the 8-bit routes' BF16 counterpart
        routed = hop.warp_specialized_config(kv_dtype, d)
        # the variants below are of the 64-key schedule without PV in flight ("hopper-ws-pv-after"
        # where the route's differs: at head_dim 64, WIDE_TILE_ROUTES)
        ws = hop.warp_specialized_config(kv_dtype, d, pv_in_flight=False, wide_tiles=False)
        # the rescale rules: the warpgroup-wide lazy test, and per row or every tile (whichever
        # the route's config does not take); two and three consumer warpgroups
        # and at head_dim 64 128-key tiles (at 128 three stages of bf16 K and V spill, 295
        # local-memory instructions in the sm_90 build)
        return [("hopper-ws", routed), *([("hopper-ws-pv-after", ws)] if ws != routed else []),
                ("hopper-ws-lazy", replace(ws, lazy_rescale=True)), _other_rescale(ws),
                *_pv_in_flight_placements(ws),
                ("hopper-ws-2c", hop.two_consumer_config(kv_dtype, d)), *_three_consumers(kv_dtype, d, pv),
                *(_wide_tiles(ws, d, split_release=False) if d == 64 else [])]
    sync = hop.default_config(kv_dtype, d, pv)
    out = [("hopper", sync)]
    pipe = hop.pipelined_config(kv_dtype, d) if pv != "bf16" else None
    if pipe is not None:
        out += [("hopper-pipe", pipe), ("hopper-pipe-m64", replace(pipe, block_m=64))]
    elif pv != "bf16":  # 8-bit PV without a pipelined config (int8 at D256)
        out.append(("hopper-m64", replace(sync, block_m=64)))
    if pv == "bf16":  # 16-bit PV: the loader converts V to fp16
        routed = hop.warp_specialized_config(kv_dtype, d, pv)
        # the variants below are of the route's 64-key schedule without PV in flight
        # ("hopper-ws-pv-after" where the route's differs: PV_IN_FLIGHT_ROUTES, WIDE_TILE_ROUTES)
        ws = hop.warp_specialized_config(kv_dtype, d, pv, pv_in_flight=False, wide_tiles=False)
        if ws != routed:
            out += [("hopper-ws-pv-after", ws)]
        # the route's config; the two-consumer config with QK after PV where the route's differs
        # where the route keeps PV in flight with the per-row lazy rescale: half of P's
        # exponentials as an FMA polynomial
        poly = ([("hopper-ws-exp2-poly", replace(routed, exp2_poly=True))]
                if routed.pipeline and routed.lazy_rescale == "rows" else [])
        out += [("hopper-ws", routed), *poly, ("hopper-ws-2c", hop.two_consumer_config(kv_dtype, d, pv)),
                # V scaled by the loader (P the plain fp16 p: one multiply per score fewer), or
                # not, whichever the route's config does not do
                ("hopper-ws-v-" + ("unscaled" if ws.v_scaled else "scaled"), replace(ws, v_scaled=not ws.v_scaled)),
                *_pv_in_flight_placements(ws, split_release=True)]
        # the loader's copies in flight past the tile it converts (convert_lag; None: 1) and
        # the ring depth; the rescale rules (a warpgroup-wide lazy test per tile; per row with
        # each thread's multiplies behind a branch, or every tile)
        out += [("hopper-ws-lag2", replace(ws, convert_lag=2)),
                ("hopper-ws-s5", replace(ws, stages=5)), ("hopper-ws-s5-lag2", replace(ws, stages=5, convert_lag=2)),
                ("hopper-ws-lazy", replace(ws, lazy_rescale=True)), _other_rescale(ws)]
        if d <= 128:
            # the next tile's QK in flight across this tile's softmax: the consumers' own chain
            # sets the pace at D128 (sm_90 build, Triton 3.6: no local memory, MMAs pipelined;
            # at D256 it spills 166); three consumer warpgroups, with and without it
            out += [("hopper-ws-s6", replace(ws, stages=6)), ("hopper-ws-qk-ahead", replace(ws, qk_ahead=True)),
                    *_three_consumers(kv_dtype, d, pv), *_wide_tiles(ws, d)]
        else:
            # half the keys per tile at head_dim 256, 4 stages (the config before the 64-key
            # tiles; a fp16 V ring of 4 64-key stages would not fit in shared memory), and
            # with the next QK across the softmax, which fits 32-key tiles only (sm_90 build,
            # Triton 3.6, per-row lazy rescale: no local memory, MMAs pipelined; 166-178 with
            # 64-key tiles). 128-key tiles at head_dim 128 spill (248 LDL/STL).
            out += [("hopper-ws-n32-s4", replace(ws, block_n=32, stages=4)),
                    ("hopper-ws-n32-s4-qk-ahead", replace(ws, block_n=32, stages=4, qk_ahead=True))]
        return out
    ws = hop.warp_specialized_config(kv_dtype, d)
    if ws is not None:
        # the other QK schedule too (next QK across the softmax, or after PV): registers
        # against overlap inside a warpgroup
        out += [("hopper-ws", ws), ("hopper-ws-qk-" + ("after" if ws.qk_ahead else "ahead"),
                                    replace(ws, qk_ahead=not ws.qk_ahead))]
        if kv_dtype == "int8" and ws.dv < 64:  # the 64-column PV chunks of the earlier config
            out.append(("hopper-ws-dv64-qk-after", replace(ws, dv=64, qk_ahead=False)))
        if kv_dtype == "int8" or d <= 128:
            # twice the keys per tile: the per-tile work (int32 fold, reductions, barriers)
            # amortised over more scores, against local memory (sm_90 compiles spill some)
            out.append(("hopper-ws-wide", replace(ws, block_n=2 * ws.block_n)))
    return out


def _three_consumers(kv_dtype: str, d: int, pv: str) -> list:
    """(label, config) of the route's three-consumer config ("hopper-ws-m192"), also with the
    next QK across the softmax ("hopper-ws-m192-qk-ahead"), where one exists."""
    m192 = hop.three_consumer_config(kv_dtype, d, pv)
    return [] if m192 is None else [("hopper-ws-m192", m192),
                                    ("hopper-ws-m192-qk-ahead", replace(m192, qk_ahead=True))]


def _wide_tiles(ws, d: int, split_release: bool = True) -> list:
    """(label, config) of 128-key tiles for a 16-bit-P route at head_dim <= 128 (the tile
    FlashAttention-3 runs there): each consumer's per-tile chain (QK wait, row maxima and
    their shuffles, barriers, the rescale test) over twice the keys, two consumer warpgroups
    (a third does not fit the registers). QK after PV ("hopper-ws-n128"); PV in flight across
    the next softmax in two partitions, with whole stages and released in two parts, and in
    one shared partition ("hopper-ws-pv-ahead-n128", "-n128-split" -- ``split_release``: an
    8-bit cache -- and "hopper-ws-shared-pv-ahead-n128"). Stages:
    :func:`int8attn.ops.prefill_hopper.wide_tile_config`'s (3 at head_dim 128, 4 below)."""
    wide = hop.wide_tile_config(ws, d)
    pv_ahead = hop.pv_in_flight_config(wide)
    split = [("hopper-ws-pv-ahead-n128-split", replace(pv_ahead, split_release=True))] if split_release else []
    return [("hopper-ws-n128", wide), ("hopper-ws-pv-ahead-n128", pv_ahead), *split,
            ("hopper-ws-shared-pv-ahead-n128", hop.shared_consumer_config(wide, pv_in_flight=True))]


def _pv_in_flight_placements(ws, split_release: bool = False) -> list:
    """(label, config) pairs of 16-bit PV in flight across the next softmax (QK issued with
    PV) and where it runs: two consumer partitions ("hopper-ws-pv-ahead", their PTX leaving
    Triton's worker dispatch loop); both consumer warpgroups in one 8-warp partition (one copy
    of their code), with the route's schedule and with PV in flight ("hopper-ws-shared*"); at
    head_dim <= 128 the two partitions with a 3- and a 5-stage ring ("hopper-ws-pv-ahead-s3", "-s5") and
    one consumer warpgroup per program ("hopper-ws-one*"); above it the two partitions with 32-key
    tiles in 4 and 5 stages ("hopper-ws-pv-ahead-n32-s4", "-s5": no local memory, where 64-key tiles
    spill). ``split_release`` (an 8-bit cache, whose loader converts V): the two partitions with
    ring stages given back in two parts, 8-bit copies after QK and fp16 V after PV
    ("hopper-ws-pv-ahead-split"; at head_dim <= 128 in 3 stages: "hopper-ws-pv-ahead-s3-split";
    above it with two tiles' copies in flight past the one converted, "-split-lag2", and 32-key
    tiles in 4 and 5 stages, "hopper-ws-pv-ahead-n32-s4-split", "-s5-split")."""
    pv_ahead = hop.pv_in_flight_config(ws)
    split = replace(pv_ahead, split_release=True)
    out = [("hopper-ws-pv-ahead", pv_ahead), *([("hopper-ws-pv-ahead-split", split)] if split_release else []),
           ("hopper-ws-shared", hop.shared_consumer_config(ws)),
           ("hopper-ws-shared-pv-ahead", hop.shared_consumer_config(ws, pv_in_flight=True))]
    if ws.dv <= 128:  # the ring's depth with PV in flight; one warpgroup per program, two programs per SM
        out += [(f"hopper-ws-pv-ahead-s{n}", replace(pv_ahead, stages=n)) for n in (3, 5) if n != pv_ahead.stages]
        if split_release:
            out.append(("hopper-ws-pv-ahead-s3-split", replace(split, stages=3)))
        out += [("hopper-ws-one", hop.shared_consumer_config(ws, warpgroups=1)),
                ("hopper-ws-one-pv-ahead", hop.shared_consumer_config(ws, pv_in_flight=True, warpgroups=1))]
    else:  # 32-key tiles: the accumulator, a score tile and both P tiles fit the consumers' registers
        out += [(f"hopper-ws-pv-ahead-n32-s{n}", replace(pv_ahead, block_n=32, stages=n)) for n in (4, 5)]
        if split_release:  # and the two-part release: the route's 3 stages, 2 tiles converted ahead, 32-key tiles
            out += [("hopper-ws-pv-ahead-split-lag2", replace(split, convert_lag=2)),
                    *[(f"hopper-ws-pv-ahead-n32-s{n}-split", replace(split, block_n=32, stages=n)) for n in (4, 5)]]
    return out


def _other_rescale(ws) -> tuple:
    """(label, config): the 16-bit-P rescale rule the route's config does not take --
    "hopper-ws-rescale-all" (every tile) beside a per-row lazy default, else
    "hopper-ws-lazy-rows"."""
    return "hopper-ws-rescale-all" if ws.lazy_rescale == "rows" else "hopper-ws-lazy-rows", hop.other_rescale_rule(ws)


def bench_case(rec, shape, prefix, kv_dtype, pvs):
    hq, hkv, d = SHAPES[shape]
    b = testing.make_paged_batch([prefix + CHUNK], [CHUNK], num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                                 kv_dtype=kv_dtype, seed=7, device="cuda")
    args = (b.query, b.cache, b.block_table, b.seq_lens, b.query_start_loc)
    ops = unmasked_ops(hq, d, CHUNK, prefix)
    base = dict(bench="prefill_hopper", shape=shape, prefix=prefix, chunk=CHUNK, kv_dtype=kv_dtype, block_size=16)
    qq, qs = quantize_query(b.query, kv_dtype)
    codes = {} if kv_dtype == "bf16" else dict(q_quant=qq, q_scale=qs)  # a BF16 cache reads the query itself
    if codes:
        us = bench.time_eager(lambda: quantize_query(b.query, kv_dtype))
        _record(rec, **base, kernel="quantize_query", us=us)
    for pv in pvs:
        try:
            portable = prefill_attention(*args, pv_mode=pv)
            t = _timed(lambda: prefill_attention(*args, pv_mode=pv))
            us_p = t["us"]
            _record(rec, **base, pv_mode=pv, kernel="portable", **t, tops=ops / us_p * 1e-6)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            _record(rec, **base, pv_mode=pv, kernel="portable", error=repr(e)[:400])
            continue
        for label, cfg in hopper_configs(kv_dtype, d, pv):
            if LABELS:
                if label not in LABELS:
                    continue
            elif (ONLY_WS and not label.startswith("hopper-ws")) or (ROUTED and label != "hopper-ws"):
                continue
            try:
                out = testing.poisoned_like(portable)
                run = lambda: hop.prefill(*args, kernel="hopper", pv_mode=pv, out=out, config=cfg,  # noqa: E731
                                          **codes)
                run()
                torch.cuda.synchronize()
                finite = bool(torch.isfinite(out.float()).all())
                err = _rel_l2(out, portable)
                t = _timed(run)
                us_h = t["us"]
                _record(rec, **base, pv_mode=pv, kernel=label, **t, tops=ops / us_h * 1e-6,
                        rel_l2_vs_portable=err, all_written=finite, speedup_vs_portable=us_p / us_h, config=str(cfg))
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                _record(rec, **base, pv_mode=pv, kernel=label, error=repr(e)[:400], config=str(cfg))
    return b


def bench_bf16_peers(rec, shape, prefix):
    hq, hkv, d = SHAPES[shape]
    kv_len = prefix + CHUNK
    g = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(1, CHUNK, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, kv_len, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(1, kv_len, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    ops = unmasked_ops(hq, d, CHUNK, prefix)
    base = dict(bench="prefill_hopper", shape=shape, prefix=prefix, chunk=CHUNK, kv_dtype="bf16 dense")
    # SDPA on [B, H, L, D], K/V expanded to the query heads, lower-right causal mask
    from torch.nn.attention.bias import causal_lower_right
    qt = q.transpose(1, 2)
    kt = k.transpose(1, 2).repeat_interleave(hq // hkv, 1)
    vt = v.transpose(1, 2).repeat_interleave(hq // hkv, 1)
    mask = causal_lower_right(CHUNK, kv_len)
    sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask)  # noqa: E731
    try:
        ref = sdpa()
        t = _timed(sdpa)
        _record(rec, **base, kernel="sdpa_bf16", **t, tops=ops / t["us"] * 1e-6)
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        _record(rec, **base, kernel="sdpa_bf16", error=repr(e)[:400])
        ref = None
    _flashinfer_paged(rec, dict(base, kv_dtype="bf16 paged"), q, k, v, ops)
    try:
        from flash_attn.cute import flash_attn_func  # FlashAttention-4 (CuTe DSL)
    except Exception as e:  # noqa: BLE001
        _record(rec, **base, kernel="fa4_bf16", error=f"not importable: {e!r}"[:300])
        return
    try:
        fa = lambda: flash_attn_func(q, k, v, causal=True)  # noqa: E731 - bottom-right aligned causal
        out = fa()
        out = out[0] if isinstance(out, tuple) else out
        err = _rel_l2(out.transpose(1, 2), ref) if ref is not None else None
        t = _timed(fa)
        _record(rec, **base, kernel="fa4_bf16", **t, tops=ops / t["us"] * 1e-6, rel_l2_vs_sdpa=err)
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        _record(rec, **base, kernel="fa4_bf16", error=repr(e)[:400])


def _flashinfer_paged(rec, base, q, k, v, ops) -> None:
    """FlashInfer's paged prefill (``backend="fa3"``, BF16, 16-token pages in a shuffled
    order), the paged BF16 peer, on the dense peers' tokens; timed by this script's timers."""
    import _peers as P

    times = {}

    class _Timer:  # the timing hook _peers calls: eager and, with --graph, graph replay
        @staticmethod
        def time(fn):
            times.update(_timed(fn))
            return times["us"]

    try:
        res = P.flashinfer_prefill(_Timer, q[0], k[0], v[0], [k.shape[1]], [q.shape[1]])
    except P.Unavailable as e:
        _record(rec, **base, kernel="flashinfer_fa3_bf16", error=str(e)[:300])
        return
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        _record(rec, **base, kernel="flashinfer_fa3_bf16", error=repr(e)[:400])
        return
    _record(rec, **base, kernel="flashinfer_fa3_bf16", **times, tops=ops / times["us"] * 1e-6,
            rel_l2_vs_fp32=res["rel_l2"], peer_version=res["peer_version"])


#: Mixed-batch overlap variants: (label) -> (side stream priority, prefill launched first)
OVERLAP_VARIANTS = {"decode-first hi": (-1, False), "decode-first": (0, False), "prefill-first hi": (-1, True)}


@contextlib.contextmanager
def _overlap(variant):
    """The attention module's overlap order and priority set to ``variant`` inside the block."""
    from int8attn.ops import attention as A

    saved = A.OVERLAP_PRIORITY, A.OVERLAP_PREFILL_FIRST
    if variant is not None:
        A.OVERLAP_PRIORITY, A.OVERLAP_PREFILL_FIRST = OVERLAP_VARIANTS[variant]
    try:
        yield
    finally:
        A.OVERLAP_PRIORITY, A.OVERLAP_PREFILL_FIRST = saved


def bench_batches(rec, shape, kv_dtype):
    """Per-token cost of what "auto" runs (a plan: checked metadata, the query quantized in
    the call) for the single 4096-token chunk, a 4 x 4096 causal batch and a mixed batch
    (16 decode sequences at context 8192 beside one 4096-token chunk) and those decode
    sequences alone, one run; with the library's default PV (``pv_mode`` None: each kernel
    its own -- 16-bit in prefill, 8-bit in decode; row ``pv_mode: "default"``), then 16-bit
    and 8-bit PV forced on both."""
    import int8attn

    hq, hkv, d = SHAPES[shape]
    cases = {"1x4096": ([CHUNK], [CHUNK]), "4x4096": ([CHUNK] * 4, [CHUNK] * 4),
             "16dec+4096": ([8192] * 16 + [CHUNK], [1] * 16 + [CHUNK]),
             # the mixed batch's decode sequences alone (a pure decode batch: its plan may take
             # the Hopper decode kernel, where the mixed batch runs the portable one)
             "16dec": ([8192] * 16, [1] * 16)}
    for name, (lens, qlens) in cases.items():
        b = testing.make_paged_batch(lens, qlens, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, kv_dtype=kv_dtype,
                                     seed=11, device="cuda")
        args = (b.query, b.cache, b.block_table, b.seq_lens, b.query_start_loc)
        ops = sum(unmasked_ops(hq, d, q, n - q) for n, q in zip(lens, qlens))
        runs = [(pv, None) for pv in (None, DEFAULT_PV[kv_dtype], kv_dtype)]
        if name == "16dec+4096":  # the decode launch beside the prefill launch, each order / priority
            runs += [(None, variant) for variant in OVERLAP_VARIANTS]
        for pv, variant in runs:
            with _overlap(variant):
                plan = int8attn.plan_attention(b.cache, b.block_table, b.seq_lens, b.query_start_loc, hq, pv_mode=pv,
                                               overlap=variant is not None)
                out = testing.poisoned_like(torch.empty(b.query.shape, dtype=torch.bfloat16, device="cuda"))
                plan.run(*args, out=out)
                torch.cuda.synchronize()
                us = bench.time_eager(lambda: plan.run(*args, out=out))
                graph_us = bench.time_graph(lambda: plan.run(*args, out=out)) if GRAPH else None
            _record(rec, bench="prefill_hopper", shape=shape, kv_dtype=kv_dtype, pv_mode=pv or "default", batch=name,
                    kernel=f"plan:{plan.prefill_kernel}", decode_kernel=plan.decode_kernel if plan.has_decode else None,
                    overlap=variant or "off", us=us, tokens=int(sum(qlens)),
                    us_per_token=us / sum(qlens), tops=ops / us * 1e-6,
                    **({"graph_us": graph_us, "graph_us_per_token": graph_us / sum(qlens)} if graph_us else {}),
                    all_written=bool(torch.isfinite(out.float()).all()))
            del plan, out
        del b
        torch.cuda.empty_cache()


def bench_gemm_floor(rec, size: int = 8192):
    from gemm_floor_hopper import gemm_s8

    a = torch.randint(-127, 128, (size, size), dtype=torch.int8, device="cuda")
    b = torch.randint(-127, 128, (size, size), dtype=torch.int8, device="cuda")
    c = gemm_s8(a, b)
    want = a[:256].double() @ b[:256].double().T  # exact in float64 (|sum| < 2**53)
    exact = bool(torch.equal(c[:256, :256].double(), want))
    us = bench.time_eager(lambda: gemm_s8(a, b, out=c))
    _record(rec, bench="prefill_hopper", kernel="gluon_wgmma_s8_gemm", m=size, n=size, k=size, us=us,
            tops=2.0 * size ** 3 / us * 1e-6, exact_first_tile=exact)


def print_table(rows, key: str = "us") -> None:
    """One line per timed kernel: ``key`` ("us" eager, or "graph_us"), TOP/s, and ratios
    against the portable kernel on the same route, SDPA / FA4 BF16 (dense), FlashInfer's paged
    BF16 ("FI") and the BF16 cache on the warp-specialized kernel ("WS16") on the same case
    (all from this run, all by ``key``)."""
    timed = [r for r in rows if key in r and "shape" in r and "batch" not in r and r.get("kernel") != "quantize_query"]
    peers = {(r["shape"], r["prefix"], r["kernel"]): r[key] for r in timed if r.get("pv_mode") is None}
    port = {(r["shape"], r["prefix"], r["kv_dtype"], r["pv_mode"]): r[key] for r in timed
            if r.get("kernel") == "portable"}
    # the BF16 cache on the warp-specialized kernel: the ratio within one design
    ws16 = {(r["shape"], r["prefix"]): r[key] for r in timed
            if r.get("kernel") == "hopper-ws" and r.get("kv_dtype") == "bf16"}
    head = f"{'case':<22} {'kv/pv':<10} {'kernel':<23} {key:>9} {'TOP/s':>7} {'x port':>7} {'x SDPA':>7} " \
           f"{'x FA4':>7} {'x FI':>7} {'x WS16':>7} {'relL2':>7}"
    print("\n" + head + "\n" + "-" * len(head))
    for r in timed:
        case = f"{r['shape']} p{r['prefix']}"
        route = "bf16" if r.get("pv_mode") is None else f"{r['kv_dtype']}/{r['pv_mode']}"
        p = port.get((r["shape"], r["prefix"], r["kv_dtype"], r.get("pv_mode")))
        sd = peers.get((r["shape"], r["prefix"], "sdpa_bf16"))
        fa = peers.get((r["shape"], r["prefix"], "fa4_bf16"))
        fi = peers.get((r["shape"], r["prefix"], "flashinfer_fa3_bf16"))
        ratio = lambda ref: f"{ref / r[key]:7.2f}" if ref else f"{'-':>7}"  # noqa: E731
        err = r.get("rel_l2_vs_portable")
        tops = r["tops"] * r["us"] / r[key] if "tops" in r else 0.0
        print(f"{case:<22} {route:<10} {r['kernel']:<23} {r[key]:9.1f} {tops:7.1f} {ratio(p)} "
              f"{ratio(sd)} {ratio(fa)} {ratio(fi)} {ratio(ws16.get((r['shape'], r['prefix'])))} "
              f"{'' if err is None else format(err, '7.4f')}")
    for r in rows if key == "us" else ():
        if r.get("kernel") == "gluon_wgmma_s8_gemm" and "tops" in r:
            print(f"s8 wgmma GEMM floor {r['m']}^3: {r['us']:.1f} us, {r['tops']:.0f} TOP/s")
        if "error" in r:
            print("error:", {k: r.get(k) for k in ("shape", "prefix", "kv_dtype", "pv_mode", "kernel", "error")})


def print_batch_table(rows) -> None:
    """The batch rows (``bench_batches``): per-token cost and its ratio to the single chunk's
    with the same shape, cache and PV choice (all from this run)."""
    batch = [r for r in rows if "batch" in r and "us_per_token" in r]
    if not batch:
        return
    single = {(r["shape"], r["kv_dtype"], r["pv_mode"]): r["us_per_token"] for r in batch if r["batch"] == "1x4096"}
    gsingle = {(r["shape"], r["kv_dtype"], r["pv_mode"]): r["graph_us_per_token"] for r in batch
               if r["batch"] == "1x4096" and "graph_us_per_token" in r}
    print(f"{'shape':<14} {'kv':<5} {'pv':<8} {'batch':<11} {'overlap':<17} {'kernel':<14} {'decode':<9} {'us':>8} "
          f"{'us/token':>9} {'x 1x4096':>8} {'graph us':>9} {'x 1x4096':>8}")
    for r in batch:
        key = (r["shape"], r["kv_dtype"], r["pv_mode"])
        ratio = f"{r['us_per_token'] / single[key]:8.2f}" if key in single else f"{'-':>8}"
        g = r.get("graph_us")
        gratio = f"{r['graph_us_per_token'] / gsingle[key]:8.2f}" if g and key in gsingle else f"{'-':>8}"
        print(f"{r['shape']:<14} {r['kv_dtype']:<5} {r['pv_mode']:<8} {r['batch']:<11} {r.get('overlap', 'off'):<17} "
              f"{r['kernel']:<14} {str(r.get('decode_kernel')):<9} {r['us']:8.1f} {r['us_per_token']:9.4f} {ratio} "
              f"{g if g is None else round(g, 1)!s:>9} {gratio}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="directory of prefill_hopper.jsonl (default benchmarks/results)")
    ap.add_argument("--quick", action="store_true", help="prefix 28672 only, no fp8 cache")
    ap.add_argument("--batches", action="store_true", help="the batch cases (bench_batches) too")
    ap.add_argument("--only-ws", action="store_true", help="of the Hopper kernels, the warp-specialized ones only")
    ap.add_argument("--graph", action="store_true", help="also time every attention row by CUDA-graph replay")
    ap.add_argument("--routed", action="store_true",
                    help="of the Hopper kernels, the warp-specialized route configs only (no variants)")
    ap.add_argument("--labels", default="", help="comma-separated Hopper config labels to time (only these)")
    ap.add_argument("--caches", default="int8,fp8,bf16", help="comma-separated cache dtypes to time")
    ap.add_argument("--prefixes", default=",".join(map(str, PREFIXES)), help="comma-separated prefix lengths")
    ap.add_argument("--shapes", default=",".join(DEFAULT_SHAPES), help=f"comma-separated, of {list(SHAPES)}")
    opts = ap.parse_args()
    global ONLY_WS, ROUTED, GRAPH, LABELS
    ONLY_WS, ROUTED, GRAPH = opts.only_ws, opts.routed, opts.graph
    LABELS = tuple(name for name in opts.labels.split(",") if name)
    opts.shapes = [name for name in opts.shapes.split(",") if name]
    unknown = set(opts.shapes) - set(SHAPES)
    if unknown:
        ap.error(f"unknown shapes {sorted(unknown)}")
    path = os.path.join(opts.out, "prefill_hopper.jsonl") if opts.out else None
    rec = bench.Recorder("prefill_hopper", path)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    try:
        bench_gemm_floor(rec)
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        _record(rec, bench="prefill_hopper", kernel="gluon_wgmma_s8_gemm", error=repr(e)[:400])
    # a timeout's SIGTERM still prints the table and saves the rows measured so far
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        run_all(rec, opts)
    finally:
        print_table(rec.rows)
        if any("graph_us" in r for r in rec.rows):
            print_table(rec.rows, "graph_us")
        print_batch_table(rec.rows)
        print("rows ->", rec.save())


def run_all(rec, opts) -> None:
    prefixes = [int(p) for p in opts.prefixes.split(",") if p]
    caches = [c for c in opts.caches.split(",") if c]
    for shape in opts.shapes:
        for prefix in (prefixes[:1] if opts.quick else prefixes):
            for kv in (("int8",) if opts.quick else caches):
                try:
                    bench_case(rec, shape, prefix, kv, [pv for k, pv in ROUTES if k == kv])
                except Exception as e:  # noqa: BLE001
                    traceback.print_exc()
                    _record(rec, bench="prefill_hopper", shape=shape, prefix=prefix, kv_dtype=kv, error=repr(e)[:400])
                torch.cuda.empty_cache()
            bench_bf16_peers(rec, shape, prefix)
            torch.cuda.empty_cache()
    for shape in opts.shapes if opts.batches else ():
        for kv in ("int8", "fp8"):
            try:
                bench_batches(rec, shape, kv)
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                _record(rec, bench="prefill_hopper", shape=shape, kv_dtype=kv, batch="?", error=repr(e)[:400])


if __name__ == "__main__":
    main()
