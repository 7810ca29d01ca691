"""The Hopper prefill kernel of :mod:`int8attn.kernels.prefill_hopper` with asynchronous
warpgroup MMAs (8-bit PV only): the same function, rows, scales, masking, P quantization
and tensor layouts; only the schedule differs.

Per KV tile ``j`` each warpgroup runs (FlashAttention-3's intra-warpgroup overlap):

1. softmax of the scores ``S_j`` (already in registers) -> the 8-bit P operand, while
   ``PV(j - 1)`` is still running on the tensor cores;
2. wait for ``PV(j - 1)`` and fold it into the accumulator (int8 PV: ``acc * f + o - M``;
   fp8 PV accumulates inside the MMA, scaled by ``f`` as it is issued);
3. wait for tile ``j + 1``'s copies, one CTA barrier, refill the ring stage of tile ``j - 2``
   with tile ``j + STAGES - 2`` (every thread finished ``PV(j - 2)`` before the barrier at
   ``j - 1``; with 3 stages the refill precedes the wait);
4. issue ``QK(j + 1)`` then ``PV(j)``, both asynchronous, and wait only for ``QK(j + 1)``
   (``warpgroup_mma_wait(NUM_DV)``): ``PV(j)`` overlaps the next softmax.

The K and V scales of tile ``j + 1`` are loaded right after the softmax of tile ``j`` (their
latency hides behind steps 2-4), with page-clamped unmasked addresses and 2-key vectors; keys past
the sequence get scale 0 by a select (stale NaN scales never reach arithmetic).

``STAGES >= 3`` (three tiles are live: ``j - 1`` until its PV ends, ``j`` and ``j + 1``; at
3 stages tile ``j + 1``'s copies are issued one step before their wait, so 4 is the
pipelined default). Same constexprs as the synchronous kernel, so one launcher and one
AOT-compile path serve both.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared, warpgroup_mma,
                                                                warpgroup_mma_wait)

from . import _gluon_compat as _gc
from .codes import KIND_FP8, KIND_INT8, PV_BF16, PV_FP8, PV_INT8
from .prefill_hopper import (MAGIC_F, MAGIC_I, MIN_REL_STEP, NEG_BIG, _issue_tile, _kv_range, _load_q_tile,
                             _checked_tile, _start_ring, _store_output, _zero_tail_keys)


@gluon.jit
def _tile_scales(j, bt_row, k_scale_ptr, v_scale_ptr, scale_head, stride_sb, kv_end, last_page,
                 PAGE: gl.constexpr, BLOCK_N: gl.constexpr, COL: gl.constexpr):
    """K and V scales of tile ``j`` in the score columns' layout; 0 past ``kv_end``."""
    offs_n = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=COL)
    blk = gl.load(bt_row + gl.minimum(offs_n // PAGE, last_page)).to(gl.int64)
    # pairs of keys share a page (PAGE >= 16) and sit at even slots: 8-byte loads
    off = gl.max_contiguous(gl.multiple_of(blk * stride_sb + scale_head + offs_n % PAGE, 2), 2)
    in_seq = offs_n < kv_end
    ks = gl.where(in_seq, gl.load(k_scale_ptr + off), 0.0)
    vs = gl.where(in_seq, gl.load(v_scale_ptr + off), 0.0)
    return ks, vs


@gluon.jit
def _issue_pv(p_op, v_buf, acc0, acc1, acc2, acc3, factor, BLOCK_M: gl.constexpr, DV: gl.constexpr,
              NUM_DV: gl.constexpr, PV_KIND: gl.constexpr, PV_LAYOUT: gl.constexpr):
    """Issue the PV MMAs of one tile (asynchronous); int8: fresh ``MAGIC_I`` starts (the
    results are returned), fp8: into ``acc * factor`` (the accumulators are returned)."""
    if PV_KIND == PV_INT8:
        start = gl.full([BLOCK_M, DV], MAGIC_I, gl.int32, PV_LAYOUT)
        o0 = warpgroup_mma(p_op, v_buf.slice(0, DV, dim=0).permute((1, 0)), start, is_async=True)
        o1 = o0
        o2 = o0
        o3 = o0
        if NUM_DV > 1:
            o1 = warpgroup_mma(p_op, v_buf.slice(DV, DV, dim=0).permute((1, 0)), start, is_async=True)
        if NUM_DV > 2:
            o2 = warpgroup_mma(p_op, v_buf.slice(2 * DV, DV, dim=0).permute((1, 0)), start, is_async=True)
            o3 = warpgroup_mma(p_op, v_buf.slice(3 * DV, DV, dim=0).permute((1, 0)), start, is_async=True)
    else:
        f = factor[:, None]
        o0 = warpgroup_mma(p_op, v_buf.slice(0, DV, dim=0).permute((1, 0)), acc0 * f, is_async=True)
        o1 = o0
        o2 = o0
        o3 = o0
        if NUM_DV > 1:
            o1 = warpgroup_mma(p_op, v_buf.slice(DV, DV, dim=0).permute((1, 0)), acc1 * f, is_async=True)
        if NUM_DV > 2:
            o2 = warpgroup_mma(p_op, v_buf.slice(2 * DV, DV, dim=0).permute((1, 0)), acc2 * f, is_async=True)
            o3 = warpgroup_mma(p_op, v_buf.slice(3 * DV, DV, dim=0).permute((1, 0)), acc3 * f, is_async=True)
    return o0, o1, o2, o3


@gluon.jit
def _fold_pv(acc, o, factor, PV_KIND: gl.constexpr):
    """Accumulator after a completed PV MMA: int8 ``acc * factor + (o - M)``, fp8 ``o``."""
    if PV_KIND == PV_INT8:
        return acc * factor[:, None] + (o.to(gl.float32, bitcast=True) - MAGIC_F)
    else:
        return o


@gluon.jit
def _wait_and_fold(o0, o1, o2, o3, acc0, acc1, acc2, acc3, factor, NUM_DV: gl.constexpr, PV_KIND: gl.constexpr):
    """Wait for the PV MMAs in flight and fold their results into the ``NUM_DV`` accumulators
    (see _fold_pv); accumulators past NUM_DV come back as they were."""
    o0, o1, o2, o3 = warpgroup_mma_wait(0, deps=[o0, o1, o2, o3])
    acc0 = _fold_pv(acc0, o0, factor, PV_KIND)
    if NUM_DV > 1:
        acc1 = _fold_pv(acc1, o1, factor, PV_KIND)
    if NUM_DV > 2:
        acc2 = _fold_pv(acc2, o2, factor, PV_KIND)
        acc3 = _fold_pv(acc3, o3, factor, PV_KIND)
    return acc0, acc1, acc2, acc3


@gluon.jit
def _online_softmax(t, m_i, l_i, row_scale, row_limit, start, full_end, BLOCK_N: gl.constexpr, COL: gl.constexpr):
    """One tile of the online softmax over the K-scaled scores ``t`` (each row's ``row_scale``
    still to apply; causal mask only in tiles past ``full_end``): returns (P in fp32, the rows'
    rescale factor alpha, m, l)."""
    if start + BLOCK_N > full_end:
        offs_n = start + gl.arange(0, BLOCK_N, layout=COL)
        t = gl.where(offs_n[None, :] <= row_limit[:, None], t, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(t, 1) * row_scale)
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(t * row_scale[:, None] - m_new[:, None])
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, alpha, m_new, l_i


@gluon.jit
def _qk(q_smem, k_buf, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, KV_KIND: gl.constexpr,
        QK_LAYOUT: gl.constexpr):
    """Issue QK of one tile (asynchronous), from zero (``use_acc=False``: no register start):
    int32 for an int8 cache, fp32 otherwise; :func:`_k_scaled` converts it."""
    if KV_KIND == KIND_INT8:
        start = gl.zeros([BLOCK_M, BLOCK_N], gl.int32, QK_LAYOUT)
    else:
        start = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, QK_LAYOUT)
    return warpgroup_mma(q_smem, k_buf.permute((1, 0)), start, use_acc=False, is_async=True)


@gluon.jit
def _k_scaled(s, k_scale, KV_KIND: gl.constexpr):
    """A QK MMA result (:func:`_qk`) with each key's scale applied (base-2 score = t * the
    row's scale); a BF16 cache's as it is. int8: the int32 dot converted by one I2FP (exact:
    |dot| <= 256 * 127 * 127 < 2**24), which spares the register move per score that a
    ``MAGIC_I`` start costs a warpgroup MMA (benchmarks/notes/prefill_hopper.md)."""
    if KV_KIND == KIND_INT8:
        t = s.to(gl.float32) * k_scale[None, :]
    elif KV_KIND == KIND_FP8:
        t = s * k_scale[None, :]
    else:
        t = s
    return t


@gluon.jit
def _softmax_tile(s, k_scale, v_scale, m_i, l_i, r_i, row_scale, row_limit, start, full_end, levels: gl.constexpr,
                  BLOCK_N: gl.constexpr, KV_KIND: gl.constexpr, PV_KIND: gl.constexpr, COL: gl.constexpr,
                  PV_ROW: gl.constexpr, P_LAYOUT: gl.constexpr):
    """Online softmax of one tile's scores ``s`` (the QK MMA result) to the 8-bit P operand:
    returns (P, the accumulator's rescale factor, m, l, r) -- see prefill_hopper for the rule."""
    t = _k_scaled(s, k_scale, KV_KIND)
    p, alpha, m_i, l_i = _online_softmax(t, m_i, l_i, row_scale, row_limit, start, full_end, BLOCK_N, COL)
    pv = p * v_scale[None, :]
    floor = gl.max(v_scale, 0) * MIN_REL_STEP
    r_new = gl.maximum(gl.max(pv, 1), floor) * (1.0 / levels)
    inv_r = 1.0 / r_new
    factor = gl.convert_layout(alpha * (r_i / r_new), PV_ROW)
    r_i = r_new
    if PV_KIND == PV_FP8:
        # pv * inv_r <= 448 up to rounding; the e4m3 conversion saturates (satfinite)
        p_op = gl.convert_layout((pv * inv_r[:, None]).to(gl.float8e4nv), P_LAYOUT)
    else:
        u = pv * inv_r[:, None] + MAGIC_F
        p_op = gl.convert_layout(u.to(gl.int32, bitcast=True).to(gl.int8), P_LAYOUT)
    return p_op, factor, m_i, l_i, r_i


@gluon.jit
def _prefill_hopper_pipe_kernel(
    q_ptr, q_scale_ptr, out_ptr,
    k_ptr, v_ptr, k_scale_ptr, v_scale_ptr,
    block_table_ptr, seq_lens_ptr, query_start_loc_ptr,
    qk_scale, num_seqs, min_query_len, num_tiles,
    stride_qt, stride_qh, stride_qst, stride_qsh,
    stride_ot, stride_oh,
    stride_cb, stride_ch, stride_sb, stride_sh,
    stride_bt, flags_ptr, num_tokens, num_blocks, max_blocks,
    GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, PAGE: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_Q: gl.constexpr, BLOCK_N: gl.constexpr, DV: gl.constexpr,
    KV_KIND: gl.constexpr, PV_KIND: gl.constexpr, STAGES: gl.constexpr,
    QK_LAYOUT: gl.constexpr, PV_LAYOUT: gl.constexpr, P_LAYOUT: gl.constexpr,
    Q_SMEM: gl.constexpr, K_SMEM: gl.constexpr, V_SMEM: gl.constexpr, V16_SMEM: gl.constexpr,
    LOAD_Q: gl.constexpr, LOAD_K: gl.constexpr, LOAD_V: gl.constexpr,
):
    ROW: gl.constexpr = gl.SliceLayout(1, QK_LAYOUT)
    COL: gl.constexpr = gl.SliceLayout(0, QK_LAYOUT)
    PV_ROW: gl.constexpr = gl.SliceLayout(1, PV_LAYOUT)
    NUM_DV: gl.constexpr = HEAD_DIM // DV
    gl.static_assert(STAGES >= 3, "the pipelined kernel keeps three KV tiles live")
    gl.static_assert(PV_KIND != PV_BF16, "the pipelined kernel runs 8-bit PV only")

    run, kv_head, seq, q_start, q_tile, q_len, seq_len = _checked_tile(
        query_start_loc_ptr, seq_lens_ptr, block_table_ptr, flags_ptr, out_ptr, num_seqs, num_tiles, num_tokens,
        num_blocks, max_blocks, min_query_len, stride_bt, stride_ot, stride_oh, GROUP, BLOCK_M, BLOCK_Q, HEAD_DIM, PAGE)
    if not run:
        return
    ctx = seq_len - q_len
    q_smem, tok, row_scale = _load_q_tile(q_ptr, q_scale_ptr, k_ptr, q_start, q_tile, q_len, kv_head, qk_scale,
                                          stride_qt, stride_qh, stride_qst, stride_qsh,
                                          GROUP, HEAD_DIM, BLOCK_M, BLOCK_Q, KV_KIND, ROW, Q_SMEM, LOAD_Q)
    kv_end, full_end, row_limit, last_page, num_kv_tiles = _kv_range(ctx, q_tile, q_len, tok, BLOCK_Q, BLOCK_N,
                                                                     PAGE)
    bt_row = block_table_ptr + seq.to(gl.int64) * stride_bt
    data_head = kv_head.to(gl.int64) * stride_ch
    scale_head = kv_head.to(gl.int64) * stride_sh
    # tiles 0 .. STAGES - 2 in flight; iteration j refills tile j + STAGES - 2
    k_ring, v_ring = _start_ring(k_ptr, v_ptr, bt_row, data_head, stride_cb, last_page, num_kv_tiles,
                                 HEAD_DIM, PAGE, BLOCK_N, STAGES, K_SMEM, V_SMEM, LOAD_K, LOAD_V)

    m_i = gl.full([BLOCK_M], NEG_BIG, gl.float32, ROW)
    l_i = gl.zeros([BLOCK_M], gl.float32, ROW)
    r_i = gl.full([BLOCK_M], 1.0, gl.float32, ROW)
    acc0 = gl.zeros([BLOCK_M, DV], gl.float32, PV_LAYOUT)
    acc1 = acc0
    acc2 = acc0
    acc3 = acc0
    if PV_KIND == PV_INT8:
        levels: gl.constexpr = 127.0
        pend = gl.full([BLOCK_M, DV], MAGIC_I, gl.int32, PV_LAYOUT)  # "PV(-1)": o - M = 0
    else:
        levels: gl.constexpr = 448.0
        pend = acc0
    o0 = pend
    o1 = pend
    o2 = pend
    o3 = pend
    f_prev = gl.full([BLOCK_M], 1.0, gl.float32, PV_ROW)

    # ---- QK(0)
    async_copy.wait_group(STAGES - 2)
    fence_async_shared()
    _gc.cta_barrier()
    k0 = k_ring.index(0)
    s = warpgroup_mma_wait(0, deps=[_qk(q_smem, k0, BLOCK_M, BLOCK_N, KV_KIND, QK_LAYOUT)])
    k_scale, v_scale = _tile_scales(0, bt_row, k_scale_ptr, v_scale_ptr, scale_head, stride_sb, kv_end, last_page,
                                    PAGE, BLOCK_N, COL)

    for j in range(0, num_kv_tiles):
        start = j * BLOCK_N
        has_next = j + 1 < num_kv_tiles
        # ---- 1. softmax of S_j (PV(j - 1) still running)
        p_op, factor, m_i, l_i, r_i = _softmax_tile(s, k_scale, v_scale, m_i, l_i, r_i, row_scale, row_limit, start,
                                                     full_end, levels, BLOCK_N, KV_KIND, PV_KIND, COL, PV_ROW,
                                                     P_LAYOUT)

        # next tile's scales (their latency hides behind steps 2-4; loaded after this
        # tile's scales died: fewer live registers while PV(j - 1) is in flight)
        k_scale, v_scale = _tile_scales(gl.minimum(j + 1, num_kv_tiles - 1), bt_row, k_scale_ptr, v_scale_ptr,
                                        scale_head, stride_sb, kv_end, last_page, PAGE, BLOCK_N, COL)

        # ---- 2. PV(j - 1) done: fold it in
        acc0, acc1, acc2, acc3 = _wait_and_fold(o0, o1, o2, o3, acc0, acc1, acc2, acc3, f_prev, NUM_DV, PV_KIND)

        # ---- 3. tile j + 1 landed (every thread's copies: one CTA barrier), then refill the
        # stage of tile j - 2 with tile j + STAGES - 2 (every thread finished PV(j - 2) before
        # the barrier at j - 1). With 4+ stages the refill follows the barrier, which then
        # also orders it after every read of that stage (no second barrier).
        nxt = j + STAGES - 2
        v_buf = v_ring.index(j % STAGES)
        if STAGES >= 4:
            # committed after tile j + 1's group: tiles j + 2 .. j + STAGES - 3
            async_copy.wait_group(STAGES - 4)
        else:
            if (j >= 1) & (nxt < num_kv_tiles):
                _issue_tile(nxt, k_ring.index(nxt % STAGES), v_ring.index(nxt % STAGES), k_ptr, v_ptr, bt_row,
                            data_head, stride_cb, last_page, HEAD_DIM, PAGE, BLOCK_N, LOAD_K, LOAD_V)
            if j >= 1:
                async_copy.commit_group()
            async_copy.wait_group(0)
        fence_async_shared()
        if KV_KIND == KIND_FP8:
            if start + BLOCK_N > kv_end:
                # tile j's copies are visible since the barrier at j - 1
                _zero_tail_keys(v_buf, start, kv_end, HEAD_DIM, BLOCK_N, LOAD_V)
                fence_async_shared()
        _gc.cta_barrier()
        if STAGES >= 4:
            if (j >= 1) & (nxt < num_kv_tiles):
                _issue_tile(nxt, k_ring.index(nxt % STAGES), v_ring.index(nxt % STAGES), k_ptr, v_ptr, bt_row,
                            data_head, stride_cb, last_page, HEAD_DIM, PAGE, BLOCK_N, LOAD_K, LOAD_V)
            if j >= 1:
                async_copy.commit_group()

        # ---- 4. QK(j + 1) and PV(j), asynchronous; wait for QK(j + 1) only (groups retire in
        # order). The PV results come back as tensors still being written: their next use
        # is the wait of step 2.
        if has_next:
            s_tok = _qk(q_smem, k_ring.index((j + 1) % STAGES), BLOCK_M, BLOCK_N, KV_KIND, QK_LAYOUT)
            t0, t1, t2, t3 = _issue_pv(p_op, v_buf, acc0, acc1, acc2, acc3, factor, BLOCK_M, DV, NUM_DV, PV_KIND,
                                       PV_LAYOUT)
            s, o0, o1, o2, o3 = warpgroup_mma_wait(NUM_DV, deps=[s_tok, t0, t1, t2, t3])
        else:
            t0, t1, t2, t3 = _issue_pv(p_op, v_buf, acc0, acc1, acc2, acc3, factor, BLOCK_M, DV, NUM_DV, PV_KIND,
                                       PV_LAYOUT)
            o0, o1, o2, o3 = warpgroup_mma_wait(0, deps=[t0, t1, t2, t3])
        f_prev = factor

    acc0, acc1, acc2, acc3 = _wait_and_fold(o0, o1, o2, o3, acc0, acc1, acc2, acc3, f_prev, NUM_DV, PV_KIND)
    async_copy.wait_group(0)
    _store_output(out_ptr, acc0, acc1, acc2, acc3, l_i, r_i, q_start, q_tile, q_len, kv_head, stride_ot, stride_oh,
                  GROUP, BLOCK_M, BLOCK_Q, DV, NUM_DV, PV_LAYOUT)
