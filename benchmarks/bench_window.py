"""GPU time of sliding-window attention (``window=``) against full causal attention.

A window layer reads only the tiles its window reaches, so its time should follow the
window, not the context. Timed at the gate's shape (24 q / 4 KV heads, head_dim 256, INT8
cache, page 16), windows None / 4096 / 1024, in one run:

* decode, batch 16 at L 32768, one token per sequence: ``AttentionPlan.run(window=)``,
  CUDA-graph replay;
* prefill, a 4096-token chunk over a 28672-token prefix (the portable kernel, which a window
  always takes), CUDA events.

Each row also holds the rel-L2 of the first sequence's last 16 query rows against the
float64 reference with the same window (``int8attn.reference``).

Rows go to ``--out DIR/window.jsonl`` (default benchmarks/results/window.jsonl).

    PYTHONPATH=src python3 benchmarks/bench_window.py --out DIR
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from int8attn import bench, reference, testing
from int8attn.ops.attention import plan_attention

HQ, HKV, D, PAGE = 24, 4, 256, 16
WINDOWS = (None, 4096, 1024)


def _time(fn, graph: bool) -> float:
    return bench.time_graph(fn, replays=20, repeats=7) if graph else bench.time_eager(fn)


def _case(rec, kind: str, seq_len: int, q_len: int, batch: int, graph: bool) -> None:
    b = testing.make_paged_batch([seq_len] * batch, [q_len] * batch, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D,
                                 kv_dtype="int8", seed=batch, device="cuda")
    args = (b.cache, b.block_table, b.seq_lens, b.query_start_loc)
    plan = plan_attention(*args, HQ)
    out = torch.empty(b.query.shape, dtype=torch.bfloat16, device="cuda")
    full_us = None
    for window in WINDOWS:
        us = _time(lambda: plan.run(b.query, *args, None, out, window=window), graph)
        full_us = us if window is None else full_us
        got = plan.run(b.query, *args, None, torch.empty_like(out), window=window)
        # the first sequence's last (up to 16) query tokens against float64 attention with the
        # window's mask (as a query of their own: same positions)
        n = min(q_len, 16)
        rows = slice(q_len - n, q_len)
        qsl = torch.tensor([0, n], dtype=torch.int32, device="cuda")
        ref = reference.attention_reference_quantized(b.query[rows], b.cache, b.block_table[:1], b.seq_lens[:1], qsl,
                                                      window=window)
        err = reference.error_stats(got[rows], ref)["rel_l2"]
        row = rec.add(kind=kind, batch=batch, L=seq_len, q_len=q_len, window=window, us=us,
                      speedup_vs_full=full_us / us, rel_l2_vs_float64=err, timing="graph" if graph else "events")
        print(f"{kind:8s} bs{batch:3d} L{seq_len} q{q_len:5d} window {str(window):>5s}: {us:9.1f} us "
              f"({row['speedup_vs_full']:.2f}x full), rel-L2 {err:.4f}")
    del b


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_window.py times GPU work: no CUDA device here", file=sys.stderr)
        return 2
    rec = bench.Recorder("window", Path(args.out) / "window.jsonl" if args.out else None)
    _case(rec, "decode", 32768, 1, 16, graph=True)
    _case(rec, "prefill", 32768, 4096, 1, graph=False)
    print(f"rows -> {rec.save()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
