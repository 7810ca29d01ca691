"""One short prefill (16 q / 4 KV heads, head_dim 64, a 4096-token causal chunk, no prefix)
timed four ways on the H200, to tell kernel time from host time: CUDA-graph replay
(``bench.time_graph``), calls queued behind a sleep kernel (``bench.time_queued``), eager
``triton.testing.do_bench`` with L2 flushed (``bench.time_eager``, what
``bench_prefill_hopper.py`` reports), and the host's issue time per call (wall clock of 50
back-to-back calls). Kernels: the portable kernel, the warp-specialized Hopper kernel with
both QK schedules and, for fp8, the synchronous Hopper kernel; the query codes are passed
in as a plan passes them. Two repeats each.

Why: ``do_bench`` flushes L2 by zeroing a buffer, records its start event and calls the
function; when the call's host work outlasts the flush, the GPU waits for the launch and
the wait is timed. A kernel of ~150 µs whose unplanned launch costs ~300 µs of host time
then reads anything from its own time to twice it.

Usage: ``PYTHONPATH=src python benchmarks/timing_methods_prefill_hopper.py [--out DIR]``
(rows: ``prefill_hopper.jsonl``, ``bench: prefill_hopper_timing``).
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import replace

import torch

from int8attn import bench, testing
from int8attn.ops import prefill_hopper as hop
from int8attn.ops.prefill import prefill_attention
from int8attn.ops.producer import quantize_query


def host_issue_us(fn, calls: int = 50) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return host


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="directory of prefill_hopper.jsonl (default benchmarks/results)")
    opts = ap.parse_args()
    rec = bench.Recorder("prefill_hopper_timing",
                         os.path.join(opts.out, "prefill_hopper.jsonl") if opts.out else None)
    for kv in ("int8", "fp8"):
        b = testing.make_paged_batch([4096], [4096], num_q_heads=16, num_kv_heads=4, head_dim=64, kv_dtype=kv, seed=7,
                                     device="cuda")
        args = (b.query, b.cache, b.block_table, b.seq_lens, b.query_start_loc)
        qq, qs = quantize_query(b.query, kv)
        ws = hop.warp_specialized_config(kv, 64)
        codes = dict(kernel="hopper", pv_mode=kv, q_quant=qq, q_scale=qs)
        runs = {"portable": lambda: prefill_attention(*args, pv_mode=kv),
                "ws-after": lambda: hop.prefill(*args, config=replace(ws, qk_ahead=False), **codes),
                "ws-ahead": lambda: hop.prefill(*args, config=replace(ws, qk_ahead=True), **codes)}
        if kv == "fp8":
            runs["sync"] = lambda: hop.prefill(*args, config=hop.default_config(kv, 64, kv), **codes)
        for rep in range(2):
            for name, fn in runs.items():
                host = host_issue_us(fn)
                graph = bench.time_graph(fn)
                queued, ok = bench.time_queued(fn)
                eager = bench.time_eager(fn)
                row = dict(bench="prefill_hopper_timing", shape="16q4kv_d64", prefix=0, chunk=4096, kv_dtype=kv,
                           pv_mode=kv, kernel=name, repeat=rep, graph_us=graph, queued_us=queued, queued=ok,
                           eager_us=eager, host_issue_us=host)
                print(f"{kv} rep{rep} {name:<9} graph {graph:7.1f} queued {queued:7.1f} ({ok}) eager {eager:7.1f} "
                      f"host-issue {host:6.1f} us", flush=True)
                rec.add(**row)
    print("rows ->", rec.save())


if __name__ == "__main__":
    main()
