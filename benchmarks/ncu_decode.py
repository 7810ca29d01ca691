"""A small decode workload for Nsight Compute: where does a batch-1 split kernel's time go?

Runs ``decode_attention`` (24q/4kv, head_dim 256, block 16, random pages) a few times at
one batch / context so ``ncu`` can profile one launch of the split kernel, e.g.::

    ncu -k regex:_decode_split_kernel -s 3 -c 1 --section SpeedOfLight --section Occupancy \
        --section WarpStateStats --section MemoryWorkloadAnalysis \
        python3 benchmarks/ncu_decode.py --bs 1 --context 32768 --kv int8

(the first calls compile and warm up; ``-s 3`` skips them). Prints nothing but the plan.
An eager call runs the one-launch barrier merge with the query quantized in the launch;
``--graph-kernels`` runs what a CUDA-graph replay runs instead: the query quantized first,
then the split kernel and the merge kernel (``fused_merge=False``, the planned ``pdl``).
"""

import dataclasses

import argparse

import torch

from int8attn import PagedKVCache, launches
from int8attn.ops import decode as dec
from int8attn.ops.producer import quantize_query


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bs", type=int, default=1)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--kv", default="int8", choices=("int8", "fp8", "bf16"))
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--graph-kernels", action="store_true", help="the split + merge kernels of a graph replay")
    args = ap.parse_args()
    hq, hkv, d, page = 24, 4, 256, 16
    pages = args.bs * args.context // page
    cache = PagedKVCache(pages + 8, page, hkv, d, kv_dtype=args.kv, device="cuda", key_smoothing="none")
    g = torch.Generator(device="cuda").manual_seed(0)
    for t in (cache.key, cache.value):
        if args.kv == "int8":
            t.copy_(torch.randint(-127, 128, t.shape, generator=g, device="cuda", dtype=torch.int16))
        else:
            t.copy_(torch.randn(t.shape, generator=g, device="cuda").to(t.dtype))
    if cache.quantized:
        for s in (cache.key_scale, cache.value_scale):
            s.copy_(torch.rand(s.shape, generator=g, device="cuda") * 0.02 + 0.005)
    perm = torch.randperm(pages + 8, generator=torch.Generator().manual_seed(1))[:pages]
    block_table = perm.view(args.bs, -1).to(torch.int32).cuda()
    seq_lens = torch.full((args.bs,), args.context, dtype=torch.int32, device="cuda")
    qsl = torch.arange(args.bs + 1, dtype=torch.int32, device="cuda")
    query = torch.randn(args.bs, hq, d, device="cuda").to(torch.bfloat16)
    ws = dec.DecodeWorkspace(args.bs, hq, d, device="cuda")
    plan = None
    if args.graph_kernels:
        base = dec.plan_decode(tuple(query.shape), cache, tuple(block_table.shape))
        plan = dec.plan_decode(tuple(query.shape), cache, tuple(block_table.shape),
                               config=dataclasses.replace(base.config, fused_merge=False))
        qq, qs = quantize_query(query, args.kv) if cache.quantized else (None, None)
    for _ in range(args.calls):
        if plan is None:
            dec.decode_attention(query, cache, block_table, seq_lens, qsl, workspace=ws)
        else:
            dec.run_decode(plan, query, cache, block_table, seq_lens, qsl, None, None, qq, qs, ws)
    torch.cuda.synchronize()
    split = launches.last("_decode_split_kernel")
    print("plan:", split.facts["plan"], "grid:", split.facts["grid"])


if __name__ == "__main__":
    main()
