"""The int8attn:: torch.library ops: schemas (exact mutations), results identical to the
eager launchers and close to the float64 reference, fake implementations (torch.compile,
opcheck), rejected inputs, and -- on a GPU -- CUDA-graph capture and replay with changing
seq_lens and block tables."""

import copy

import pytest
import torch

from _ids import cases
from int8attn import reference
from int8attn.cache import PagedKVCache
from int8attn.ops import library
from int8attn.testing import assert_close_verbose, make_keys, make_normal, make_paged_batch, poisoned_like

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def eager_ops():
    from int8attn.ops.attention import attention
    from int8attn.ops.producer import rope_quantize_and_write
    from int8attn.ops.write import write_kv

    return write_kv, rope_quantize_and_write, attention


def written_args(op) -> set:
    return {a.name for a in op.default._schema.arguments if a.alias_info is not None and a.alias_info.is_write}


def caches_equal(a: PagedKVCache, b: PagedKVCache) -> bool:
    same = torch.equal(a.key.view(torch.uint8), b.key.view(torch.uint8)) and torch.equal(
        a.value.view(torch.uint8), b.value.view(torch.uint8))
    if a.quantized:
        same = same and torch.equal(a.key_scale, b.key_scale) and torch.equal(a.value_scale, b.value_scale)
    if (a.key_mean is None) != (b.key_mean is None):
        return False
    return same and (a.key_mean is None or torch.equal(a.key_mean, b.key_mean))


def new_tokens(n, num_kv_heads, head_dim, gen, device):
    key = make_keys(n, num_kv_heads, head_dim, generator=gen).to(device)
    value = make_normal((n, num_kv_heads, head_dim), generator=gen).to(device)
    return key, value


# --------------------------------------------------------------------------- schemas
def test_schemas_declare_exactly_the_mutated_tensors():
    ops = torch.ops.int8attn
    assert written_args(ops.write_kv) == {"key_cache", "value_cache", "key_scale", "value_scale"}
    assert written_args(ops.rope_quantize_and_write) == {
        "key_cache", "value_cache", "key_scale", "value_scale", "out_q", "out_q_scale"}
    assert written_args(ops.attention) == {"out"}
    assert written_args(ops.quantize_query) == set()


# --------------------------------------------------------------------------- write_kv
@pytest.mark.parametrize("kv_dtype", ["int8", "fp8", "bf16"])
def test_write_kv_op_matches_eager_bit_for_bit(kv_dtype, device, gen):
    write_eager = eager_ops()[0]
    cache_op = PagedKVCache(6, 16, 2, 64, kv_dtype=kv_dtype, device=device)
    cache_eager = copy.deepcopy(cache_op)
    # Two writes: the first sets the key-smoothing mean (int8/fp8), the second uses it.
    for n in (17, 5):
        key, value = new_tokens(n, 2, 64, gen, device)
        slots = torch.randperm(cache_op.num_slots, generator=gen)[:n].to(device)
        slots[3] = -1
        library.write_kv(cache_op, key, value, slots)
        write_eager(cache_eager, key, value, slots)
    assert (cache_op.key_mean is not None) == (kv_dtype != "bf16")
    assert caches_equal(cache_op, cache_eager)


def test_write_kv_op_rejects_bad_input_and_leaves_cache_untouched(device, gen, host_value_checks):
    cache = PagedKVCache(4, 16, 2, 64, device=device)
    key, value = new_tokens(5, 2, 64, gen, device)
    library.write_kv(cache, key, value, torch.arange(5, device=device))
    before = copy.deepcopy(cache)
    with pytest.raises(TypeError):
        library.write_kv(cache, key.to(torch.int32), value, torch.arange(5, device=device))
    with pytest.raises(ValueError):
        library.write_kv(cache, key[:, :1].contiguous(), value[:, :1].contiguous(), torch.arange(5, device=device))
    with pytest.raises(ValueError):
        library.write_kv(cache, key, value, torch.tensor([0, 1, 2, 3, cache.num_slots], device=device))
    assert caches_equal(cache, before)


# --------------------------------------------------------------------------- attention
@cases("kv_dtype,group", [("int8", 6), ("fp8", 4), ("bf16", 1)])
def test_attention_op_matches_eager_and_reference(kv_dtype, group, device):
    batch = make_paged_batch([17, 40, 3], [1, 4, 3], num_q_heads=2 * group, num_kv_heads=2, head_dim=64,
                             kv_dtype=kv_dtype, device=device, seed=7)
    args = (batch.query, batch.cache, batch.block_table, batch.seq_lens, batch.query_start_loc)
    out = poisoned_like(batch.query)
    result = library.attention(*args, out=out)
    assert result is out
    assert torch.isfinite(out).all(), "the op left elements of out unwritten"
    expected = eager_ops()[2](*args)
    assert torch.equal(out, expected), "the op and the eager launcher disagree"
    ref = reference.attention_reference(*args)
    assert_close_verbose(out, ref, rel_l2={"int8": 0.03, "fp8": 0.06, "bf16": 0.01}[kv_dtype], name="attention")


def test_attention_op_sliding_window_matches_eager(device):
    batch = make_paged_batch([97, 40, 3], [1, 4, 3], num_q_heads=4, num_kv_heads=2, head_dim=64, device=device,
                             seed=9)
    args = (batch.query, batch.cache, batch.block_table, batch.seq_lens, batch.query_start_loc)
    out = library.attention(*args, out=poisoned_like(batch.query), window=5)
    assert torch.equal(out, eager_ops()[2](*args, window=5)), "the op and the eager launcher disagree"
    assert not torch.equal(out, eager_ops()[2](*args)), "the window was dropped on the way"
    with pytest.raises(ValueError, match="window"):
        library.attention(*args, window=0)


def test_attention_op_rejects_bad_input(device):
    batch = make_paged_batch([9], [1], num_q_heads=4, num_kv_heads=2, head_dim=64, device=device)
    q, c, bt, sl, qsl = batch.query, batch.cache, batch.block_table, batch.seq_lens, batch.query_start_loc
    with pytest.raises(ValueError):  # 3 query heads over 2 KV heads
        library.attention(q[:, :3].contiguous(), c, bt, sl, qsl)
    with pytest.raises(TypeError):
        library.attention(q, c, bt.long(), sl, qsl)
    with pytest.raises(ValueError):
        library.attention(q, c, bt, sl, qsl, out=torch.empty(2, 4, 64, dtype=torch.bfloat16, device=device))


# --------------------------------------------------------------------------- producer, quantize_query
@pytest.mark.parametrize("kv_dtype", ["int8", "bf16"])
def test_producer_op_matches_eager(kv_dtype, device, gen):
    producer_eager = eager_ops()[1]
    n, hq, hkv, d = 7, 4, 2, 64
    cos_sin = reference.rope_cos_sin_cache(64, 32).to(device)
    cache_op = PagedKVCache(4, 16, hkv, d, kv_dtype=kv_dtype, device=device)
    cache_eager = copy.deepcopy(cache_op)
    for _ in range(2):  # first write (key mean) + a later one
        query = make_normal((n, hq, d), generator=gen).to(device)
        key, value = new_tokens(n, hkv, d, gen, device)
        positions = torch.randint(0, 64, (n,), generator=gen).to(device)
        slots = torch.randperm(cache_op.num_slots, generator=gen)[:n].to(device)
        q_op, s_op = library.rope_quantize_and_write(query, key, value, positions, cos_sin, cache_op, slots)
        q_ref, s_ref = producer_eager(query, key, value, positions, cos_sin, cache_eager, slots)
        assert torch.equal(q_op.view(torch.uint8) if q_op.dtype != torch.bfloat16 else q_op,
                           q_ref.view(torch.uint8) if q_ref.dtype != torch.bfloat16 else q_ref)
        assert (s_op is None) == (s_ref is None) and (s_op is None or torch.equal(s_op, s_ref))
    assert caches_equal(cache_op, cache_eager)


def test_quantize_query_op_matches_reference(device, gen):
    query = make_normal((5, 3, 64), generator=gen).to(device)
    for kv_dtype in ("int8", "fp8"):
        q, s = library.quantize_query(query, kv_dtype)
        q_ref, s_ref = reference.quantize_rows(query.cpu(), kv_dtype)
        assert torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s.cpu(), s_ref)
    q, s = library.quantize_query(query, "bf16")
    assert q is query and s is None


# --------------------------------------------------------------------------- tracing
def test_ops_trace_under_torch_compile(device, gen):
    """fullgraph: the wrappers and ops trace without a graph break; results equal eager."""
    batch = make_paged_batch([20, 33], [1, 1], num_q_heads=4, num_kv_heads=2, head_dim=64, device=device, seed=3)
    cache_c = batch.cache
    cache_e = copy.deepcopy(cache_c)
    key, value = new_tokens(2, 2, 64, gen, device)
    slots = torch.tensor([cache_c.num_slots - 1, cache_c.num_slots - 2], device=device)

    def step(cache, query, key, value, slots, block_table, seq_lens, qsl):
        library.write_kv(cache, key, value, slots)
        return library.attention(query, cache, block_table, seq_lens, qsl) * 1.0

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    args = (batch.query, key, value, slots, batch.block_table, batch.seq_lens, batch.query_start_loc)
    out_c = compiled(cache_c, *args)
    out_e = step(cache_e, *args)
    assert caches_equal(cache_c, cache_e)
    assert torch.equal(out_c, out_e)


def test_opcheck(device, gen):
    """torch.library.opcheck: schema vs real mutations, fake impls, functionalization."""
    batch = make_paged_batch([18], [2], num_q_heads=4, num_kv_heads=2, head_dim=64, device=device, seed=5)
    c = batch.cache
    key, value = new_tokens(3, 2, 64, gen, device)
    slots = torch.tensor([40, 41, -1], device=device)
    torch.library.opcheck(torch.ops.int8attn.write_kv.default,
                          (key, value, slots, c.key.clone(), c.value.clone(), c.key_scale.clone(),
                           c.value_scale.clone(), c.key_mean))
    out = torch.empty_like(batch.query)
    torch.library.opcheck(torch.ops.int8attn.attention.default,
                          (batch.query, c.key, c.value, c.key_scale, c.value_scale, batch.block_table,
                           batch.seq_lens, batch.query_start_loc, out, None, None, None, None))
    torch.library.opcheck(torch.ops.int8attn.quantize_query.default, (batch.query, "int8"))


def test_fake_impl_reports_bad_shapes_at_trace_time(device):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        kc = torch.empty(4, 2, 16, 64, dtype=torch.int8)
        vc = torch.empty(4, 2, 64, 16, dtype=torch.int8)  # 8-bit V pages are stored transposed
        sc = torch.empty(4, 2, 16)
        q = torch.empty(3, 5, 64, dtype=torch.bfloat16)  # 5 heads over 2 KV heads
        bt = torch.empty(1, 4, dtype=torch.int32)
        sl = torch.empty(1, dtype=torch.int32)
        qsl = torch.empty(2, dtype=torch.int32)
        with pytest.raises(ValueError):
            torch.ops.int8attn.attention(q, kc, vc, sc, sc, bt, sl, qsl, torch.empty_like(q), None, None, None, None)
        with pytest.raises(TypeError):
            torch.ops.int8attn.write_kv(torch.empty(3, 2, 64, dtype=torch.int32), torch.empty(3, 2, 64),
                                        torch.empty(3, dtype=torch.int64), kc, vc, sc, sc, None)


# --------------------------------------------------------------------------- CUDA graphs (GPU)
@GPU
@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_cuda_graph_replay_with_changing_seq_lens_and_block_tables(kv_dtype):
    """Capture write_kv + attention once; replay with new seq_lens, block tables, slots and
    tokens written into the static inputs; every replay matches the reference."""
    torch.manual_seed(0)
    num_seqs, hq, hkv, d, bs, width = 4, 24, 4, 256, 16, 24
    cache = PagedKVCache(num_seqs * width + 8, bs, hkv, d, kv_dtype=kv_dtype, device="cuda")
    gen = torch.Generator().manual_seed(0)
    warm = make_keys(64, hkv, d, generator=gen).cuda()
    library.write_kv(cache, warm, warm, torch.arange(64, device="cuda"))  # sets the key mean eagerly
    # Fill every slot once so any block a later table names holds finite data.
    fill_k, fill_v = new_tokens(cache.num_slots, hkv, d, gen, "cuda")
    library.write_kv(cache, fill_k, fill_v, torch.arange(cache.num_slots, device="cuda"))

    query = torch.zeros(num_seqs, hq, d, dtype=torch.bfloat16, device="cuda")
    new_k = torch.zeros(num_seqs, hkv, d, dtype=torch.bfloat16, device="cuda")
    new_v = torch.zeros_like(new_k)
    slots = torch.zeros(num_seqs, dtype=torch.int64, device="cuda")
    block_table = torch.zeros(num_seqs, width, dtype=torch.int32, device="cuda")
    seq_lens = torch.ones(num_seqs, dtype=torch.int32, device="cuda")
    qsl = torch.arange(num_seqs + 1, dtype=torch.int32, device="cuda")
    out = torch.zeros_like(query)

    def step():
        library.write_kv(cache, new_k, new_v, slots)
        library.attention(query, cache, block_table, seq_lens, qsl, out=out)

    def refill(round_):
        perm = torch.randperm(cache.num_blocks, generator=gen)[: num_seqs * width].view(num_seqs, width)
        lens = torch.randint(1, width * bs + 1, (num_seqs,), generator=gen)
        lens[round_ % num_seqs] = width * bs if round_ % 2 else 1  # full table / single token
        block_table.copy_(perm.to(torch.int32))
        seq_lens.copy_(lens.to(torch.int32))
        last = lens - 1
        slots.copy_(perm[torch.arange(num_seqs), last // bs].long() * bs + last % bs)
        k, v = new_tokens(num_seqs, hkv, d, gen, "cuda")
        new_k.copy_(k)
        new_v.copy_(v)
        query.copy_(make_normal((num_seqs, hq, d), generator=gen))

    refill(0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for round_ in range(1, 6):
        refill(round_)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = reference.attention_reference(query, cache, block_table, seq_lens, qsl)
        assert torch.isfinite(out).all()
        assert_close_verbose(out, ref, rel_l2=0.03 if kv_dtype == "int8" else 0.06, name=f"replay {round_}")


@GPU
def test_inductor_compiled_decode_step_matches_eager():
    batch = make_paged_batch([300, 1000], [1, 1], num_q_heads=24, num_kv_heads=4, head_dim=256, device="cuda")

    def step(query, cache, block_table, seq_lens, qsl):
        return library.attention(query, cache, block_table, seq_lens, qsl).float() * 2.0

    compiled = torch.compile(step, fullgraph=True)
    args = (batch.query, batch.cache, batch.block_table, batch.seq_lens, batch.query_start_loc)
    assert torch.equal(compiled(*args), step(*args))
