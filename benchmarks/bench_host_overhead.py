"""Host cost of eager attention calls: what one call costs before (and around) its kernels.

Calls measured, at the gate's decode shape (24 query heads, 4 KV heads, head_dim 256, page
16), one new token per sequence, batch 1 / 16 / 64, context L = 8192, INT8 and BF16
caches:

* ``decode_attention`` -- the no-plan decode op (``out=`` and a ``DecodeWorkspace`` given,
  as a careful eager caller does);
* ``attention`` -- the public router without a plan;
* ``plan.run`` -- :meth:`int8attn.AttentionPlan.run`, the per-layer call of a planned step
  (the plan made once, outside the loop), with the same tensors every call; ``plan.run new
  tensors`` the same with another query, output and cache (a pool of 8 cycled) on every
  call, as a model's layers call it; ``attention(plan=)`` the same through the public
  function; ``plan.run triton runner`` the same plan's launches through Triton's own
  ``compiled[grid]`` runner instead of int8attn's direct one (``ops._launch``);
* ``plan_attention`` -- making the plan (once per batch, one host sync);
* ``step of 16 layers`` (stub mode) -- a fresh plan plus one run per layer, each layer with
  its own cache, divided by 16: the per-layer host cost of a planned eager step.

Each no-plan call is measured with value checks on (``INT8ATTN_CHECK_VALUES=1``: a host
sync per call) and off (``INT8ATTN_CHECK_VALUES=0``; on a GPU an unplanned call's default
is the same as off). Two modes:

* ``stub`` (the only mode without a GPU): every Triton launch is replaced by a no-op that
  records its grid, so the figure is the Python (and PyTorch) work of the call: checks,
  planning, allocation, argument building. On the CPU the tensors are CPU tensors;
* ``real`` (GPU): real launches. ``wall_us`` is the time per call of a loop of N calls
  between two ``torch.cuda.synchronize()`` (eager throughput: host-bound when it exceeds
  the kernels' own time); ``host_us`` the time to issue the N calls, before the final
  sync; ``gpu_us`` the time per call of the same call replayed in a CUDA graph (kernels
  only; plan.run only, the one capturable without turning value checks off); ``queued_gpu_us``
  the GPU time per call of the eager launches themselves (:func:`int8attn.bench.time_queued`:
  calls issued behind a sleep kernel, so host time is hidden; an eager call may launch other
  kernels than its graph capture does, e.g. the one-launch barrier decode).

On a GPU both modes run, real first: ``real - stub`` host time is what Triton's launch
path itself costs. The planned calls are measured first in each block, the no-plan
``attention`` last (for T > 8 tokens it also launches the prefill kernel, the slowest
compile); no measurement starts after ``--deadline`` seconds (default 50; skipped ones are
listed).

Rows go to ``--out DIR/host_overhead.jsonl`` (default benchmarks/results/host_overhead.jsonl)
via :class:`int8attn.bench.Recorder`; a summary table goes to stdout. About 2 s on the CPU;
on an H200 a few seconds of measurement plus whatever Triton compiles (the decode kernels
for both caches, the merge and query kernels, the prefill kernel for both caches).

    PYTHONPATH=src python3 benchmarks/bench_host_overhead.py                # CPU: stub mode
    PYTHONUNBUFFERED=1 PYTHONPATH=src python3 benchmarks/bench_host_overhead.py --out $OUT   # GPU
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():  # stub mode on CPU tensors: the checks want the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

from int8attn import bench  # noqa: E402
from int8attn.cache import PagedKVCache  # noqa: E402
from int8attn.ops import _launch as launch_mod  # noqa: E402
from int8attn.ops import decode as dec  # noqa: E402
from int8attn.ops import prefill as pre  # noqa: E402
from int8attn.ops import producer as prod
from int8attn.ops.attention import attention, plan_attention

HQ, HKV, D, PAGE = 24, 4, 256, 16
LAYERS = 16


def is_planned(call: str) -> bool:
    """A call through a plan (``plan.run`` and its variants, ``attention(plan=)``): it reads
    no metadata values whatever INT8ATTN_CHECK_VALUES says, so it is timed once."""
    return call.startswith("plan.run") or call == "attention(plan=)"


class _StubCompiled:
    """Stands in for Triton's CompiledKernel: ``compiled[grid](*args)`` records the grid."""

    asm: dict = {}
    function = None

    def __init__(self, name: str, grids: list):
        self.name, self.grids = name, grids

    def run(self, *args):  # the attribute CachedLaunch checks for
        raise AssertionError("not called")

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.grids.append((self.name, grid))
        return launch


class _StubKernel:
    """Stands in for a @triton.jit kernel: ``kernel[grid](...)`` records the grid, runs
    nothing and returns a :class:`_StubCompiled`, so ops._launch.CachedLaunch takes its
    cached path from the second call on, as it does on a GPU (the interpreter never
    caches): the stub times the Python of the real launch path minus Triton's launcher."""

    def __init__(self, name: str, grids: list, real=None):
        self.name, self.grids = name, grids
        self.arg_names = getattr(real, "arg_names", None)
        self.fn = getattr(real, "fn", None)
        self._compiled = _StubCompiled(name, grids)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.grids.append((self.name, grid))
            return self._compiled
        return launch


#: The module attributes every attention launch goes through.
_KERNELS = ((dec, "_decode_split_kernel"), (dec, "_decode_merge_kernel"), (dec, "_quantize_query_kernel"),
            (prod, "_quantize_query_kernel"),
            (pre, "_prefill_kernel"))


@contextlib.contextmanager
def stubbed_launches():
    """Replace the Triton kernels with :class:`_StubKernel` (restored on exit); yields the
    list of (kernel, grid) launches recorded."""
    grids: list = []
    saved = [(mod, name, getattr(mod, name)) for mod, name in _KERNELS]
    try:
        for mod, name in _KERNELS:
            setattr(mod, name, _StubKernel(name, grids, getattr(mod, name)))
        yield grids
    finally:
        for mod, name, kernel in saved:
            setattr(mod, name, kernel)


@contextlib.contextmanager
def value_checks(on: bool):
    old = os.environ.get("INT8ATTN_CHECK_VALUES")
    os.environ["INT8ATTN_CHECK_VALUES"] = "1" if on else "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("INT8ATTN_CHECK_VALUES", None)
        else:
            os.environ["INT8ATTN_CHECK_VALUES"] = old


def make_batch(kv_dtype: str, batch: int, length: int, device: str, full_cache: bool):
    """Query, cache, metadata and out of one decode step. ``full_cache``: a cache holding
    every sequence's pages (GPU); else a small cache whose block ids repeat (the stub mode
    reads no K/V, only the shapes and the block-id range matter)."""
    blocks_per_seq = length // PAGE
    num_blocks = batch * blocks_per_seq if full_cache else 64
    cache = PagedKVCache(num_blocks, PAGE, HKV, D, kv_dtype=kv_dtype, device=device, key_smoothing="none")
    gen = torch.Generator().manual_seed(batch)
    if full_cache:
        ids = torch.randperm(num_blocks, generator=gen).view(batch, blocks_per_seq)
    else:
        ids = torch.randint(0, num_blocks, (batch, blocks_per_seq), generator=gen)
    block_table = ids.to(torch.int32).to(device)
    seq_lens = torch.full((batch,), length, dtype=torch.int32, device=device)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=device)
    query = torch.randn(batch, HQ, D, generator=gen).to(torch.bfloat16).to(device)
    out = torch.empty_like(query)
    return query, cache, block_table, seq_lens, qsl, out


def _variant_plans(cache, bt, sl, qsl, q, scale, out) -> dict:
    """Planned calls next to ``plan.run``: with the producer's query codes given
    (``q_quant``: no quantization launch), with the fused merge (one launch for the split
    kernel and its merge), and both."""
    import dataclasses

    plan_fused = _plan_with(lambda c: dataclasses.replace(c, fused_merge=True), cache, bt, sl, qsl)
    plan_barrier = _plan_with(lambda c: dataclasses.replace(c, fused_merge="barrier"), cache, bt, sl, qsl)
    plan_kernel = _plan_with(lambda c: dataclasses.replace(c, fused_merge=False), cache, bt, sl, qsl)
    plan_triton = _first_run_without_direct_launch(plan_attention(cache, bt, sl, qsl, HQ), q, cache, bt, sl, qsl,
                                                   scale, out)
    fns = {"plan.run triton runner": lambda: plan_triton.run(q, cache, bt, sl, qsl, scale, out),
           "plan.run fused": lambda: plan_fused.run(q, cache, bt, sl, qsl, scale, out),
           "plan.run barrier": lambda: plan_barrier.run(q, cache, bt, sl, qsl, scale, out),
           "plan.run merge kernel": lambda: plan_kernel.run(q, cache, bt, sl, qsl, scale, out)}
    if cache.quantized:
        qq, qs = prod.quantize_query(q, cache.kv_dtype)
        plan_q = plan_attention(cache, bt, sl, qsl, HQ)
        fns["plan.run q_quant"] = lambda: plan_q.run(q, cache, bt, sl, qsl, scale, out, q_quant=qq, q_scale=qs)
        fns["plan.run q_quant fused"] = lambda: plan_fused.run(q, cache, bt, sl, qsl, scale, out, q_quant=qq,
                                                               q_scale=qs)
        fns["plan.run q_quant barrier"] = lambda: plan_barrier.run(q, cache, bt, sl, qsl, scale, out, q_quant=qq,
                                                                   q_scale=qs)
        fns["plan.run q_quant merge kernel"] = lambda: plan_kernel.run(q, cache, bt, sl, qsl, scale, out,
                                                                       q_quant=qq, q_scale=qs)
    return fns


def _with_new_tensors(plan, q, cache, bt, sl, qsl, scale, out, pool: int = 8):
    """``plan.run`` as a model's layers call it: another query, output and cache (same
    layout) on every call -- a pool of ``pool`` of each, cycled -- so the launch sees new
    tensor objects each time and checks their signature."""
    qs = [q.clone() for _ in range(pool)]
    outs = [torch.empty_like(out) for _ in range(pool)]
    caches = [cache] + [PagedKVCache(cache.num_blocks, PAGE, HKV, D, kv_dtype=cache.kv_dtype, device=cache.device,
                                     key_smoothing="none") for _ in range(pool - 1)]
    step = iter(range(1 << 62))

    def call():
        i = next(step) % pool
        plan.run(qs[i], caches[i], bt, sl, qsl, scale, outs[i])
    return call


def _first_run_without_direct_launch(plan, q, cache, bt, sl, qsl, scale, out):
    """``plan`` after a first run that built its launches on Triton's own runner
    (``ops._launch.DIRECT_LAUNCH`` off): what the direct launch path saves, side by side."""
    launch_mod.DIRECT_LAUNCH = False
    try:
        plan.run(q, cache, bt, sl, qsl, scale, out)
    finally:
        launch_mod.DIRECT_LAUNCH = True
    return plan


def _plan_with(change, cache, bt, sl, qsl):
    """A plan made while the decode planner's default config is ``change(default)``."""
    real = dec.default_config
    dec.default_config = lambda *a, **k: change(real(*a, **k))
    try:
        return plan_attention(cache, bt, sl, qsl, HQ)
    finally:
        dec.default_config = real


def _layers_step(query, cache, block_table, seq_lens, qsl, out, scale):
    """One decode step as a serving engine runs it: a fresh plan (every bound given, as the
    transformers integration plans), then one run per layer, each layer with its own cache
    of the same geometry. Stub mode only (the caches are small)."""
    caches = [cache] + [PagedKVCache(cache.num_blocks, PAGE, HKV, D, kv_dtype=cache.kv_dtype, device=cache.device,
                                     key_smoothing="none") for _ in range(LAYERS - 1)]
    tokens, seqs = query.shape[0], block_table.shape[0]

    def step():
        plan = plan_attention(cache, block_table, seq_lens, qsl, HQ, num_tokens=tokens, max_query_len=tokens // seqs,
                              has_decode=True, has_prefill=False)
        for layer_cache in caches:
            plan.run(query, layer_cache, block_table, seq_lens, qsl, scale, out)
    return step


def measure(mode: str, device: str, batches, length: int, n: int, repeats: int, rec, graph: bool,
            deadline: float, skipped: list) -> list[dict]:
    """Rows of one mode; measurements that would start after ``deadline`` (perf_counter
    time) are skipped and named in ``skipped``."""
    rows = []
    stub = stubbed_launches() if mode == "stub" else contextlib.nullcontext([])
    with stub as grids:
        for kv_dtype in ("int8", "bf16"):
            for batch in batches:
                rows += _measure_batch(mode, device, kv_dtype, batch, length, n, repeats, rec, graph, deadline,
                                       skipped, grids)
                if device == "cuda":
                    torch.cuda.empty_cache()
    return rows


def _measure_batch(mode, device, kv_dtype, batch, length, n, repeats, rec, graph, deadline, skipped,
                   grids) -> list[dict]:
    on_gpu = device == "cuda"
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    q, cache, bt, sl, qsl, out = make_batch(kv_dtype, batch, length, device, full_cache=mode == "real")
    scale = D ** -0.5
    plan = plan_attention(cache, bt, sl, qsl, HQ)
    ws = dec.DecodeWorkspace(batch, HQ, D, device=device)
    # the planned calls first: the no-plan router also compiles the prefill kernel (its grid
    # runs for T > 8 tokens), the slowest compile of the lot
    variants = _variant_plans(cache, bt, sl, qsl, q, scale, out)
    fns = {
        "plan.run": lambda: plan.run(q, cache, bt, sl, qsl, scale, out),
        "plan.run new tensors": _with_new_tensors(plan, q, cache, bt, sl, qsl, scale, out),
        **variants,
        "attention(plan=)": lambda: attention(q, cache, bt, sl, qsl, scale, out, plan=plan),
        "decode_attention": lambda: dec.decode_attention(q, cache, bt, sl, qsl, softmax_scale=scale, out=out,
                                                         workspace=ws),
        "attention": lambda: attention(q, cache, bt, sl, qsl, scale, out),
    }
    base = dict(mode=mode, device=device, kv_dtype=kv_dtype, batch=batch, L=length, q_len=1, num_q_heads=HQ,
                num_kv_heads=HKV, head_dim=D, n_calls=n, repeats=repeats, num_splits=plan.decode_plan.num_splits)
    rows = []
    # discarded: the first loop of a process ran up to 2x slower than later ones on the H200 box
    bench.per_call_us(fns["plan.run"], n, 2, sync)
    for checks in (True, False):
        with value_checks(checks):
            # a planned run reads no values either way: timed once
            calls = {call: fn for call, fn in fns.items() if checks or not is_planned(call)}
            if time.perf_counter() > deadline:
                skipped.extend(f"{mode} {kv_dtype} bs{batch} {call} checks={checks}" for call in calls)
                continue
            launches = {}
            for call, fn in calls.items():
                del grids[:]
                fn()
                launches[call] = len(grids) if mode == "stub" else None
            timed = bench.interleaved_us(calls, n, repeats, sync)
            for call, fn in calls.items():
                host, wall = timed[call]
                planned = is_planned(call)
                row = dict(base, call=call, value_checks=None if planned else checks, host_us=host,
                           wall_us=wall if on_gpu else None, launches_per_call=launches[call])
                if graph and call.startswith("plan.run") and mode == "real":
                    row["gpu_us"] = bench.time_graph(fn, replays=20, repeats=5, warmup=2)
                if mode == "real" and (planned or not checks):
                    # the eager launches' own GPU time (a graph replays the capture-time launches)
                    row["queued_gpu_us"], row["queued"] = bench.time_queued(fn, calls=100, repeats=5)
                rows.append(rec.add(**row))
            if time.perf_counter() > deadline:
                skipped.append(f"{mode} {kv_dtype} bs{batch} plan_attention checks={checks}")
                continue
            planning = bench.per_call_us(lambda: plan_attention(cache, bt, sl, qsl, HQ), max(5, n // 10), repeats,
                                   sync)[1]
            rows.append(rec.add(**dict(base, call="plan_attention", value_checks=checks, host_us=planning,
                                       wall_us=None, launches_per_call=None)))
            if mode == "stub":
                step = bench.per_call_us(_layers_step(q, cache, bt, sl, qsl, out, scale), max(5, n // 20), repeats,
                                   sync)[1] / LAYERS
                rows.append(rec.add(**dict(base, call=f"step of {LAYERS} layers", value_checks=checks,
                                           host_us=step, wall_us=None, launches_per_call=None)))
    return rows


def summary(rows: list[dict]) -> str:
    lines = ["| mode | kv | batch | call | checks | host us/call | wall us/call | gpu us (graph) | gpu us (queued) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        checks = "-" if r["value_checks"] is None else ("on" if r["value_checks"] else "off")

        def fmt(v):
            return "-" if v is None else f"{v:.1f}"
        lines.append(f"| {r['mode']} | {r['kv_dtype']} | {r['batch']} | {r['call']} | {checks} | {fmt(r['host_us'])} "
                     f"| {fmt(r['wall_us'])} | {fmt(r.get('gpu_us'))} | {fmt(r.get('queued_gpu_us'))} |")
    return "\n".join(lines)


def profile_plan_run(device: str, length: int, out: Path | None, calls: int = 2000) -> None:
    """cProfile of ``plan.run`` with the producer's query codes and of an unplanned
    ``attention()`` (batch 1, the int8 cache, value checks at their default): the functions
    that hold their host time, to ``out/host_profile.txt`` and stdout."""
    import cProfile
    import io
    import pstats

    q, cache, bt, sl, qsl, out_t = make_batch("int8", 1, length, device, full_cache=device == "cuda")
    plan = plan_attention(cache, bt, sl, qsl, HQ)
    qq, qs = prod.quantize_query(q, cache.kv_dtype)
    scale = D ** -0.5
    texts = []
    for name, fn in (("plan.run (q codes given)", lambda: plan.run(q, cache, bt, sl, qsl, scale, out_t, q_quant=qq,
                                                                    q_scale=qs)),
                     ("attention() without a plan", lambda: attention(q, cache, bt, sl, qsl, scale, out_t))):
        for _ in range(50):
            fn()
        if device == "cuda":
            torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            fn()
        prof.disable()
        if device == "cuda":
            torch.cuda.synchronize()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(30)
        texts.append(f"{name} (int8, batch 1, L {length}), {calls} calls, cProfile by tottime\n" + buf.getvalue())
    text = "\n".join(texts)
    print(text)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "host_profile.txt").write_text(text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="folder for host_overhead.jsonl (default benchmarks/results)")
    ap.add_argument("--mode", choices=("stub", "real", "both"), default=None,
                    help="default: both on a GPU, stub without one")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--calls", type=int, default=200, help="calls per timed loop")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph time of plan.run")
    ap.add_argument("--label", default=None, help="a tag stored in every row (e.g. which tree was measured)")
    ap.add_argument("--profile", action="store_true",
                    help="also cProfile 2000 calls of plan.run (producer codes given) and of an unplanned "
                         "attention() at batch 1, and print where their host time goes")
    ap.add_argument("--deadline", type=float, default=50.0,
                    help="seconds after which no new measurement starts (the rest is listed as skipped)")
    args = ap.parse_args(argv)
    on_gpu = torch.cuda.is_available()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        on_gpu = False
    mode = args.mode or ("both" if on_gpu else "stub")
    if mode != "stub" and not on_gpu:
        print("real launches need a GPU; running the stub mode", file=sys.stderr)
        mode = "stub"
    device = "cuda" if on_gpu else "cpu"
    batches = [int(b) for b in args.batches.split(",")]
    rec = bench.Recorder("host_overhead", Path(args.out) / "host_overhead.jsonl" if args.out else None)
    if args.label:
        rec.env["label"] = args.label
    start = time.perf_counter()
    rows, skipped = [], []
    for m in (("real", "stub") if mode == "both" else (mode,)):
        rows += measure(m, device, batches, args.length, args.calls, args.repeats, rec, graph=not args.no_graph,
                        deadline=start + args.deadline, skipped=skipped)
        print(f"[{time.perf_counter() - start:5.1f}s] {m} mode done", flush=True)
    if args.profile and device == "cuda":  # interpreted kernels would only profile the interpreter
        profile_plan_run(device, args.length, Path(args.out) if args.out else None)
    path = rec.save()
    print(summary(rows))
    if skipped:
        print(f"\nskipped past the {args.deadline:.0f} s deadline: " + "; ".join(skipped))
    print(f"\n{len(rows)} rows -> {path}; {rec.env['gpu']}, torch {rec.env['torch']}, triton {rec.env['triton']}; "
          f"wall {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
