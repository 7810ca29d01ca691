"""int8attn.emulation: the plain-PyTorch roundings the accuracy levers are prototyped with."""

import pytest
import torch

from int8attn import emulation, reference
from int8attn.emulation import Variant, emulate, exact, rel_l2


def _qkv(tq=17, t=97, hq=4, hkv=2, d=64, outlier=20.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(tq, hq, d, generator=g)
    k = torch.randn(t, hkv, d, generator=g)
    k[..., 3] *= outlier  # an outlier channel, as real keys carry
    v = torch.randn(t, hkv, d, generator=g)
    return q, k, v


@pytest.mark.parametrize("d", [16, 64, 256])
def test_hadamard_is_orthonormal(d):
    h = emulation.hadamard(d).double()
    assert torch.allclose(h @ h.T, torch.eye(d, dtype=torch.float64), atol=1e-6)


@pytest.mark.parametrize("d", [0, 96, 80])
def test_hadamard_needs_a_power_of_two(d):
    with pytest.raises(ValueError, match="power-of-two"):
        emulation.hadamard(d)


def test_rotation_leaves_unrounded_attention_unchanged():
    q, k, v = _qkv(seed=1)
    first = k.shape[0] - q.shape[0]
    ref = exact(q, k, v, first_pos=first)
    got = emulate(q, k, v, Variant("rot", rotate=True), first_pos=first)
    assert rel_l2(got, ref) < 1e-5


def test_rotation_spreads_an_outlier_channel_before_the_rounding():
    """With one key channel 20x the others, rotating Q and K before the per-row INT8
    rounding of K cuts the error of that rounding (Q, V and P exact)."""
    q, k, v = _qkv(seed=2)
    first = k.shape[0] - q.shape[0]
    ref = exact(q, k, v, first_pos=first)
    plain = emulate(q, k, v, Variant("k", kv="int8", v="exact", pv="exact"), first_pos=first)
    rotated = emulate(q, k, v, Variant("k+rot", kv="int8", v="exact", pv="exact", rotate=True), first_pos=first)
    assert rel_l2(rotated, ref) < 0.5 * rel_l2(plain, ref), (rel_l2(rotated, ref), rel_l2(plain, ref))


def test_value_rotation_is_undone_on_the_output_and_spreads_a_value_outlier():
    """``rotate_v``: V rotated before its rounding, the output rotated back -- unrounded,
    the attention is unchanged; with one V channel 20x the others, the per-row INT8
    rounding of V (Q, K and P exact) errs less after the rotation."""
    q, k, v = _qkv(seed=4)
    first = k.shape[0] - q.shape[0]
    ref = exact(q, k, v, first_pos=first)
    assert rel_l2(emulate(q, k, v, Variant("rotv", rotate_v=True), first_pos=first), ref) < 1e-5
    v = v.clone()
    v[..., 5] *= 20
    ref = exact(q, k, v, first_pos=first)
    plain = emulate(q, k, v, Variant("v", v="int8", pv="exact"), first_pos=first)
    rotated = emulate(q, k, v, Variant("v+rotv", v="int8", pv="exact", rotate_v=True), first_pos=first)
    assert rel_l2(rotated, ref) < 0.5 * rel_l2(plain, ref), (rel_l2(rotated, ref), rel_l2(plain, ref))


def test_grouped_scales_round_each_group_alone():
    """``kv_group``: one scale per group of channels -- a row whose halves differ 100x in
    range keeps the small half's precision; the group must divide head_dim and PV be exact."""
    x = torch.cat([torch.randn(5, 2, 32), 100 * torch.randn(5, 2, 32)], dim=-1)
    per_row = emulation._fake_quant(x, "int8")
    grouped = emulation._fake_quant(x, "int8", 32)
    small = x[..., :32].double()
    assert (grouped[..., :32] - small).abs().max() < 0.05 * (per_row[..., :32] - small).abs().max()
    assert torch.equal(grouped[..., 32:], emulation._fake_quant(x[..., 32:], "int8"))
    with pytest.raises(ValueError, match="divide"):
        emulation._fake_quant(x, "int8", 48)
    with pytest.raises(ValueError, match="kv_group"):
        Variant("g", kv="int8", pv="int8", kv_group=32)


def test_v_override_rounds_only_the_keys():
    """``v="exact"`` with an INT8 ``kv``: the keys are rounded as the cache stores them,
    the values are not -- the same as attention over dequantized keys and exact values."""
    q, k, v = _qkv(seed=3)
    first = k.shape[0] - q.shape[0]
    got = emulate(q, k, v, Variant("k", kv="int8", v="exact", pv="exact"), first_pos=first)
    codes, scales = reference.quantize_rows(k.float(), "int8")
    k_hat = reference.dequantize_rows(codes, scales)
    want = exact(q, k_hat.float(), v, first_pos=first)
    assert rel_l2(got, want) < 1e-6
    both = emulate(q, k, v, Variant("kv", kv="int8", pv="exact"), first_pos=first)
    assert rel_l2(both, want) > 1e-4  # V's rounding is visible when it is on


def test_variant_rejects_unknown_roundings():
    with pytest.raises(ValueError, match="q, kv and v"):
        Variant("bad", kv="int8", v="int4")


@pytest.mark.parametrize("rotate", [False, True])
def test_emulated_cache_keeps_the_first_writes_migration_scale(rotate):
    """Through later prefill chunks and decode steps the emulated cache rounds as a library
    cache whose channel-migration scale was calibrated once, on the first write's queries
    and keys (the integration's order: calibrate, then write_kv; later writes reuse it).
    A scale recalibrated per call from that call's queries (the emulation before this test)
    is off by as much as the rounding error itself when later queries differ."""
    import types

    from int8attn.cache import PagedKVCache
    from int8attn.emulation import cache_variant, hadamard
    from int8attn.integrations.transformers.emulated import EmulatedCache, _emulated_forward, emulated_cache
    from int8attn.ops.migration import calibrate_channel_migration

    g = torch.Generator().manual_seed(3)
    n, hq, hkv, d = 48, 4, 2, 64
    q = torch.randn(n, hq, d, generator=g)
    k = torch.randn(n, hkv, d, generator=g) + 0.5
    v = torch.randn(n, hkv, d, generator=g)
    q[..., 3] *= 10.0
    k[..., 5] *= 8.0
    q[32:, :, 9] *= 12.0  # queries after the first write carry an outlier channel its queries do not
    rot = hadamard(d) if rotate else torch.eye(d)
    var = cache_variant("int8", "exact", migrate=0.5, rotate=rotate)
    cache = PagedKVCache(n // 16, 16, hkv, d, kv_dtype="int8", device="cpu", channel_migration="first_write")
    block_table = torch.arange(n // 16, dtype=torch.int32)[None]
    module = types.SimpleNamespace(layer_idx=0)
    with emulated_cache(EmulatedCache(prefill=var, decode=var)):
        for s, e in ((0, 32), (32, 47), (47, 48)):  # two prefill chunks, one decode step
            qs, ks, slots = (q[s:e] @ rot).contiguous(), (k[s:e] @ rot).contiguous(), torch.arange(s, e)
            if s == 0:
                calibrate_channel_migration(cache, qs, ks, slots)
            reference.write_kv_reference(cache, ks, v[s:e], slots)
            lib = reference.attention_reference_quantized(
                qs, cache, block_table, torch.tensor([e], dtype=torch.int32),
                torch.tensor([0, e - s], dtype=torch.int32), d ** -0.5).double()
            got, _ = _emulated_forward(module, q[None, s:e].transpose(1, 2), k[None, :e].transpose(1, 2),
                                       v[None, :e].transpose(1, 2), None)
            assert rel_l2(got[0].double(), lib) < 1e-5, (s, e)
            if s:
                per_call = emulate(q[s:e], k[:e], v[:e], var, mean_tokens=32, first_pos=s)
                assert rel_l2(per_call, lib) > 1e-2, (s, e)
