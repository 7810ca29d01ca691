"""The float64 reference checked against independent formulations."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from int8attn import reference
from int8attn.testing import make_paged_batch


def test_quantize_rows_int8(gen):
    x = torch.randn(7, 3, 64, generator=gen) * 5
    x[2, 1] = 0
    q, s = reference.quantize_rows(x, "int8")
    assert q.dtype == torch.int8 and s.shape == (7, 3)
    assert s[2, 1] == 1 and (q[2, 1] == 0).all()
    assert q.abs().max() == 127
    assert (q.abs().amax(-1)[s != 1] == 127).all()  # the row maximum maps to +-127
    err = (reference.dequantize_rows(q, s) - x.double()).abs()
    assert (err <= s.double().unsqueeze(-1) * 0.5 * (1 + 1e-6)).all()
    # half away from zero on exact ties
    row = torch.tensor([127.0, 2.5, -2.5, 0.5, -0.5])
    assert reference.quantize_rows(row, "int8")[0].tolist() == [127, 3, -3, 1, -1]


def test_quantize_rows_fp8_and_bf16(gen):
    x = torch.randn(5, 2, 128, generator=gen)
    q, s = reference.quantize_rows(x, "fp8")
    assert q.dtype == torch.float8_e4m3fn
    torch.testing.assert_close(s, x.abs().amax(-1) / 448, rtol=0, atol=0)
    assert (q.float().abs().amax(-1) == 448).all()
    inv = torch.full_like(s, 448.0) / x.abs().amax(-1)
    assert torch.equal(q.float(), (x * inv.unsqueeze(-1)).to(torch.float8_e4m3fn).float())
    b, none = reference.quantize_rows(x, "bf16")
    assert none is None and torch.equal(b, x.to(torch.bfloat16))
    with pytest.raises(ValueError):
        reference.quantize_rows(x, "int4")


def _quantize_rows_numpy(x: np.ndarray, qmax: float):
    """Independent float32 model of the quantization: codes from x * (qmax / amax)."""
    x = x.astype(np.float32)
    amax = np.abs(x).max(axis=-1)
    big = amax >= np.float32(qmax * 2.0 ** -126)
    inv = np.where(big, np.float32(qmax) / np.where(big, amax, 1), 1).astype(np.float32)
    scale = np.where(big, amax / np.float32(qmax), 1).astype(np.float32)
    r = (x * inv[..., None]).astype(np.float32)
    return r, scale


def test_quantize_rows_multiplies_by_the_rounded_reciprocal(gen):
    """Codes use inv = 127 / amax (correctly rounded), not a division by the stored scale:
    rows where the two disagree are kept as evidence that the definition is pinned."""
    x = torch.randn(400, 64, generator=gen) * 3
    # near-ties where x * (127 / amax) and x / (amax / 127) round to different codes
    # (row maximum, value, code with the reciprocal, code a division by the scale gives)
    ties = [(7.513043403625488, 2.040944814682007, 34, 35), (5.972415924072266, 0.21162103116512299, 5, 4),
            (4.560959339141846, -3.8965675830841064, -108, -109)]
    for i, (amax, value, _, _) in enumerate(ties):
        x[i, :2] = torch.tensor([amax, value])
        x[i, 2:] = x[i, 2:].clamp(-amax / 2, amax / 2)
    q, s = reference.quantize_rows(x, "int8")
    r, scale = _quantize_rows_numpy(x.numpy(), 127.0)
    want = np.sign(r) * np.floor(np.abs(r) + np.float32(0.5))
    assert np.array_equal(q.numpy(), np.clip(want, -127, 127).astype(np.int8))
    assert np.array_equal(s.numpy(), scale)
    for i, (_, _, code, code_by_division) in enumerate(ties):
        assert q[i, 1].item() == code
        r_div = (x[i, 1] / s[i]).item()
        assert math.copysign(math.floor(abs(r_div) + 0.5), r_div) == code_by_division
    qf, sf = reference.quantize_rows(x, "fp8")
    rf, scalef = _quantize_rows_numpy(x.numpy(), 448.0)
    assert torch.equal(qf.float(), torch.from_numpy(rf).clamp(-448, 448).to(torch.float8_e4m3fn).float())
    assert np.array_equal(sf.numpy(), scalef)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_quantize_rows_tiny_rows_count_as_zero(kv_dtype):
    """A row with amax < qmax * 2**-126 (its scale would be subnormal) is an all-zero row:
    scale 1, codes 0, never inf or NaN; from qmax * 2**-126 up it is quantized."""
    qmax = 127.0 if kv_dtype == "int8" else 448.0
    edge = qmax * 2.0 ** -126
    x = torch.zeros(4, 16)
    x[0, :4] = torch.tensor([1e-38, -3e-39, 0.0, 2e-45])
    x[1, 0] = float(np.nextafter(np.float32(edge), np.float32(0)))
    x[2, :2] = torch.tensor([edge, -edge / 2])
    q, s = reference.quantize_rows(x, kv_dtype)
    assert torch.isfinite(q.float()).all() and torch.isfinite(s).all()
    assert (s[[0, 1, 3]] == 1).all() and (q[[0, 1, 3]].float() == 0).all()
    assert s[2].item() == 2.0 ** -126 and q[2, 0].float().item() == qmax


def test_rope_reference_vs_complex_rotation(gen):
    n, h, d, rot = 9, 3, 128, 64
    x = torch.randn(n, h, d, generator=gen, dtype=torch.float64)
    pos = torch.randint(0, 512, (n,), generator=gen)
    cs = reference.rope_cos_sin_cache(512, rot)
    out = reference.apply_rope_reference(x, pos, cs)
    half = rot // 2
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot))
    angle = pos.double()[:, None] * inv_freq[None, :]
    z = torch.complex(x[..., :half], x[..., half:rot]) * torch.polar(torch.ones_like(angle), angle)[:, None, :]
    torch.testing.assert_close(out[..., :half], z.real, rtol=0, atol=1e-5)
    torch.testing.assert_close(out[..., half:rot], z.imag, rtol=0, atol=1e-5)
    assert torch.equal(out[..., rot:], x[..., rot:])  # partial rotary: the rest passes through
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1))  # a rotation keeps the norm
    with pytest.raises(ValueError):
        reference.rope_cos_sin_cache(8, 7)


def test_attention_reference_vs_sdpa_bf16_cache():
    batch = make_paged_batch([37, 16, 5], [3, 16, 1], num_q_heads=8, num_kv_heads=2, head_dim=64,
                             kv_dtype="bf16", block_size=8, device="cpu", seed=3)
    out = reference.attention_reference(batch.query, batch.cache, batch.block_table, batch.seq_lens,
                                        batch.query_start_loc)
    assert out.dtype == torch.float64 and out.shape == batch.query.shape
    start = 0
    for s, (seq_len, q_len) in enumerate(zip(batch.seq_lens.tolist(), [3, 16, 1])):
        k = batch.key[start:start + seq_len].double().transpose(0, 1)  # [Hkv, L, D]
        v = batch.value[start:start + seq_len].double().transpose(0, 1)
        start += seq_len
        q = batch.query[batch.query_start_loc[s]:batch.query_start_loc[s + 1]].double().transpose(0, 1)
        k, v = k.repeat_interleave(4, 0), v.repeat_interleave(4, 0)
        q_pos = seq_len - q_len + torch.arange(q_len)
        mask = torch.arange(seq_len)[None, :] <= q_pos[:, None]
        want = F.scaled_dot_product_attention(q, k.to(q.dtype), v, attn_mask=mask).transpose(0, 1)
        got = out[batch.query_start_loc[s]:batch.query_start_loc[s + 1]]
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


def test_attention_reference_quantized_uses_query_quantization():
    batch = make_paged_batch([20], [4], num_q_heads=4, num_kv_heads=4, head_dim=64, device="cpu", seed=1)
    args = (batch.cache, batch.block_table, batch.seq_lens, batch.query_start_loc)
    qq, qs = reference.quantize_rows(batch.query, "int8")
    want = reference.attention_reference(reference.dequantize_rows(qq, qs), *args)
    torch.testing.assert_close(reference.attention_reference_quantized(batch.query, *args), want, rtol=0, atol=0)
    plain = reference.attention_reference(batch.query, *args)
    assert 0 < reference.error_stats(want, plain)["rel_l2"] < 0.02


def test_gather_kv_follows_permuted_blocks():
    batch = make_paged_batch([29], [1], num_q_heads=2, num_kv_heads=2, head_dim=64, kv_dtype="bf16",
                             block_size=8, device="cpu", seed=5)
    k, v = reference.gather_kv(batch.cache, batch.block_table[0], 29)
    assert torch.equal(k, batch.key.double()) and torch.equal(v, batch.value.double())


def test_write_kv_reference_first_write_mean():
    batch = make_paged_batch([20], [1], num_q_heads=2, num_kv_heads=2, head_dim=64, device="cpu", seed=2)
    torch.testing.assert_close(batch.cache.key_mean, batch.key.float().mean(0), rtol=0, atol=0)
    k, _ = reference.gather_kv(batch.cache, batch.block_table[0], 20)
    assert reference.error_stats(k, batch.key)["rel_l2"] < 0.01


def test_error_stats():
    ref = torch.arange(1, 101, dtype=torch.float64)
    out = ref.clone()
    out[0] += 3.0
    st = reference.error_stats(out, ref)
    assert st["finite"] and st["max_abs"] == 3.0 and math.isclose(st["rel_l2"], 3.0 / ref.norm().item())
    assert st["mean_abs"] == pytest.approx(0.03)
    out[5] = float("nan")
    st = reference.error_stats(out, ref)
    assert not st["finite"] and st["max_abs"] == math.inf
    with pytest.raises(ValueError):
        reference.error_stats(out[:3], ref)
