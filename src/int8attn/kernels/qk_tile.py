"""QK-only kernels for the gate's experiment E3 (the first article's route table).

Three routes over the same long score tiles, one kernel each so that a profiler trace
names the route that ran:

* ``_qk_bf16_kernel``          -- BF16 Q . BF16 K^T (fp32 accumulate), the baseline;
* ``_qk_int8_to_bf16_kernel``  -- INT8 K is loaded, dequantized in registers
  (``k * sK`` -> bf16) and fed to the BF16 dot with a BF16 Q: half the K bytes, plus a
  conversion of every K element in every program;
* ``_qk_int8_native_kernel``   -- INT8 Q . INT8 K^T on the int8 tensor cores (int32
  accumulate), restored in registers as ``acc * sQ[row] * sK[token] * softmax_scale``.

Layouts: Q [num_q_heads, M, D] (bf16 or int8), q_scale [num_q_heads, M] fp32;
K [num_kv_heads, T, D] (bf16 or int8), k_scale [num_kv_heads, T] fp32; query head ``h``
reads KV head ``h // (num_q_heads / num_kv_heads)``. One program owns BLOCK_M query rows of
one query head and streams all T key tokens in BLOCK_N tiles.

Outputs: row_max [num_q_heads, M] fp32, the running max of each row's scores (the first
thing softmax needs; small, so the timed kernel is the QK product, not a score write); and,
when ``store_scores`` is non-zero, the full scores [num_q_heads, M, T] fp32 for accuracy
checks (a runtime flag, so the checked and the timed kernel are one binary).
"""

import triton
import triton.language as tl

from .codes import ROUTE_BF16, ROUTE_INT8_NATIVE, ROUTE_INT8_TO_BF16


@triton.jit
def _qk_body(
    q_ptr, q_scale_ptr, k_ptr, k_scale_ptr, row_max_ptr, scores_ptr,
    M, T, group, softmax_scale, store_scores,
    stride_qh, stride_qm, stride_kh, stride_kt, stride_sqh, stride_skh, stride_mh, stride_sh, stride_sm,
    ROUTE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    pid_m = tl.program_id(0)
    q_head = tl.program_id(1)
    kv_head = q_head // group
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    row_ok = rows < M
    q_ptrs = q_ptr + q_head.to(tl.int64) * stride_qh + rows[:, None].to(tl.int64) * stride_qm + dims[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None], other=0)
    if ROUTE == ROUTE_INT8_NATIVE:
        row_scale = tl.load(q_scale_ptr + q_head * stride_sqh + rows, mask=row_ok, other=0.0) * softmax_scale
    if INTERPRET:
        if ROUTE != ROUTE_INT8_NATIVE:
            q = q.to(tl.float32)  # the interpreter's bf16 x bf16 dot is wrong
    k_base = k_ptr + kv_head.to(tl.int64) * stride_kh
    ks_base = k_scale_ptr + kv_head * stride_skh
    running_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    for t0 in range(0, T, BLOCK_N):
        tokens = t0 + tl.arange(0, BLOCK_N)
        tok_ok = tokens < T
        k = tl.load(k_base + tokens[:, None].to(tl.int64) * stride_kt + dims[None, :], mask=tok_ok[:, None], other=0)
        if ROUTE == ROUTE_BF16:
            if INTERPRET:
                k = k.to(tl.float32)
            s = tl.dot(q, tl.trans(k)) * softmax_scale
        elif ROUTE == ROUTE_INT8_TO_BF16:
            k_scale = tl.load(ks_base + tokens, mask=tok_ok, other=0.0)
            k_deq = (k.to(tl.float32) * k_scale[:, None]).to(tl.bfloat16)
            if INTERPRET:
                k_deq = k_deq.to(tl.float32)
            s = tl.dot(q, tl.trans(k_deq)) * softmax_scale
        else:
            k_scale = tl.load(ks_base + tokens, mask=tok_ok, other=0.0)
            acc = tl.dot(q, tl.trans(k))
            s = acc.to(tl.float32) * row_scale[:, None] * k_scale[None, :]
        s = tl.where(tok_ok[None, :], s, float("-inf"))
        running_max = tl.maximum(running_max, tl.max(s, axis=1))
        if store_scores != 0:
            s_ptrs = (scores_ptr + q_head.to(tl.int64) * stride_sh + rows[:, None].to(tl.int64) * stride_sm
                      + tokens[None, :])
            tl.store(s_ptrs, s, mask=row_ok[:, None] & tok_ok[None, :])
    tl.store(row_max_ptr + q_head * stride_mh + rows, running_max, mask=row_ok)


@triton.jit(do_not_specialize=["store_scores"])
def _qk_bf16_kernel(
    q_ptr, q_scale_ptr, k_ptr, k_scale_ptr, row_max_ptr, scores_ptr,
    M, T, group, softmax_scale, store_scores,
    stride_qh, stride_qm, stride_kh, stride_kt, stride_sqh, stride_skh, stride_mh, stride_sh, stride_sm,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr,
):
    _qk_body(q_ptr, q_scale_ptr, k_ptr, k_scale_ptr, row_max_ptr, scores_ptr,
             M, T, group, softmax_scale, store_scores,
             stride_qh, stride_qm, stride_kh, stride_kt, stride_sqh, stride_skh, stride_mh, stride_sh, stride_sm,
             ROUTE_BF16, HEAD_DIM, BLOCK_M, BLOCK_N, INTERPRET)


@triton.jit(do_not_specialize=["store_scores"])
def _qk_int8_to_bf16_kernel(
    q_ptr, q_scale_ptr, k_ptr, k_scale_ptr, row_max_ptr, scores_ptr,
    M, T, group, softmax_scale, store_scores,
    stride_qh, stride_qm, stride_kh, stride_kt, stride_sqh, stride_skh, stride_mh, stride_sh, stride_sm,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr,
):
    _qk_body(q_ptr, q_scale_ptr, k_ptr, k_scale_ptr, row_max_ptr, scores_ptr,
             M, T, group, softmax_scale, store_scores,
             stride_qh, stride_qm, stride_kh, stride_kt, stride_sqh, stride_skh, stride_mh, stride_sh, stride_sm,
             ROUTE_INT8_TO_BF16, HEAD_DIM, BLOCK_M, BLOCK_N, INTERPRET)


@triton.jit(do_not_specialize=["store_scores"])
def _qk_int8_native_kernel(
    q_ptr, q_scale_ptr, k_ptr, k_scale_ptr, row_max_ptr, scores_ptr,
    M, T, group, softmax_scale, store_scores,
    stride_qh, stride_qm, stride_kh, stride_kt, stride_sqh, stride_skh, stride_mh, stride_sh, stride_sm,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr,
):
    _qk_body(q_ptr, q_scale_ptr, k_ptr, k_scale_ptr, row_max_ptr, scores_ptr,
             M, T, group, softmax_scale, store_scores,
             stride_qh, stride_qm, stride_kh, stride_kt, stride_sqh, stride_skh, stride_mh, stride_sh, stride_sm,
             ROUTE_INT8_NATIVE, HEAD_DIM, BLOCK_M, BLOCK_N, INTERPRET)
