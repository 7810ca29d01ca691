"""Host cost of eager prefill calls on the H200: what a call costs the CPU before its kernel
runs, per path, with the Hopper launch through :class:`int8attn.ops._launch.CachedLaunch`
(``ops.prefill_hopper.CACHED_LAUNCH``, the default) and through Gluon's JIT dispatch
(the launch before it), timed side by side in one run.

Shape: 32 query / 8 KV heads, head_dim 128, page 16, one causal chunk of ``--chunk`` tokens
(default 512: a kernel of tens of µs, so a loop of calls is host-bound and the wall time per
call is the host's). Cache dtypes int8, fp8 and bf16. Calls:

* ``hopper codes`` -- ``ops.prefill_hopper.run_prefill`` with the query's codes given (one
  launch: the attention kernel), cached launch / JIT dispatch;
* ``plan.run`` / ``plan.run codes`` -- :meth:`int8attn.AttentionPlan.run` of a plan on the
  "auto" route (the Hopper kernel), quantizing the query in the call (two launches for an
  8-bit cache) / given the codes, cached launch / JIT dispatch;
* ``plan.run portable`` -- the same plan forced to the portable kernel;
* ``attention()`` -- the public call without a plan (value checks off: the portable kernel).

Per call: ``host_us`` (issuing 100 back-to-back calls, per call), ``wall_us`` (until the
device finished too), ``gpu_us`` (:func:`int8attn.bench.time_queued`: the same calls queued
behind a sleep kernel, host time hidden). ``--profile`` adds a cProfile of 500 ``plan.run``
calls per launch path (top functions by cumulative time, to stdout).

    PYTHONUNBUFFERED=1 PYTHONPATH=src python3 benchmarks/bench_host_prefill.py --out DIR [--profile]

Rows: ``host_overhead.jsonl`` (``bench: host_prefill``).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats

import torch

from int8attn import bench, testing
from int8attn.ops import prefill_hopper as hop
from int8attn.ops.attention import attention, plan_attention
from int8attn.ops.producer import quantize_query

HQ, HKV, D, PAGE = 32, 8, 128, 16


def calls_for(kv: str, chunk: int) -> dict:
    """{name: (fn, uses the Hopper launch)} of one batch (a single causal chunk)."""
    b = testing.make_paged_batch([chunk], [chunk], num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, block_size=PAGE,
                                 kv_dtype=kv, seed=1, device="cuda")
    args = (b.query, b.cache, b.block_table, b.seq_lens, b.query_start_loc)
    out = torch.empty(b.query.shape, dtype=torch.bfloat16, device="cuda")
    qq, qs = quantize_query(b.query, kv) if kv != "bf16" else (None, None)
    plan = plan_attention(b.cache, b.block_table, b.seq_lens, b.query_start_loc, HQ, pv_mode=kv)
    portable = plan_attention(b.cache, b.block_table, b.seq_lens, b.query_start_loc, HQ, pv_mode=kv,
                              prefill_kernel="portable")
    config = hop.route_config(b.cache, HQ, kv)
    calls = {"hopper codes": (lambda: hop.run_prefill(config, kv, *args, None, out, qq, qs, 0, None), True),
             "plan.run": (lambda: plan.run(*args, out=out), True),
             "plan.run portable": (lambda: portable.run(*args, out=out), False),
             "attention()": (lambda: attention(*args, out=out, pv_mode=kv), False)}
    if kv != "bf16":
        calls["plan.run codes"] = (lambda: plan.run(*args, out=out, q_quant=qq, q_scale=qs), True)
    assert plan.prefill_kernel == "hopper", plan.prefill_kernel
    return calls


def _profile(fn, calls: int = 500) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(25)
    return text.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="folder for host_overhead.jsonl (default benchmarks/results)")
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--kv", default="int8,fp8,bf16")
    ap.add_argument("--profile", action="store_true")
    opts = ap.parse_args()
    rec = bench.Recorder("host_prefill", os.path.join(opts.out, "host_overhead.jsonl") if opts.out else None)
    sync = torch.cuda.synchronize
    print(f"{'kv':<5} {'call':<18} {'launch':<7} {'host us':>8} {'wall us':>8} {'gpu us':>8}")
    for kv in opts.kv.split(","):
        calls = calls_for(kv, opts.chunk)
        fns = {}
        for name, (fn, hopper) in calls.items():
            for cached in ((True, False) if hopper else (True,)):
                def call(fn=fn, cached=cached):
                    hop.CACHED_LAUNCH = cached
                    return fn()
                fns[(name, "cached" if cached else "jit")] = call
        timed = bench.interleaved_us(fns, opts.calls, opts.repeats, sync)
        for (name, launch), fn in fns.items():
            host, wall = timed[(name, launch)]
            gpu, queued = bench.time_queued(fn)
            print(f"{kv:<5} {name:<18} {launch:<7} {host:8.1f} {wall:8.1f} {gpu:8.1f}{'' if queued else ' *'}",
                  flush=True)
            rec.add(bench="host_prefill", kv_dtype=kv, call=name, launch=launch, shape=f"{HQ}q{HKV}kv_d{D}",
                    chunk=opts.chunk, host_us=host, wall_us=wall, gpu_us=gpu, queued=queued, calls=opts.calls,
                    repeats=opts.repeats)
        if opts.profile:
            for launch in ("cached", "jit"):
                print(f"--- cProfile: {kv} plan.run, {launch} launch ---")
                print(_profile(fns[("plan.run", launch)]))
    hop.CACHED_LAUNCH = True
    print("rows ->", rec.save())
    print("* queued: the GPU reached the calls before all were issued (the figure includes host time)")


if __name__ == "__main__":
    main()
