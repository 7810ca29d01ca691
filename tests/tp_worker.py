"""One rank of the CPU tensor-parallel check (tests/test_integration_transformers_tp.py).

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/tp_worker.py DIR

Kernels run under Triton's interpreter (TRITON_INTERPRET=1 in the environment), the ranks
talk over gloo. Rank 0 builds a tiny Qwen3 (random weights), saves it to DIR and, alone,
loads it back unsharded and records the reference: teacher-forced logits with an int8attn
cache and that cache's dequantized K/V, and the same logits with SDPA (a control). Then every rank loads DIR with transformers'
tensor-parallel plan (q/k/v colwise: each rank gets num_key_value_heads / world KV heads),
runs the same teacher-forced steps with its own Int8PagedCache (and with SDPA) and saves, to
DIR/rank{r}.pt, its logits, its local head counts and its cache's dequantized K/V. The
test reads the files and asserts; this script checks nothing itself.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

BATCH, PROMPT, STEPS = 2, 12, 4
CONFIG = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8,
              num_key_value_heads=4, head_dim=64, max_position_embeddings=128)


def teacher_forced(model, tokens, sdpa=False):
    """Logits [B, T - PROMPT + 1, V] (fp32): prefill tokens[:, :PROMPT], then one token a step;
    and the cache, which holds K/V of all tokens: an Int8PagedCache with "int8attn" attention,
    or with ``sdpa`` transformers' own (DynamicCache, SDPA: the control for TP's numerics)."""
    from transformers import DynamicCache

    from int8attn.integrations.transformers import Int8PagedCache, cache_argument_name

    model.set_attn_implementation("sdpa" if sdpa else "int8attn")
    cache = (DynamicCache(config=model.config) if sdpa else
             Int8PagedCache(model.config, max_batch_size=BATCH, max_cache_len=tokens.shape[1] + 1, device="cpu"))
    kw = {cache_argument_name(model): cache, "use_cache": True}
    with torch.inference_mode():
        out = [model(tokens[:, :PROMPT], **kw).logits[:, -1].float()]
        for t in range(PROMPT, tokens.shape[1]):
            out.append(model(tokens[:, t:t + 1], **kw).logits[:, -1].float())
    return torch.stack(out, 1), cache


def cache_contents(cache, length):
    """Per layer: dequantized K, V [B, length, local KV heads, D] (float64) and the page shape."""
    from int8attn.reference import gather_kv

    layers = []
    for layer in cache.layers:
        paged = layer.paged
        kv = [gather_kv(paged, cache.block_table[b], length) for b in range(BATCH)]
        layers.append(dict(num_kv_heads=paged.num_kv_heads, key_shape=tuple(paged.key.shape),
                           k=torch.stack([k for k, _ in kv]), v=torch.stack([v for _, v in kv])))
    return layers


def main(out: Path) -> int:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from int8attn.integrations.transformers import register

    register()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ckpt = out / "model"
    tokens = torch.randint(0, CONFIG["vocab_size"], (BATCH, PROMPT + STEPS), generator=torch.Generator().manual_seed(1))
    if rank == 0:
        torch.manual_seed(0)
        Qwen3ForCausalLM(Qwen3Config(**CONFIG)).to(torch.bfloat16).save_pretrained(ckpt)
        single = Qwen3ForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16, attn_implementation="int8attn").eval()
        logits, cache = teacher_forced(single, tokens)
        torch.save(dict(logits=logits, sdpa_logits=teacher_forced(single, tokens, sdpa=True)[0],
                        cache=cache_contents(cache, tokens.shape[1])), out / "single.pt")
        del single, cache
    dist.barrier()

    from transformers import DistributedConfig

    model = Qwen3ForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16, attn_implementation="int8attn",
                                             distributed_config=DistributedConfig(tp_size=world)).eval()
    attn = model.model.layers[0].self_attn
    local = lambda w: (w.to_local() if hasattr(w, "to_local") else w).shape[0] // CONFIG["head_dim"]  # noqa: E731
    logits, cache = teacher_forced(model, tokens)
    sdpa_logits = teacher_forced(model, tokens, sdpa=True)[0]
    torch.save(dict(world=world, local_q_heads=local(attn.q_proj.weight), local_k_heads=local(attn.k_proj.weight),
                    logits=logits, sdpa_logits=sdpa_logits, cache=cache_contents(cache, tokens.shape[1])),
               out / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
