"""What decode's in-kernel clamps cost: a launch without them (``INT8ATTN_DECODE_SAFE=0``)
against the default (clamps on), side by side in one run, under CUDA graphs.

24 query / 4 KV heads, head_dim 256, pages of 16 (the decode goal shape), bs 1 / 16 / 64 x
L 8k / 32k, one query token per sequence, per cache dtype. Per row: median time of each
launch kind, the ratio clamped / unclamped, and whether the two outputs are bit-identical (they
must be on valid metadata).

Usage (H200, about a minute)::

    PYTHONPATH=src python3 benchmarks/bench_decode_safe.py --out $OUT

Rows go to ``$OUT/decode_safe.jsonl`` (copy to ``benchmarks/results/``); a table is printed.
Without a GPU it runs one tiny case under Triton's interpreter (no timing).
"""

from __future__ import annotations

import argparse
import os

import torch

if not torch.cuda.is_available():  # one tiny case in Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

from int8attn import bench, testing  # noqa: E402
from int8attn.ops.decode import DecodeWorkspace, decode_attention  # noqa: E402

HQ, HKV, D, BLOCK = 24, 4, 256, 16


def run(kv: str, batch: int, length: int, device: str, rec: bench.Recorder) -> dict:
    b = testing.make_paged_batch([length] * batch, [1] * batch, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D,
                                 block_size=BLOCK, kv_dtype=kv, seed=batch, device=device, extra_blocks=0)
    args = (b.query, b.cache, b.block_table, b.seq_lens, b.query_start_loc)
    ws = DecodeWorkspace(batch, HQ, D, device=device)
    results = {}
    for safe in (False, True):
        os.environ["INT8ATTN_DECODE_SAFE"] = "1" if safe else "0"
        out = torch.full(b.query.shape, float("nan"), dtype=torch.bfloat16, device=device)
        decode_attention(*args, out=out, workspace=ws)
        us = bench.time_graph(lambda: decode_attention(*args, out=out, workspace=ws)) if device == "cuda" \
            else float("nan")
        results[safe] = (us, out.clone())
    os.environ.pop("INT8ATTN_DECODE_SAFE", None)
    (us0, out0), (us1, out1) = results[False], results[True]
    row = rec.add(op="decode_safe", kv_dtype=kv, batch=batch, seq_len=length, num_q_heads=HQ, num_kv_heads=HKV,
                  head_dim=D, block_size=BLOCK, us_unclamped=us0, us_clamped=us1, clamped_over_unclamped=us1 / us0,
                  bit_identical=bool(torch.equal(out0, out1)), graph=True)
    print(f"{kv:5s} bs{batch:<3d} L{length:<6d} unclamped {us0:8.1f} us  clamped {us1:8.1f} us  "
          f"x{row['clamped_over_unclamped']:.3f}  identical {row['bit_identical']}", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--kv", default="int8,fp8,bf16")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shapes = [(1, 8192), (1, 32768), (16, 8192), (16, 32768), (64, 8192), (64, 32768)] if device == "cuda" \
        else [(2, 40)]
    rec = bench.Recorder("decode_safe", path=os.path.join(args.out, "decode_safe.jsonl"))
    for kv in args.kv.split(","):
        for batch, length in shapes:
            run(kv, batch, length, device, rec)
            rec.save()  # row by row: a deadline keeps what was measured
    print(f"rows: {rec.save()}")


if __name__ == "__main__":
    main()
