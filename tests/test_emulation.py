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
