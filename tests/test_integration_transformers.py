"""transformers integration: generate() end to end with the INT8 paged cache on a tiny
Qwen3 model (random weights), compared with transformers' own SDPA path; the cache holds
INT8 pages only; unsupported uses fail with clear errors. CPU runs use the Triton
interpreter, so the model is tiny (2 layers, hidden 128, head_dim 64)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import DynamicCache, Qwen3Config, Qwen3ForCausalLM  # noqa: E402

from _ids import cases
from int8attn.integrations.transformers import (  # noqa: E402
    CUDAGraphDecoder,
    Int8PagedCache,
    cache_argument_name,
    register,
)

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def tiny_config(**overrides):
    kw = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=6,
              num_key_value_heads=2, head_dim=64, max_position_embeddings=512)
    kw.update(overrides)
    return Qwen3Config(**kw)


@pytest.fixture(scope="module")
def model():
    register()
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return Qwen3ForCausalLM(tiny_config()).to(device=device, dtype=torch.bfloat16).eval()


def device_of(model):
    return next(model.parameters()).device


def prompt(model, batch, length, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (batch, length), generator=gen).to(device_of(model))


@torch.inference_mode()
def teacher_forced_logits(model, cache, tokens, prompt_len):
    """Prefill tokens[:, :prompt_len], then feed tokens[:, t] one by one; logits of every step."""
    kw = {cache_argument_name(model): cache, "use_cache": True}
    logits = [model(tokens[:, :prompt_len], **kw).logits[:, -1].float()]
    for t in range(prompt_len, tokens.shape[1]):
        logits.append(model(tokens[:, t: t + 1], **kw).logits[:, -1].float())
    return torch.stack(logits, 1)


def rel_l2(a, b):
    return ((a - b).norm() / b.norm()).item()


def sdpa_and_cache_logits(model, seed: int, **cache_options):
    """Greedy continuation of a 2 x 13 prompt under SDPA, then the teacher-forced logits of
    SDPA and of an Int8PagedCache with ``cache_options`` over it: (cache, logits, ref_logits)."""
    ids = prompt(model, 2, 13, seed=seed)
    model.set_attn_implementation("sdpa")
    ref = model.generate(ids, max_new_tokens=4, do_sample=False)
    ref_logits = teacher_forced_logits(model, DynamicCache(config=model.config), ref, ids.shape[1])
    model.set_attn_implementation("int8attn")
    try:
        cache = Int8PagedCache(model.config, max_batch_size=2, max_cache_len=32, **cache_options)
        logits = teacher_forced_logits(model, cache, ref, ids.shape[1])
    finally:
        model.set_attn_implementation("sdpa")
    return cache, logits, ref_logits


# --------------------------------------------------------------------------- generate
@pytest.mark.slow  # 20-25 s per case under the interpreter
@cases("kv_dtype,bound", [("int8", 0.05), ("bf16", 0.02)])
def test_generate_end_to_end_matches_sdpa(model, kv_dtype, bound):
    ids = prompt(model, 2, 11)
    model.set_attn_implementation("sdpa")
    ref = model.generate(ids, max_new_tokens=5, do_sample=False)
    ref_logits = teacher_forced_logits(model, DynamicCache(config=model.config), ref, ids.shape[1])
    model.set_attn_implementation("int8attn")
    try:
        cache = Int8PagedCache(model.config, max_batch_size=2, max_cache_len=32, kv_dtype=kv_dtype)
        out = model.generate(ids, max_new_tokens=5, do_sample=False, **{cache_argument_name(model): cache})
        assert out.shape == ref.shape and torch.equal(out[:, :11], ids)
        cache = Int8PagedCache(model.config, max_batch_size=2, max_cache_len=32, kv_dtype=kv_dtype)
        logits = teacher_forced_logits(model, cache, ref, ids.shape[1])
    finally:
        model.set_attn_implementation("sdpa")
    for step in range(logits.shape[1]):
        assert rel_l2(logits[:, step], ref_logits[:, step]) < bound, f"step {step}"
    # Greedy tokens: random weights give near-flat logits, so a token may flip on a near-tie;
    # it must agree wherever SDPA's top-1 margin exceeds twice the largest logit error.
    first = ref_logits[:, 0].topk(2, dim=-1).values
    margin = first[:, 0] - first[:, 1]
    err = (logits[:, 0] - ref_logits[:, 0]).abs().amax(-1)
    confident = margin > 2 * err
    assert torch.equal(out[:, 11][confident], ref[:, 11][confident])


def test_cache_holds_int8_pages_only(model):
    ids = prompt(model, 2, 20, seed=1)
    model.set_attn_implementation("int8attn")
    try:
        cache = Int8PagedCache(model.config, max_batch_size=2, max_cache_len=40, block_size=16)
        model.generate(ids, max_new_tokens=3, do_sample=False, **{cache_argument_name(model): cache})
    finally:
        model.set_attn_implementation("sdpa")
    assert cache.get_seq_length() == 22  # the last generated token is never fed back
    for layer in cache.layers:
        paged = layer.paged
        assert paged.key.dtype == torch.int8 and paged.value.dtype == torch.int8
        assert layer.keys is paged.key and layer.values is paged.value  # no dense copy anywhere
        assert paged.key_mean is not None and torch.isfinite(paged.key_scale).all()
        assert layer.length == 22
    # 22 tokens per sequence = 2 pages each, 4 distinct pages in all.
    table = cache.block_table[:2, :2].cpu()
    assert table.unique().numel() == 4
    assert cache.nbytes() == sum(layer.paged.nbytes() for layer in cache.layers)


def test_reset_then_generate_again_is_identical(model):
    """Also: a cache first filled under inference_mode keeps working outside it."""
    ids = prompt(model, 1, 9, seed=2)
    model.set_attn_implementation("int8attn")
    try:
        cache = Int8PagedCache(model.config, max_batch_size=1, max_cache_len=24)
        kw = {cache_argument_name(model): cache}
        with torch.inference_mode():
            model(ids, **kw, use_cache=True)
        cache.reset()
        first = model.generate(ids, max_new_tokens=3, do_sample=False, **kw)
        cache.reset()
        second = model.generate(ids, max_new_tokens=3, do_sample=False, **kw)
    finally:
        model.set_attn_implementation("sdpa")
    assert torch.equal(first, second)


@pytest.mark.slow  # about 20 s under the interpreter
@torch.inference_mode()
def test_multi_token_step_and_custom_ops_path(model):
    """A 3-token verification step after a prefill gives the logits of three 1-token steps;
    the torch.library op path gives the same numbers as the direct launchers."""
    ids = prompt(model, 1, 14, seed=3)
    model.set_attn_implementation("int8attn")
    try:
        results = []
        for use_custom_ops, chunks in ((False, (11, 1, 1, 1)), (False, (11, 3)), (True, (11, 3))):
            cache = Int8PagedCache(model.config, max_batch_size=1, max_cache_len=32, use_custom_ops=use_custom_ops)
            kw = {cache_argument_name(model): cache, "use_cache": True}
            start, logits = 0, []
            for n in chunks:
                logits.append(model(ids[:, start: start + n], **kw).logits.float())
                start += n
            results.append(torch.cat(logits, 1)[:, 10:])
    finally:
        model.set_attn_implementation("sdpa")
    assert rel_l2(results[1], results[0]) < 0.02
    assert torch.equal(results[1], results[2])


# --------------------------------------------------------------------------- refusals
def test_refuses_what_it_does_not_support(model):
    ids = prompt(model, 2, 6)
    model.set_attn_implementation("int8attn")
    try:
        with pytest.raises(RuntimeError, match="Int8PagedCache"):
            model.generate(ids, max_new_tokens=1, do_sample=False)  # transformers' own DynamicCache
        padded = torch.ones_like(ids)
        padded[0, :2] = 0
        cache = Int8PagedCache(model.config, max_batch_size=2, max_cache_len=16)
        with pytest.raises(ValueError, match="padded"):
            model.generate(ids, attention_mask=padded, max_new_tokens=1, do_sample=False,
                           **{cache_argument_name(model): cache})
        small = Int8PagedCache(model.config, max_batch_size=1, max_cache_len=16)
        with pytest.raises(ValueError, match="at most 1"):
            model(ids, **{cache_argument_name(model): small, "use_cache": True})
        short = Int8PagedCache(model.config, max_batch_size=2, max_cache_len=4)
        with pytest.raises(ValueError, match="max_cache_len"):
            model(ids, **{cache_argument_name(model): short, "use_cache": True})
    finally:
        model.set_attn_implementation("sdpa")
    from types import SimpleNamespace

    chunked = SimpleNamespace(num_hidden_layers=2, layer_types=["chunked_attention", "full_attention"])
    with pytest.raises(ValueError, match="chunked_attention"):
        Int8PagedCache(chunked, max_batch_size=1, max_cache_len=16)
    with pytest.raises(ValueError):
        Int8PagedCache(model.config, max_batch_size=1, max_cache_len=16, kv_dtype="int4")
    with pytest.raises(ValueError):
        Int8PagedCache(model.config, max_batch_size=1, max_cache_len=16, block_size=12)


@pytest.mark.slow  # ~30 s under the interpreter
@torch.inference_mode()
def test_sliding_window_layers_match_sdpa(model):
    """A model with a sliding-window layer (window 8 over 17 positions, as Gemma's local
    layers and Mistral have): teacher-forced logits through the INT8 cache (prefill, then
    decode steps) match transformers' SDPA with its sliding-window mask, while the same
    weights with full attention everywhere are far from it (the window matters here)."""
    sliding_config = tiny_config(layer_types=["sliding_attention", "full_attention"], sliding_window=8,
                                 use_sliding_window=True)
    device = device_of(model)
    sliding = Qwen3ForCausalLM(sliding_config).to(device=device, dtype=torch.bfloat16).eval()
    sliding.load_state_dict(model.state_dict())
    ids = prompt(sliding, 2, 13, seed=5)
    sliding.set_attn_implementation("sdpa")
    ref = sliding.generate(ids, max_new_tokens=4, do_sample=False)
    ref_logits = teacher_forced_logits(sliding, DynamicCache(config=sliding.config), ref, ids.shape[1])
    full_logits = teacher_forced_logits(model, DynamicCache(config=model.config), ref, ids.shape[1])
    sliding.set_attn_implementation("int8attn")
    cache = Int8PagedCache(sliding.config, max_batch_size=2, max_cache_len=32)
    logits = teacher_forced_logits(sliding, cache, ref, ids.shape[1])
    err, full_err = rel_l2(logits, ref_logits), rel_l2(full_logits, ref_logits)
    print(f"sliding-window model: INT8 cache {err:.4f}, full attention {full_err:.4f} (rel-L2 of logits)")
    assert err < 0.05, f"logits rel-L2 {err:.4f} against SDPA with the window"
    assert full_err > 4 * err, f"full attention is only {full_err:.4f} from the windowed model: the test is blind"


# --------------------------------------------------------------------------- CUDA graphs (GPU)
@GPU
@torch.inference_mode()
def test_cuda_graph_decode_matches_eager_decode(model):
    ids = prompt(model, 3, 40, seed=4)
    model.set_attn_implementation("int8attn")
    try:
        kw_name = cache_argument_name(model)
        caches = [Int8PagedCache(model.config, max_batch_size=3, max_cache_len=80) for _ in range(2)]
        first = []
        for cache in caches:
            first.append(model(ids, **{kw_name: cache, "use_cache": True}, logits_to_keep=1).logits[:, -1])
        token = first[0].argmax(-1, keepdim=True)
        pos = torch.full((3, 1), 40, dtype=torch.long, device=ids.device)
        runner = CUDAGraphDecoder(model, caches[1], batch_size=3)
        for _ in range(20):  # crosses page boundaries (block_size 16) several times
            eager = model(token, position_ids=pos, **{kw_name: caches[0], "use_cache": True}).logits[:, -1]
            graphed = runner.step(token, pos)
            assert rel_l2(graphed.float(), eager.float()) < 1e-3
            token = eager.argmax(-1, keepdim=True)
            pos += 1
    finally:
        model.set_attn_implementation("sdpa")
    assert caches[0].get_seq_length() == caches[1].get_seq_length() == 60


@GPU
@torch.inference_mode()
def test_cuda_graph_static_cache_refuses_overflow_on_the_host(model):
    """A StaticCache write past max_cache_len is a device-side assert (the CUDA context is
    lost): the decoder refuses that step on the host, and the context stays usable."""
    from transformers import StaticCache

    ids = prompt(model, 2, 10, seed=6)
    model.set_attn_implementation("sdpa")
    cache = StaticCache(config=model.config, max_cache_len=13)
    token = model(ids, **{cache_argument_name(model): cache, "use_cache": True}).logits[:, -1:].argmax(-1)
    runner = CUDAGraphDecoder(model, cache, batch_size=2)
    pos = torch.full((2, 1), 10, dtype=torch.long, device=ids.device)
    for _ in range(3):  # positions 10, 11, 12 fit
        token = runner.step(token, pos).argmax(-1, keepdim=True)
        pos += 1
    with pytest.raises(ValueError, match="max_cache_len=13"):
        runner.step(token, pos)
    torch.cuda.synchronize()
    assert int(cache.layers[0].cumulative_length) == 13


# --------------------------------------------------------------------------- continuous batching
def _has_paged_dispatch() -> bool:
    from transformers import AttentionInterface

    return "paged|sdpa" in AttentionInterface._global_mapping


@GPU
@pytest.mark.skipif(not _has_paged_dispatch(), reason="this transformers release has no paged| attention dispatch")
def test_continuous_batching_paged_variant(model):
    """transformers' continuous batching (generate_batch) with paged|int8attn: the pages
    transformers hands out are mirrored as INT8 pages and give SDPA's tokens."""
    from transformers import GenerationConfig
    from transformers.generation import ContinuousBatchingConfig

    from int8attn.integrations.transformers import paged as integ

    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=gen).tolist() for n in (7, 30, 19)]
    config = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=-1, pad_token_id=0)
    # Small pages and a small pool: sequences span several pages.
    cb_config = ContinuousBatchingConfig(block_size=16, num_blocks=32, max_batch_tokens=128)
    results = {}
    for impl in ("paged|sdpa", "paged|int8attn"):
        model.set_attn_implementation(impl)
        try:
            out = model.generate_batch(inputs=prompts, generation_config=config,
                                       continuous_batching_config=cb_config)
        finally:
            model.set_attn_implementation("sdpa")
        results[impl] = [out[k].generated_tokens for k in sorted(out)]
    assert all(len(t) == 6 for t in results["paged|int8attn"])
    ref = torch.tensor(results["paged|sdpa"])
    got = torch.tensor(results["paged|int8attn"])
    assert (got == ref).float().mean() >= 0.8, (got, ref)
    mirrors = next(iter(integ._PAGED_MIRRORS.values()))[1]
    assert len(mirrors) == model.config.num_hidden_layers
    assert all(m.key.dtype == torch.int8 for m in mirrors.values())


# --------------------------------------------------------------------------- channel migration
@cases("migration", ["first_write", "none"])
def test_channel_migration_calibrates_each_layer_on_its_first_step(model, migration):
    """The first write of each layer waits for the attention call's queries, calibrates the
    layer's scale from them and its keys, then writes; later steps write at once."""
    cache, logits, ref_logits = sdpa_and_cache_logits(model, 3, channel_migration=migration)
    for layer in cache.layers:
        assert layer.pending_write is None
        if migration == "none":
            assert layer.paged.key_channel_scale is None
        else:
            lam = layer.paged.key_channel_scale
            assert lam is not None and torch.isfinite(lam).all() and (lam > 0).all() and not (lam == 1).all()
    for step in range(logits.shape[1]):
        assert rel_l2(logits[:, step], ref_logits[:, step]) < 0.05, f"step {step}"


# --------------------------------------------------------------------------- Q/K rotation
def test_qk_rotation_leaves_the_model_output_and_refuses_what_it_cannot_rotate(model):
    """qk_rotation="hadamard" rotates queries and keys by one orthonormal matrix: scores,
    and so the model's output, stay those of SDPA within the INT8 cache's error; the
    stored keys are the rotated ones. A head_dim that is not a power of two is refused."""
    cache, logits, ref_logits = sdpa_and_cache_logits(model, 5, qk_rotation="hadamard")
    for step in range(logits.shape[1]):
        assert rel_l2(logits[:, step], ref_logits[:, step]) < 0.05, f"step {step}"
    assert cache._rotation is not None and cache._rotation.shape == (64, 64)
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        Int8PagedCache(tiny_config(head_dim=96), max_batch_size=1, max_cache_len=16, qk_rotation="hadamard")
    with pytest.raises(ValueError, match="qk_rotation"):
        Int8PagedCache(model.config, max_batch_size=1, max_cache_len=16, qk_rotation="random")
