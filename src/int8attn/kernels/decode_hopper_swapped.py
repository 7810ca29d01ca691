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
* ``O^T += V^T . P^T`` in 64-channel chunks, V^T from registers (ldmatrix of the ring,
  which holds each page's [head_dim, 16] bytes contiguous as the cache does:
  :func:`page_major_layouts`); the accumulator is [head_dim, R] (64 fp32 per thread at
  head_dim 256 and R = 32, half the rows-on-M kernel's).

The program stages Q and its row scales in shared memory once, before the partitions fork
(:func:`_stage_query`), and runs ``CONSUMERS`` = 2 or 3 consumer warpgroups: consumer ``w``
is virtual split ``CONSUMERS * split + w``, ring item ``CONSUMERS * k + w`` its tile ``k``.

Applies to int8 caches with PV in int8 and at most 32 packed rows (its accumulator and the
per-key softmax sums stay in registers up to there); 64-key tiles. Output, partials,
skipped queries and metadata clamps as :mod:`int8attn.kernels.decode_hopper` (partials of
``CONSUMERS * num_splits`` virtual splits). Tensor layouts and grid: as
:mod:`int8attn.kernels.decode_hopper`.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, warpgroup_mma, \
    warpgroup_mma_wait

from . import _gluon_compat as _gc
from .decode_hopper import _checked_program, _decode_loader, _run
from .prefill_hopper import MAGIC_F, MIN_REL_STEP, NEG_BIG
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


def page_major_layouts(head_dim: int, block_n: int, page: int) -> dict:
    """The V^T ring's layout, page-major -- each page's [head_dim, RUN] bytes contiguous, as
    in the cache (offset bits within a stage: key within the page's run, channel, page; RUN =
    min(page, block_n)) -- and the loader's copy layout for it (16 bytes per thread, lanes
    along a run's keys then channels), so a warp's copies are 512 contiguous bytes on both
    sides. Why: in a swizzled wgmma tile a 16-key page's rows land 16 bytes apart in rows of
    64 bytes, and the H200 served such cp.async copies lane by lane (twice the L2 sectors,
    eight times the shared-memory wavefronts of the tile; notes/decode.md, "The V^T ring").
    The PV MMA then takes V^T from registers (ldmatrix), not from a wgmma descriptor."""
    run = min(page, block_n)
    bases = [[0, 1 << b] for b in range(run.bit_length() - 1)]
    bases += [[1 << b, 0] for b in range(head_dim.bit_length() - 1)]
    bases += [[0, run << b] for b in range((block_n // run).bit_length() - 1)]
    lanes_n = min(32, run // 16)
    warps_n = min(LOADER_WARPS.value, block_n // run)
    return dict(V_SMEM=gl.SharedLinearLayout(bases),
                LOAD_V=gl.BlockedLayout([1, 16], [32 // lanes_n, lanes_n], [LOADER_WARPS.value // warps_n, warps_n],
                                        [1, 0]))


@gluon.jit
def _pv_chunk(v_buf, c: gl.constexpr, pt_smem, dead):
    """``V^T[c * DC:(c + 1) * DC] . P^T``: one output chunk's int32 MMA (from zero), waited.
    The chunk of the page-major ring is no wgmma descriptor layout: it is loaded into
    registers as the MMA's A operand. ``dead`` [DC, R] int32 is a tensor no longer used:
    the MMA ignores its values (``use_acc=False``) and writes the chunk into its registers,
    so no zero tile lives across the loop."""
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dead.type.layout, k_width=4)
    a = v_buf.slice(c * DC, DC, dim=0).load(a_layout)
    return warpgroup_mma(a, pt_smem.permute((1, 0)), dead, use_acc=False)


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
def _stage_query(q_ptr, q_scale_ptr, q_smem, rs_smem, kv_head, q_start, q_len, qk_scale, stride_qt, stride_qh,
                 stride_qst, stride_qsh, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_Q: gl.constexpr,
                 R: gl.constexpr, LOAD_QT: gl.constexpr):
    """The packed rows' Q codes and score scales (``sQ * qk_scale``) into shared memory, once
    per program before the partitions fork: every consumer reads them (the scales per tile:
    an [R] vector held across the tile loop costs R / 4 registers per thread)."""
    qr = gl.arange(0, R, layout=gl.SliceLayout(1, LOAD_QT))
    qd = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, LOAD_QT))
    tok = qr // GROUP
    valid = (tok < BLOCK_Q) & (tok < q_len) & (qr < GROUP * BLOCK_Q)
    rows = (q_start + tok).to(gl.int64) * stride_qt + (kv_head * GROUP + qr % GROUP) * stride_qh
    q_smem.store(gl.load(q_ptr + rows[:, None] + qd[None, :], mask=valid[:, None], other=0))
    rs_smem.store(gl.load(q_scale_ptr + (q_start + tok).to(gl.int64) * stride_qst
                          + (kv_head * GROUP + qr % GROUP) * stride_qsh, mask=valid, other=1.0) * qk_scale)
    fence_async_shared()  # the Q codes are a wgmma operand (async proxy)
    _gc.cta_barrier()


@gluon.jit
def _swapped_consumer(out_ptr, part_acc_ptr, part_ml_ptr, q_smem, rs_smem, pt_bufs, k_ring, v_ring, ks_ring,
                      vs_ring, ready, empty, kv_head, q_start, q_len, ctx, kv_end, split, num_tiles, n_virtual,
                      poison, stride_ot, stride_oh, stride_pt, stride_ph, stride_ps, stride_mt, stride_mh, stride_ms,
                      GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_Q: gl.constexpr, BLOCK_N: gl.constexpr,
                      STAGES: gl.constexpr, R: gl.constexpr, QKT_LAYOUT: gl.constexpr, PVT_LAYOUT: gl.constexpr,
                      NC: gl.constexpr, WG: gl.constexpr):
    gl.static_assert(BLOCK_N == DC, "S^T [BLOCK_N, R] is the first PV chunk's register tile")
    KEY: gl.constexpr = gl.SliceLayout(1, QKT_LAYOUT)
    COLQ: gl.constexpr = gl.SliceLayout(0, QKT_LAYOUT)
    COLP: gl.constexpr = gl.SliceLayout(0, PVT_LAYOUT)
    vsplit = NC * split + WG
    lo, count = _run(num_tiles, vsplit, n_virtual)
    full_end = ((ctx + 1) // BLOCK_N) * BLOCK_N

    m_i = gl.full([R], NEG_BIG, gl.float32, COLQ)
    r_i = gl.full([R], 1.0, gl.float32, COLQ)
    l_part = gl.zeros([BLOCK_N, R], gl.float32, QKT_LAYOUT)  # per-key sums, reduced once at the end
    acc0 = gl.zeros([DC, R], gl.float32, PVT_LAYOUT)
    acc1 = acc0
    acc2 = acc0
    acc3 = acc0

    for k in range(0, count):
        i = NC * k + WG
        st = i % STAGES
        start = (lo + k) * BLOCK_N
        mbarrier.wait(ready.index(st), (i // STAGES) & 1)
        fence_async_shared()
        # from zero (no register start), converted by one I2FP per score: the prefill rule (_k_scaled)
        s = warpgroup_mma(k_ring.index(st), q_smem.permute((1, 0)), gl.zeros([BLOCK_N, R], gl.int32, QKT_LAYOUT),
                          use_acc=False, is_async=True)
        s = warpgroup_mma_wait(0, deps=[s])
        ks = ks_ring.index(st).load(KEY)
        vs = vs_ring.index(st).load(KEY)
        n = start + gl.arange(0, BLOCK_N, layout=KEY)
        if start + BLOCK_N > kv_end:
            ks = gl.where(n < kv_end, ks, 0.0)
            vs = gl.where(n < kv_end, vs, 0.0)
        t = s.to(gl.float32) * ks[:, None]  # exact: |dot| <= 256 * 127 * 127 < 2**24
        if start + BLOCK_N > full_end:
            # each query token's last key (recomputed here: no [R] vector lives across the loop)
            row_limit = gl.minimum(ctx + gl.arange(0, R, layout=COLQ) // GROUP, kv_end - 1)
            t = gl.where(n[:, None] <= row_limit[None, :], t, float("-inf"))
        row_scale = rs_smem.load(COLQ)
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
        o = _pv_chunk(v_buf, 0, pt_smem, s)  # S^T [BLOCK_N = DC, R] is dead past the softmax
        acc0 = _fold_i32(acc0, o, factor)
        if HEAD_DIM > 64:
            o = _pv_chunk(v_buf, 1, pt_smem, o)
            acc1 = _fold_i32(acc1, o, factor)
        if HEAD_DIM > 128:
            o = _pv_chunk(v_buf, 2, pt_smem, o)
            acc2 = _fold_i32(acc2, o, factor)
            o = _pv_chunk(v_buf, 3, pt_smem, o)
            acc3 = _fold_i32(acc3, o, factor)
        mbarrier.arrive(empty.index(st), count=1)

    l_i = gl.sum(l_part, 0)
    r = gl.arange(0, R, layout=COLQ)
    tok = r // GROUP
    row_valid = (tok < BLOCK_Q) & (tok < q_len) & (r < GROUP * BLOCK_Q)
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
    PT_SMEM: gl.constexpr, LOAD_QT: gl.constexpr, CONSUMERS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
    LOADER_REGS: gl.constexpr,
):
    gl.static_assert((CONSUMERS == 2) | (CONSUMERS == 3), "two or three consumer warpgroups")
    NC: gl.constexpr = CONSUMERS
    split = gl.program_id(0)
    kv_head = gl.program_id(1)
    seq = gl.program_id(2)
    bt_row = block_table_ptr + seq.to(gl.int64) * stride_bt
    q_start, q_len, seq_len, num_tiles, n_virtual, lo, n_items, poison = _checked_program(
        query_start_loc_ptr, seq_lens_ptr, bt_row, flags_ptr, seq, split, num_splits, max_query_len, num_tokens,
        num_blocks, max_blocks, PAGE, BLOCK_N, NC)
    if (q_len <= 0) | (q_len > max_query_len) | (NC * split >= n_virtual):
        return
    ctx = seq_len - q_len
    last_page = (seq_len - 1) // PAGE

    # Q and its scales once for every consumer (the partitions fork after these stores)
    q_smem = gl.allocate_shared_memory(gl.int8, [R, HEAD_DIM], QT_SMEM)
    rs_smem = gl.allocate_shared_memory(gl.float32, [R], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    _stage_query(q_ptr, q_scale_ptr, q_smem, rs_smem, kv_head, q_start, q_len, qk_scale, stride_qt, stride_qh,
                 stride_qst, stride_qsh, GROUP, HEAD_DIM, BLOCK_Q, R, LOAD_QT)
    pt_bufs = gl.allocate_shared_memory(gl.int8, [2 * NC, R, BLOCK_N], PT_SMEM)
    # each ring stage has one reader: the consumer whose virtual split owns its tile
    k_ring, v_ring, ks_ring, vs_ring, ready, empty = _alloc_ring(gl.int8, STAGES, BLOCK_N, HEAD_DIM, KV_KIND, K_SMEM,
                                                                 V_SMEM, 1)
    data_head = kv_head.to(gl.int64) * stride_ch
    scale_head = kv_head.to(gl.int64) * stride_sh
    # consumer 0 is the default partition (the kernel's four warps); the other consumers and
    # the loader are workers. (The entries are spelled out: a tuple of arguments bound to a
    # name or concatenated loses its constexprs in Triton 3.6.)
    if NC == 2:
        gl.warp_specialize([
            (_swapped_consumer, (out_ptr, part_acc_ptr, part_ml_ptr, q_smem, rs_smem, pt_bufs, k_ring, v_ring, ks_ring,
                                 vs_ring, ready, empty, kv_head, q_start, q_len, ctx, seq_len, split, num_tiles,
                                 n_virtual, poison, stride_ot, stride_oh, stride_pt, stride_ph, stride_ps, stride_mt,
                                 stride_mh, stride_ms, GROUP, HEAD_DIM, BLOCK_Q, BLOCK_N, STAGES, R, QKT_LAYOUT,
                                 PVT_LAYOUT, NC, 0)),
            (_swapped_consumer, (out_ptr, part_acc_ptr, part_ml_ptr, q_smem, rs_smem, pt_bufs, k_ring, v_ring, ks_ring,
                                 vs_ring, ready, empty, kv_head, q_start, q_len, ctx, seq_len, split, num_tiles,
                                 n_virtual, poison, stride_ot, stride_oh, stride_pt, stride_ph, stride_ps, stride_mt,
                                 stride_mh, stride_ms, GROUP, HEAD_DIM, BLOCK_Q, BLOCK_N, STAGES, R, QKT_LAYOUT,
                                 PVT_LAYOUT, NC, 1)),
            (_decode_loader, (k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, bt_row, data_head, scale_head, stride_cb,
                              stride_sb, seq_len, last_page, num_blocks, num_tiles, n_virtual, NC * split, n_items,
                              k_ring, v_ring, ks_ring, vs_ring, ready, empty, HEAD_DIM, PAGE, BLOCK_N, STAGES, KV_KIND,
                              LOAD_K, LOAD_V, LOAD_S, NC)),
        ], [4, LOADER_WARPS], [CONSUMER_REGS, LOADER_REGS])
    else:
        gl.warp_specialize([
            (_swapped_consumer, (out_ptr, part_acc_ptr, part_ml_ptr, q_smem, rs_smem, pt_bufs, k_ring, v_ring, ks_ring,
                                 vs_ring, ready, empty, kv_head, q_start, q_len, ctx, seq_len, split, num_tiles,
                                 n_virtual, poison, stride_ot, stride_oh, stride_pt, stride_ph, stride_ps, stride_mt,
                                 stride_mh, stride_ms, GROUP, HEAD_DIM, BLOCK_Q, BLOCK_N, STAGES, R, QKT_LAYOUT,
                                 PVT_LAYOUT, NC, 0)),
            (_swapped_consumer, (out_ptr, part_acc_ptr, part_ml_ptr, q_smem, rs_smem, pt_bufs, k_ring, v_ring, ks_ring,
                                 vs_ring, ready, empty, kv_head, q_start, q_len, ctx, seq_len, split, num_tiles,
                                 n_virtual, poison, stride_ot, stride_oh, stride_pt, stride_ph, stride_ps, stride_mt,
                                 stride_mh, stride_ms, GROUP, HEAD_DIM, BLOCK_Q, BLOCK_N, STAGES, R, QKT_LAYOUT,
                                 PVT_LAYOUT, NC, 1)),
            (_swapped_consumer, (out_ptr, part_acc_ptr, part_ml_ptr, q_smem, rs_smem, pt_bufs, k_ring, v_ring, ks_ring,
                                 vs_ring, ready, empty, kv_head, q_start, q_len, ctx, seq_len, split, num_tiles,
                                 n_virtual, poison, stride_ot, stride_oh, stride_pt, stride_ph, stride_ps, stride_mt,
                                 stride_mh, stride_ms, GROUP, HEAD_DIM, BLOCK_Q, BLOCK_N, STAGES, R, QKT_LAYOUT,
                                 PVT_LAYOUT, NC, 2)),
            (_decode_loader, (k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, bt_row, data_head, scale_head, stride_cb,
                              stride_sb, seq_len, last_page, num_blocks, num_tiles, n_virtual, NC * split, n_items,
                              k_ring, v_ring, ks_ring, vs_ring, ready, empty, HEAD_DIM, PAGE, BLOCK_N, STAGES, KV_KIND,
                              LOAD_K, LOAD_V, LOAD_S, NC)),
        ], [4, 4, LOADER_WARPS], [CONSUMER_REGS, CONSUMER_REGS, LOADER_REGS])
