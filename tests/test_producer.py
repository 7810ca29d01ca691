"""quantize_query and the fused RoPE + K/V write + Q quantization producer."""

import copy

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _ids import cases
from int8attn import reference
from int8attn.cache import PagedKVCache
from int8attn.errors import DeviceMetadataError, check_errors
from int8attn.kernels.quantize import _amax_rows, _quantize, _quantize_rows, _row_scale
from int8attn.ops.producer import apply_rope_torch, quantize_query, rope_quantize_and_write
from int8attn.ops.write import write_kv
from int8attn.kernels.codes import KV_KIND
from int8attn.runtime import interpret_mode
from int8attn.testing import make_keys, make_normal, poisoned_like


def bits(t):
    return t.detach().cpu().contiguous().view(torch.uint8)


def same_bits(a, b) -> bool:
    """Byte equality where any NaN equals any NaN (payloads differ between conversions)."""
    if a.is_floating_point() and a.element_size() > 1:
        a_nan, b_nan = torch.isnan(a.float()).cpu(), torch.isnan(b.float()).cpu()
        if not torch.equal(a_nan, b_nan):
            return False
        a, b = a.cpu().masked_fill(a_nan, 0), b.cpu().masked_fill(b_nan, 0)
    return torch.equal(bits(a), bits(b))


# --------------------------------------------------------------------------- quantize_query
@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
@cases("shape", [(17, 24, 256), (97, 6, 64), (3, 5, 128)])
def test_quantize_query_bit_exact(kv_dtype, shape, gen, device):
    q = (make_normal(shape, generator=gen) * 4).to(device)
    q[1, 0] = 0  # a zero row
    out, scale = quantize_query(q, kv_dtype)
    ref_q, ref_s = reference.quantize_rows(q.cpu(), kv_dtype)
    assert out.dtype == ref_q.dtype and scale.dtype == torch.float32
    assert torch.equal(bits(out), bits(ref_q))
    assert torch.equal(bits(scale), bits(ref_s))
    assert scale[1, 0].item() == 1.0


def test_quantize_query_rounding_edges(device):
    """Exact ties round half away from zero (int8); fp8 mantissa carries (the values
    the interpreter's own cast mis-rounds) and subnormals round to nearest even."""
    row = torch.zeros(64)
    row[0] = 127.0  # amax 127 -> scale exactly 1, so r == x
    row[1:9] = torch.tensor([2.5, -2.5, 0.5, -0.5, 126.5, -126.49, 1.4999999, 3.5])
    q, s = quantize_query(row.view(1, 1, 64).to(device), "int8")
    assert s.item() == 1.0
    assert q[0, 0, :9].tolist() == [127, 3, -3, 1, -1, 127, -126, 1, 4]
    row = torch.zeros(64)
    row[0] = 448.0  # fp8: scale 1
    vals = [127.6, 15.9, -31.9, 7.8, 0.0029, -0.0009, 0.001953125, 0.00341796875, 447.9, 239.9, 0.1]
    row[1:1 + len(vals)] = torch.tensor(vals)
    row[1 + len(vals)] = -448.0
    x = row.view(1, 1, 64).to(device)
    q, s = quantize_query(x, "fp8")
    ref_q, ref_s = reference.quantize_rows(x.cpu(), "fp8")
    assert torch.equal(bits(q), bits(ref_q)), (q.float()[0, 0, :14], ref_q.float()[0, 0, :14])
    assert q.float()[0, 0, 1].item() == 128.0


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_quantize_query_near_ties_and_tiny_rows(kv_dtype, device):
    """Values where x * (qmax / amax) and x / (amax / qmax) round apart (the codes must be
    the reciprocal's, as in the reference), and rows so small that their scale would be
    subnormal (all-zero rows: scale 1, no inf / NaN)."""
    rows = torch.zeros(6, 64)
    ties = [(7.513043403625488, 2.040944814682007), (5.972415924072266, 0.21162103116512299),
            (4.560959339141846, -3.8965675830841064)]
    for i, (amax, value) in enumerate(ties):
        rows[i, 0], rows[i, 1] = amax, value
        rows[i, 2:] = torch.linspace(-amax / 2, amax / 2, 62)
    rows[3, :3] = torch.tensor([1e-38, -3e-39, 2e-38])
    rows[4, :2] = torch.tensor([1.2e-37, 1.0e-36])  # below 127 * 2**-126 and 448 * 2**-126
    x = rows.view(2, 3, 64).to(device)  # fp32 input: the tie values survive exactly
    q, s = quantize_query(x, kv_dtype)
    ref_q, ref_s = reference.quantize_rows(x.cpu(), kv_dtype)
    assert torch.equal(bits(q), bits(ref_q)) and torch.equal(bits(s), bits(ref_s))
    assert torch.isfinite(q.float()).all() and torch.isfinite(s).all()
    if kv_dtype == "int8":
        assert q.view(6, 64)[:3, 1].tolist() == [34, 5, -108]


@triton.jit
def _both_entry_points(x_ptr, a_ptr, b_ptr, KIND: tl.constexpr, INTERPRET: tl.constexpr):
    offs = tl.arange(0, 4)[:, None] * 64 + tl.arange(0, 64)[None, :]
    x = tl.load(x_ptr + offs)
    tl.store(a_ptr + offs, _quantize(x, _row_scale(_amax_rows(x), KIND), KIND, INTERPRET))
    q, _ = _quantize_rows(x, KIND, INTERPRET)
    tl.store(b_ptr + offs, q)


def test_older_quantize_entry_point_matches(gen, device):
    """``_quantize(x, scale)`` (kept for kernels written against it) gives the codes of
    ``_quantize_rows``, the reference's."""
    x = (make_normal((4, 64), generator=gen, dtype=torch.float32) * 5).to(device)
    for kv_dtype in ("int8", "fp8"):
        kind = KV_KIND[kv_dtype]
        ref_q, _ = reference.quantize_rows(x.cpu(), kv_dtype)
        a = torch.empty(4, 64, dtype=ref_q.dtype, device=device)
        b = torch.empty_like(a)
        _both_entry_points[(1,)](x, a, b, KIND=kind, INTERPRET=interpret_mode())
        assert torch.equal(bits(a), bits(ref_q)) and torch.equal(bits(b), bits(ref_q))


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    t=st.integers(1, 6),
    h=st.integers(1, 5),
    d=st.sampled_from([16, 48, 64, 80, 128, 256]),
    log_scale=st.floats(-8, 8),
    kv_dtype=st.sampled_from(["int8", "fp8"]),
    in_dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
    seed=st.integers(0, 2**31 - 1),
)
def test_quantize_query_matches_reference_property(t, h, d, log_scale, kv_dtype, in_dtype, seed, device):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, d, generator=g) * (2.0 ** log_scale)
    x = x * (torch.rand(t, h, 1, generator=g) < 0.9)  # some all-zero rows
    if in_dtype == torch.float16:
        x = x.clamp(-6e4, 6e4)
    x = x.to(in_dtype).to(device)
    out, scale = quantize_query(x, kv_dtype)
    ref_q, ref_s = reference.quantize_rows(x.cpu(), kv_dtype)
    assert torch.equal(bits(out), bits(ref_q))
    assert torch.equal(bits(scale), bits(ref_s))


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("d", [64, 80])
def test_quantize_query_non_finite_rows_get_nan_scale(kv_dtype, d, gen, device):
    """A row with an inf / NaN: scale NaN and codes 0 (so its attention output is NaN);
    the other rows are untouched by it, bit for bit as the reference."""
    q = make_normal((5, 3, d), generator=gen).to(device)
    q[0, 1, 2] = float("inf")
    q[3, 0, d - 1] = float("nan")
    q[4, 2, 0] = float("-inf")
    out, scale = quantize_query(q, kv_dtype)
    ref_q, ref_s = reference.quantize_rows(q.cpu(), kv_dtype)
    # NaN payloads and signs differ between devices: NaN positions, then every other bit
    assert torch.equal(bits(out), bits(ref_q))
    scale = scale.cpu()
    assert torch.equal(torch.isnan(scale), torch.isnan(ref_s))
    assert torch.equal(bits(torch.nan_to_num(scale)), bits(torch.nan_to_num(ref_s)))
    bad = torch.zeros(5, 3, dtype=torch.bool)
    bad[0, 1] = bad[3, 0] = bad[4, 2] = True
    assert torch.isnan(scale.cpu()[bad]).all() and torch.isfinite(scale.cpu()[~bad]).all()
    assert (out.cpu()[bad].float() == 0).all()


def test_quantize_query_out_and_views(gen, device):
    """out= is written in full (poisoned first); a strided query (a view of fused QKV)."""
    qkv = make_normal((17, 12, 128), generator=gen).to(device)
    q = qkv[:, :8]
    out = torch.full((17, 8, 128), 99, dtype=torch.int8, device=device)
    out_scale = poisoned_like(torch.empty(17, 8, device=device))
    ret_q, ret_s = quantize_query(q, "int8", out=out, out_scale=out_scale)
    assert ret_q is out and ret_s is out_scale
    ref_q, ref_s = reference.quantize_rows(q.cpu(), "int8")
    assert torch.equal(out.cpu(), ref_q) and torch.equal(out_scale.cpu(), ref_s)


def test_quantize_query_reuses_one_launch_per_geometry(gen, device):
    """Repeated calls of one geometry share one cached launch (on a GPU the second call skips
    Triton's argument binding); a channel scale, a strided view or another token count is
    another geometry; every call stays bit exact, whichever path launched it."""
    from int8attn.ops import producer

    producer._QUERY_LAUNCHES.clear()
    lam = (torch.rand(2, 64, generator=gen) + 0.5).to(device)
    qkv = make_normal((9, 12, 64), generator=gen).to(device)
    calls = [make_normal((17, 4, 64), generator=gen).to(device) for _ in range(3)] + [qkv[:, :4], qkv[:5, :4]]
    for i, q in enumerate(calls):
        for channel_scale in (None, lam):
            out, scale = quantize_query(q, "int8", channel_scale=channel_scale)
            x = q.cpu() if channel_scale is None else \
                q.cpu() * channel_scale.cpu().repeat_interleave(2, 0)[None]
            ref_q, ref_s = reference.quantize_rows(x, "int8")
            assert torch.equal(out.cpu(), ref_q) and torch.equal(bits(scale), bits(ref_s)), (i, channel_scale)
    # contiguous x {no scale, scale}, the view x 2, the 5-token view x 2
    assert len(producer._QUERY_LAUNCHES) == 6
    if not interpret_mode():  # a compiled kernel kept: later calls take the cached path
        assert all(launch._compiled is not None for launch in producer._QUERY_LAUNCHES.values())


def test_quantize_query_bf16_passthrough(gen, device):
    q = make_normal((5, 4, 64), generator=gen).to(device)
    out, scale = quantize_query(q, "bf16")
    assert scale is None and out.dtype == torch.bfloat16 and torch.equal(out, q)
    out, _ = quantize_query(q.float(), "bf16")
    assert torch.equal(out, q)


def test_quantize_query_bad_inputs(gen, device):
    q = make_normal((5, 4, 64), generator=gen).to(device)
    with pytest.raises(ValueError, match="kv_dtype"):
        quantize_query(q, "int4")
    with pytest.raises(TypeError):
        quantize_query(q.to(torch.int8), "int8")
    with pytest.raises(ValueError):
        quantize_query(q[0], "int8")
    with pytest.raises(ValueError, match="contiguous"):
        quantize_query(q.transpose(0, 2), "int8")
    with pytest.raises(TypeError):
        quantize_query(q, "int8", out=torch.empty(5, 4, 64, dtype=torch.float8_e4m3fn, device=device))
    with pytest.raises(ValueError):
        quantize_query(q, "int8", out_scale=torch.empty(5, 3, device=device))
    with pytest.raises(ValueError):
        quantize_query(q, "bf16", out=torch.empty_like(q))


def test_quantize_query_empty(device):
    q, s = quantize_query(torch.empty(0, 4, 64, dtype=torch.bfloat16, device=device), "int8")
    assert q.shape == (0, 4, 64) and s.shape == (0, 4)


# --------------------------------------------------------------------------- fused producer
def make_step(n, hq, hkv, d, rotary_dim, kv_dtype, gen, device, block_size=16, pad=True, fused_qkv=True,
              smoothing="auto", max_pos=4096):
    cache = PagedKVCache(-(-n // block_size) + 2, block_size, hkv, d, kv_dtype=kv_dtype, device=device,
                         key_smoothing=smoothing)
    qkv = make_normal((n, hq + 2 * hkv, d), generator=gen)
    qkv[:, hq:hq + hkv] = make_keys(n, hkv, d, generator=gen)  # outlier channels
    qkv = qkv.to(device)
    if fused_qkv:  # views with token stride (hq + 2 hkv) * d, as a fused projection gives
        q, k, v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
    else:
        q, k, v = (t.contiguous() for t in (qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]))
    pos = torch.randint(0, max_pos, (n,), generator=gen).to(device)
    cos_sin = reference.rope_cos_sin_cache(max_pos, rotary_dim).to(device)
    slots = torch.randperm(cache.num_slots, generator=gen)[:n]
    if pad:
        slots[n // 2] = -1
    return cache, q, k, v, pos, cos_sin, slots.to(device)


def check_quantized_rows(got_q, got_s, want, kv_dtype, what):
    """Kernel rows (fp32 RoPE) vs the float64 RoPE'd rows: scales within fp32 rounding,
    values within half a step (int8) / half an e4m3 ulp (fp8) of the exact rows, and the
    codes equal to the reference quantization of the exact rows almost everywhere
    (RoPE in fp32 vs float64 may move a value across a rounding boundary)."""
    want = want.cpu()
    ref_q, ref_s = reference.quantize_rows(want.float(), kv_dtype)
    if kv_dtype == "bf16":
        assert got_s is None
        err = (got_q.cpu().double() - want).abs()
        assert (err <= want.abs() * 2.0 ** -8 + 1e-6).all(), f"{what}: bf16 max err {err.max().item()}"
        return
    torch.testing.assert_close(got_s.cpu(), ref_s, rtol=1e-5, atol=0, msg=what)
    deq = reference.dequantize_rows(got_q.cpu(), got_s.cpu())
    err = (deq - want).abs()
    s = got_s.cpu().double().unsqueeze(-1)
    if kv_dtype == "int8":
        bound = 0.5 * s * 1.001 + 1e-6 * want.abs()
    else:
        bound = torch.maximum(want.abs() * 2.0 ** -4, s * 2.0 ** -10) * 1.001 + 1e-6
    assert (err <= bound).all(), f"{what}: max excess {(err - bound).max().item()}"
    mismatch = (bits(got_q) != bits(ref_q)).float().mean().item()
    assert mismatch < 0.01, f"{what}: {mismatch:.2%} codes differ from the reference quantization"


@cases(
    "n,hq,hkv,d,rotary_dim,kv_dtype",
    [
        (17, 2, 2, 64, 64, "int8"),  # GQA 1:1, full rotary
        (17, 8, 2, 128, 32, "int8"),  # 4:1, partial
        (17, 24, 4, 256, 64, "int8"),  # 6:1, the headline layer (Qwen3.5: 1/4 rotary)
        (17, 8, 1, 256, 256, "fp8"),  # 8:1, full rotary
        (97, 6, 1, 64, 16, "fp8"),  # 6:1, odd count
        (17, 12, 2, 128, 96, "int8"),  # rotary_dim not a power of two
        (17, 8, 2, 128, 64, "bf16"),
        (17, 4, 1, 256, 128, "bf16"),
        (9, 6, 3, 80, 48, "int8"),  # head_dim not a power of two, heads not a multiple of the tile: masked
        (9, 4, 2, 96, 96, "fp8"),
        (9, 4, 1, 192, 64, "bf16"),
        (17, 6, 2, 112, 112, "int8"),
        (9, 4, 4, 64, 2, "fp8"),  # one rotated pair
    ],
)
def test_producer_vs_reference(n, hq, hkv, d, rotary_dim, kv_dtype, gen, device):
    cache, q, k, v, pos, cos_sin, slots = make_step(n, hq, hkv, d, rotary_dim, kv_dtype, gen, device)
    untouched_key = cache.key.clone()
    out_q, out_s = rope_quantize_and_write(q, k, v, pos, cos_sin, cache, slots)
    q_rope = reference.apply_rope_reference(q.cpu(), pos.cpu(), cos_sin.cpu())
    k_rope = reference.apply_rope_reference(k.cpu(), pos.cpu(), cos_sin.cpu())
    check_quantized_rows(out_q, out_s, q_rope, kv_dtype, "query")
    valid = (slots >= 0).cpu()
    blk, off = slots.cpu()[valid] // cache.block_size, slots.cpu()[valid] % cache.block_size
    if cache.key_mean is not None:  # the mean of the RoPE'd keys of this first write
        torch.testing.assert_close(cache.key_mean.cpu().double(), k_rope[valid].mean(0), rtol=0, atol=1e-5)
        k_rope = k_rope - cache.key_mean.cpu().double()
    else:
        assert kv_dtype == "bf16"
    kscale = None if cache.key_scale is None else cache.key_scale.cpu()[blk, :, off]
    vscale = None if cache.value_scale is None else cache.value_scale.cpu()[blk, :, off]
    check_quantized_rows(cache.key.cpu()[blk, :, off], kscale, k_rope[valid], kv_dtype, "key")
    # bit for bit: fp32 RoPE as PyTorch computes it, then the reference quantization
    q_rope32 = apply_rope_torch(q, pos, cos_sin).cpu()
    ref_q, ref_qs = reference.quantize_rows(q_rope32, kv_dtype)
    assert torch.equal(bits(out_q), bits(ref_q)), f"{(bits(out_q) != bits(ref_q)).sum().item()} query bytes differ"
    if kv_dtype != "bf16":
        assert torch.equal(bits(out_s), bits(ref_qs))
    k_rope32 = apply_rope_torch(k, pos, cos_sin).cpu()[valid]
    if cache.key_mean is not None:
        k_rope32 = k_rope32 - cache.key_mean.cpu()
    ref_k, ref_ks = reference.quantize_rows(k_rope32, kv_dtype)
    assert torch.equal(bits(cache.key.cpu()[blk, :, off]), bits(ref_k))
    if kscale is not None:
        assert torch.equal(bits(kscale), bits(ref_ks))
    # V is not rotated: bit-exact with write_kv's reference quantization
    ref_v, ref_vs = reference.quantize_rows(v.cpu()[valid].float(), kv_dtype)
    assert torch.equal(bits(cache.value_rows.cpu()[blk, :, off]), bits(ref_v))
    if vscale is not None:
        assert torch.equal(vscale, ref_vs)
    # slots not written keep their old content
    written = torch.zeros(cache.num_slots, dtype=torch.bool)
    written[slots.cpu()[valid]] = True
    written = written.view(cache.num_blocks, cache.block_size)
    assert torch.equal(bits(cache.key.cpu()[~written.unsqueeze(1).expand(-1, hkv, -1)]),
                       bits(untouched_key.cpu()[~written.unsqueeze(1).expand(-1, hkv, -1)]))


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8", "bf16"])
def test_producer_matches_unfused_sequence(kv_dtype, gen, device):
    """Fused producer == torch RoPE (fp32) + write_kv + quantize_query, bit for bit, with
    the same explicit key mean."""
    n, hq, hkv, d, rot = 17, 12, 2, 128, 64
    cache, q, k, v, pos, cos_sin, slots = make_step(n, hq, hkv, d, rot, kv_dtype, gen, device,
                                                    smoothing="none", fused_qkv=False)
    if cache.quantized:
        cache.set_key_mean(torch.randn(hkv, d, generator=gen))
    unfused = copy.deepcopy(cache)
    poison_q = torch.full((n, hq, d), 77, dtype=torch.int8, device=device) if kv_dtype == "int8" else None
    out_q, out_s = rope_quantize_and_write(q, k, v, pos, cos_sin, cache, slots, out_q=poison_q)
    if poison_q is not None:
        assert out_q is poison_q
    q_rope = apply_rope_torch(q, pos, cos_sin)
    k_rope = apply_rope_torch(k, pos, cos_sin)
    write_kv(unfused, k_rope, v, slots)
    ref_q, ref_s = quantize_query(q_rope, kv_dtype)
    assert torch.equal(bits(out_q), bits(ref_q))
    assert torch.equal(bits(cache.key), bits(unfused.key))
    assert torch.equal(bits(cache.value), bits(unfused.value))
    if kv_dtype == "bf16":
        assert out_s is None
        return
    assert torch.equal(bits(out_s), bits(ref_s))
    assert torch.equal(bits(cache.key_scale), bits(unfused.key_scale))
    assert torch.equal(bits(cache.value_scale), bits(unfused.value_scale))


@pytest.mark.parametrize("launch", [{"TOKENS_PER_PROGRAM": 2, "BLOCK_HQ": 4},
                                    {"TOKENS_PER_PROGRAM": 3, "KV_TOKENS": 4, "num_warps": 2},
                                    {"KV_TOKENS": 1, "BLOCK_HKV": 1}])
def test_producer_launch_variants_bit_exact(launch, gen, device):
    """Other launch shapes (several tokens per program, smaller head groups) give the same
    bytes as the default launch."""
    n, hq, hkv, d, rot = 7, 12, 2, 64, 32
    cache, q, k, v, pos, cos_sin, slots = make_step(n, hq, hkv, d, rot, "int8", gen, device, smoothing="none")
    cache.set_key_mean(torch.randn(hkv, d, generator=gen))
    other = copy.deepcopy(cache)
    want_q, want_s = rope_quantize_and_write(q, k, v, pos, cos_sin, cache, slots)
    got_q, got_s = rope_quantize_and_write(q, k, v, pos, cos_sin, other, slots, _launch=launch)
    assert torch.equal(bits(got_q), bits(want_q)) and torch.equal(bits(got_s), bits(want_s))
    for a, b in ((cache.key, other.key), (cache.value, other.value), (cache.key_scale, other.key_scale),
                 (cache.value_scale, other.value_scale)):
        assert torch.equal(bits(a), bits(b))


def test_producer_padding_emits_q_but_writes_no_kv(gen, device):
    cache, q, k, v, pos, cos_sin, slots = make_step(9, 4, 2, 64, 64, "int8", gen, device, pad=False)
    cache.set_key_mean(torch.zeros(2, 64))
    before = copy.deepcopy(cache)
    out_q, out_s = rope_quantize_and_write(q, k, v, pos, cos_sin, cache, torch.full_like(slots, -1),
                                           out_q_scale=poisoned_like(torch.empty(9, 4, device=device)))
    assert torch.isfinite(out_s).all()
    assert torch.equal(bits(cache.key), bits(before.key)) and torch.equal(cache.key_scale, before.key_scale)
    assert torch.equal(bits(cache.value), bits(before.value))


def test_producer_all_padding_first_write_leaves_mean_unset(gen, device):
    cache, q, k, v, pos, cos_sin, slots = make_step(9, 4, 2, 64, 32, "fp8", gen, device)
    rope_quantize_and_write(q, k, v, pos, cos_sin, cache, torch.full_like(slots, -1))
    assert cache.key_mean is None


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8", "bf16"])
def test_producer_non_finite_rows(kv_dtype, gen, device):
    """Q rows with an inf / NaN come out NaN (scale NaN, codes 0; bf16 NaN), K / V rows
    with one are stored poisoned as write_kv stores them, the first-write mean comes
    from the finite rows, and every other row is as without them."""
    n, hq, hkv, d, rot = 9, 4, 2, 64, 32
    cache, q, k, v, pos, cos_sin, slots = make_step(n, hq, hkv, d, rot, kv_dtype, gen, device, fused_qkv=False)
    q[1, 3, 0] = float("nan")
    k[2, 0, 40] = float("inf")  # past the rotary part
    v[6, 1, 3] = float("nan")
    unfused = copy.deepcopy(cache)
    out_q, out_s = rope_quantize_and_write(q, k, v, pos, cos_sin, cache, slots)
    k_rope = apply_rope_torch(k, pos, cos_sin)
    write_kv(unfused, k_rope, v, slots)
    ref_q, ref_s = quantize_query(apply_rope_torch(q, pos, cos_sin), kv_dtype)
    assert same_bits(out_q, ref_q)
    for a, b in ((cache.key, unfused.key), (cache.value, unfused.value)):
        assert same_bits(a, b)
    if kv_dtype == "bf16":
        # bf16 Q is RoPE'd as given: the NaN reaches its channel and the rotation partner
        assert torch.isnan(out_q[1, 3].float()).sum() == 2 and torch.isnan(out_q.float()).sum() == 2
        return
    assert torch.equal(bits(out_s), bits(ref_s))
    assert torch.isnan(out_s[1, 3]) and torch.isfinite(out_s).sum() == n * hq - 1
    assert torch.equal(bits(cache.key_scale), bits(unfused.key_scale))
    assert torch.equal(bits(cache.key_mean), bits(unfused.key_mean)) and torch.isfinite(cache.key_mean).all()
    blk, off = slots.long() // cache.block_size, slots.long() % cache.block_size
    for t, h in ((2, 0), (6, 1)):
        if slots[t] >= 0:
            assert torch.isnan(cache.key_scale[blk[t], h, off[t]])


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8", "bf16"])
def test_producer_unchecked_bad_positions_and_slots(kv_dtype, gen, device, monkeypatch):
    """With value checks off: a position outside the cos/sin table gives that token a NaN
    Q and a poisoned K/V (never an address outside the table), a slot outside the cache is
    skipped, every other byte is as the unfused sequence writes it, and check_errors()
    names the first bad token."""
    monkeypatch.setenv("INT8ATTN_CHECK_VALUES", "0")
    n, hq, hkv, d, rot, max_pos = 9, 4, 2, 64, 32, 64
    cache, q, k, v, pos, cos_sin, slots = make_step(n, hq, hkv, d, rot, kv_dtype, gen, device, pad=False,
                                                    fused_qkv=False, max_pos=max_pos)
    bad_pos = pos.clone()
    bad_pos[3] = max_pos
    bad_pos[6] = -1
    pos_ok = (bad_pos >= 0) & (bad_pos < max_pos)
    bad_slots = slots.clone()
    bad_slots[7] = cache.num_slots + 1
    unfused = copy.deepcopy(cache)
    out_q, out_s = rope_quantize_and_write(q, k, v, bad_pos, cos_sin, cache, bad_slots)
    with pytest.raises(DeviceMetadataError, match="slot outside.*position outside.*index 3;"):
        check_errors(device)
    clamped = torch.where(pos_ok, bad_pos, 0)
    nan_rows = torch.where(pos_ok[:, None, None], 0.0, float("nan"))
    write_kv(unfused, apply_rope_torch(k, clamped, cos_sin) + nan_rows, v,
             torch.where(bad_slots < cache.num_slots, bad_slots, -1))
    ref_q, ref_s = quantize_query(apply_rope_torch(q, clamped, cos_sin) + nan_rows, kv_dtype)
    assert same_bits(out_q, ref_q)
    for a, b in ((cache.key, unfused.key), (cache.value, unfused.value)):
        assert same_bits(a, b)
    if kv_dtype == "bf16":
        assert torch.isnan(out_q[[3, 6]].float()).all()
        return
    assert same_bits(out_s, ref_s) and torch.isnan(out_s[[3, 6]]).all() and torch.isfinite(out_s).sum() == 7 * hq
    assert same_bits(cache.key_scale, unfused.key_scale) and same_bits(cache.value_scale, unfused.value_scale)
    assert same_bits(cache.key_mean, unfused.key_mean) and torch.isfinite(cache.key_mean).all()


def test_producer_duplicate_slots_refused(gen, device, monkeypatch):
    monkeypatch.setenv("INT8ATTN_CHECK_VALUES", "1")
    cache, q, k, v, pos, cos_sin, slots = make_step(9, 4, 2, 64, 32, "int8", gen, device, pad=False)
    slots[8] = slots[0]
    with pytest.raises(ValueError, match=r"slot_mapping\[0\] and slot_mapping\[8\]"):
        rope_quantize_and_write(q, k, v, pos, cos_sin, cache, slots)
    assert cache.key_mean is None


def test_producer_bad_inputs_leave_cache_unchanged(gen, device, monkeypatch):
    monkeypatch.setenv("INT8ATTN_CHECK_VALUES", "1")  # the slot / position checks (off by default on a GPU)
    cache, q, k, v, pos, cos_sin, slots = make_step(9, 8, 2, 64, 32, "int8", gen, device)
    before = copy.deepcopy(cache)
    bad = [
        (TypeError, dict(query=q.to(torch.int8))),
        (ValueError, dict(query=q[:, :3])),  # 3 q heads, 2 KV heads
        (ValueError, dict(key=k[:, :1], value=v[:, :1])),  # KV heads mismatch
        (ValueError, dict(query=q[:-1])),  # token count mismatch
        (TypeError, dict(positions=pos.float())),
        (ValueError, dict(positions=pos + 10 ** 6)),  # beyond the cos/sin table
        (TypeError, dict(cos_sin_cache=cos_sin.double())),
        (ValueError, dict(cos_sin_cache=cos_sin[:, :31].contiguous())),  # odd rotary_dim
        (ValueError, dict(cos_sin_cache=torch.zeros(8, 128, device=device))),  # rotary_dim > head_dim
        (ValueError, dict(slot_mapping=slots + cache.num_slots)),
        (TypeError, dict(out_q=torch.empty(9, 8, 64, dtype=torch.float8_e4m3fn, device=device))),
        (ValueError, dict(out_q_scale=torch.empty(9, 7, device=device))),
        (ValueError, dict(key=k.transpose(0, 2).contiguous().transpose(0, 2))),  # last dim strided
    ]
    if device == "cpu":
        bad.append((ValueError, dict(query=q.to("meta"))))
    base = dict(query=q, key=k, value=v, positions=pos, cos_sin_cache=cos_sin, cache=cache, slot_mapping=slots)
    for exc, change in bad:
        args = {**base, **change}
        with pytest.raises(exc):
            rope_quantize_and_write(**args)
        assert torch.equal(bits(cache.key), bits(before.key)), change.keys()
        assert torch.equal(cache.key_scale, before.key_scale)
        assert cache.key_mean is None, change.keys()
