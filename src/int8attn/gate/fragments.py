"""CPU model of INT8 matrix-instruction register fragments.

A hand-written INT8 attention kernel holds its ``Q_int8 . K_int8^T`` tile not as a matrix
but as per-lane registers. Restoring scores (``acc * sQ[row] * sK[key token]``) and masking
the tail (``key token >= seq_len``) must use the coordinates each register *really* holds,
which for matrix instructions are interleaved. This module models two instructions exactly
enough to check that mapping on the CPU:

* ``NVIDIA_MMA_M16N8K32_S8`` -- ``mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32``, the
  warp-level INT8 MMA (32 lanes), with the A/B/C fragment layouts of the PTX ISA
  ("Matrix Fragments for mma.m16n8k32", .s8 operands, .s32 accumulators)::

      groupID = lane >> 2, tig = lane % 4
      A[16x32]  a_i (i < 16): row = groupID (+8 for 4 <= i < 8 and i >= 12)
                              col = 4*tig + (i & 3) (+16 for i >= 8)
      B[32x8]   b_i (i < 8):  row = 4*tig + (i & 3) (+16 for i >= 4), col = groupID
      C[16x8]   c_i (i < 4):  row = groupID (+8 for i >= 2), col = 2*tig + (i & 1)

* ``GFX936_MMAC_I32_16X16X32_I8`` -- ``v_mmac_i32_16x16x32_i8`` on a 64-lane wave, as
  docs/design.md §2 describes it. ASSUMPTION (no ISA document is available to us): the
  output fragment is read as ``row = lane % 16``, ``c = lane // 16``, a lane's four values
  being columns ``c, c+4, c+8, c+12`` (the only consistent reading of the article's
  description of a 16x16 tile over 64 lanes x 4 values); inputs are modelled as
  A: lane holds row ``lane % 16``, k ``8*(lane // 16) .. +7``; B: lane holds column
  ``lane % 16``, k ``8*(lane // 16) .. +7``. Only the output map matters for scales and
  masks; the input maps only have to cover the operands once each.

In attention terms the MMA's rows are query rows (or query heads of a GQA group) and its
columns are key tokens; :func:`lane_token_map` gives, per lane and register, the
``(row, key token)`` a kernel must use for the per-token K scale and the tail mask, and
:func:`naive_c_coord` the tempting "a lane's values are consecutive columns" reading,
which silently scales and masks the wrong tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

Coord = tuple[int, int]


@dataclass(frozen=True)
class FragmentLayout:
    """Register fragment layout of one matrix instruction ``D[m x n] = A[m x k] B[k x n] + C``.

    ``a_coord(lane, i) -> (row, k)``, ``b_coord(lane, i) -> (k, col)``,
    ``c_coord(lane, i) -> (row, col)`` give the matrix element held by register value ``i``
    of ``lane``.
    """

    name: str
    instruction: str
    m: int
    n: int
    k: int
    lanes: int
    a_per_lane: int
    b_per_lane: int
    c_per_lane: int
    a_coord: Callable[[int, int], Coord]
    b_coord: Callable[[int, int], Coord]
    c_coord: Callable[[int, int], Coord]
    source: str

    def coords(self, operand: str) -> torch.Tensor:
        """[lanes, values_per_lane, 2] int64 table of (row, col) for operand "a", "b" or "c"."""
        fn, per = {
            "a": (self.a_coord, self.a_per_lane),
            "b": (self.b_coord, self.b_per_lane),
            "c": (self.c_coord, self.c_per_lane),
        }[operand]
        return torch.tensor([[fn(lane, i) for i in range(per)] for lane in range(self.lanes)], dtype=torch.int64)

    def operand_shape(self, operand: str) -> tuple[int, int]:
        return {"a": (self.m, self.k), "b": (self.k, self.n), "c": (self.m, self.n)}[operand]


# --------------------------------------------------------------------------- NVIDIA m16n8k32 s8
def _nv_a(lane: int, i: int) -> Coord:
    group, tig = lane >> 2, lane % 4
    row = group if (i < 4 or 8 <= i < 12) else group + 8
    col = tig * 4 + (i & 3) + (16 if i >= 8 else 0)
    return row, col


def _nv_b(lane: int, i: int) -> Coord:
    group, tig = lane >> 2, lane % 4
    row = tig * 4 + (i & 3) + (16 if i >= 4 else 0)
    return row, group


def _nv_c(lane: int, i: int) -> Coord:
    group, tig = lane >> 2, lane % 4
    row = group if i < 2 else group + 8
    return row, tig * 2 + (i & 1)


NVIDIA_MMA_M16N8K32_S8 = FragmentLayout(
    name="nvidia_mma_m16n8k32_s8",
    instruction="mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32",
    m=16, n=8, k=32, lanes=32, a_per_lane=16, b_per_lane=8, c_per_lane=4,
    a_coord=_nv_a, b_coord=_nv_b, c_coord=_nv_c,
    source="PTX ISA, 'Matrix Fragments for mma.m16n8k32' (.s8 A/B, .s32 C/D)",
)


# --------------------------------------------------------------------------- gfx936 16x16x32 i8
def _amd_a(lane: int, i: int) -> Coord:
    return lane % 16, 8 * (lane // 16) + i


def _amd_b(lane: int, i: int) -> Coord:
    return 8 * (lane // 16) + i, lane % 16


def _amd_c(lane: int, i: int) -> Coord:
    return lane % 16, lane // 16 + 4 * i


GFX936_MMAC_I32_16X16X32_I8 = FragmentLayout(
    name="gfx936_mmac_i32_16x16x32_i8",
    instruction="v_mmac_i32_16x16x32_i8 (wave64)",
    m=16, n=16, k=32, lanes=64, a_per_lane=8, b_per_lane=8, c_per_lane=4,
    a_coord=_amd_a, b_coord=_amd_b, c_coord=_amd_c,
    source=("docs/design.md §2 (assumed reading: row = lane % 16, c = lane // 16, "
            "values at columns c, c+4, c+8, c+12; input maps modelled, not documented)"),
)

LAYOUTS = {layout.name: layout for layout in (NVIDIA_MMA_M16N8K32_S8, GFX936_MMAC_I32_16X16X32_I8)}

INT32_MAX = 2**31 - 1


def naive_c_coord(layout: FragmentLayout) -> Callable[[int, int], Coord]:
    """The wrong "consecutive columns" reading of the accumulator: register ``i`` of
    ``lane`` taken as element ``lane * c_per_lane + i`` of the tile in row-major order
    (for gfx936: row ``lane // 4``, columns ``4 * (lane % 4) + i``). It covers the tile
    exactly once, so nothing crashes -- it just scales and masks the wrong key tokens."""

    def coord(lane: int, i: int) -> Coord:
        flat = lane * layout.c_per_lane + i
        return flat // layout.n, flat % layout.n

    return coord


# --------------------------------------------------------------------------- packing
def check_layout(layout: FragmentLayout) -> None:
    """Raise AssertionError unless each operand map covers its matrix exactly once."""
    for operand in "abc":
        rows, cols = layout.operand_shape(operand)
        table = layout.coords(operand).reshape(-1, 2)
        if table.shape[0] != rows * cols:
            raise AssertionError(f"{layout.name}.{operand}: {table.shape[0]} values for a {rows}x{cols} matrix")
        if (table[:, 0] >= rows).any() or (table[:, 1] >= cols).any() or (table < 0).any():
            raise AssertionError(f"{layout.name}.{operand}: coordinate out of the {rows}x{cols} matrix")
        flat = table[:, 0] * cols + table[:, 1]
        if torch.unique(flat).numel() != rows * cols:
            raise AssertionError(f"{layout.name}.{operand}: some elements are held twice, others never")


def _pack(layout: FragmentLayout, operand: str, matrix: torch.Tensor) -> torch.Tensor:
    shape = layout.operand_shape(operand)
    if tuple(matrix.shape) != shape:
        raise ValueError(f"{layout.name}: operand {operand} must be {shape}, got {tuple(matrix.shape)}")
    table = layout.coords(operand)
    return matrix[table[..., 0], table[..., 1]]


def pack_a(layout: FragmentLayout, a: torch.Tensor) -> torch.Tensor:
    """[m, k] -> per-lane fragments [lanes, a_per_lane]."""
    return _pack(layout, "a", a)


def pack_b(layout: FragmentLayout, b: torch.Tensor) -> torch.Tensor:
    """[k, n] -> per-lane fragments [lanes, b_per_lane]."""
    return _pack(layout, "b", b)


def pack_c(layout: FragmentLayout, c: torch.Tensor) -> torch.Tensor:
    """[m, n] -> per-lane fragments [lanes, c_per_lane]."""
    return _pack(layout, "c", c)


def unpack_c(layout: FragmentLayout, frags: torch.Tensor, c_coord: Callable[[int, int], Coord] | None = None,
             fill=0) -> torch.Tensor:
    """Per-lane accumulator fragments [lanes, c_per_lane] -> the [m, n] tile, each register
    written where ``c_coord`` (default: the layout's true map) says it belongs."""
    if tuple(frags.shape) != (layout.lanes, layout.c_per_lane):
        raise ValueError(f"{layout.name}: C fragments must be {(layout.lanes, layout.c_per_lane)}, got {tuple(frags.shape)}")
    coord = c_coord or layout.c_coord
    tile = torch.full((layout.m, layout.n), fill, dtype=frags.dtype)
    for lane in range(layout.lanes):
        for i in range(layout.c_per_lane):
            r, c = coord(lane, i)
            tile[r, c] = frags[lane, i]
    return tile


def _unpack_operand(layout: FragmentLayout, operand: str, frags: torch.Tensor) -> torch.Tensor:
    rows, cols = layout.operand_shape(operand)
    table = layout.coords(operand)
    out = torch.zeros((rows, cols), dtype=frags.dtype)
    out[table[..., 0], table[..., 1]] = frags
    return out


def mma(layout: FragmentLayout, a_frags: torch.Tensor, b_frags: torch.Tensor,
        c_frags: torch.Tensor | None = None) -> torch.Tensor:
    """One instruction: per-lane D fragments from per-lane A, B (int8 values) and C (int32).

    The hardware exchanges operands between lanes; the model does the same by rebuilding
    A and B from all lanes' registers, multiplying exactly (int64), and handing each lane
    the elements its C/D registers map to. Raises OverflowError if a result leaves int32
    (the .s32 accumulator would wrap).
    """
    a = _unpack_operand(layout, "a", a_frags.to(torch.int64))
    b = _unpack_operand(layout, "b", b_frags.to(torch.int64))
    d = a @ b
    if c_frags is not None:
        d = d + _unpack_operand(layout, "c", c_frags.to(torch.int64))
    if d.abs().max().item() > INT32_MAX:
        raise OverflowError(f"{layout.name}: accumulator leaves int32")
    return pack_c(layout, d)


# --------------------------------------------------------------------------- attention view
def lane_token_map(layout: FragmentLayout, c_coord: Callable[[int, int], Coord] | None = None) -> torch.Tensor:
    """[lanes, c_per_lane, 2]: the (query row, key token within the tile) each accumulator
    register holds -- the indices a kernel must use for ``sQ[row]``, ``sK[token]`` and the
    ``token < seq_len`` mask."""
    coord = c_coord or layout.c_coord
    return torch.tensor([[coord(lane, i) for i in range(layout.c_per_lane)] for lane in range(layout.lanes)],
                        dtype=torch.int64)


def max_abs_int8_dot(head_dim: int) -> int:
    """Largest |q . k| of two int8 vectors quantized symmetrically to [-127, 127]."""
    return head_dim * 127 * 127


def qk_tile_scores(
    layout: FragmentLayout,
    q_int8: torch.Tensor,
    k_int8: torch.Tensor,
    q_scale: torch.Tensor,
    k_scale: torch.Tensor,
    softmax_scale: float,
    valid_tokens: int,
    token_offset: int = 0,
    c_coord: Callable[[int, int], Coord] | None = None,
) -> torch.Tensor:
    """What a hand-written kernel computes for one ``m x n`` score tile, register by register.

    q_int8: [m, head_dim] int8 query rows; k_int8: [n, head_dim] int8 key tokens
    ``token_offset .. token_offset + n - 1``; q_scale: [m]; k_scale: [n] (per key token).
    ``head_dim`` is consumed in K-steps of ``layout.k`` (256 -> 8 steps of 32), each one
    instruction accumulating into the int32 registers. Every register is then restored as
    ``acc * q_scale[row] * k_scale[token] * softmax_scale`` and set to -inf when
    ``token_offset + token >= valid_tokens``, where (row, token) come from ``c_coord``
    (default: the true layout; pass :func:`naive_c_coord` to see the bug). The registers
    are finally laid out by the *true* map, as a store through the real layout would.
    Returns [m, n] float64.
    """
    m, n, kstep = layout.m, layout.n, layout.k
    head_dim = q_int8.shape[1]
    if q_int8.shape != (m, head_dim) or k_int8.shape != (n, head_dim):
        raise ValueError(f"expected q [{m}, D] and k [{n}, D], got {tuple(q_int8.shape)} and {tuple(k_int8.shape)}")
    if head_dim % kstep:
        raise ValueError(f"head_dim {head_dim} is not a multiple of the instruction's k={kstep}")
    acc = torch.zeros((layout.lanes, layout.c_per_lane), dtype=torch.int64)
    for k0 in range(0, head_dim, kstep):
        a = pack_a(layout, q_int8[:, k0:k0 + kstep])
        b = pack_b(layout, k_int8[:, k0:k0 + kstep].t())
        acc = mma(layout, a, b, acc)
    coord = c_coord or layout.c_coord
    regs = torch.empty(acc.shape, dtype=torch.float64)
    for lane in range(layout.lanes):
        for i in range(layout.c_per_lane):
            row, token = coord(lane, i)
            value = float(acc[lane, i]) * float(q_scale[row]) * float(k_scale[token]) * softmax_scale
            regs[lane, i] = -math.inf if token_offset + token >= valid_tokens else value
    return unpack_c(layout, regs)


def qk_tile_reference(q_int8, k_int8, q_scale, k_scale, softmax_scale: float, valid_tokens: int,
                      token_offset: int = 0) -> torch.Tensor:
    """float64 ``(q*sQ) . (k*sK)^T * softmax_scale`` with tokens ``>= valid_tokens`` at -inf."""
    q = q_int8.to(torch.float64) * q_scale.to(torch.float64)[:, None]
    k = k_int8.to(torch.float64) * k_scale.to(torch.float64)[:, None]
    scores = (q @ k.t()) * softmax_scale
    tokens = token_offset + torch.arange(k.shape[0])
    return scores.masked_fill(tokens[None, :] >= valid_tokens, -math.inf)
