"""prefill_attention: chunked prefill vs the float64 references (both), chunk lengths
crossing tiles, prefixes on and off page boundaries, GQA ratios, head dims, page sizes,
every cache dtype and PV precision, varlen batches, skipped sequences, pre-quantized
queries, and inputs rejected before any launch."""

import copy
import math
from dataclasses import replace

import pytest
import torch

from _ids import cases
from int8attn import reference, testing
from int8attn.errors import DeviceMetadataError, check_errors
from int8attn.ops.prefill import DEFAULT_PV, PrefillConfig, launch_grid, prefill_attention
from int8attn.ops.producer import quantize_query

# Tight bounds vs the quantized-query reference (the gap is the P rounding and fp32 /
# bf16 arithmetic) and end-to-end bounds vs the float64 reference over the dequantized
# cache (the query quantization adds in). Measured worst cases on these data were about
# half of each bound.
TOL_QUANTIZED = {("int8", "int8"): 0.012, ("int8", "bf16"): 0.006, ("fp8", "fp8"): 0.03,
                 ("fp8", "bf16"): 0.006, ("bf16", "bf16"): 0.008}
TOL_REFERENCE = {("int8", "int8"): 0.016, ("int8", "bf16"): 0.012, ("fp8", "fp8"): 0.05,
                 ("fp8", "bf16"): 0.045, ("bf16", "bf16"): 0.008}
#: Small tiles so a few dozen tokens already cross several query and KV tiles.
SMALL = PrefillConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)


def batch(seq_lens, q_lens, *, hq=4, hkv=2, d=64, bs=16, kv="int8", seed=0, device="cpu"):
    return testing.make_paged_batch(seq_lens, q_lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                                    block_size=bs, kv_dtype=kv, seed=seed, device=device)


def args_of(b):
    return b.query, b.cache, b.block_table, b.seq_lens, b.query_start_loc


def on_device(config, pv, device):
    """``config`` as compiled code accepts it: 8-bit PV dots need >= 32 keys per tile on a
    GPU (the interpreter runs the 16-key tiles that make small tests cross many tiles)."""
    if config is not None and device != "cpu" and pv in ("int8", "fp8") and config.block_n < 32:
        return replace(config, block_n=32)
    return config


def run_and_check(b, *, pv=None, config=SMALL, name="out", **kw):
    kv = b.cache.kv_dtype
    key = (kv, pv or DEFAULT_PV[kv])
    out = testing.poisoned_like(torch.empty(b.query.shape, dtype=torch.bfloat16, device=b.query.device))
    prefill_attention(*args_of(b), out=out, pv_mode=pv, config=on_device(config, key[1], b.query.device.type), **kw)
    scale = kw.get("softmax_scale")
    refq = reference.attention_reference_quantized(*args_of(b), softmax_scale=scale)
    ref = reference.attention_reference(*args_of(b), softmax_scale=scale)
    testing.assert_close_verbose(out, refq, rel_l2=TOL_QUANTIZED[key], name=f"{name} vs quantized-query ref")
    testing.assert_close_verbose(out, ref, rel_l2=TOL_REFERENCE[key], name=f"{name} vs float64 ref")
    return out


# --------------------------------------------------------------------------- accuracy
@cases("q_len,prefix,pv", [(1, 0, "int8"), (9, 1, "bf16"), (17, 17, "int8"), (65, 16, "bf16"),
                                           (130, 0, "int8")])
def test_chunk_lengths_and_prefixes(q_len, prefix, pv, device):
    """Chunks of 1..130 tokens over prefixes 0, 1, 17 and one page exactly (16)."""
    b = batch([prefix + q_len], [q_len], seed=q_len, device=device)
    run_and_check(b, pv=pv)


@cases("kv,pv", [("int8", "int8"), ("int8", "bf16"), ("fp8", "fp8"), ("fp8", "bf16"),
                                   ("bf16", "bf16")])
def test_cache_dtypes_and_pv_modes(kv, pv, device):
    b = batch([40, 23], [30, 23], kv=kv, seed=3, device=device)
    run_and_check(b, pv=pv)


@cases("hq,hkv,d,bs", [(4, 4, 128, 32), (8, 2, 64, 64), (6, 1, 64, 16), (8, 1, 256, 16),
                                         (12, 2, 64, 8)])
def test_gqa_head_dims_page_sizes(hq, hkv, d, bs, device):
    """GQA 1/4/6/8 (6: rows of the last GQA group pad the tile), head_dim 64/128/256,
    pages of 8..64 tokens (KV tiles span several pages, or a fraction of one)."""
    b = batch([33, 20], [21, 20], hq=hq, hkv=hkv, d=d, bs=bs, seed=hq + d, device=device)
    run_and_check(b, pv="int8")


@pytest.mark.parametrize("config,pv", [
    (PrefillConfig(block_m=32, block_n=32, dv=32, num_warps=4, num_stages=1), "int8"),   # 2 PV column chunks
    (PrefillConfig(block_m=16, block_n=64, dv=16, num_warps=4, num_stages=1), "int8"),   # 4 chunks, tile > page
    (PrefillConfig(block_m=64, block_n=16, p_shift=True, num_warps=4, num_stages=1), "int8"),  # P on 0..255
    (PrefillConfig(block_m=32, block_n=32, dv=16, num_warps=4, num_stages=1), "bf16"),   # 16-bit PV, 4 chunks
    # V loaded right before each PV dot; cvt_asm asked for but off outside CUDA (portable path)
    (PrefillConfig(block_m=32, block_n=32, dv=32, v_late=True, cvt_asm=True, num_warps=4, num_stages=1), "bf16"),
    (PrefillConfig(block_m=16, block_n=32, dv=16, v_late=True, num_warps=4, num_stages=1), "int8"),
    # V pages loaded as flat [pages, D * PAGE] runs (one tile = 2 pages)
    (PrefillConfig(block_m=32, block_n=32, dv=16, v_flat=True, num_warps=4, num_stages=1), "bf16"),
    (PrefillConfig(block_m=16, block_n=64, dv=32, v_flat=True, v_late=True, num_warps=4, num_stages=1), "int8"),
], ids=["dv2", "dv4_n64", "shift", "pv16_dv4", "pv16_late_dv2", "pv8_late_dv4", "pv16_flat_dv4", "pv8_flat_late"])
def test_kernel_variants(config, pv, device):
    b = batch([97, 5], [60, 5], seed=11, device=device)
    run_and_check(b, config=config, pv=pv)


@cases("kv,scale", [("int8", 2.0), ("bf16", 2.0), ("fp8", 0.05)])
def test_lazy_rescale_matches_eager_rescale(kv, scale, device):
    """16-bit PV rescales the accumulator only when a running max grows by > 2**4; with
    peaked scores (softmax_scale 2: maxima jump by far more than 4 in log2 units from tile
    to tile) and flat ones, lazy and every-tile rescaling agree with the references."""
    b = batch([70, 45], [50, 45], kv=kv, seed=21, device=device)
    # peaked softmax magnifies the query's quantization error, so the bound that holds is
    # the one against the quantized-query reference
    refq = reference.attention_reference_quantized(*args_of(b), softmax_scale=scale)
    outs = []
    for lazy in (True, False):
        out = testing.poisoned_like(torch.empty(b.query.shape, dtype=torch.bfloat16, device=device))
        prefill_attention(*args_of(b), out=out, pv_mode="bf16", config=replace(SMALL, lazy_rescale=lazy),
                          softmax_scale=scale)
        testing.assert_close_verbose(out, refq, rel_l2=TOL_QUANTIZED[(kv, "bf16")], name=f"lazy={lazy}")
        outs.append(out)
    testing.assert_close_verbose(outs[0], outs[1].float(), rel_l2=2e-3, name="lazy vs eager rescale")


def test_varlen_batch(device):
    """Many sequences of different prefix and chunk lengths (and an empty one) in one
    launch (programs find their sequence by searching query_start_loc)."""
    b = batch([50, 17, 3, 40, 1, 70], [33, 17, 0, 9, 1, 12], hq=6, hkv=2, seed=5, device=device)
    run_and_check(b)


def test_max_query_len_grid_matches_searched_grid(device):
    """With max_query_len the grid is sequences x tiles (here smaller than the searched
    one); both give bit-identical rows."""
    q_lens = [20, 18, 20]
    b = batch([25, 18, 40], q_lens, hq=6, hkv=2, seed=8, device=device)
    block_q = SMALL.block_m // 3
    assert launch_grid(b.query.shape[0], 3, block_q, max(q_lens))[2] is False
    assert launch_grid(b.query.shape[0], 3, block_q, None)[2] is True
    out = run_and_check(b)
    dense = testing.poisoned_like(out)
    prefill_attention(*args_of(b), out=dense, config=SMALL, max_query_len=max(q_lens))
    assert torch.equal(out, dense)


def test_min_query_len_skips_rows(device):
    """Sequences with q_len <= min_query_len are left untouched (their rows stay NaN)."""
    b = batch([20, 30, 12], [8, 20, 3], seed=9, device=device)
    out = testing.poisoned_like(torch.empty(b.query.shape, dtype=torch.bfloat16, device=device))
    prefill_attention(*args_of(b), out=out, config=SMALL, min_query_len=8)
    assert torch.isnan(out[:8].float()).all() and torch.isnan(out[28:].float()).all()
    ref = reference.attention_reference(*args_of(b))
    testing.assert_close_verbose(out[8:28], ref[8:28], rel_l2=TOL_REFERENCE[("int8", "int8")])


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_prequantized_query_matches_in_kernel_quantization(kv, device):
    b = batch([45], [45], kv=kv, seed=2, device=device)
    out = run_and_check(b)
    q, s = quantize_query(b.query, kv)
    out_pre = testing.poisoned_like(out)
    prefill_attention(*args_of(b), out=out_pre, config=SMALL, q_quant=q, q_scale=s)
    assert torch.equal(out, out_pre)


def test_softmax_scale_and_default_config(device):
    b = batch([26], [18], seed=4, device=device)
    run_and_check(b, config=None, softmax_scale=0.3)


def test_outlier_free_gaussian_and_tiny_values(device):
    """Plain Gaussian keys, and values scaled down 1e-4 (P must not underflow)."""
    b = testing.make_paged_batch([30], [30], num_q_heads=4, num_kv_heads=2, head_dim=64, outliers=False,
                                 seed=6, device=device, writer=lambda c, k, v, s: reference.write_kv_reference(
                                     c, k, v * 1e-4, s))
    for pv in ("int8", "bf16"):
        run_and_check(b, pv=pv)


def test_small_values_in_the_first_tile(device):
    """The fp16 P unit comes from the first KV tile's V scales: values 1e-3 smaller there
    than later (a sink-like start) must neither overflow P nor lose the later keys."""
    def writer(c, k, v, s):
        v = v.clone()
        v[:20] *= 1e-3
        reference.write_kv_reference(c, k, v, s)

    b = testing.make_paged_batch([90], [40], num_q_heads=4, num_kv_heads=2, head_dim=64, seed=13, device=device,
                                 writer=writer)
    out = run_and_check(b, pv="bf16")
    assert torch.isfinite(out.float()).all()


def _poison_then_write(c, k, v, s):
    """Fill every slot with bytes that must never reach the output -- NaN for fp8 / bf16
    data (0x7F is an e4m3 NaN), -128 for int8 (the worst case of the shifted int8 P),
    NaN scales -- then write the sequences' tokens."""
    for t in (c.key, c.value):
        if c.kv_dtype == "fp8":
            t.view(torch.uint8).fill_(0x7F)
        elif c.kv_dtype == "int8":
            t.fill_(-128)
        else:
            t.fill_(float("nan"))
    if c.quantized:
        c.key_scale.fill_(float("nan"))
        c.value_scale.fill_(float("nan"))
    reference.write_kv_reference(c, k, v, s)


@pytest.mark.parametrize("kv,pv,bs,config", [
    ("fp8", "fp8", 16, SMALL),
    ("fp8", "bf16", 64, replace(SMALL, block_n=32)),                   # tile inside a page
    ("int8", "int8", 8, replace(SMALL, block_n=64, p_shift=True)),     # 8 pages per tile
    ("int8", "bf16", 16, replace(SMALL, block_n=64, dv=32, v_late=True)),
    ("bf16", "bf16", 16, replace(SMALL, block_n=32)),
    ("fp8", "bf16", 16, replace(SMALL, block_n=32, v_flat=True)),       # flat page runs, masked
    ("fp8", "fp8", 64, replace(SMALL, block_n=32, v_flat=True)),        # tile inside a page: gather
], ids=["fp8_pv8", "fp8_pv16_in_page", "int8_shift_8pages", "int8_pv16_late", "bf16", "fp8_pv16_flat",
        "fp8_pv8_flat_in_page"])
def test_stale_slots_never_leak(kv, pv, bs, config, device):
    """Keys past the end of a sequence are read from memory (the rest of its last page,
    block 0 for pages past the end; 8-bit V pages are gathered a page at a time, without
    a per-key mask) but must contribute nothing, whatever those bytes hold. (The CPU
    interpreter reads e4m3 0x7F as 480, not NaN: the fp8 NaN case bites on the GPU only.)"""
    b = testing.make_paged_batch([37, 50, 9], [20, 9, 9], num_q_heads=8, num_kv_heads=2, head_dim=64,
                                 block_size=bs, kv_dtype=kv, seed=17, device=device, writer=_poison_then_write)
    out = run_and_check(b, pv=pv, config=config)
    assert torch.isfinite(out.float()).all()


# --------------------------------------------------------------------------- sliding window
@cases("kv,pv,window", [("int8", "bf16", 7), ("int8", "int8", 17), ("fp8", "fp8", 33), ("bf16", "bf16", 1),
                         ("int8", "bf16", 40)])
def test_sliding_window_matches_reference(kv, pv, window, device):
    """``window`` over chunks with cached prefixes and GQA packing: the query tiles' rows
    see different windows (the tiles that cut a window are masked, the older ones never
    visited); the float64 reference with the window is met and differs from full
    attention, and a window of the whole context is full attention bit for bit."""
    b = batch([61, 40], [45, 40], hq=4, hkv=2, kv=kv, seed=29, device=device)
    config = on_device(SMALL, pv, device)
    out = prefill_attention(*args_of(b), out=testing.poisoned_like(b.query), pv_mode=pv, config=config,
                            window=window)
    ref = reference.attention_reference_quantized(*args_of(b), window=window)
    testing.assert_close_verbose(out, ref, rel_l2=TOL_QUANTIZED[(kv, pv)], name=f"{kv}/{pv} window {window}")
    full = prefill_attention(*args_of(b), pv_mode=pv, config=config)
    assert reference.error_stats(full, ref)["rel_l2"] > 2 * TOL_QUANTIZED[(kv, pv)], "the window made no difference"
    assert torch.equal(prefill_attention(*args_of(b), pv_mode=pv, config=config, window=61), full)


def test_sliding_window_refused_when_bad(device):
    b = batch([20], [12], device=device)
    for bad in (0, -1, True, 3.0, "8"):
        with pytest.raises(ValueError, match="window"):
            prefill_attention(*args_of(b), window=bad)


# --------------------------------------------------------------------------- non-finite input
@pytest.mark.parametrize("kv,pv", [("int8", "int8"), ("int8", "bf16"), ("fp8", "fp8"), ("fp8", "bf16"),
                                   ("bf16", "bf16")])
@pytest.mark.parametrize("tensor,bad", [("k", float("nan")), ("v", float("inf"))], ids=["k_nan", "v_inf"])
def test_non_finite_kv_poisons_exactly_the_rows_that_read_it(kv, pv, tensor, bad, device):
    """A K or V row with an inf / NaN (stored poisoned: key scale NaN, zero V) makes NaN
    exactly the output rows whose query sees that token (positions at or after it, the
    KV head's query heads, its sequence); earlier rows of the same tiles, other heads and
    other sequences stay finite and correct."""
    seq_lens, q_lens = [61, 40], [45, 40]
    hq, hkv = 6, 2
    # token 30 of sequence 0 (position 30: query rows 14.. of the 45-token chunk), KV head 1
    b = testing.make_paged_batch(seq_lens, q_lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=64, kv_dtype=kv,
                                 seed=23, device=device, writer=testing.poisoning_writer([(30, 1, 5, tensor)], bad))
    out = testing.poisoned_like(torch.empty(b.query.shape, dtype=torch.bfloat16, device=device))
    prefill_attention(*args_of(b), out=out, pv_mode=pv, config=on_device(SMALL, pv, device))
    want = torch.zeros(b.query.shape[:2], dtype=torch.bool)
    ctx = seq_lens[0] - q_lens[0]
    want[30 - ctx:q_lens[0], 3:6] = True
    ref = reference.attention_reference_quantized(*args_of(b))
    testing.assert_nan_exactly(out, ref, want, TOL_QUANTIZED[(kv, pv)], f"{kv}/{pv}")


@pytest.mark.parametrize("kv,pre", [("int8", False), ("int8", True), ("fp8", False), ("fp8", True),
                                    ("bf16", False)], ids=["int8", "int8_prequantized", "fp8", "fp8_prequantized",
                                                           "bf16"])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")], ids=["inf", "-inf", "nan"])
def test_non_finite_query_gives_nan_rows_for_that_query_only(kv, pre, bad, device):
    b = batch([40, 23], [30, 23], kv=kv, seed=3, device=device)
    want, clean = testing.poison_query_rows(b.query, [(7, 1, 3), (35, 2, 0)], bad)
    kw = {}
    if pre:
        q, s = quantize_query(b.query, kv)
        assert torch.isnan(s[7, 1]) and torch.isnan(s[35, 2]) and torch.isfinite(s[~want.to(device)]).all()
        kw = dict(q_quant=q, q_scale=s)
    out = testing.poisoned_like(torch.empty(b.query.shape, dtype=torch.bfloat16, device=device))
    prefill_attention(*args_of(b), out=out, config=SMALL, **kw)
    ref = reference.attention_reference_quantized(clean, *args_of(b)[1:])
    testing.assert_nan_exactly(out, ref, want, TOL_QUANTIZED[(kv, DEFAULT_PV[kv])], kv)


# --------------------------------------------------------------------------- unchecked bad metadata
def _bad_metadata_cases(b):
    """One sequence's metadata out of range (sequence 1, or 2 for the query range)."""
    return testing.bad_metadata_cases(b, overrun=50)


_BAD_CASES = list(_bad_metadata_cases(batch([30, 40, 25], [12, 21, 9])).keys())


@pytest.mark.parametrize("case", _BAD_CASES)
@pytest.mark.parametrize("kv", ["int8", "fp8", "bf16"])
def test_unchecked_bad_metadata_stays_in_bounds(case, kv, device, monkeypatch):
    """With value checks off, out-of-range metadata of one sequence makes that sequence's
    rows NaN (and only those: the others match the reference), leaves the cache and every
    other element untouched, and raises a device flag that check_errors() turns into an
    error naming the sequence."""
    monkeypatch.setenv("INT8ATTN_CHECK_VALUES", "0")
    b = testing.make_paged_batch([30, 40, 25], [12, 21, 9], num_q_heads=4, num_kv_heads=2, head_dim=64,
                                 kv_dtype=kv, seed=31, device=device)
    bt, sl, qsl, bad_seq, words = _bad_metadata_cases(b)[case]
    before = [t.clone() for t in (b.cache.key, b.cache.value)]
    out = testing.poisoned_like(torch.empty(b.query.shape, dtype=torch.bfloat16, device=device))
    prefill_attention(b.query, b.cache, bt, sl, qsl, out=out, config=SMALL)
    starts = b.query_start_loc.tolist()
    want = torch.zeros(b.query.shape[:2], dtype=torch.bool)
    want[starts[bad_seq]:starts[bad_seq + 1]] = True
    ref = reference.attention_reference_quantized(*args_of(b))
    testing.assert_nan_exactly(out, ref, want, TOL_QUANTIZED[(kv, DEFAULT_PV[kv])], case)
    for t, t0 in zip((b.cache.key, b.cache.value), before):
        assert torch.equal(t.view(torch.uint8), t0.view(torch.uint8))
    with pytest.raises(DeviceMetadataError, match=f"{words}.*index {bad_seq};"):
        check_errors(device)
    check_errors(device)  # cleared


def test_unchecked_bad_metadata_with_the_dense_grid(device, monkeypatch):
    """The max_query_len grid (sequences x tiles) takes the same in-kernel checks."""
    monkeypatch.setenv("INT8ATTN_CHECK_VALUES", "0")
    b = batch([30, 40, 25], [12, 21, 9], seed=32, device=device)
    bt, sl, qsl, bad_seq, words = _bad_metadata_cases(b)["block id too large"]
    out = testing.poisoned_like(torch.empty(b.query.shape, dtype=torch.bfloat16, device=device))
    prefill_attention(b.query, b.cache, bt, sl, qsl, out=out, config=SMALL, max_query_len=21)
    want = torch.zeros(b.query.shape[:2], dtype=torch.bool)
    want[12:33] = True
    testing.assert_nan_exactly(out, reference.attention_reference_quantized(*args_of(b)), want,
                        TOL_QUANTIZED[("int8", "bf16")], "dense grid")
    with pytest.raises(DeviceMetadataError, match="index 1;"):
        check_errors(device)


# --------------------------------------------------------------------------- bad input
def _with_value(cache, value):
    """A shallow copy of ``cache`` whose V storage is ``value`` (data shared)."""
    bad = copy.copy(cache)
    bad.value = value
    return bad


def _bad_calls(b):
    q, cache, bt, sl, qsl = args_of(b)
    return {
        "query dtype": (TypeError, dict(query=q.to(torch.int32))),
        "query heads": (ValueError, dict(query=q[:, :3])),
        "block_table dtype": (TypeError, dict(block_table=bt.long())),
        "seq_lens shape": (ValueError, dict(seq_lens=sl[:1])),
        "qsl dtype": (TypeError, dict(query_start_loc=qsl.long())),
        "seq shorter than chunk": (ValueError, dict(seq_lens=torch.tensor([3, 20], dtype=torch.int32,
                                                                          device=q.device))),
        "block id out of range": (ValueError, dict(block_table=torch.full_like(bt, 10 ** 6))),
        "pv_mode": (ValueError, dict(pv_mode="fp8")),
        "min_query_len": (ValueError, dict(min_query_len=-1)),
        "max_query_len": (ValueError, dict(max_query_len=2.5)),
        "softmax_scale": (ValueError, dict(softmax_scale=-1.0)),
        "softmax_scale type": (TypeError, dict(softmax_scale="0.1")),
        "config type": (TypeError, dict(config={"block_m": 16})),
        "config block_n": (ValueError, dict(config=PrefillConfig(block_n=24))),
        "config dv": (ValueError, dict(config=PrefillConfig(dv=128))),
        "config v_late": (TypeError, dict(config=PrefillConfig(v_late=1))),
        "config cvt_asm": (TypeError, dict(config=PrefillConfig(cvt_asm="yes"))),
        "config v_flat": (TypeError, dict(config=PrefillConfig(v_flat=1))),
        "q_scale without q_quant": (ValueError, dict(q_scale=torch.ones(q.shape[:2], device=q.device))),
        "out shape": (ValueError, dict(out=torch.empty(3, 4, 64, dtype=torch.bfloat16, device=q.device))),
        # 8-bit V pages must be stored [D, block_size]: neither row pages, nor the right
        # shape over row-major memory
        "V pages not transposed": (ValueError, dict(cache=_with_value(cache, cache.value_rows.contiguous()))),
        "V transposed view of row pages": (
            ValueError, dict(cache=_with_value(cache, cache.value_rows.contiguous().transpose(-1, -2)))),
    }


@pytest.mark.parametrize("case", list(_bad_calls(batch([20, 20], [10, 10])).keys()))
def test_bad_input_raises_before_launch(case, monkeypatch, device, host_value_checks):
    import int8attn.ops.prefill as ops

    b = batch([20, 20], [10, 10], device=device)
    err, change = _bad_calls(b)[case]

    def no_launch(*a, **k):
        raise AssertionError("kernel launched despite bad input")

    monkeypatch.setattr(ops, "run_prefill", no_launch)
    kw = dict(zip(("query", "cache", "block_table", "seq_lens", "query_start_loc"), args_of(b)))
    out = testing.poisoned_like(torch.empty(b.query.shape, dtype=torch.bfloat16, device=device))
    kw.update(out=out, config=SMALL)
    kw.update(change)
    with pytest.raises(err):
        prefill_attention(**kw)
    assert torch.isnan(out.float()).all()


KV_PV = [("int8", "int8"), ("int8", "bf16"), ("fp8", "fp8"), ("fp8", "bf16"), ("bf16", "bf16")]


@pytest.mark.parametrize("d", [80, 96, 112, 160, 192])
@pytest.mark.parametrize("kv,pv", KV_PV, ids=[f"{kv}_pv{pv}" for kv, pv in KV_PV])
def test_head_dims_that_are_not_powers_of_two(d, kv, pv, device):
    """head_dim 80..192: the tile is padded to the next power of two with masks on the
    head_dim axis; every element of the output is written and matches both references."""
    b = batch([37, 20], [23, 20], hq=6, hkv=2, d=d, kv=kv, seed=d, device=device)
    run_and_check(b, pv=pv, name=f"D{d}")


@pytest.mark.parametrize("d,config,pv", [
    (80, PrefillConfig(block_m=32, block_n=32, dv=32, num_warps=4, num_stages=1), "int8"),  # 3 of 4 chunks live
    (80, PrefillConfig(block_m=32, block_n=32, dv=64, v_late=True, num_warps=4, num_stages=1), "bf16"),
    (160, PrefillConfig(block_m=16, block_n=32, dv=64, v_late=True, num_warps=4, num_stages=1), "int8"),
    (192, PrefillConfig(block_m=16, block_n=16, dv=64, p_shift=True, num_warps=4, num_stages=1), "int8"),
    (96, PrefillConfig(block_m=32, block_n=32, dv=64, v_flat=True, num_warps=4, num_stages=1), "bf16"),
    (112, PrefillConfig(block_m=16, block_n=64, dv=32, v_flat=True, v_late=True, num_warps=4, num_stages=1),
     "int8"),
], ids=["d80_dv32", "d80_pv16_late", "d160_dv64_late", "d192_shift", "d96_flat", "d112_flat_late"])
def test_padded_head_dim_kernel_variants(d, config, pv, device):
    """Padded head_dims with PV column chunks partly or wholly past head_dim, late V
    loads, shifted int8 P and flat V page runs."""
    b = batch([97, 5], [60, 5], hq=4, hkv=2, d=d, bs=16, seed=d + 1, device=device)
    run_and_check(b, config=config, pv=pv, name=f"D{d}")


def test_padded_head_dim_stale_slots_and_poisoned_neighbours(device):
    """At D 80 the masked channel lanes of K and V never reach the output: NaN bytes in
    every stale slot stay out (fp8 / bf16 data poisoned, see _poison_then_write)."""
    for kv, pv in (("fp8", "fp8"), ("bf16", "bf16"), ("fp8", "bf16")):
        b = testing.make_paged_batch([37, 50, 9], [20, 9, 9], num_q_heads=4, num_kv_heads=2, head_dim=80,
                                     block_size=16, kv_dtype=kv, seed=19, device=device, writer=_poison_then_write)
        out = run_and_check(b, pv=pv, config=replace(SMALL, block_n=32))
        assert torch.isfinite(out.float()).all()


def test_head_dim_not_a_multiple_of_16_is_refused_by_the_cache():
    with pytest.raises(ValueError, match="multiple of 16"):
        batch([20], [10], d=72, hq=2, hkv=1)


# --------------------------------------------------------------------------- GPU
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kv", ["int8", "fp8", "bf16"])
def test_gpu_default_config(kv):
    """Default tiles on the GPU: 24q/4kv/D256 and a long chunk over a prefix."""
    b = batch([1500, 300], [700, 300], hq=24, hkv=4, d=256, kv=kv, seed=1, device="cuda")
    out = testing.poisoned_like(torch.empty(b.query.shape, dtype=torch.bfloat16, device="cuda"))
    prefill_attention(*args_of(b), out=out)
    ref = reference.attention_reference(*args_of(b))
    key = (kv, DEFAULT_PV[kv])
    testing.assert_close_verbose(out, ref, rel_l2=TOL_REFERENCE[key])
    assert math.isfinite(float(out.float().abs().max()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("d,kv,pv", [(96, "int8", None), (96, "fp8", None), (96, "bf16", None),
                                     (192, "int8", "int8"), (160, "fp8", "fp8"), (80, "int8", None)],
                         ids=["d96_int8", "d96_fp8", "d96_bf16", "d192_int8_pv8", "d160_fp8_pv8", "d80_int8"])
def test_gpu_padded_head_dims(d, kv, pv):
    """Default GPU tiles at head_dims that are not powers of two (padded, masked)."""
    b = batch([1500, 300], [700, 300], hq=16, hkv=4, d=d, kv=kv, seed=d, device="cuda")
    out = testing.poisoned_like(torch.empty(b.query.shape, dtype=torch.bfloat16, device="cuda"))
    prefill_attention(*args_of(b), out=out, pv_mode=pv)
    key = (kv, pv or DEFAULT_PV[kv])
    testing.assert_close_verbose(out, reference.attention_reference(*args_of(b)), rel_l2=TOL_REFERENCE[key])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_default_tiles_poisoned_token_query_and_bad_block_id():
    """Default GPU tiles (value checks off, the GPU default): a poisoned K token, an inf
    query row and an out-of-range block id each make exactly their rows NaN; the flag
    names the bad sequence."""
    b = testing.make_paged_batch([700, 900, 300], [300, 500, 300], num_q_heads=24, num_kv_heads=4, head_dim=256,
                                 seed=5, device="cuda", writer=testing.poisoning_writer([(600, 2, 11, "k")], float("nan")))
    b.query[50, 3, 0] = float("inf")
    bt = b.block_table.clone()
    bt[2, 3] = 10 ** 6
    out = testing.poisoned_like(torch.empty(b.query.shape, dtype=torch.bfloat16, device="cuda"))
    prefill_attention(b.query, b.cache, bt, b.seq_lens, b.query_start_loc, out=out)
    want = torch.zeros(b.query.shape[:2], dtype=torch.bool)
    want[600 - 400:300, 12:18] = True  # sequence 0: prefix 400, token 600 of KV head 2
    want[50, 3] = True
    want[800:] = True  # sequence 2
    clean = b.query.clone()
    clean[50, 3] = 0
    ref = reference.attention_reference_quantized(clean, *args_of(b)[1:])
    testing.assert_nan_exactly(out, ref, want, 0.012, "default tiles")
    with pytest.raises(DeviceMetadataError, match="block id.*index 2;"):
        check_errors("cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@cases("kv,pv", [("int8", "int8"), ("fp8", "fp8")])
def test_gpu_8bit_pv_needs_32_key_tiles(kv, pv, monkeypatch):
    import int8attn.ops.prefill as ops

    b = batch([20], [10], kv=kv, device="cuda")
    monkeypatch.setattr(ops, "run_prefill", lambda *a, **k: pytest.fail("kernel launched despite bad input"))
    with pytest.raises(ValueError, match="block_n=16 must be >= 32"):
        prefill_attention(*args_of(b), pv_mode=pv, config=SMALL)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@cases("d,hq,hkv", [(256, 24, 4), (128, 32, 8)])
def test_gpu_ptx_v_conversion_matches_portable(d, hq, hkv):
    """INT8 V -> fp16 by PTX byte permutes (the CUDA default) gives the same bits as the
    portable conversion, early or late V loads, and stays within the reference bound."""
    b = batch([900, 200], [500, 200], hq=hq, hkv=hkv, d=d, kv="int8", seed=12, device="cuda")
    outs = {}
    for late in (False, True):
        for asm in (False, True):
            out = testing.poisoned_like(torch.empty(b.query.shape, dtype=torch.bfloat16, device="cuda"))
            cfg = PrefillConfig(block_m=128, block_n=64, dv=128, v_late=late, cvt_asm=asm, num_warps=8, num_stages=2)
            prefill_attention(*args_of(b), out=out, pv_mode="bf16", config=cfg)
            outs[late, asm] = out
    ref = reference.attention_reference(*args_of(b))
    testing.assert_close_verbose(outs[True, True], ref, rel_l2=TOL_REFERENCE[("int8", "bf16")])
    assert torch.equal(outs[False, True], outs[False, False])
    assert torch.equal(outs[True, True], outs[True, False])
