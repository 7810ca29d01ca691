"""Tensor-parallel generation: the bench_e2e model sharded over 2 GPUs by transformers'
tensor-parallel plan, each rank keeping its own KV heads (4 / 2 = 2) in its own int8attn cache.

    torchrun --nproc-per-node 2 benchmarks/tp_generate.py [--out DIR] [--tiny]

(NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 in the
environment: NVLink multicast stays off.)

transformers 5.x shards a model while loading a checkpoint (``from_pretrained`` with
``DistributedConfig(tp_size=N)``, or ``tp_plan="auto"`` on releases before it), so rank 0
first builds the model from its config with random weights, saves it with
``save_pretrained``, loads that checkpoint back on its one GPU (the same loader as the
sharded ranks: same weights, fp32 rotary buffers, same config) and, still alone, records the
reference: greedy tokens and
teacher-forced logits with the int8attn cache (and with SDPA, as a control), plus its
single-GPU decode throughput. Then every rank loads the checkpoint sharded
(``Qwen3``'s ``base_model_tp_plan``: q/k/v/gate/up colwise, o/down rowwise + all-reduce) and
runs the same generation and throughput loop; teacher forcing feeds rank 0's reference
tokens on every rank (a TP forward must see one input). Every rank checks that its gathered
weights and buffers equal the reference's. Reported: token agreement TP vs one GPU, logits
relative L2 (int8attn and the SDPA control), local KV heads per rank, tokens/s of the TP
group and per GPU.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_e2e as e2e  # noqa: E402

from int8attn.bench import Recorder  # noqa: E402


def log(*args):
    print(f"[rank {dist.get_rank() if dist.is_initialized() else 0}]", *args, flush=True)


def load_sharded(path, world_size):
    from transformers import Qwen3ForCausalLM

    from int8attn.integrations.transformers import register

    register()
    kwargs = dict(dtype=torch.bfloat16, attn_implementation="int8attn")
    try:
        from transformers import DistributedConfig

        kwargs["distributed_config"] = DistributedConfig(tp_size=world_size)
    except ImportError:  # releases before DistributedConfig took tp_plan directly
        kwargs["tp_plan"] = "auto"
    return Qwen3ForCausalLM.from_pretrained(path, **kwargs).eval()


def load_single(path, device):
    """The checkpoint on one device, through the same loader as the sharded model (same
    dtype handling: bf16 weights, fp32 rotary buffers), so the reference and the TP run
    differ only by the sharding."""
    from transformers import Qwen3ForCausalLM

    from int8attn.integrations.transformers import register

    register()
    model = Qwen3ForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map={"": torch.device(device)})
    model.set_attn_implementation("sdpa")
    return model.eval()


def checkpoint_tensors(path) -> dict:
    """name -> CPU tensor of every weight in the saved checkpoint."""
    from safetensors.torch import load_file

    tensors = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return tensors


def local_rows(weight: torch.Tensor) -> int:
    return (weight.to_local() if hasattr(weight, "to_local") else weight).shape[0]


def full(t: torch.Tensor) -> torch.Tensor:
    """A parameter or buffer as one dense tensor (a DTensor shard is gathered: collective)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def state_mismatches(model, reference: dict) -> list[str]:
    """Names whose (gathered) parameters / floating buffers differ from ``reference``
    (name -> CPU tensor) in value or dtype. Every rank must call it (DTensor gathers)."""
    bad = []
    tensors = list(model.named_parameters()) + [(n, b) for n, b in model.named_buffers() if b.is_floating_point()]
    for name, t in tensors:
        dense = full(t.detach()).cpu()
        ref = reference.get(name)
        if ref is None or ref.dtype != dense.dtype or ref.shape != dense.shape or not torch.equal(ref, dense):
            bad.append(name)
    return bad


def generate_tokens(model, ids, steps, kv_dtype, device):
    """Greedy tokens [B, steps] with an int8attn cache (kv_dtype); with SDPA (kv_dtype None)
    the tokens and their logits [B, steps, V]."""
    from int8attn.integrations.transformers import cache_argument_name

    if kv_dtype is None:
        model.set_attn_implementation("sdpa")
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True)
        return out.sequences[:, ids.shape[1]:], torch.stack([x.float() for x in out.logits], 1)
    else:
        model.set_attn_implementation("int8attn")
        cache = e2e.new_int8attn_cache(model, kv_dtype, ids.shape[0], ids.shape[1] + steps + 1, device)
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                                 **{cache_argument_name(model): cache})
    return out[:, ids.shape[1]:]


def teacher_forced_logits(model, ids, tokens, kv_dtype, device):
    model.set_attn_implementation("int8attn")
    cache = e2e.new_int8attn_cache(model, kv_dtype, ids.shape[0], ids.shape[1] + tokens.shape[1] + 1, device)
    return e2e.teacher_forced(model, cache, ids, tokens), cache


def teacher_forced_sdpa(model, ids, tokens):
    """SDPA (DynamicCache) logits [B, steps, V] of decoding ``tokens`` after ``ids``."""
    from transformers import DynamicCache

    model.set_attn_implementation("sdpa")
    return e2e.teacher_forced(model, DynamicCache(config=model.config), ids, tokens)


def rel_l2(a, b):
    """Per-step relative L2 of logits [B, steps, V], flattened."""
    return ((a - b).norm(dim=-1) / b.norm(dim=-1)).flatten()


def throughput(model, args, device, cuda, label, mode):
    """int8attn decode tokens/s at batch args.batch, prompt args.prompt, in ``mode``
    ("eager" or "graph"; each over its own prefill, so a failing graph capture cannot take
    the eager figure with it)."""
    ids = e2e.random_prompt(model.config.vocab_size, args.batch, args.prompt, args.seed + 2, device)
    total = args.prompt + 2 * (args.warmup + args.steps) + 8
    out = e2e.throughput_int8attn(model, ids, args.kv_dtype, total, args, device,
                                  cuda=cuda and mode == "graph", eager=mode == "eager")
    rows = []
    for (_, kv, m), r in out.items():
        rows.append(dict(section="tp_throughput", setup=label, kv_dtype=kv, mode=m, batch=args.batch,
                         prompt_len=args.prompt, decode_steps=args.steps, **r))
        log(f"{label} {m}: {r['tokens_per_s']:.1f} tok/s ({r['ms_per_step']:.3f} ms/step)")
    return rows


def modes(cuda):
    return ("eager", "graph") if cuda else ("eager",)


def save_rows(rec):
    """Append the rows so far (rank 0): a later hang or kill keeps them."""
    if rec.rows:
        rec.save()  # appends only the rows not saved yet


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--kv-dtype", default="int8")
    p.add_argument("--gen-batch", type=int, default=None)
    p.add_argument("--gen-prompt", type=int, default=None)
    p.add_argument("--gen-steps", type=int, default=None)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--prompt", type=int, default=None)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    defaults = (dict(gen_batch=1, gen_prompt=12, gen_steps=4, batch=2, prompt=16, steps=2, warmup=1) if args.tiny
                else dict(gen_batch=2, gen_prompt=1024, gen_steps=64, batch=32, prompt=8192, steps=32, warmup=3))
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    # bench_e2e's model arguments (same model as the single-GPU benchmark)
    model_args = e2e.parse_args(["--tiny"] if args.tiny else [])
    model_args.max_positions = max(args.prompt + 2 * (args.steps + args.warmup), args.gen_prompt + args.gen_steps) + 64

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if cuda:
        torch.cuda.set_device(local_rank)
    device = f"cuda:{local_rank}" if cuda else "cpu"
    import transformers

    out_dir = Path(args.out) if args.out else None
    rec = Recorder("tp_e2e", path=(out_dir / "tp_e2e.jsonl") if out_dir else None)
    rec.env.update(transformers=transformers.__version__, world_size=world)
    failures = []
    single = {}  # single-GPU throughput rows by mode (rank 0)
    ids = e2e.random_prompt(model_args.vocab, args.gen_batch, args.gen_prompt, args.seed + 1, device)

    # ---- rank 0 alone: build, save, single-GPU reference
    ref = {}
    # checkpoint path, the reference's floating buffers (rotary inv_freq), its greedy tokens
    holder = [None, None, None]
    if rank == 0:
        try:
            tmp = tempfile.mkdtemp(prefix="int8attn_tp_")
            built = e2e.build_model(model_args, device)
            built.save_pretrained(tmp)
            del built
            # The reference is the saved checkpoint loaded on one GPU: the very weights, dtypes
            # and config the sharded ranks load.
            model = load_single(tmp, device)
            holder[0] = tmp
            ref["int8"] = generate_tokens(model, ids, args.gen_steps, args.kv_dtype, device)
            ref["sdpa"], ref["sdpa_logits"] = generate_tokens(model, ids, args.gen_steps, None, device)
            ref["logits"], _ = teacher_forced_logits(model, ids, ref["int8"], args.kv_dtype, device)
            ref["sdpa_tf_logits"] = teacher_forced_sdpa(model, ids, ref["int8"])
            holder[2] = ref["int8"].cpu()
            log(f"single GPU: int8attn tokens {ref['int8'][0, :12].tolist()}...")
            holder[1] = {n: b.detach().cpu() for n, b in model.named_buffers() if b.is_floating_point()}
            bad = state_mismatches(model, {**checkpoint_tensors(tmp), **holder[1]})
            if bad:
                failures.append(f"single GPU model differs from its checkpoint: {bad[:8]}")
            save_rows(rec)
            if not args.skip_throughput:
                for mode in modes(cuda):
                    try:
                        for row in throughput(model, args, device, cuda, "single GPU", mode):
                            single[row["mode"]] = rec.add(**row)
                    except Exception as exc:
                        traceback.print_exc()
                        failures.append(f"single GPU {mode}: {type(exc).__name__}: {exc}")
                    save_rows(rec)
            del model
            e2e.free_memory()
        except Exception as exc:
            traceback.print_exc()
            failures.append(f"single GPU reference: {type(exc).__name__}: {exc}")
    dist.broadcast_object_list(holder, src=0)
    path = holder[0]
    if path is None:
        log("rank 0 could not save the model; stopping")
        dist.destroy_process_group()
        return 1

    # ---- all ranks: sharded model
    try:
        model = load_sharded(path, world)
        # Same function as the reference: every gathered weight equals the checkpoint's, and the
        # rotary buffers equal the single-GPU model's (value and dtype).
        state_bad = state_mismatches(model, {**checkpoint_tensors(path), **(holder[1] or {})})
        if state_bad:
            failures.append(f"rank {rank}: sharded model differs from the checkpoint / reference in {state_bad[:8]}")
            log(f"sharded model differs from the reference in {len(state_bad)} tensors: {state_bad[:8]}")
        attn = model.model.layers[0].self_attn
        local_q = local_rows(attn.q_proj.weight) // model.config.head_dim
        local_k = local_rows(attn.k_proj.weight) // model.config.head_dim
        tp_int8 = generate_tokens(model, ids, args.gen_steps, args.kv_dtype, device)
        tp_sdpa, tp_sdpa_logits = generate_tokens(model, ids, args.gen_steps, None, device)
        # Teacher forcing feeds the reference's tokens on EVERY rank: a TP forward is one
        # computation over all ranks, so the ranks must agree on its input.
        forced = holder[2].to(device) if holder[2] is not None else tp_int8
        if holder[2] is None:
            dist.broadcast(forced, src=0)
        tp_logits, cache = teacher_forced_logits(model, ids, forced, args.kv_dtype, device)
        tp_sdpa_tf_logits = teacher_forced_sdpa(model, ids, forced)
        local_kv = cache.layers[0].paged.num_kv_heads
        cfg = model.config
        if local_kv != local_k or local_q * cfg.num_key_value_heads != local_k * cfg.num_attention_heads:
            failures.append(f"rank {rank}: local heads {local_q} q / {local_k} k_proj / {local_kv} in the cache do not "
                            f"shard {model.config.num_attention_heads} / {model.config.num_key_value_heads} evenly")
        log(f"TP: {local_q} local q heads, {local_kv} local KV heads in this rank's int8attn cache "
            f"({cache.nbytes() / 2**20:.1f} MiB); tokens {tp_int8[0, :12].tolist()}...")
        if rank == 0 and "int8" in ref:
            same = tp_int8 == ref["int8"]
            first_div = [int((~r).nonzero()[0]) if (~r).any() else args.gen_steps for r in same]
            same_sdpa = tp_sdpa == ref["sdpa"]
            rel = rel_l2(tp_logits, ref["logits"])
            rel_sdpa_tf = rel_l2(tp_sdpa_tf_logits, ref["sdpa_tf_logits"])
            # SDPA control: TP's own numerics (bf16 all-reduce order), meaningful up to the first
            # step where the free-running SDPA tokens differ.
            n_same = int(same_sdpa.all(0).long().cumprod(0).sum()) if same_sdpa.numel() else 0
            rel_sdpa = ((tp_sdpa_logits[:, :n_same + 1] - ref["sdpa_logits"][:, :n_same + 1]).norm(dim=-1)
                        / ref["sdpa_logits"][:, :n_same + 1].norm(dim=-1)).flatten()
            row = rec.add(
                section="tp_tokens", kv_dtype=args.kv_dtype, batch=args.gen_batch, prompt_len=args.gen_prompt,
                steps=args.gen_steps, local_q_heads=local_q, local_kv_heads=local_kv,
                tokens_match_single_gpu=bool(same.all()), token_agreement=same.float().mean().item(),
                first_divergence_step=first_div,
                sdpa_tokens_match_single_gpu=bool(same_sdpa.all()),
                sdpa_token_agreement=same_sdpa.float().mean().item(),
                teacher_forced_logits_rel_l2_median=rel.median().item(),
                teacher_forced_logits_rel_l2_max=rel.max().item(),
                teacher_forced_logits_rel_l2_prefill_step=rel.view(args.gen_batch, -1)[:, 0].median().item(),
                sdpa_teacher_forced_logits_rel_l2_median=rel_sdpa_tf.median().item(),
                sdpa_teacher_forced_logits_rel_l2_max=rel_sdpa_tf.max().item(),
                int8attn_vs_sdpa_rel_l2_median_single_gpu=rel_l2(ref["logits"], ref["sdpa_tf_logits"]).median().item(),
                int8attn_vs_sdpa_rel_l2_median_tp=rel_l2(tp_logits, tp_sdpa_tf_logits).median().item(),
                sdpa_logits_rel_l2_median=rel_sdpa.median().item() if rel_sdpa.numel() else None,
                sharded_state_mismatches=state_bad,
            )
            log(f"TP vs one GPU (int8attn): tokens identical={row['tokens_match_single_gpu']} "
                f"agreement {row['token_agreement']:.3f} first divergence {first_div}; logits rel L2 median "
                f"{row['teacher_forced_logits_rel_l2_median']:.2e} max {row['teacher_forced_logits_rel_l2_max']:.2e}; "
                f"SDPA TP vs one GPU agreement {row['sdpa_token_agreement']:.3f}, teacher-forced logits rel L2 median "
                f"{row['sdpa_teacher_forced_logits_rel_l2_median']:.2e} "
                f"max {row['sdpa_teacher_forced_logits_rel_l2_max']:.2e}; "
                f"int8attn vs SDPA rel L2 median: one GPU {row['int8attn_vs_sdpa_rel_l2_median_single_gpu']:.2e}, "
                f"TP {row['int8attn_vs_sdpa_rel_l2_median_tp']:.2e}; sharded tensors differing: {state_bad}")
        del cache
        if rank == 0:
            save_rows(rec)
        if not args.skip_throughput:
            for mode in modes(cuda):
                for row in throughput(model, args, device, cuda, f"TP={world}", mode):
                    row["per_gpu_tokens_per_s"] = row["tokens_per_s"] / world
                    row["rank"] = rank
                    if row["mode"] in single:
                        row["per_gpu_vs_single_gpu"] = row["per_gpu_tokens_per_s"] / single[row["mode"]]["tokens_per_s"]
                        row["tp_vs_single_gpu"] = row["tokens_per_s"] / single[row["mode"]]["tokens_per_s"]
                    if rank == 0:
                        rec.add(**row)
                        save_rows(rec)
    except Exception as exc:
        traceback.print_exc()
        failures.append(f"rank {rank} TP: {type(exc).__name__}: {exc}")
    all_failures = [None] * world
    dist.all_gather_object(all_failures, failures)
    if rank == 0:
        for f in (x for fs in all_failures for x in fs):
            rec.add(section="tp_error", error=f[:500])
            log("FAILED", f)
        saved = rec.save()
        log(f"rows: {saved}")
        shutil.rmtree(path, ignore_errors=True)
    dist.barrier()
    dist.destroy_process_group()
    return 1 if any(all_failures) else 0


if __name__ == "__main__":
    sys.exit(main())
