"""Does key smoothing pay? Attention error vs float64 with and without it (CPU, float64).

For INT8 and FP8 caches, on keys with outlier channels (``make_keys``: 4 channels per
head with a consistent 10-30x offset, as real post-RoPE keys show) and on plain Gaussian
keys, the cache is filled exactly as ``write_kv`` fills it (``reference.write_kv_reference``
is bit-identical to the kernel, see tests/test_write.py) with key smoothing

* "none"              -- no offset;
* "first_write/1"     -- mean taken from a first write of 1 token (a decode-first cache);
* "first_write/16"    -- from a first write of 16 tokens;
* "first_write/all"   -- from a first write of the whole prefix (prefill).

The attention output of the headline layer (24 q / 4 KV heads, head_dim 256) for 16
query tokens at the end of the context is compared with exact float64 attention over the
unquantized keys/values, both with the query as given (cache error only) and with the
query quantized as the kernels quantize it (the whole low-precision path).

    python benchmarks/accuracy_key_smoothing.py [--seeds 3] [--context 1024 4096]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from int8attn import bench, reference
from int8attn.cache import PagedKVCache
from int8attn.testing import make_keys, make_normal

HQ, HKV, D, BLOCK, QLEN = 24, 4, 256, 16, 16


def run_case(kv_dtype, outliers, context, smoothing, seed):
    gen = torch.Generator().manual_seed(seed)
    key = make_keys(context, HKV, D, outliers=outliers, generator=gen)
    value = make_normal((context, HKV, D), generator=gen)
    query = make_normal((QLEN, HQ, D), generator=gen)
    num_blocks = -(-context // BLOCK)
    mode, _, first = smoothing.partition("/")
    cache = PagedKVCache(num_blocks, BLOCK, HKV, D, kv_dtype=kv_dtype, device="cpu", key_smoothing=mode)
    perm = torch.randperm(num_blocks, generator=gen)
    pos = torch.arange(context)
    slots = perm[pos // BLOCK] * BLOCK + pos % BLOCK
    n_first = {"": context, "all": context, "1": 1, "16": 16}[first]
    reference.write_kv_reference(cache, key[:n_first], value[:n_first], slots[:n_first])
    if n_first < context:
        reference.write_kv_reference(cache, key[n_first:], value[n_first:], slots[n_first:])
    table = perm.to(torch.int32)[None]
    lens = torch.tensor([context], dtype=torch.int32)
    qsl = torch.tensor([0, QLEN], dtype=torch.int32)
    exact = reference.attend(query, key, value, context - QLEN, D ** -0.5)
    out = reference.attention_reference(query, cache, table, lens, qsl)
    out_q = reference.attention_reference_quantized(query, cache, table, lens, qsl)
    return reference.error_stats(out, exact)["rel_l2"], reference.error_stats(out_q, exact)["rel_l2"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--context", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rec = bench.Recorder("accuracy_key_smoothing", path=args.out)
    lines = ["| kv | keys | context | smoothing | rel-L2 (cache only) | rel-L2 (query quantized too) |",
             "|---|---|---|---|---|---|"]
    for kv_dtype in ("int8", "fp8"):
        for outliers in (True, False):
            for context in args.context:
                for smoothing in ("none", "first_write/1", "first_write/16", "first_write/all"):
                    errs = [run_case(kv_dtype, outliers, context, smoothing, s) for s in range(args.seeds)]
                    cache_only = statistics.mean(e[0] for e in errs)
                    full = statistics.mean(e[1] for e in errs)
                    keys = "outlier" if outliers else "gaussian"
                    rec.add(kind="accuracy", kv_dtype=kv_dtype, keys=keys, context=context, smoothing=smoothing,
                            seeds=args.seeds, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, q_len=QLEN,
                            rel_l2_cache_only=cache_only, rel_l2_query_quantized=full,
                            rel_l2_cache_only_per_seed=[e[0] for e in errs],
                            rel_l2_query_quantized_per_seed=[e[1] for e in errs])
                    line = f"| {kv_dtype} | {keys} | {context} | {smoothing} | {cache_only:.4f} | {full:.4f} |"
                    lines.append(line)
                    print(line, flush=True)
    print(f"saved to {rec.save()}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
