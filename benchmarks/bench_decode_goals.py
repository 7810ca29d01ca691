"""The decode goals in one short run (H200, 24q/4kv/D256, page 16, INT8 cache unless noted):

* ``sass``: the matrix instruction of the split kernel that ran (IGMMA for INT8, QGMMA for
  FP8) and its registers / spills;
* ``merge``: bs 1/16/64 x L 8k/32k, CUDA-graph and eager, the one-launch decode (split
  programs merge their own partials, DecodeConfig.fused_merge) against the same tile with
  the separate merge kernel; % of copy bandwidth; our BF16 cache alongside; which merge
  was faster per point;
* ``mt``: q_len 1 vs 4 at bs16 L32k: the q4 default tile and its alternatives (4 / 8
  warps, operand-swapped or row-major, split counts);
* ``peers``: FlashInfer ``BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True)``
  BF16 and FP8 e4m3 (per-tensor k/v scales) and PyTorch SDPA BF16 at the same points,
  eager and graph (benchmarks/_peers.py; skipped with the reason when not importable);
  then a goals table: % of copy, and our INT8 against FlashInfer BF16 / FP8.

Setup as benchmarks/bench_decode.py's grid: the same cache size (64 x 32k tokens + 8
pages), random pages, four rotating block tables (so graph replays never find the
previous call's KV in L2), eager times with L2 flushed, the K/V bytes (+ scales) counted.
Eager figures are CUDA-event times of back-to-back calls through ``ops.decode.run_decode``
with the producer's query codes (the kernels only; the host path is measured by
bench_host_overhead.py). FlashInfer's own pages do not rotate: its graph figure at a point
whose K/V fit in L2 (``l2_resident`` in the row) is flattered. Rows go to
``--out DIR/decode_goals.jsonl`` via int8attn.bench; a table to stdout. About 3-4
minutes on an H200 with FlashInfer (its first calls JIT-compile), most of it compilation.

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

import _peers as P  # noqa: E402  (FlashInfer / SDPA peers)
import bench_decode as bd  # noqa: E402  (caches, rotating tables, bytes)
from int8attn.gate.sass import sass_of_compiled

L2_BYTES = 50 << 20  # H200 L2; a peer's K/V below this may stay resident across graph replays
_DEADLINE = [float("inf")]  # perf_counter() after which the remaining points are skipped (--deadline)


def _late(what: str) -> bool:
    if time.perf_counter() > _DEADLINE[0]:
        print(f"deadline reached: {what} and the rest skipped", flush=True)
        return True
    return False

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
        if _late(f"merge bs{bs} L{ctx}"):
            return
        for kv in ("int8", "bf16"):
            variants = [("default", None)] if kv == "bf16" else [
                ("default", None), ("fused", _config(kv, 1, fused_merge=True)),
                ("merge-kernel", _config(kv, 1, fused_merge=False))]
            for name, cfg in variants:
                run = bd.Decode(caches[kv], SHAPE, bs, ctx, 1, None, config=cfg)
                cfg = run.plan.config
                nbytes = bd.kv_bytes(kv, bs, ctx, SHAPE["hkv"], SHAPE["d"])
                for graph in ((True, False) if kv == "int8" or name == "default" else (True,)):
                    us = _time(run, graph)
                    rows.append(rec.add(section="merge", kv_dtype=kv, variant=name, batch=bs, L=ctx, q_len=1,
                                        graph=graph, us=us, num_splits=run.plan.num_splits,
                                        pct_copy=100 * nbytes / (us * 1e-6) / copy_bw, config=str(cfg),
                                        fused=bool(cfg.fused_merge and run.plan.num_splits > 1)))
                    print(f"merge {kv:5s} {name:12s} bs{bs:<3d} L{ctx:<6d} {'graph' if graph else 'eager'} "
                          f"{us:8.1f} us  {rows[-1]['pct_copy']:5.1f}% of copy  splits {run.plan.num_splits}",
                          flush=True)
                del run
        pair = {r["variant"]: r["us"] for r in rows if r.get("section") == "merge" and r["kv_dtype"] == "int8"
                and r["batch"] == bs and r["L"] == ctx and r["graph"] and r["variant"] in ("fused", "merge-kernel")}
        if len(pair) == 2:
            best = min(pair, key=pair.get)
            rows.append(rec.add(section="merge_choice", batch=bs, L=ctx, faster=best, graph_us=pair))
            print(f"merge faster at bs{bs} L{ctx} (graph): {best} "
                  f"({pair['fused']:.1f} fused vs {pair['merge-kernel']:.1f} merge kernel)", flush=True)
        torch.cuda.empty_cache()


def mt_section(rec, caches, copy_bw, rows):
    bs, ctx = 16, 32768
    nbytes = bd.kv_bytes("int8", bs, ctx, SHAPE["hkv"], SHAPE["d"])
    base = None
    swapped4 = dec.DecodeConfig(block_n=64, num_warps=4, num_stages=6, swap_ab=True)
    swapped8 = dec.DecodeConfig(block_n=64, num_warps=8, num_stages=6, swap_ab=True)
    for name, q_len, cfg, splits in [
        ("q1 default", 1, _config("int8", 1), None),
        ("q4 default", 4, _config("int8", 4), None),
        ("q4 swapped 8 warps", 4, swapped8, None),
        ("q4 swapped 8 warps, 4 splits", 4, swapped8, 4),
        ("q4 swapped 8 warps, 8 splits", 4, swapped8, 8),
        ("q4 swapped 4 warps, 8 splits", 4, swapped4, 8),
        ("q4 row-major 8 warps", 4, dec.DecodeConfig(block_n=64, num_warps=8, num_stages=9), None),
    ]:
        if _late(f"mt {name}"):
            return
        try:
            run = bd.Decode(caches["int8"], SHAPE, bs, ctx, q_len, None, config=cfg, num_splits=splits)
            us = _time(run, True)
        except Exception as e:  # a config that does not compile is reported, not fatal
            print(f"mt {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        base = us if q_len == 1 else base
        compiled = launches.last("_decode_split_kernel").compiled
        ratio = us / base if base else None
        rows.append(rec.add(section="mt", kv_dtype="int8", variant=name, batch=bs, L=ctx, q_len=q_len, graph=True,
                            us=us, ratio_to_q1=ratio, pct_copy=100 * nbytes / (us * 1e-6) / copy_bw,
                            num_splits=run.plan.num_splits, tokens_per_pass=run.plan.tokens_per_pass,
                            block_m=run.plan.block_m, config=str(cfg), n_regs=getattr(compiled, "n_regs", None),
                            n_spills=getattr(compiled, "n_spills", None)))
        print(f"mt {name:30s} {us:8.1f} us  x{ratio if ratio else float('nan'):.2f} of q1  "
              f"(tokens/pass {run.plan.tokens_per_pass}, rows {run.plan.block_m}, splits {run.plan.num_splits}, "
              f"regs {getattr(compiled, 'n_regs', '?')}, spills {getattr(compiled, 'n_spills', '?')})", flush=True)
        del run


def sass_section(rec, caches, rows):
    for kv, want in (("int8", "IGMMA"), ("fp8", "QGMMA")):
        cache = caches.get(kv)
        if cache is None:
            continue
        run = bd.Decode(cache, SHAPE, 16, 8192, 1, None)
        run()
        torch.cuda.synchronize()
        compiled = launches.last("_decode_split_kernel").compiled
        sass = sass_of_compiled(compiled)
        found = sorted(set(re.findall(r"\b([A-Z]+MMA)\b", sass)))
        rows.append(rec.add(section="sass", kv_dtype=kv, mma=found, want=want, ok=want in found,
                            n_regs=getattr(compiled, "n_regs", None), n_spills=getattr(compiled, "n_spills", None)))
        print(f"sass {kv}: {found} (want {want}: {'OK' if want in found else 'MISSING'}), "
              f"regs {getattr(compiled, 'n_regs', '?')}, spills {getattr(compiled, 'n_spills', '?')}", flush=True)


class _PeerTimer:
    """The ``run`` object benchmarks/_peers.py times with: eager as asked and, when
    ``graph``, the same callable under CUDA-graph replay too (kept in ``graph_us``; a
    callable that cannot be captured leaves the reason in ``graph_error``)."""

    device = "cuda"

    def __init__(self, graph: bool):
        self.graph, self.graph_us, self.graph_error = graph, None, None

    def time(self, fn, graph: bool = False) -> float:
        if graph:
            return _time(fn, True)
        us = _time(fn, False)
        if self.graph and self.graph_us is None and self.graph_error is None:
            try:
                self.graph_us = _time(fn, True)
            except Exception as e:  # not capturable: eager only
                self.graph_error = f"{type(e).__name__}: {str(e)[:160]}"
        return us


def peers_section(rec, copy_bw, rows):
    hq, hkv, d, page = SHAPE["hq"], SHAPE["hkv"], SHAPE["d"], SHAPE["page"]
    missing = set()
    for bs, ctx in POINTS:
        if _late(f"peers bs{bs} L{ctx}"):
            return
        for peer, kv in (("flashinfer", "bf16"), ("flashinfer", "fp8"), ("torch_sdpa", "bf16")):
            if peer in missing:
                continue
            timer = _PeerTimer(graph=peer == "flashinfer")
            try:
                if peer == "flashinfer":
                    row = P.flashinfer_decode(timer, bs, ctx, hq, hkv, d, page=page, kv_dtype=kv)
                    row["graph_us"], row["graph_error"] = timer.graph_us, timer.graph_error
                else:
                    row = P.sdpa_decode(timer, bs, ctx, hq, hkv, d, max_bs=64)
            except P.Unavailable as e:
                missing.add(peer)
                rows.append(rec.add(section="peers", peer=peer, kv_dtype=kv, skipped=str(e)))
                print(f"peers {peer}: skipped: {e}", flush=True)
                continue
            except Exception as e:  # a failing peer is reported, not fatal
                rows.append(rec.add(section="peers", peer=peer, kv_dtype=kv, batch=bs, L=ctx,
                                    error=f"{type(e).__name__}: {str(e)[:300]}"))
                print(f"peers {peer} {kv} bs{bs} L{ctx}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                torch.cuda.empty_cache()
                continue
            nbytes = bd.kv_bytes(kv, bs, ctx, hkv, d) if kv == "bf16" else bs * ctx * hkv * 2 * d
            row.pop("bs", None), row.pop("context", None), row.pop("kv_dtype", None)
            rows.append(rec.add(section="peers", kv_dtype=kv, batch=bs, L=ctx, q_len=1, kv_bytes=nbytes,
                                l2_resident=nbytes < L2_BYTES,
                                pct_copy_graph=100 * nbytes / (row["graph_us"] * 1e-6) / copy_bw
                                if row.get("graph_us") else None,
                                pct_copy_eager=100 * nbytes / (row["eager_us"] * 1e-6) / copy_bw, **row))
            g = f"{row['graph_us']:8.1f}" if row.get("graph_us") else "     n/a"
            print(f"peers {peer:10s} {kv:4s} bs{bs:<3d} L{ctx:<6d} graph {g} us  eager {row['eager_us']:8.1f} us  "
                  f"rel_l2 {row.get('rel_l2', float('nan')):.2e}" + (" (K/V fit in L2)" if nbytes < L2_BYTES else ""),
                  flush=True)
            torch.cuda.empty_cache()


def summary(rows) -> None:
    """Our INT8 default (fused merge as configured) against the goals and the peers."""
    ours = {(r["batch"], r["L"], r["graph"]): r for r in rows
            if r.get("section") == "merge" and r["kv_dtype"] == "int8" and r["variant"] == "default"}
    peer = {(r["peer"], r["kv_dtype"], r["batch"], r["L"]): r for r in rows
            if r.get("section") == "peers" and "eager_us" in r}
    print("\n| bs | L | mode | int8 us | % copy | FI bf16 us | x FI bf16 | FI fp8 us | x FI fp8 | SDPA us | x SDPA |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for bs, ctx in POINTS:
        for graph in (True, False):
            o = ours.get((bs, ctx, graph))
            if o is None:
                continue
            key = "graph_us" if graph else "eager_us"
            cells = []
            for name, kv in (("flashinfer", "bf16"), ("flashinfer", "fp8"), ("torch_sdpa", "bf16")):
                p = peer.get((name, kv, bs, ctx), {}).get(key)
                cells += [f"{p:.1f}" if p else "-", f"{p / o['us']:.2f}" if p else "-"]
            print(f"| {bs} | {ctx} | {'graph' if graph else 'eager'} | {o['us']:.1f} | {o['pct_copy']:.1f} | "
                  + " | ".join(cells) + " |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--deadline", type=float, default=None,
                    help="seconds after which remaining points are skipped (the rows so far are saved)")
    ap.add_argument("--skip", default="", help="comma list of sections to skip: sass,mt,merge,peers")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    skip = set(filter(None, args.skip.split(",")))
    rec = bench.Recorder("decode_goals", Path(args.out) / "decode_goals.jsonl" if args.out else None)
    t0 = time.perf_counter()
    if args.deadline:
        _DEADLINE[0] = t0 + args.deadline
    copy_bw = bench.copy_bandwidth()
    blocks = 64 * 32768 // SHAPE["page"] + 8  # bench_decode.py's cache (MAX_BS x MAX_L + 8 pages)
    caches = {kv: bd.make_cache(kv, blocks if kv != "fp8" else 16 * 8192 // SHAPE["page"], SHAPE,
                                gen_seed={"int8": 1, "fp8": 2, "bf16": 3}[kv])
              for kv in ("int8", "bf16", "fp8")}
    rows: list = []
    for name, fn in (("sass", lambda: sass_section(rec, caches, rows)),
                     ("mt", lambda: mt_section(rec, caches, copy_bw, rows)),
                     ("merge", lambda: merge_section(rec, caches, copy_bw, rows)),
                     ("peers", lambda: peers_section(rec, copy_bw, rows))):
        if name in skip:
            continue
        try:
            fn()
        except Exception:
            traceback.print_exc()
        print(f"[{time.perf_counter() - t0:6.1f}s] {name} done", flush=True)
    if "merge" not in skip:
        summary(rows)
    path = rec.save()
    print(f"{len(rows)} rows -> {path}; copy {copy_bw / 1e12:.2f} TB/s; {rec.env['gpu']}, torch {rec.env['torch']}, "
          f"triton {rec.env['triton']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
