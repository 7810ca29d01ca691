"""write_kv: bit-exactness vs the reference, paging, padding, zero rows, round-trip error,
key smoothing, and rejected inputs that leave the cache untouched."""

import copy

import pytest
import torch

from _ids import cases
from int8attn import reference
from int8attn.cache import BlockAllocator, PagedKVCache
from int8attn.errors import DeviceMetadataError, check_errors
from int8attn.ops.write import write_kv
from int8attn.testing import make_keys, make_normal


def bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes of a tensor on the CPU (bit-exact comparison of any dtype, NaN included)."""
    return t.detach().cpu().contiguous().view(torch.uint8)


def assert_same_bits(a, b, what):
    """Byte equality, except that any NaN equals any NaN (payloads differ between the
    kernels' conversions and PyTorch's, and between backends)."""
    if a.is_floating_point() and a.element_size() > 1:
        a_nan, b_nan = torch.isnan(a.float()).cpu(), torch.isnan(b.float()).cpu()
        if not torch.equal(a_nan, b_nan):
            raise AssertionError(f"{what}: NaN at {(a_nan != b_nan).nonzero()[:5].tolist()} differs")
        a, b = a.cpu().masked_fill(a_nan, 0), b.cpu().masked_fill(b_nan, 0)
    if not torch.equal(bits(a), bits(b)):
        diff = (bits(a) != bits(b)).nonzero()[:5].tolist()
        raise AssertionError(f"{what} differs from the reference at byte indices {diff}")


def assert_caches_equal(c1: PagedKVCache, c2: PagedKVCache):
    assert_same_bits(c1.key, c2.key, "key")
    assert_same_bits(c1.value, c2.value, "value")
    if c1.quantized:
        assert_same_bits(c1.key_scale, c2.key_scale, "key_scale")
        assert_same_bits(c1.value_scale, c2.value_scale, "value_scale")
    assert (c1.key_mean is None) == (c2.key_mean is None)
    if c1.key_mean is not None:
        assert_same_bits(c1.key_mean, c2.key_mean, "key_mean")


def reference_write(cache_before, key, value, slots, kernel_cache=None):
    """``reference.write_kv_reference`` applied to a CPU copy of ``cache_before``.

    The reference runs on the CPU: there torch divides by a Python scalar exactly, while
    on CUDA it multiplies by the reciprocal (a scale may move by one ulp). On a GPU the
    first-write mean is also taken from ``kernel_cache`` (a CUDA reduction sums in
    another order than the CPU one).
    """
    ref = copy.copy(cache_before)
    ref.device = torch.device("cpu")
    for name in ("key", "value", "key_scale", "value_scale", "key_mean"):
        t = getattr(cache_before, name)
        setattr(ref, name, None if t is None else t.detach().cpu().clone())
    if kernel_cache is not None and kernel_cache.key.is_cuda and ref.key_mean is None \
            and kernel_cache.key_mean is not None:
        ref.key_mean = kernel_cache.key_mean.cpu().clone()
    reference.write_kv_reference(ref, key.cpu(), value.cpu(), slots.cpu())
    return ref


def fill_garbage(cache: PagedKVCache, gen: torch.Generator) -> None:
    """Random bytes in every slot, so a test sees which slots a write touched."""
    for t in (cache.key, cache.value):
        if cache.kv_dtype == "bf16":
            t.copy_(torch.randn(t.shape, generator=gen).to(torch.bfloat16))
        else:
            t.view(torch.uint8).copy_(torch.randint(0, 256, t.shape, generator=gen, dtype=torch.uint8))
            if cache.kv_dtype == "fp8":  # keep it finite: clear 0x7f / 0xff (NaN)
                t.view(torch.uint8)[t.view(torch.uint8) & 0x7F == 0x7F] = 0
    if cache.quantized:
        cache.key_scale.copy_(torch.rand(cache.key_scale.shape, generator=gen) + 0.5)
        cache.value_scale.copy_(torch.rand(cache.value_scale.shape, generator=gen) + 0.5)


def make_case(n, num_kv_heads, head_dim, kv_dtype, block_size=16, gen=None, device="cpu", smoothing="auto",
              pad_every=0, dtype=torch.bfloat16, index_dtype=torch.int64):
    num_blocks = -(-n // block_size) + 3
    cache = PagedKVCache(num_blocks, block_size, num_kv_heads, head_dim, kv_dtype=kv_dtype, device=device,
                         key_smoothing=smoothing)
    fill_garbage(cache, gen)
    # slots: a random permutation of all slots (crosses blocks, every offset)
    slots = torch.randperm(cache.num_slots, generator=gen)[:n]
    if pad_every:
        slots[::pad_every] = -1
    key = make_keys(n, num_kv_heads, head_dim, generator=gen, dtype=dtype)
    value = make_normal((n, num_kv_heads, head_dim), generator=gen, dtype=dtype)
    return cache, key.to(device), value.to(device), slots.to(device=device, dtype=index_dtype)


@cases(
    "n,num_kv_heads,head_dim,block_size,kv_dtype",
    [
        (17, 1, 64, 8, "int8"),
        (97, 4, 128, 16, "int8"),
        (17, 8, 256, 32, "int8"),
        (17, 6, 128, 16, "int8"),
        (97, 2, 64, 16, "fp8"),
        (17, 4, 256, 16, "fp8"),
        (17, 3, 128, 64, "fp8"),
        (17, 4, 128, 16, "bf16"),
        (17, 2, 256, 8, "bf16"),
        (9, 2, 80, 16, "fp8"),  # head_dim not a power of two: masked lanes
        (17, 2, 96, 16, "int8"),
        (9, 3, 160, 8, "fp8"),
        (17, 1, 192, 16, "bf16"),
        (16, 2, 112, 16, "int8"),
    ],
)
def test_write_kv_bit_exact_vs_reference(n, num_kv_heads, head_dim, block_size, kv_dtype, gen, device):
    cache, key, value, slots = make_case(n, num_kv_heads, head_dim, kv_dtype, block_size, gen, device, pad_every=5)
    before = copy.deepcopy(cache)
    write_kv(cache, key, value, slots)
    # written slots equal the reference, untouched slots keep their garbage
    assert_caches_equal(cache, reference_write(before, key, value, slots, cache))
    if kv_dtype != "bf16":
        assert cache.key_mean is not None  # default "auto" smooths quantized caches


@pytest.mark.parametrize("launch", [{"KV_TOKENS": 2, "num_warps": 2}, {"KV_TOKENS": 32, "BLOCK_HKV": 1},
                                    {"KV_TOKENS": 1, "BLOCK_HKV": 2}])
def test_write_kv_launch_variants_bit_exact(launch, gen, device):
    """Several tokens per program (the last program half empty, padding inside it)."""
    cache, key, value, slots = make_case(17, 4, 64, "int8", 16, gen, device, pad_every=3)
    before = copy.deepcopy(cache)
    write_kv(cache, key, value, slots, _launch=launch)
    assert_caches_equal(cache, reference_write(before, key, value, slots, cache))


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_write_kv_other_input_dtypes_and_int32_slots(kv_dtype, dtype, gen, device):
    cache, key, value, slots = make_case(23, 2, 64, kv_dtype, 8, gen, device, dtype=dtype,
                                         index_dtype=torch.int32, smoothing="none")
    before = copy.deepcopy(cache)
    write_kv(cache, key, value, slots)
    assert_caches_equal(cache, reference_write(before, key, value, slots))


def test_write_kv_strided_inputs_from_fused_qkv(gen, device):
    """K and V as views of one fused projection output (token stride != Hkv * D)."""
    n, hq, hkv, d = 17, 8, 2, 128
    qkv = make_normal((n, hq + 2 * hkv, d), generator=gen).to(device)
    key, value = qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
    assert not key.is_contiguous()
    cache = PagedKVCache(4, 16, hkv, d, device=device)
    before = copy.deepcopy(cache)
    slots = torch.randperm(64, generator=gen)[:n].to(device)
    write_kv(cache, key, value, slots)
    assert_caches_equal(cache, reference_write(before, key, value, slots, cache))


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8", "bf16"])
def test_zero_rows_get_scale_one(kv_dtype, gen, device):
    cache, key, value, slots = make_case(9, 2, 64, kv_dtype, 8, gen, device, smoothing="none")
    key[2] = 0
    value[3, 1] = 0
    key[4, 0] = -0.0
    write_kv(cache, key, value, slots)
    for t in (cache.key, cache.value):
        assert torch.isfinite(t.float()).all()
    if cache.quantized:
        blk, off = slots // cache.block_size, slots % cache.block_size
        assert torch.equal(cache.key_scale[blk[2], :, off[2]].cpu(), torch.ones(2))
        assert cache.value_scale[blk[3], 1, off[3]].item() == 1.0
        assert cache.key_scale[blk[4], 0, off[4]].item() == 1.0
        assert torch.isfinite(cache.key_scale).all() and torch.isfinite(cache.value_scale).all()
        assert (cache.key[blk[2], :, off[2]].float() == 0).all()


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_round_trip_error_bounds(kv_dtype, gen, device):
    cache, key, value, slots = make_case(97, 4, 128, kv_dtype, 16, gen, device, smoothing="none")
    write_kv(cache, key, value, slots)
    blk, off = slots.long() // cache.block_size, slots.long() % cache.block_size
    for src, data, scale in ((key, cache.key, cache.key_scale), (value, cache.value_rows, cache.value_scale)):
        x = src.double().cpu()
        s = scale[blk, :, off].double().cpu()
        deq = reference.dequantize_rows(data[blk, :, off].cpu(), s)
        err = (deq - x).abs()
        amax = x.abs().amax(-1)
        if kv_dtype == "int8":
            torch.testing.assert_close(s, amax / 127, rtol=1e-6, atol=0)
            bound = 0.5 * s.unsqueeze(-1) * (1 + 1e-5)
        else:
            torch.testing.assert_close(s, amax / 448, rtol=1e-6, atol=0)
            # 3 mantissa bits: half an ulp is 2**-4 relative; subnormals: 2**-10 * s absolute
            bound = torch.maximum(x.abs() * 2.0 ** -4, s.unsqueeze(-1) * 2.0 ** -10) * (1 + 1e-5)
        assert (err <= bound).all(), f"max excess {(err - bound).max().item()}"


def test_allocator_paging_with_offsets_and_permuted_blocks(gen, device):
    """Sequences grown over several writes land in permuted blocks at non-zero offsets and
    read back (reference.gather_kv) in order."""
    bs, hkv, d = 8, 2, 64
    cache = PagedKVCache(12, bs, hkv, d, device=device, key_smoothing="none")
    alloc = BlockAllocator.for_cache(cache)
    alloc._free = torch.randperm(12, generator=gen).tolist()
    written = {0: [], 1: []}
    for step_lens in ((5, 11), (1, 1), (13, 3)):
        keys, values, slots = [], [], []
        for seq, n in enumerate(step_lens):
            slots += alloc.allocate(seq, n)
            k = make_keys(n, hkv, d, generator=gen)
            v = make_normal((n, hkv, d), generator=gen)
            written[seq].append((k, v))
            keys.append(k)
            values.append(v)
        write_kv(cache, torch.cat(keys).to(device), torch.cat(values).to(device),
                 torch.tensor(slots, device=device))
    table = alloc.block_table([0, 1], device=device)
    for seq in (0, 1):
        k_ref = torch.cat([k for k, _ in written[seq]]).double()
        v_ref = torch.cat([v for _, v in written[seq]]).double()
        k, v = reference.gather_kv(cache, table[seq], alloc.seq_len(seq))
        assert k.shape == k_ref.shape
        assert (k.cpu() - k_ref).abs().max() <= k_ref.abs().max() / 127
        assert (v.cpu() - v_ref).abs().max() <= v_ref.abs().max() / 127


def test_all_padding_write_is_a_no_op(gen, device):
    cache, key, value, slots = make_case(7, 2, 64, "int8", 8, gen, device)
    before = copy.deepcopy(cache)
    write_kv(cache, key, value, torch.full_like(slots, -1))
    assert_caches_equal(cache, before)
    assert cache.key_mean is None  # the mean waits for the first real tokens
    write_kv(cache, key[:0], value[:0], slots[:0])
    assert cache.key_mean is None


def test_first_write_mean_then_fixed(gen, device):
    cache, key, value, slots = make_case(17, 2, 128, "int8", 16, gen, device, pad_every=4)
    write_kv(cache, key, value, slots)
    valid = slots >= 0
    torch.testing.assert_close(cache.key_mean.cpu(), key[valid].float().mean(0).cpu(), rtol=0, atol=0)
    mean = cache.key_mean.clone()
    key2 = make_keys(5, 2, 128, generator=gen).to(device) + 3.0
    write_kv(cache, key2, key2, torch.arange(5, device=device))
    assert torch.equal(cache.key_mean, mean)  # later writes reuse it


def test_explicit_key_mean_is_used(gen, device):
    cache, key, value, slots = make_case(17, 4, 64, "fp8", 8, gen, device, smoothing="none")
    cache.set_key_mean(torch.randn(4, 64, generator=gen))
    before = copy.deepcopy(cache)
    write_kv(cache, key, value, slots)
    assert_caches_equal(cache, reference_write(before, key, value, slots))


def _attention_error(kv_dtype, smoothing, outliers, gen, device):
    seq_len, hq, hkv, d = 97, 8, 2, 128
    cache = PagedKVCache(-(-seq_len // 16), 16, hkv, d, kv_dtype=kv_dtype, device=device, key_smoothing=smoothing)
    key = make_keys(seq_len, hkv, d, outliers=outliers, generator=gen).to(device)
    value = make_normal((seq_len, hkv, d), generator=gen).to(device)
    write_kv(cache, key, value, torch.arange(seq_len, device=device))
    query = make_normal((4, hq, d), generator=gen).to(device)
    table = torch.arange(cache.num_blocks, dtype=torch.int32, device=device)[None]
    lens = torch.tensor([seq_len], dtype=torch.int32, device=device)
    qsl = torch.tensor([0, 4], dtype=torch.int32, device=device)
    out = reference.attention_reference(query, cache, table, lens, qsl)
    exact = reference.attend(query.cpu(), key.cpu(), value.cpu(), seq_len - 4, d ** -0.5)
    # what kernels compute: keys without the mean added back
    blk_row = table[0]
    k_nomean, v = reference.gather_kv(cache, blk_row, seq_len, add_key_mean=False)
    out_nomean = reference.attend(query.cpu(), k_nomean.cpu(), v.cpu(), seq_len - 4, d ** -0.5)
    return out, out_nomean, exact


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_key_smoothing_leaves_attention_unchanged(kv_dtype, gen, device):
    out, out_nomean, exact = _attention_error(kv_dtype, "first_write", True, gen, device)
    # softmax is shift-invariant per query: dropping q . mean changes nothing
    torch.testing.assert_close(out_nomean, out, rtol=1e-10, atol=1e-10)
    assert reference.error_stats(out, exact)["rel_l2"] < (0.03 if kv_dtype == "int8" else 0.08)


def test_key_smoothing_reduces_int8_error_on_outlier_keys(device):
    errs = {}
    for smoothing in ("none", "first_write"):
        out, _, exact = _attention_error("int8", smoothing, True, torch.Generator().manual_seed(7), device)
        errs[smoothing] = reference.error_stats(out, exact)["rel_l2"]
    assert errs["first_write"] < 0.6 * errs["none"], errs


# --------------------------------------------------------------------------- non-finite input
@pytest.mark.parametrize("kv_dtype", ["int8", "fp8", "bf16"])
def test_non_finite_rows_are_stored_poisoned(kv_dtype, gen, device):
    """A (token, head) with an inf / NaN in K or V: key scale NaN and key codes 0 (bf16: a
    NaN key row), value codes 0 with scale 1 (bf16: zeros), bit for bit as the reference;
    every other row is quantized as usual and untouched slots keep their bytes."""
    cache, key, value, slots = make_case(17, 3, 80, kv_dtype, 8, gen, device, smoothing="none")
    key[2, 1, 7] = float("nan")
    value[5, 0, 79] = float("inf")
    key[9, 2, 0] = float("-inf")
    value[9, 2, 1] = float("nan")
    before = copy.deepcopy(cache)
    write_kv(cache, key, value, slots)
    assert_caches_equal(cache, reference_write(before, key, value, slots))
    blk, off = slots.long() // cache.block_size, slots.long() % cache.block_size
    poisoned = [(2, 1), (5, 0), (9, 2)]
    for t, h in poisoned:
        if cache.quantized:
            assert torch.isnan(cache.key_scale[blk[t], h, off[t]]) and cache.value_scale[blk[t], h, off[t]] == 1
            assert (cache.key[blk[t], h, off[t]].float() == 0).all()
        else:
            assert torch.isnan(cache.key[blk[t], h, off[t]].float()).all()
        assert (cache.value_rows[blk[t], h, off[t]].float() == 0).all()
    if cache.quantized:
        ks = cache.key_scale[blk, :, off].clone()
        for t, h in poisoned:
            ks[t, h] = 1.0
        assert torch.isfinite(ks).all() and torch.isfinite(cache.value_scale).all()


def test_first_write_mean_comes_from_finite_rows(gen, device):
    """A NaN / inf in the first write does not reach cache.key_mean (the mean of that head
    is taken over its finite rows), so a later clean sequence is quantized as well as
    without the bad rows: its attention error against the float64 reference of its raw
    keys is what it is when the first write is clean."""
    n, m, hkv, d = 40, 37, 2, 128
    keys = make_keys(n + m, hkv, d, generator=gen).to(device)  # one layer: shared outlier channels
    values = make_normal((n + m, hkv, d), generator=gen).to(device)
    query = make_normal((5, 4, d), generator=gen).to(device)
    table = torch.tensor([[4, 5, 6]], dtype=torch.int32, device=device)
    lens = torch.tensor([m], dtype=torch.int32, device=device)
    qsl = torch.tensor([0, 5], dtype=torch.int32, device=device)
    exact = reference.attend(query.cpu(), keys[n:].cpu(), values[n:].cpu(), m - 5, d ** -0.5)
    errors = {}
    for poisoned in (False, True):
        cache = PagedKVCache(8, 16, hkv, d, kv_dtype="int8", device=device)
        key, value = keys[:n].clone(), values[:n].clone()
        if poisoned:
            key[3, 0, 5] = float("nan")
            value[4, 1, 0] = float("inf")  # a V-only problem poisons the token, not the K statistics
            key[6, 1, 9] = float("inf")
        write_kv(cache, key, value, torch.arange(n, device=device))
        finite = torch.isfinite(key.float()).all(-1)
        want = torch.stack([key[finite[:, h], h].float().mean(0) for h in range(hkv)])
        torch.testing.assert_close(cache.key_mean, want, rtol=1e-6, atol=1e-6)
        # bit for bit under the interpreter; a GPU sums in another order (float rounding)
        bitwise = cache.device.type == "cpu"
        torch.testing.assert_close(cache.key_mean.cpu(), reference.key_mean_reference(key.cpu(), torch.arange(n)),
                                   rtol=0 if bitwise else 1e-6, atol=0 if bitwise else 1e-6)
        write_kv(cache, keys[n:], values[n:], torch.arange(64, 64 + m, device=device))  # pages 4..6
        out = reference.attention_reference(query, cache, table, lens, qsl)
        errors[poisoned] = reference.error_stats(out, exact)["rel_l2"]
    assert errors[True] < 0.03 and errors[True] < 1.2 * errors[False], errors


def test_first_write_with_no_finite_row_leaves_the_mean_unset(gen, device):
    cache, key, value, slots = make_case(5, 2, 64, "int8", 8, gen, device)
    key[:, :, 0] = float("nan")
    write_kv(cache, key, value, slots)
    assert cache.key_mean is None
    assert torch.isnan(cache.key_scale[slots.long() // 8, :, slots.long() % 8]).all()


# --------------------------------------------------------------------------- rejected input
def _bad_calls(cache, key, value, slots):
    n, hkv, d = key.shape
    yield "key dtype", TypeError, (cache, key.to(torch.int32), value, slots)
    yield "key not a tensor", TypeError, (cache, key.tolist(), value, slots)
    yield "slot dtype", TypeError, (cache, key, value, slots.float())
    yield "cache type", TypeError, (object(), key, value, slots)
    yield "key 2-D", ValueError, (cache, key[:, 0], value, slots)
    yield "value shape", ValueError, (cache, key, value[:-1], slots)
    yield "kv heads mismatch", ValueError, (cache, key[:, :1], value[:, :1], slots)
    yield "head_dim mismatch", ValueError, (cache, key[..., :32], value[..., :32], slots)
    strided_key = key.transpose(1, 2).contiguous().transpose(1, 2)
    yield "non-contiguous last dim", ValueError, (cache, strided_key, value, slots)
    yield "slot_mapping length", ValueError, (cache, key, value, slots[:-1])
    yield "slot out of range", ValueError, (cache, key, value, torch.where(slots == slots[3], cache.num_slots, slots))
    yield "slot below -1", ValueError, (cache, key, value, torch.where(slots == slots[2], -2, slots))
    yield "device", ValueError, (cache, key.to("meta"), value.to("meta"), slots.to("meta"))


def test_bad_inputs_raise_before_launch_and_leave_cache_unchanged(gen, device, monkeypatch):
    monkeypatch.setenv("INT8ATTN_CHECK_VALUES", "1")  # the slot checks (off by default on a GPU)
    cache, key, value, slots = make_case(9, 2, 64, "int8", 8, gen, device)
    before = copy.deepcopy(cache)
    for what, exc, args in _bad_calls(cache, key, value, slots):
        if what == "device" and device != "cpu":
            continue
        with pytest.raises(exc):
            write_kv(*args)
        assert_caches_equal(cache, before)
        assert cache.key_mean is None, what


def test_duplicate_slots_are_refused_when_values_are_checked(gen, device, monkeypatch):
    """Two tokens of one call to the same slot: a clear error naming both and the slot,
    before the cache is touched (padding -1 may repeat)."""
    monkeypatch.setenv("INT8ATTN_CHECK_VALUES", "1")
    cache, key, value, slots = make_case(9, 2, 64, "int8", 8, gen, device, pad_every=4)
    slots[7] = slots[2]
    before = copy.deepcopy(cache)
    with pytest.raises(ValueError, match=rf"slot_mapping\[2\] and slot_mapping\[7\] are both slot {int(slots[2])}"):
        write_kv(cache, key, value, slots)
    assert_caches_equal(cache, before)
    slots[7] = -1  # several padding tokens are fine
    write_kv(cache, key, value, slots)
    assert_caches_equal(cache, reference_write(before, key, value, slots, cache))


@pytest.mark.parametrize("kv_dtype,launch", [("int8", None), ("fp8", {"KV_TOKENS": 1, "BLOCK_HKV": 2}),
                                             ("bf16", None), ("int8", {"KV_TOKENS": 8, "BLOCK_HKV": 1})],
                         ids=["int8", "fp8_one_token", "bf16", "int8_whole_pages"])
def test_unchecked_bad_slots_are_skipped_and_flagged(kv_dtype, launch, gen, device, monkeypatch):
    """With value checks off, slots outside [-1, num_slots) are skipped (no byte outside
    the written slots changes), the other tokens are written exactly, and check_errors()
    names the first bad token."""
    monkeypatch.setenv("INT8ATTN_CHECK_VALUES", "0")
    cache, key, value, _ = make_case(40, 2, 64, kv_dtype, 8, gen, device, smoothing="none")
    slots = torch.arange(8, 48, device=device)  # whole pages from page 1 on
    bad = slots.clone()
    bad[5] = cache.num_slots
    bad[11] = -2
    bad[30] = 10 ** 9
    before = copy.deepcopy(cache)
    write_kv(cache, key, value, bad, _launch=launch)
    assert_caches_equal(cache, reference_write(before, key, value, torch.where((bad >= 0) & (bad < cache.num_slots),
                                                                                bad, -1)))
    with pytest.raises(DeviceMetadataError, match="slot outside.*index 5;"):
        check_errors(device)


def test_checked_call_reports_earlier_flags(gen, device, monkeypatch):
    """A later call that runs its value checks raises what an unchecked kernel flagged."""
    cache, key, value, slots = make_case(9, 2, 64, "int8", 8, gen, device)
    monkeypatch.setenv("INT8ATTN_CHECK_VALUES", "0")
    write_kv(cache, key, value, torch.where(slots == slots[4], cache.num_slots + 3, slots))
    monkeypatch.setenv("INT8ATTN_CHECK_VALUES", "1")
    with pytest.raises(DeviceMetadataError, match="index 4;"):
        write_kv(cache, key, value, slots)
    write_kv(cache, key, value, slots)  # flags cleared


def test_non_contiguous_last_dim_message(gen, device):
    cache, key, value, slots = make_case(9, 2, 64, "int8", 8, gen, device)
    key_t = torch.empty(9, 2, 64, 2, dtype=key.dtype, device=device)[..., 0]
    key_t.copy_(key)
    with pytest.raises(ValueError, match="contiguous last dimension"):
        write_kv(cache, key_t, value, slots)


def test_value_checks_can_be_disabled(gen, device, monkeypatch):
    cache, key, value, slots = make_case(9, 2, 64, "int8", 8, gen, device)
    monkeypatch.setenv("INT8ATTN_CHECK_VALUES", "0")
    # metadata checks stay on
    with pytest.raises(TypeError):
        write_kv(cache, key.to(torch.int32), value, slots)
    # the value check is off: an in-range call still works
    write_kv(cache, key, value, slots)


@cases("kv_dtype,head_dim,block_size", [("int8", 64, 16), ("fp8", 128, 16), ("int8", 80, 16),
                                                          ("int8", 64, 32)])
def test_whole_pages_take_the_aligned_store_and_stay_bit_exact(kv_dtype, head_dim, block_size, gen, device):
    """Prefill-like slots: whole pages of consecutive slots (in permuted pages, the
    kernel's aligned transposed-page store) next to a page entered mid-way, a page with
    a padding token and a short tail -- all bit-exact against the reference."""
    pages = 6
    cache = PagedKVCache(pages + 2, block_size, 3, head_dim, kv_dtype=kv_dtype, device=device, key_smoothing="none")
    fill_garbage(cache, gen)
    order = torch.randperm(pages + 2, generator=gen)[:pages]
    slots = torch.cat([order[0] * block_size + torch.arange(block_size),  # whole page
                       order[1] * block_size + torch.arange(block_size),  # whole page
                       order[2] * block_size + 3 + torch.arange(block_size - 3),  # mid-page start
                       order[3] * block_size + torch.arange(block_size),  # page with a padding token
                       order[4] * block_size + torch.arange(5)])  # short tail
    slots[3 * block_size - 3 + 4] = -1
    n = slots.shape[0]
    key = make_keys(n, 3, head_dim, generator=gen).to(device)
    value = make_normal((n, 3, head_dim), generator=gen).to(device)
    slots = slots.to(device)
    before = copy.deepcopy(cache)
    write_kv(cache, key, value, slots)
    assert_caches_equal(cache, reference_write(before, key, value, slots, cache))
