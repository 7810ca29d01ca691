"""Producer kernels against their byte floor: write_kv, quantize_query, the fused
RoPE + K/V write + Q quantization, and the unfused sequence (torch RoPE + quantize_query +
write_kv), at 1, 64 and 4096 new tokens of the headline layer (24 q / 4 KV heads,
head_dim 256, rotary_dim 64 and 256), int8 and fp8 caches.

Floor = (bytes read + bytes written, each once) / measured copy bandwidth. Every timing
is recorded eagerly (CUDA events, L2 flushed between runs) and under CUDA-graph replay
(back to back, no flush: launch gaps gone, small shapes L2-resident).

Before timing, the kernels are checked on the GPU against the CPU reference (bit-exact
write_kv / quantize_query, producer within RoPE rounding). The compiled kernels' cubins
are saved (``--out``) for a SASS check (vectorized loads, no local memory).

    python benchmarks/bench_producer.py --out DIR     # on a GPU
    TRITON_INTERPRET=1 python benchmarks/bench_producer.py --dry-run   # CPU smoke test
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import sys
import tarfile
import time

import torch

from int8attn import bench, reference
from int8attn.cache import PagedKVCache
from int8attn.kernels import quantize as qk
from int8attn.ops.producer import apply_rope_torch, quantize_query, rope_quantize_and_write
from int8attn.ops.write import write_kv
from int8attn.testing import make_keys, make_normal

HQ, HKV, D, BLOCK = 24, 4, 256, 16


def log(*a):
    print(*a, flush=True)


def make_inputs(n, rot, kv_dtype, device, gen, max_pos=32768):
    qkv = make_normal((n, HQ + 2 * HKV, D), generator=gen)
    qkv[:, HQ:HQ + HKV] = make_keys(n, HKV, D, generator=gen)
    qkv = qkv.to(device)
    q, k, v = (t.contiguous() for t in (qkv[:, :HQ], qkv[:, HQ:HQ + HKV], qkv[:, HQ + HKV:]))
    num_blocks = -(-n // BLOCK) + 8
    cache = PagedKVCache(num_blocks, BLOCK, HKV, D, kv_dtype=kv_dtype, device=device, key_smoothing="none")
    cache.set_key_mean(torch.randn(HKV, D, generator=gen))  # calibrated smoothing: the default int8 path
    blocks = torch.randperm(num_blocks, generator=gen)[: -(-n // BLOCK)]
    pos = torch.arange(n)
    slots = (blocks[pos // BLOCK] * BLOCK + pos % BLOCK).to(device)
    positions = torch.randint(0, max_pos, (n,), generator=gen).to(device)
    cos_sin = reference.rope_cos_sin_cache(max_pos, rot).to(device)
    return q, k, v, positions, cos_sin, cache, slots


def floor_bytes(n, rot, kv_dtype):
    elem = 1  # int8 / fp8 storage
    kv_read = 2 * n * HKV * D * 2
    kv_write = 2 * n * HKV * (D * elem + 4)
    q_read = n * HQ * D * 2
    q_write = n * HQ * (D * elem + 4)
    meta = n * 8  # slot_mapping int64
    return {
        "write_kv": kv_read + kv_write + meta + HKV * D * 4,
        "quantize_query": q_read + q_write,
        "producer": q_read + q_write + kv_read + kv_write + 2 * meta + n * rot * 4 + HKV * D * 4,
        # the unfused chain moves RoPE'd bf16 Q/K through memory once more
        "unfused": None,
    }


def bits(t):
    return t.detach().cpu().contiguous().view(torch.uint8)


# --------------------------------------------------------------------------- correctness
def check_correctness(device, gen, n, results):
    ok = True
    for kv_dtype in ("int8", "fp8"):
        q, k, v, positions, cos_sin, cache, slots = make_inputs(n, 64, kv_dtype, device, gen)
        q[3, 5] = 0
        out, scale = quantize_query(q, kv_dtype)
        rq, rs = reference.quantize_rows(q.cpu(), kv_dtype)
        qq_exact = torch.equal(bits(out), bits(rq)) and torch.equal(bits(scale), bits(rs))
        # write_kv with a first-write mean computed on the GPU, reference given the same mean
        fresh = PagedKVCache(cache.num_blocks, BLOCK, HKV, D, kv_dtype=kv_dtype, device=device)
        fresh.key.view(torch.uint8).fill_(0x5A)
        ref_cache = PagedKVCache(cache.num_blocks, BLOCK, HKV, D, kv_dtype=kv_dtype, device="cpu",
                                 key_smoothing="none")
        ref_cache.key.view(torch.uint8).fill_(0x5A)
        slots_pad = slots.clone()
        slots_pad[::7] = -1
        write_kv(fresh, k, v, slots_pad)
        ref_cache.set_key_mean(fresh.key_mean.cpu())
        mean_err = (fresh.key_mean.cpu() - k[slots_pad >= 0].float().mean(0).cpu()).abs().max().item()
        reference.write_kv_reference(ref_cache, k.cpu(), v.cpu(), slots_pad.cpu())
        wkv_exact = all(torch.equal(bits(a), bits(b)) for a, b in (
            (fresh.key, ref_cache.key), (fresh.value, ref_cache.value),
            (fresh.key_scale, ref_cache.key_scale), (fresh.value_scale, ref_cache.value_scale)))
        # fused producer vs float64 RoPE + reference quantization
        out_q = torch.full(q.shape, 0x7F, dtype=torch.uint8, device=device).view(cache.storage_dtype)
        out_s = torch.full((n, HQ), float("nan"), device=device)
        rope_quantize_and_write(q, k, v, positions, cos_sin, cache, slots, out_q=out_q, out_q_scale=out_s)
        q_rope = reference.apply_rope_reference(q.cpu(), positions.cpu(), cos_sin.cpu())
        k_rope = reference.apply_rope_reference(k.cpu(), positions.cpu(), cos_sin.cpu())
        k_rope = k_rope - cache.key_mean.cpu().double()
        rq, rs = reference.quantize_rows(q_rope.float(), kv_dtype)
        blk, off = slots.cpu() // BLOCK, slots.cpu() % BLOCK
        rk, rks = reference.quantize_rows(k_rope.float(), kv_dtype)
        q_mis = (bits(out_q) != bits(rq)).float().mean().item()
        k_mis = (bits(cache.key.cpu()[blk, :, off]) != bits(rk)).float().mean().item()
        q_deq_err = reference.error_stats(reference.dequantize_rows(out_q.cpu(), out_s.cpu()), q_rope)
        scale_rel = ((out_s.cpu() - rs).abs() / rs).max().item()
        kscale_rel = ((cache.key_scale.cpu()[blk, :, off] - rks).abs() / rks).max().item()
        v_exact = torch.equal(bits(cache.value.cpu()[blk, :, off]), bits(reference.quantize_rows(v.cpu().float(),
                                                                                                   kv_dtype)[0]))
        good = (qq_exact and wkv_exact and v_exact and q_mis < 0.01 and k_mis < 0.01 and scale_rel < 1e-5
                and kscale_rel < 1e-5 and torch.isfinite(out_s).all().item())
        ok &= good
        row = dict(kind="correctness", kv_dtype=kv_dtype, num_tokens=n, quantize_query_bit_exact=qq_exact,
                   write_kv_bit_exact=wkv_exact, first_write_mean_max_abs_diff_vs_cpu=mean_err,
                   producer_q_code_mismatch=q_mis, producer_k_code_mismatch=k_mis, producer_v_bit_exact=v_exact,
                   producer_q_scale_max_rel=scale_rel, producer_k_scale_max_rel=kscale_rel,
                   producer_q_rel_l2_vs_f64=q_deq_err["rel_l2"], passed=bool(good))
        results.append(row)
        log("correctness", json.dumps(row))
    return ok


# --------------------------------------------------------------------------- timing
def timed(fn, graph: bool):
    if not torch.cuda.is_available():
        fn()
        return float("nan")
    return bench.time_graph(fn) if graph else bench.time_eager(fn, warmup_ms=10, rep_ms=60)


def bench_one(rec, name, fn, nbytes, bw, **row):
    eager = timed(fn, False)
    graph = timed(fn, True)
    floor_us = nbytes / bw * 1e6 if nbytes else float("nan")
    r = rec.add(kind="timing", op=name, eager_us=eager, graph_us=graph, bytes=nbytes, floor_us=floor_us,
                eager_over_floor=eager / floor_us if nbytes else None,
                graph_over_floor=graph / floor_us if nbytes else None,
                copy_bandwidth_TBps=bw / 1e12, **row)
    ratio_e = eager / floor_us if nbytes else float("nan")
    ratio_g = graph / floor_us if nbytes else float("nan")
    log(f"{name:16s} n={row.get('num_tokens'):5d} rot={row.get('rotary_dim'):3d} {row.get('kv_dtype'):4s} "
        f"eager {eager:8.2f} us  graph {graph:8.2f} us  floor {floor_us:8.2f} us  "
        f"x{ratio_e:5.2f} / x{ratio_g:5.2f}  {row.get('config', '')}")
    return r


def run_timings(rec, device, gen, sizes, rots, dtypes, sweep):
    bw = bench.copy_bandwidth() if torch.cuda.is_available() else 1e12
    log(f"copy bandwidth {bw / 1e12:.3f} TB/s")
    if sweep:  # what the host-side value checks (one sync per call) cost an eager decode step
        q, k, v, positions, cos_sin, cache, slots = make_inputs(1, rots[0], dtypes[0], device, gen)
        os.environ["INT8ATTN_CHECK_VALUES"] = "1"
        bench_one(rec, "producer", lambda: rope_quantize_and_write(q, k, v, positions, cos_sin, cache, slots),
                  floor_bytes(1, rots[0], dtypes[0])["producer"], bw, config="default, value checks ON",
                  num_tokens=1, rotary_dim=rots[0], kv_dtype=dtypes[0], value_checks=True)
    # timed calls skip the value checks (host syncs); correctness ran with them on
    os.environ["INT8ATTN_CHECK_VALUES"] = "0"
    for kv_dtype in dtypes:
        for n in sizes:
            for rot in rots:
                q, k, v, positions, cos_sin, cache, slots = make_inputs(n, rot, kv_dtype, device, gen)
                fb = floor_bytes(n, rot, kv_dtype)
                common = dict(num_tokens=n, rotary_dim=rot, kv_dtype=kv_dtype, num_q_heads=HQ, num_kv_heads=HKV,
                              head_dim=D, block_size=BLOCK, value_checks=False)
                out_q = torch.empty(q.shape, dtype=cache.storage_dtype, device=device)
                out_s = torch.empty((n, HQ), device=device)
                if rot == rots[0]:  # rotary-independent ops once per size
                    bench_one(rec, "write_kv", lambda: write_kv(cache, k, v, slots), fb["write_kv"], bw, **common)
                    bench_one(rec, "quantize_query", lambda: quantize_query(q, kv_dtype, out=out_q, out_scale=out_s),
                              fb["quantize_query"], bw, **common)
                bench_one(rec, "producer", lambda: rope_quantize_and_write(
                    q, k, v, positions, cos_sin, cache, slots, out_q=out_q, out_q_scale=out_s),
                    fb["producer"], bw, config="default", **common)

                def unfused():
                    q_rope = apply_rope_torch(q, positions, cos_sin).to(torch.bfloat16)
                    k_rope = apply_rope_torch(k, positions, cos_sin).to(torch.bfloat16)
                    quantize_query(q_rope, kv_dtype, out=out_q, out_scale=out_s)
                    write_kv(cache, k_rope, v, slots)

                bench_one(rec, "unfused", unfused, fb["producer"], bw, **common)
                if sweep and n == max(sizes) and rot == rots[0] and kv_dtype == dtypes[0] and n > 64:
                    for cfg in ({"BLOCK_HQ": 8, "num_warps": 8}, {"BLOCK_HQ": 32, "num_warps": 8},
                                {"BLOCK_HQ": 4, "num_warps": 4}, {"BLOCK_HQ": 32, "num_warps": 16}):
                        bench_one(rec, "producer", lambda: rope_quantize_and_write(
                            q, k, v, positions, cos_sin, cache, slots, out_q=out_q, out_q_scale=out_s, _launch=cfg),
                            fb["producer"], bw, config=json.dumps(cfg, sort_keys=True), **common)


# --------------------------------------------------------------------------- SASS
def compiled_kernels():
    for fn in (qk._write_kv_kernel, qk._quantize_query_kernel, qk._rope_quantize_write_kernel):
        caches = getattr(fn, "device_caches", None) or {0: (getattr(fn, "cache", {}).get(0, {}),)}
        for entry in caches.values():
            cache = entry[0] if isinstance(entry, tuple) else entry
            for key, kern in list(cache.items()):
                if hasattr(kern, "asm"):
                    yield fn.__name__, kern


def dump_sass(out_dir, rec):
    buf = io.BytesIO()
    summary = []
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for i, (name, kern) in enumerate(compiled_kernels()):
            cubin = kern.asm.get("cubin") if hasattr(kern.asm, "get") else kern.asm["cubin"]
            info = tarfile.TarInfo(f"{name}_{i}.cubin")
            info.size = len(cubin)
            tar.addfile(info, io.BytesIO(cubin))
            counts = {}
            try:
                sass = kern.asm["sass"]
            except Exception as exc:  # no disassembler: the cubins travel back instead
                sass = ""
                counts["sass_error"] = repr(exc)[:200]
            for op in re.findall(r"\b((?:LDG|STG|LDL|STL)[A-Z0-9._]*)", sass):
                counts[op] = counts.get(op, 0) + 1
            meta = kern.metadata
            row = dict(kind="sass", kernel=name, index=i, n_regs=getattr(kern, "n_regs", None),
                       n_spills=getattr(kern, "n_spills", None), num_warps=getattr(meta, "num_warps", None),
                       constants=str(getattr(meta, "constants", ""))[:400], memory_ops=counts)
            summary.append(row)
            rec.add(**row)
            log("sass", json.dumps(row))
    if out_dir:
        with open(os.path.join(out_dir, "producer_cubins.tar"), "wb") as f:
            f.write(buf.getvalue())
    return summary


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="write results/cubins here instead of benchmarks/results")
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes, no timing (CPU interpreter)")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(0)
    path = os.path.join(args.out, "producer.jsonl") if args.out else None
    rec = bench.Recorder("producer", path=path)
    t0 = time.time()
    results = []
    ok = check_correctness(device, gen, 8 if args.dry_run else 4096, results)
    for r in results:
        rec.add(**r)
    log(f"correctness {'PASSED' if ok else 'FAILED'} ({time.time() - t0:.1f} s)")
    if args.dry_run:
        run_timings(rec, device, gen, [1, 3], [64, 256], ["int8", "fp8"], sweep=True)
    else:
        run_timings(rec, device, gen, [1, 64, 4096], [64, 256], ["int8", "fp8"], sweep=True)
        dump_sass(args.out, rec)
    saved = rec.save()
    log(f"saved {len(rec.rows)} rows to {saved} ({time.time() - t0:.1f} s)")
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
