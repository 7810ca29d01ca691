"""The decode goals in one short run (H200, 24q/4kv/D256, page 16, INT8 cache unless noted):

* ``merge``: bs 1/16/64 x L 8k/32k, CUDA-graph and eager, the one-launch decode (split
  programs merge their own partials, DecodeConfig.fused_merge) against the same tile with
  the separate merge kernel; % of copy bandwidth; our BF16 cache alongside (graph);
* ``mt``: q_len 1 vs 4 at bs16 L32k: the default 32-row tile (operand-swapped, 8 warps)
  and the two alternatives it replaced (the row-major rule tile; the 4-warp swapped tile);
* ``sass``: the matrix instruction of the split kernel that ran (IGMMA for INT8, QGMMA for
  FP8) and its registers / spills.

Eager figures are CUDA-event times of back-to-back calls through ``ops.decode.run_decode``
with the producer's query codes (the kernels only; the host path is measured by
bench_host_overhead.py). Rows go to ``--out DIR/decode_goals.jsonl`` via int8attn.bench;
a table to stdout. About 2-3 minutes on an H200, most of it compilation.

    PYTHONUNBUFFERED=1 PYTHONPATH=src:benchmarks python3 benchmarks/bench_decode_goals.py --out $OUT
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import time
import traceback
from pathlib import Path

import torch

from int8attn import bench, launches
from int8attn.ops import decode as dec

import bench_decode as bd  # noqa: E402  (shapes, caches, rotating tables, SASS helpers)

SHAPE = dict(hq=24, hkv=4, d=256, page=16)
POINTS = [(bs, ctx) for bs in (1, 16, 64) for ctx in (8192, 32768)]


def _time(fn, graph: bool) -> float:
    return bench.time_graph(fn, replays=30, repeats=9) if graph else bench.time_eager(fn, warmup_ms=10, rep_ms=60)


def _config(kv: str, q_len: int, **change):
    group = SHAPE["hq"] // SHAPE["hkv"]
    _, block_m = dec.rows_per_program(q_len * 16, 16, group)
    cfg = dec.default_config(kv, SHAPE["d"], block_m, SHAPE["page"], None)
    return dataclasses.replace(cfg, **change) if change else cfg


def merge_section(rec, caches, copy_bw, rows):
    for bs, ctx in POINTS:
        for kv in ("int8", "bf16"):
            variants = [("fused", _config(kv, 1))]
            if kv == "int8":
                variants.append(("merge-kernel", _config(kv, 1, fused_merge=False)))
            for name, cfg in variants:
                run = bd.Decode(caches[kv], SHAPE, bs, ctx, 1, None, config=cfg)
                nbytes = bd.kv_bytes(kv, bs, ctx, SHAPE["hkv"], SHAPE["d"])
                for graph in ((True, False) if kv == "int8" else (True,)):
                    us = _time(run, graph)
                    rows.append(rec.add(section="merge", kv_dtype=kv, variant=name, batch=bs, L=ctx, q_len=1,
                                        graph=graph, us=us, num_splits=run.plan.num_splits,
                                        pct_copy=100 * nbytes / (us * 1e-6) / copy_bw, config=str(cfg)))
                    print(f"merge {kv:5s} {name:12s} bs{bs:<3d} L{ctx:<6d} {'graph' if graph else 'eager'} "
                          f"{us:8.1f} us  {rows[-1]['pct_copy']:5.1f}% of copy  splits {run.plan.num_splits}",
                          flush=True)
                del run
        torch.cuda.empty_cache()


def mt_section(rec, caches, copy_bw, rows):
    bs, ctx = 16, 32768
    nbytes = bd.kv_bytes("int8", bs, ctx, SHAPE["hkv"], SHAPE["d"])
    base = None
    for name, q_len, cfg in [
        ("q1 default", 1, _config("int8", 1)),
        ("q4 default (swapped 8 warps)", 4, _config("int8", 4)),
        ("q4 row-major rule", 4, dec.DecodeConfig(block_n=64, num_warps=8, num_stages=9)),
        ("q4 swapped 4 warps", 4, dec.DecodeConfig(block_n=64, num_warps=4, num_stages=6, swap_ab=True)),
    ]:
        try:
            run = bd.Decode(caches["int8"], SHAPE, bs, ctx, q_len, None, config=cfg)
            us = _time(run, True)
        except Exception as e:  # a config that does not compile is reported, not fatal
            print(f"mt {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        base = us if q_len == 1 else base
        ratio = us / base if base else None
        rows.append(rec.add(section="mt", kv_dtype="int8", variant=name, batch=bs, L=ctx, q_len=q_len, graph=True,
                            us=us, ratio_to_q1=ratio, pct_copy=100 * nbytes / (us * 1e-6) / copy_bw,
                            num_splits=run.plan.num_splits, tokens_per_pass=run.plan.tokens_per_pass,
                            block_m=run.plan.block_m, config=str(cfg)))
        print(f"mt {name:30s} {us:8.1f} us  x{ratio if ratio else float('nan'):.2f} of q1  "
              f"(tokens/pass {run.plan.tokens_per_pass}, rows {run.plan.block_m})", flush=True)


def sass_section(rec, caches, rows):
    for kv, want in (("int8", "IGMMA"), ("fp8", "QGMMA")):
        cache = caches.get(kv)
        if cache is None:
            continue
        run = bd.Decode(cache, SHAPE, 16, 8192, 1, None)
        run()
        torch.cuda.synchronize()
        compiled = launches.last("_decode_split_kernel").compiled
        sass = bd.sass_of(compiled)
        found = sorted(set(re.findall(r"\b([A-Z]+MMA)\b", sass)))
        rows.append(rec.add(section="sass", kv_dtype=kv, mma=found, want=want, ok=want in found,
                            n_regs=getattr(compiled, "n_regs", None), n_spills=getattr(compiled, "n_spills", None)))
        print(f"sass {kv}: {found} (want {want}: {'OK' if want in found else 'MISSING'}), "
              f"regs {getattr(compiled, 'n_regs', '?')}, spills {getattr(compiled, 'n_spills', '?')}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--skip", default="", help="comma list of sections to skip: merge,mt,sass")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    skip = set(filter(None, args.skip.split(",")))
    rec = bench.Recorder("decode_goals", Path(args.out) / "decode_goals.jsonl" if args.out else None)
    t0 = time.perf_counter()
    copy_bw = bench.copy_bandwidth()
    blocks = 64 * 32768 // SHAPE["page"] * 2  # two rotations of the largest point
    caches = {kv: bd.make_cache(kv, blocks if kv != "fp8" else 16 * 8192 // SHAPE["page"], SHAPE)
              for kv in ("int8", "bf16", "fp8")}
    rows: list = []
    for name, fn in (("sass", lambda: sass_section(rec, caches, rows)),
                     ("mt", lambda: mt_section(rec, caches, copy_bw, rows)),
                     ("merge", lambda: merge_section(rec, caches, copy_bw, rows))):
        if name in skip:
            continue
        try:
            fn()
        except Exception:
            traceback.print_exc()
        print(f"[{time.perf_counter() - t0:6.1f}s] {name} done", flush=True)
    path = rec.save()
    print(f"{len(rows)} rows -> {path}; copy {copy_bw / 1e12:.2f} TB/s; {rec.env['gpu']}, torch {rec.env['torch']}, "
          f"triton {rec.env['triton']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
