"""Paged decode on the GPU: correctness at real shapes, SASS proof, timings, tuning sweep.

One script, one device call:

1. compile every kernel variant it will time, in parallel worker processes (they fill
   Triton's on-disk cache; the main process then loads them);
2. accuracy at real shapes (24q/4kv D256 page 16, outlier keys) vs the float64
   reference, for every cache dtype / PV mode; the same-quantization reference for the
   default INT8 path;
3. SASS of the kernels that ran (``LAST_LAUNCH``): IMMA/IGMMA for INT8, QGMMA or the
   fp8 path Triton chose, HMMA/HGMMA for BF16; registers, spills, shared memory;
4. timings (median; eager = CUDA events with L2 flush, graph = CUDA-graph replay over
   several block tables so the KV bytes never sit in L2): DESIGN.md section 4 shapes, vs
   PyTorch SDPA BF16 on contiguous K/V and vs our own BF16-cache path; multi-token 2/4;
   32q/8kv D128; a batch sweep 1..64 at 8k; a tile / warps / stages / splits sweep.

Rows go to benchmarks/results/decode.jsonl (or --out DIR/decode.jsonl) via
int8attn.bench.Recorder. ``--smoke`` runs every code path at toy sizes on the CPU
interpreter (timings meaningless) to check the script itself.

    PYTHONPATH=src python3 benchmarks/bench_decode.py --out $OUT
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback

import torch

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

from int8attn import bench, reference, testing  # noqa: E402
from int8attn.cache import PagedKVCache  # noqa: E402
from int8attn.ops import decode as dec  # noqa: E402
from int8attn.ops.producer import quantize_query  # noqa: E402

DEV = "cpu" if SMOKE else "cuda"
LOG = []


def log(msg: str) -> None:
    print(msg, flush=True)
    LOG.append(msg)


# --------------------------------------------------------------------------- shapes
HEADLINE = dict(hq=24, hkv=4, d=256, page=16)
COMMON = dict(hq=32, hkv=8, d=128, page=16)
if SMOKE:
    BATCHES, CONTEXTS, SWEEP_BATCHES = [1, 2], [64, 160], [1, 3]
    MT_CONTEXTS, TUNE_SHAPES = [160], [(2, 160), (1, 160)]
    MAX_BS, MAX_L = 4, 256
else:
    BATCHES, CONTEXTS = [1, 16, 64], [1024, 8192, 16384, 32768]
    SWEEP_BATCHES = [1, 2, 4, 8, 12, 16, 24, 32, 48, 64]
    MT_CONTEXTS, TUNE_SHAPES = [8192, 32768], [(16, 32768), (1, 32768), (64, 8192)]
    MAX_BS, MAX_L = 64, 32768

# Paths timed: name -> (cache dtype, pv mode, config override or None)
WIDE_FP8 = dec.DecodeConfig(block_n=64, num_warps=8, num_stages=5, min_block_m=64)
PATHS = {
    "int8": ("int8", "int8", None),
    "int8_pvbf16": ("int8", "bf16", None),
    "fp8": ("fp8", "fp8", None),
    "fp8_pvbf16": ("fp8", "bf16", None),
    "fp8_qgmma": ("fp8", "fp8", WIDE_FP8),
    "bf16": ("bf16", "bf16", None),
}
# (block_n, num_warps, num_stages); Triton buffers (num_stages - 1) // 2 K/V tiles here.
TUNE_CONFIGS = {
    "int8": [(64, 8, 9), (64, 8, 7), (64, 4, 9), (128, 8, 5), (128, 4, 5), (32, 8, 9), (32, 4, 9), (64, 8, 5)],
    "fp8": [(64, 8, 9), (128, 8, 5), (64, 8, 7)],
    "bf16": [(32, 8, 9), (32, 8, 7), (32, 4, 9), (64, 8, 5), (64, 4, 5)],
}
BS_MID = 2 if SMOKE else 16
DEADLINE_S = float(os.environ.get("BENCH_DEADLINE_S", "1e9"))


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


def timeit(fn_cycle, graph: bool) -> float:
    """Median µs per call. ``fn_cycle`` is a zero-arg callable that runs the next input set."""
    if SMOKE:
        t0 = time.perf_counter()
        fn_cycle()
        return (time.perf_counter() - t0) * 1e6
    if graph:
        return bench.time_graph(fn_cycle, replays=30, repeats=9)
    return bench.time_eager(fn_cycle, warmup_ms=10, rep_ms=60)


class Decode:
    """One timed configuration of our kernel over rotating block tables."""

    def __init__(self, cache, shape, bs, ctx, q_len, pv_mode, config=None, num_splits=None, quantize_in_call=False,
                 tables=None):
        self.cache = cache
        t = bs * q_len
        self.query = torch.randn(t, shape["hq"], shape["d"], device=DEV, dtype=torch.float32).to(torch.bfloat16)
        self.tables = tables or block_tables(cache.num_blocks, bs, ctx, shape["page"], 4)
        self.seq_lens = torch.full((bs,), ctx, dtype=torch.int32, device=DEV)
        self.qsl = torch.arange(0, t + 1, q_len, dtype=torch.int32, device=DEV)
        self.plan = dec.plan_decode(tuple(self.query.shape), cache, tuple(self.tables[0].shape), pv_mode=pv_mode,
                                    num_splits=num_splits, config=config)
        self.qq, self.qs = (None, None) if quantize_in_call or not cache.quantized else quantize_query(
            self.query, cache.kv_dtype)
        self.ws = dec.DecodeWorkspace(t, shape["hq"], shape["d"], max(2, self.plan.num_splits), device=DEV)
        self.out = torch.empty_like(self.query)
        self._it = itertools.cycle(self.tables)

    def __call__(self):
        return dec._run(self.plan, self.query, self.cache, next(self._it), self.seq_lens, self.qsl, None, self.out,
                        self.qq, self.qs, self.ws)


# --------------------------------------------------------------------------- 1. parallel compile
def _variant_key(kv, pv, shape, plan):
    c = plan.config
    return (kv, pv, shape["hq"], shape["hkv"], shape["d"], shape["page"], plan.tokens_per_pass, plan.block_m,
            c.block_n, c.num_warps, c.num_stages, c.min_block_m)


def _compile_worker(key):
    """Run one variant once on toy inputs with the same specialization (worker process)."""
    try:
        kv, pv, hq, hkv, d, page, tpp, block_m, block_n, warps, stages, min_bm = key
        shape = dict(hq=hq, hkv=hkv, d=d, page=page)
        cache = make_cache(kv, 64, shape)
        bs, ctx = 2, 4 * max(block_n, page)
        cfg = dec.DecodeConfig(block_n, warps, stages, min_bm)
        plan = dec.DecodePlan(num_splits=2, tokens_per_pass=tpp, block_m=block_m, config=cfg, pv_mode=pv)
        q = torch.randn(bs * tpp, hq, d, device=DEV).to(torch.bfloat16)
        bt = torch.arange(bs * ctx // page, dtype=torch.int32, device=DEV).view(bs, -1)
        sl = torch.full((bs,), ctx, dtype=torch.int32, device=DEV)
        qsl = torch.arange(0, bs * tpp + 1, tpp, dtype=torch.int32, device=DEV)
        qq, qs = (None, None) if not cache.quantized else quantize_query(q, kv)
        dec._run(plan, q, cache, bt, sl, qsl, None, None, qq, qs, None)
        torch.cuda.synchronize()
        return key, None
    except Exception as e:  # reported, the main process compiles it again if needed
        return key, repr(e)


def precompile(keys) -> None:
    if SMOKE or not keys:
        return
    import concurrent.futures as cf
    import multiprocessing as mp

    t0 = time.time()
    workers = min(len(keys), max(1, (os.cpu_count() or 4) - 2))
    with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
        for key, err in ex.map(_compile_worker, sorted(keys)):
            if err:
                log(f"  precompile {key}: {err}")
    log(f"precompiled {len(keys)} variants with {workers} processes in {time.time() - t0:.1f}s")


# --------------------------------------------------------------------------- 3. SASS
MMA_RE = re.compile(r"\b((?:IMMA|IGMMA|QGMMA|HGMMA|HMMA|QMMA|OMMA)[\w.]*)")


def sass_of(kernel) -> str:
    try:
        return kernel.asm["sass"]
    except Exception:
        with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
            f.write(kernel.asm["cubin"])
        return subprocess.run(["cuobjdump", "--dump-sass", f.name], capture_output=True, text=True).stdout


def sass_summary(kernel) -> dict:
    sass = sass_of(kernel)
    mma = collections.Counter(m.split(".")[0] + "." + ".".join(m.split(".")[1:3]) for m in MMA_RE.findall(sass))
    ops = collections.Counter(re.findall(r"\b(LDS\.U8|STS\.U8|LDL[\w.]*|STL[\w.]*|LDGSTS[\w.]*|LDG\.E[\w.]*)\b", sass))
    meta = kernel.metadata
    return {
        "mma": dict(mma), "ops": dict(ops),
        "n_regs": getattr(kernel, "n_regs", None), "n_spills": getattr(kernel, "n_spills", None),
        "shared_bytes": getattr(meta, "shared", None), "num_warps": getattr(meta, "num_warps", None),
        "num_stages": getattr(meta, "num_stages", None),
    }


# --------------------------------------------------------------------------- main
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="directory for decode.jsonl and the log (default benchmarks/results)")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--skip", default="", help="comma list of sections to skip: acc,sass,grid,mt,d128,batch,tune")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    out_dir = args.out
    rec = bench.Recorder("decode", path=os.path.join(out_dir, "decode.jsonl") if out_dir else None)
    torch.manual_seed(0)
    t_start = time.time()
    copy_bw = 1.0 if SMOKE else bench.copy_bandwidth()
    sms = dec.sm_count(torch.device(DEV))
    log(f"device {rec.env['gpu']} torch {rec.env['torch']} triton {rec.env['triton']} SMs {sms} "
        f"copy {copy_bw / 1e12:.3f} TB/s")
    rec.add(kind="copy_bandwidth", bytes_per_s=copy_bw)

    # ---- shared caches for timing (sized for the largest shape, random data)
    caches = {}
    for kv in ("int8", "fp8", "bf16"):
        caches[kv] = make_cache(kv, MAX_BS * MAX_L // HEADLINE["page"] + 8, HEADLINE,
                                gen_seed={"int8": 1, "fp8": 2, "bf16": 3}[kv])
    caches_d128 = {kv: make_cache(kv, 64 * 32768 // 16 + 8 if not SMOKE else 80, COMMON) for kv in ("int8", "bf16")}
    log(f"caches ready {time.time() - t_start:.1f}s")

    # ---- collect and precompile every variant the run will use
    keys = set()

    def want(kv, pv, shape, bs, q_len, config=None, num_splits=None):
        cache = caches[kv] if shape is HEADLINE else caches_d128[kv]
        plan = dec.plan_decode((bs * q_len, shape["hq"], shape["d"]), cache, (bs, 2048), pv_mode=pv,
                               num_splits=num_splits, config=config)
        keys.add(_variant_key(kv, plan.pv_mode, shape, plan))

    for name, (kv, pv, cfg) in PATHS.items():
        want(kv, pv, HEADLINE, 16, 1, cfg)
    want("int8", "int8_signed", HEADLINE, 16, 1)
    for q_len in (2, 4):
        for kv in ("int8", "bf16"):
            want(kv, None, HEADLINE, 16, q_len)
    for kv in ("int8", "bf16"):
        want(kv, None, COMMON, 16, 1)
    # accuracy section: mean query length 3 (multi-token case)
    for kv, modes in (("int8", ["int8", "bf16", "int8_signed"]), ("fp8", ["fp8", "bf16"]), ("bf16", ["bf16"])):
        for mode in modes:
            want(kv, mode, HEADLINE, 2, 3)
    want("fp8", "fp8", HEADLINE, 2, 3, WIDE_FP8)
    for kv, cfgs in TUNE_CONFIGS.items():
        for bn, w, st in cfgs:
            want(kv, None, HEADLINE, 16, 1, dec.DecodeConfig(bn, w, st))
    precompile(keys)

    # ---- 2. accuracy at real shapes
    if "acc" not in skip:
        acc_cases = [("decode", [8200, 1000, 33] if not SMOKE else [150, 33], [1, 1, 1] if not SMOKE else [1, 1]),
                     ("multi-token", [4100, 300] if not SMOKE else [100, 40], [2, 4])]
        for case, lens, qs in acc_cases:
            for kv in ("int8", "fp8", "bf16"):
                b = testing.make_paged_batch(lens, qs, num_q_heads=24, num_kv_heads=4, head_dim=256, block_size=16,
                                             kv_dtype=kv, seed=42, device=DEV)
                a = (b.query, b.cache, b.block_table, b.seq_lens, b.query_start_loc)
                ref = reference.attention_reference(*a)
                refq = reference.attention_reference_quantized(*a) if kv == "int8" else None
                modes = {"int8": ["int8", "bf16", "int8_signed"], "fp8": ["fp8", "bf16", "qgmma"],
                         "bf16": ["bf16"]}[kv]
                for mode in modes:
                    cfg = WIDE_FP8 if mode == "qgmma" else None
                    pv = "fp8" if mode == "qgmma" else mode
                    try:
                        plan = dec.plan_decode(tuple(b.query.shape), b.cache, tuple(b.block_table.shape), pv_mode=pv,
                                               config=cfg)
                        out = testing.poisoned_like(b.query)
                        dec._run(plan, *a, None, out, None, None, None)
                        st = reference.error_stats(out, ref)
                        row = dict(kind="accuracy", case=case, kv_dtype=kv, pv_mode=mode, seq_lens=lens, q_lens=qs,
                                   num_splits=plan.num_splits, key_smoothing=b.cache.key_smoothing,
                                   **{f"vs_f64_{k}": v for k, v in st.items()})
                        if refq is not None:
                            stq = reference.error_stats(out, refq)
                            row.update({f"vs_sameq_{k}": v for k, v in stq.items()})
                        rec.add(**row)
                        log(f"acc {case:11s} {kv}/{mode:11s} splits {plan.num_splits:3d} rel_l2 {st['rel_l2']:.4f} "
                            f"max_abs {st['max_abs']:.4f} finite {st['finite']}"
                            + (f" | same-quant rel_l2 {row['vs_sameq_rel_l2']:.4f}" if refq is not None else ""))
                        if not SMOKE and mode in ("int8", "fp8", "bf16", "qgmma") and case == "decode":
                            if dec.LAST_LAUNCH.get("split_kernel") is not None and "sass" not in skip:
                                try:
                                    s = sass_summary(dec.LAST_LAUNCH["split_kernel"])
                                    rec.add(kind="sass", kv_dtype=kv, pv_mode=mode, **s)
                                    log(f"sass {kv}/{mode}: {json.dumps(s)}")
                                except Exception as e:
                                    log(f"sass {kv}/{mode} failed: {e!r}")
                    except Exception as e:
                        log(f"acc {case} {kv}/{mode} FAILED: {e!r}")
                        traceback.print_exc()
                del b
        # 32q / 8kv D128
        try:
            b = testing.make_paged_batch([5000, 77] if not SMOKE else [90, 7], [1, 1], num_q_heads=32, num_kv_heads=8,
                                         head_dim=128, kv_dtype="int8", seed=5, device=DEV)
            a = (b.query, b.cache, b.block_table, b.seq_lens, b.query_start_loc)
            out = dec.decode_attention(*a)
            st = reference.error_stats(out, reference.attention_reference(*a))
            stq = reference.error_stats(out, reference.attention_reference_quantized(*a))
            rec.add(kind="accuracy", case="d128", kv_dtype="int8", pv_mode="int8", **{f"vs_f64_{k}": v for k, v in st.items()},
                    **{f"vs_sameq_{k}": v for k, v in stq.items()})
            log(f"acc d128 int8/int8 rel_l2 {st['rel_l2']:.4f} same-quant {stq['rel_l2']:.4f}")
            del b
        except Exception as e:
            log(f"acc d128 FAILED: {e!r}")
        log(f"accuracy done {time.time() - t_start:.1f}s")

    # ---- 4. main grid
    summary = []

    def time_path(tag, name, kv, pv, cfg, shape, bs, ctx, q_len=1, num_splits=None, graph_only=False,
                  quantize_in_call=False, extra=None):
        cache = caches[kv] if shape is HEADLINE else caches_d128[kv]
        try:
            runner = Decode(cache, shape, bs, ctx, q_len, pv, cfg, num_splits, quantize_in_call)
            runner()
            if not SMOKE:
                torch.cuda.synchronize()
            res = {"graph_us": timeit(runner, True)}
            if not graph_only:
                res["eager_us"] = timeit(runner, False)
        except Exception as e:
            log(f"  {tag} {name} bs{bs} L{ctx} q{q_len} FAILED: {e!r}")
            traceback.print_exc()
            return None
        nbytes = kv_bytes(kv, bs, ctx, shape["hkv"], shape["d"])
        p = runner.plan
        row = dict(kind=tag, path=name, kv_dtype=kv, pv_mode=p.pv_mode, bs=bs, context=ctx, q_len=q_len,
                   q_heads=shape["hq"], kv_heads=shape["hkv"], head_dim=shape["d"], page=shape["page"],
                   num_splits=p.num_splits, block_m=p.block_m, tokens_per_pass=p.tokens_per_pass,
                   block_n=p.config.block_n, num_warps=p.config.num_warps, num_stages=p.config.num_stages,
                   min_block_m=p.config.min_block_m, bytes=nbytes, quantize_in_call=quantize_in_call, **res)
        for mode in ("graph", "eager"):
            if f"{mode}_us" in res:
                bw = nbytes / (res[f"{mode}_us"] * 1e-6)
                row[f"{mode}_bw_tbs"] = bw / 1e12
                row[f"{mode}_pct_copy"] = 100 * bw / copy_bw
        row.update(extra or {})
        rec.add(**row)
        summary.append(row)
        log(f"{tag:6s} {name:12s} bs{bs:3d} L{ctx:6d} q{q_len} S{p.num_splits:3d} BN{p.config.block_n:4d} "
            f"w{p.config.num_warps} st{p.config.num_stages} graph {res['graph_us']:9.1f}us "
            f"({row['graph_pct_copy']:5.1f}%)" + (f" eager {res['eager_us']:9.1f}us ({row['eager_pct_copy']:5.1f}%)"
                                                   if "eager_us" in res else ""))
        return row

    def time_sdpa(shape, bs, ctx, tag="grid"):
        hq, hkv, d = shape["hq"], shape["hkv"], shape["d"]
        try:
            rot = max(1, min(4, MAX_BS // bs))
            kv_len = ctx
            k = torch.randn(bs * rot, hkv, kv_len, d, device=DEV, dtype=torch.bfloat16)
            v = torch.randn_like(k)
            q = torch.randn(bs, hq, 1, d, device=DEV, dtype=torch.bfloat16)
            sets = itertools.cycle([(k[i * bs:(i + 1) * bs], v[i * bs:(i + 1) * bs]) for i in range(rot)])

            def fn():
                kk, vv = next(sets)
                return torch.nn.functional.scaled_dot_product_attention(q, kk, vv, enable_gqa=True)

            fn()
            res = {"graph_us": timeit(fn, True), "eager_us": timeit(fn, False)}
            del k, v
        except Exception as e:
            log(f"  sdpa bs{bs} L{ctx} FAILED: {e!r}")
            return None
        nbytes = kv_bytes("bf16", bs, ctx, hkv, d)
        row = dict(kind=tag, path="sdpa_bf16", kv_dtype="bf16", bs=bs, context=ctx, q_len=1, q_heads=hq,
                   kv_heads=hkv, head_dim=d, bytes=nbytes, **res)
        for mode in ("graph", "eager"):
            bw = nbytes / (res[f"{mode}_us"] * 1e-6)
            row[f"{mode}_bw_tbs"] = bw / 1e12
            row[f"{mode}_pct_copy"] = 100 * bw / copy_bw
        rec.add(**row)
        summary.append(row)
        log(f"{tag:6s} {'sdpa_bf16':12s} bs{bs:3d} L{ctx:6d} q1 graph {res['graph_us']:9.1f}us "
            f"({row['graph_pct_copy']:5.1f}%) eager {res['eager_us']:9.1f}us ({row['eager_pct_copy']:5.1f}%)")
        return row

    if "grid" not in skip:
        for bs in BATCHES:
            for ctx in CONTEXTS:
                for name, (kv, pv, cfg) in PATHS.items():
                    if name in ("fp8_pvbf16", "fp8_qgmma") and ctx not in (CONTEXTS[1], CONTEXTS[-1]):
                        continue
                    time_path("grid", name, kv, pv, cfg, HEADLINE, bs, ctx)
                time_sdpa(HEADLINE, bs, ctx)
                if SMOKE:
                    break
        # Q quantized inside the timed call (no producer): its cost is in the window
        for bs, ctx in ((1, CONTEXTS[-1]), (BS_MID, CONTEXTS[-1])):
            time_path("qcall", "int8", "int8", "int8", None, HEADLINE, bs, ctx, quantize_in_call=True)
        time_path("grid", "int8_signed", "int8", "int8_signed", None, HEADLINE, BS_MID, CONTEXTS[-1])
        rec.save()
        rec.rows.clear()
        log(f"grid done {time.time() - t_start:.1f}s")

    def late(section):
        if time.time() - t_start > DEADLINE_S:
            log(f"deadline: skipping {section}")
            return True
        return False

    if "batch" not in skip and not late("batch"):
        ctx = CONTEXTS[1]
        for bs in SWEEP_BATCHES:
            for kv in ("int8", "bf16"):
                time_path("batch", kv, kv, None, None, HEADLINE, bs, ctx, graph_only=True)
        log(f"batch sweep done {time.time() - t_start:.1f}s")
    rec.save()
    rec.rows.clear()

    if "mt" not in skip and not late("mt"):
        for q_len in (2, 4):
            for bs in BATCHES:
                for ctx in MT_CONTEXTS:
                    for kv in ("int8", "bf16"):
                        time_path("mt", kv, kv, None, None, HEADLINE, bs, ctx, q_len=q_len, graph_only=True)
        log(f"multi-token done {time.time() - t_start:.1f}s")

    if "d128" not in skip and not late("d128"):
        for bs in BATCHES:
            for ctx in MT_CONTEXTS:
                for kv in ("int8", "bf16"):
                    time_path("d128", kv, kv, None, None, COMMON, bs, ctx)
                time_sdpa(COMMON, bs, ctx, tag="d128")
        log(f"d128 done {time.time() - t_start:.1f}s")

    rec.save()
    rec.rows.clear()

    if "tune" not in skip:
        for bs, ctx in TUNE_SHAPES:
            for kv, cfgs in TUNE_CONFIGS.items():
                for bn, w, st in cfgs:
                    if late(f"tune {kv} {bn}/{w}/{st} bs{bs} L{ctx}"):
                        break
                    cfg = dec.DecodeConfig(bn, w, st)
                    base = dec.plan_decode((bs, 24, 256), caches[kv], (bs, ctx // 16), config=cfg).num_splits
                    splits = [base]
                    if kv == "int8" and (bn, w, st) == TUNE_CONFIGS["int8"][0]:
                        splits = sorted({max(1, base // 2), base, base * 2, base * 4} & set(range(1, 257)))
                    for s in splits:
                        time_path("tune", kv, kv, None, cfg, HEADLINE, bs, ctx, num_splits=s, graph_only=True,
                                  extra={"auto_splits": base})
        log(f"tune done {time.time() - t_start:.1f}s")
    rec.save()

    # ---- summary table (last lines of the output)
    log("\nSUMMARY graph us (pct copy) | ratios")
    by = {(r["kind"], r["path"], r["bs"], r["context"], r.get("q_len", 1), r.get("head_dim")): r for r in summary}
    for bs in BATCHES:
        for ctx in CONTEXTS:
            g = lambda p: by.get(("grid", p, bs, ctx, 1, 256))  # noqa: E731
            i8, b16, sd, f8 = g("int8"), g("bf16"), g("sdpa_bf16"), g("fp8")
            if not (i8 and b16 and sd):
                continue
            line = (f"bs{bs:3d} L{ctx:6d} int8 {i8['graph_us']:8.1f} ({i8['graph_pct_copy']:5.1f}%) "
                    f"eager {i8['eager_pct_copy']:5.1f}% | bf16 {b16['graph_us']:8.1f} | sdpa {sd['graph_us']:8.1f} | "
                    f"int8/sdpa {sd['graph_us'] / i8['graph_us']:.2f}x int8/bf16 {b16['graph_us'] / i8['graph_us']:.2f}x")
            if f8:
                line += f" fp8/bf16 {b16['graph_us'] / f8['graph_us']:.2f}x"
            log(line)
    log(f"total {time.time() - t_start:.1f}s")
    if out_dir:
        with open(os.path.join(out_dir, "decode_log.txt"), "w") as f:
            f.write("\n".join(LOG) + "\n")


if __name__ == "__main__":
    main()
