"""End-to-end generation in transformers: int8attn's INT8 paged cache vs transformers' SDPA BF16.

A Qwen3 model built from a config at the Qwen3.5-27B attention shape (24 q heads, 4 KV heads,
head_dim 256; a few layers, small hidden size, random weights) generates with

* ``sdpa``: transformers' own SDPA attention over its BF16 caches -- ``DynamicCache``
  (eager) and ``StaticCache`` (eager, and one decode step captured in a CUDA graph);
* ``int8attn``: :class:`Int8PagedCache` (kv int8; fp8 and bf16 through the same kernels for
  comparison) with the "int8attn" attention implementation, eager and CUDA graph.

Sections (each guarded: a failure is recorded as a row and the script goes on; every throughput
path runs in a child process of its own, so a device-side assert cannot poison the others):

1. accuracy: transformers ``generate()`` (greedy, 256 steps) on SDPA gives the reference
   tokens and logits; int8attn replays the same tokens (teacher forcing) for per-step
   logits relative L2 and argmax agreement, and runs its own ``generate()`` for free-running
   greedy agreement.
2. throughput: prompts of 8192 tokens at batch 1 and 32; prefill once, then timed greedy
   decode steps (the same loop for every path: forward, argmax, next token), eager and
   CUDA graph; tokens/s = batch * steps / wall time.
3. op overhead: host time per call of ``int8attn::attention`` (torch.library op) vs the
   direct launcher at a small decode shape.

CUDA graphs: transformers' own compile path (``StaticCache`` + torch.compile) cannot host a
cache whose pages are allocated on the host, so every graph here is one decode step
captured by :class:`int8attn.integrations.transformers.CUDAGraphDecoder` -- for SDPA too, over
transformers' ``StaticCache`` (whose write position is a device counter).

Rows go to benchmarks/results/e2e.jsonl (or ``--out DIR``/e2e.jsonl) via int8attn.bench.Recorder;
a markdown summary is printed and written next to them. ``--tiny`` runs a CPU-sized model
(Triton interpreter without a GPU; timings meaningless).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

if not torch.cuda.is_available():  # kernels run in Triton's interpreter; set before triton loads them
    os.environ.setdefault("TRITON_INTERPRET", "1")

from int8attn.bench import Recorder  # noqa: E402


# --------------------------------------------------------------------------- model
def model_config(args):
    from transformers import Qwen3Config

    if args.tiny:
        heads = dict(num_attention_heads=6, num_key_value_heads=2, head_dim=64)
    else:
        heads = dict(num_attention_heads=24, num_key_value_heads=4, head_dim=256)
    return Qwen3Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, max_position_embeddings=args.max_positions,
        tie_word_embeddings=False, **heads,
    )


def build_model(args, device):
    from transformers import Qwen3ForCausalLM

    from int8attn.integrations.transformers import register

    register()
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = Qwen3ForCausalLM(model_config(args))
    rope_buffers = fp32_rope_buffers(model)
    model = model.to(device=device, dtype=torch.bfloat16).eval()
    restore_buffers(model, rope_buffers)
    model.set_attn_implementation("sdpa")
    return model


def fp32_rope_buffers(model) -> dict:
    """The rotary embeddings' frequency buffers (``inv_freq`` ...), fp32 copies.

    ``Module.to(dtype=bf16)`` casts buffers too; ``from_pretrained(dtype=bf16)`` keeps them
    fp32. A bf16 ``inv_freq`` moves the rotary phase by up to ~1 radian at position 1k, so
    a model built here and the same checkpoint loaded elsewhere (tensor parallel) would not
    compute the same function. Restoring them after the cast matches the loaded model."""
    return {name: buf.detach().clone() for name, buf in model.named_buffers()
            if "inv_freq" in name.rsplit(".", 1)[-1] and buf.is_floating_point()}


def restore_buffers(model, buffers: dict) -> None:
    for name, value in buffers.items():
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner) if owner else model
        module._buffers[attr] = value.to(device=module._buffers[attr].device)


def cache_kw(model, cache) -> dict:
    from int8attn.integrations.transformers import cache_argument_name

    return {cache_argument_name(model): cache, "use_cache": True}


def random_prompt(vocab, batch, length, seed, device):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=gen).to(device)


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def new_int8attn_cache(model, kv_dtype, batch, max_len, device):
    from int8attn.integrations.transformers import Int8PagedCache

    return Int8PagedCache(model.config, max_batch_size=batch, max_cache_len=max_len, kv_dtype=kv_dtype,
                          device=device)


# --------------------------------------------------------------------------- loops
@torch.inference_mode()
def prefill(model, cache, ids):
    """Eager prefill of ``ids`` [B, L]; returns the last position's logits [B, V]."""
    return model(input_ids=ids, **cache_kw(model, cache), logits_to_keep=1).logits[:, -1]


@torch.inference_mode()
def decode(model, cache, token, position, steps, runner=None):
    """Greedy decode ``steps`` tokens from ``token`` [B, 1] at ``position``; returns
    (tokens [B, steps], logits of the last step). The same loop for every path."""
    pos = torch.full_like(token, position)
    tokens = []
    logits = None
    for _ in range(steps):
        if runner is not None:
            logits = runner.step(token, pos)
        else:
            logits = model(input_ids=token, position_ids=pos, **cache_kw(model, cache), logits_to_keep=1).logits[:, -1]
        token = logits.argmax(-1, keepdim=True)
        pos = pos + 1
        tokens.append(token)
    return torch.cat(tokens, 1), logits


def timed(fn, device):
    sync(device)
    t0 = time.perf_counter()
    result = fn()
    sync(device)
    return result, time.perf_counter() - t0


# --------------------------------------------------------------------------- 1. accuracy
@torch.inference_mode()
def teacher_forced(model, cache, ids, tokens):
    """Logits [B, steps, V] (fp32) of decoding ``tokens`` after prefilling ``ids``."""
    out = [prefill(model, cache, ids).float()]
    pos = torch.full((ids.shape[0], 1), ids.shape[1], dtype=torch.long, device=ids.device)
    for t in range(tokens.shape[1] - 1):
        logits = model(input_ids=tokens[:, t: t + 1], position_ids=pos + t, **cache_kw(model, cache),
                       logits_to_keep=1).logits[:, -1]
        out.append(logits.float())
    return torch.stack(out, 1)


def logits_report(logits, ref_logits, ref_tokens) -> dict:
    """Per-step relative L2, argmax agreement and how near-ties compare with the error."""
    diff = (logits - ref_logits).float()
    rel = (diff.norm(dim=-1) / ref_logits.float().norm(dim=-1)).flatten()
    agree = (logits.argmax(-1) == ref_tokens).float()
    top2 = ref_logits.float().topk(2, dim=-1).values
    margin = (top2[..., 0] - top2[..., 1]).flatten()
    max_err = diff.abs().amax(-1).flatten()
    confident = margin > 2 * max_err
    return {
        "logits_rel_l2_median": rel.median().item(),
        "logits_rel_l2_p99": rel.quantile(0.99).item(),
        "logits_rel_l2_max": rel.max().item(),
        "teacher_forced_argmax_agreement": agree.mean().item(),
        "confident_steps": int(confident.sum()),
        "confident_argmax_agreement": agree.flatten()[confident].mean().item() if confident.any() else float("nan"),
        "median_top2_margin": margin.median().item(),
        "median_max_abs_logit_err": max_err.median().item(),
    }


def run_accuracy(model, args, device, rec, summary):
    from int8attn.integrations.transformers import cache_argument_name

    steps = args.acc_steps
    ids = random_prompt(model.config.vocab_size, args.acc_batch, args.acc_prompt, args.seed + 1, device)
    model.set_attn_implementation("sdpa")
    with torch.inference_mode():
        ref = model.generate(ids, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    ref_tokens = ref.sequences[:, ids.shape[1]:]
    ref_logits = torch.stack([x.float() for x in ref.logits], 1)
    del ref
    for kv_dtype in args.acc_kv_dtypes:
        try:
            model.set_attn_implementation("int8attn")
            max_len = ids.shape[1] + steps + 1
            cache = new_int8attn_cache(model, kv_dtype, args.acc_batch, max_len, device)
            logits = teacher_forced(model, cache, ids, ref_tokens)
            report = logits_report(logits, ref_logits, ref_tokens)
            del cache, logits
            cache = new_int8attn_cache(model, kv_dtype, args.acc_batch, max_len, device)
            with torch.inference_mode():
                out = model.generate(ids, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                                     **{cache_argument_name(model): cache})
            free = out[:, ids.shape[1]:]
            same = (free == ref_tokens)
            first_div = [int((~row).nonzero()[0]) if (~row).any() else steps for row in same]
            report.update({
                "free_running_agreement": same.float().mean().item(),
                "first_divergence_step": first_div,
                "free_running_identical": bool(same.all()),
            })
            row = rec.add(section="accuracy", path="int8attn", kv_dtype=kv_dtype, batch=args.acc_batch,
                          prompt_len=args.acc_prompt, steps=steps, reference="transformers sdpa bf16 generate()",
                          **report)
            summary["accuracy"].append(row)
            print(f"[accuracy] kv={kv_dtype}: rel L2 median {report['logits_rel_l2_median']:.4f} "
                  f"max {report['logits_rel_l2_max']:.4f}; teacher-forced argmax agreement "
                  f"{report['teacher_forced_argmax_agreement']:.3f}; free-running {report['free_running_agreement']:.3f}"
                  f" (first divergence {first_div})", flush=True)
        except Exception as exc:  # recorded, the script goes on
            record_failure(rec, summary, "accuracy", f"int8attn kv={kv_dtype}", exc)
        finally:
            model.set_attn_implementation("sdpa")
            free_memory()


# --------------------------------------------------------------------------- 2. throughput
# Decode phases per path, each ``warmup + steps`` tokens long: SDPA runs DynamicCache eager,
# then StaticCache eager and graph over the same (copied) prompt K/V; int8attn runs eager,
# then graph. The static caches are sized from these counts (a write past max_cache_len is a
# device-side assert that kills the CUDA context), and every phase is checked on the host first.
PHASES = {"sdpa": 3, "int8attn": 2}


def cache_len_needed(prompt: int, args, path: str) -> int:
    return prompt + PHASES[path] * (args.warmup + args.steps) + 8


def check_room(capacity: int, start: int, steps: int, what: str) -> None:
    """Refuse (on the host) a decode phase that would write past a static cache's end."""
    if start + steps > capacity:
        raise ValueError(f"{what}: positions {start}..{start + steps - 1} do not fit max_cache_len={capacity}")


def throughput_paths(args) -> list[str]:
    return ["sdpa"] + [f"int8attn:{kv}" for kv in args.kv_dtypes]


def run_throughput_path(model, args, device, path: str, batch: int) -> dict:
    """One path's rates {(path, cache, mode): rates} at ``batch`` (in this process)."""
    cuda = torch.device(device).type == "cuda"
    ids = random_prompt(model.config.vocab_size, batch, args.prompt, args.seed + 2, device)
    if path == "sdpa":
        return throughput_sdpa(model, ids, cache_len_needed(args.prompt, args, "sdpa"), args, device, cuda)
    kv_dtype = path.split(":", 1)[1]
    return throughput_int8attn(model, ids, kv_dtype, cache_len_needed(args.prompt, args, "int8attn"), args,
                               device, cuda)


def run_throughput(model, args, device, rec, summary):
    """Every (path, batch) runs in its own process (unless --in-process): a device-side
    assert poisons its CUDA context for good, and must not take the other paths with it."""
    for batch in args.batches:
        results = {}
        for path in throughput_paths(args):
            what = f"{path.replace(':', ' kv=')} b={batch}"
            if args.in_process:
                results.update(guarded(rec, summary, what,
                                       lambda: run_throughput_path(model, args, device, path, batch)))
            else:
                results.update(guarded(rec, summary, what, lambda: throughput_subprocess(args, path, batch)))
        base = {mode: results.get(("sdpa", "static", mode)) for mode in ("eager", "graph")}
        for (path, cache_kind, mode), r in results.items():
            ref = base.get(mode)
            ratio = r["tokens_per_s"] / ref["tokens_per_s"] if ref else None
            row = rec.add(section="throughput", path=path, cache=cache_kind, mode=mode, batch=batch,
                          prompt_len=args.prompt, decode_steps=args.steps, layers=args.layers,
                          hidden=args.hidden, ratio_vs_sdpa_static_same_mode=ratio, **r)
            summary["throughput"].append(row)
            print(f"[throughput] b={batch} {path:8s} {cache_kind:8s} {mode:5s}: {r['tokens_per_s']:10.1f} tok/s "
                  f"({r['ms_per_step']:.3f} ms/step)" + (f", {ratio:.2f}x sdpa-static" if ratio else ""), flush=True)
        free_memory()


def throughput_subprocess(args, path: str, batch: int) -> dict:
    """Run one throughput path in a child process (same arguments, ``--worker``); its
    output goes to this process's stdout. Returns its rates, or raises with its error."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory(prefix="int8attn_e2e_") as tmp:
        result_file = Path(tmp) / "result.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), *args.argv, "--worker", f"{path}@{batch}",
               "--worker-out", str(result_file)]
        print(f"[throughput] {path} b={batch}: child process", flush=True)
        try:
            proc = subprocess.run(cmd, timeout=args.worker_timeout)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"{path} b={batch}: child process ran past {args.worker_timeout}s") from None
        payload = json.loads(result_file.read_text()) if result_file.exists() else {}
    if payload.get("error"):
        raise RuntimeError(f"child process: {payload['error']}")
    if rc != 0 or "results" not in payload:
        raise RuntimeError(f"child process exited with rc={rc} and no result (see the log above)")
    return {tuple(key): r for key, r in payload["results"]}


def run_worker(args) -> int:
    """``--worker PATH@BATCH``: one throughput path in this (child) process; writes
    {"results": [[[path, cache, mode], rates], ...]} or {"error": ...} to --worker-out."""
    path, batch = args.worker.rsplit("@", 1)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    payload = {}
    try:
        model = build_model(args, device)
        results = run_throughput_path(model, args, device, path, int(batch))
        payload["results"] = [[list(key), r] for key, r in results.items()]
    except Exception as exc:
        traceback.print_exc()
        payload["error"] = f"{type(exc).__name__}: {exc}"[:500]
    Path(args.worker_out).write_text(json.dumps(payload))
    return 1 if "error" in payload else 0


def throughput_sdpa(model, ids, total_len, args, device, cuda):
    """SDPA decode rates: DynamicCache eager, then StaticCache (``total_len`` positions)
    eager and graph. The static phases continue after the dynamic one's tokens (its K/V
    is copied), so ``total_len`` must hold prompt + 3 phases (see :func:`cache_len_needed`)."""
    from transformers import DynamicCache, StaticCache

    from int8attn.integrations.transformers import CUDAGraphDecoder

    out = {}
    model.set_attn_implementation("sdpa")
    batch, prompt = ids.shape
    check_room(total_len, prompt, PHASES["sdpa"] * (args.warmup + args.steps), "sdpa decode phases")
    dyn = DynamicCache(config=model.config)
    logits, t_prefill = timed(lambda: prefill(model, dyn, ids), device)
    token = logits.argmax(-1, keepdim=True)
    pos = prompt
    decode(model, dyn, token, pos, args.warmup)
    (toks, _), t = timed(lambda: decode(model, dyn, token, pos + args.warmup, args.steps), device)
    out[("sdpa", "dynamic", "eager")] = rates(batch, args.steps, t, prefill_s=t_prefill, prompt=prompt)
    # Same prompt K/V copied into a StaticCache (avoids a masked 8k prefill over the static length).
    static = StaticCache(config=model.config, max_cache_len=total_len)
    length = dyn.get_seq_length()
    if length != prompt + args.warmup + args.steps:
        raise RuntimeError(f"DynamicCache holds {length} tokens, expected {prompt + args.warmup + args.steps}")
    static.early_initialization(batch, model.config.num_key_value_heads, model.config.head_dim, torch.bfloat16,
                                torch.device(device))
    for dst, src in zip(static.layers, dyn.layers):
        dst.keys[:, :, :length].copy_(src.keys)
        dst.values[:, :, :length].copy_(src.values)
        dst.cumulative_length.fill_(length)
    dyn = None
    free_memory()
    token = toks[:, -1:]
    pos = length
    check_room(total_len, pos, args.warmup + args.steps, "sdpa static eager")
    decode(model, static, token, pos, args.warmup)
    pos += args.warmup
    (_, _), t = timed(lambda: decode(model, static, token, pos, args.steps), device)
    out[("sdpa", "static", "eager")] = rates(batch, args.steps, t)
    pos += args.steps
    static_length(static, pos)
    if cuda:
        check_room(total_len, pos, args.warmup + args.steps, "sdpa static graph")
        runner = CUDAGraphDecoder(model, static, batch)
        decode(model, static, token, pos, args.warmup, runner=runner)  # captures
        pos += args.warmup
        (_, _), t = timed(lambda: decode(model, static, token, pos, args.steps, runner=runner), device)
        out[("sdpa", "static", "graph")] = rates(batch, args.steps, t)
        pos += args.steps
        static_length(static, pos)
        runner = None
    static = None
    return out


def static_length(static, expected: int) -> None:
    """Check (one host read) that StaticCache's device write counters are at ``expected``."""
    for layer in static.layers:
        length = getattr(layer, "cumulative_length", None)
        if isinstance(length, torch.Tensor) and int(length) != expected:
            raise RuntimeError(f"StaticCache write position {int(length)}, expected {expected}")


def throughput_int8attn(model, ids, kv_dtype, total_len, args, device, cuda, eager=True):
    """Eager (when ``eager``) then CUDA-graph (when ``cuda``) decode rates over one prefill
    (``total_len`` >= prompt + 2 phases; :class:`Int8PagedCache` also refuses an overflow
    on the host)."""
    from int8attn.integrations.transformers import CUDAGraphDecoder

    out = {}
    model.set_attn_implementation("int8attn")
    try:
        batch, prompt = ids.shape
        needed = args.warmup + (args.steps if eager else 0) + ((args.warmup + args.steps) if cuda else 0)
        check_room(total_len, prompt, needed, f"int8attn kv={kv_dtype}")
        cache = new_int8attn_cache(model, kv_dtype, batch, total_len, device)
        logits, t_prefill = timed(lambda: prefill(model, cache, ids), device)
        token = logits.argmax(-1, keepdim=True)
        pos = prompt
        toks, _ = decode(model, cache, token, pos, args.warmup)
        pos += args.warmup
        if eager:
            (toks, _), t = timed(lambda: decode(model, cache, token, pos, args.steps), device)
            out[("int8attn", kv_dtype, "eager")] = rates(batch, args.steps, t, prefill_s=t_prefill, prompt=prompt,
                                                         cache_bytes=cache.nbytes())
            pos += args.steps
        if cuda:
            runner = CUDAGraphDecoder(model, cache, batch)
            token = toks[:, -1:]
            decode(model, cache, token, pos, args.warmup, runner=runner)
            pos += args.warmup
            (_, _), t = timed(lambda: decode(model, cache, token, pos, args.steps, runner=runner), device)
            out[("int8attn", kv_dtype, "graph")] = rates(batch, args.steps, t, cache_bytes=cache.nbytes())
            del runner
        cache = None
    finally:
        model.set_attn_implementation("sdpa")
    return out


def rates(batch, steps, seconds, prefill_s=None, prompt=None, cache_bytes=None) -> dict:
    r = {"tokens_per_s": batch * steps / seconds, "ms_per_step": 1e3 * seconds / steps}
    if prefill_s is not None:
        r["prefill_s"] = prefill_s
        r["prefill_tokens_per_s"] = batch * prompt / prefill_s
    if cache_bytes is not None:
        r["kv_cache_bytes"] = cache_bytes
    return r


# --------------------------------------------------------------------------- profile
ATTENTION_KERNEL_HINTS = ("flash", "fmha", "attention", "sdpa", "cudnn", "efficient")


def run_profile(model, args, device, rec, summary):
    """Which GPU kernels one int8attn decode step of the model launches (torch.profiler):
    the proof that generation runs the int8attn kernels and no other attention kernel."""
    from collections import Counter

    from torch.profiler import ProfilerActivity, profile

    if torch.device(device).type != "cuda":
        print("[profile] skipped: needs CUDA", flush=True)
        return
    model.set_attn_implementation("int8attn")
    try:
        ids = random_prompt(model.config.vocab_size, 2, 256, args.seed + 3, device)
        cache = new_int8attn_cache(model, "int8", 2, 256 + 8, device)
        token = prefill(model, cache, ids).argmax(-1, keepdim=True)
        decode(model, cache, token, 256, 1)
        sync(device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            decode(model, cache, token, 257, 1)
            sync(device)
        kernels = Counter(e.name for e in prof.events() if e.device_type.name == "CUDA")
        ours = {k: v for k, v in kernels.items() if k.startswith("_") and any(
            h in k for h in ("decode", "prefill", "write_kv", "quantize"))}
        foreign = {k: v for k, v in kernels.items() if k not in ours and any(
            h in k.lower() for h in ATTENTION_KERNEL_HINTS)}
        row = rec.add(section="profile", path="int8attn", kv_dtype="int8", layers=model.config.num_hidden_layers,
                      int8attn_kernels=ours, other_attention_kernels=foreign, all_kernels=dict(kernels))
        summary["profile"].append(row)
        print(f"[profile] one decode step: int8attn kernels {ours}; other attention kernels {foreign or 'none'}",
              flush=True)
    finally:
        model.set_attn_implementation("sdpa")
        free_memory()


# --------------------------------------------------------------------------- 3. op overhead
def run_op_overhead(args, device, rec, summary):
    from int8attn.ops import library
    from int8attn.ops.attention import attention
    from int8attn.testing import make_paged_batch

    heads = (6, 2, 64) if args.tiny else (24, 4, 256)
    batch = make_paged_batch([args.overhead_ctx], [1], num_q_heads=heads[0], num_kv_heads=heads[1],
                             head_dim=heads[2], device=device)
    a = (batch.query, batch.cache, batch.block_table, batch.seq_lens, batch.query_start_loc)
    out = torch.empty_like(batch.query)
    calls = {"direct": lambda: attention(*a, out=out), "torch.library op": lambda: library.attention(*a, out=out)}
    n = 5 if args.tiny else 300
    old = os.environ.get("INT8ATTN_CHECK_VALUES")
    os.environ["INT8ATTN_CHECK_VALUES"] = "0"  # a serving loop's setting: no host reads
    try:
        for name, fn in calls.items():
            for _ in range(3):
                fn()
            _, t = timed(lambda: [fn() for _ in range(n)], device)
            row = rec.add(section="op_overhead", path=name, context=args.overhead_ctx, calls=n,
                          us_per_call_wall=1e6 * t / n)
            summary["op_overhead"].append(row)
            print(f"[op overhead] {name}: {1e6 * t / n:.1f} us/call (wall, back to back)", flush=True)
    finally:
        if old is None:
            os.environ.pop("INT8ATTN_CHECK_VALUES", None)
        else:
            os.environ["INT8ATTN_CHECK_VALUES"] = old


# --------------------------------------------------------------------------- plumbing
def guarded(rec, summary, what, fn) -> dict:
    try:
        return fn()
    except Exception as exc:
        record_failure(rec, summary, "throughput", what, exc)
        return {}
    finally:
        free_memory()


def record_failure(rec, summary, section, what, exc):
    traceback.print_exc()
    row = rec.add(section=section, path=what, error=f"{type(exc).__name__}: {exc}"[:500])
    summary["errors"].append(row)
    print(f"[{section}] FAILED {what}: {type(exc).__name__}: {exc}", flush=True)


def free_memory():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def markdown(summary, rows_extra=()) -> str:
    lines = []
    if summary.get("env"):
        e = summary["env"]
        lines.append(f"GPU {e['gpu']}, torch {e['torch']}, triton {e['triton']}, transformers {e.get('transformers')}")
        lines.append("")
    if summary["throughput"]:
        lines += ["| batch | path | cache | mode | tokens/s | ms/step | x sdpa-static (same mode) | "
                  "prefill s (incl. first-call JIT) |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in summary["throughput"]:
            ratio = r.get("ratio_vs_sdpa_static_same_mode")
            lines.append(f"| {r['batch']} | {r['path']} | {r['cache']} | {r['mode']} | {r['tokens_per_s']:.1f} | "
                         f"{r['ms_per_step']:.3f} | {'' if ratio is None else f'{ratio:.2f}x'} | "
                         f"{r.get('prefill_s', float('nan')):.3f} |")
        lines.append("")
    if summary["accuracy"]:
        lines += ["| kv | logits rel L2 median / p99 / max | teacher-forced argmax agreement | "
                  "confident-step agreement (n) | free-running agreement | first divergence |",
                  "|---|---|---|---|---|---|"]
        for r in summary["accuracy"]:
            lines.append(
                f"| {r['kv_dtype']} | {r['logits_rel_l2_median']:.4f} / {r['logits_rel_l2_p99']:.4f} / "
                f"{r['logits_rel_l2_max']:.4f} | {r['teacher_forced_argmax_agreement']:.3f} | "
                f"{r['confident_argmax_agreement']:.3f} ({r['confident_steps']}) | "
                f"{r['free_running_agreement']:.3f} | {r['first_divergence_step']} |")
        lines.append("")
    if summary["op_overhead"]:
        lines += ["| call | us/call (host wall) |", "|---|---|"]
        for r in summary["op_overhead"]:
            lines.append(f"| {r['path']} | {r['us_per_call_wall']:.1f} |")
        lines.append("")
    for r in summary.get("profile", []):
        lines.append(f"Kernels of one int8attn decode step ({r['layers']} layers): {r['int8attn_kernels']}; "
                     f"other attention kernels: {r['other_attention_kernels'] or 'none'}")
        lines.append("")
    for r in list(summary["errors"]) + list(rows_extra):
        lines.append(f"- FAILED {r.get('section')} {r.get('path')}: {r.get('error')}")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="CPU-sized model (interpreter without a GPU)")
    p.add_argument("--out", default=None, help="directory for e2e.jsonl and e2e_summary.md "
                                                "(default benchmarks/results/)")
    p.add_argument("--sections", default="accuracy,throughput,profile,overhead")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--intermediate", type=int, default=None)
    p.add_argument("--vocab", type=int, default=None)
    p.add_argument("--prompt", type=int, default=None)
    p.add_argument("--batches", default=None)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--kv-dtypes", default="int8,bf16")
    p.add_argument("--acc-kv-dtypes", default="int8,fp8,bf16")
    p.add_argument("--acc-batch", type=int, default=None)
    p.add_argument("--acc-prompt", type=int, default=None)
    p.add_argument("--acc-steps", type=int, default=None)
    p.add_argument("--overhead-ctx", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--in-process", action="store_true",
                   help="run the throughput paths in this process (default: one child process per path and batch)")
    p.add_argument("--worker-timeout", type=int, default=240, help="seconds per throughput child process")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # PATH@BATCH: child process mode
    p.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)
    args.argv = argv
    tiny = dict(layers=1, hidden=128, intermediate=256, vocab=256, prompt=16, batches="1,2", steps=3, warmup=1,
                acc_batch=1, acc_prompt=12, acc_steps=4, overhead_ctx=40)
    full = dict(layers=4, hidden=2048, intermediate=4096, vocab=32000, prompt=8192, batches="1,32", steps=48,
                warmup=4, acc_batch=2, acc_prompt=8192, acc_steps=256, overhead_ctx=1024)
    for k, v in (tiny if args.tiny else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.batches = [int(b) for b in str(args.batches).split(",")]
    args.kv_dtypes = [k for k in args.kv_dtypes.split(",") if k]
    args.acc_kv_dtypes = [k for k in args.acc_kv_dtypes.split(",") if k]
    args.sections = set(args.sections.split(","))
    args.max_positions = max(args.prompt + max(PHASES.values()) * (args.steps + args.warmup),
                             args.acc_prompt + args.acc_steps) + 64
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        return run_worker(args)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    import transformers

    out_dir = Path(args.out) if args.out else None
    rec = Recorder("e2e", path=(out_dir / "e2e.jsonl") if out_dir else None)
    summary = {"env": {**rec.env, "transformers": transformers.__version__}, "accuracy": [], "throughput": [],
               "op_overhead": [], "profile": [], "errors": []}
    rec.env["transformers"] = transformers.__version__
    print(f"[env] {json.dumps(summary['env'])}", flush=True)
    try:
        model = build_model(args, device)
        print(f"[model] {model.config.num_hidden_layers} layers, hidden {model.config.hidden_size}, "
              f"{model.config.num_attention_heads} q / {model.config.num_key_value_heads} kv heads, "
              f"head_dim {model.config.head_dim}, {sum(p.numel() for p in model.parameters()) / 1e6:.0f} M params",
              flush=True)
        if "accuracy" in args.sections:
            run_accuracy(model, args, device, rec, summary)
        if "throughput" in args.sections:
            run_throughput(model, args, device, rec, summary)
        if "profile" in args.sections:
            try:
                run_profile(model, args, device, rec, summary)
            except Exception as exc:
                record_failure(rec, summary, "profile", "int8attn decode step", exc)
    except Exception as exc:
        record_failure(rec, summary, "setup", "model", exc)
    if "overhead" in args.sections:
        try:
            run_op_overhead(args, device, rec, summary)
        except Exception as exc:
            record_failure(rec, summary, "op_overhead", "attention", exc)
    path = rec.save()
    text = markdown(summary)
    (path.parent / "e2e_summary.md").write_text(text + "\n")
    print("\n" + text, flush=True)
    print(f"\nrows: {path}", flush=True)
    return 1 if summary["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
