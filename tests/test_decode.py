"""decode_attention (split-K paged decode, 1..8 query tokens per sequence).

Every check runs the kernel on fresh random data with outlier-channel keys, output
poisoned with NaN first, against the float64 references of int8attn.reference:
``attention_reference`` (the query as given; kernel + quantization error) and
``attention_reference_quantized`` (the query quantized as the kernel sees it; only P
rounding, fp32 accumulation and the bf16 output separate a correct kernel from it).
"""

import dataclasses
import math

import pytest
import torch

from _ids import cases
from int8attn import launches, reference, testing
from int8attn.errors import DeviceMetadataError, check_errors
from int8attn.ops.decode import (
    MAX_DECODE_QUERY_LEN,
    DecodeConfig,
    DecodeWorkspace,
    choose_num_splits,
    decode_attention,
    plan_decode,
    rows_per_program,
)
from int8attn.ops.producer import quantize_query

# rel-L2 bounds vs the same-quantization reference (tight: kernel bugs show far above)
# and vs the plain float64 reference (includes the K/V/Q quantization error).
TOL_QUANTIZED = {("int8", "int8"): 0.015, ("int8", "int8_signed"): 0.025, ("int8", "bf16"): 0.01,
                 ("fp8", "fp8"): 0.035, ("fp8", "bf16"): 0.012, ("bf16", "bf16"): 0.006}
TOL_FLOAT64 = {"int8": 0.02, "fp8": 0.05, "bf16": 0.006}


def _run_and_check(batch, *, pv_mode=None, num_splits=None, softmax_scale=None, workspace=None, skipped=()):
    out = testing.poisoned_like(batch.query)
    ret = decode_attention(batch.query, batch.cache, batch.block_table, batch.seq_lens, batch.query_start_loc,
                           softmax_scale=softmax_scale, out=out, pv_mode=pv_mode, num_splits=num_splits,
                           workspace=workspace)
    assert ret is out
    kv = batch.cache.kv_dtype
    mode = pv_mode or {"int8": "int8", "fp8": "fp8", "bf16": "bf16"}[kv]
    qsl = batch.query_start_loc.tolist()
    keep = torch.ones(out.shape[0], dtype=torch.bool)
    for s in skipped:
        rows = out[qsl[s]:qsl[s + 1]]
        assert torch.isnan(rows.float()).all(), f"rows of skipped sequence {s} were written"
        keep[qsl[s]:qsl[s + 1]] = False
    args = (batch.query, batch.cache, batch.block_table, batch.seq_lens, batch.query_start_loc, softmax_scale)
    ref_q = reference.attention_reference_quantized(*args)
    ref = reference.attention_reference(*args)
    stats = testing.assert_close_verbose(out[keep], ref_q[keep], rel_l2=TOL_QUANTIZED[(kv, mode)],
                                         name=f"{kv}/{mode} vs same-quantization reference")
    testing.assert_close_verbose(out[keep], ref[keep], rel_l2=TOL_FLOAT64[kv], name=f"{kv}/{mode} vs float64")
    return stats


# (kv, pv, q_heads, kv_heads, head_dim, block_size, seq_lens, q_lens, num_splits)
CASES = [
    # single-token decode, lengths 1/17/97/123 crossing pages and split boundaries
    ("int8", "int8", 8, 2, 64, 16, [1, 17, 97, 123], [1, 1, 1, 1], None),
    ("int8", "int8", 8, 2, 64, 16, [1, 17, 97, 123], [1, 1, 1, 1], 3),
    # multi-token causal steps, GQA 6, several passes for the longest query
    ("int8", "int8", 12, 2, 128, 32, [17, 97, 123, 9], [2, 4, 8, 1], 2),
    ("int8", "bf16", 12, 2, 128, 32, [17, 97, 123, 9], [2, 4, 8, 1], None),
    # GQA 8, head_dim 256, page 64 (tiles of two pages)
    ("int8", "int8", 8, 1, 256, 64, [123, 1, 70], [1, 1, 3], 2),
    # GQA 1 (MHA)
    ("int8", "int8", 2, 2, 64, 16, [33, 5, 97], [3, 1, 2], 4),
    ("int8", "int8_signed", 8, 2, 64, 16, [17, 97], [1, 2], 2),
    ("fp8", "fp8", 12, 2, 64, 16, [17, 97, 123], [1, 2, 4], 3),
    ("fp8", "bf16", 8, 1, 128, 32, [97, 1], [2, 1], 2),
    ("fp8", "fp8", 8, 1, 256, 16, [123], [1], None),
    ("bf16", None, 12, 2, 64, 16, [17, 97, 123], [1, 2, 4], 3),
    ("bf16", None, 8, 1, 256, 64, [123, 9], [4, 1], 1),
    # head_dims that are not powers of two (tiles padded to the next one, channels masked)
    ("int8", "int8", 6, 2, 96, 16, [17, 97, 123], [1, 2, 1], 3),
    ("int8", "int8", 4, 1, 80, 16, [97, 5], [1, 3], None),
    ("int8", "bf16", 8, 2, 112, 32, [123, 40], [2, 1], 2),
    ("fp8", "fp8", 8, 1, 192, 16, [97, 17], [1, 2], 2),
    ("fp8", "bf16", 4, 2, 160, 16, [70], [3], None),
    ("bf16", None, 6, 2, 96, 16, [17, 123], [1, 4], 2),
    ("bf16", None, 4, 1, 48, 16, [97], [2], None),
]


@cases("kv,pv,hq,hkv,d,bs,seq_lens,q_lens,splits", CASES)
def test_matches_references(device, kv, pv, hq, hkv, d, bs, seq_lens, q_lens, splits):
    batch = testing.make_paged_batch(seq_lens, q_lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs,
                                     kv_dtype=kv, seed=len(CASES) * d + hq + bs, device=device)
    _run_and_check(batch, pv_mode=pv, num_splits=splits)


@cases("kv,hq,d,bs,swap", [("int8", 4, 64, 16, False), ("fp8", 8, 64, 32, False),
                                             ("bf16", 4, 128, 16, False), ("fp8", 8, 64, 16, True)])
def test_stale_slots_never_leak(device, monkeypatch, kv, hq, d, bs, swap):
    """The tile loads are unmasked within a page (keys past seq_len read stale slots of
    the last page, or block 0 for pages past the end): NaN in every slot no sequence owns
    -- values and scales -- must not reach the output."""
    batch = testing.make_paged_batch([37, 5, 70], [1, 2, 1], num_q_heads=hq, num_kv_heads=1, head_dim=d,
                                     block_size=bs, kv_dtype=kv, seed=13, device=device)
    if swap:
        import int8attn.ops.decode as dec

        config = DecodeConfig(block_n=64, num_warps=4, num_stages=3, swap_ab=True)
        monkeypatch.setattr(dec, "default_config", lambda *args: config)
    cache = batch.cache
    owned = torch.zeros(cache.num_blocks * bs, dtype=torch.bool, device=device)
    owned[batch.slot_mapping] = True
    stale = ~owned.view(cache.num_blocks, 1, bs)
    for t in (cache.key, cache.value_rows):
        if kv == "bf16":
            t.masked_fill_(stale[..., None], float("nan"))
        else:  # int8: an extreme value; fp8: 0x7f is NaN in e4m3fn
            t.view(torch.uint8).masked_fill_(stale[..., None], 0x80 if kv == "int8" else 0x7F)
    if cache.quantized:
        for t in (cache.key_scale, cache.value_scale):
            t.masked_fill_(stale, float("nan"))
    for splits in (1, 3):
        _run_and_check(batch, num_splits=splits)


# (kv, pv, q_heads, kv_heads, head_dim, block_size, seq_lens, q_lens, num_splits, block_n)
SWAPPED_CASES = [
    ("fp8", "fp8", 12, 2, 64, 16, [17, 97, 123], [1, 2, 4], 3, 64),
    ("fp8", "fp8", 8, 1, 64, 16, [40, 97, 5], [8, 1, 3], 2, 64),  # 8 x 8 rows: several passes
    ("fp8", "bf16", 8, 1, 128, 32, [97, 1], [2, 1], 2, 64),
    ("fp8", "fp8", 6, 1, 256, 16, [123, 33], [1, 2], None, 128),
    ("int8", "int8", 8, 2, 64, 16, [1, 17, 97, 123], [1, 1, 1, 1], None, 64),
    ("int8", "bf16", 6, 1, 256, 64, [123, 70], [1, 3], 2, 128),
    ("int8", "int8", 16, 4, 128, 16, [17, 300, 97], [1, 2, 1], None, 128),  # the D128 default's shape
    ("int8", "int8", 8, 2, 96, 16, [17, 123], [1, 2], 2, 64),  # padded head_dim: V^T rows masked
    ("fp8", "fp8", 8, 1, 192, 16, [97, 33], [1, 3], None, 64),
]


@cases("kv,pv,hq,hkv,d,bs,seq_lens,q_lens,splits,block_n", SWAPPED_CASES)
def test_swapped_operands_match_references(device, monkeypatch, kv, pv, hq, hkv, d, bs, seq_lens, q_lens, splits,
                                           block_n):
    """The operand-swapped tile (keys in the MMA's M rows, O^T accumulated): same results."""
    import int8attn.ops.decode as dec

    config = DecodeConfig(block_n=block_n, num_warps=4, num_stages=3, swap_ab=True)
    monkeypatch.setattr(dec, "default_config", lambda *args: config)
    batch = testing.make_paged_batch(seq_lens, q_lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs,
                                     kv_dtype=kv, seed=7 * d + hq + bs + block_n, device=device)
    _run_and_check(batch, pv_mode=pv, num_splits=splits)
    assert launches.last("_decode_split_kernel").facts["plan"].config.swap_ab


def test_default_orientation_per_pv_mode():
    """The measured defaults swap the operands for 16-row int8 / fp8 tiles at head_dim 256,
    except for the PV modes measured (or only built) row-major."""
    from int8attn.ops.decode import ROW_MAJOR_PV, default_config

    assert default_config("int8", 256, 16, 16, "int8").swap_ab
    assert default_config("fp8", 256, 16, 16, "fp8").swap_ab
    assert default_config("int8", 128, 16, 16, "int8").swap_ab and default_config("fp8", 128, 16, 16, "fp8").swap_ab
    assert not default_config("int8", 128, 16, 16, "bf16").swap_ab
    for mode in ROW_MAJOR_PV["int8"]:
        cfg = default_config("int8", 256, 16, 16, mode)
        assert not cfg.swap_ab and cfg.block_n == 64 and cfg.num_warps == 4
    # 32 packed rows: the 8-warp, 128-key swapped tile (4-warp swapped tiles spill there)
    wide = default_config("int8", 256, 32, 16, "int8")
    assert wide.swap_ab and wide.num_warps == 8 and wide.block_n == 128
    assert not default_config("int8", 256, 32, 16, "bf16").swap_ab
    assert not default_config("fp8", 256, 32, 16, "fp8").swap_ab
    assert not default_config("bf16", 256, 16, 16, "bf16").swap_ab



def test_register_cap_validated_and_counted(small_batch):
    """``maxnreg`` is checked before any launch and raises the planner's programs-per-SM
    estimate (65536 registers / (128 threads x cap)), so the split count fills the slots."""
    from int8attn.ops.decode import _programs_per_sm

    b = small_batch
    for bad in (0, 16, 256, 168.0, True, "168"):
        with pytest.raises(ValueError, match="maxnreg"):
            plan_decode(tuple(b.query.shape), b.cache, tuple(b.block_table.shape),
                        config=DecodeConfig(block_n=64, num_warps=4, num_stages=4, swap_ab=True, maxnreg=bad))
    uncapped = DecodeConfig(block_n=64, num_warps=4, num_stages=4, swap_ab=True)
    capped = DecodeConfig(block_n=64, num_warps=4, num_stages=4, swap_ab=True, maxnreg=168)
    assert _programs_per_sm(uncapped, 256, 1) == 2
    assert _programs_per_sm(capped, 256, 1) == 3
    assert _programs_per_sm(DecodeConfig(32, 4, 4, swap_ab=True, maxnreg=128), 256, 1) == 4


@cases("kv,block_n,maxnreg", [("int8", 64, 168), ("int8", 32, 128), ("fp8", 64, 168)])
def test_register_capped_configs_match_references(device, monkeypatch, kv, block_n, maxnreg):
    """A register cap changes register allocation only (spills on the GPU), never results;
    on CUDA the compiled split kernel must respect the cap."""
    import int8attn.ops.decode as dec

    config = DecodeConfig(block_n=block_n, num_warps=4, num_stages=4, swap_ab=True, maxnreg=maxnreg)
    monkeypatch.setattr(dec, "default_config", lambda *args: config)
    batch = testing.make_paged_batch([17, 97, 123], [1, 2, 1], num_q_heads=12, num_kv_heads=2, head_dim=256,
                                     kv_dtype=kv, seed=block_n + maxnreg, device=device)
    _run_and_check(batch, num_splits=2)
    kernel = launches.last("_decode_split_kernel").compiled
    if kernel is not None and getattr(kernel, "n_regs", None):
        assert kernel.n_regs <= maxnreg, f"compiled with {kernel.n_regs} registers, cap {maxnreg}"

def test_swapped_operands_need_an_8bit_cache(small_batch):
    bf16 = testing.make_paged_batch([20], [1], num_q_heads=4, num_kv_heads=1, head_dim=64, kv_dtype="bf16", seed=1,
                                    device="cpu")
    with pytest.raises(ValueError, match="swap_ab"):
        plan_decode(tuple(bf16.query.shape), bf16.cache, tuple(bf16.block_table.shape),
                    config=DecodeConfig(block_n=64, num_warps=4, num_stages=3, swap_ab=True))


@pytest.mark.parametrize("splits", [1, 2, 5, 64])
def test_forced_split_counts(device, splits):
    """Any split count, including more splits than tiles (empty splits exit early)."""
    batch = testing.make_paged_batch([123, 40, 1], [1, 2, 1], num_q_heads=4, num_kv_heads=1, head_dim=64,
                                     kv_dtype="int8", seed=splits, device=device)
    _run_and_check(batch, num_splits=splits)



def test_merge_folds_more_splits_than_one_chunk(device, monkeypatch):
    """69 active splits: the merge kernel loads MERGE_MAX_CHUNK partials at a time and folds
    the rest in a second chunk; a 3-split sequence of the same batch takes one chunk."""
    import int8attn.ops.decode as dec

    config = DecodeConfig(block_n=32, num_warps=4, num_stages=2)
    monkeypatch.setattr(dec, "default_config", lambda *args: config)
    batch = testing.make_paged_batch([2200, 70], [1, 2], num_q_heads=4, num_kv_heads=1, head_dim=64,
                                     kv_dtype="int8", seed=11, device=device)
    _run_and_check(batch, num_splits=70)
    assert launches.last("_decode_split_kernel").facts["plan"].num_splits > dec.MERGE_MAX_CHUNK

def test_smoothing_off_outlier_keys(device):
    """Outlier keys quantized without the smoothing offset: larger per-token scales,
    the path must still be within the INT8 bound."""
    batch = testing.make_paged_batch([97, 50], [1, 1], num_q_heads=6, num_kv_heads=1, head_dim=128,
                                     kv_dtype="int8", key_smoothing="none", seed=7, device=device)
    out = decode_attention(batch.query, batch.cache, batch.block_table, batch.seq_lens, batch.query_start_loc,
                           num_splits=2)
    ref_q = reference.attention_reference_quantized(batch.query, batch.cache, batch.block_table, batch.seq_lens,
                                                    batch.query_start_loc)
    testing.assert_close_verbose(out, ref_q, rel_l2=TOL_QUANTIZED[("int8", "int8")])


def test_long_queries_skipped_and_empty_queries(device):
    """q_len > MAX_DECODE_QUERY_LEN: rows untouched (left to prefill); q_len 0: fine."""
    q_lens = [MAX_DECODE_QUERY_LEN + 1, 0, 1, MAX_DECODE_QUERY_LEN]
    batch = testing.make_paged_batch([40, 16, 33, 20], q_lens, num_q_heads=4, num_kv_heads=2, head_dim=64,
                                     kv_dtype="int8", seed=3, device=device)
    _run_and_check(batch, num_splits=2, skipped=(0,))


def test_custom_scale_and_prequantized_query(device):
    batch = testing.make_paged_batch([57, 12], [2, 1], num_q_heads=4, num_kv_heads=1, head_dim=64,
                                     kv_dtype="int8", seed=11, device=device)
    q_quant, q_scale = quantize_query(batch.query, "int8")
    out = decode_attention(batch.query, batch.cache, batch.block_table, batch.seq_lens, batch.query_start_loc,
                           softmax_scale=0.05, q_quant=q_quant, q_scale=q_scale, num_splits=2)
    ref_q = reference.attention_reference_quantized(batch.query, batch.cache, batch.block_table, batch.seq_lens,
                                                    batch.query_start_loc, softmax_scale=0.05)
    testing.assert_close_verbose(out, ref_q, rel_l2=TOL_QUANTIZED[("int8", "int8")])


def test_workspace_reused(device):
    """One preallocated workspace serves calls of different batches (graph-replay style)."""
    ws = DecodeWorkspace(max_tokens=8, num_q_heads=4, head_dim=64, max_splits=4, device=device)
    for seed, (lens, qs) in enumerate([([50, 97], [1, 1]), ([123, 3, 30], [2, 1, 3])]):
        batch = testing.make_paged_batch(lens, qs, num_q_heads=4, num_kv_heads=1, head_dim=64, kv_dtype="int8",
                                         seed=20 + seed, device=device)
        _run_and_check(batch, num_splits=4, workspace=ws)


def test_plan_from_shapes_only():
    """The launch plan depends on host shapes only and fills the GPU at every batch size."""
    cache = type("C", (), {})()  # the planner reads these attributes only
    cache.num_kv_heads, cache.block_size, cache.kv_dtype, cache.device = 4, 16, "int8", torch.device("cpu")
    cache.key = torch.empty(1, dtype=torch.int8)
    small = plan_decode((1, 24, 256), cache, (1, 2048))
    big = plan_decode((64, 24, 256), cache, (64, 512))
    assert small.num_splits > big.num_splits >= 1
    # bs1 L32k on a 132-SM GPU: enough splits to give every SM work
    assert choose_num_splits(1, 4, 32768, 128, 6, 256, 1, slots=132) * 4 >= 100
    assert choose_num_splits(64, 4, 8192, 128, 6, 256, 1, slots=132) <= 2
    assert rows_per_program(16, 16, 6) == (1, 16)      # decode: 6 of 16 rows
    assert rows_per_program(32, 16, 6) == (2, 16)      # 2 tokens x 6 heads = 12 of 16 rows
    assert rows_per_program(64, 16, 6) == (4, 32)
    assert rows_per_program(8, 1, 32) == (1, 32)
    assert rows_per_program(16, 16, 6, max_query_len=2) == (2, 16)  # a router that knows the longest query


def _bad_call(batch, **kw):
    args = dict(query=batch.query, cache=batch.cache, block_table=batch.block_table, seq_lens=batch.seq_lens,
                query_start_loc=batch.query_start_loc)
    args.update(kw)
    return decode_attention(args.pop("query"), args.pop("cache"), args.pop("block_table"), args.pop("seq_lens"),
                            args.pop("query_start_loc"), **args)


@pytest.fixture(scope="module")
def small_batch(device):
    return testing.make_paged_batch([20, 9], [1, 1], num_q_heads=4, num_kv_heads=2, head_dim=64, kv_dtype="int8",
                                    seed=5, device=device)


@cases("kw,exc", [
    ({"query": "q.int()"}, TypeError),
    ({"query": "q[:, :3]"}, ValueError),                      # 3 q heads over 2 KV heads
    ({"query": "q[..., :32]"}, ValueError),                   # head_dim mismatch
    ({"query": "q.transpose(1, 2).contiguous().transpose(1, 2)"}, ValueError),  # strided last dim
    ({"block_table": "bt.long()"}, TypeError),
    ({"block_table": "bt[:1]"}, ValueError),
    ({"block_table": "bt + 1000"}, ValueError),               # block ids out of range
    ({"seq_lens": "sl[:1]"}, ValueError),
    ({"seq_lens": "sl * 100"}, ValueError),                   # longer than the block table
    ({"query_start_loc": "qsl.flip(0)"}, ValueError),
    ({"pv_mode": "fp8"}, ValueError),
    ({"pv_mode": "int4"}, ValueError),
    ({"num_splits": 0}, ValueError),
    ({"num_splits": 1000}, ValueError),
    ({"num_splits": 2.0}, ValueError),
    ({"softmax_scale": -1.0}, ValueError),
    ({"softmax_scale": "'x'"}, TypeError),
    ({"q_quant": "torch.zeros_like(q)"}, TypeError),          # bf16 q_quant for an int8 cache
    ({"workspace": "ws_small"}, ValueError),
    ({"workspace": "object()"}, TypeError),
    ({"out": "torch.empty_like(q, dtype=torch.float64)"}, TypeError),
    ({"out": "q.new_empty((3, 4, 64))"}, ValueError),
])
def test_bad_inputs_raise_before_launch(small_batch, device, kw, exc, host_value_checks):
    b = small_batch
    env = {"q": b.query, "bt": b.block_table, "sl": b.seq_lens, "qsl": b.query_start_loc, "torch": torch,
           "ws_small": DecodeWorkspace(1, 4, 64, max_splits=2, device=device)}
    (name, expr), = kw.items()
    value = eval(expr, env) if isinstance(expr, str) and name not in ("pv_mode",) else expr
    out = testing.poisoned_like(b.query)
    call = {name: value}
    if name != "out":
        call["out"] = out
    if name == "workspace":
        call["num_splits"] = 4
    with pytest.raises(exc):
        _bad_call(b, **call)
    assert torch.isnan(out.float()).all(), "a rejected call wrote its output"


def test_config_tile_must_cover_page(small_batch):
    with pytest.raises(ValueError):
        plan_decode(tuple(small_batch.query.shape), small_batch.cache, tuple(small_batch.block_table.shape),
                    config=DecodeConfig(block_n=24, num_warps=4, num_stages=2))


def test_8bit_pv_needs_32_key_tiles(small_batch):
    """int8 / fp8 PV reduces over the tile's keys 32 at a time (the 8-bit MMA's K): a
    16-key tile is refused at planning (it would fail to compile on the GPU); bf16 PV
    over the same 8-bit cache takes it."""
    b = small_batch
    shapes = (tuple(b.query.shape), b.cache, tuple(b.block_table.shape))
    tile16 = DecodeConfig(block_n=16, num_warps=4, num_stages=2)
    for mode in ("int8", "int8_signed"):
        with pytest.raises(ValueError, match="block_n >= 32"):
            plan_decode(*shapes, pv_mode=mode, config=tile16)
    assert plan_decode(*shapes, pv_mode="bf16", config=tile16).config.block_n == 16


def test_unplanned_calls_reuse_their_launch(device):
    """Unplanned calls of one geometry share one launch (and its workspace); new data in the
    same tensors, or in new tensors of the same layout, gives what a fresh launch gives; a
    new geometry gets its own launch."""
    import int8attn.ops.decode as dec

    b = testing.make_paged_batch([37, 97, 20], [1, 3, 2], num_q_heads=4, num_kv_heads=2, head_dim=64,
                                 kv_dtype="int8", seed=51, device=device)
    args = (b.query, b.cache, b.block_table, b.seq_lens, b.query_start_loc)
    dec._LAUNCHES.clear()
    first = decode_attention(*args, num_splits=3)
    assert len(dec._LAUNCHES) == 1
    launch = next(iter(dec._LAUNCHES.values()))
    again = decode_attention(*args, num_splits=3)
    assert torch.equal(first, again) and next(iter(dec._LAUNCHES.values())) is launch
    # other data, same layout: shorter sequences and a fresh query through the same launch
    lens2 = b.seq_lens - torch.tensor([5, 0, 3], dtype=torch.int32, device=device)
    q2 = torch.randn(b.query.shape, generator=torch.Generator().manual_seed(3)).to(b.query)
    reused = decode_attention(q2, b.cache, b.block_table, lens2, b.query_start_loc, num_splits=3)
    assert len(dec._LAUNCHES) == 1
    dec._LAUNCHES.clear()
    fresh = decode_attention(q2, b.cache, b.block_table, lens2, b.query_start_loc, num_splits=3)
    assert torch.equal(reused, fresh)
    decode_attention(*args, num_splits=2)
    decode_attention(b.query[:4], b.cache, b.block_table[:2], b.seq_lens[:2], b.query_start_loc[:3],
                     num_splits=3)
    assert len(dec._LAUNCHES) == 3
    # with a caller's workspace the launch lives on the workspace, not in the shared table
    ws = DecodeWorkspace(b.query.shape[0], 4, 64, max_splits=3, device=device)
    with_ws = decode_attention(*args, num_splits=3, workspace=ws)
    assert len(dec._LAUNCHES) == 3 and len(ws.launches) == 1
    assert torch.equal(decode_attention(*args, num_splits=3, workspace=ws), with_ws) and len(ws.launches) == 1
    assert torch.equal(with_ws, first)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_unplanned_launches_are_per_stream_and_never_made_under_capture():
    import int8attn.ops.decode as dec

    b = testing.make_paged_batch([300, 1000], [1, 1], num_q_heads=24, num_kv_heads=4, head_dim=256,
                                 kv_dtype="int8", seed=53, device="cuda")
    args = (b.query, b.cache, b.block_table, b.seq_lens, b.query_start_loc)
    dec._LAUNCHES.clear()
    want = decode_attention(*args)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        got = decode_attention(*args)
    torch.cuda.synchronize()
    assert len(dec._LAUNCHES) == 2 and torch.equal(got, want)
    out = torch.empty_like(b.query)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_attention(*args, out=out)
    assert len(dec._LAUNCHES) == 2
    out.fill_(math.nan)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_capture_and_replay():
    batch = testing.make_paged_batch([300, 1000, 77], [1, 2, 1], num_q_heads=24, num_kv_heads=4, head_dim=256,
                                     kv_dtype="int8", seed=9, device="cuda")
    q_quant, q_scale = quantize_query(batch.query, "int8")
    ws = DecodeWorkspace(batch.query.shape[0], 24, 256, device="cuda")
    out = torch.empty_like(batch.query)
    args = (batch.query, batch.cache, batch.block_table, batch.seq_lens, batch.query_start_loc)
    decode_attention(*args, out=out, q_quant=q_quant, q_scale=q_scale, workspace=ws)  # warm-up / compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_attention(*args, out=out, q_quant=q_quant, q_scale=q_scale, workspace=ws)
    out.fill_(math.nan)
    graph.replay()
    torch.cuda.synchronize()
    ref_q = reference.attention_reference_quantized(*args)
    testing.assert_close_verbose(out, ref_q, rel_l2=TOL_QUANTIZED[("int8", "int8")])


_SM90_COMPILE = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from int8attn.kernels.codes import KV_KIND, PV_KIND
from int8attn.kernels.decode import _decode_split_kernel
from int8attn.ops._launch import _defaults

kv, pv, block_n, warps, stages, swap, extra, asm = json.loads(sys.argv[1])
elem = {"int8": "*i8", "fp8": "*fp8e4nv", "bf16": "*bf16"}[kv]
const = dict(GROUP=6, HEAD_DIM=256, BLOCK_D=256, PAGE=16, BLOCK_N=block_n, BLOCK_M=16, TOKENS_PER_PASS=1,
             MAX_QUERY_LEN=8, KV_KIND=KV_KIND[kv], PV_KIND=PV_KIND[pv], INTERPRET=False, SWAP_AB=swap,
             SAFE=True, **extra)  # the clamped kernel launches use by default
# the other constexprs at their defaults (as a launch that leaves them out compiles them)
const = {**_defaults(_decode_split_kernel), **const}
# a launch that quantizes its query (QUERY_IN) reads a bf16 query and writes codes of the cache's dtype
ptrs = dict(q_ptr="*bf16" if extra.get("QUERY_IN") else elem, k_ptr=elem, v_ptr=elem, q_scale_ptr="*fp32",
            k_scale_ptr="*fp32", v_scale_ptr="*fp32", block_table_ptr="*i32", seq_lens_ptr="*i32",
            query_start_loc_ptr="*i32", out_ptr="*bf16", part_acc_ptr="*fp32", part_ml_ptr="*fp32", flags_ptr="*i32",
            counter_ptr="*i32", qk_scale="fp32", qc_ptr=elem, qcs_ptr="*fp32")
names = _decode_split_kernel.arg_names
sig = {n: "constexpr" if n in const else ptrs.get(n, "i32") for n in names}
aligned = [i for i, n in enumerate(names) if (n in ptrs and n != "qk_scale")
           or n in ("stride_qt", "stride_qh", "stride_cb", "stride_ch", "stride_ot", "stride_oh",
                    "stride_pt", "stride_ph", "stride_ps", "stride_qct", "stride_qch")]
compiled = triton.compile(
    ASTSource(fn=_decode_split_kernel, signature=sig, constexprs=const,
              attrs={(i,): [["tt.divisibility", 16]] for i in aligned}),
    target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
if asm == "all":  # one compile, every artifact
    from int8attn.gate import sass
    sys.stdout.write(json.dumps({"ptx": compiled.asm["ptx"], "ttgir": compiled.asm["ttgir"],
                                 "sass": sass.dump_sass(compiled.asm["cubin"])}))
else:
    sys.stdout.write(compiled.asm[asm])
"""


def _ttgir_for_sm90(kv_dtype: str, pv_mode: str, config: DecodeConfig, extra: dict | None = None,
                    asm: str = "ttgir") -> str:
    """TTGIR (or ``asm``: "ptx") of the split kernel compiled ahead of time for sm_90 (no
    GPU needed; ``extra``: more constexprs), in a subprocess because this test session runs
    Triton in its interpreter."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="0")
    args = json.dumps([kv_dtype, pv_mode, config.block_n, config.num_warps, config.num_stages, config.swap_ab,
                       extra or {}, asm])
    proc = subprocess.run([sys.executable, "-c", _SM90_COMPILE, args], capture_output=True, text=True, env=env,
                          timeout=300)
    # a compile failure is a failure (ptxas ships in the Triton wheel: every machine can compile)
    marker = {"ttgir": "scf.for", "ptx": ".entry", "all": ".entry"}[asm]
    assert proc.returncode == 0 and marker in proc.stdout, f"sm_90 compile failed: {proc.stderr[-3000:]}"
    return proc.stdout


@pytest.mark.parametrize("kv_dtype,pv_mode,swap", [
    pytest.param("int8", "int8", False, id="int8-pv_int8"),
    pytest.param("bf16", "bf16", False, id="bf16-pv_bf16"),
    pytest.param("fp8", "fp8", True, id="fp8-pv_fp8-swap_ab"),
])
def test_split_kernel_is_software_pipelined(kv_dtype, pv_mode, swap):
    """Regression guard: the KV tile loop must keep tiles in flight. A loop shape that
    Triton cannot pipeline still compiles and runs correctly, but waits for every load in
    the iteration that issues it (measured on the H200: ~20% of copy bandwidth).
    The operand-swapped fp8 tile must also reach the warpgroup MMA with 16 query rows
    (both products; QGMMA in SASS), the reason it exists."""
    import re

    if swap:
        config = DecodeConfig(block_n=64, num_warps=4, num_stages=6, swap_ab=True)
    else:
        config = DecodeConfig(block_n=64 if kv_dtype == "int8" else 32, num_warps=8, num_stages=9)
    ttgir = _ttgir_for_sm90(kv_dtype, pv_mode, config)
    if swap:
        wgmma = re.findall(r"ttng\.warp_group_dot .*?-> tensor<(\d+)x(\d+)x", ttgir)
        assert ("64", "16") in wgmma and ("256", "16") in wgmma, f"QK / PV not on the warpgroup MMA: {wgmma}"
    # Two tile loops: single pass (Q hoisted) and the flat (pass, tile) loop for longer
    # queries. Inside each loop every wait leaves later tiles in flight; only the drain
    # after a loop waits for all.
    loops = ttgir.split("scf.for")[1:]
    assert len(loops) >= 2, "expected the single-pass and the multi-pass tile loops"
    for i, loop in enumerate(loops):
        waits = [int(n) for n in re.findall(r"ttg\.async_wait[^\n]*\{num = (\d+)", loop)]
        assert waits, f"loop {i}: no asynchronous copies: the K/V loads are not pipelined"
        assert waits.count(0) <= 1, f"loop {i}: loads waited for in their own iteration: async_wait nums {waits}"
    assert re.search(r"memdesc<[2-9]x\d+x256x", ttgir), "K/V tiles are not multi-buffered"


# --------------------------------------------------------------------------- in-kernel clamps (on by default)
def _bad_decode_metadata(b):
    """One decode sequence's metadata out of range (its query range stays decode-length)."""
    return testing.bad_metadata_cases(b, overrun=2)


#: (kv, q_heads, kv_heads, swap, num_splits): the row-major and swapped tiles, one and
#: several splits, one pass and several passes (16 heads x 3 tokens > 32 packed rows)
SAFE_CONFIGS = [("int8", 4, 2, False, 3), ("int8", 4, 2, False, 1), ("int8", 4, 2, True, 3),
                ("fp8", 4, 2, True, 2), ("bf16", 4, 2, False, 2), ("int8", 16, 2, False, 2)]


@cases("kv,hq,hkv,swap,splits", SAFE_CONFIGS)
def test_safe_launch_equals_the_default_on_valid_metadata(device, monkeypatch, kv, hq, hkv, swap, splits):
    """The clamps (default) change nothing for metadata in range: bit-identical output to a
    launch built without them (INT8ATTN_DECODE_SAFE=0)."""
    if swap:
        import int8attn.ops.decode as dec

        config = DecodeConfig(block_n=64, num_warps=4, num_stages=3, swap_ab=True)
        monkeypatch.setattr(dec, "default_config", lambda *args: config)
    b = testing.make_paged_batch([37, 97, 20], [1, 3, 2], num_q_heads=hq, num_kv_heads=hkv, head_dim=64,
                                 kv_dtype=kv, seed=41, device=device)
    args = (b.query, b.cache, b.block_table, b.seq_lens, b.query_start_loc)
    monkeypatch.setenv("INT8ATTN_DECODE_SAFE", "0")
    plain = decode_attention(*args, out=testing.poisoned_like(b.query), num_splits=splits)
    assert launches.last("_decode_split_kernel").facts["safe"] is False
    monkeypatch.delenv("INT8ATTN_DECODE_SAFE")
    safe = decode_attention(*args, out=testing.poisoned_like(b.query), num_splits=splits)
    assert launches.last("_decode_split_kernel").facts["safe"] is True
    assert torch.equal(plain, safe)


_BAD_DECODE_CASES = list(_bad_decode_metadata(testing.make_paged_batch(
    [37, 97, 20], [1, 3, 2], num_q_heads=4, num_kv_heads=2, head_dim=64)).keys())
#: every case on the row-major, several-split tile; two cases on each other configuration
BAD_DECODE_RUNS = ([(case, "int8", 4, 2, False, 3) for case in _BAD_DECODE_CASES]
                   + [(case, *config) for config in SAFE_CONFIGS if config != ("int8", 4, 2, False, 3)
                      for case in ("block id too large", "seq_len beyond table")])


@cases("case,kv,hq,hkv,swap,splits", BAD_DECODE_RUNS)
def test_safe_launch_keeps_bad_metadata_in_bounds(device, monkeypatch, case, kv, hq, hkv, swap, splits):
    """With value checks off and the default clamps, out-of-range metadata of one
    sequence makes its rows NaN (the others equal the run on valid metadata), and raises a
    device flag that check_errors() turns into an error naming the sequence."""
    if swap:
        import int8attn.ops.decode as dec

        config = DecodeConfig(block_n=64, num_warps=4, num_stages=3, swap_ab=True)
        monkeypatch.setattr(dec, "default_config", lambda *args: config)
    monkeypatch.setenv("INT8ATTN_CHECK_VALUES", "0")
    monkeypatch.delenv("INT8ATTN_DECODE_SAFE", raising=False)
    b = testing.make_paged_batch([37, 97, 20], [1, 3, 2], num_q_heads=hq, num_kv_heads=hkv, head_dim=64,
                                 kv_dtype=kv, seed=43, device=device)
    good = decode_attention(b.query, b.cache, b.block_table, b.seq_lens, b.query_start_loc, num_splits=splits)
    bt, sl, qsl, bad_seq, words = _bad_decode_metadata(b)[case]
    out = decode_attention(b.query, b.cache, bt, sl, qsl, out=testing.poisoned_like(b.query), num_splits=splits)
    testing.assert_only_sequence_nan(out, good, b.query_start_loc, bad_seq, case)
    with pytest.raises(DeviceMetadataError, match=f"{words}.*index {bad_seq};"):
        check_errors(device)
    check_errors(device)  # cleared


def test_safe_plan_survives_metadata_changed_after_planning(device, monkeypatch):
    """A plan checked at planning whose seq_lens and block table are then changed in place
    (the metadata a serving loop may corrupt between steps): NaN rows and an error, no
    access outside the cache."""
    from int8attn.ops.attention import plan_attention

    monkeypatch.delenv("INT8ATTN_DECODE_SAFE", raising=False)
    b = testing.make_paged_batch([37, 97, 20], [1, 1, 1], num_q_heads=4, num_kv_heads=2, head_dim=64,
                                 kv_dtype="int8", seed=47, device=device)
    plan = plan_attention(b.cache, b.block_table, b.seq_lens, b.query_start_loc, 4)
    args = (b.query, b.cache, b.block_table, b.seq_lens, b.query_start_loc)
    good = plan.run(*args)
    b.seq_lens[0] = b.block_table.shape[1] * b.cache.block_size + 100
    b.block_table[2, 0] = -7
    out = plan.run(*args, out=testing.poisoned_like(b.query))
    assert torch.isnan(out[0].float()).all() and torch.isnan(out[2].float()).all()
    assert torch.equal(out[1], good[1])
    with pytest.raises(DeviceMetadataError, match="index 0;"):
        check_errors(device)


# ---------------------------------------------------------------- fused merge (one launch)
# (kv, pv, q_heads, kv_heads, head_dim, seq_lens, q_lens, num_splits, swap, block_n): one
# group of splits and several (the two-level merge: 8 splits per group), several passes,
# padded head_dim, row-major and swapped tiles
FUSED_CASES = [
    ("int8", "int8", 8, 2, 64, [1, 17, 97, 123], [1, 1, 1, 1], 3, False, 32),
    ("int8", "int8", 12, 2, 128, [17, 400, 123, 9], [2, 4, 8, 1], 20, False, 32),
    ("int8", "int8", 6, 1, 256, [700, 33], [1, 2], 11, True, 64),
    ("fp8", "fp8", 8, 1, 64, [40, 600, 5], [8, 1, 3], 9, True, 64),
    ("int8", "bf16", 4, 2, 96, [300, 70], [1, 3], 16, False, 32),
    ("bf16", None, 6, 2, 64, [17, 520], [1, 4], 64, False, 16),
]


#: the fused merges; the barrier merge needs every program resident at once, which the
#: interpreter (one program after another) never has: it runs on the GPU only (its sm_90
#: code is checked on every machine by test_barrier_merge_compiles_for_sm90)
FUSED_MODES = [pytest.param(True, id="last"),
               pytest.param("barrier", id="barrier", marks=pytest.mark.skipif(
                   not torch.cuda.is_available(), reason="the barrier merge runs on a GPU only"))]


@pytest.mark.parametrize("mode", FUSED_MODES)
@cases("kv,pv,hq,hkv,d,seq_lens,q_lens,splits,swap,block_n", FUSED_CASES)
def test_fused_merge_matches_references(device, monkeypatch, mode, kv, pv, hq, hkv, d, seq_lens, q_lens, splits,
                                        swap, block_n):
    """``fused_merge``: the split programs merge their own partials (the last to finish per
    (sequence, KV head), in two levels past 8 splits; or, "barrier", every split its share
    of the columns after all have arrived); one launch, no merge kernel; the same results
    as the merge kernel's launch (to fp32 summation order), the counters left valid for the
    next call (arrivals back at zero), and a second call on the reused launch bit-identical."""
    import int8attn.ops.decode as dec

    base = DecodeConfig(block_n=block_n, num_warps=4, num_stages=3, swap_ab=swap, fused_merge=False)
    batch = testing.make_paged_batch(seq_lens, q_lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=16,
                                     kv_dtype=kv, seed=3 * d + hq + splits, device=device)
    monkeypatch.setattr(dec, "default_config", lambda *args: base)
    separate = _run_and_check(batch, pv_mode=pv, num_splits=splits)
    fused_cfg = DecodeConfig(block_n=block_n, num_warps=4, num_stages=3, swap_ab=swap, fused_merge=mode)
    monkeypatch.setattr(dec, "default_config", lambda *args: fused_cfg)
    launches.clear()
    args = (batch.query, batch.cache, batch.block_table, batch.seq_lens, batch.query_start_loc)
    fused = _run_and_check(batch, pv_mode=pv, num_splits=splits)
    assert launches.last("_decode_merge_kernel") is None, "the fused launch ran the merge kernel"
    plan = launches.last("_decode_split_kernel").facts["plan"]
    slots = dec.resident_slots(fused_cfg, batch.cache.device, d, batch.cache.key.element_size())
    fits = len(seq_lens) * hkv * plan.head_split * splits <= slots
    assert plan.merge == ("barrier" if mode == "barrier" and fits else "last"), (plan.merge, fits)
    first = decode_attention(*args, pv_mode=pv, num_splits=splits)
    again = decode_attention(*args, out=testing.poisoned_like(batch.query), pv_mode=pv, num_splits=splits)
    assert torch.equal(first, again)
    launch = next(v for v in dec._LAUNCHES.values() if v.plan is plan)
    counters = launch._counters if plan.merge == "last" else launch._counters[..., 0]
    assert int(counters.abs().sum()) == 0, "arrival counters not reset"
    assert abs(fused["rel_l2"] - separate["rel_l2"]) < 1e-3


@pytest.mark.parametrize("mode", FUSED_MODES)
def test_fused_merge_with_bad_metadata(device, monkeypatch, mode):
    """A sequence with bad metadata under the fused merge: its rows NaN and flagged, the
    others equal to the valid run, and the counters reset (the next valid call is right)."""
    import int8attn.ops.decode as dec

    config = DecodeConfig(block_n=32, num_warps=4, num_stages=3, fused_merge=mode)
    monkeypatch.setattr(dec, "default_config", lambda *args: config)
    monkeypatch.setenv("INT8ATTN_CHECK_VALUES", "0")
    monkeypatch.delenv("INT8ATTN_DECODE_SAFE", raising=False)
    b = testing.make_paged_batch([37, 400, 20], [1, 3, 2], num_q_heads=4, num_kv_heads=2, head_dim=64,
                                 kv_dtype="int8", seed=43, device=device)
    args = (b.query, b.cache, b.block_table, b.seq_lens, b.query_start_loc)
    good = decode_attention(*args, num_splits=12)
    for case in ("block id too large", "seq_len beyond table", "seq_len negative"):
        bt, sl, qsl, bad_seq, words = _bad_decode_metadata(b)[case]
        out = decode_attention(b.query, b.cache, bt, sl, qsl, out=testing.poisoned_like(b.query), num_splits=12)
        testing.assert_only_sequence_nan(out, good, b.query_start_loc, bad_seq, case)
        with pytest.raises(DeviceMetadataError, match=words):
            check_errors(device)
        assert torch.equal(decode_attention(*args, num_splits=12), good), f"{case}: the next valid call differs"


# --------------------------------------------------------------------------- sliding window
WINDOW_CASES = [
    # (kv, q_heads, kv_heads, head_dim, seq_lens, q_lens, window, num_splits)
    ("int8", 8, 2, 64, [300, 40, 17], [1, 3, 2], 1, None),
    ("int8", 8, 2, 64, [400, 97, 17], [1, 8, 2], 17, 3),
    ("int8", 12, 2, 128, [300, 40], [4, 1], 97, 5),
    ("fp8", 8, 2, 64, [261, 40], [2, 1], 33, 3),
    ("bf16", 6, 2, 96, [300, 17], [3, 1], 40, 2),
]


@cases("kv,hq,hkv,d,seq_lens,q_lens,window,splits", WINDOW_CASES)
def test_sliding_window_matches_reference_and_skips_older_tiles(kv, hq, hkv, d, seq_lens, q_lens, window, splits,
                                                                 device, monkeypatch):
    """``window``: each query token sees the ``window`` most recent positions up to its
    own (multi-token steps: each token its own window), through one split and through
    the merge. The tiles before a sequence's window are never read: their block-table
    entries are set out of range (value checks off) and no error flag is raised, no row
    is poisoned."""
    monkeypatch.setenv("INT8ATTN_CHECK_VALUES", "0")
    b = testing.make_paged_batch(seq_lens, q_lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, kv_dtype=kv,
                                 seed=13, device=device)
    args = (b.cache, b.block_table, b.seq_lens, b.query_start_loc)
    ref = reference.attention_reference_quantized(b.query, *args, window=window)
    out = decode_attention(b.query, *args, out=testing.poisoned_like(b.query), num_splits=splits, window=window)
    mode = {"int8": "int8", "fp8": "fp8", "bf16": "bf16"}[kv]
    testing.assert_close_verbose(out, ref, rel_l2=TOL_QUANTIZED[(kv, mode)], name=f"{kv} window {window}")
    plan = launches.last("_decode_split_kernel").facts["plan"]
    block_n = max(plan.config.block_n, b.cache.block_size)
    bt = b.block_table.clone()
    hidden = 0
    for s, (length, q_len) in enumerate(zip(seq_lens, q_lens)):
        first_key = (max(length - q_len - window + 1, 0) // block_n) * block_n
        pages = first_key // b.cache.block_size
        bt[s, :pages] = b.cache.num_blocks + 7  # out of range: reading any of them raises a flag
        hidden += pages
    assert hidden > 0, "the case hides no page: it would test nothing"
    again = decode_attention(b.query, b.cache, bt, b.seq_lens, b.query_start_loc, out=testing.poisoned_like(b.query),
                             num_splits=splits, window=window)
    check_errors(device)  # no flag: no hidden page was read
    assert torch.equal(again, out)


# --------------------------------------------------------------------------- non-finite input
_DEFAULT_PV = {"int8": "int8", "fp8": "fp8", "bf16": "bf16"}


@pytest.mark.parametrize("kv,pre", [("int8", False), ("int8", True), ("fp8", False), ("fp8", True),
                                    ("bf16", False)], ids=["int8", "int8_prequantized", "fp8", "fp8_prequantized",
                                                           "bf16"])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("splits", [1, 3], ids=["one_split", "three_splits"])
def test_non_finite_query_gives_nan_rows_for_that_query_only(kv, pre, bad, splits, device):
    """A query row with an inf / NaN (its q_scale NaN; bf16: its scores) makes exactly its
    own output row NaN -- never a finite row (an 8-bit P rounds NaN to 0, so the
    normalization must keep a NaN denominator) -- through one split and through the
    merge; every other row matches the reference."""
    b = testing.make_paged_batch([97, 40, 17], [1, 2, 1], num_q_heads=8, num_kv_heads=2, head_dim=64, kv_dtype=kv,
                                 seed=3, device=device)
    want, clean = testing.poison_query_rows(b.query, [(0, 1, 3), (2, 6, 0)], bad)  # token 2: sequence 1's second
    kw = {}
    if pre:
        q, s = quantize_query(b.query, kv)
        kw = dict(q_quant=q, q_scale=s)
    args = (b.cache, b.block_table, b.seq_lens, b.query_start_loc)
    out = decode_attention(b.query, *args, out=testing.poisoned_like(b.query), num_splits=splits, **kw)
    ref = reference.attention_reference_quantized(clean, *args)
    testing.assert_nan_exactly(out, ref, want, TOL_QUANTIZED[(kv, _DEFAULT_PV[kv])], f"{kv}, {splits} splits")


@pytest.mark.parametrize("kv,pv", [("int8", "int8"), ("int8", "bf16"), ("fp8", "fp8"), ("bf16", "bf16")])
@pytest.mark.parametrize("tensor,bad", [("k", float("nan")), ("v", float("inf"))], ids=["k_nan", "v_inf"])
@pytest.mark.parametrize("splits", [1, 3], ids=["one_split", "three_splits"])
def test_non_finite_kv_poisons_exactly_the_rows_that_read_it(kv, pv, tensor, bad, splits, device):
    """A K or V row with an inf / NaN (stored poisoned) makes NaN exactly the decode rows
    that see it: the KV head's query heads of its sequence, at positions at or after it
    (sequence 0's 3-token step at positions 58..60 over a token at 59: its last two
    tokens); other heads, earlier positions and other sequences stay finite and correct."""
    b = testing.make_paged_batch([61, 40], [3, 1], num_q_heads=6, num_kv_heads=2, head_dim=64, kv_dtype=kv,
                                 seed=23, device=device, writer=testing.poisoning_writer([(59, 1, 5, tensor)], bad))
    args = (b.cache, b.block_table, b.seq_lens, b.query_start_loc)
    out = decode_attention(b.query, *args, out=testing.poisoned_like(b.query), pv_mode=pv, num_splits=splits)
    want = torch.zeros(b.query.shape[:2], dtype=torch.bool)
    want[1:3, 3:6] = True
    ref = reference.attention_reference_quantized(b.query, *args)
    testing.assert_nan_exactly(out, ref, want, TOL_QUANTIZED[(kv, pv)], f"{kv}/{pv}, {splits} splits")



def test_barrier_merge_plan(device, monkeypatch):
    """``fused_merge="barrier"``: the planner caps the split count at the resident program
    slots (the grid must be co-resident), keeps "barrier" while the grid fits and takes
    "last" when it cannot (more programs than slots at two splits); under the interpreter
    the launch runs the last-arrival merge (FUSED_MERGE code of "last"); a bad value is
    refused."""
    import int8attn.ops.decode as dec
    from int8attn.kernels.codes import MERGE

    cfg = DecodeConfig(block_n=32, num_warps=4, num_stages=3, fused_merge="barrier")
    cache = testing.make_paged_batch([40], [1], num_q_heads=8, num_kv_heads=2, head_dim=64, device=device).cache
    slots = dec.resident_slots(cfg, cache.device, 64, cache.key.element_size())
    small = dec.plan_decode((1, 8, 64), cache, (1, 4096), config=cfg)
    assert small.merge == "barrier" and 2 <= small.num_splits and 2 * small.num_splits <= slots
    wide = dec.plan_decode((slots, 8, 64), cache, (slots, 4096), config=cfg)
    assert wide.merge == "last" or wide.num_splits == 1
    with pytest.raises(ValueError, match="fused_merge"):
        dec.plan_decode((1, 8, 64), cache, (1, 64), config=DecodeConfig(32, 4, 3, fused_merge="grid"))
    if device == "cpu":
        monkeypatch.setattr(dec, "default_config", lambda *args: cfg)
        b = testing.make_paged_batch([300, 70], [1, 2], num_q_heads=8, num_kv_heads=2, head_dim=64, seed=5)
        _run_and_check(b, num_splits=4)
        rec = launches.last("_decode_split_kernel")
        assert rec.facts["plan"].merge == "barrier"
        launch = next(v for v in dec._LAUNCHES.values() if v.plan is rec.facts["plan"])
        # the interpreter runs programs in order: the split launch quantizes its own query
        assert rec.facts["query_in"] == "quantize" and isinstance(launch._split_kernel, tuple)
        for split in launch._split_kernel:
            assert split.constexprs["FUSED_MERGE"] == MERGE["last"]
            assert "launch_cooperative_grid" not in split.constexprs


FUSED_QUERY_CASES = [
    # (kv, q_heads, kv_heads, head_dim, seq_lens, q_lens, num_splits, head_split, migrated)
    ("int8", 8, 2, 64, [97, 17, 1], [1, 1, 1], 3, 1, False),
    ("int8", 8, 2, 64, [123, 40], [4, 1], 4, 1, True),
    ("fp8", 12, 2, 128, [97, 33], [8, 2], 2, 1, True),
    ("int8", 12, 2, 64, [123, 9], [4, 3], 3, 2, True),
]


@pytest.mark.parametrize("kv,hq,hkv,d,seq_lens,q_lens,splits,head_split,migrated", FUSED_QUERY_CASES,
                         ids=lambda v: str(v).replace(" ", ""))
def test_split_kernel_quantizing_its_query_matches_given_codes(device, kv, hq, hkv, d, seq_lens, q_lens, splits,
                                                               head_split, migrated):
    """A split launch that quantizes the float query itself (``QUERY_IN``: one program per
    (sequence, KV head) rounds it, the others wait for its codes) gives bit for bit the
    output of the same launch reading the codes of the query quantization kernel, writes
    those same codes, and leaves its ready counts at zero (so the next launch and every
    graph replay start clean). On the CPU every quantizing launch is fused (the interpreter
    runs split 0 first); on a GPU the eager barrier launch is. Covered: GQA packing, several
    passes (q_len 8 over 4-token passes), head-split programs, channel migration, a NaN
    query row (its own rows NaN, nothing else changed)."""
    import int8attn.ops.decode as dec
    from int8attn.ops.producer import quantize_query

    b = testing.make_paged_batch(seq_lens, q_lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, kv_dtype=kv,
                                 seed=11, device=device)
    if migrated:
        lam = torch.rand(hkv, d, generator=torch.Generator().manual_seed(3)).add_(0.5).to(device)
        b.cache.set_channel_migration(lam)
    query = b.query.clone()
    query[0, 1, 5] = float("nan")  # sequence 0's first token, head 1
    plan = dec.plan_decode(tuple(query.shape), b.cache, tuple(b.block_table.shape), num_splits=splits,
                           head_split=head_split, max_query_len=max(q_lens))
    tail = (b.cache, b.block_table, b.seq_lens, b.query_start_loc)
    fused = dec.DecodeLaunch.for_tensors(plan, b.cache, query, None, None, b.block_table, query.stride())
    if device == "cuda" and fused._eager_split is None:
        pytest.skip("this plan has no eager barrier launch on this GPU")
    out = testing.poisoned_like(query)
    launches.clear()
    fused(query, None, None, *tail, out, dec.qk_scale_of(None, d))
    assert launches.last("_decode_split_kernel").facts["query_in"] == ("quantize_lam" if migrated else "quantize")
    assert launches.last("_quantize_query_kernel") is None

    q_quant, q_scale = quantize_query(query, kv, channel_scale=b.cache.key_channel_scale)
    given = dec.DecodeLaunch.for_tensors(plan, b.cache, query, q_quant, q_scale, b.block_table, query.stride())
    expect = testing.poisoned_like(query)
    given(query, q_quant, q_scale, *tail, expect, dec.qk_scale_of(None, d))
    assert launches.last("_decode_split_kernel").facts["query_in"] == "codes"

    assert torch.equal(fused._q_codes.view(torch.uint8), q_quant.view(torch.uint8))
    torch.testing.assert_close(fused._q_scales, q_scale, rtol=0, atol=0, equal_nan=True)
    nan_rows = torch.isnan(out.float()).flatten(1).any(1)
    assert nan_rows[0] and not nan_rows[1:].any(), "the NaN query row reached other tokens' rows"
    assert torch.isnan(out[0, 1].float()).all()
    testing.assert_close_verbose(out[1:], expect[1:], rel_l2=0.0, name="fused query vs given codes")
    assert torch.equal(out[0, torch.arange(hq) != 1], expect[0, torch.arange(hq) != 1])
    assert int(fused._counters[..., 0].abs().sum()) == 0, "ready counts not back at zero"


def test_auto_merge_plan(device):
    """The default config (``fused_merge=None``): a plan whose grid fits the resident slots
    merges "auto" -- the barrier merge for eager launches, the merge kernel under graph
    capture -- with the split count the merge kernel would get (auto never changes it);
    a grid that does not fit, and one split, take the merge kernel; the interpreter never
    builds the barrier launch."""
    import int8attn.ops.decode as dec

    b = testing.make_paged_batch([300, 70], [1, 2], num_q_heads=8, num_kv_heads=2, head_dim=64, seed=5,
                                 device=device)
    auto = dec.plan_decode(tuple(b.query.shape), b.cache, tuple(b.block_table.shape))
    kernel = dec.plan_decode(tuple(b.query.shape), b.cache, tuple(b.block_table.shape),
                             config=dataclasses.replace(auto.config, fused_merge=False))
    assert auto.config.fused_merge is None and auto.num_splits == kernel.num_splits
    assert (auto.merge, kernel.merge) == ("auto" if auto.num_splits > 1 else "kernel", "kernel")
    one = dec.plan_decode(tuple(b.query.shape), b.cache, tuple(b.block_table.shape), num_splits=1)
    assert one.merge == "kernel"
    slots = dec.resident_slots(auto.config, b.cache.device, 64, b.cache.key.element_size())
    wide = dec.plan_decode((slots, 8, 64), b.cache, (slots, b.block_table.shape[1]), num_splits=2)
    assert wide.merge == "kernel"
    launch = dec.DecodeLaunch.for_tensors(auto, b.cache, b.query, None, None, b.block_table, b.query.stride())
    assert (launch._eager_split is None) == (device == "cpu" or auto.merge != "auto")


def test_refused_cooperative_launch_falls_back_to_the_merge_kernel(device, monkeypatch):
    """An "auto" launch whose cooperative grid the driver refuses (Triton raises "...too
    many blocks in cooperative launch") runs the split + merge kernels instead, from then
    on; any other launch error propagates. (The driver's refusal is simulated: the
    barrier launch itself runs on a GPU only.)"""
    import int8attn.ops.decode as dec

    b = testing.make_paged_batch([300, 70], [1, 2], num_q_heads=8, num_kv_heads=2, head_dim=64, seed=5,
                                 device=device)
    plan = dec.plan_decode(tuple(b.query.shape), b.cache, tuple(b.block_table.shape), num_splits=4)
    assert plan.merge == "auto"
    launch = dec.DecodeLaunch.for_tensors(plan, b.cache, b.query, None, None, b.block_table, b.query.stride())

    def refused(*args):
        raise RuntimeError("Triton Error [CUDA]: too many blocks in cooperative launch")

    def broken(*args):
        raise RuntimeError("Triton Error [CUDA]: an illegal memory access was encountered")

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    args = (b.query, None, None, b.cache, b.block_table, b.seq_lens, b.query_start_loc)
    launch._eager_split = broken
    with pytest.raises(RuntimeError, match="illegal memory access"):
        launch(*args, testing.poisoned_like(b.query), dec.qk_scale_of(None, 64))
    launch._eager_split = refused
    launches.clear()
    out = testing.poisoned_like(b.query)
    launch(*args, out, dec.qk_scale_of(None, 64))
    assert launch._eager_split is None
    assert launches.last("_decode_split_kernel").facts["merge"] == "kernel"
    assert launches.last("_decode_merge_kernel") is not None
    ref_q = reference.attention_reference_quantized(b.query, b.cache, b.block_table, b.seq_lens, b.query_start_loc)
    testing.assert_close_verbose(out, ref_q, rel_l2=TOL_QUANTIZED[("int8", "int8")])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_auto_merge_eager_barrier_graph_kernels(monkeypatch, unloaded_decode_kernels):
    """Default plans on the GPU: an eager call is one launch (the barrier merge, no merge
    kernel), the same call captured into a CUDA graph is split + merge kernels; both agree
    with the merge kernel's eager result (to fp32 summation order) and with the reference.
    The capture loads no module (which would invalidate it): the eager call loaded the
    captured path's kernels without launching them -- the kernels' in-process caches are
    emptied first, so no earlier test loaded them."""
    import int8attn.ops.decode as dec

    batch = testing.make_paged_batch([300, 1000, 77], [1, 2, 1], num_q_heads=24, num_kv_heads=4, head_dim=256,
                                     kv_dtype="int8", seed=9, device="cuda")
    args = (batch.query, batch.cache, batch.block_table, batch.seq_lens, batch.query_start_loc)
    ws = DecodeWorkspace(batch.query.shape[0], 24, 256, device="cuda")
    launches.clear()
    eager = decode_attention(*args, workspace=ws)
    rec = launches.last("_decode_split_kernel")
    assert rec.facts["plan"].merge == "auto" and rec.facts["merge"] == "barrier"
    assert launches.last("_decode_merge_kernel") is None
    launches.clear()
    out = torch.empty_like(batch.query)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_attention(*args, out=out, workspace=ws)
    assert launches.last("_decode_split_kernel").facts["merge"] == "kernel"
    assert launches.last("_decode_merge_kernel") is not None
    out.fill_(math.nan)
    graph.replay()
    torch.cuda.synchronize()
    plan = rec.facts["plan"]
    kernel_cfg = dataclasses.replace(plan.config, fused_merge=False)
    monkeypatch.setattr(dec, "default_config", lambda *a, **k: kernel_cfg)
    separate = decode_attention(*args, workspace=ws)
    ref_q = reference.attention_reference_quantized(*args)
    for got in (eager, out):
        testing.assert_close_verbose(got, ref_q, rel_l2=TOL_QUANTIZED[("int8", "int8")])
        assert (got.float() - separate.float()).abs().max() <= 2e-2


def test_barrier_merge_compiles_for_sm90():
    """The barrier merge's sm_90 code (compiled ahead of time, no GPU): one thread per
    program reads the generation at its start (a relaxed load, consumed after the tile
    loop), takes its ticket with an acq_rel add and, the last, advances the generation
    with a release add; the others spin on acquire loads; the tile loop is still
    software-pipelined (async copies in the loop)."""
    import json
    import re

    cfg = DecodeConfig(block_n=64, num_warps=4, num_stages=6, swap_ab=True)
    extra = dict(FUSED_MERGE=2, MERGE_M=8, MERGE_CHUNK=64, MERGE_COLS=4)
    out = json.loads(_ttgir_for_sm90("int8", "int8", cfg, extra, asm="all"))
    ptx, ttgir = out["ptx"], out["ttgir"]
    assert re.search(r"ld\.global\.gpu\.relaxed\.b32", ptx), "no early read of the generation"
    assert re.search(r"ld\.global\.gpu\.acquire\.b32", ptx), "no acquire loads of the generation"
    assert re.search(r"atom\.global\.gpu\.acq_rel\.add\.u32", ptx), "no acq_rel arrival ticket"
    # (a result-less add may be emitted as a reduction)
    assert re.search(r"(atom|red)\.global\.gpu\.release\.add\.u32", ptx), "no release of the generation"
    assert "scf.while" in ttgir, "no spin loop"
    assert "ttg.async_copy_global_to_local" in ttgir and "ttg.async_wait" in ttgir


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_query_quantizing_barrier_launch_compiles_for_sm90(kv):
    """The eager one-launch decode that quantizes its own query (QUERY_IN "quantize_lam",
    the barrier merge, the 16-row swapped tile of the default D256 q1 plan), compiled for
    sm_90 without a GPU: split 0 publishes the codes with a release add (beside the
    barrier's), the other splits spin on acquire loads, both products stay on Hopper's
    8-bit warpgroup MMA (IGMMA / QGMMA in SASS), the tile loop stays software-pipelined,
    and the int8 kernel uses no local memory (fp8's, at the 255-register limit, at most 12
    local-memory instructions more than the same launch reading given codes: 6 with Triton
    3.6, 16 against 6 with 3.9)."""
    import json
    import re

    from int8attn.kernels.codes import QUERY_IN

    cfg = DecodeConfig(block_n=64, num_warps=4, num_stages=6, swap_ab=True)
    extra = dict(FUSED_MERGE=2, MERGE_M=8, MERGE_CHUNK=64, MERGE_COLS=4, QUERY_IN=QUERY_IN["quantize_lam"])
    out = json.loads(_ttgir_for_sm90(kv, kv, cfg, extra, asm="all"))
    ptx, ttgir, text = out["ptx"], out["ttgir"], out["sass"]
    assert len(re.findall(r"(?:atom|red)\.global\.gpu\.release\.add", ptx)) == 2, "ready count not released"
    assert len(re.findall(r"ld\.global\.gpu\.acquire\.b32", ptx)) >= 2, "no acquire spin on the ready count"
    mma = {"int8": r"\.s32\.s8\.s8", "fp8": r"\.f32\.e4m3\.e4m3"}[kv]
    assert re.search(r"wgmma\.mma_async\.sync\.aligned\.\w+" + mma, ptx), "products left the 8-bit wgmma"
    assert ttgir.count("scf.while") >= 2, "no spin loops"
    assert "ttg.async_copy_global_to_local" in ttgir and "ttg.async_wait" in ttgir
    assert ("IGMMA" if kv == "int8" else "QGMMA") in text
    local = len(re.findall(r"\b(?:LDL|STL)\b", text))
    if kv == "int8":
        assert local == 0, f"{local} local-memory instructions"
    else:
        codes = dict(extra, QUERY_IN=QUERY_IN["codes"])
        given_sass = json.loads(_ttgir_for_sm90(kv, kv, cfg, codes, asm="all"))["sass"]
        given = len(re.findall(r"\b(?:LDL|STL)\b", given_sass))
        assert local <= given + 12, f"{local} local-memory instructions against {given} with given codes"


# ---------------------------------------------------------------- head split (GQA group over programs)
# (kv, pv, q_heads, kv_heads, head_dim, seq_lens, q_lens, head_split, fused, swap)
HEAD_SPLIT_CASES = [
    ("int8", "int8", 12, 2, 64, [17, 97, 123], [4, 1, 3], 2, False, False),
    ("int8", "int8", 12, 2, 128, [300, 40], [4, 2], 3, False, True),
    ("int8", "int8", 12, 2, 64, [400, 97], [4, 8], 2, True, True),
    ("fp8", "fp8", 8, 1, 64, [97, 33], [3, 1], 4, False, True),
    ("bf16", None, 6, 2, 96, [123, 17], [4, 2], 3, True, False),
    ("int8", "bf16", 8, 2, 64, [70, 9], [2, 2], 2, False, False),
]


@cases("kv,pv,hq,hkv,d,seq_lens,q_lens,head_split,fused,swap", HEAD_SPLIT_CASES)
def test_head_split_matches_references(device, monkeypatch, kv, pv, hq, hkv, d, seq_lens, q_lens, head_split, fused,
                                       swap):
    """A KV head's query heads shared out over ``head_split`` programs (each packing its
    share of the group): the same results, with the merge kernel or the fused merge."""
    import int8attn.ops.decode as dec

    config = DecodeConfig(block_n=64, num_warps=4, num_stages=3, swap_ab=swap, fused_merge=fused)
    monkeypatch.setattr(dec, "default_config", lambda *args: config)
    real_plan = dec.plan_decode
    monkeypatch.setattr(dec, "plan_decode", lambda *a, **k: real_plan(*a, **{**k, "head_split": head_split}))
    batch = testing.make_paged_batch(seq_lens, q_lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=16,
                                     kv_dtype=kv, seed=5 * d + hq + head_split, device=device)
    _run_and_check(batch, pv_mode=pv, num_splits=3)
    plan = launches.last("_decode_split_kernel").facts["plan"]
    assert plan.head_split == head_split and plan.block_m >= (hq // hkv // head_split) * plan.tokens_per_pass


def test_choose_head_split():
    """Multi-token steps whose packed rows exceed the widest measured tile split the group
    (smallest divisor that fits 16 rows); single-token decode never does; the planner lets
    int8 at head_dim 256 keep 32 rows in one program; a bad explicit value is refused."""
    from int8attn.ops.decode import choose_head_split

    assert choose_head_split(6, 16, 16) == 1            # q1
    assert choose_head_split(6, 32, 16) == 1            # q2: 12 rows
    assert choose_head_split(6, 64, 16) == 2            # q4: 24 rows -> 2 x 12
    assert choose_head_split(6, 64, 16, max_rows=32) == 1  # ... unless a 32-row tile is measured good
    assert choose_head_split(6, 16, 16, max_query_len=8, max_rows=32) == 3  # q8: 48 rows -> 3 x 16
    assert choose_head_split(8, 48, 16) == 2            # q3: 24 -> 2 x 12
    assert choose_head_split(16, 16, 16) == 1           # q1 at GQA 16: one program
    assert choose_head_split(5, 40, 10) == 5            # q4 at GQA 5: 20 rows, only 5 x 4 fits
    for kv, d, want in (("int8", 256, 1), ("fp8", 256, 2), ("bf16", 256, 2), ("int8", 64, 2)):
        b = testing.make_paged_batch([20], [4], num_q_heads=6, num_kv_heads=1, head_dim=d, kv_dtype=kv, seed=1,
                                     device="cpu")
        assert plan_decode(tuple(b.query.shape), b.cache, tuple(b.block_table.shape)).head_split == want, (kv, d)
    for bad in (0, 4, 7, 2.0):
        with pytest.raises(ValueError, match="head_split"):
            plan_decode(tuple(b.query.shape), b.cache, tuple(b.block_table.shape), head_split=bad)


@pytest.mark.parametrize("trigger", [True, "store", "exit"], ids=["start", "store", "exit"])
@pytest.mark.parametrize("kv", ["int8", "bf16"])
def test_programmatic_dependent_merge(device, monkeypatch, kv, trigger):
    """``DecodeConfig(pdl=...)``: the merge kernel launched as the split kernel's
    programmatic dependent (sm_90; the interpreter runs it as the plain merge), triggered at
    the split programs' start, after their tile loop or at their exit, gives the plain
    merge's result bit for bit, eagerly and replayed from a CUDA graph; on the GPU the merge
    kernel is compiled for that launch; the default (None) triggers after the tile loop
    where the GPU takes programmatic launches and launches plainly elsewhere; a value that
    names no trigger is refused at planning. Its instructions:
    test_sm90_compile.test_programmatic_dependent_merge_and_cyclic_splits_compile_for_sm90."""
    import int8attn.ops.decode as dec

    if device == "cuda" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs sm_90 or newer")
    plain = DecodeConfig(block_n=32, num_warps=4, num_stages=3, fused_merge=False, pdl=False)
    b = testing.make_paged_batch([300, 97, 1000], [1, 2, 1], num_q_heads=12, num_kv_heads=2, head_dim=64,
                                 kv_dtype=kv, seed=61, device=device)
    args = (b.query, b.cache, b.block_table, b.seq_lens, b.query_start_loc)
    monkeypatch.setattr(dec, "default_config", lambda *a, **k: plain)
    want = decode_attention(*args, num_splits=7)
    assert launches.last("_decode_split_kernel").facts["pdl"] is None
    monkeypatch.setattr(dec, "default_config", lambda *a, **k: dataclasses.replace(plain, pdl=None))
    assert torch.equal(decode_attention(*args, num_splits=7), want)
    auto = "store" if device == "cuda" else None
    assert launches.last("_decode_split_kernel").facts["pdl"] == launches.last("_decode_merge_kernel").facts["pdl"] \
        == auto
    monkeypatch.setattr(dec, "default_config", lambda *a, **k: dataclasses.replace(plain, pdl=trigger))
    launches.clear()
    got = decode_attention(*args, out=testing.poisoned_like(b.query), num_splits=7)
    assert torch.equal(got, want)
    assert launches.last("_decode_split_kernel").facts["plan"].config.pdl == trigger
    assert launches.last("_decode_split_kernel").facts["pdl"] == (
        None if device != "cuda" else "start" if trigger is True else trigger)
    assert launches.last("_decode_merge_kernel") is not None
    if device == "cuda":
        compiled = launches.last("_decode_merge_kernel").compiled
        assert getattr(compiled.metadata, "launch_pdl", None) is True
        out = torch.empty_like(b.query)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            decode_attention(*args, out=out, num_splits=7)
        out.fill_(math.nan)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)
    for bad in (1, "end", "auto"):
        with pytest.raises(ValueError, match="pdl must be None, a bool or one of"):
            dec.plan_decode(tuple(b.query.shape), b.cache, tuple(b.block_table.shape),
                            config=dataclasses.replace(plain, pdl=bad))


@pytest.mark.parametrize("migrated", [False, True], ids=["plain", "migrated"])
@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_split_kernel_as_the_query_quantizations_dependent(device, monkeypatch, kv, migrated):
    """``DecodeConfig(query_pdl=...)``: where a call quantizes its query in a kernel of its
    own, the split kernel launched as that kernel's programmatic dependent gives the plain
    launch's result bit for bit -- eagerly with the merge kernel and the "last" merge, and
    replayed from a CUDA graph of the default "auto" plan -- with channel migration too;
    on the GPU both kernels are compiled for it. None takes it where the GPU runs
    programmatic launches (the default); calls given the
    producer's codes, and launches that quantize the query themselves (every quantizing
    launch under the interpreter, eager barrier launches), never do; a value that is not a
    bool is refused at planning. Its instructions:
    test_sm90_compile.test_split_kernel_waits_for_the_query_quantization_on_sm90."""
    import int8attn.ops.decode as dec

    if device == "cuda" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs sm_90 or newer")
    on = device == "cuda"
    b = testing.make_paged_batch([300, 97, 1000], [1, 2, 1], num_q_heads=12, num_kv_heads=2, head_dim=64,
                                 kv_dtype=kv, seed=62, device=device)
    if migrated:
        lam = torch.rand(2, 64, generator=torch.Generator().manual_seed(4)).add_(0.5).to(device)
        b.cache.set_channel_migration(lam)
    args = (b.query, b.cache, b.block_table, b.seq_lens, b.query_start_loc)
    assert dec.plan_decode(tuple(b.query.shape), b.cache, tuple(b.block_table.shape)).config.query_pdl is None
    plain = DecodeConfig(block_n=32, num_warps=4, num_stages=3, fused_merge=False, query_pdl=False)

    def run(config, **kw):
        monkeypatch.setattr(dec, "default_config", lambda *a, **k: config)
        launches.clear()
        return decode_attention(*args, out=testing.poisoned_like(b.query), num_splits=7, **kw)

    for merge in (False, "last"):
        want = run(dataclasses.replace(plain, fused_merge=merge))
        assert launches.last("_decode_split_kernel").facts["query_pdl"] is False
        got = run(dataclasses.replace(plain, fused_merge=merge, query_pdl=None))
        testing.assert_close_verbose(got, want, rel_l2=0.0, name=f"query_pdl, merge {merge}")
        assert torch.equal(got, want), merge
        split, quantize = launches.last("_decode_split_kernel"), launches.last("_quantize_query_kernel")
        assert split.facts["query_pdl"] is on and (quantize is None) is (not on), (split.facts, quantize)
        if on:
            assert quantize.facts["query_pdl"] is True
            assert getattr(split.compiled.metadata, "launch_pdl", None) is True
    q_quant, q_scale = quantize_query(b.query, kv, channel_scale=b.cache.key_channel_scale)
    run(dataclasses.replace(plain, query_pdl=None), q_quant=q_quant, q_scale=q_scale)
    assert launches.last("_decode_split_kernel").facts["query_pdl"] is False
    assert launches.last("_quantize_query_kernel") is None
    if on:
        want = run(dataclasses.replace(plain, fused_merge=False))
        auto = dataclasses.replace(plain, fused_merge=None, query_pdl=None)
        run(auto)  # eager: the barrier launch quantizes itself and loads the captured kernels
        assert launches.last("_decode_split_kernel").facts["query_pdl"] is False
        out = torch.empty_like(b.query)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            decode_attention(*args, out=out, num_splits=7)
        assert launches.last("_decode_split_kernel").facts["query_pdl"] is True
        out.fill_(math.nan)
        graph.replay()
        torch.cuda.synchronize()
        testing.assert_close_verbose(out, want, rel_l2=0.0, name="query_pdl, graph replay")
        assert torch.equal(out, want)
    for bad in (1, "yes"):
        with pytest.raises(ValueError, match="query_pdl must be None or a bool"):
            dec.plan_decode(tuple(b.query.shape), b.cache, tuple(b.block_table.shape),
                            config=dataclasses.replace(plain, query_pdl=bad))


# (kv, pv, q_heads, kv_heads, head_dim, page, seq_lens, q_lens, splits, swap_ab)
CYCLIC_CASES = [
    # odd lengths over 32-key tiles: one tile (1, 17), a split past the tiles (40: 2 tiles, 3
    # splits), uneven deals (97, 123, 250)
    ("int8", "int8", 8, 2, 64, 16, [1, 17, 40, 97, 123, 250], [1, 1, 1, 1, 1, 1], 3, False),
    ("int8", "int8", 8, 2, 64, 16, [97, 250, 33], [1, 1, 1], 5, True),
    # several query passes (4 tokens x GQA 6 > 16 rows): the flat (pass, tile) loop
    ("int8", "bf16", 12, 2, 64, 16, [123, 40], [4, 1], 3, False),
    # fp8: the peeled last tile is the one split whose last tile it is
    ("fp8", "fp8", 8, 2, 64, 16, [97, 123, 17, 250], [1, 2, 1, 1], 4, True),
    ("fp8", "fp8", 8, 1, 128, 32, [250, 65], [1, 3], 3, False),
    ("bf16", "bf16", 6, 2, 96, 16, [123, 97], [1, 2], 3, False),
]


@cases("kv,pv,hq,hkv,d,page,seq_lens,q_lens,splits,swap", CYCLIC_CASES)
def test_cyclic_splits_match_references(kv, pv, hq, hkv, d, page, seq_lens, q_lens, splits, swap, device, monkeypatch):
    """``DecodeConfig(cyclic_splits=True)``: tiles dealt to the splits in turn give the
    float64 references' result within the usual bounds, through the merge (several splits
    hold tiles) and with a split that holds none; the launch record names the option. (The
    block-id prefetch it adds on a GPU: test_sm90_compile.)"""
    import int8attn.ops.decode as dec

    cfg = DecodeConfig(block_n=max(page, 32), num_warps=4, num_stages=3, fused_merge=False, swap_ab=swap, cyclic_splits=True)
    monkeypatch.setattr(dec, "default_config", lambda *a, **k: cfg)
    b = testing.make_paged_batch(seq_lens, q_lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, kv_dtype=kv,
                                 block_size=page, seed=29, device=device)
    launches.clear()
    _run_and_check(b, pv_mode=pv, num_splits=splits)
    facts = launches.last("_decode_split_kernel").facts
    assert facts["plan"].config.cyclic_splits and facts["plan"].num_splits == splits
    with pytest.raises(ValueError, match="cyclic_splits must be a bool"):
        dec.plan_decode(tuple(b.query.shape), b.cache, tuple(b.block_table.shape),
                        config=dataclasses.replace(cfg, cyclic_splits=1))


def test_stamped_launches_time_every_program_and_change_no_output(device):
    """``DecodeLaunch.stamped`` (the decode timeline's kernels, ``STAMPS``): the split and
    merge kernels give the plain launches' output bit for bit, eagerly and replayed from a
    CUDA graph; every program stamps its start and SM, every split program with tiles its
    metadata, last accumulator and stores in that order, the others nothing more; the merge
    programs pass their wait (as the split kernel's programmatic dependents where the GPU
    runs them) only after the last split program has issued its stores. Refused under the
    interpreter and for rows of the wrong shape. Instructions:
    test_sm90_compile.test_decode_stamps_compile_for_sm90_after_what_they_wait_for."""
    import int8attn.ops.decode as dec
    from int8attn.kernels._timeline import MERGE_STAMPS, SPLIT_STAMPS

    seq_lens, splits = [300, 97, 1000, 17], 5
    b = testing.make_paged_batch(seq_lens, [1] * 4, num_q_heads=12, num_kv_heads=2, head_dim=64, kv_dtype="int8",
                                 seed=71, device=device)
    q_quant, q_scale = quantize_query(b.query, "int8")
    base = dec.plan_decode(tuple(b.query.shape), b.cache, tuple(b.block_table.shape), num_splits=splits)
    plan = dec.plan_decode(tuple(b.query.shape), b.cache, tuple(b.block_table.shape), num_splits=splits,
                           config=dataclasses.replace(base.config, fused_merge=False))
    launch = dec.DecodeLaunch.for_tensors(plan, b.cache, b.query, q_quant, q_scale, b.block_table, b.query.stride())
    scale = dec.qk_scale_of(None, 64)

    def call(out):
        launch(b.query, q_quant, q_scale, b.cache, b.block_table, b.seq_lens, b.query_start_loc, out, scale)
        return out

    if device != "cuda":
        with pytest.raises(ValueError, match="run on a CUDA GPU"):
            with launch.stamped(*launch.stamp_rows()):
                pass
        return
    split_rows, merge_rows = launch.stamp_rows()
    assert merge_rows is not None and split_rows.shape[1] == len(SPLIT_STAMPS)
    with pytest.raises(ValueError, match="stamp rows"):
        with launch.stamped(split_rows[1:], merge_rows):
            pass
    want = call(testing.poisoned_like(b.query))
    with launch.stamped(split_rows, merge_rows):
        got = call(testing.poisoned_like(b.query))
    torch.cuda.synchronize()
    assert torch.equal(got, want)
    S, M = {n: i for i, n in enumerate(SPLIT_STAMPS)}, {n: i for i, n in enumerate(MERGE_STAMPS)}
    grid = launch._split_grid  # (splits, KV heads x head split, sequences); rows: axis 0 fastest
    rows = split_rows.cpu().view(grid[2], grid[1], grid[0], len(SPLIT_STAMPS))
    for seq, n in enumerate(seq_lens):
        active = min(grid[0], -(-n // max(plan.config.block_n, b.cache.block_size)))
        for split in range(grid[0]):
            for r in rows[seq, :, split]:
                t = [int(r[S[k]]) for k in ("start", "metadata", "tiles", "stored")]
                assert 0 < t[0] <= t[1] and int(r[S["sm"]]) >= 0, (seq, split, r)
                if split < active:
                    assert t[1] <= t[2] <= t[3], (seq, split, r)
                else:
                    assert t[2] == t[3] == -1, (seq, split, r)
    merge = merge_rows.cpu()
    assert (merge[:, M["start"]] > 0).all() and (merge[:, M["sm"]] >= 0).all()
    written = merge[:, M["stored"]] > 0  # programs of sequences with several active splits
    assert written.any()
    assert launches.last("_decode_merge_kernel").facts["stamps"] is True
    assert (merge[written, M["waited"]] >= split_rows[:, S["stored"]].max().cpu()).all()
    assert (merge[written, M["stored"]] >= merge[written, M["waited"]]).all()
    # replayed from a CUDA graph: the same output, the rows written again
    split_rows.fill_(-1)
    out = testing.poisoned_like(b.query)
    graph = torch.cuda.CUDAGraph()
    with launch.stamped(split_rows, merge_rows):
        with torch.cuda.graph(graph):
            call(out)
    split_rows.fill_(-1)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want) and (split_rows[:, S["start"]] > 0).all()
