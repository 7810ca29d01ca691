"""The read-only floor of a decode call: how fast the GPU streams N bytes, per call.

Decode reads its K/V bytes once and writes almost nothing, so its floor is a read-only
stream of the same byte count, launched and timed the way the decode benchmark times a
call (CUDA-graph replay of back-to-back calls over rotating buffers, so nothing stays in
L2). At the smaller sizes a fixed per-call cost (launch, ramp-up of the memory system,
the tail of the last programs) weighs on any kernel; this script measures it, next to
the device-to-device copy figure the decode percentages are quoted against.

A Triton kernel XOR-reduces int32 words: ``programs`` programs each stream a contiguous
chunk with 16-byte loads and write one word per lane; several grid sizes are tried and the
fastest kept. Rows go to
``--out DIR/read_floor.jsonl`` (else benchmarks/results/read_floor.jsonl).

    PYTHONPATH=src python3 benchmarks/bench_read_floor.py --out $OUT
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch
import triton
import triton.language as tl

from int8attn import bench

#: (batch, context) of the decode shapes of docs/design.md §4 (24q/4kv, D256) and the K+V
#: bytes each token adds over the 4 KV heads (the 8-bit caches: codes + fp32 scales)
SHAPES = [(1, 32768), (16, 8192), (16, 16384), (16, 32768), (64, 8192)]
BYTES_PER_TOKEN = {"int8": 4 * 2 * (256 + 4), "bf16": 4 * 2 * 256 * 2}
BLOCK = 2048   # int32 words per iteration and program: 8 KB, two 16-byte loads per thread at 8 warps


@triton.jit
def _read_kernel(x_ptr, out_ptr, words_per_program, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    base = x_ptr + pid.to(tl.int64) * words_per_program
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, words_per_program, BLOCK):
        acc ^= tl.load(base + start + offs)
    tl.store(out_ptr + pid * BLOCK + offs, acc)


def read_time(nbytes: int, programs: int, rotations: int = 4) -> tuple[float, int]:
    """(µs per call, bytes actually read) for ``nbytes`` rounded up to whole blocks."""
    words = -(-nbytes // 4)
    per = -(-words // (programs * BLOCK)) * BLOCK
    bufs = [torch.randint(-2**31, 2**31 - 1, (programs * per,), dtype=torch.int32, device="cuda")
            for _ in range(rotations)]
    out = torch.empty(programs * BLOCK, dtype=torch.int32, device="cuda")
    cycle = itertools.cycle(bufs)

    def call():
        _read_kernel[(programs,)](next(cycle), out, per, BLOCK=BLOCK, num_warps=8, num_stages=4)

    call()
    torch.cuda.synchronize()
    us = bench.time_graph(call, replays=30, repeats=9)
    del bufs
    return us, programs * per * 4


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    rec = bench.Recorder("read_floor", path=os.path.join(args.out, "read_floor.jsonl") if args.out else None)
    copy_bw = bench.copy_bandwidth()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{rec.env['gpu']} copy {copy_bw / 1e12:.3f} TB/s, {sms} SMs")
    rec.add(kind="copy_bandwidth", bytes_per_s=copy_bw)
    for kv, per_token in BYTES_PER_TOKEN.items():
        for bs, ctx in SHAPES:
            nbytes = bs * ctx * per_token
            best = None
            for mult in (1, 2, 4, 8):
                us, real = read_time(nbytes, sms * mult)
                if best is None or us < best[0]:
                    best = (us, real, sms * mult)
            us, real, programs = best
            pct = 100 * real / (us * 1e-6) / copy_bw
            rec.add(kind="read_floor", kv_dtype=kv, bs=bs, context=ctx, bytes=real, programs=programs, graph_us=us,
                    pct_copy=pct)
            print(f"{kv:5s} bs{bs:3d} L{ctx:6d} {real / 1e6:8.1f} MB  {us:8.1f} us  {pct:6.1f}% of copy  "
                  f"({programs} programs)")
    rec.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
