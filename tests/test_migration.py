"""Channel migration (int8attn.ops.migration and the cache's key_channel_scale): calibration,
bit-exact writes / query rounding against the reference, attention accuracy with and
without migration on data with outlier channels in Q and K, and the bit-identity of a
cache without a scale."""

import copy

import pytest
import torch

from _ids import cases
from int8attn import reference
from int8attn.cache import PagedKVCache
from int8attn.ops import library
from int8attn.ops.attention import attention
from int8attn.ops.migration import LAM_MAX, LAM_MIN, calibrate_channel_migration, migration_scale
from int8attn.ops.producer import apply_rope_torch, quantize_query, rope_quantize_and_write
from int8attn.ops.write import write_kv
from int8attn.testing import assert_close_verbose, make_keys, make_normal, poisoned_like


def bits(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def outlier_queries(n, hq, d, gen, channels=(3, 17), scale=25.0):
    """Queries with a few large channels (real models' queries carry them too)."""
    q = make_normal((n, hq, d), generator=gen, dtype=torch.float32)
    for c in channels:
        q[..., c % d] *= scale
    return q


def step_data(n, hq, hkv, d, gen, device):
    q = outlier_queries(n, hq, d, gen).to(device)
    k = make_keys(n, hkv, d, generator=gen, dtype=torch.float32, device=device)
    k[..., 5 % d] *= 8.0  # a channel large but not offset: smoothing leaves it, migration moves it
    v = make_normal((n, hkv, d), generator=gen, dtype=torch.float32, device=device)
    return q, k, v


def migrated_cache(num_blocks, block_size, hkv, d, kv_dtype, device, migration, q, k, slots):
    cache = PagedKVCache(num_blocks, block_size, hkv, d, kv_dtype=kv_dtype, device=device,
                         channel_migration=migration)
    calibrate_channel_migration(cache, q, k, slots)
    return cache


# --------------------------------------------------------------------------- calibration
@cases("n,hq,hkv,d", [(17, 4, 2, 64), (97, 6, 2, 48), (123, 8, 1, 128)])
def test_scale_matches_reference_and_is_finite(n, hq, hkv, d, gen, device):
    q, k, _ = step_data(n, hq, hkv, d, gen, device)
    lam = migration_scale(q, k)
    assert lam.shape == (hkv, d) and lam.dtype == torch.float32
    assert torch.isfinite(lam).all() and (lam > 0).all()
    torch.testing.assert_close(lam.cpu(), reference.migration_scale_reference(q.cpu(), k.cpu()), rtol=2e-7, atol=0)
    # a query channel 25x larger gets a 5x smaller lam (sqrt of the range ratio)
    plain_q = q.clone()
    plain_q[..., [3, 17]] /= 25.0
    plain = migration_scale(plain_q, k)
    torch.testing.assert_close(lam[:, [3, 17]] * 5.0, plain[:, [3, 17]], rtol=1e-6, atol=0)


def test_scale_ignores_non_finite_rows_and_zero_channels(gen, device):
    q, k, _ = step_data(33, 4, 2, 64, gen, device)
    clean = migration_scale(q, k)
    q2, k2 = q.clone(), k.clone()
    q2[4, 1, 9] = float("inf")
    q2[7, 3, 0] = float("nan")
    k2[2, 0, 30] = float("-inf")
    k2[11, 1, 1] = float("nan")
    dirty = migration_scale(q2, k2)
    assert torch.isfinite(dirty).all() and (dirty > 0).all()
    # the statistics skip exactly the non-finite (token, head) rows: zeroing them gives the same scale
    zero_rows = lambda x: torch.where(torch.isfinite(x).all(-1, keepdim=True), x, 0.0)  # noqa: E731
    assert torch.equal(dirty, migration_scale(zero_rows(q2), zero_rows(k2)))
    # a channel that is zero on one side gets lam 1; extreme ratios are clamped
    q3, k3 = q.clone(), k.clone()
    q3[..., 10] = 0.0
    k3[..., 20] = 0.0
    k3[..., 40] *= 1e12
    lam = migration_scale(q3, k3)
    assert (lam[:, 10] == 1).all() and (lam[:, 20] == 1).all() and (lam[:, 40] == LAM_MAX).all()
    assert (lam >= LAM_MIN).all() and torch.isfinite(clean).all()


def test_all_padding_or_non_finite_write_leaves_the_cache_waiting(gen, device):
    q, k, v = step_data(9, 4, 2, 64, gen, device)
    cache = PagedKVCache(4, 16, 2, 64, device=device, channel_migration="first_write")
    assert not calibrate_channel_migration(cache, q, k, torch.full((9,), -1, device=device))
    nan_k = torch.full_like(k, float("nan"))
    assert not calibrate_channel_migration(cache, q, nan_k, torch.arange(9, device=device))
    assert cache.key_channel_scale is None and cache.needs_channel_calibration
    assert calibrate_channel_migration(cache, q, k, torch.arange(9, device=device))
    assert cache.key_mean is not None and torch.isfinite(cache.key_channel_scale).all()
    # calibrated once: a second call changes nothing
    lam = cache.key_channel_scale.clone()
    assert not calibrate_channel_migration(cache, q * 3, k, torch.arange(9, device=device))
    assert torch.equal(cache.key_channel_scale, lam)


def test_bad_scales_and_modes_are_refused(gen, device):
    cache = PagedKVCache(4, 16, 2, 64, device=device)
    for bad in (torch.zeros(2, 64), torch.full((2, 64), float("nan")), -torch.ones(2, 64), torch.ones(2, 32)):
        with pytest.raises(ValueError):
            cache.set_channel_migration(bad)
    assert cache.key_channel_scale is None
    with pytest.raises(ValueError, match="quantized caches"):
        PagedKVCache(4, 16, 2, 64, kv_dtype="bf16", device=device, channel_migration="first_write")
    with pytest.raises(ValueError, match="quantized caches"):
        PagedKVCache(4, 16, 2, 64, kv_dtype="bf16", device=device).set_channel_migration(torch.ones(2, 64))
    with pytest.raises(ValueError, match="channel_migration"):
        PagedKVCache(4, 16, 2, 64, device=device, channel_migration="always")


def test_uncalibrated_write_is_refused_and_leaves_the_cache_untouched(gen, device):
    q, k, v = step_data(9, 4, 2, 64, gen, device)
    cache = PagedKVCache(4, 16, 2, 64, device=device, channel_migration="first_write")
    before = copy.deepcopy(cache)
    with pytest.raises(ValueError, match="calibrate_channel_migration"):
        write_kv(cache, k, v, torch.arange(9, device=device))
    assert torch.equal(cache.key, before.key) and torch.equal(cache.key_scale, before.key_scale)
    assert cache.key_mean is None and cache.key_channel_scale is None


# --------------------------------------------------------------------------- bit-exact writes and queries
@cases("n,hq,hkv,d,kv_dtype", [(17, 4, 2, 64, "int8"), (97, 6, 3, 48, "fp8"), (123, 8, 1, 128, "int8"),
                                (40, 4, 4, 256, "fp8")])
def test_write_and_query_rounding_match_reference(n, hq, hkv, d, kv_dtype, gen, device):
    q, k, v = step_data(n, hq, hkv, d, gen, device)
    slots = torch.randperm(8 * 16, generator=gen)[:n].to(device)
    cache = migrated_cache(8, 16, hkv, d, kv_dtype, device, "first_write", q, k, slots)
    ref = PagedKVCache(8, 16, hkv, d, kv_dtype=kv_dtype, device="cpu", key_smoothing="none")
    ref.set_key_mean(cache.key_mean.cpu())
    ref.set_channel_migration(cache.key_channel_scale.cpu())
    write_kv(cache, k, v, slots)
    reference.write_kv_reference(ref, k.cpu(), v.cpu(), slots.cpu())
    for a, b in ((cache.key, ref.key), (cache.value, ref.value), (cache.key_scale, ref.key_scale),
                 (cache.value_scale, ref.value_scale)):
        assert torch.equal(bits(a).cpu(), bits(b))
    out, scale = quantize_query(q, kv_dtype, poisoned_like(torch.empty(q.shape, device=device)).to(cache.storage_dtype)
                                if kv_dtype == "int8" else None, channel_scale=cache.key_channel_scale)
    want_q, want_s = reference.quantize_rows(reference.migrate_query(q.cpu(), ref.key_channel_scale), kv_dtype)
    assert torch.equal(bits(out).cpu(), bits(want_q)) and torch.equal(scale.cpu(), want_s)
    # the library op carries the scale too
    lq, ls = library.quantize_query(q, kv_dtype, cache.key_channel_scale)
    assert torch.equal(bits(lq), bits(out)) and torch.equal(ls, scale)


@cases("n,hq,hkv,d,rot,kv_dtype", [(17, 4, 2, 64, 64, "int8"), (33, 6, 2, 128, 64, "fp8"), (9, 8, 1, 256, 256, "int8")])
def test_producer_calibrates_and_matches_the_unfused_path(n, hq, hkv, d, rot, kv_dtype, gen, device):
    q, k, v = step_data(n, hq, hkv, d, gen, device)
    pos = torch.randint(0, 200, (n,), generator=gen).to(device)
    cos_sin = reference.rope_cos_sin_cache(256, rot, device=device)
    slots = torch.randperm(6 * 16, generator=gen)[:n].to(device)
    fused = PagedKVCache(6, 16, hkv, d, kv_dtype=kv_dtype, device=device, channel_migration="first_write")
    out_q, out_s = rope_quantize_and_write(q, k, v, pos, cos_sin, fused, slots)
    assert fused.key_channel_scale is not None and torch.isfinite(fused.key_channel_scale).all()
    q_rope, k_rope = apply_rope_torch(q, pos, cos_sin), apply_rope_torch(k, pos, cos_sin)
    unfused = PagedKVCache(6, 16, hkv, d, kv_dtype=kv_dtype, device=device, channel_migration="first_write")
    calibrate_channel_migration(unfused, q_rope, k_rope, slots)
    assert torch.equal(fused.key_channel_scale, unfused.key_channel_scale)
    assert torch.equal(fused.key_mean, unfused.key_mean)
    write_kv(unfused, k_rope, v, slots)
    want_q, want_s = quantize_query(q_rope, kv_dtype, channel_scale=unfused.key_channel_scale)
    assert torch.equal(bits(out_q), bits(want_q)) and torch.equal(out_s, want_s)
    for a, b in ((fused.key, unfused.key), (fused.value, unfused.value), (fused.key_scale, unfused.key_scale)):
        assert torch.equal(bits(a), bits(b))
    # and through the custom op (an already calibrated cache goes through the op itself)
    again = copy.deepcopy(unfused)
    lq, ls = library.rope_quantize_and_write(q, k, v, pos, cos_sin, again, slots)
    assert torch.equal(bits(lq), bits(out_q)) and torch.equal(bits(again.key), bits(fused.key))


# --------------------------------------------------------------------------- attention accuracy
def run_attention(cache, q, block_table, seq_len, q_len, device):
    qsl = torch.tensor([0, q_len], dtype=torch.int32, device=device)
    seq_lens = torch.tensor([seq_len], dtype=torch.int32, device=device)
    out = poisoned_like(torch.empty(q.shape, device=device))  # fp32 out: the interpreter truncates bf16
    attention(q, cache, block_table, seq_lens, qsl, None, out)
    return out, reference.attention_reference_quantized(q, cache, block_table, seq_lens, qsl)


@cases("kv_dtype,hq,hkv,d,seq_len,q_len", [
    ("int8", 6, 2, 64, 97, 1), ("int8", 8, 1, 128, 123, 3), ("int8", 6, 2, 64, 97, 97),
    ("fp8", 6, 2, 64, 97, 1), ("fp8", 4, 2, 128, 123, 123),
])
def test_attention_with_migration_beats_without(kv_dtype, hq, hkv, d, seq_len, q_len, gen, device):
    q, k, v = step_data(seq_len, hq, hkv, d, gen, device)
    blocks = -(-seq_len // 16) + 2
    block_table = torch.randperm(blocks, generator=gen)[None].to(torch.int32).to(device)
    slots = reference.token_slots(block_table[0].cpu(), seq_len, 16).to(device)
    exact = reference.attend(q[-q_len:].cpu(), k.cpu(), v.cpu(), seq_len - q_len, d ** -0.5)
    errors = {}
    for migration in ("none", "first_write"):
        cache = migrated_cache(blocks, 16, hkv, d, kv_dtype, device, migration, q, k, slots)
        write_kv(cache, k, v, slots)
        out, ref = run_attention(cache, q[-q_len:].contiguous(), block_table, seq_len, q_len, device)
        # the kernels compute the reference of the stored codes (8-bit P in decode)
        assert_close_verbose(out, ref, rel_l2=0.02 if q_len <= 8 else 2e-3, name=f"{migration} vs reference")
        errors[migration] = reference.error_stats(out, exact)["rel_l2"]
    if kv_dtype == "int8":
        assert errors["first_write"] < 0.6 * errors["none"], errors
    else:
        # e4m3 rounds each element relative to its own magnitude, so an outlier channel
        # costs the other channels little and migration does not reliably help (one decode
        # query here: 0.046 without, 0.057 with); it is opt-in for FP8 and must stay close
        assert errors["first_write"] < 1.5 * errors["none"], errors


# --------------------------------------------------------------------------- no-scale bit identity
@cases("kv_dtype,seq_len,q_len", [("int8", 97, 1), ("fp8", 57, 2), ("int8", 123, 123)])
def test_unit_scale_is_bit_identical_to_no_scale(kv_dtype, seq_len, q_len, gen, device):
    """lam = 1 goes through every migration multiply (x * 1 and x * (1 / 1) are exact), so
    its writes, query rounding and attention equal a cache without a scale bit for bit:
    the HAS_LAM paths touch nothing else."""
    hq, hkv, d = 6, 2, 64
    q, k, v = step_data(seq_len, hq, hkv, d, gen, device)
    blocks = -(-seq_len // 16)
    block_table = torch.arange(blocks, dtype=torch.int32, device=device)[None]
    slots = torch.arange(seq_len, device=device)
    plain = PagedKVCache(blocks, 16, hkv, d, kv_dtype=kv_dtype, device=device)
    unit = PagedKVCache(blocks, 16, hkv, d, kv_dtype=kv_dtype, device=device)
    unit.set_channel_migration(torch.ones(hkv, d))
    write_kv(plain, k, v, slots)
    write_kv(unit, k, v, slots)
    for a, b in ((plain.key, unit.key), (plain.value, unit.value), (plain.key_scale, unit.key_scale)):
        assert torch.equal(bits(a), bits(b))
    qa, sa = quantize_query(q, kv_dtype)
    qb, sb = quantize_query(q, kv_dtype, channel_scale=unit.key_channel_scale)
    assert torch.equal(bits(qa), bits(qb)) and torch.equal(sa, sb)
    qry = q[-q_len:].contiguous()
    out_plain, _ = run_attention(plain, qry, block_table, seq_len, q_len, device)
    out_unit, _ = run_attention(unit, qry, block_table, seq_len, q_len, device)
    assert torch.equal(out_plain, out_unit)
    # the op path carries the scale through cache_view
    view = library.cache_view(unit.key, unit.value, unit.key_scale, unit.value_scale, unit.key_mean,
                              unit.key_channel_scale)
    assert view.key_channel_scale is unit.key_channel_scale
    out_op = library.attention(qry.to(torch.bfloat16), unit, block_table, torch.tensor([seq_len], dtype=torch.int32, device=device),
                               torch.tensor([0, q_len], dtype=torch.int32, device=device))
    assert torch.isfinite(out_op.float()).all()


@cases("q_len", [1, 40])
def test_one_plan_serves_caches_with_and_without_scale(q_len, gen, device):
    """A step's plan runs every layer: caches with a scale and without alternate through its
    decode launch (and prefill) and each gives what attention() alone gives."""
    from int8attn.ops.attention import plan_attention

    hq, hkv, d, seq_len = 6, 2, 64, 57
    q, k, v = step_data(seq_len, hq, hkv, d, gen, device)
    blocks = -(-seq_len // 16)
    block_table = torch.arange(blocks, dtype=torch.int32, device=device)[None]
    slots = torch.arange(seq_len, device=device)
    seq_lens = torch.tensor([seq_len], dtype=torch.int32, device=device)
    qsl = torch.tensor([0, q_len], dtype=torch.int32, device=device)
    caches = [migrated_cache(blocks, 16, hkv, d, "int8", device, m, q, k, slots)
              for m in ("first_write", "none", "first_write")]
    caches[2].set_channel_migration(caches[0].key_channel_scale * 2.0)  # another layer's scale
    for c in caches:
        write_kv(c, k, v, slots)
    qry = q[-q_len:].contiguous()
    plan = plan_attention(caches[0], block_table, seq_lens, qsl, hq)
    for c in caches + caches[::-1]:
        alone = torch.empty(qry.shape, device=device)
        attention(qry, c, block_table, seq_lens, qsl, None, alone)
        planned = torch.empty(qry.shape, device=device)
        attention(qry, c, block_table, seq_lens, qsl, None, planned, plan=plan)
        assert torch.equal(planned, alone)
    outs = [attention(qry, c, block_table, seq_lens, qsl, None, torch.empty(qry.shape, device=device)) for c in caches]
    assert not torch.equal(outs[0], outs[1])  # the scale is used, not a cached launch of another cache
