"""The Hopper (Gluon) prefill kernel against the portable Triton kernel and BF16 peers, on
one H200 run: a 4096-token causal chunk over prefix 0 and 28672, 24q/4kv D256 and
32q/8kv D128, block size 16.

Per case: the Hopper kernel per (cache dtype, PV precision) with the query codes passed in
(the producer quantizes Q once; its own time is a separate row), the portable kernel's
default on the same cache, FlashAttention-4 BF16 dense (``flash_attn.cute``, when
importable) and PyTorch SDPA BF16 on contiguous K/V (lower-right causal mask; the backend
PyTorch picks). Every output is checked against the portable kernel (rel-L2) before it is
timed. TOP/s count unmasked work only: ``4 * D * Hq * (q * prefix + q * (q + 1) / 2)``.
Then the 8-bit floor: a plain pipelined Gluon wgmma s8 GEMM (TMA ring, 8192^3).

Every section is guarded (an error is printed and recorded, the run goes on). Rows go to
``benchmarks/results/prefill_hopper.jsonl`` (or ``--out DIR/prefill_hopper.jsonl``).
Timings are medians (CUDA events, L2 flushed); nothing is asserted.

Usage: ``PYTHONPATH=src python benchmarks/bench_prefill_hopper.py [--out DIR] [--quick]``
"""

from __future__ import annotations

import argparse
import os
import traceback

import torch

from int8attn import bench, reference, testing
from int8attn.ops import prefill_hopper as hop
from int8attn.ops.prefill import prefill_attention
from int8attn.ops.producer import quantize_query

SHAPES = {"24q4kv_d256": (24, 4, 256), "32q8kv_d128": (32, 8, 128)}
PREFIXES = (28672, 0)
CHUNK = 4096
ROUTES = (("int8", "int8"), ("int8", "bf16"), ("fp8", "fp8"), ("fp8", "bf16"))


def unmasked_ops(hq: int, d: int, q: int, prefix: int) -> float:
    return 4.0 * d * hq * (q * prefix + q * (q + 1) / 2)


def _rel_l2(a, b) -> float:
    return reference.error_stats(a, b)["rel_l2"]


def _record(rec, **row):
    print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    rec.add(**row)


def bench_case(rec, shape, prefix, kv_dtype, pvs):
    hq, hkv, d = SHAPES[shape]
    b = testing.make_paged_batch([prefix + CHUNK], [CHUNK], num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                                 kv_dtype=kv_dtype, seed=7, device="cuda")
    args = (b.query, b.cache, b.block_table, b.seq_lens, b.query_start_loc)
    ops = unmasked_ops(hq, d, CHUNK, prefix)
    base = dict(bench="prefill_hopper", shape=shape, prefix=prefix, chunk=CHUNK, kv_dtype=kv_dtype, block_size=16)
    qq, qs = quantize_query(b.query, kv_dtype)
    us = bench.time_eager(lambda: quantize_query(b.query, kv_dtype))
    _record(rec, **base, kernel="quantize_query", us=us)
    for pv in pvs:
        try:
            portable = prefill_attention(*args, pv_mode=pv)
            us_p = bench.time_eager(lambda: prefill_attention(*args, pv_mode=pv))
            _record(rec, **base, pv_mode=pv, kernel="portable", us=us_p, tops=ops / us_p * 1e-6)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            _record(rec, **base, pv_mode=pv, kernel="portable", error=repr(e)[:400])
            continue
        try:
            out = testing.poisoned_like(portable)
            hop.prefill(*args, kernel="hopper", pv_mode=pv, q_quant=qq, q_scale=qs, out=out)
            err = _rel_l2(out, portable)
            us_h = bench.time_eager(lambda: hop.prefill(*args, kernel="hopper", pv_mode=pv, q_quant=qq,
                                                        q_scale=qs, out=out))
            _record(rec, **base, pv_mode=pv, kernel="hopper", us=us_h, tops=ops / us_h * 1e-6,
                    rel_l2_vs_portable=err, speedup_vs_portable=us_p / us_h,
                    config=str(hop.default_config(kv_dtype, d, pv)))
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            _record(rec, **base, pv_mode=pv, kernel="hopper", error=repr(e)[:400])
    return b


def bench_bf16_peers(rec, shape, prefix):
    hq, hkv, d = SHAPES[shape]
    kv_len = prefix + CHUNK
    g = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(1, CHUNK, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, kv_len, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(1, kv_len, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    ops = unmasked_ops(hq, d, CHUNK, prefix)
    base = dict(bench="prefill_hopper", shape=shape, prefix=prefix, chunk=CHUNK, kv_dtype="bf16 dense")
    # SDPA on [B, H, L, D], K/V expanded to the query heads, lower-right causal mask
    from torch.nn.attention.bias import causal_lower_right
    qt = q.transpose(1, 2)
    kt = k.transpose(1, 2).repeat_interleave(hq // hkv, 1)
    vt = v.transpose(1, 2).repeat_interleave(hq // hkv, 1)
    mask = causal_lower_right(CHUNK, kv_len)
    sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask)  # noqa: E731
    try:
        ref = sdpa()
        us = bench.time_eager(sdpa)
        _record(rec, **base, kernel="sdpa_bf16", us=us, tops=ops / us * 1e-6)
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        _record(rec, **base, kernel="sdpa_bf16", error=repr(e)[:400])
        ref = None
    try:
        from flash_attn.cute import flash_attn_func  # FlashAttention-4 (CuTe DSL)
    except Exception as e:  # noqa: BLE001
        _record(rec, **base, kernel="fa4_bf16", error=f"not importable: {e!r}"[:300])
        return
    try:
        fa = lambda: flash_attn_func(q, k, v, causal=True)  # noqa: E731 - bottom-right aligned causal
        out = fa()
        out = out[0] if isinstance(out, tuple) else out
        err = _rel_l2(out.transpose(1, 2), ref) if ref is not None else None
        us = bench.time_eager(fa)
        _record(rec, **base, kernel="fa4_bf16", us=us, tops=ops / us * 1e-6, rel_l2_vs_sdpa=err)
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        _record(rec, **base, kernel="fa4_bf16", error=repr(e)[:400])


def bench_gemm_floor(rec, size: int = 8192):
    from gemm_floor_hopper import gemm_s8

    a = torch.randint(-127, 128, (size, size), dtype=torch.int8, device="cuda")
    b = torch.randint(-127, 128, (size, size), dtype=torch.int8, device="cuda")
    c = gemm_s8(a, b)
    want = a[:256].double() @ b[:256].double().T  # exact in float64 (|sum| < 2**53)
    exact = bool(torch.equal(c[:256, :256].double(), want))
    us = bench.time_eager(lambda: gemm_s8(a, b, out=c))
    _record(rec, bench="prefill_hopper", kernel="gluon_wgmma_s8_gemm", m=size, n=size, k=size, us=us,
            tops=2.0 * size ** 3 / us * 1e-6, exact_first_tile=exact)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="directory of prefill_hopper.jsonl (default benchmarks/results)")
    ap.add_argument("--quick", action="store_true", help="prefix 28672 only, no fp8 cache")
    opts = ap.parse_args()
    path = os.path.join(opts.out, "prefill_hopper.jsonl") if opts.out else None
    rec = bench.Recorder("prefill_hopper", path)
    import sys
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    try:
        bench_gemm_floor(rec)
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        _record(rec, bench="prefill_hopper", kernel="gluon_wgmma_s8_gemm", error=repr(e)[:400])
    for shape in SHAPES:
        for prefix in (PREFIXES[:1] if opts.quick else PREFIXES):
            for kv in (("int8",) if opts.quick else ("int8", "fp8")):
                try:
                    bench_case(rec, shape, prefix, kv, [pv for k, pv in ROUTES if k == kv])
                except Exception as e:  # noqa: BLE001
                    traceback.print_exc()
                    _record(rec, bench="prefill_hopper", shape=shape, prefix=prefix, kv_dtype=kv, error=repr(e)[:400])
                torch.cuda.empty_cache()
            bench_bf16_peers(rec, shape, prefix)
            torch.cuda.empty_cache()
    print("rows ->", rec.save())


if __name__ == "__main__":
    main()
