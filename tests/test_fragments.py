"""CPU model of INT8 MMA register fragments (int8attn.gate.fragments)."""

import math

import pytest
import torch

from int8attn.gate import fragments as F
from int8attn.reference import quantize_rows
from int8attn.testing import make_keys, make_normal

LAYOUTS = [pytest.param(layout, id=layout.name)
           for layout in (F.NVIDIA_MMA_M16N8K32_S8, F.GFX936_MMAC_I32_16X16X32_I8)]


def _rand_int8(shape, gen):
    # Include the extremes: -128 never comes out of symmetric quantization but the
    # instruction must still multiply it exactly.
    return torch.randint(-128, 128, shape, generator=gen, dtype=torch.int64).to(torch.int8)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_operand_map_covers_its_matrix_once(layout):
    F.check_layout(layout)


def test_check_layout_catches_a_broken_map():
    broken = F.FragmentLayout(**{**F.NVIDIA_MMA_M16N8K32_S8.__dict__, "c_coord": lambda lane, i: (lane % 16, 0)})
    with pytest.raises(AssertionError):
        F.check_layout(broken)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_rebuilding_the_tile_from_lane_fragments_equals_the_product(layout):
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        a = _rand_int8((layout.m, layout.k), gen)
        b = _rand_int8((layout.k, layout.n), gen)
        c = torch.randint(-1000, 1000, (layout.m, layout.n), generator=gen)
        d = F.mma(layout, F.pack_a(layout, a), F.pack_b(layout, b), F.pack_c(layout, c))
        want = a.long() @ b.long() + c
        assert torch.equal(F.unpack_c(layout, d), want)
        # and every lane holds exactly the elements its map names
        table = F.lane_token_map(layout)
        assert torch.equal(d, want[table[..., 0], table[..., 1]])


def test_nvidia_accumulator_map_matches_the_ptx_isa():
    layout = F.NVIDIA_MMA_M16N8K32_S8
    # lane 5: groupID 1, threadID_in_group 1 -> c0,c1 at row 1 cols 2,3; c2,c3 at row 9
    assert F.lane_token_map(layout)[5].tolist() == [[1, 2], [1, 3], [9, 2], [9, 3]]
    # A: a0..a3 row g, cols 4*tig..; a4..a7 row g+8; a8..a11 row g, cols +16; a12..a15 row g+8, +16
    assert [F._nv_a(5, i) for i in (0, 3, 4, 8, 15)] == [(1, 4), (1, 7), (9, 4), (1, 20), (9, 23)]
    assert [F._nv_b(5, i) for i in (0, 3, 4, 7)] == [(4, 1), (7, 1), (20, 1), (23, 1)]


def test_gfx936_lane_holds_interleaved_columns():
    layout = F.GFX936_MMAC_I32_16X16X32_I8
    table = F.lane_token_map(layout)
    # lane 17: row 1, c = 1 -> tokens 1, 5, 9, 13 (not 4..7)
    assert table[17].tolist() == [[1, 1], [1, 5], [1, 9], [1, 13]]
    assert table[63].tolist() == [[15, 3], [15, 7], [15, 11], [15, 15]]
    naive = F.lane_token_map(layout, F.naive_c_coord(layout))
    assert naive[17].tolist() == [[4, 4], [4, 5], [4, 6], [4, 7]]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_tail_mask_uses_the_true_token_of_each_register(layout):
    valid = layout.n - 3  # the last three key tokens of the tile are past seq_len
    table = F.lane_token_map(layout)
    masked = (table[..., 1] >= valid)
    # exactly 3 columns x m rows of registers are masked, spread over many lanes
    assert int(masked.sum()) == 3 * layout.m
    lanes_touched = int(masked.any(dim=1).sum())
    naive_masked = F.lane_token_map(layout, F.naive_c_coord(layout))[..., 1] >= valid
    assert int(naive_masked.sum()) == 3 * layout.m
    assert not torch.equal(masked, naive_masked), "the naive reading masks other registers"
    assert lanes_touched >= layout.m


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("head_dim", [pytest.param(64, id="d64"), pytest.param(256, id="d256")])
def test_qk_tile_with_per_token_scales_and_tail_matches_float64(layout, head_dim):
    gen = torch.Generator().manual_seed(head_dim + layout.n)
    q = make_normal((layout.m, head_dim), generator=gen, dtype=torch.float32)
    k = make_keys(layout.n, 1, head_dim, generator=gen, dtype=torch.float32)[:, 0]
    qq, qs = quantize_rows(q, "int8")
    kq, ks = quantize_rows(k, "int8")
    scale = head_dim ** -0.5
    valid = 2 * layout.n - 3  # the tile holds tokens n..2n-1; the last 3 are masked
    got = F.qk_tile_scores(layout, qq, kq, qs, ks, scale, valid, token_offset=layout.n)
    want = F.qk_tile_reference(qq, kq, qs, ks, scale, valid, token_offset=layout.n)
    finite = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), finite)
    assert int((~finite).sum()) == 3 * layout.m
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_naive_consecutive_reading_gives_wrong_scores(layout):
    gen = torch.Generator().manual_seed(7)
    head_dim = 128
    q = make_normal((layout.m, head_dim), generator=gen, dtype=torch.float32)
    # per-token scales that differ a lot, as outlier keys make them
    k = make_keys(layout.n, 1, head_dim, generator=gen, dtype=torch.float32)[:, 0]
    k = k * torch.linspace(0.2, 3.0, layout.n)[:, None]
    qq, qs = quantize_rows(q, "int8")
    kq, ks = quantize_rows(k, "int8")
    valid = layout.n - 2
    want = F.qk_tile_reference(qq, kq, qs, ks, 1.0, valid)
    bad = F.qk_tile_scores(layout, qq, kq, qs, ks, 1.0, valid, c_coord=F.naive_c_coord(layout))
    finite_want, finite_bad = torch.isfinite(want), torch.isfinite(bad)
    assert not torch.equal(finite_want, finite_bad), "naive reading masks the wrong tokens"
    both = finite_want & finite_bad
    rel = (bad[both] - want[both]).norm() / want[both].norm()
    assert rel > 0.05, f"naive reading should be visibly wrong, rel err {rel}"


def test_int32_accumulator_cannot_overflow_at_head_dim_256():
    bound = F.max_abs_int8_dot(256)
    assert bound == 4_129_024
    assert F.INT32_MAX // bound >= 500
    layout = F.GFX936_MMAC_I32_16X16X32_I8
    worst = torch.full((layout.m, 256), 127, dtype=torch.int8)
    got = F.qk_tile_scores(layout, worst, worst[: layout.n], torch.ones(layout.m), torch.ones(layout.n), 1.0,
                           valid_tokens=layout.n)
    assert torch.all(got == bound)


def test_mma_reports_int32_overflow():
    layout = F.NVIDIA_MMA_M16N8K32_S8
    a = torch.full((layout.m, layout.k), 127, dtype=torch.int8)
    b = torch.full((layout.k, layout.n), 127, dtype=torch.int8)
    c = torch.full((layout.m, layout.n), F.INT32_MAX - 10, dtype=torch.int64)
    with pytest.raises(OverflowError):
        F.mma(layout, F.pack_a(layout, a), F.pack_b(layout, b), F.pack_c(layout, c))


def test_shape_errors_are_clear():
    layout = F.NVIDIA_MMA_M16N8K32_S8
    with pytest.raises(ValueError, match="operand a"):
        F.pack_a(layout, torch.zeros(8, 32, dtype=torch.int8))
    with pytest.raises(ValueError, match="multiple"):
        F.qk_tile_scores(layout, torch.zeros(16, 40, dtype=torch.int8), torch.zeros(8, 40, dtype=torch.int8),
                         torch.ones(16), torch.ones(8), 1.0, 8)
    assert math.isfinite(float(F.max_abs_int8_dot(64)))
