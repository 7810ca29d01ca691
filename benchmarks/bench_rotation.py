"""GPU cost of the Q/K Hadamard rotation (``Int8PagedCache(qk_rotation="hadamard")``).

The rotation multiplies every new query and key row by a [D, D] orthonormal Hadamard matrix
before the producer rounds them (one ``x @ H`` per tensor and layer, in the model's dtype);
the attention kernels do not change. Timed at the gate's shape (24 q / 4 KV heads, head_dim
256, bf16), next to the attention it precedes, in the same run:

* decode, batch 1 / 16 / 64 at L 8192: rotating Q [bs, 24, 256] and K [bs, 4, 256] against a
  planned INT8 decode call (``AttentionPlan.run``, CUDA-graph replay);
* prefill, a 4096-token chunk: rotating Q [4096, 24, 256] and K [4096, 4, 256] against the
  chunk's INT8 prefill attention over no prefix (CUDA events).

Rows go to ``--out DIR/rotation.jsonl`` (default benchmarks/results/rotation.jsonl).

    PYTHONPATH=src python3 benchmarks/bench_rotation.py --out DIR
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from int8attn import bench, testing
from int8attn.emulation import hadamard
from int8attn.ops.attention import plan_attention

HQ, HKV, D = 24, 4, 256


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_rotation.py times GPU work: no CUDA device here", file=sys.stderr)
        return 2
    rec = bench.Recorder("rotation", Path(args.out) / "rotation.jsonl" if args.out else None)
    rot = hadamard(D).to(device="cuda", dtype=torch.bfloat16)
    for bs in (1, 16, 64):
        b = testing.make_paged_batch([8192] * bs, [1] * bs, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D,
                                     kv_dtype="int8", seed=bs, device="cuda")
        q = b.query.to(torch.bfloat16)
        k = torch.randn(bs, HKV, D, device="cuda", dtype=torch.bfloat16)
        plan = plan_attention(b.cache, b.block_table, b.seq_lens, b.query_start_loc, HQ)
        out = torch.empty_like(q)
        attn_us = bench.time_graph(lambda: plan.run(q, b.cache, b.block_table, b.seq_lens, b.query_start_loc,
                                                    None, out))
        rot_us = bench.time_graph(lambda: (q @ rot, k @ rot))
        row = rec.add(kind="decode", batch=bs, L=8192, attention_us=attn_us, rotation_us=rot_us,
                      ratio=rot_us / attn_us)
        print(f"decode bs{bs:3d} L8192: attention {attn_us:8.1f} us, rotation (Q + K) {rot_us:6.1f} us "
              f"= {100 * row['ratio']:.1f}%")
        del b
    n = 4096
    b = testing.make_paged_batch([n], [n], num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, kv_dtype="int8", seed=7,
                                 device="cuda")
    q = b.query.to(torch.bfloat16)
    k = torch.randn(n, HKV, D, device="cuda", dtype=torch.bfloat16)
    plan = plan_attention(b.cache, b.block_table, b.seq_lens, b.query_start_loc, HQ)
    out = torch.empty_like(q)
    attn_us = bench.time_eager(lambda: plan.run(q, b.cache, b.block_table, b.seq_lens, b.query_start_loc, None, out))
    rot_us = bench.time_eager(lambda: (q @ rot, k @ rot))
    row = rec.add(kind="prefill", chunk=n, prefix=0, attention_us=attn_us, rotation_us=rot_us,
                  ratio=rot_us / attn_us)
    print(f"prefill chunk {n}: attention {attn_us:8.1f} us, rotation (Q + K) {rot_us:6.1f} us "
          f"= {100 * row['ratio']:.1f}%")
    print(f"rows -> {rec.save()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
