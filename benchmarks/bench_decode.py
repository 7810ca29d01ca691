"""Paged decode on the GPU: correctness at real shapes, SASS proof, tuning, timings.

One script, one device call (about 3 minutes on an H200 including compilation; a
deadline, ``BENCH_DEADLINE_S`` = 200 s by default, skips later sections rather than run
over). Sections, each under try/except so one failure does not lose the rest:

0. setup: copy bandwidth, caches, every kernel variant compiled in parallel worker
   processes (they fill Triton's on-disk cache; the main process then loads them);
1. ``acc``: accuracy at real shapes (24q/4kv D256 page 16, outlier keys) vs the float64
   reference for every cache dtype / PV mode (same-quantization reference for INT8) and
   the SASS of the kernels that ran (``int8attn.launches``): IMMA/IGMMA for INT8, QGMMA or
   what Triton chose for fp8, HMMA/HGMMA for BF16; registers, spills, shared memory;
2. ``tune``: a handful of tile / warps / stages configs per cache dtype (picked from the
   sm_90 static analysis) at bs16 L32k, bs1 L32k, bs64 L8k; the best (geometric mean)
   becomes the config of the headline table;
3. ``grid``: the headline table, docs/design.md §4 shapes at q_len 1: eager (CUDA
   events, L2 flushed) and CUDA-graph replay over rotating block tables (so the KV bytes
   never sit in L2), % of copy bandwidth, vs PyTorch SDPA BF16 on contiguous K/V and vs
   our own BF16-cache path;
4. ``small``: batch 1 at L8k and L32k, configs x split counts; ``pairs``: the planner's split
   count against half of it where its programs have few tiles; ``occ``: the 8-bit configs with
   and without a register cap (DecodeConfig.maxnreg) at the FP8-goal points; ``prof``:
   split / merge kernel device times (torch profiler) against the graph time;
5. ``batch``: bs 1..64 at L 8k (no cliff); 6. ``mt``: q_len 2 and 4 at a few points;
   ``mtcfg``: q4 over candidate 32-row configs (one program per KV head); ``hsplit``: q4 /
   q8 with the planner's head split against one program per KV head; ``fused``: the
   fused merge (one launch) against split + merge kernels, graph and eager; ``pdl``: the
   merge as the split kernel's programmatic dependent (trigger positions) and cyclic
   splits; ``qpdl``: calls that quantize their query, the split kernel launched plainly or
   as the quantize kernel's programmatic dependent, beside the producer's codes;
7. ``d128``: 32q/8kv D128; 8. ``splits``: split counts around the planner's choice;
9. ``peers``: FlashInfer paged decode (fa2 tensor-core kernel, BF16 and FP8 e4m3 K/V) at
   the headline grid points, when installed (benchmarks/_peers.py; rows carry its version).

Rows go to ``--out DIR/decode.jsonl`` (else benchmarks/results/decode.jsonl) via
int8attn.bench.Recorder, a markdown summary to ``DIR/decode_summary.md``, the log to
``DIR/decode_log.txt``. ``--smoke`` runs every section at toy sizes, every peer attempted:
on the GPU as a first check of a run (well under a minute plus the peers' JIT), without one
under the CPU interpreter (timings meaningless); ``--quick`` times fewer points; ``--skip``
names sections (``acc,tune,...``); ``--budget-s`` overrides ``BENCH_DEADLINE_S``. The
command line, sections, rows, logging, the compile pool, SASS summaries, kernel profiles
and peer attempts are benchmarks/_harness.py; this script is the setup and the cases.

    PYTHONUNBUFFERED=1 PYTHONPATH=src python3 benchmarks/bench_decode.py --smoke --out $OUT/smoke
    PYTHONUNBUFFERED=1 PYTHONPATH=src python3 benchmarks/bench_decode.py --out $OUT
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import itertools
import math
import sys

import torch

import _harness as H
import _peers as P

SMOKE = "--smoke" in sys.argv
INTERPRET = H.start(SMOKE)   # before the kernels are imported

from int8attn import bench, launches, reference, runtime, testing  # noqa: E402
from int8attn.cache import PagedKVCache  # noqa: E402
from int8attn.ops import decode as dec  # noqa: E402
from int8attn.ops.producer import quantize_query  # noqa: E402

DEV = "cpu" if INTERPRET else "cuda"

# --------------------------------------------------------------------------- shapes
QUICK = "--quick" in sys.argv
HEADLINE = dict(hq=24, hkv=4, d=256, page=16)
COMMON = dict(hq=32, hkv=8, d=128, page=16)
MT_QLENS = (2, 4)
if SMOKE:
    BATCHES, CONTEXTS, SWEEP_BATCHES, L8K = [1, 2], [64, 160], [1, 3], 160
    TUNE_SHAPES, MT_POINTS, D128_POINTS = [(2, 160), (1, 160)], [(2, 160)], [(2, 160)]
    MAX_BS, MAX_L = 4, 256
elif QUICK:
    BATCHES, CONTEXTS, SWEEP_BATCHES, L8K = [1, 16, 64], [8192, 32768], [1, 4, 16, 32, 64], 8192
    TUNE_SHAPES, MT_POINTS, D128_POINTS = [(16, 32768), (1, 32768)], [(16, 8192)], [(16, 32768)]
    MAX_BS, MAX_L = 64, 32768
else:
    BATCHES, CONTEXTS, L8K = [1, 16, 64], [1024, 8192, 16384, 32768], 8192
    SWEEP_BATCHES = [1, 2, 4, 8, 12, 16, 24, 32, 48, 64]
    TUNE_SHAPES = [(16, 32768), (1, 32768), (64, 8192)]
    MT_POINTS = [(1, 32768), (16, 8192), (16, 32768), (64, 8192)]
    D128_POINTS = [(1, 32768), (16, 32768)]
    MAX_BS, MAX_L = 64, 32768
L1K = min(1024, MAX_L)  # the short context of the pdl sections (within the smoke run's cache)

# Paths timed: name -> (cache dtype, pv mode, config override or None). TUNED_PATHS take
# the config the tuning section chose for their cache dtype; the others keep their own.
WIDE_FP8 = dec.DecodeConfig(block_n=64, num_warps=8, num_stages=5, min_block_m=64)
SWAP_FP8 = dec.DecodeConfig(block_n=64, num_warps=4, num_stages=6, swap_ab=True)
PATHS = {
    "int8": ("int8", "int8", None),
    "int8_pvbf16": ("int8", "bf16", None),
    "fp8": ("fp8", "fp8", None),
    "fp8_pvbf16": ("fp8", "bf16", None),
    "fp8_qgmma": ("fp8", "fp8", WIDE_FP8),
    "fp8_swap": ("fp8", "fp8", SWAP_FP8),
    "bf16": ("bf16", "bf16", None),
}
TUNED_PATHS = ("int8", "fp8", "bf16")
SIDE_PATHS, SIDE_CONTEXTS = ("fp8_pvbf16", "fp8_qgmma", "fp8_swap"), (L8K, CONTEXTS[-1])
ACC_MODES = {"int8": ["int8", "bf16", "int8_signed", "swap"], "fp8": ["fp8", "bf16", "qgmma", "swap", "swap_bf16"],
             "bf16": ["bf16"]}
#: accuracy modes that are a config rather than a PV precision: mode -> (pv_mode or None, config)
ACC_CONFIG_MODES = {"qgmma": ("fp8", WIDE_FP8), "swap": (None, SWAP_FP8), "swap_bf16": ("bf16", SWAP_FP8)}
# (block_n, num_warps, num_stages); the first of each list is the default config. Triton
# buffers (num_stages - 1) // 2 K/V tiles here. Static figures (Triton 3.6, sm_90, D256,
# 16 rows, 8-bit V pages stored transposed; warp-instructions per key in the single-pass
# loop, registers, buffered tiles):
#   int8 128/4/4: 29, 255 regs, 1 buf (2 programs/SM) | 128/4/5: 30, 2 buf | 64/4/6: 46, 246
#        regs, 2 buf | 128/8/4: 44, 206 regs | 256/8/3: 30, 244 regs | 64/8/9: 61, 214 regs,
#        4 buf | 32/4/9: 67, 231 regs (the defaults of the row-major V layout: 77 and 81)
#   bf16 32/8/9: 74, 169 regs, 4 buf | 32/4/9: 49, 228 regs | 32/8/11: 74, 5 buf | 64/8/5: 49, 2 buf
#   fp8  64/8/7: 118, 231 regs | 128/8/4: 101, 255 regs (e4m3 -> f16 conversions for HMMA)
# Left out: spills (int8 256/4/3; fp8 128/4/4, 64/4/6) or over 227 KB (bf16 64/8/7).
# Operand-swapped tiles (a 5th entry True: DecodeConfig.swap_ab; keys in the MMA's M rows,
# so 16 query rows reach QGMMA / IGMMA): fp8 64/4/6 47 warp-instructions per key, 255 regs,
# 113 KB (2 programs/SM); 64/4/8 47, 150 KB; 128/8/5 47, 213 KB; int8 64/4/6 52 (IGMMA).
# 128/4/5 swapped spills 64 B; 32 packed rows swapped spill 312 B (not swept).
# Register-capped (a 6th entry: DecodeConfig.maxnreg), for a third or fourth program per SM:
#   int8 64/4/4 swap r168: 52 per key, 67 KB, no spill in the single-pass loop (3/SM) |
#        32/4/6 swap r168: 72 per key (QK on IMMA, PV on IGMMA), 50 KB, 40 B stack (3/SM) |
#        32/4/6 swap r128: 79 per key, 208 B stack (4/SM) | 32/4/4 swap r128: 74, 29.5 KB (4/SM)
#   fp8  64/4/4 swap r168: 44 per key, 75 KB (3/SM); 32-key fp8 tiles fall back to HMMA for QK.
CAPPED = {"int8": [(64, 4, 4, 16, True, 168), (32, 4, 6, 16, True, 168), (32, 4, 6, 16, True, 128),
                   (32, 4, 4, 16, True, 128)],
          "fp8": [(64, 4, 4, 16, True, 168)]}
TUNE_CONFIGS = {
    "int8": [(64, 4, 6, 16, True), *CAPPED["int8"], (128, 4, 4), (128, 4, 5), (64, 4, 6)],
    "fp8": [(64, 4, 6, 16, True), *CAPPED["fp8"], (64, 4, 8, 16, True)],
    "bf16": [(64, 8, 5), (32, 4, 9), (32, 8, 9)],
}


def cfg_label(c) -> str:
    """block_n/warps/stages[/m<rows>][/swap] of a DecodeConfig or a TUNE_CONFIGS tuple."""
    c = c if isinstance(c, dec.DecodeConfig) else dec.DecodeConfig(*c)
    return (f"{c.block_n}/{c.num_warps}/{c.num_stages}" + (f"/m{c.min_block_m}" if c.min_block_m != 16 else "")
            + ("/swap" if c.swap_ab else "") + (f"/r{c.maxnreg}" if c.maxnreg else "")
            + ({True: "/fused", "last": "/fused", "barrier": "/barrier"}.get(c.fused_merge, ""))
            + {None: "", False: "/pdl-off", True: "/pdl"}.get(c.pdl, f"/pdl-{c.pdl}")
            + ("/cyclic" if c.cyclic_splits else ""))
# head_dim 128, 16 rows (32q/8kv): int8 128/4/4 is 22 warp-instructions per key, 198 regs;
# int8 128/4/5 swapped 29, 233 regs (row-major 128/4/5: 23, 223 regs);
# fp8 swapped 64/4/6 39 per key, 193 regs; 128/4/5 27, 255 regs (128/4/4 keeps one tile: unpipelined)
D128_INT8_CONFIGS = [(128, 4, 4), (128, 4, 5), (64, 4, 6), (128, 4, 5, 16, True)]
D128_FP8_CONFIGS = [(64, 4, 6, 16, True), (128, 4, 5, 16, True), (64, 8, 9)]
if SMOKE:
    TUNE_CONFIGS = {kv: cfgs[:2] for kv, cfgs in TUNE_CONFIGS.items()}
    D128_INT8_CONFIGS, D128_FP8_CONFIGS = D128_INT8_CONFIGS[:1], D128_FP8_CONFIGS[:1]
BS_MID = 2 if SMOKE else 16


# --------------------------------------------------------------------------- helpers
def make_cache(kv_dtype: str, num_blocks: int, shape: dict, gen_seed: int = 0) -> PagedKVCache:
    """A cache full of random data (never zeros), built on the device in chunks."""
    cache = PagedKVCache(num_blocks, shape["page"], shape["hkv"], shape["d"], kv_dtype=kv_dtype, device=DEV,
                         key_smoothing="none")
    g = torch.Generator(device=DEV).manual_seed(gen_seed)
    chunk = max(1, (1 << 28) // (shape["hkv"] * shape["page"] * shape["d"]))
    for t in (cache.key, cache.value):
        for b0 in range(0, num_blocks, chunk):
            part = t[b0:b0 + chunk]
            if kv_dtype == "int8":
                part.copy_(torch.randint(-127, 128, part.shape, generator=g, device=DEV, dtype=torch.int16))
            else:
                part.copy_(torch.randn(part.shape, generator=g, device=DEV, dtype=torch.float32).to(part.dtype))
    if cache.quantized:
        for s in (cache.key_scale, cache.value_scale):
            s.copy_(torch.rand(s.shape, generator=g, device=DEV) * 0.02 + 0.005)
    return cache


def block_tables(num_blocks: int, bs: int, ctx: int, page: int, rotations: int, seed: int = 1):
    """``rotations`` block tables over disjoint random pages (so back-to-back graph
    replays never find the previous call's KV bytes in L2)."""
    per = bs * (ctx // page)
    rotations = max(1, min(rotations, num_blocks // per))
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
    return [perm[i * per:(i + 1) * per].view(bs, ctx // page).to(torch.int32).to(DEV) for i in range(rotations)]


def kv_bytes(kv_dtype: str, bs: int, ctx: int, hkv: int, d: int) -> int:
    elem = 1 if kv_dtype in ("int8", "fp8") else 2
    scales = 8 if kv_dtype in ("int8", "fp8") else 0
    return bs * hkv * ctx * (2 * d * elem + scales)


class Run(H.Run):
    """The harness run plus what the decode sections share: caches, copy bandwidth and
    the configs the tuning section chose."""

    def __init__(self, out_dir, deadline_s: float):
        super().__init__("decode", out_dir, deadline_s=deadline_s, interpret=INTERPRET)
        self.copy_bw = 1.0
        self.caches = {}
        self.caches_d128 = {}
        self.best = {}          # kv dtype -> DecodeConfig chosen by the tuning section
        self.acc_rows = []
        self.sass_rows = []

    def config(self, kv):
        return self.best.get(kv)


def pct_copy(r: Run, row: dict) -> dict:
    """Bandwidth and % of copy bandwidth of each timing of ``row`` (over ``row["bytes"]``)."""
    for mode in ("graph", "eager"):
        if row.get(f"{mode}_us"):
            bw = row["bytes"] / (row[f"{mode}_us"] * 1e-6)
            row[f"{mode}_bw_tbs"] = bw / 1e12
            row[f"{mode}_pct_copy"] = 100 * bw / r.copy_bw
    return row


class Decode:
    """One timed configuration of our kernel over rotating block tables."""

    def __init__(self, cache, shape, bs, ctx, q_len, pv_mode, config=None, num_splits=None, quantize_in_call=False,
                 tables=None, head_split=None):
        self.cache = cache
        t = bs * q_len
        self.query = torch.randn(t, shape["hq"], shape["d"], device=DEV, dtype=torch.float32).to(torch.bfloat16)
        self.tables = tables or block_tables(cache.num_blocks, bs, ctx, shape["page"], 4)
        self.seq_lens = torch.full((bs,), ctx, dtype=torch.int32, device=DEV)
        self.qsl = torch.arange(0, t + 1, q_len, dtype=torch.int32, device=DEV)
        self.plan = dec.plan_decode(tuple(self.query.shape), cache, tuple(self.tables[0].shape), pv_mode=pv_mode,
                                    num_splits=num_splits, config=config, head_split=head_split)
        self.qq, self.qs = (None, None) if quantize_in_call or not cache.quantized else quantize_query(
            self.query, cache.kv_dtype)
        self.ws = dec.DecodeWorkspace(t, shape["hq"], shape["d"], max(2, self.plan.num_splits), device=DEV)
        self.out = torch.empty_like(self.query)
        self._it = itertools.cycle(self.tables)
        # built once, eagerly, as a plan's run keeps it: a graph captures only its kernels
        # (a launch built under capture would allocate there, e.g. zeroed merge counters)
        self.launch = dec.DecodeLaunch.for_tensors(self.plan, cache, self.query, self.qq, self.qs, self.tables[0],
                                                   self.out.stride(), self.ws)
        self.qk_scale = dec.qk_scale_of(None, shape["d"])

    def __call__(self):
        self.launch(self.query, self.qq, self.qs, self.cache, next(self._it), self.seq_lens, self.qsl, self.out,
                    self.qk_scale)
        return self.out


# --------------------------------------------------------------------------- compile worker, timed paths
def _variant_key(kv, pv, shape, plan):
    c = plan.config
    return (kv, pv, shape["hq"], shape["hkv"], shape["d"], shape["page"], plan.tokens_per_pass, plan.block_m,
            c.block_n, c.num_warps, c.num_stages, c.min_block_m, c.swap_ab, c.maxnreg, c.fused_merge, plan.head_split,
            c.pdl, c.cyclic_splits)


def _compile_worker(key):
    """Run one variant once on toy inputs with the same specialization (worker process)."""
    kv, pv, hq, hkv, d, page, tpp, block_m, block_n, warps, stages, min_bm, swap, maxnreg, fused, hsplit, pdl, \
        cyclic = key
    shape = dict(hq=hq, hkv=hkv, d=d, page=page)
    bs, ctx = 2, 4 * max(block_n, page)
    cache = make_cache(kv, bs * ctx // page, shape)
    cfg = dec.DecodeConfig(block_n, warps, stages, min_bm, swap, maxnreg, fused, pdl, cyclic)
    plan = dec.DecodePlan(num_splits=2, tokens_per_pass=tpp, block_m=block_m, config=cfg, pv_mode=pv, head_split=hsplit)
    q = torch.randn(bs * tpp, hq, d, device=DEV).to(torch.bfloat16)
    bt = torch.arange(bs * ctx // page, dtype=torch.int32, device=DEV).view(bs, -1)
    sl = torch.full((bs,), ctx, dtype=torch.int32, device=DEV)
    qsl = torch.arange(0, bs * tpp + 1, tpp, dtype=torch.int32, device=DEV)
    qq, qs = (None, None) if not cache.quantized else quantize_query(q, kv)
    dec.run_decode(plan, q, cache, bt, sl, qsl, None, None, qq, qs, None)
    torch.cuda.synchronize()
    return key


def _pdl_trigger(plan):
    """Where the last split launch of ``plan`` triggered its dependent merge (None: no PDL)."""
    rec = launches.last("_decode_split_kernel")
    return rec.facts.get("pdl") if rec is not None and rec.facts.get("plan") == plan else None


def headline_plan(r: Run, kv: str, bs: int, ctx: int, q_len: int = 1, **kw) -> "dec.DecodePlan":
    """The plan the HEADLINE shape gets at batch ``bs``, ``q_len`` query tokens each, over a
    block table of ``ctx`` tokens (the planner's config and split count at that point)."""
    return dec.plan_decode((bs * q_len, HEADLINE["hq"], HEADLINE["d"]), r.caches[kv], (bs, ctx // HEADLINE["page"]),
                           **kw)


def time_path(r: Run, tag, name, kv, pv, cfg, shape, bs, ctx, q_len=1, num_splits=None, graph_only=False,
              quantize_in_call=False, extra=None, head_split=None):
    cache = r.caches[kv] if shape is HEADLINE else r.caches_d128[kv]
    try:
        runner = Decode(cache, shape, bs, ctx, q_len, pv, cfg, num_splits, quantize_in_call, head_split=head_split)
        runner()
        r.sync()
        res = {"graph_us": r.time(runner, True)}   # each call runs the next block table
        if not graph_only:
            res["eager_us"] = r.time(runner, False)
    except Exception as e:
        r.log(f"  {tag} {name} bs{bs} L{ctx} q{q_len} FAILED: {e!r}")
        r.row(kind="failed", tag=tag, path=name, bs=bs, context=ctx, q_len=q_len, error=repr(e)[:300])
        return None
    nbytes = kv_bytes(kv, bs, ctx, shape["hkv"], shape["d"])
    p = runner.plan
    row = dict(kind=tag, path=name, kv_dtype=kv, pv_mode=p.pv_mode, bs=bs, context=ctx, q_len=q_len,
               q_heads=shape["hq"], kv_heads=shape["hkv"], head_dim=shape["d"], page=shape["page"],
               num_splits=p.num_splits, block_m=p.block_m, tokens_per_pass=p.tokens_per_pass,
               block_n=p.config.block_n, num_warps=p.config.num_warps, num_stages=p.config.num_stages,
               min_block_m=p.config.min_block_m, swap_ab=p.config.swap_ab, maxnreg=p.config.maxnreg,
               fused_merge=p.config.fused_merge, merge=p.merge, head_split=p.head_split, pdl=p.config.pdl,
               pdl_trigger=_pdl_trigger(p),
               cyclic_splits=p.config.cyclic_splits, query_pdl=p.config.query_pdl, bytes=nbytes,
               quantize_in_call=quantize_in_call,
               config_source="tuned" if cfg is not None and cfg == r.best.get(kv) else (
                   "default" if cfg is None else "explicit"), **res)
    pct_copy(r, row)
    row.update(extra or {})
    r.row(**row)
    r.log(f"{tag:6s} {name:12s} bs{bs:3d} L{ctx:6d} q{q_len} S{p.num_splits:3d} H{p.head_split} "
        f"BN{p.config.block_n:4d} "
        f"w{p.config.num_warps} st{p.config.num_stages}{' swap' if p.config.swap_ab else ''}"
        f"{f' r{p.config.maxnreg}' if p.config.maxnreg else ''} graph {res['graph_us']:9.1f}us "
        f"({row['graph_pct_copy']:5.1f}%)" + (f" eager {res['eager_us']:9.1f}us ({row['eager_pct_copy']:5.1f}%)"
                                                 if "eager_us" in res else ""))
    return row


def time_sdpa(r: Run, shape, bs, ctx, tag="grid"):
    """PyTorch SDPA BF16 decode on contiguous K/V (the peer every user has)."""
    try:
        res = P.sdpa_decode(r, bs, ctx, shape["hq"], shape["hkv"], shape["d"], MAX_BS)
    except Exception as e:
        r.log(f"  sdpa bs{bs} L{ctx} FAILED: {e!r}")
        return None
    row = pct_copy(r, dict(kind=tag, path="sdpa_bf16", kv_dtype="bf16", bs=bs, context=ctx, q_len=1,
                           q_heads=shape["hq"], kv_heads=shape["hkv"], head_dim=shape["d"],
                           bytes=kv_bytes("bf16", bs, ctx, shape["hkv"], shape["d"]), **res))
    r.row(**row)
    r.log(f"{tag:6s} {'sdpa_bf16':12s} bs{bs:3d} L{ctx:6d} q1 graph {res['graph_us']:9.1f}us "
          f"({row['graph_pct_copy']:5.1f}%) eager {res['eager_us']:9.1f}us ({row['eager_pct_copy']:5.1f}%) "
          f"rel_l2 {res['rel_l2']:.4f}")
    return row


# --------------------------------------------------------------------------- setup, sections (run order: SECTIONS)
def setup(r: Run) -> None:
    r.copy_bw = 1.0 if INTERPRET else bench.copy_bandwidth()
    sms = runtime.sm_count(torch.device(DEV))
    r.log(f"device {r.env['gpu']} torch {r.env['torch']} triton {r.env['triton']} SMs {sms} "
          f"copy {r.copy_bw / 1e12:.3f} TB/s")
    r.row(kind="copy_bandwidth", bytes_per_s=r.copy_bw)
    for kv in ("int8", "fp8", "bf16"):
        r.caches[kv] = make_cache(kv, MAX_BS * MAX_L // HEADLINE["page"] + 8, HEADLINE,
                                  gen_seed={"int8": 1, "fp8": 2, "bf16": 3}[kv])
    d128_blocks = max(b for b, _ in D128_POINTS) * max(c for _, c in D128_POINTS) // COMMON["page"] + 8
    r.caches_d128 = {kv: make_cache(kv, d128_blocks, COMMON) for kv in ("int8", "fp8", "bf16")}
    r.log(f"caches ready {r.elapsed():.1f}s")

    # every variant the run may time, compiled in parallel worker processes
    keys = set()

    def want(kv, pv, shape, bs, q_len, config=None, head_split=None):
        cache = r.caches[kv] if shape is HEADLINE else r.caches_d128[kv]
        plan = dec.plan_decode((bs * q_len, shape["hq"], shape["d"]), cache, (bs, 2048), pv_mode=pv, config=config,
                               head_split=head_split)
        keys.add(_variant_key(kv, plan.pv_mode, shape, plan))

    for name, (kv, pv, cfg) in PATHS.items():
        want(kv, pv, HEADLINE, 16, 1, cfg)
    want("int8", "int8_signed", HEADLINE, 16, 1)
    for kv, cfgs in TUNE_CONFIGS.items():
        for c in cfgs:
            want(kv, None, HEADLINE, 16, 1, dec.DecodeConfig(*c))
        if kv in ("int8", "bf16"):
            for q_len in MT_QLENS:
                want(kv, None, HEADLINE, 16, q_len)
    for kv in ("int8", "fp8", "bf16"):
        want(kv, None, COMMON, 16, 1)
    for c in D128_FP8_CONFIGS:
        want("fp8", None, COMMON, 16, 1, dec.DecodeConfig(*c))
    for c in MT_CONFIGS:
        want("int8", None, HEADLINE, 16, 4, dec.DecodeConfig(*c), head_split=1)
    for kv in ("int8", "fp8", "bf16"):
        for q_len in (4, 8):
            want(kv, None, HEADLINE, 16, q_len)
            want(kv, None, HEADLINE, 16, q_len, head_split=1)
    for kv in ("int8", "fp8", "bf16"):
        for bs, q_len in ((1, 1), (16, 1), (16, 2), (16, 4)):
            base = dec.plan_decode((bs * q_len, 24, 256), r.caches[kv], (bs, 2048)).config
            want(kv, None, HEADLINE, 16, q_len, _fused(base))
    for kv in ("int8", "fp8"):  # section pdl
        base = _fused(dec.plan_decode((1, 24, 256), r.caches[kv], (1, 2048)).config, False)
        for change in SMALL_BATCH_LEVERS.values():
            want(kv, None, HEADLINE, 1, 1, dataclasses.replace(base, **change))
    for kv, modes in ACC_MODES.items():   # accuracy: mean query length 3 (multi-token case)
        for mode in modes:
            pv, cfg = ACC_CONFIG_MODES.get(mode, (mode, None))
            want(kv, pv, HEADLINE, 2, 3, cfg)
    H.precompile(r, _compile_worker, sorted(keys, key=repr))  # fused_merge: None, bools and strings


@H.section("acc")
def accuracy(r: Run) -> None:
    """rel-L2 etc. vs the float64 reference at real shapes (outlier keys, default key
    smoothing), every cache dtype / PV mode; same-quantization reference for int8; SASS
    of the kernels that ran."""
    cases = [("decode", [8200, 1000, 33] if not SMOKE else [150, 33], [1, 1, 1] if not SMOKE else [1, 1]),
             ("multi-token", [4100, 300] if not SMOKE else [100, 40], [2, 4])]
    for case, lens, qs in cases:
        for kv, modes in ACC_MODES.items():
            b = testing.make_paged_batch(lens, qs, num_q_heads=24, num_kv_heads=4, head_dim=256, block_size=16,
                                         kv_dtype=kv, seed=42, device=DEV)
            a = (b.query, b.cache, b.block_table, b.seq_lens, b.query_start_loc)
            ref = reference.attention_reference(*a)
            refq = reference.attention_reference_quantized(*a) if kv == "int8" else None
            for mode in modes:
                try:
                    pv, cfg = ACC_CONFIG_MODES.get(mode, (mode, None))
                    plan = dec.plan_decode(tuple(b.query.shape), b.cache, tuple(b.block_table.shape), pv_mode=pv,
                                           config=cfg)
                    out = testing.poisoned_like(b.query)
                    dec.run_decode(plan, *a, None, out, None, None, None)
                    st = reference.error_stats(out, ref)
                    row = dict(kind="accuracy", case=case, kv_dtype=kv, pv_mode=mode, seq_lens=lens, q_lens=qs,
                               num_splits=plan.num_splits, key_smoothing=b.cache.key_smoothing,
                               **{f"vs_f64_{k}": v for k, v in st.items()})
                    if refq is not None:
                        row.update({f"vs_sameq_{k}": v for k, v in reference.error_stats(out, refq).items()})
                    r.row(**row)
                    r.acc_rows.append(row)
                    r.log(f"acc {case:11s} {kv}/{mode:11s} splits {plan.num_splits:3d} rel_l2 {st['rel_l2']:.4f} "
                        f"max_abs {st['max_abs']:.4f} finite {st['finite']}"
                        + (f" | same-quant rel_l2 {row['vs_sameq_rel_l2']:.4f}" if refq is not None else ""))
                    split = H.launched("_decode_split_kernel")
                    if not INTERPRET and case == "decode" and split is not None:
                        s = H.sass_summary(split)
                        r.row(kind="sass", kv_dtype=kv, pv_mode=mode, **s)
                        r.sass_rows.append(dict(kv_dtype=kv, pv_mode=mode, **s))
                        r.log(f"sass {kv}/{mode}: mma {s.get('mma')} loops {s.get('loop_instr')} regs {s['n_regs']} "
                              f"spills {s['n_spills']} smem {s['shared_bytes']} {s.get('sass_error', '')}")
                except Exception as e:
                    r.log(f"acc {case} {kv}/{mode} FAILED: {e!r}")
                    r.row(kind="failed", tag="accuracy", case=case, kv_dtype=kv, pv_mode=mode, error=repr(e)[:300])
            del b
    b = testing.make_paged_batch([5000, 77] if not SMOKE else [90, 7], [1, 1], num_q_heads=32, num_kv_heads=8,
                                 head_dim=128, kv_dtype="int8", seed=5, device=DEV)
    a = (b.query, b.cache, b.block_table, b.seq_lens, b.query_start_loc)
    out = dec.decode_attention(*a)
    st = reference.error_stats(out, reference.attention_reference(*a))
    stq = reference.error_stats(out, reference.attention_reference_quantized(*a))
    row = dict(kind="accuracy", case="d128", kv_dtype="int8", pv_mode="int8",
               **{f"vs_f64_{k}": v for k, v in st.items()}, **{f"vs_sameq_{k}": v for k, v in stq.items()})
    r.row(**row)
    r.acc_rows.append(row)
    r.log(f"acc d128 int8/int8 rel_l2 {st['rel_l2']:.4f} same-quant {stq['rel_l2']:.4f}")


@H.section("tune")
def tune(r: Run) -> None:
    """A handful of configs per cache dtype (chosen from the sm_90 static analysis, see
    benchmarks/notes/decode.md) at the tuning shapes, graph-timed with the planner's
    split count; the config with the lowest geometric-mean time becomes that dtype's
    config for the headline table."""
    times = collections.defaultdict(dict)
    for bs, ctx in TUNE_SHAPES:
        for kv, cfgs in TUNE_CONFIGS.items():
            for c in cfgs:
                if r.late(f"tune {kv} {cfg_label(c)} bs{bs} L{ctx}"):
                    break
                cfg = dec.DecodeConfig(*c)
                row = time_path(r, "tune", kv, kv, None, cfg, HEADLINE, bs, ctx, graph_only=True)
                if row:
                    times[kv][c] = times[kv].get(c, []) + [row["graph_us"]]
    for kv, per_cfg in times.items():
        full = {c: t for c, t in per_cfg.items() if len(t) == max(len(x) for x in per_cfg.values())}
        geo = {c: math.exp(sum(math.log(x) for x in t) / len(t)) for c, t in full.items()}
        best = min(geo, key=geo.get)
        default = tuple(TUNE_CONFIGS[kv][0])
        r.best[kv] = dec.DecodeConfig(*best)
        r.row(kind="tune_choice", kv_dtype=kv, block_n=best[0], num_warps=best[1], num_stages=best[2],
                  swap_ab=r.best[kv].swap_ab, maxnreg=r.best[kv].maxnreg,
                  geomean_us=geo[best], default_geomean_us=geo.get(default),
                  all={cfg_label(c): g for c, g in geo.items()})
        r.log(f"tune choice {kv}: {cfg_label(best)} geomean {geo[best]:.1f}us "
              f"(default {geo.get(default, float('nan')):.1f}us)")


@H.section("grid")
def grid(r: Run) -> None:
    """Headline table (docs/design.md §4, q_len 1): eager + graph, vs SDPA and our bf16."""
    for bs in BATCHES:
        for ctx in CONTEXTS:
            if r.late(f"grid bs{bs} L{ctx}"):
                return
            for name, (kv, pv, cfg) in PATHS.items():
                if name in SIDE_PATHS and ctx not in SIDE_CONTEXTS:
                    continue
                use = r.config(kv) if name in TUNED_PATHS else cfg
                time_path(r, "grid", name, kv, pv, use, HEADLINE, bs, ctx)
            time_sdpa(r, HEADLINE, bs, ctx)
            if SMOKE:
                break
    # Q quantized inside the timed call (no producer): its cost is in the window
    for bs, ctx in ((1, CONTEXTS[-1]), (BS_MID, CONTEXTS[-1])):
        time_path(r, "qcall", "int8", "int8", "int8", r.config("int8"), HEADLINE, bs, ctx, quantize_in_call=True,
                  graph_only=True)
    time_path(r, "grid", "int8_signed", "int8", "int8_signed", None, HEADLINE, BS_MID, CONTEXTS[-1],
              graph_only=True)
    time_path(r, "grid", "int8_default", "int8", "int8", None, HEADLINE, BS_MID, CONTEXTS[-1], graph_only=True)


@H.section("batch")
def batch_sweep(r: Run) -> None:
    """bs 1..64 at L 8k, graph: time per sequence must fall or stay flat (no cliff)."""
    for bs in SWEEP_BATCHES:
        for kv in ("int8", "bf16"):
            time_path(r, "batch", kv, kv, None, r.config(kv), HEADLINE, bs, L8K, graph_only=True)


@H.section("mt")
def multi_token(r: Run) -> None:
    """q_len 1 / 2 / 4 with the default configs: at 32 packed rows (q 4) the 4-warp and
    128-key tuning configs spill registers (sm_90 static analysis), the defaults do not."""
    for q_len in (1,) + MT_QLENS:
        for bs, ctx in MT_POINTS:
            for kv in ("int8", "bf16"):
                time_path(r, "mt", kv, kv, None, None, HEADLINE, bs, ctx, q_len=q_len, graph_only=True)


#: q4 (24 packed rows at GQA 6) candidates: the row-major 8-warp default and swapped tiles
#: (two warpgroups at 128 keys; 4 warps at 64 spill at 32 rows, sm_90 static)
MT_CONFIGS = [(64, 8, 5), (128, 8, 5, 16, True), (128, 4, 5, 16, True), (64, 4, 6, 16, True), (32, 8, 9)]


@H.section("hsplit")
def head_split(r: Run) -> None:
    """Multi-token steps with the GQA group shared out over programs (the planner's
    head_split: q4 -> 2 programs of 12 rows, q8 -> 3 of 16) against one program per KV
    head (head_split=1: 24 / 48 rows), at bs 1 / 16 / 64, three cache dtypes."""
    for bs, ctx in [(1, CONTEXTS[-1]), (BS_MID, L8K), (BS_MID, CONTEXTS[-1]), (BATCHES[-1], L8K)]:
        for kv in ("int8", "fp8", "bf16"):
            if r.late(f"hsplit {kv} bs{bs} L{ctx}"):
                return
            time_path(r, "hsplit", f"{kv} q1", kv, None, None, HEADLINE, bs, ctx, q_len=1, graph_only=True)
            for q_len in (4, 8) if kv == "int8" else (4,):
                time_path(r, "hsplit", f"{kv} q{q_len} split", kv, None, None, HEADLINE, bs, ctx, q_len=q_len,
                          graph_only=True)
                time_path(r, "hsplit", f"{kv} q{q_len} one", kv, None, None, HEADLINE, bs, ctx, q_len=q_len,
                          graph_only=True, head_split=1)
    base = headline_plan(r, "int8", BS_MID, L8K, q_len=4).config
    time_path(r, "hsplit", "int8 q4 split fused", "int8", None, _fused(base), HEADLINE, BS_MID, L8K, q_len=4,
              graph_only=True)


@H.section("mtcfg")
def multi_token_configs(r: Run) -> None:
    """q4 against q1 at the q4 goal's points (bs16 L8k / L32k) over candidate configs."""
    for bs, ctx in [(BS_MID, L8K), (BS_MID, CONTEXTS[-1])]:
        time_path(r, "mtcfg", "int8 q1", "int8", None, None, HEADLINE, bs, ctx, q_len=1, graph_only=True)
        for c in MT_CONFIGS:
            if r.late(f"mtcfg {cfg_label(c)} bs{bs} L{ctx}"):
                return
            time_path(r, "mtcfg", f"int8 {cfg_label(c)}", "int8", None, dec.DecodeConfig(*c), HEADLINE, bs, ctx,
                      q_len=4, graph_only=True, head_split=1)


def _fused(cfg: "dec.DecodeConfig", mode=True) -> "dec.DecodeConfig":
    return dataclasses.replace(cfg, fused_merge=mode)


@contextlib.contextmanager
def _plain_launch():
    """Measurement only: decode launches built inside the block drop the cooperative launch
    attribute (what the co-scheduling guarantee of the barrier merge costs; the grids timed
    fit the GPU, so the barrier opens on an idle GPU without it)."""
    real = dec.CachedLaunch

    def plain(kernel, grid, constexprs, *a, **k):
        return real(kernel, grid, {n: v for n, v in constexprs.items() if n != "launch_cooperative_grid"}, *a, **k)

    dec.CachedLaunch = plain
    dec._LAUNCHES.clear()  # launches cached by unplanned calls: made again inside / after the block
    try:
        yield
    finally:
        dec.CachedLaunch = real
        dec._LAUNCHES.clear()


@H.section("fused")
def fused_merge(r: Run) -> None:
    """One launch (the split programs merge their own partials: the last to finish, or
    all of them after a barrier) against split + merge kernels, same config, graph and
    eager, at the grid points -- the two kernels also with the merge as the split kernel's
    programmatic dependent launch ("pdl"); then the barrier merge over small batches (graph)."""
    for bs in BATCHES:
        for ctx in CONTEXTS if not QUICK else (L8K, CONTEXTS[-1]):
            for kv in ("int8", "fp8", "bf16"):
                if r.late(f"fused {kv} bs{bs} L{ctx}"):
                    return
                base = headline_plan(r, kv, bs, ctx).config
                time_path(r, "fused", f"{kv} two-launch", kv, None, _fused(base, False), HEADLINE, bs, ctx)
                # the merge kernel as the split kernel's programmatic dependent launch
                pdl = dataclasses.replace(_fused(base, False), pdl=True)
                time_path(r, "fused", f"{kv} two-launch pdl", kv, None, pdl, HEADLINE, bs, ctx)
                time_path(r, "fused", f"{kv} auto", kv, None, _fused(base, None), HEADLINE, bs, ctx)
                time_path(r, "fused", f"{kv} fused", kv, None, _fused(base), HEADLINE, bs, ctx)
                time_path(r, "fused", f"{kv} barrier", kv, None, _fused(base, "barrier"), HEADLINE, bs, ctx)
                if kv == "int8" and bs < 64:
                    with _plain_launch():
                        time_path(r, "fused", "int8 barrier plain-launch", kv, None, _fused(base, "barrier"),
                                  HEADLINE, bs, ctx)
    for bs in (2, 4, 8) if not SMOKE else (2,):
        for ctx in (L8K, CONTEXTS[-1]):
            if r.late(f"fused barrier bs{bs} L{ctx}"):
                return
            base = headline_plan(r, "int8", bs, ctx).config
            time_path(r, "fused", "int8 two-launch", "int8", None, _fused(base, False), HEADLINE, bs, ctx,
                      graph_only=True)
            pdl = dataclasses.replace(_fused(base, False), pdl=True)
            time_path(r, "fused", "int8 two-launch pdl", "int8", None, pdl, HEADLINE, bs, ctx, graph_only=True)
            time_path(r, "fused", "int8 barrier", "int8", None, _fused(base, "barrier"), HEADLINE, bs, ctx,
                      graph_only=True)
    for q_len in MT_QLENS:
        for ctx in (L8K, CONTEXTS[-1]):
            base = headline_plan(r, "int8", BS_MID, ctx, q_len=q_len).config
            time_path(r, "fused", "int8 fused", "int8", None, _fused(base), HEADLINE, BS_MID, ctx, q_len=q_len,
                      graph_only=True)


#: Section pdl's paths: changes to the planned config (the split + merge kernels; its own
#: pdl is None: "store" on sm_90).
SMALL_BATCH_LEVERS = {"two-launch": {"pdl": False}, "pdl-start": {"pdl": "start"}, "pdl-store": {"pdl": "store"},
                      "pdl-exit": {"pdl": "exit"}, "cyclic": {"cyclic_splits": True, "pdl": False},
                      "cyclic pdl-store": {"cyclic_splits": True, "pdl": "store"}, "default": {}}
#: From batch 32 on (and for the BF16 cache) only what a default may cost.
LARGE_BATCH_LEVERS = ("two-launch", "pdl-store", "default")


@H.section("pdl")
def small_batch_levers(r: Run) -> None:
    """The split + merge kernels (graph replays), side by side: plain; the merge as the
    split kernel's programmatic dependent, triggered at the split programs' start, after
    their tile loop ("store") or at their exit; tiles dealt to the splits in turn with their
    block ids prefetched ("cyclic"), alone and with the "store" trigger; the planned config
    ("default"); the plain pair again last (drift check). Batch 32-64 and the BF16 cache:
    plain, "store" and the default. Then the split / merge kernels' device time at batch 1
    (profiler, plain pair)."""
    for ctx in (L8K, CONTEXTS[-1], L1K):
        for bs in (1, 2, 4, 8, 16, 32, 64) if not SMOKE else (1, 2):
            for kv in ("int8", "fp8", "bf16"):
                if r.late(f"pdl {kv} bs{bs} L{ctx}"):
                    return
                base = _fused(headline_plan(r, kv, bs, ctx).config, False)
                names = list(SMALL_BATCH_LEVERS) if bs <= 16 and kv != "bf16" else LARGE_BATCH_LEVERS
                for name in [*names, "two-launch again"]:
                    change = SMALL_BATCH_LEVERS[name.replace(" again", "")]
                    time_path(r, "pdl", f"{kv} {name}", kv, None, dataclasses.replace(base, **change), HEADLINE, bs,
                              ctx, graph_only=True)
    if INTERPRET:
        return
    for ctx in (L8K, CONTEXTS[-1]):
        for kv in ("int8", "fp8"):
            base = _fused(headline_plan(r, kv, 1, ctx).config, False)
            kernel_profile(r, kv, dataclasses.replace(base, pdl=False), 1, ctx)


#: The "qpdl" section's rows: the producer's codes (no quantization in the call), then calls
#: that quantize their query with the split kernel launched plainly and as the quantize
#: kernel's programmatic dependent (DecodeConfig.query_pdl), the plain one again last.
QUERY_PDL_ROWS = {"codes": (False, {}), "qcall plain": (True, {"query_pdl": False}),
                  "qcall qpdl": (True, {"query_pdl": True}), "qcall plain again": (True, {"query_pdl": False})}


@H.section("qpdl")
def query_pdl(r: Run) -> None:
    """Graph replays of default plans that quantize their query in the call: the split
    kernel launched plainly after the quantize kernel, or as its programmatic dependent
    (``DecodeConfig.query_pdl``), beside the same plan given the producer's codes."""
    points = ((1, L8K), (1, CONTEXTS[-1]), (16, L8K), (4, L8K), (16, CONTEXTS[-1]), (64, L8K), (2, L8K), (1, L1K),
              (64, CONTEXTS[-1]))
    for bs, ctx in points if not SMOKE else points[:2]:
        for kv in ("int8", "fp8"):
            if r.late(f"qpdl {kv} bs{bs} L{ctx}"):
                return
            base = headline_plan(r, kv, bs, ctx).config
            for name, (in_call, change) in QUERY_PDL_ROWS.items():
                time_path(r, "qpdl", f"{kv} {name}", kv, None, dataclasses.replace(base, **change), HEADLINE, bs,
                          ctx, graph_only=True, quantize_in_call=in_call)


@H.section("d128")
def d128(r: Run) -> None:
    """32q/8kv at head_dim 128 with the default configs, plus the candidate int8 configs
    (timed so a head_dim-128 entry of MEASURED_BEST can be chosen from them)."""
    for bs, ctx in D128_POINTS:
        for kv in ("int8", "bf16"):
            time_path(r, "d128", kv, kv, None, None, COMMON, bs, ctx)
        for c in D128_INT8_CONFIGS:
            time_path(r, "d128", f"int8 {cfg_label(c)}", "int8", None, dec.DecodeConfig(*c), COMMON, bs, ctx,
                      graph_only=True)
        time_path(r, "d128", "fp8", "fp8", None, None, COMMON, bs, ctx, graph_only=True)
        for c in D128_FP8_CONFIGS:
            time_path(r, "d128", f"fp8 {cfg_label(c)}", "fp8", None, dec.DecodeConfig(*c), COMMON, bs, ctx,
                      graph_only=True)
        time_sdpa(r, COMMON, bs, ctx, tag="d128")


@H.section("splits")
def split_sweep(r: Run) -> None:
    """Split count around the planner's choice for the chosen int8 config (checks the model)."""
    cfg = r.config("int8") or dec.DecodeConfig(*TUNE_CONFIGS["int8"][0])
    for bs, ctx in TUNE_SHAPES:
        base = headline_plan(r, "int8", bs, ctx, config=cfg).num_splits
        for s in sorted({max(1, base // 2), base * 2} & set(range(1, dec.MAX_NUM_SPLITS + 1))):
            time_path(r, "splits", "int8", "int8", None, cfg, HEADLINE, bs, ctx, num_splits=s, graph_only=True,
                      extra={"auto_splits": base})
    # fp8 at bs16 L8k, the one length where it misses 1.8x our BF16: is the split count the lever?
    base = headline_plan(r, "fp8", BS_MID, L8K).num_splits
    for s in sorted({2, 3, base, 5, 6, 8} if not SMOKE else {base}):
        time_path(r, "splits", "fp8", "fp8", None, None, HEADLINE, BS_MID, L8K, num_splits=s, graph_only=True,
                  extra={"auto_splits": base})
    if not INTERPRET:
        try:
            kernel_profile(r, "int8", cfg, 1, TUNE_SHAPES[1][1])
        except Exception as e:  # a profiler problem must not cost the rest of the run
            r.log(f"kernel profile FAILED: {e!r}")


def kernel_profile(r: Run, kv: str, cfg, bs: int, ctx: int) -> None:
    """Where a call's time goes: device time of the split and merge kernels (torch
    profiler, median over 50 eager calls) next to the graph time of the whole call."""
    runner = Decode(r.caches[kv], HEADLINE, bs, ctx, 1, None, cfg)
    med = H.kernel_times(runner, "_decode_")
    graph_us = r.time(runner, True)
    cfg = runner.plan.config
    row = dict(kind="kernel_profile", path=kv, bs=bs, context=ctx, num_splits=runner.plan.num_splits,
               block_n=cfg.block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages, swap_ab=cfg.swap_ab,
               graph_us=graph_us, bytes=kv_bytes(kv, bs, ctx, HEADLINE["hkv"], HEADLINE["d"]),
               **{f"{k}_us": v for k, v in med.items()})
    r.row(**row)
    r.log(f"profile {kv} bs{bs} L{ctx} S{runner.plan.num_splits}: graph {graph_us:.1f}us, kernels "
          + ", ".join(f"{k} {v:.1f}us" for k, v in med.items()))


#: the default, lighter tiles (128-key and row-major: fewer instructions per key), one 8-warp
#: program per SM (a pair of 4-warp programs shares an SM's schedulers), then register caps
SMALL_CONFIGS = [(64, 4, 6, 16, True), (128, 4, 4), (64, 4, 6), (128, 8, 5, 16, True), *CAPPED["int8"]]
#: split counts per context of the "small" section (the planner's count is added)
SMALL_SPLITS = {8192: (32, 64, 128), 32768: (64, 96, 128, 192)}


@H.section("small")
def small_batch(r: Run) -> None:
    """Batch 1 at L 8k and 32k, where the 50% and 75%-of-copy goals are missed: configs x
    split counts (with 128-key and row-major tiles: fewer instructions per key, which a
    batch-1 call, a few tiles per program, may feel more than a streaming one)."""
    bs = 1
    for ctx in (L8K, TUNE_SHAPES[1][1]) if not SMOKE else (TUNE_SHAPES[1][1],):
        for c in SMALL_CONFIGS[:2] if SMOKE else SMALL_CONFIGS:
            cfg = dec.DecodeConfig(*c)
            base = headline_plan(r, "int8", bs, ctx, config=cfg).num_splits
            for n in sorted({base, *SMALL_SPLITS.get(ctx, ())} if not SMOKE else {base}):
                if r.late(f"small {cfg_label(c)} L{ctx} S{n}"):
                    return
                time_path(r, "small", "int8", "int8", None, cfg, HEADLINE, bs, ctx, num_splits=n, graph_only=True,
                          extra={"auto_splits": base, "config": cfg_label(c)})


#: batch x context points where the planner puts two 4-warp programs on an SM with at most 4
#: tiles each (its model charges nothing for sharing an SM)
PAIR_POINTS = ((1, 4096), (1, 8192), (1, 16384), (2, 4096), (2, 8192), (4, 2048), (4, 4096), (8, 2048))


@H.section("pairs")
def pairs(r: Run) -> None:
    """One program per SM against two: the default config at the planner's split count and at
    half of it (the same tiles per SM in half the programs), graph, where each program has few
    tiles (at batch 1 L8k on an H100 half the splits were 9% faster: notes/decode.md)."""
    for bs, ctx in [(1, L8K)] if SMOKE else PAIR_POINTS:
        if r.late(f"pairs bs{bs} L{ctx}"):
            return
        plan = headline_plan(r, "int8", bs, ctx)
        base, tiles = plan.num_splits, -(-ctx // plan.config.block_n)
        for n in sorted({base, max(1, base // 2)}, reverse=True):
            time_path(r, "pairs", "int8", "int8", None, None, HEADLINE, bs, ctx, num_splits=n, graph_only=True,
                      extra={"auto_splits": base, "programs": bs * HEADLINE["hkv"] * n,
                             "tiles_per_split": -(-tiles // n)})


@H.section("occ")
def occupancy(r: Run) -> None:
    """The 8-bit configs with and without a register cap next to our BF16 path at the
    batch / length points of the FP8 >= 1.8x goal (graph, planner's splits)."""
    points = [(BS_MID, c) for c in CONTEXTS if c >= L8K] + [(BATCHES[-1], L8K)]
    for bs, ctx in points[:1] if SMOKE else points:
        if r.late(f"occ bs{bs} L{ctx}"):
            return
        time_path(r, "occ", "bf16", "bf16", None, None, HEADLINE, bs, ctx, graph_only=True)
        for kv in ("fp8", "int8"):
            for c in TUNE_CONFIGS[kv][:1] + CAPPED[kv]:
                time_path(r, "occ", f"{kv} {cfg_label(c)}", kv, None, dec.DecodeConfig(*c), HEADLINE, bs, ctx,
                          graph_only=True)


@H.section("prof")
def profiles(r: Run) -> None:
    """Split / merge kernel device time against the graph time of the call, default
    configs, at the points of the missed goals (bs1 L32k; FP8 vs BF16 at bs16 8k / 32k)."""
    if INTERPRET:   # the CUDA profiler has nothing to see under the interpreter
        return
    for bs, ctx in ((1, CONTEXTS[-1]), (BS_MID, L8K), (BS_MID, CONTEXTS[-1])):
        for kv in ("fp8", "int8", "bf16"):
            if r.late(f"prof {kv} bs{bs} L{ctx}"):
                return
            kernel_profile(r, kv, None, bs, ctx)


@H.section("peers")
def peers(r: Run) -> None:
    """FlashInfer paged decode (fa2 tensor-core kernel) with BF16 and FP8 e4m3 K/V at the
    headline grid points, eager (CUDA events, L2 flushed) and CUDA-graph replay; first
    calls JIT-compile."""
    for kv in ("bf16", "fp8"):
        for bs in BATCHES:
            for ctx in CONTEXTS[:1] if SMOKE else CONTEXTS:
                if r.late(f"peers flashinfer {kv} bs{bs} L{ctx}"):
                    return
                call = functools.partial(P.flashinfer_decode, r, bs, ctx, HEADLINE["hq"], HEADLINE["hkv"],
                                         HEADLINE["d"], HEADLINE["page"], kv_dtype=kv)
                res = H.peer(r, "flashinfer", call, f"peers {kv} bs{bs} L{ctx}",
                             failed=dict(kv_dtype=kv, bs=bs, context=ctx), error_chars=300)
                if "flashinfer" in r.unavailable:
                    return
                if res is None:
                    continue
                row = pct_copy(r, dict(kind="peer", path=f"flashinfer_{kv}", q_len=1, **res))
                r.row(**row)
                graph = (f" graph {res['graph_us']:9.1f}us ({row['graph_pct_copy']:5.1f}%)" if res.get("graph_us")
                         else " graph –")
                r.log(f"peer   flashinfer_{kv:5s} bs{bs:3d} L{ctx:6d} eager {res['eager_us']:9.1f}us "
                      f"({row['eager_pct_copy']:5.1f}%){graph} rel_l2 {res['rel_l2']:.4f} ({res['peer_version']})")


# --------------------------------------------------------------------------- summary
def summary(r: Run) -> str:
    """Markdown summary (also printed): headline, goals, tuning, batch sweep, mt, d128, accuracy."""
    env = r.env
    by = {}
    for row in r.rows:
        if "path" in row and "bs" in row:
            by[(row["kind"], row["path"], row["bs"], row["context"], row.get("q_len", 1), row.get("head_dim"))] = row
    ratio = lambda a, b: (a["graph_us"] / b["graph_us"]) if a and b else None  # noqa: E731
    head = []
    for bs in BATCHES:
        for ctx in CONTEXTS:
            g = lambda p: by.get(("grid", p, bs, ctx, 1, 256))  # noqa: E731
            i8, pb, f8, b16, sd = g("int8"), g("int8_pvbf16"), g("fp8"), g("bf16"), g("sdpa_bf16")
            if i8:
                head.append([bs, ctx, f"{i8['graph_us']:.1f}", f"{i8['graph_pct_copy']:.1f}",
                             H.fmt(i8.get("eager_pct_copy")), H.fmt(pb and pb["graph_us"]), H.fmt(f8 and f8["graph_us"]),
                             H.fmt(b16 and b16["graph_us"]), H.fmt(sd and sd["graph_us"]),
                             H.fmt(ratio(sd, i8), "{:.2f}x"), H.fmt(ratio(b16, i8), "{:.2f}x"),
                             H.fmt(ratio(b16, f8), "{:.2f}x")])
    md = [f"### Decode run: {env.get('gpu')}, torch {env.get('torch')}, Triton {env.get('triton')}, {env.get('date')}",
          "", f"Copy bandwidth {r.copy_bw / 1e12:.3f} TB/s. Configs (block_n/warps/stages): "
          + ", ".join(f"{kv} {c.block_n}/{c.num_warps}/{c.num_stages}" for kv, c in r.best.items())
          + (" (tuned in this run)" if r.best else " (defaults)") + f". Total {r.elapsed():.0f}s.", "",
          *H.table(["bs", "L", "int8 graph µs", "% copy", "eager %", "int8 pv-bf16 µs", "fp8 µs", "our bf16 µs",
                    "SDPA bf16 µs", "int8/SDPA", "int8/our bf16", "fp8/our bf16"], head)]

    def pct(bs, ctx, mode="graph"):
        row = by.get(("grid", "int8", bs, ctx, 1, 256))
        return row and row.get(f"{mode}_pct_copy")

    def vs(path, ref, bs, ctx):
        return ratio(by.get(("grid", ref, bs, ctx, 1, 256)), by.get(("grid", path, bs, ctx, 1, 256)))

    big = BATCHES[1] if len(BATCHES) > 1 else BATCHES[0]
    fp8_ratios = [x for x in (vs("fp8", "bf16", big, c) for c in CONTEXTS if c >= L8K) if x is not None]
    acc = next((a for a in r.acc_rows if a["case"] == "decode" and a["kv_dtype"] == "int8" and a["pv_mode"] == "int8"),
               None)
    goals = [
        (f"bs{big} L{CONTEXTS[-1]} % copy", ">= 90", pct(big, CONTEXTS[-1]), lambda x: x >= 90),
        (f"bs{big} L{CONTEXTS[-1]} vs SDPA bf16", ">= 2.1x", vs("int8", "sdpa_bf16", big, CONTEXTS[-1]),
         lambda x: x >= 2.1),
        (f"bs1 L{CONTEXTS[-1]} graph % copy", ">= 75", pct(1, CONTEXTS[-1]), lambda x: x >= 75),
        (f"bs{BATCHES[-1]} L{L8K} % copy", ">= 88", pct(BATCHES[-1], L8K), lambda x: x >= 88),
        (f"fp8 / our bf16, bs{big} L 8k-32k (min)", ">= 1.8x", min(fp8_ratios) if fp8_ratios else None,
         lambda x: x >= 1.8),
        ("default INT8 rel-L2 vs float64 (decode)", "<= 0.02", acc and acc["vs_f64_rel_l2"], lambda x: x <= 0.02),
    ]
    md += ["", *H.table(["goal", "target", "measured", "status"],
                        [[name, target, H.fmt(val, "{:.3f}" if val is not None and val < 1 else "{:.2f}"),
                          "–" if val is None else ("met" if ok(val) else "missed")] for name, target, val, ok in goals])]
    tune_rows = [x for x in r.rows if x["kind"] == "tune"]
    if tune_rows:
        def key(x):
            return (x["kv_dtype"], x["block_n"], x["num_warps"], x["num_stages"], x["min_block_m"],
                    bool(x.get("swap_ab")), x.get("maxnreg"))
        lines = []
        for k in sorted({key(x) for x in tune_rows}):
            cells = []
            for b, c in TUNE_SHAPES:
                t = next((x for x in tune_rows if key(x) == k and (x["bs"], x["context"]) == (b, c)), None)
                cells.append(f"{t['graph_us']:.1f} ({t['graph_pct_copy']:.0f}%, S{t['num_splits']})" if t else "–")
            mark = " **chosen**" if r.best.get(k[0]) == dec.DecodeConfig(*k[1:]) else ""
            lines.append([k[0], cfg_label(k[1:]) + mark, *cells])
        md += ["", "Tuning (graph µs, planner's splits):", "",
               *H.table(["kv", "block_n/warps/stages", *(f"bs{b} L{c}" for b, c in TUNE_SHAPES)], lines)]
    sweep = [x for x in r.rows if x["kind"] == "batch"]
    if sweep:
        def cell(kv, b):
            t = next((x for x in sweep if x["kv_dtype"] == kv and x["bs"] == b), None)
            return f"{t['graph_us']:.0f} ({t['graph_us'] / b:.1f})" if t else "–"
        md += ["", f"Batch sweep, L {L8K}, graph µs per call (µs per sequence):", "",
               *H.table(["bs", *SWEEP_BATCHES], [[kv, *(cell(kv, b) for b in SWEEP_BATCHES)] for kv in ("int8", "bf16")])]
    if any(x["kind"] == "mt" for x in r.rows):
        md += ["", "Multi-token (graph µs, default configs):", "",
               *H.table(["kv", "bs", "L", "q1", "q2", "q4"],
                        [[kv, b, c, *(H.fmt((by.get(("mt", kv, b, c, q, 256)) or {}).get("graph_us"))
                                      for q in (1,) + MT_QLENS)] for kv in ("int8", "bf16") for b, c in MT_POINTS])]
    if any(x["kind"] == "d128" for x in r.rows):
        lines = []
        for b, c in D128_POINTS:
            g = lambda p: by.get(("d128", p, b, c, 1, 128))  # noqa: E731
            i8, b16, sd = g("int8"), g("bf16"), g("sdpa_bf16")
            lines.append([b, c, f"{H.fmt(i8 and i8['graph_us'])} ({H.fmt(i8 and i8['graph_pct_copy'])}%)",
                          H.fmt(b16 and b16["graph_us"]), H.fmt(sd and sd["graph_us"]),
                          H.fmt(sd["graph_us"] / i8["graph_us"] if i8 and sd else None, "{:.2f}x")])
        md += ["", "32q/8kv D128 (graph µs, % copy):", "",
               *H.table(["bs", "L", "int8", "bf16", "SDPA bf16", "int8/SDPA"], lines)]
    for ctx in sorted({x["context"] for x in r.rows if x["kind"] == "small"}):
        small = [x for x in r.rows if x["kind"] == "small" and x["context"] == ctx]
        splits = sorted({x["num_splits"] for x in small})

        def cell(label, n):
            t = next((x for x in small if x["config"] == label and x["num_splits"] == n), None)
            return (f"{t['graph_us']:.1f} ({t['graph_pct_copy']:.0f}%)"
                    + ("*" if t["num_splits"] == t["auto_splits"] else "")) if t else "–"
        md += ["", f"Batch 1, L {ctx}, int8: graph µs (% copy) per config and split count (* = the planner's):", "",
               *H.table(["config", *(f"S{n}" for n in splits)],
                        [[label, *(cell(label, n) for n in splits)] for label in dict.fromkeys(x["config"] for x in small)])]
    pair_rows = [x for x in r.rows if x["kind"] == "pairs"]
    if pair_rows:
        def pair_cell(x):
            return f"S{x['num_splits']}, {x['tiles_per_split']} tiles: {x['graph_us']:.1f}" if x else "–"
        lines = []
        for bs, ctx in dict.fromkeys((x["bs"], x["context"]) for x in pair_rows):
            at = {x["num_splits"]: x for x in pair_rows if (x["bs"], x["context"]) == (bs, ctx)}
            two, one = at.get(max(at)), at.get(min(at)) if len(at) > 1 else None
            lines.append([bs, ctx, pair_cell(two), pair_cell(one),
                          H.fmt(two["graph_us"] / one["graph_us"] if one else None, "{:.2f}x")])
        md += ["", "Planner's splits against half of them (int8 default config, graph µs):", "",
               *H.table(["bs", "L", "planner's", "half", "half's speed-up"], lines)]
    if r.acc_rows:
        md += ["", "Accuracy vs float64 (outlier keys):", "",
               *H.table(["case", "kv/pv", "rel-L2", "vs same-q", "max abs", "finite"],
                        [[a["case"], f"{a['kv_dtype']}/{a['pv_mode']}", f"{a['vs_f64_rel_l2']:.4f}",
                          H.fmt(a.get("vs_sameq_rel_l2"), "{:.4f}"), f"{a['vs_f64_max_abs']:.4f}", a["vs_f64_finite"]]
                         for a in r.acc_rows])]
    if r.sass_rows:
        md += ["", "SASS of the kernels that ran (default configs; loop instr = per warp per tile, single-pass "
               "loop first):", "",
               *H.table(["kv/pv", "MMA", "loop instr", "regs", "spills", "smem"],
                        [[f"{s['kv_dtype']}/{s['pv_mode']}", s["mma"], s.get("loop_instr"), s["n_regs"], s["n_spills"],
                          s["shared_bytes"]] for s in r.sass_rows])]
    return "\n".join(md) + "\n"


def main():
    args = H.parser("decode", sections=SECTIONS, quick=True, budget_s=200, budget_env="BENCH_DEADLINE_S",
                    out_help="directory for decode.jsonl, decode_summary.md and the log "
                             "(default: rows to benchmarks/results/decode.jsonl, no summary file)").parse_args()
    r = Run(args.out, args.budget_s)
    torch.manual_seed(0)
    H.attempt(r, "setup", setup, r)
    H.run_sections(r, SECTIONS, args.skip)
    H.finish(r, "decode_summary.md", lambda: summary(r))


SECTIONS = (accuracy, tune, grid, small_batch, pairs, occupancy, profiles, batch_sweep, multi_token,
            multi_token_configs, head_split, fused_merge, small_batch_levers, query_pdl, d128, split_sweep, peers)

if __name__ == "__main__":
    main()
