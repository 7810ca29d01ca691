"""Time the fused producer of an older kernels/quantize.py side by side with the current one.

    git show 2925ac9:src/int8attn/kernels/quantize.py > /tmp/quantize_round2.py
    OUT=/tmp/run PYTHONPATH=src:benchmarks INT8ATTN_CHECK_VALUES=0 \
        python3 benchmarks/compare_producer_rounds.py /tmp/quantize_round2.py

Both kernels run through the current launcher; their outputs are compared byte for byte
before timing (CUDA-graph replay). Rows go to $OUT/producer.jsonl (tag "round3_quick").
"""

import importlib.util
import os
import sys

import torch

import bench_producer as B
import int8attn.ops.producer as P
from int8attn import bench


def main(old_path: str) -> None:
    spec = importlib.util.spec_from_file_location("old_quantize", old_path)
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    kernels = {"round2": old._rope_quantize_write_kernel, "round3": P._rope_quantize_write_kernel}
    rec = bench.Recorder("producer", path=os.environ["OUT"] + "/producer.jsonl")
    bw = bench.copy_bandwidth()

    def raw(t):
        return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32)

    for n in (4096, 1):
        for kv in ("int8", "fp8"):
            for rot in (64, 256):
                q, k, v, pos, cs, c, sl, oq, osc = B.cached_inputs(n, rot, kv, "cuda")
                outs = [oq, osc, c.key, c.value, c.key_scale, c.value_scale]

                def fn():
                    return P.rope_quantize_and_write(q, k, v, pos, cs, c, sl, out_q=oq, out_q_scale=osc)

                got = {}
                for name, kernel in kernels.items():
                    P._rope_quantize_write_kernel = kernel
                    for t in outs:
                        raw(t).fill_(0x7F)
                    fn()
                    got[name] = [raw(t).clone() for t in outs]
                same = all(map(torch.equal, got["round2"], got["round3"]))
                floor_us = B.floor_bytes(n, rot)["producer"] / bw * 1e6
                for name, kernel in kernels.items():
                    P._rope_quantize_write_kernel = kernel
                    g = bench.time_graph(fn, replays=30, repeats=9)
                    rec.add(kind="timing", op="producer", impl=name, tag="round3_quick", round=3, num_tokens=n,
                            rotary_dim=rot, kv_dtype=kv, graph_us=g, floor_us=floor_us, graph_over_floor=g / floor_us,
                            copy_bandwidth_TBps=bw / 1e12, bit_exact_vs_round2=same, num_q_heads=B.HQ,
                            num_kv_heads=B.HKV, head_dim=B.D, block_size=B.BLOCK)
                    print(name, n, kv, rot, f"graph {g:.2f} us floor {floor_us:.2f} x{g / floor_us:.2f} same_bytes={same}")
                P._rope_quantize_write_kernel = kernels["round3"]
    print("saved", rec.save())


if __name__ == "__main__":
    main(sys.argv[1])
