"""Generate with a Hugging Face transformers model whose KV cache is int8attn's INT8 paged cache.

    python examples/generate_transformers.py                  # GPU: Qwen3.5-27B attention shape, 4 layers
    python examples/generate_transformers.py --tiny           # CPU (Triton interpreter): a tiny model
    python examples/generate_transformers.py --model DIR      # a local checkpoint instead of random weights
    python examples/generate_transformers.py --cuda-graph     # decode steps replayed from a CUDA graph

The model attends through the "int8attn" attention implementation; K/V live as INT8 (one
fp32 scale per token and KV head) in one paged cache per layer, read by the INT8 tensor-core
kernels. The same prompt is also generated with transformers' SDPA (BF16) for comparison.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

if not torch.cuda.is_available():  # the kernels run in Triton's CPU interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM  # noqa: E402

from int8attn.integrations.transformers import (  # noqa: E402
    CUDAGraphDecoder,
    Int8PagedCache,
    cache_argument_name,
    register,
)


def build_model(args, device):
    if args.model:
        return AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).to(device).eval()
    if args.tiny:
        config = Qwen3Config(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                             num_attention_heads=6, num_key_value_heads=2, head_dim=64)
    else:  # the Qwen3.5-27B full-attention shape: 24 q heads, 4 KV heads, head_dim 256
        config = Qwen3Config(vocab_size=32000, hidden_size=2048, intermediate_size=4096, num_hidden_layers=4,
                             num_attention_heads=24, num_key_value_heads=4, head_dim=256,
                             max_position_embeddings=32768)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(config)
    return model.to(dtype=torch.bfloat16).eval()


@torch.inference_mode()
def greedy_with_cuda_graph(model, cache, input_ids, max_new_tokens):
    """Eager prefill, then one captured decode step replayed per token."""
    batch, prompt_len = input_ids.shape
    kw = {cache_argument_name(model): cache, "use_cache": True}
    token = model(input_ids, logits_to_keep=1, **kw).logits[:, -1].argmax(-1, keepdim=True)
    runner = CUDAGraphDecoder(model, cache, batch_size=batch)
    position = torch.full_like(token, prompt_len)
    tokens = [token]
    for _ in range(max_new_tokens - 1):
        token = runner.step(token, position).argmax(-1, keepdim=True)
        position += 1
        tokens.append(token)
    return torch.cat([input_ids] + tokens, dim=1)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="local checkpoint directory (default: random weights)")
    p.add_argument("--tiny", action="store_true", help="a tiny model (default without a GPU)")
    p.add_argument("--kv-dtype", default="int8", choices=["int8", "fp8", "bf16"])
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--prompt-len", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--cuda-graph", action="store_true")
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    args.tiny = args.tiny or device == "cpu"
    batch = args.batch or (2 if args.tiny else 4)
    prompt_len = args.prompt_len or (12 if args.tiny else 2048)
    new_tokens = args.max_new_tokens or (6 if args.tiny else 64)

    register()  # adds "int8attn" to transformers' AttentionInterface
    model = build_model(args, device)
    input_ids = torch.randint(0, model.config.vocab_size, (batch, prompt_len),
                              generator=torch.Generator().manual_seed(1)).to(device)

    model.set_attn_implementation("sdpa")
    reference = model.generate(input_ids, max_new_tokens=new_tokens, do_sample=False)

    model.set_attn_implementation("int8attn")
    cache = Int8PagedCache(model.config, max_batch_size=batch, max_cache_len=prompt_len + new_tokens,
                           kv_dtype=args.kv_dtype)
    start = time.perf_counter()
    if args.cuda_graph:
        output = greedy_with_cuda_graph(model, cache, input_ids, new_tokens)
    else:
        output = model.generate(input_ids, max_new_tokens=new_tokens, do_sample=False,
                                **{cache_argument_name(model): cache})
    seconds = time.perf_counter() - start

    layer = cache.layers[0].paged
    print(f"cache: {cache}")
    scales = "none" if layer.key_scale is None else f"{tuple(layer.key_scale.shape)} fp32"
    print(f"layer 0 pages: key {tuple(layer.key.shape)} {layer.key.dtype}, scales {scales}")
    new = output[:, prompt_len:]
    same = (new == reference[:, prompt_len:]).float().mean().item()
    print(f"generated {new.numel()} tokens in {seconds:.2f} s; agreement with SDPA BF16 greedy: {same:.0%}")
    for row in new[:2].tolist():
        print("  ", row)


if __name__ == "__main__":
    main()
