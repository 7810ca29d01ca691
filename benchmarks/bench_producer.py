"""Producer kernels against their byte floor: write_kv, quantize_query, the fused
RoPE + K/V write + Q quantization, and the unfused sequence (torch RoPE + quantize_query +
write_kv), at 1, 64 and 4096 new tokens of the headline layer (24 q / 4 KV heads,
head_dim 256, rotary_dim 64 and 256), int8 and fp8 caches.

Floor = (bytes read + bytes written, each once) / measured copy bandwidth. Every timing
is recorded eagerly (CUDA events, L2 flushed between runs) and under CUDA-graph replay
(back to back, no flush: launch gaps gone, small shapes L2-resident).

One run does, in order:

1. correctness on the GPU against the CPU reference, bit for bit: quantize_query and
   write_kv vs ``reference.quantize_rows`` / ``reference.write_kv_reference``; the fused
   producer vs PyTorch fp32 RoPE (``apply_rope_torch``) + the reference quantization (Q
   codes and scales, K and V pages and scales), rotary 64 and 256, outputs poisoned first;
2. (GPU) a warm-up that compiles every kernel variant in parallel worker processes
   (Triton's on-disk cache then serves the timed process);
3. a launch-configuration sweep (tokens per program, heads per program, warps) at 4096
   and 1 tokens; the fastest configuration per (op, kv dtype, size class: <= 64 tokens or
   more) is then used for the table and reported, so the library defaults can follow it;
4. the table: every op, size, rotary and dtype, eager and graph; with ``--baseline FILE``
   (the round-1 kernels, ``git show c9446ed:src/int8attn/kernels/quantize.py``) the round-1
   write_kv, quantize_query and producer are timed in the same run, side by side;
5. the SASS of every compiled kernel: instruction counts (per EXIT-terminated section, i.e.
   per branch of the kernel), memory-op widths, barriers, local memory, registers (cubins
   saved to ``--out``; ``--sass-from TAR`` disassembles a saved tar on any machine).

    python benchmarks/bench_producer.py --out DIR [--baseline .round1/quantize_round1.py]   # GPU
    python benchmarks/bench_producer.py --sass-from DIR/producer_cubins.tar --out DIR2       # no GPU needed
    TRITON_INTERPRET=1 python benchmarks/bench_producer.py --dry-run                         # CPU smoke test
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import importlib.util
import io
import json
import multiprocessing as mp
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time

import torch
import triton

from int8attn import bench, reference
from int8attn.cache import PagedKVCache
from int8attn.kernels import quantize as qk
from int8attn.ops.producer import apply_rope_torch, quantize_query, rope_quantize_and_write
from int8attn.kernels.codes import KV_KIND
from int8attn.ops.write import write_kv
from int8attn.runtime import heads_per_program, interpret_mode
from int8attn.testing import make_keys, make_normal

HQ, HKV, D, BLOCK = 24, 4, 256, 16
SIZES = (1, 64, 4096)
SWEEP_SIZES = (1, 4096)  # 64 tokens is as launch-bound as 1 here
ROTS = (64, 256)
DTYPES = ("int8", "fp8")

#: Launch configurations swept (the first of each list is round 2's starting point).
SWEEP = {
    "producer": [dict(BLOCK_HQ=8, num_warps=2, TOKENS_PER_PROGRAM=1, KV_TOKENS=2, BLOCK_HKV=4),
                 dict(BLOCK_HQ=8, num_warps=4, TOKENS_PER_PROGRAM=1, KV_TOKENS=4, BLOCK_HKV=4),
                 dict(BLOCK_HQ=8, num_warps=2, TOKENS_PER_PROGRAM=1, KV_TOKENS=1, BLOCK_HKV=4),
                 dict(BLOCK_HQ=4, num_warps=2, TOKENS_PER_PROGRAM=1, KV_TOKENS=2, BLOCK_HKV=4),
                 dict(BLOCK_HQ=8, num_warps=4, TOKENS_PER_PROGRAM=1, KV_TOKENS=16, BLOCK_HKV=1)],
    "write_kv": [dict(num_warps=4, KV_TOKENS=4, BLOCK_HKV=4), dict(num_warps=4, KV_TOKENS=2, BLOCK_HKV=4),
                 dict(num_warps=4, KV_TOKENS=16, BLOCK_HKV=1), dict(num_warps=8, KV_TOKENS=8, BLOCK_HKV=4)],
    "quantize_query": [dict(BLOCK_R=8, num_warps=4), dict(BLOCK_R=16, num_warps=4), dict(BLOCK_R=8, num_warps=2),
                       dict(BLOCK_R=4, num_warps=1)],
}


def log(*a):
    print(*a, flush=True)


# --------------------------------------------------------------------------- inputs
def make_inputs(n, rot, kv_dtype, device, seed, max_pos=32768):
    gen = torch.Generator().manual_seed(seed)
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


def floor_bytes(n, rot):
    elem = 1  # int8 / fp8 storage
    kv_read = 2 * n * HKV * D * 2
    kv_write = 2 * n * HKV * (D * elem + 4)
    q_read = n * HQ * D * 2
    q_write = n * HQ * (D * elem + 4)
    meta = n * 8  # slot_mapping / positions int64
    return {
        "write_kv": kv_read + kv_write + meta + HKV * D * 4,
        "quantize_query": q_read + q_write,
        "producer": q_read + q_write + kv_read + kv_write + 2 * meta + n * rot * 4 + HKV * D * 4,
    }


def bits(t):
    return t.detach().cpu().contiguous().view(torch.uint8)


# --------------------------------------------------------------------------- round-1 kernels
_ROUND1 = None


def load_round1(path):
    global _ROUND1
    if path and _ROUND1 is None:
        spec = importlib.util.spec_from_file_location("int8attn_round1_quantize", path)
        _ROUND1 = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(_ROUND1)
    return _ROUND1


def round1_write_kv(m, cache, key, value, slots):
    """The round-1 launch of write_kv (c9446ed ops/write.py), without the input checks."""
    sscale = cache.key_scale.stride()
    m._write_kv_kernel[(key.shape[0],)](
        key, value, slots, cache.key, cache.value, cache.key_scale, cache.value_scale, cache.key_mean,
        HKV, key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        cache.key.stride(0), cache.key.stride(1), cache.key.stride(2), sscale[0], sscale[1], sscale[2],
        BLOCK_SIZE=BLOCK, HEAD_DIM=D, BLOCK_H=heads_per_program(HKV, D), BLOCK_D=D,
        KIND=KV_KIND[cache.kv_dtype], HAS_MEAN=True, INTERPRET=interpret_mode(), num_warps=4)


def round1_quantize_query(m, q, kv_dtype, out, out_scale):
    rows = q.shape[0] * q.shape[1]
    block_r = max(1, min(2048 // D, triton.next_power_of_2(rows)))
    m._quantize_query_kernel[(triton.cdiv(rows, block_r),)](
        q, out, out_scale, rows, q.shape[1], q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        out_scale.stride(0), out_scale.stride(1), HEAD_DIM=D, BLOCK_R=block_r, BLOCK_D=D,
        KIND=KV_KIND[kv_dtype], INTERPRET=interpret_mode(), num_warps=4)


def round1_producer(m, q, k, v, positions, cos_sin, cache, slots, out_q, out_s):
    rot = cos_sin.shape[1]
    sscale = cache.key_scale.stride()
    m._rope_quantize_write_kernel[(q.shape[0],)](
        q, k, v, positions, cos_sin, slots, out_q, out_s,
        cache.key, cache.value, cache.key_scale, cache.value_scale, cache.key_mean,
        HQ, HKV, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out_q.stride(0), out_q.stride(1), out_s.stride(0), out_s.stride(1),
        cache.key.stride(0), cache.key.stride(1), cache.key.stride(2), sscale[0], sscale[1], sscale[2],
        BLOCK_SIZE=BLOCK, HEAD_DIM=D, ROTARY_DIM=rot, BLOCK_HQ=heads_per_program(HQ, D),
        BLOCK_HKV=heads_per_program(HKV, D), BLOCK_HALF=triton.next_power_of_2(rot // 2),
        BLOCK_REST=triton.next_power_of_2(max(D - rot, 1)), BLOCK_D=D,
        KIND=KV_KIND[cache.kv_dtype], HAS_MEAN=True, INTERPRET=interpret_mode(), num_warps=4)


# --------------------------------------------------------------------------- the calls
_INPUTS: dict = {}


def cached_inputs(n, rot, kv_dtype, device):
    """Inputs and outputs of one case, drawn once per (n, rot, kv_dtype) and reused by
    every configuration timed on them (drawing 4096 tokens on the CPU takes a while)."""
    key = (n, rot, kv_dtype, str(device))
    if key not in _INPUTS:
        if len(_INPUTS) > 4:
            _INPUTS.clear()
        q, k, v, positions, cos_sin, cache, slots = make_inputs(n, rot, kv_dtype, device, seed=n + rot)
        out_q = torch.empty(q.shape, dtype=cache.storage_dtype, device=device)
        out_s = torch.empty((n, HQ), device=device)
        _INPUTS[key] = (q, k, v, positions, cos_sin, cache, slots, out_q, out_s)
    return _INPUTS[key]


def make_call(spec, device, baseline=None):
    """A zero-argument closure running one benchmark case; ``spec``: op, impl
    ("round2" | "round1"), kv_dtype, n, rot, cfg (launch overrides)."""
    op, impl, kv_dtype, n, rot, cfg = (spec[k] for k in ("op", "impl", "kv_dtype", "n", "rot", "cfg"))
    q, k, v, positions, cos_sin, cache, slots, out_q, out_s = cached_inputs(n, rot, kv_dtype, device)
    m = load_round1(baseline) if impl == "round1" else None
    if op == "write_kv":
        if m is not None:
            return lambda: round1_write_kv(m, cache, k, v, slots)
        return lambda: write_kv(cache, k, v, slots, _launch=cfg)
    if op == "quantize_query":
        if m is not None:
            return lambda: round1_quantize_query(m, q, kv_dtype, out_q, out_s)
        return lambda: quantize_query(q, kv_dtype, out=out_q, out_scale=out_s, _launch=cfg)
    if op == "producer":
        if m is not None:
            return lambda: round1_producer(m, q, k, v, positions, cos_sin, cache, slots, out_q, out_s)
        return lambda: rope_quantize_and_write(q, k, v, positions, cos_sin, cache, slots, out_q=out_q,
                                               out_q_scale=out_s, _launch=cfg)
    if op == "unfused":  # cfg: {"quantize_query": {...}, "write_kv": {...}}
        def unfused():
            q_rope = apply_rope_torch(q, positions, cos_sin).to(torch.bfloat16)
            k_rope = apply_rope_torch(k, positions, cos_sin).to(torch.bfloat16)
            quantize_query(q_rope, kv_dtype, out=out_q, out_scale=out_s, _launch=cfg.get("quantize_query"))
            write_kv(cache, k_rope, v, slots, _launch=cfg.get("write_kv"))
        return unfused
    raise ValueError(op)


def _warm(args):
    specs, baseline = args
    os.environ["INT8ATTN_CHECK_VALUES"] = "0"
    torch.set_num_threads(1)
    done = 0
    for spec in specs:
        try:
            make_call(spec, "cuda", baseline)()
            torch.cuda.synchronize()
            done += 1
        except Exception as exc:  # the timed process compiles it again and reports
            print("warm-up failed", spec, repr(exc)[:200], flush=True)
    return done


def warm_up(specs, baseline, workers=12):
    """Compile every variant once, in parallel processes (Triton's disk cache is shared)."""
    t0 = time.time()
    unique = {json.dumps(s, sort_keys=True): s for s in specs}
    specs = sorted(unique.values(), key=lambda s: (s["n"], s["rot"], s["kv_dtype"]))  # input reuse per worker
    chunks = [specs[i * len(specs) // workers:(i + 1) * len(specs) // workers] for i in range(workers)]
    try:
        with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
            done = sum(ex.map(_warm, [(c, baseline) for c in chunks if c]))
    except Exception as exc:
        log("warm-up skipped:", repr(exc)[:300])
        return
    log(f"warm-up: {done}/{len(specs)} variants in {time.time() - t0:.1f} s")


# --------------------------------------------------------------------------- correctness
def check_correctness(device, n, rec):
    ok = True
    for kv_dtype in DTYPES:
        for rot in ROTS:
            q, k, v, positions, cos_sin, cache, slots = make_inputs(n, rot, kv_dtype, device, seed=1000 + rot)
            row = dict(kind="correctness", kv_dtype=kv_dtype, num_tokens=n, rotary_dim=rot)
            if rot == ROTS[0]:
                q[3, 5] = 0
                out, scale = quantize_query(q, kv_dtype)
                rq, rs = reference.quantize_rows(q.cpu(), kv_dtype)
                row["quantize_query_bit_exact"] = (torch.equal(bits(out), bits(rq))
                                                   and torch.equal(bits(scale), bits(rs)))
                # write_kv with padding and a first-write mean computed on the GPU; the
                # reference gets the same mean (a CUDA reduction sums in another order)
                fresh = PagedKVCache(cache.num_blocks, BLOCK, HKV, D, kv_dtype=kv_dtype, device=device)
                ref_cache = PagedKVCache(cache.num_blocks, BLOCK, HKV, D, kv_dtype=kv_dtype, device="cpu",
                                         key_smoothing="none")
                for c in (fresh, ref_cache):
                    c.key.view(torch.uint8).fill_(0x5A)
                    c.value.view(torch.uint8).fill_(0x5A)
                    c.key_scale.fill_(float("nan"))
                    c.value_scale.fill_(float("nan"))
                slots_pad = slots.clone()
                slots_pad[::7] = -1
                write_kv(fresh, k, v, slots_pad)
                ref_cache.set_key_mean(fresh.key_mean.cpu())
                reference.write_kv_reference(ref_cache, k.cpu(), v.cpu(), slots_pad.cpu())
                row["write_kv_bit_exact"] = all(torch.equal(bits(a), bits(b)) for a, b in (
                    (fresh.key, ref_cache.key), (fresh.value, ref_cache.value),
                    (fresh.key_scale, ref_cache.key_scale), (fresh.value_scale, ref_cache.value_scale)))
            # fused producer (outputs poisoned) vs PyTorch fp32 RoPE + reference quantization
            for c in (cache.key, cache.value):
                c.view(torch.uint8).fill_(0x7F)
            cache.key_scale.fill_(float("nan"))
            cache.value_scale.fill_(float("nan"))
            out_q = torch.full(q.shape, 0x7F, dtype=torch.uint8, device=device).view(cache.storage_dtype)
            out_s = torch.full((n, HQ), float("nan"), device=device)
            rope_quantize_and_write(q, k, v, positions, cos_sin, cache, slots, out_q=out_q, out_q_scale=out_s)
            q_rope = apply_rope_torch(q.cpu(), positions.cpu(), cos_sin.cpu())
            k_rope = apply_rope_torch(k.cpu(), positions.cpu(), cos_sin.cpu()) - cache.key_mean.cpu()
            rq, rs = reference.quantize_rows(q_rope, kv_dtype)
            rk, rks = reference.quantize_rows(k_rope, kv_dtype)
            rv, rvs = reference.quantize_rows(v.cpu().float(), kv_dtype)
            blk, off = slots.cpu() // BLOCK, slots.cpu() % BLOCK
            got = {"q": (out_q, out_s), "k": (cache.key.cpu()[blk, :, off], cache.key_scale.cpu()[blk, :, off]),
                   "v": (cache.value_rows.cpu()[blk, :, off], cache.value_scale.cpu()[blk, :, off])}
            want = {"q": (rq, rs), "k": (rk, rks), "v": (rv, rvs)}
            for name in got:
                codes = (bits(got[name][0]) != bits(want[name][0])).sum().item()
                scales = (bits(got[name][1]) != bits(want[name][1])).sum().item()
                row[f"producer_{name}_code_bytes_differing"] = codes
                row[f"producer_{name}_scale_bytes_differing"] = scales
            if rot == ROTS[0]:  # accuracy against float64 RoPE (the codes above are exact)
                q_f64 = reference.apply_rope_reference(q.cpu(), positions.cpu(), cos_sin.cpu())
                row["producer_q_rel_l2_vs_f64_rope"] = reference.error_stats(
                    reference.dequantize_rows(out_q.cpu(), out_s.cpu()), q_f64)["rel_l2"]
            good = all(v is True or v == 0 for key, v in row.items()
                       if key.endswith(("bit_exact", "differing")))
            row["passed"] = bool(good and torch.isfinite(out_s).all().item())
            ok &= row["passed"]
            rec.add(**row)
            log("correctness", json.dumps(row))
    return ok


# --------------------------------------------------------------------------- timing
def timed(fn, graph: bool):
    if not torch.cuda.is_available():
        fn()
        return float("nan")
    return bench.time_graph(fn, replays=30, repeats=9) if graph else bench.time_eager(fn, warmup_ms=5, rep_ms=40)


class PartialRecorder(bench.Recorder):
    """Recorder that, given ``partial``, also appends each row there at once, so a run cut
    short still leaves its rows behind (``--out`` runs only)."""

    def __init__(self, name, path=None, partial=None):
        super().__init__(name, path=path)
        self.partial = partial

    def add(self, **row) -> dict:
        full = super().add(**row)
        if self.partial:
            with open(self.partial, "a") as f:
                f.write(json.dumps(full, sort_keys=True) + "\n")
        return full


def bench_one(rec, spec, bw, device, baseline, eager=True, tag=""):
    fn = make_call(spec, device, baseline)
    nbytes = floor_bytes(spec["n"], spec["rot"])["producer" if spec["op"] == "unfused" else spec["op"]]
    e = timed(fn, False) if eager else float("nan")
    g = timed(fn, True)
    floor_us = nbytes / bw * 1e6
    row = rec.add(kind="timing", op=spec["op"], impl=spec["impl"], tag=tag, num_tokens=spec["n"],
                  rotary_dim=spec["rot"], kv_dtype=spec["kv_dtype"], config=json.dumps(spec["cfg"], sort_keys=True),
                  eager_us=e, graph_us=g, bytes=nbytes, floor_us=floor_us, eager_over_floor=e / floor_us,
                  graph_over_floor=g / floor_us, copy_bandwidth_TBps=bw / 1e12, num_q_heads=HQ, num_kv_heads=HKV,
                  head_dim=D, block_size=BLOCK, value_checks=False)
    log(f"{tag:6s} {spec['impl']:6s} {spec['op']:15s} n={spec['n']:5d} rot={spec['rot']:3d} {spec['kv_dtype']:4s} "
        f"eager {e:8.2f} us  graph {g:8.2f} us  floor {floor_us:7.2f} us  x{e / floor_us:6.2f} / x{g / floor_us:6.2f}"
        f"  {json.dumps(spec['cfg'], sort_keys=True)}")
    return row


def spec(op, kv_dtype, n, rot, cfg=None, impl="round2"):
    return dict(op=op, impl=impl, kv_dtype=kv_dtype, n=n, rot=rot, cfg=dict(cfg or {}))


def size_class(n):
    return "small" if n <= 64 else "large"


def sweep_specs(sizes):
    out = []
    for n in sizes:
        for op, cfgs in SWEEP.items():
            for kv_dtype in DTYPES:
                for cfg in cfgs:
                    out.append(spec(op, kv_dtype, n, ROTS[0], cfg))
    return out


def table_specs(sizes, best, baseline):
    out = []
    for kv_dtype in DTYPES:
        for n in sizes:
            pick = lambda op: best.get((op, kv_dtype, size_class(n)), SWEEP[op][0])  # noqa: E731
            out.append(spec("write_kv", kv_dtype, n, ROTS[0], pick("write_kv")))
            out.append(spec("quantize_query", kv_dtype, n, ROTS[0], pick("quantize_query")))
            for rot in ROTS:
                out.append(spec("producer", kv_dtype, n, rot, pick("producer")))
                unf = {"quantize_query": pick("quantize_query"), "write_kv": pick("write_kv")}
                out.append(spec("unfused", kv_dtype, n, rot, unf))
            if baseline and n in (1, max(sizes)):
                out.append(spec("write_kv", kv_dtype, n, ROTS[0], impl="round1"))
                out.append(spec("quantize_query", kv_dtype, n, ROTS[0], impl="round1"))
                for rot in ROTS:
                    out.append(spec("producer", kv_dtype, n, rot, impl="round1"))
    return out


# --------------------------------------------------------------------------- SASS
def compiled_kernels():
    fns = [qk._write_kv_kernel, qk._quantize_query_kernel, qk._rope_quantize_write_kernel]
    if _ROUND1 is not None:
        fns += [_ROUND1._write_kv_kernel, _ROUND1._quantize_query_kernel, _ROUND1._rope_quantize_write_kernel]
    for fn in fns:
        tag = "round1" if fn.__module__ == "int8attn_round1_quantize" else "round2"
        caches = getattr(fn, "device_caches", None) or {0: (getattr(fn, "cache", {}).get(0, {}),)}
        for entry in caches.values():
            cache = entry[0] if isinstance(entry, tuple) else entry
            for kern in list(cache.values()):
                if hasattr(kern, "asm"):
                    yield tag, fn.__name__, kern


def cuobjdump() -> str:
    """cuobjdump from PATH, else the one Triton's NVIDIA backend ships."""
    return shutil.which("cuobjdump") or os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                                                     "cuobjdump")


def sass_stats(cubin: bytes) -> dict:
    """Disassemble a cubin (cuobjdump --dump-sass): instruction count, instructions per
    EXIT-terminated section (the kernel's branches), memory / barrier / conversion ops,
    registers and stack bytes."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([cuobjdump(), "--dump-sass", f.name], capture_output=True, text=True).stdout
        usage = subprocess.run([cuobjdump(), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    instrs = [t.strip() for t in re.findall(r"/\*[0-9a-f]{4}\*/\s+([^;]*);", sass)]
    sections, count = [], 0
    for t in instrs:
        count += 1
        if t == "EXIT" or t.startswith("RET"):
            sections.append(count)
            count = 0
    ops = {}
    for t in instrs:
        op = re.sub(r"^@!?U?P\w+\s+", "", t).split()[0]
        if op.startswith(("LDG", "STG", "LDL", "STL", "LDS", "STS", "BAR", "F2I", "F2FP", "MUFU", "SHFL")):
            ops[op] = ops.get(op, 0) + 1
    regs = re.search(r"REG:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)
    return dict(instructions=len(instrs), sections=sections, ops=ops, registers=int(regs.group(1)) if regs else None,
                stack_bytes=int(stack.group(1)) if stack else None)


def dump_sass(out_dir, rec):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for i, (tag, name, kern) in enumerate(compiled_kernels()):
            cubin = kern.asm["cubin"]
            info = tarfile.TarInfo(f"{tag}_{name}_{i}.cubin")
            info.size = len(cubin)
            tar.addfile(info, io.BytesIO(cubin))
            try:
                constants = {str(k): v for k, v in kern.src.constants.items()
                             if isinstance(v, (int, float, bool, str))}
            except Exception:
                constants = None
            try:
                stats = sass_stats(cubin)
            except Exception as exc:  # no disassembler: the cubins travel back instead
                stats = dict(sass_error=repr(exc)[:200])
            row = rec.add(kind="sass", impl=tag, kernel=name, cubin=info.name,
                          num_warps=getattr(kern.metadata, "num_warps", None), constants=constants, **stats)
            log("sass", json.dumps(row)[:300])
    if out_dir:
        with open(os.path.join(out_dir, "producer_cubins.tar"), "wb") as f:
            f.write(buf.getvalue())


def sass_from_tar(path, rec):
    """SASS rows for the cubins a GPU run saved (``--sass-from``; runs without a GPU)."""
    with tarfile.open(path) as tar:
        for member in tar.getmembers():
            stats = sass_stats(tar.extractfile(member).read())
            impl, name = member.name.split("_", 1)
            row = rec.add(kind="sass", impl=impl, kernel=name.rsplit("_", 1)[0], cubin=member.name,
                          disassembled_from=os.path.basename(path), **stats)
            log("sass", json.dumps({k: row[k] for k in ("cubin", "instructions", "sections", "registers",
                                                         "stack_bytes", "ops")}))


# --------------------------------------------------------------------------- main
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="write results/cubins here instead of benchmarks/results")
    ap.add_argument("--baseline", default=None, help="round-1 kernels file, timed side by side")
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes, no timing (CPU interpreter)")
    ap.add_argument("--no-warm-up", action="store_true")
    ap.add_argument("--sass-from", default=None, help="only disassemble the cubins of a GPU run's tar")
    args = ap.parse_args()
    if args.sass_from:
        rec = bench.Recorder("producer", path=os.path.join(args.out, "producer.jsonl") if args.out else None)
        sass_from_tar(args.sass_from, rec)
        log(f"saved {len(rec.rows)} rows to {rec.save()}")
        return
    device = "cuda" if torch.cuda.is_available() else "cpu"
    path = os.path.join(args.out, "producer.jsonl") if args.out else None
    rec = PartialRecorder("producer", path=path, partial=path + ".partial" if path else None)
    t0 = time.time()
    sizes = (1, 3) if args.dry_run else SIZES
    load_round1(args.baseline)
    ok = check_correctness(device, 8 if args.dry_run else max(sizes), rec)
    log(f"correctness {'PASSED' if ok else 'FAILED'} ({time.time() - t0:.1f} s)")
    os.environ["INT8ATTN_CHECK_VALUES"] = "0"  # timed calls skip the host-side value checks
    bw = bench.copy_bandwidth() if torch.cuda.is_available() else 1e12
    log(f"copy bandwidth {bw / 1e12:.3f} TB/s")
    sweep_sizes = (3,) if args.dry_run else tuple(reversed(SWEEP_SIZES))
    if device == "cuda" and not args.no_warm_up:
        # every configuration the run can time (the table's are among the sweep's)
        warm_up(sweep_specs(sweep_sizes) + table_specs(sizes, {}, args.baseline), args.baseline)
    # large sizes first: the figures that matter most survive a run cut short
    best = {}
    for n_sweep in sweep_sizes:
        times = {}
        for s in sweep_specs((n_sweep,)):
            r = bench_one(rec, s, bw, device, args.baseline, eager=False, tag="sweep")
            times.setdefault((s["op"], s["kv_dtype"], size_class(n_sweep)), {})[
                json.dumps(s["cfg"], sort_keys=True)] = r["graph_us"]
        for key, by_cfg in times.items():
            cfg = min(by_cfg, key=lambda c: by_cfg[c])
            best[key] = json.loads(cfg)
            rec.add(kind="chosen_config", op=key[0], kv_dtype=key[1], size_class=key[2], num_tokens=n_sweep,
                    config=cfg, graph_us=by_cfg)
            log("chosen", key, cfg)
        for s in table_specs(sizes, best, args.baseline):
            if size_class(s["n"]) == size_class(n_sweep):
                bench_one(rec, s, bw, device, args.baseline, tag="table")
    if device == "cuda":
        dump_sass(args.out, rec)
    if args.dry_run and not args.out:
        log(f"dry run: {len(rec.rows)} rows not saved (give --out to keep them) ({time.time() - t0:.1f} s)")
    else:
        saved = rec.save()
        log(f"saved {len(rec.rows)} rows to {saved} ({time.time() - t0:.1f} s)")
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
