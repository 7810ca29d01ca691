"""Multi-token decode for Hopper with keys on the MMA's M side (the *keys-on-M* kernel):
:mod:`int8attn.kernels.decode_hopper`'s program, loader and virtual splits with the operands
of the consumers swapped.

Why. The rows-on-M kernel pads a step's packed rows (GQA group x tokens) to the 64 rows of a
warpgroup MMA: at 24 real rows its consumers spend most instructions on the [64, head_dim]
accumulator fold and the 64-row softmax (notes/decode.md). Here the tile's 64 keys are the
MMA's M and the packed rows, padded to ``R`` = 16 or 32, its N:

* ``S^T = K . Q^T`` [BLOCK_N, R] (int8 x int8 -> int32, K from the ring as the A operand);
* the online softmax runs down the columns (a max across the four warps per tile);
* P^T [R, BLOCK_N] is rounded to int8 per column (127 levels, as the other kernels round P
  per row) and goes through shared memory -- two buffers per consumer, so a warp may write
  tile ``k + 1``'s P^T while the MMA of tile ``k`` still reads the other;
* ``O^T += V^T . P^T`` in 64-channel chunks (V^T pages are already K-major A operands);
  the accumulator is [head_dim, R] (64 fp32 per thread at head_dim 256 and R = 32, half the
  rows-on-M kernel's).

Applies to int8 caches with PV in int8 and at most 32 packed rows (its accumulator and the
per-key softmax sums stay in registers up to there); 64-key tiles. Output, partials,
skipped queries and metadata trust as :mod:`int8attn.kernels.decode_hopper`.
Tensor layouts and grid: as :mod:`int8attn.kernels.decode_hopper`.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, warpgroup_mma, \
    warpgroup_mma_wait

from . import _gluon_compat as _gc
from .decode_hopper import _checked_program, _decode_loader
from .prefill_hopper import MAGIC_F, MAGIC_I, MIN_REL_STEP, NEG_BIG
from .prefill_hopper_ws import LOADER_WARPS, _alloc_ring, _fold_i32

DC = gl.constexpr(64)  # output channels per PV chunk (the MMA's M)


def swapped_layouts(rows: int, block_n: int, head_dim: int) -> dict:
    """Layout constexprs of the keys-on-M consumers (one warpgroup each) for ``rows`` = R."""
    lanes_d = max(1, min(32, head_dim // 16))  # lanes along a Q row: 16 bytes each
    # S^T [BLOCK_N, R] and each O^T chunk [64, R] are the same MMA shape: one layout for both
    mma = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, rows, 32])
    return dict(QKT_LAYOUT=mma, PVT_LAYOUT=mma, R=rows,
                QT_SMEM=gl.NVMMASharedLayout.get_default_for([rows, head_dim], gl.int8),
                PT_SMEM=gl.NVMMASharedLayout.get_default_for([rows, block_n], gl.int8),
                LOAD_QT=gl.BlockedLayout([1, 16], [32 // lanes_d, lanes_d], [4, 1], [1, 0]))


@gluon.jit
def _pv_chunk(v_buf, c: gl.constexpr, pt_smem, zero):
    """``V^T[c * DC:(c + 1) * DC] . P^T``: one output chunk's int32 MMA (from zero), waited."""
    return warpgroup_mma(v_buf.slice(c * DC, DC, dim=0), pt_smem.permute((1, 0)), zero, use_acc=False)


@gluon.jit
def _store_t(ptr, acc, c: gl.constexpr, scale, q_start, q_len, kv_head, stride_t, stride_h, GROUP: gl.constexpr,
             BLOCK_Q: gl.constexpr, R: gl.constexpr, PVT_LAYOUT: gl.constexpr):
    """Rows of a transposed chunk ``acc`` [DC, R] times ``scale`` [R] to ``ptr`` rows (token,
    head) at channels ``c * DC ...``."""
    r = gl.arange(0, R, layout=gl.SliceLayout(0, PVT_LAYOUT))
    d = c * DC + gl.arange(0, DC, layout=gl.SliceLayout(1, PVT_LAYOUT))
    tok = r // GROUP
    valid = (tok < BLOCK_Q) & (tok < q_len) & (r < GROUP * BLOCK_Q)
    rows = (q_start + tok).to(gl.int64) * stride_t + (kv_head * GROUP + r % GROUP) * stride_h
    gl.store(ptr + rows[None, :] + d[:, None], (acc * scale[None, :]).to(ptr.dtype.element_ty), mask=valid[None, :])


@gluon.jit
def _swapped_consumer(q_ptr, q_scale_ptr, out_ptr, part_acc_ptr, part_ml_ptr, q_bufs, pt_bufs, k_ring, v_ring,
                      ks_ring, vs_ring, ready, empty, kv_head, q_start, q_len, ctx, kv_end, split, n_virtual, lo0,
                      count0, count1, poison, qk_scale, stride_qt, stride_qh, stride_qst, stride_qsh, stride_ot,
                      stride_oh, stride_pt, stride_ph, stride_ps, stride_mt, stride_mh, stride_ms,
                      WG: gl.constexpr, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_Q: gl.constexpr,
                      BLOCK_N: gl.constexpr, STAGES: gl.constexpr, R: gl.constexpr, QKT_LAYOUT: gl.constexpr,
                      PVT_LAYOUT: gl.constexpr, LOAD_QT: gl.constexpr):
    KEY: gl.constexpr = gl.SliceLayout(1, QKT_LAYOUT)
    COLQ: gl.constexpr = gl.SliceLayout(0, QKT_LAYOUT)
    COLP: gl.constexpr = gl.SliceLayout(0, PVT_LAYOUT)
    if WG == 0:
        lo = lo0
        count = count0
    else:
        lo = lo0 + count0
        count = count1
    vsplit = 2 * split + WG

    qr = gl.arange(0, R, layout=gl.SliceLayout(1, LOAD_QT))
    qd = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, LOAD_QT))
    q_valid = (qr // GROUP < BLOCK_Q) & (qr // GROUP < q_len) & (qr < GROUP * BLOCK_Q)
    q_rows = (q_start + qr // GROUP).to(gl.int64) * stride_qt + (kv_head * GROUP + qr % GROUP) * stride_qh
    q = gl.load(q_ptr + q_rows[:, None] + qd[None, :], mask=q_valid[:, None], other=0)
    q_smem = q_bufs.index(WG)
    q_smem.store(q)
    fence_async_shared()
    _gc.cta_barrier()

    r = gl.arange(0, R, layout=COLQ)
    tok = r // GROUP
    row_valid = (tok < BLOCK_Q) & (tok < q_len) & (r < GROUP * BLOCK_Q)
    row_scale = gl.load(q_scale_ptr + (q_start + tok).to(gl.int64) * stride_qst
                        + (kv_head * GROUP + r % GROUP) * stride_qsh, mask=row_valid, other=1.0) * qk_scale
    full_end = ((ctx + 1) // BLOCK_N) * BLOCK_N
    row_limit = gl.minimum(ctx + tok, kv_end - 1)

    m_i = gl.full([R], NEG_BIG, gl.float32, COLQ)
    r_i = gl.full([R], 1.0, gl.float32, COLQ)
    l_part = gl.zeros([BLOCK_N, R], gl.float32, QKT_LAYOUT)  # per-key sums, reduced once at the end
    acc0 = gl.zeros([DC, R], gl.float32, PVT_LAYOUT)
    acc1 = acc0
    acc2 = acc0
    acc3 = acc0
    zero = gl.zeros([DC, R], gl.int32, PVT_LAYOUT)

    for k in range(0, count):
        i = 2 * k + WG
        st = i % STAGES
        start = (lo + k) * BLOCK_N
        mbarrier.wait(ready.index(st), (i // STAGES) & 1)
        fence_async_shared()
        s = warpgroup_mma(k_ring.index(st), q_smem.permute((1, 0)),
                          gl.full([BLOCK_N, R], MAGIC_I, gl.int32, QKT_LAYOUT), is_async=True)
        s = warpgroup_mma_wait(0, deps=[s])
        ks = ks_ring.index(st).load(KEY)
        vs = vs_ring.index(st).load(KEY)
        n = start + gl.arange(0, BLOCK_N, layout=KEY)
        if start + BLOCK_N > kv_end:
            ks = gl.where(n < kv_end, ks, 0.0)
            vs = gl.where(n < kv_end, vs, 0.0)
        t = s.to(gl.float32, bitcast=True) * ks[:, None] + (ks * -MAGIC_F)[:, None]
        if start + BLOCK_N > full_end:
            t = gl.where(n[:, None] <= row_limit[None, :], t, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(t, 0) * row_scale)
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(t * row_scale[None, :] - m_new[None, :])
        l_part = l_part * alpha[None, :] + p
        pv = p * vs[:, None]
        # max(max_k pv, MIN_REL_STEP * max_k vs) in one column reduction (each across the
        # four warps costs shared-memory round trips and barriers)
        r_new = gl.max(gl.maximum(pv, (vs * MIN_REL_STEP)[:, None]), 0) * (1.0 / 127.0)
        factor = gl.convert_layout(alpha * (r_i / r_new), COLP)[None, :]
        u = pv * (1.0 / r_new)[None, :] + MAGIC_F
        p8 = u.to(gl.int32, bitcast=True).to(gl.int8)
        # every warp of the warpgroup past the column reductions before any P^T byte is
        # written: without this barrier the H200 ran the PV MMA on wrong P^T bytes (rel-L2
        # ~1.0 against the portable kernel, benchmarks/notes/decode.md); which shared-memory
        # access races without it was not identified (the P^T buffers alias no reduction scratch)
        _gc.cta_barrier()
        # two P^T buffers per consumer: a warp may write tile k + 1's P^T while another
        # warp's share of tile k's PV MMA still reads the other buffer
        pt_smem = pt_bufs.index(2 * WG + (k & 1))
        pt_smem.store(gl.permute(p8, (1, 0)))
        fence_async_shared()
        _gc.cta_barrier()  # every warp's P^T rows are in shared memory before the MMA reads them
        m_i = m_new
        r_i = r_new
        v_buf = v_ring.index(st)
        acc0 = _fold_i32(acc0, _pv_chunk(v_buf, 0, pt_smem, zero), factor)
        if HEAD_DIM > 64:
            acc1 = _fold_i32(acc1, _pv_chunk(v_buf, 1, pt_smem, zero), factor)
        if HEAD_DIM > 128:
            acc2 = _fold_i32(acc2, _pv_chunk(v_buf, 2, pt_smem, zero), factor)
            acc3 = _fold_i32(acc3, _pv_chunk(v_buf, 3, pt_smem, zero), factor)
        mbarrier.arrive(empty.index(st), count=1)

    l_i = gl.sum(l_part, 0)
    r_i = gl.where(poison != 0, float("nan"), r_i)  # metadata out of range: NaN rows (partials)
    if vsplit < n_virtual:
        if n_virtual == 1:
            norm = gl.convert_layout(gl.where(l_i > 0.0, r_i / l_i, 0.0), COLP)
            _store_chunks(out_ptr, acc0, acc1, acc2, acc3, norm, q_start, q_len, kv_head, stride_ot, stride_oh,
                          GROUP, HEAD_DIM, BLOCK_Q, R, PVT_LAYOUT)
        else:
            ml = part_ml_ptr + vsplit * stride_ms + (q_start + tok).to(gl.int64) * stride_mt \
                + (kv_head * GROUP + r % GROUP) * stride_mh
            gl.store(ml, m_i, mask=row_valid)
            gl.store(ml + 1, l_i, mask=row_valid)
            _store_chunks(part_acc_ptr + vsplit * stride_ps, acc0, acc1, acc2, acc3, gl.convert_layout(r_i, COLP),
                          q_start, q_len, kv_head, stride_pt, stride_ph, GROUP, HEAD_DIM, BLOCK_Q, R, PVT_LAYOUT)


@gluon.jit
def _store_chunks(ptr, acc0, acc1, acc2, acc3, scale, q_start, q_len, kv_head, stride_t, stride_h,
                  GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_Q: gl.constexpr, R: gl.constexpr,
                  PVT_LAYOUT: gl.constexpr):
    """The head_dim // 64 transposed chunks of a consumer's rows, times ``scale`` per row."""
    _store_t(ptr, acc0, 0, scale, q_start, q_len, kv_head, stride_t, stride_h, GROUP, BLOCK_Q, R, PVT_LAYOUT)
    if HEAD_DIM > 64:
        _store_t(ptr, acc1, 1, scale, q_start, q_len, kv_head, stride_t, stride_h, GROUP, BLOCK_Q, R, PVT_LAYOUT)
    if HEAD_DIM > 128:
        _store_t(ptr, acc2, 2, scale, q_start, q_len, kv_head, stride_t, stride_h, GROUP, BLOCK_Q, R, PVT_LAYOUT)
        _store_t(ptr, acc3, 3, scale, q_start, q_len, kv_head, stride_t, stride_h, GROUP, BLOCK_Q, R, PVT_LAYOUT)


@gluon.jit
def _decode_hopper_swapped_kernel(
    q_ptr, q_scale_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
    k_ptr, v_ptr, k_scale_ptr, v_scale_ptr,
    block_table_ptr, seq_lens_ptr, query_start_loc_ptr,
    qk_scale, num_splits, max_query_len,
    stride_qt, stride_qh, stride_qst, stride_qsh,
    stride_ot, stride_oh,
    stride_pt, stride_ph, stride_ps,
    stride_mt, stride_mh, stride_ms,
    stride_cb, stride_ch, stride_sb, stride_sh,
    stride_bt, flags_ptr, num_tokens, num_blocks, max_blocks,
    GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, PAGE: gl.constexpr, BLOCK_Q: gl.constexpr,
    BLOCK_N: gl.constexpr, STAGES: gl.constexpr, KV_KIND: gl.constexpr,
    K_SMEM: gl.constexpr, V_SMEM: gl.constexpr, LOAD_K: gl.constexpr, LOAD_V: gl.constexpr, LOAD_S: gl.constexpr,
    R: gl.constexpr, QKT_LAYOUT: gl.constexpr, PVT_LAYOUT: gl.constexpr, QT_SMEM: gl.constexpr,
    PT_SMEM: gl.constexpr, LOAD_QT: gl.constexpr, CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr,
):
    split = gl.program_id(0)
    kv_head = gl.program_id(1)
    seq = gl.program_id(2)
    bt_row = block_table_ptr + seq.to(gl.int64) * stride_bt
    q_start, q_len, seq_len, n_virtual, lo0, count0, count1, poison = _checked_program(
        query_start_loc_ptr, seq_lens_ptr, bt_row, flags_ptr, seq, split, num_splits, max_query_len, num_tokens,
        num_blocks, max_blocks, PAGE, BLOCK_N)
    if (q_len <= 0) | (q_len > max_query_len) | (2 * split >= n_virtual):
        return
    ctx = seq_len - q_len
    last_page = (seq_len - 1) // PAGE

    q_bufs = gl.allocate_shared_memory(gl.int8, [2, R, HEAD_DIM], QT_SMEM)
    pt_bufs = gl.allocate_shared_memory(gl.int8, [4, R, BLOCK_N], PT_SMEM)
    # each ring stage has one reader: the consumer whose virtual split owns its tile
    k_ring, v_ring, ks_ring, vs_ring, ready, empty = _alloc_ring(gl.int8, STAGES, BLOCK_N, HEAD_DIM, KV_KIND, K_SMEM,
                                                                 V_SMEM, 1)

    gl.warp_specialize([
        (_swapped_consumer, (q_ptr, q_scale_ptr, out_ptr, part_acc_ptr, part_ml_ptr, q_bufs, pt_bufs, k_ring, v_ring,
                             ks_ring, vs_ring, ready, empty, kv_head, q_start, q_len, ctx, seq_len, split, n_virtual,
                             lo0, count0, count1, poison, qk_scale, stride_qt, stride_qh, stride_qst, stride_qsh,
                             stride_ot, stride_oh, stride_pt, stride_ph, stride_ps, stride_mt, stride_mh, stride_ms,
                             0, GROUP, HEAD_DIM, BLOCK_Q, BLOCK_N, STAGES, R, QKT_LAYOUT, PVT_LAYOUT, LOAD_QT)),
        (_swapped_consumer, (q_ptr, q_scale_ptr, out_ptr, part_acc_ptr, part_ml_ptr, q_bufs, pt_bufs, k_ring, v_ring,
                             ks_ring, vs_ring, ready, empty, kv_head, q_start, q_len, ctx, seq_len, split, n_virtual,
                             lo0, count0, count1, poison, qk_scale, stride_qt, stride_qh, stride_qst, stride_qsh,
                             stride_ot, stride_oh, stride_pt, stride_ph, stride_ps, stride_mt, stride_mh, stride_ms,
                             1, GROUP, HEAD_DIM, BLOCK_Q, BLOCK_N, STAGES, R, QKT_LAYOUT, PVT_LAYOUT, LOAD_QT)),
        (_decode_loader, (k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, bt_row, kv_head.to(gl.int64) * stride_ch,
                          kv_head.to(gl.int64) * stride_sh, stride_cb, stride_sb, seq_len, last_page, num_blocks, lo0,
                          count0, count1, k_ring, v_ring, ks_ring, vs_ring, ready, empty,
                          HEAD_DIM, PAGE, BLOCK_N, STAGES, KV_KIND, LOAD_K, LOAD_V, LOAD_S)),
    ], [4, LOADER_WARPS], [CONSUMER_REGS, LOADER_REGS])
