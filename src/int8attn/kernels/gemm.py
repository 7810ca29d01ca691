"""GEMM kernels for the gate's experiment E1 (the second article's negative result).

* ``_quantize_rows_kernel`` -- per-row symmetric quantization of a [rows, cols] matrix to
  int8 or fp8 e4m3 with the cache write's arithmetic (``kernels/quantize.py``), bit for bit
  :func:`int8attn.reference.quantize_rows`, for rows of any length. Used for per-call
  activation quantization and for the query in E3.
* ``_gemm_int8_kernel`` -- ``C = (A_q * sA[:, None]) @ (B_q * sB[None, :])``: int8 operands
  quantized beforehand, one int32 accumulator over the whole K, scales applied once in the
  epilogue, bf16 output.
* ``_gemm_dynamic_int8_kernel`` -- the article's dynamic route: BF16 A and B are quantized
  *inside the call*, per tile: every K-step quantizes its ``A[BM, BK]`` tile per row and its
  ``B[BK, BN]`` tile per column, runs the int8 dot, and folds the two scale vectors into a
  float32 accumulator. Each weight tile is quantized again by every M-tile program of every
  call: that is the cost the gate measures.

Layouts: A [M, K], B given as [K, N] through strides (a [N, K] nn.Linear weight passes its
transpose), C [M, N] bf16. Int8 wgmma wants both operands K-major in shared memory, so A
with unit K stride and B with unit K stride (the [N, K] weight) are the fast layouts.
"""

import triton
import triton.language as tl

from .quantize import _quantize_with_inv, _row_inv, _row_scale


@triton.jit
def _round_half_away(x):
    return tl.where(x >= 0, tl.floor(x + 0.5), -tl.floor(0.5 - x))


@triton.jit
def _quantize_rows_kernel(
    x_ptr, q_ptr, scale_ptr,
    n_rows, n_cols, stride_x_row, stride_q_row,
    KIND: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, INTERPRET: tl.constexpr,
):
    """BLOCK_R rows per program: pass 1 finds each row's amax, pass 2 (from L2) quantizes
    with the cache write's own per-row arithmetic (kernels/quantize.py), bit for bit."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_x_row
    q_rows = q_ptr + rows[:, None].to(tl.int64) * stride_q_row
    amax = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    for c0 in range(0, n_cols, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        mask = row_ok[:, None] & (cols[None, :] < n_cols)
        x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    row_max = tl.max(amax, axis=1)
    inv = _row_inv(row_max, KIND)
    for c0 in range(0, n_cols, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        mask = row_ok[:, None] & (cols[None, :] < n_cols)
        x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(q_rows + cols[None, :], _quantize_with_inv(x, inv, KIND, INTERPRET), mask=mask)
    tl.store(scale_ptr + rows, _row_scale(row_max, KIND), mask=row_ok)


@triton.jit
def _tile_ids(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Grouped tile order: GROUP_M consecutive M-tiles share each B tile while it is in L2."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    group = pid // per_group
    first_m = group * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    return pid_m, pid_n


@triton.jit
def _gemm_int8_kernel(
    a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, c_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rm[:, None].to(tl.int64) * stride_am + rk[None, :] * stride_ak
    b_ptrs = b_ptr + rk[:, None] * stride_bk + rn[None, :].to(tl.int64) * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + rk) < K
        a = tl.load(a_ptrs, mask=(rm[:, None] < M) & k_ok[None, :], other=0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & (rn[None, :] < N), other=0)
        # ``acc += dot`` rather than ``tl.dot(a, b, acc)``: Triton < 3.9 rejects an int32
        # accumulator argument (its out_dtype defaults to fp32); the add folds into the MMA.
        acc += tl.dot(a, b)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    sa = tl.load(a_scale_ptr + rm, mask=rm < M, other=0.0)
    sb = tl.load(b_scale_ptr + rn, mask=rn < N, other=0.0)
    c = acc.to(tl.float32) * sa[:, None] * sb[None, :]
    c_ptrs = c_ptr + rm[:, None].to(tl.int64) * stride_cm + rn[None, :] * stride_cn
    tl.store(c_ptrs, c.to(tl.bfloat16), mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _gemm_dynamic_int8_kernel(
    a_ptr, b_ptr, c_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rm[:, None].to(tl.int64) * stride_am + rk[None, :] * stride_ak
    b_ptrs = b_ptr + rk[:, None] * stride_bk + rn[None, :].to(tl.int64) * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + rk) < K
        a = tl.load(a_ptrs, mask=(rm[:, None] < M) & k_ok[None, :], other=0.0).to(tl.float32)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & (rn[None, :] < N), other=0.0).to(tl.float32)
        # Per-tile scales: A per row over this K-slice, B per column over this K-slice.
        a_max = tl.max(tl.abs(a), axis=1)
        b_max = tl.max(tl.abs(b), axis=0)
        sa = tl.where(a_max > 0, a_max / 127.0, 1.0)
        sb = tl.where(b_max > 0, b_max / 127.0, 1.0)
        aq = _round_half_away(a / sa[:, None]).to(tl.int8)
        bq = _round_half_away(b / sb[None, :]).to(tl.int8)
        part = tl.dot(aq, bq)
        # The scales change every K-step, so the int32 partial cannot keep accumulating.
        acc += part.to(tl.float32) * sa[:, None] * sb[None, :]
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    c_ptrs = c_ptr + rm[:, None].to(tl.int64) * stride_cm + rn[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(tl.bfloat16), mask=(rm[:, None] < M) & (rn[None, :] < N))
