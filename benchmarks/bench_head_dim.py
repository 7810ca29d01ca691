"""What a head_dim that is not a power of two costs: D=96 (tiles padded to 128, masks on the
head_dim axis) against D=128 on the same shapes, same run, per cache dtype, in prefill and
in decode.

32 query / 8 KV heads, pages of 16, the library's default config for each (cache dtype,
head_dim). Prefill: one sequence, a 4096-token chunk over a 8192-token prefix; median time
(CUDA events, L2 flushed), TFLOP/s counting the real head_dim's unmasked work
``4 * D * Hq * (q_len * prefix + q_len * (q_len + 1) / 2)``, accuracy of the last 32 query
rows against float64 attention over the dequantized cache. Decode: 16 sequences of 8192
tokens, one query token each, under a CUDA graph; GB/s counting the real head_dim's K/V
bytes and scales, accuracy of every row against float64 attention of the unquantized
inputs. Each row carries its time ratio to D=128 of the same cache dtype and op; outputs
are NaN-poisoned first and every element must be written.

Usage (H200, about a minute, most of it compilation)::

    PYTHONPATH=src python3 benchmarks/bench_head_dim.py --out $OUT

Rows go to ``$OUT/head_dim.jsonl`` (copy to ``benchmarks/results/``); a table is printed.
``--dims 80,96,112,128,160,192,256`` widens the comparison (each D compiles its own kernel).
"""

from __future__ import annotations

import argparse
import os

import torch

if not torch.cuda.is_available():  # one tiny case in Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

from int8attn import bench, reference, testing  # noqa: E402
from int8attn.ops.decode import DecodeWorkspace, decode_attention  # noqa: E402
from int8attn.ops.prefill import prefill_attention  # noqa: E402

HQ, HKV, CHUNK, PREFIX, BLOCK = 32, 8, 4096, 8192, 16
DECODE_BATCH, DECODE_LEN = 16, 8192


def run_case(kv: str, d: int, rec: bench.Recorder, device: str, chunk: int, prefix: int) -> dict:
    b = testing.make_paged_batch([prefix + chunk], [chunk], num_q_heads=HQ, num_kv_heads=HKV, head_dim=d,
                                 block_size=BLOCK, kv_dtype=kv, seed=d, device=device, extra_blocks=0)
    out = torch.full(b.query.shape, float("nan"), dtype=torch.bfloat16, device=device)
    args = (b.query, b.cache, b.block_table, b.seq_lens, b.query_start_loc)
    prefill_attention(*args, out=out)
    written = bool(torch.isfinite(out.float()).all())
    rows = 32
    k, v = reference.gather_kv(b.cache, b.block_table[0].cpu(), prefix + chunk)
    want = reference.attend(b.query[-rows:].cpu(), k.cpu(), v.cpu(), prefix + chunk - rows, d ** -0.5)
    err = reference.error_stats(out[-rows:].cpu(), want)["rel_l2"]
    us = bench.time_eager(lambda: prefill_attention(*args, out=out)) if device == "cuda" else float("nan")
    flops = 4 * d * HQ * (chunk * prefix + chunk * (chunk + 1) / 2)
    row = rec.add(op="prefill_head_dim", kv_dtype=kv, head_dim=d, num_q_heads=HQ, num_kv_heads=HKV,
                  q_len=chunk, prefix=prefix, block_size=BLOCK, us=us, tflops=flops / (us * 1e-6) / 1e12,
                  rel_l2_last_rows=err, all_written=written)
    print(f"{kv:5s} D={d:3d}  {us:9.1f} us  {row['tflops']:6.1f} TFLOP/s  rel-L2 {err:.4f}  "
          f"written {written}", flush=True)
    return row


def run_decode_case(kv: str, d: int, rec: bench.Recorder, device: str, batch: int, length: int) -> dict:
    b = testing.make_paged_batch([length] * batch, [1] * batch, num_q_heads=HQ, num_kv_heads=HKV, head_dim=d,
                                 block_size=BLOCK, kv_dtype=kv, seed=d + 1, device=device, extra_blocks=0)
    out = torch.full(b.query.shape, float("nan"), dtype=torch.bfloat16, device=device)
    args = (b.query, b.cache, b.block_table, b.seq_lens, b.query_start_loc)
    ws = DecodeWorkspace(b.query.shape[0], HQ, d, device=device)
    decode_attention(*args, out=out, workspace=ws)
    written = bool(torch.isfinite(out.float()).all())
    err = reference.error_stats(out.cpu(), reference.attention_reference(*args).cpu())["rel_l2"]
    us = bench.time_graph(lambda: decode_attention(*args, out=out, workspace=ws)) if device == "cuda" \
        else float("nan")
    elem = b.cache.key.element_size()
    scale_bytes = 8 if b.cache.quantized else 0  # fp32 K and V scales per (token, KV head)
    nbytes = batch * length * HKV * (2 * d * elem + scale_bytes)
    row = rec.add(op="decode_head_dim", kv_dtype=kv, head_dim=d, num_q_heads=HQ, num_kv_heads=HKV, batch=batch,
                  seq_len=length, block_size=BLOCK, us=us, gbps=nbytes / (us * 1e-6) / 1e9, rel_l2=err,
                  all_written=written, graph=True)
    print(f"{kv:5s} D={d:3d}  decode {us:9.1f} us  {row['gbps']:7.1f} GB/s  rel-L2 {err:.4f}  written {written}",
          flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--dims", default="96,128")
    ap.add_argument("--kv", default="int8,fp8,bf16")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    chunk, prefix = (CHUNK, PREFIX) if device == "cuda" else (64, 64)  # CPU: a smoke run
    rec = bench.Recorder("head_dim", path=os.path.join(args.out, "head_dim.jsonl"))
    dims = [int(x) for x in args.dims.split(",")]
    batch, length = (DECODE_BATCH, DECODE_LEN) if device == "cuda" else (2, 70)
    for kv in args.kv.split(","):
        for case in (lambda d: run_case(kv, d, rec, device, chunk, prefix),
                     lambda d: run_decode_case(kv, d, rec, device, batch, length)):
            rows = {d: case(d) for d in dims}
            base = rows.get(128)
            for d, row in rows.items():
                if base is not None:
                    row["time_vs_d128"] = row["us"] / base["us"]
                    row["time_per_channel_vs_d128"] = (row["us"] / d) / (base["us"] / 128)
    path = rec.save()
    print(f"\n{'op':16s} {'kv':5s} {'D':>4s} {'us':>9s} {'x D128':>7s} {'per-channel x D128':>19s}")
    for row in rec.rows:
        print(f"{row['op']:16s} {row['kv_dtype']:5s} {row['head_dim']:4d} {row['us']:9.1f} "
              f"{row.get('time_vs_d128', float('nan')):7.3f} {row.get('time_per_channel_vs_d128', float('nan')):19.3f}")
    print(f"rows: {path}")


if __name__ == "__main__":
    main()
