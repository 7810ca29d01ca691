"""Decode with metadata nobody checked: the kernels clamp it, never address outside the
cache / workspace / output, write NaN rows for the sequences it affects, keep every other
sequence's result exact, and raise a device error flag that int8attn.check_errors() turns
into DeviceMetadataError naming the sequence.

Value checks are switched off (INT8ATTN_CHECK_VALUES=0), as in a serving loop, so the bad
values reach the kernels. The GPU half (compute-sanitizer memcheck on the same cases) is
benchmarks/decode_memcheck.py.
"""

import pytest
import torch

import int8attn
from int8attn import reference, testing
from int8attn.errors import DeviceMetadataError, check_errors
from int8attn.ops.attention import plan_attention
from int8attn.ops.decode import DecodeConfig, decode_attention

SEQ_LENS, Q_LENS = [97, 17, 123, 40], [1, 2, 1, 4]


@pytest.fixture(autouse=True)
def _checks_off(monkeypatch):
    monkeypatch.setenv("INT8ATTN_CHECK_VALUES", "0")
    try:  # no flag left over from another test
        check_errors()
    except DeviceMetadataError:
        pass


def _batch(device, kv="int8", seed=3, hq=8, hkv=2, d=64, bs=16):
    return testing.make_paged_batch(SEQ_LENS, Q_LENS, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs,
                                    kv_dtype=kv, seed=seed, device=device)


def _rows(batch, seq):
    qsl = batch.query_start_loc.tolist()
    return slice(qsl[seq], qsl[seq + 1])


def _expect(batch, out, ref, bad, tol):
    """Rows of ``bad`` sequences all NaN; every other row written and close to ``ref``."""
    keep = torch.ones(out.shape[0], dtype=torch.bool)
    for s in bad:
        rows = out[_rows(batch, s)].float()
        assert torch.isnan(rows).all(), f"sequence {s}: {int((~torch.isnan(rows)).sum())} finite values"
        keep[_rows(batch, s)] = False
    good = out[keep]
    assert not torch.isnan(good.float()).any(), "a row of a good sequence was not written"
    testing.assert_close_verbose(good, ref[keep], rel_l2=tol, name="good sequences")


def _raises_naming(seq):
    with pytest.raises(DeviceMetadataError, match=rf"first sequence/token index {seq}\b") as info:
        int8attn.check_errors()
    check_errors()  # cleared: a second check passes
    return str(info.value)


def _reference(batch):
    return reference.attention_reference_quantized(batch.query, batch.cache, batch.block_table, batch.seq_lens,
                                                   batch.query_start_loc)


def _swap(monkeypatch, config):
    import int8attn.ops.decode as dec

    monkeypatch.setattr(dec, "default_config", lambda *args: config)


@pytest.mark.parametrize("bad_id", [pytest.param(10_000, id="past-num_blocks"), pytest.param(-3, id="negative")])
@pytest.mark.parametrize("splits,fused", [pytest.param(1, True, id="one-split"),
                                          pytest.param(3, True, id="3-splits-fused"),
                                          pytest.param(3, False, id="3-splits-merge-kernel")])
def test_block_id_out_of_range(device, monkeypatch, bad_id, splits, fused):
    batch = _batch(device)
    ref = _reference(batch)
    _swap(monkeypatch, DecodeConfig(block_n=32, num_warps=4, num_stages=2, fused_merge=fused))
    bt = batch.block_table.clone()
    bt[2, 3] = bad_id  # a page sequence 2 reads (123 keys = 8 pages of 16)
    out = testing.poisoned_like(batch.query)
    decode_attention(batch.query, batch.cache, bt, batch.seq_lens, batch.query_start_loc, out=out,
                     num_splits=splits)
    _expect(batch, out, ref, bad=[2], tol=0.015)
    assert "block id" in _raises_naming(2)


@pytest.mark.parametrize("kv", ["int8", "fp8", "bf16"])
def test_seq_len_beyond_the_table_and_negative(device, kv):
    batch = _batch(device, kv=kv, seed=5)
    ref = _reference(batch)
    capacity = batch.block_table.shape[1] * batch.cache.block_size
    sl = batch.seq_lens.clone()
    sl[1] = capacity + 40  # more keys than the block-table row holds
    sl[3] = -7
    out = testing.poisoned_like(batch.query)
    decode_attention(batch.query, batch.cache, batch.block_table, sl, batch.query_start_loc, out=out, num_splits=2)
    tol = {"int8": 0.015, "fp8": 0.035, "bf16": 0.006}[kv]
    _expect(batch, out, ref, bad=[1, 3], tol=tol)
    assert "seq_len" in _raises_naming(1)


def test_query_bounds_out_of_range(device):
    """q_len > seq_len, and a query_start_loc entry past num_tokens: NaN rows where they
    exist inside the output, nothing written outside it."""
    batch = _batch(device, seed=9)
    ref = _reference(batch)
    sl = batch.seq_lens.clone()
    sl[0] = 0  # q_len 1 > seq_len 0
    out = testing.poisoned_like(batch.query)
    decode_attention(batch.query, batch.cache, batch.block_table, sl, batch.query_start_loc, out=out, num_splits=2)
    _expect(batch, out, ref, bad=[0], tol=0.015)
    assert "query range" in _raises_naming(0)
    # the last sequence's bound moved past the end of the query (its tokens are rows 4..7)
    qsl = batch.query_start_loc.clone()
    qsl[-1] = qsl[-2] + 6  # q_len 6 (<= 8, a decode sequence) running past num_tokens = 8
    out = testing.poisoned_like(batch.query)
    decode_attention(batch.query, batch.cache, batch.block_table, batch.seq_lens, qsl, out=out, num_splits=2)
    _expect(batch, out, ref, bad=[3], tol=0.015)
    _raises_naming(3)


@pytest.mark.parametrize("swap", [pytest.param(False, id="row-major"), pytest.param(True, id="swapped")])
def test_metadata_changed_after_planning(device, monkeypatch, swap):
    """A plan checks its metadata once; contents changed in place afterwards reach the
    kernels unchecked -- a block id, a length past the table -- and must be contained."""
    batch = _batch(device, seed=11)
    ref = _reference(batch)
    if swap:
        _swap(monkeypatch, DecodeConfig(block_n=64, num_warps=4, num_stages=3, swap_ab=True))
    monkeypatch.setenv("INT8ATTN_CHECK_VALUES", "1")  # planning checks the (still good) values
    plan = plan_attention(batch.cache, batch.block_table, batch.seq_lens, batch.query_start_loc, 8, num_splits=3)
    monkeypatch.setenv("INT8ATTN_CHECK_VALUES", "0")
    out = testing.poisoned_like(batch.query)
    plan.run(batch.query, batch.cache, batch.block_table, batch.seq_lens, batch.query_start_loc, out=out)
    _expect(batch, out, ref, bad=[], tol=0.015)
    check_errors()  # nothing raised by a good run

    good_lens, good_table = batch.seq_lens.clone(), batch.block_table.clone()
    batch.seq_lens[0] = 1 << 20           # far past the table
    batch.block_table[3, 1] = 1 << 30     # a block id past the cache
    out = testing.poisoned_like(batch.query)
    plan.run(batch.query, batch.cache, batch.block_table, batch.seq_lens, batch.query_start_loc, out=out)
    _expect(batch, out, ref, bad=[0, 3], tol=0.015)
    msg = _raises_naming(0)
    assert "seq_len" in msg and "block id" in msg
    batch.seq_lens.copy_(good_lens)
    batch.block_table.copy_(good_table)
    out = testing.poisoned_like(batch.query)
    plan.run(batch.query, batch.cache, batch.block_table, batch.seq_lens, batch.query_start_loc, out=out)
    _expect(batch, out, ref, bad=[], tol=0.015)  # the workspace counters were left clean
    check_errors()


def test_plan_attention_reports_earlier_flags(device, monkeypatch):
    """plan_attention reads the device back anyway: it raises what earlier kernels flagged."""
    batch = _batch(device, seed=2)
    bt = batch.block_table.clone()
    bt[1, 0] = -1
    decode_attention(batch.query, batch.cache, bt, batch.seq_lens, batch.query_start_loc, num_splits=1)
    monkeypatch.delenv("INT8ATTN_CHECK_VALUES")  # the default: planning checks on every device
    with pytest.raises(DeviceMetadataError, match="index 1"):
        plan_attention(batch.cache, batch.block_table, batch.seq_lens, batch.query_start_loc, 8)
    check_errors()
