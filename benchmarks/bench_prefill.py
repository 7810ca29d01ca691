"""Chunked prefill on the GPU: a 4096-token chunk over a cached prefix of 0 / 8192 / 28672
tokens (DESIGN.md section 4), INT8 / FP8 / BF16 caches through the same kernel, against
PyTorch SDPA BF16 on contiguous K/V, in one run.

For each shape (24q/4kv/D256 and 32q/8kv/D128, block_size 16) and prefix:

* accuracy of every kernel variant on sampled query rows (4 blocks of 32 tokens spread
  over the chunk, last token included) against float64 attention over the *raw* bf16 K/V
  (end to end: quantization included), over the dequantized cache
  (:func:`int8attn.reference.attention_reference`) and with the query quantized too
  (:func:`~int8attn.reference.attention_reference_quantized`); keys carry outlier channels;
* the matrix instructions in each compiled kernel's SASS (IGMMA / QGMMA / HGMMA), its
  registers and spills;
* median time (CUDA events, L2 flushed) and effective TFLOP/s counting only unmasked work:
  ``4 * D * Hq * (q_len * prefix + q_len * (q_len + 1) / 2)``;
* SDPA BF16 on the same tokens with contiguous K/V expanded to all query heads: every
  backend that runs the exact bottom-right causal problem (FlashAttention / efficient
  through ``causal_lower_right``; cuDNN on prefix 0 with ``is_causal``; cuDNN split into a
  non-causal prefix part and a causal chunk part merged by log-sum-exp), each checked
  against the float64 rows; the ratio uses the fastest correct one;
* query quantization alone (``quantize_query`` on 4096 x 24 x 256), and the fused
  producer for 4096 tokens; a mixed decode + prefill batch through ``attention()`` with a
  plan, eager and replayed from a CUDA graph.

Kernel variants are compiled in parallel worker processes first (Triton's on-disk cache),
then everything runs in the main process. Rows go to ``<out>/prefill.jsonl`` (copy them to
``benchmarks/results/``); ``--smoke`` runs a tiny version on the CPU interpreter (timings
meaningless).

Usage: ``PYTHONPATH=src python benchmarks/bench_prefill.py --out DIR [--smoke]``
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import time
import traceback

import torch

SHAPES = {"24q4kv_d256": (24, 4, 256), "32q8kv_d128": (32, 8, 128)}
PREFIXES = (28672, 8192, 0)
CHUNK = 4096
BLOCK_SIZE = 16
SEED = 7


# --------------------------------------------------------------------------- variants
def variants(head_dim: int) -> list[dict]:
    """Kernel variants to compile and time: name, kv_dtype, pv_mode, config, prequant."""
    v = []

    def add(name, kv, pv, prequant=False, **cfg):
        v.append({"name": name, "kv": kv, "pv": pv, "cfg": cfg, "prequant": prequant})

    if head_dim == 256:
        add("int8_n64_dv64", "int8", "int8", block_m=128, block_n=64, dv=64)
        add("int8_n128_dv64", "int8", "int8", block_m=128, block_n=128, dv=64)
        add("int8_n128_dv128", "int8", "int8", block_m=128, block_n=128, dv=128)
        add("int8_m64_n64_dv256", "int8", "int8", block_m=64, block_n=64, dv=256)
        add("int8_n128_dv64_s3", "int8", "int8", block_m=128, block_n=128, dv=64, num_stages=3)
        add("int8_n64_dv64_shift", "int8", "int8", block_m=128, block_n=64, dv=64, p_shift=True)
        add("int8_n64_dv64_preq", "int8", "int8", prequant=True, block_m=128, block_n=64, dv=64)
        add("int8_pvf16_n64_dv128", "int8", "bf16", block_m=128, block_n=64, dv=128)
        add("int8_pvf16_n64_dv256", "int8", "bf16", block_m=128, block_n=64, dv=256)
        add("fp8_n64_dv64", "fp8", "fp8", block_m=128, block_n=64, dv=64)
        add("fp8_n128_dv64", "fp8", "fp8", block_m=128, block_n=128, dv=64)
        add("fp8_pvf16_n64_dv128", "fp8", "bf16", block_m=128, block_n=64, dv=128)
        add("bf16_n64_dv256", "bf16", "bf16", block_m=128, block_n=64, dv=256)
        add("bf16_n64_dv256_s3", "bf16", "bf16", block_m=128, block_n=64, dv=256, num_stages=3)
    else:
        add("int8_n64_dv128", "int8", "int8", block_m=128, block_n=64, dv=128)
        add("int8_n128_dv128", "int8", "int8", block_m=128, block_n=128, dv=128)
        add("int8_n128_dv64", "int8", "int8", block_m=128, block_n=128, dv=64)
        add("int8_pvf16_n64_dv128", "int8", "bf16", block_m=128, block_n=64, dv=128)
        add("int8_pvf16_n128_dv128", "int8", "bf16", block_m=128, block_n=128, dv=128)
        add("fp8_n64_dv128", "fp8", "fp8", block_m=128, block_n=64, dv=128)
        add("fp8_n128_dv128", "fp8", "fp8", block_m=128, block_n=128, dv=128)
        add("bf16_n64_dv128", "bf16", "bf16", block_m=128, block_n=64, dv=128)
        add("bf16_n128_dv128", "bf16", "bf16", block_m=128, block_n=128, dv=128)
    return v


def smoke_variants(head_dim: int) -> list[dict]:
    return [
        {"name": "int8_small", "kv": "int8", "pv": "int8", "cfg": {"block_m": 32, "block_n": 16}, "prequant": False},
        {"name": "int8_small_preq", "kv": "int8", "pv": "int8", "cfg": {"block_m": 32, "block_n": 16},
         "prequant": True},
        {"name": "fp8_small", "kv": "fp8", "pv": "fp8", "cfg": {"block_m": 32, "block_n": 16}, "prequant": False},
        {"name": "bf16_small", "kv": "bf16", "pv": "bf16", "cfg": {"block_m": 32, "block_n": 16},
         "prequant": False},
    ]


# --------------------------------------------------------------------------- data
def unmasked_flops(num_q_heads: int, head_dim: int, q_len: int, prefix: int) -> float:
    return 4.0 * head_dim * num_q_heads * (q_len * prefix + q_len * (q_len + 1) / 2)


def build_batch(shape, prefix, chunk, kv, device, block_size=BLOCK_SIZE):
    from int8attn import testing

    hq, hkv, d = shape
    return testing.make_paged_batch([prefix + chunk], [chunk], num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                                    block_size=block_size, kv_dtype=kv, seed=SEED, device=device)


def with_cache(raw, kv):
    """The same tokens (keys, values, pages, query) stored in a cache of dtype ``kv``."""
    import dataclasses

    from int8attn import reference
    from int8attn.cache import PagedKVCache

    c = raw.cache
    cache = PagedKVCache(c.num_blocks, c.block_size, c.num_kv_heads, c.head_dim, kv_dtype=kv, device=c.device)
    reference.write_kv_reference(cache, raw.key, raw.value, raw.slot_mapping)
    return dataclasses.replace(raw, cache=cache)


def run_variant(batch, var, out=None):
    from int8attn.ops.prefill import PrefillConfig, prefill_attention
    from int8attn.ops.producer import quantize_query

    cfg = PrefillConfig(**{"num_warps": 8 if var["cfg"].get("block_m", 128) >= 64 else 4, **var["cfg"]})
    kw = {}
    if var["prequant"] and batch.cache.quantized:
        kw["q_quant"], kw["q_scale"] = quantize_query(batch.query, batch.cache.kv_dtype)
    return lambda: prefill_attention(batch.query, batch.cache, batch.block_table, batch.seq_lens,
                                     batch.query_start_loc, out=out, pv_mode=var["pv"], config=cfg, **kw)


def _warm_worker(job):
    """Compile one variant in a worker process (fills Triton's on-disk cache)."""
    shape, chunk, var = job
    t = time.time()
    if var == "mixed":
        try:
            mixed_batch_check(lambda *a: None, False, None, warm_only=True)
            return "mixed batch kernels", round(time.time() - t, 1), None
        except Exception as e:
            return "mixed batch kernels", round(time.time() - t, 1), repr(e)[:300]
    try:
        batch = build_batch(shape, 0, chunk, var["kv"], "cuda")
        run_variant(batch, var)()
        torch.cuda.synchronize()
        return var["name"], round(time.time() - t, 1), None
    except Exception as e:  # reported, the main process retries and records the failure
        return var["name"], round(time.time() - t, 1), repr(e)[:300]


def sample_rows(chunk: int) -> list[tuple[int, int]]:
    """(start, end) token blocks of the chunk checked against float64."""
    n = min(32, chunk)
    starts = sorted({0, chunk // 3, (2 * chunk) // 3, chunk - n})
    return [(s, min(s + n, chunk)) for s in starts]


def reference_rows(query, k, v, prefix, rows, scale, query_kv_dtype=None):
    """float64 attention of the sampled query rows; k, v [L, Hkv, D] (float64 or raw)."""
    from int8attn import reference

    q = query
    if query_kv_dtype is not None:
        qq, qs = reference.quantize_rows(query, query_kv_dtype)
        q = reference.dequantize_rows(qq, qs)
    outs = []
    for s, e in rows:
        end = prefix + e
        outs.append(reference.attend(q[s:e], k[:end], v[:end], prefix + s, scale))
    return torch.cat(outs)


def take_rows(out, rows):
    return torch.cat([out[s:e] for s, e in rows])


# --------------------------------------------------------------------------- SASS
def sass_summary(kernel) -> dict:
    """MMA instruction kinds, registers and spills of a compiled Triton kernel."""
    info = {"n_regs": getattr(kernel, "n_regs", None), "n_spills": getattr(kernel, "n_spills", None)}
    try:
        cubin = kernel.asm["cubin"]
        tool = shutil.which("cuobjdump")
        if tool is None:
            import triton

            tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        path = "/tmp/_prefill_kernel.cubin"
        with open(path, "wb") as f:
            f.write(cubin)
        sass = subprocess.run([tool, "--dump-sass", path], capture_output=True, text=True, timeout=60).stdout
        info["mma"] = sorted(set(re.findall(r"\b((?:[IHQ]GMMA|[IH]MMA)\.[\w.]+)", sass)))
        for op in ("STL", "LDL", "STS", "I2F", "F2I"):
            info[f"count_{op}"] = len(re.findall(r"\b" + op + r"[\s.]", sass))
    except Exception as e:
        info["sass_error"] = repr(e)[:200]
    return info


# --------------------------------------------------------------------------- SDPA
def sdpa_variants(q, k, v, prefix, chunk, scale):
    """Callables computing the exact bottom-right causal problem with SDPA (name -> fn).

    q [1, Hq, chunk, D], k/v [1, Hq, prefix + chunk, D] bf16 contiguous.
    """
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    fns = {}
    if prefix == 0:
        for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                         ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
            def f(be=be):
                with sdpa_kernel([be]):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
            fns[f"sdpa_{name}_causal"] = f
        return fns
    from torch.nn.attention.bias import causal_lower_right

    bias = causal_lower_right(chunk, prefix + chunk)
    for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        def f(be=be):
            with sdpa_kernel([be]):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)
        fns[f"sdpa_{name}_lower_right"] = f

    kp, vp = k[:, :, :prefix], v[:, :, :prefix]
    kc, vc = k[:, :, prefix:], v[:, :, prefix:]

    def cudnn_split():
        a = torch.ops.aten._scaled_dot_product_cudnn_attention(q, kp, vp, None, True, 0.0, False, False,
                                                               scale=scale)
        b = torch.ops.aten._scaled_dot_product_cudnn_attention(q, kc, vc, None, True, 0.0, True, False,
                                                               scale=scale)
        (o1, l1), (o2, l2) = (a[0], a[1]), (b[0], b[1])
        l1 = l1.reshape(o1.shape[:-1]).float()
        l2 = l2.reshape(o2.shape[:-1]).float()
        lse = torch.logaddexp(l1, l2)
        return (o1.float() * torch.exp(l1 - lse)[..., None] + o2.float() * torch.exp(l2 - lse)[..., None]).to(q.dtype)

    fns["sdpa_cudnn_split_merge"] = cudnn_split

    def cudnn_dense():  # not the same problem (the chunk is not masked): a speed proxy only
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=False, scale=scale)

    fns["proxy_cudnn_dense_noncausal"] = cudnn_dense
    return fns


# --------------------------------------------------------------------------- main
class Log:
    def __init__(self, out_dir):
        self.f = open(os.path.join(out_dir, "log.txt"), "a")
        self.rows_path = os.path.join(out_dir, "prefill.jsonl")
        from int8attn.bench import environment

        self.env = environment()
        self.rows = []

    def __call__(self, *a):
        msg = " ".join(str(x) for x in a)
        print(msg, flush=True)
        self.f.write(msg + "\n")
        self.f.flush()

    def row(self, **r):
        full = {**r, **self.env}
        self.rows.append(full)
        with open(self.rows_path, "a") as f:
            f.write(json.dumps(full, sort_keys=True, default=str) + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU interpreter")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--rep-ms", type=float, default=80)
    ap.add_argument("--variants", default="", help="comma-separated variant names to keep (default: all)")
    ap.add_argument("--prefixes", default=",".join(str(p) for p in PREFIXES))
    ap.add_argument("--sdpa", default="", help="comma-separated SDPA variant names to keep (default: all)")
    ap.add_argument("--no-extras", action="store_true", help="skip quantize/producer timings and copy bandwidth")
    ap.add_argument("--mixed-early", action="store_true", help="run the mixed-batch check after the first case")
    ap.add_argument("--shape-prefixes", default="", help="per-shape prefixes, e.g. 32q8kv_d128=28672")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    smoke = args.smoke
    if smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    from int8attn import reference
    from int8attn.bench import time_eager
    import int8attn.ops.prefill as prefill_ops

    log = Log(args.out)
    dev = "cpu" if smoke else "cuda"
    chunk = 40 if smoke else CHUNK
    prefixes = (33, 0) if smoke else tuple(int(p) for p in args.prefixes.split(","))
    shapes = {"smoke": (4, 2, 64)} if smoke else {k: SHAPES[k] for k in args.shapes.split(",")}
    t_start = time.time()
    log("env", json.dumps(log.env))

    def timeit(fn):
        if smoke:
            t = time.time()
            fn()
            return 1e6 * (time.time() - t)
        return time_eager(fn, warmup_ms=20, rep_ms=args.rep_ms)

    # ---- parallel compile
    all_vars = {name: (smoke_variants if smoke else variants)(shape[2]) for name, shape in shapes.items()}
    if args.variants:
        keep = set(args.variants.split(","))
        all_vars = {name: [v for v in vs if v["name"] in keep] for name, vs in all_vars.items()}
    if not smoke:
        import multiprocessing as mp

        jobs = [(shape, chunk, var) for name, shape in shapes.items() for var in all_vars[name]]
        if args.mixed_early:
            jobs.insert(0, (None, chunk, "mixed"))
        t = time.time()
        with mp.get_context("spawn").Pool(min(args.workers, len(jobs))) as pool:
            for name, secs, err in pool.imap_unordered(_warm_worker, jobs):
                log(f"compiled {name} in {secs}s" + (f" ERROR {err}" if err else ""))
        log(f"parallel compile: {len(jobs)} variants in {time.time() - t:.1f}s")
        if torch.cuda.is_available() and not args.no_extras:
            from int8attn.bench import copy_bandwidth

            log(f"copy bandwidth {copy_bandwidth() / 1e12:.2f} TB/s")

    # ---- query quantization alone and the fused producer
    if not smoke and not args.no_extras:
        try:
            from int8attn.ops.producer import quantize_query

            q = torch.randn(CHUNK, 24, 256, device="cuda").to(torch.bfloat16)
            us = timeit(lambda: quantize_query(q, "int8"))
            log(f"quantize_query 4096x24x256 int8: {us:.1f} us")
            log.row(kind="quantize_query", num_tokens=CHUNK, num_heads=24, head_dim=256, kv_dtype="int8", time_us=us)
        except Exception as e:
            log(f"quantize_query timing failed {e!r}")
        try:
            from int8attn import reference as R
            from int8attn.cache import PagedKVCache
            from int8attn.ops.producer import rope_quantize_and_write

            cache = PagedKVCache(CHUNK // 16 + 4, 16, 4, 256, kv_dtype="int8", device="cuda")
            qx = torch.randn(CHUNK, 24, 256, device="cuda").to(torch.bfloat16)
            kx = torch.randn(CHUNK, 4, 256, device="cuda").to(torch.bfloat16)
            vx = torch.randn(CHUNK, 4, 256, device="cuda").to(torch.bfloat16)
            pos = torch.arange(CHUNK, device="cuda")
            cs = R.rope_cos_sin_cache(CHUNK, 64, device="cuda")
            slots = torch.arange(CHUNK, device="cuda")
            rope_quantize_and_write(qx, kx, vx, pos, cs, cache, slots)
            us = timeit(lambda: rope_quantize_and_write(qx, kx, vx, pos, cs, cache, slots))
            log(f"fused producer (RoPE 64 of 256 + K/V write + Q quant) 4096 tokens 24q/4kv/D256: {us:.1f} us")
            log.row(kind="fused_producer", num_tokens=CHUNK, num_q_heads=24, num_kv_heads=4, head_dim=256,
                    rotary_dim=64, kv_dtype="int8", time_us=us)
        except Exception as e:
            log(f"producer timing failed {e!r}")


    summary = []
    sass_seen = {}
    mixed_done = False
    per_shape = dict(kv.split("=") for kv in args.shape_prefixes.split(";") if kv)
    for shape_name, shape in shapes.items():
        hq, hkv, d = shape
        scale = d ** -0.5
        best = {}
        shape_prefixes = prefixes
        if shape_name in per_shape:
            shape_prefixes = tuple(int(x) for x in per_shape[shape_name].split(","))
        for prefix in shape_prefixes:
            flops = unmasked_flops(hq, d, chunk, prefix)
            rows = sample_rows(chunk)
            raw = build_batch(shape, prefix, chunk, "bf16", dev)
            k_raw = raw.key.to(torch.float64)
            v_raw = raw.value.to(torch.float64)
            ref_e2e = reference_rows(raw.query, k_raw, v_raw, prefix, rows, scale)
            del k_raw, v_raw
            case = {"shape": shape_name, "num_q_heads": hq, "num_kv_heads": hkv, "head_dim": d, "q_len": chunk,
                    "prefix": prefix, "block_size": BLOCK_SIZE, "unmasked_flops": flops}
            times = {}
            first = prefix == shape_prefixes[0]
            for kv in ("int8", "fp8", "bf16"):
                batch = with_cache(raw, kv)
                from int8attn.reference import gather_kv

                kd, vd = gather_kv(batch.cache, batch.block_table[0], prefix + chunk)
                ref_deq = reference_rows(batch.query, kd, vd, prefix, rows, scale)
                ref_q = reference_rows(batch.query, kd, vd, prefix, rows, scale,
                                       query_kv_dtype=kv if kv != "bf16" else None)
                del kd, vd
                for var in all_vars[shape_name]:
                    if var["kv"] != kv:
                        continue
                    name = var["name"]
                    # the sweep runs at the first prefix; later prefixes time the best of
                    # each (kv dtype, pv mode) family and the pre-quantized-query variant
                    if not first and name not in best.values() and not var["prequant"]:
                        continue
                    try:
                        out = torch.full(batch.query.shape, float("nan"), dtype=torch.bfloat16, device=dev)
                        fn = run_variant(batch, var, out=out)
                        fn()
                        if not smoke:
                            torch.cuda.synchronize()
                        all_written = bool(torch.isfinite(out).all())
                        got = take_rows(out, rows)
                        acc = {
                            "e2e": reference.error_stats(got, ref_e2e),
                            "vs_dequant_cache": reference.error_stats(got, ref_deq),
                            "vs_quantized_query": reference.error_stats(got, ref_q),
                        }
                        if name not in sass_seen:
                            sass_seen[name] = {} if smoke else sass_summary(prefill_ops.last_compiled_kernel)
                        sass = sass_seen[name]
                        us = timeit(fn)
                        tflops = flops / (us * 1e-6) / 1e12
                        times[name] = us
                        log(f"{shape_name} prefix={prefix} {name:24s} {us / 1e3:8.3f} ms {tflops:7.1f} TFLOP/s "
                            f"e2e_rel_l2={acc['e2e']['rel_l2']:.4f} deq={acc['vs_dequant_cache']['rel_l2']:.4f} "
                            f"qq={acc['vs_quantized_query']['rel_l2']:.4f} written={all_written} "
                            f"mma={sass.get('mma')} regs={sass.get('n_regs')} spills={sass.get('n_spills')}")
                        log.row(kind="prefill_kernel", variant=name, kv_dtype=kv, pv_mode=var["pv"],
                                config=var["cfg"], prequantized_q=var["prequant"], time_us=us,
                                effective_tflops=tflops, all_rows_written=all_written, accuracy=acc, sass=sass,
                                timing=("MEANINGLESS (interpreter)" if smoke
                                        else "eager (do_bench median, L2 flushed)"),
                                **case)
                    except Exception as e:
                        log(f"{shape_name} prefix={prefix} {name} FAILED {e!r}")
                        traceback.print_exc()
                        log.row(kind="prefill_kernel", variant=name, kv_dtype=kv, error=repr(e)[:500], **case)
                del batch

            # ---- SDPA BF16 on contiguous K/V (all query heads), same tokens
            sdpa_best = None
            if not smoke:
                g = hq // hkv
                q4 = raw.query.transpose(0, 1).unsqueeze(0).contiguous()
                k4 = raw.key.repeat_interleave(g, dim=1).transpose(0, 1).unsqueeze(0).contiguous()
                v4 = raw.value.repeat_interleave(g, dim=1).transpose(0, 1).unsqueeze(0).contiguous()
                for name, fn in sdpa_variants(q4, k4, v4, prefix, chunk, scale).items():
                    if args.sdpa and name not in args.sdpa.split(","):
                        continue
                    try:
                        o = fn()
                        torch.cuda.synchronize()
                        got = take_rows(o[0].transpose(0, 1), rows)
                        err = reference.error_stats(got, ref_e2e)
                        us = timeit(fn)
                        tflops = flops / (us * 1e-6) / 1e12
                        exact = not name.startswith("proxy")
                        log(f"{shape_name} prefix={prefix} {name:28s} {us / 1e3:8.3f} ms {tflops:7.1f} TFLOP/s "
                            f"e2e_rel_l2={err['rel_l2']:.4f}")
                        log.row(kind="sdpa_bf16", variant=name, time_us=us, effective_tflops=tflops,
                                accuracy={"e2e": err}, exact_problem=exact, **case)
                        if exact and err["rel_l2"] < 0.02 and (sdpa_best is None or us < sdpa_best[1]):
                            sdpa_best = (name, us)
                    except Exception as e:
                        log(f"{shape_name} prefix={prefix} {name} unavailable: {e!r}"[:400])
                        log.row(kind="sdpa_bf16", variant=name, error=repr(e)[:300], **case)
                del q4, k4, v4
            if first:
                fams = {}
                for var in all_vars[shape_name]:
                    if var["name"] in times and not var["prequant"]:
                        key = (var["kv"], var["pv"])
                        if key not in fams or times[var["name"]] < times[fams[key]]:
                            fams[key] = var["name"]
                best.update({f"fam_{k[0]}_{k[1]}": n for k, n in fams.items()})
            # ---- ratios
            for kv in ("int8", "fp8", "bf16"):
                cands = {n: t for n, t in times.items() if n.startswith(kv) and "preq" not in n}
                if not cands:
                    continue
                bname, bus = min(cands.items(), key=lambda x: x[1])
                bf = min((t for n, t in times.items() if n.startswith("bf16")), default=None)
                r = {"kind": "prefill_summary", "kv_dtype": kv, "best_variant": bname, "time_us": bus,
                     "effective_tflops": flops / (bus * 1e-6) / 1e12,
                     "ratio_vs_own_bf16_cache": (bf / bus) if bf else None,
                     "sdpa_best": sdpa_best[0] if sdpa_best else None,
                     "ratio_vs_sdpa_bf16": (sdpa_best[1] / bus) if sdpa_best else None, **case}
                log.row(**r)
                summary.append(r)
            del raw
            if not smoke:
                torch.cuda.empty_cache()
            if args.mixed_early and not mixed_done:
                mixed_done = True
                try:
                    mixed_batch_check(log, smoke, timeit)
                except Exception as e:
                    log(f"mixed batch check failed {e!r}")

    # ---- mixed batch through attention(): plan, eager and CUDA-graph replay
    try:
        if not mixed_done:
            mixed_batch_check(log, smoke, timeit)
    except Exception as e:
        log(f"mixed batch check failed {e!r}")
        traceback.print_exc()

    log("==== summary ====")
    for r in summary:
        log(f"{r['shape']:12s} prefix={r['prefix']:6d} {r['kv_dtype']:5s} best={r['best_variant']:24s} "
            f"{r['time_us'] / 1e3:7.3f} ms {r['effective_tflops']:7.1f} TFLOP/s "
            f"vs own bf16 {r['ratio_vs_own_bf16_cache'] or float('nan'):5.2f}x "
            f"vs SDPA({r['sdpa_best']}) {r['ratio_vs_sdpa_bf16'] or float('nan'):5.2f}x")
    log(f"total {time.time() - t_start:.0f}s")


def mixed_batch_check(log, smoke, timeit, warm_only=False):
    """Decode + prefill sequences in one attention() call: plan vs no plan vs one by one,
    and the planned run replayed from a CUDA graph."""
    from int8attn import reference, testing
    from int8attn.bench import time_graph
    from int8attn.ops.attention import attention, plan_attention

    if smoke:
        seq_lens, q_lens, shape = [20, 33, 9, 40], [1, 20, 9, 3], (4, 2, 64)
    else:
        seq_lens, q_lens, shape = [2048] * 8 + [1200, 300], [1] * 6 + [4, 8] + [500, 100], (24, 4, 256)
    hq, hkv, d = shape
    b = testing.make_paged_batch(seq_lens, q_lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, kv_dtype="int8",
                                 seed=3, device="cpu" if smoke else "cuda")
    args = (b.query, b.cache, b.block_table, b.seq_lens, b.query_start_loc)
    out = testing.poisoned_like(torch.empty(b.query.shape, dtype=torch.bfloat16, device=b.query.device))
    attention(*args, out=out)
    plan = plan_attention(b.cache, b.block_table, b.seq_lens, b.query_start_loc, hq)
    out_plan = testing.poisoned_like(out)
    attention(*args, out=out_plan, plan=plan)
    if warm_only:
        return
    ref = reference.attention_reference(*args)
    err = reference.error_stats(out, ref)
    same = bool(torch.equal(out, out_plan))
    log(f"mixed batch: all written={bool(torch.isfinite(out).all())} rel_l2 vs float64={err['rel_l2']:.4f} "
        f"plan==no-plan {same} launches={plan.launches}")
    row = {"kind": "mixed_batch", "seq_lens": seq_lens, "q_lens": q_lens, "rel_l2_vs_reference": err["rel_l2"],
           "plan_equals_no_plan": same, "launches": list(plan.launches)}
    if not smoke:
        row["eager_no_plan_us"] = timeit(lambda: attention(*args, out=out))
        row["eager_plan_us"] = timeit(lambda: attention(*args, out=out_plan, plan=plan))
        out_graph = testing.poisoned_like(out)
        row["graph_plan_us"] = time_graph(lambda: attention(*args, out=out_graph, plan=plan), replays=5, repeats=5)
        row["graph_equals_eager"] = bool(torch.equal(out_graph, out_plan))
        log(f"mixed batch: eager no-plan {row['eager_no_plan_us']:.1f} us, plan {row['eager_plan_us']:.1f} us, "
            f"graph replay {row['graph_plan_us']:.1f} us, graph==eager {row['graph_equals_eager']}")
    log.row(**row)


if __name__ == "__main__":
    main()
