"""Multi-token decode for Hopper (sm_90) in Gluon: split-K over the paged cache with the
warp-specialized prefill kernel's partitions (:mod:`int8attn.kernels.prefill_hopper_ws`).

Why a second decode kernel. The portable decode kernel (:mod:`int8attn.kernels.decode`)
puts the packed query rows on the MMA's N side (operand-swapped tiles): 16 rows read at
~95% of copy bandwidth, but a multi-token step of a large GQA group (4 tokens x 6 heads =
24 rows) needs a 32-row tile, whose softmax and accumulator no longer fit beside the
pipelined loads (one 8-warp program per SM, 1.5-1.6x the one-token time). Here the rows sit
on the MMA's M side as in prefill -- up to 64 of them per warpgroup, so 24 or 48 rows cost
what 6 rows cost -- and a loader partition keeps the shared-memory ring full while the two
consumer warpgroups compute, so that the MMA work of the padded rows hides under the
stream of K/V bytes.

One program owns one (split, KV head, sequence) and runs three partitions of four warps:

* a loader (as the prefill kernel's): cp.async of K, V^T and both scale rows of each KV
  tile through the block table into a ``STAGES``-deep ring, guarded by ``ready`` / ``empty``
  mbarriers, the next ring item's block ids loaded while this item's copies are issued;
* two consumer warpgroups, each owning the same packed rows (row ``r``: token ``r //
  GROUP``, head ``kv_head * GROUP + r % GROUP``; ``GROUP * q_len <= 64``) and its own
  contiguous run of the program's KV tiles: consumer ``w`` is *virtual split* ``2 * split +
  w`` of ``2 * num_splits``, the runs cut as :func:`int8attn.kernels.decode._split_tiles`
  cuts them (sizes differing by at most one, the non-empty ones first). The loader
  interleaves the two runs (ring item ``i = 2 k + w`` is tile ``k`` of consumer ``w``), so
  each ring stage is read by one consumer (``empty`` counts one arrival). Each consumer
  runs its tiles in order -- QK, the online softmax, PV -- with the scores, masks, scales
  and P quantization of the prefill kernel; the other consumer's MMAs overlap its softmax.

Output: with one active virtual split (a context of one tile) the normalized rows go to
``out``; otherwise each consumer writes its partial rows (unnormalized accumulator, running
max and sum in base 2) to the workspace, and the decode merge kernel
(:func:`int8attn.kernels.decode._decode_merge_kernel`, launched with ``2 * num_splits``
splits and this kernel's ``BLOCK_N``) combines them -- the portable kernel's partial format.

Metadata is not trusted (:func:`_checked_program`, as the portable kernel's clamps): a
query range is clamped into ``[0, num_tokens)``, ``seq_len`` into what the sequence's
block-table row holds, every block id the loader uses into ``[0, num_blocks)``; a program
whose sequence has metadata out of range (its own pages' block ids included) writes NaN rows
(partials) and raises the device error flags (:mod:`int8attn.errors`).

Sequences with ``q_len > max_query_len`` (at most ``BLOCK_Q = 64 // GROUP``) are skipped,
their rows unwritten, as the portable kernel skips them.

Tensor layouts: q [T, Hq, D] int8 | e4m3 (as uint8) codes, q_scale [T, Hq] fp32; the
cache as :mod:`int8attn.kernels.prefill_hopper`; out [T, Hq, D] bf16; part_acc [T, Hq, S2,
D] fp32, part_ml [T, Hq, S2, 2] fp32 with ``S2 >= 2 * num_splits``; flags [3] int32
(:func:`int8attn.errors.error_flags`). Grid: (num_splits, Hkv, num_seqs).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import async_copy, fence_async_shared, mbarrier, \
    warpgroup_mma_wait

from . import _gluon_compat as _gc
from ._errors import ERR_BLOCK_ID, ERR_QUERY_LEN, ERR_SEQ_LEN
from .codes import KIND_BF16, KIND_FP8, PV_INT8
from .prefill_hopper import NEG_BIG, _bad_block_ids, _issue_rows_at, _issue_v_pages_at, _page_ids, _pv_8bit, \
    _raise_flags, _store_output, _store_rows, _zero_tail_keys
from .prefill_hopper_pipe import _qk, _softmax_tile
from .prefill_hopper_ws import LOADER_WARPS, WG_ROWS, _alloc_ring, _copy_scales_at, _pv_int8_chunks, _stage_scales, \
    _v_chunk


@gluon.jit
def _run(num_tiles, v, num_virtual):
    """Tiles ``[lo, lo + count)`` of virtual split ``v`` of ``num_virtual`` (the portable
    kernel's ``_split_tiles`` with no window); ``count`` is 0 for ``v >= num_virtual``, whose
    ``lo`` is ``num_tiles`` at ``v == num_virtual``."""
    base = num_tiles // num_virtual
    rem = num_tiles % num_virtual
    lo = v * base + gl.minimum(v, rem)
    count = gl.where(v < num_virtual, base + (v < rem).to(gl.int32), 0)
    return lo, count


@gluon.jit
def _checked_program(query_start_loc_ptr, seq_lens_ptr, bt_row, flags_ptr, seq, split, num_splits, max_query_len,
                     num_tokens, num_blocks, max_blocks, PAGE: gl.constexpr, BLOCK_N: gl.constexpr,
                     NC: gl.constexpr):
    """A program's metadata, clamped so that nothing it reads or writes lies outside the
    query, the output, its block-table row or the cache, whatever the metadata holds (the
    portable kernel's ``_untrusted_metadata`` rules): a decode query range is clamped into
    ``[0, num_tokens)``; a ``seq_len`` beyond the row's ``max_blocks`` pages, negative or below
    its query length into ``[q_len, max_blocks * PAGE]``; the block ids of the program's own
    pages are scanned (the loader clamps each one it uses). Anything out of range raises the
    device flags (one record per program) and ``poison``: the program writes NaN rows.
    The program runs virtual splits ``NC * split ... NC * split + NC - 1`` of ``n_virtual``
    (one per consumer warpgroup), its ``n_items`` tiles from tile ``lo``.
    Returns (q_start, q_len, seq_len, num_tiles, n_virtual, lo, n_items, poison)."""
    q_start = gl.load(query_start_loc_ptr + seq)
    q_end = gl.load(query_start_loc_ptr + seq + 1)
    q_len = q_end - q_start
    seq_len = gl.load(seq_lens_ptr + seq)
    decode = (q_len > 0) & (q_len <= max_query_len)
    bad_q = (q_len < 0) | (decode & ((q_start < 0) | (q_end > num_tokens) | (q_len > seq_len)))
    bad_len = decode & ((seq_len < 0) | (seq_len > max_blocks * PAGE))
    q_start = gl.minimum(gl.maximum(q_start, 0), num_tokens)
    q_len = gl.where(decode, gl.maximum(gl.minimum(q_end, num_tokens) - q_start, 0), q_len)
    seq_len = gl.where(bad_q | bad_len, gl.minimum(gl.maximum(seq_len, gl.maximum(q_len, 1)), max_blocks * PAGE),
                       seq_len)
    num_tiles = (seq_len + BLOCK_N - 1) // BLOCK_N
    n_virtual = gl.minimum(NC * num_splits, num_tiles)
    lo, _ = _run(num_tiles, gl.minimum(NC * split, n_virtual), n_virtual)
    hi, _ = _run(num_tiles, gl.minimum(NC * split + NC, n_virtual), n_virtual)
    n_items = hi - lo
    # the pages of this program's tiles (the last tile's pages past the sequence read its last page)
    first_page = lo * BLOCK_N // PAGE
    end_page = (gl.minimum(hi * BLOCK_N, seq_len) + PAGE - 1) // PAGE
    bits = bad_q.to(gl.int32) * ERR_QUERY_LEN + bad_len.to(gl.int32) * ERR_SEQ_LEN
    if decode & (NC * split < n_virtual):
        bits += (_bad_block_ids(bt_row, first_page, end_page, num_blocks) > 0).to(gl.int32) * ERR_BLOCK_ID
    _raise_flags(flags_ptr, bits, seq)
    return q_start, q_len, seq_len, num_tiles, n_virtual, lo, n_items, bits


@gluon.jit
def _item_blocks(i, num_tiles, n_virtual, first_v, bt_row, last_page, num_blocks, PAGE: gl.constexpr,
                 BLOCK_N: gl.constexpr, LOAD_K: gl.constexpr, LOAD_V: gl.constexpr, LOAD_S: gl.constexpr,
                 NC: gl.constexpr):
    """Ring item ``i``'s tile (tile ``i // NC`` of consumer ``i % NC``, the run of virtual
    split ``first_v + i % NC``) and its block ids in the layouts of the K rows, the V^T pages
    and the scales, clamped into ``[0, num_blocks)`` (an id out of range was found by
    :func:`_checked_program`: the rows it feeds are NaN). The ids stay int32 (the loader
    carries the next item's across its loop in 40 registers); widen them where they scale
    a stride."""
    lo, _ = _run(num_tiles, first_v + i % NC, n_virtual)
    tile = lo + i // NC
    kblk = _page_ids(tile, bt_row, last_page, PAGE, BLOCK_N, gl.SliceLayout(1, LOAD_K))
    vblk = _page_ids(tile, bt_row, last_page, PAGE, BLOCK_N, gl.SliceLayout(0, LOAD_V))
    sblk = _page_ids(tile, bt_row, last_page, PAGE, BLOCK_N, LOAD_S)
    top = num_blocks - 1
    return (tile, gl.minimum(gl.maximum(kblk, 0), top), gl.minimum(gl.maximum(vblk, 0), top),
            gl.minimum(gl.maximum(sblk, 0), top))


@gluon.jit
def _decode_loader(k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, bt_row, data_head, scale_head, stride_cb, stride_sb,
                   kv_end, last_page, num_blocks, num_tiles, n_virtual, first_v, n_items, k_ring, v_ring, ks_ring,
                   vs_ring, ready, empty, HEAD_DIM: gl.constexpr, PAGE: gl.constexpr, BLOCK_N: gl.constexpr,
                   STAGES: gl.constexpr, KV_KIND: gl.constexpr, LOAD_K: gl.constexpr, LOAD_V: gl.constexpr,
                   LOAD_S: gl.constexpr, NC: gl.constexpr):
    # NC consumers drain the ring, so the loader must issue a tile in 1 / NC of a consumer's
    # tile time: the block ids of item i + 1 are loaded before item i's copies are issued
    # (a block-table round trip per item would otherwise pace the ring).
    tile, kblk, vblk, sblk = _item_blocks(0, num_tiles, n_virtual, first_v, bt_row, last_page, num_blocks, PAGE,
                                          BLOCK_N, LOAD_K, LOAD_V, LOAD_S, NC)
    for i in range(0, n_items):
        s = i % STAGES
        nxt, kblk_n, vblk_n, sblk_n = _item_blocks(gl.minimum(i + 1, n_items - 1), num_tiles, n_virtual, first_v,
                                                   bt_row, last_page, num_blocks, PAGE, BLOCK_N, LOAD_K, LOAD_V,
                                                   LOAD_S, NC)
        mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)  # first pass: phase 1 is done
        _issue_rows_at(tile, kblk.to(gl.int64), k_ring.index(s), k_ptr, data_head, stride_cb, HEAD_DIM, PAGE,
                       BLOCK_N, LOAD_K)
        _issue_v_pages_at(tile, vblk.to(gl.int64), v_ring.index(s), v_ptr, data_head, stride_cb, HEAD_DIM, PAGE,
                          BLOCK_N, LOAD_V)
        _copy_scales_at(tile, sblk.to(gl.int64), ks_ring.index(s), vs_ring.index(s), k_scale_ptr, v_scale_ptr,
                        scale_head, stride_sb, PAGE, BLOCK_N, LOAD_S)
        if KV_KIND == KIND_FP8:
            if (tile + 1) * BLOCK_N > kv_end:
                # stale e4m3 bytes past the end may be NaN (NaN * 0 = NaN in the MMA): zero them
                async_copy.commit_group()
                async_copy.wait_group(0)
                _zero_tail_keys(v_ring.index(s), tile * BLOCK_N, kv_end, HEAD_DIM, BLOCK_N, LOAD_V)
                fence_async_shared()
                _gc.cta_barrier()  # the loader's warps only
                mbarrier.arrive(ready.index(s), count=LOADER_WARPS * 32)
            else:
                async_copy.mbarrier_arrive(ready.index(s), increment_count=False)
        else:
            async_copy.mbarrier_arrive(ready.index(s), increment_count=False)
        tile, kblk, vblk, sblk = nxt, kblk_n, vblk_n, sblk_n


@gluon.jit
def _decode_consumer(q_ptr, q_scale_ptr, out_ptr, part_acc_ptr, part_ml_ptr, q_bufs, k_ring, v_ring, ks_ring,
                     vs_ring, ready, empty, kv_head, q_start, q_len, ctx, kv_end, split, num_tiles, n_virtual,
                     poison, qk_scale, stride_qt, stride_qh, stride_qst, stride_qsh, stride_ot, stride_oh,
                     stride_pt, stride_ph, stride_ps, stride_mt, stride_mh, stride_ms,
                     WG: gl.constexpr, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_Q: gl.constexpr,
                     BLOCK_N: gl.constexpr, DV: gl.constexpr, KV_KIND: gl.constexpr, PV_KIND: gl.constexpr,
                     STAGES: gl.constexpr, QK_LAYOUT: gl.constexpr, PV_LAYOUT: gl.constexpr,
                     P_LAYOUT: gl.constexpr, LOAD_Q: gl.constexpr):
    ROW: gl.constexpr = gl.SliceLayout(1, QK_LAYOUT)
    COL: gl.constexpr = gl.SliceLayout(0, QK_LAYOUT)
    PV_ROW: gl.constexpr = gl.SliceLayout(1, PV_LAYOUT)
    NUM_DV: gl.constexpr = HEAD_DIM // DV
    BLOCK_M: gl.constexpr = WG_ROWS
    vsplit = 2 * split + WG
    lo, count = _run(num_tiles, vsplit, n_virtual)

    # ---- the packed rows' Q codes into this warpgroup's tile
    qm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, LOAD_Q))
    qd = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, LOAD_Q))
    q_valid = (qm // GROUP < BLOCK_Q) & (qm // GROUP < q_len)
    q_rows = (q_start + qm // GROUP).to(gl.int64) * stride_qt + (kv_head * GROUP + qm % GROUP) * stride_qh
    q = gl.load(q_ptr + q_rows[:, None] + qd[None, :], mask=q_valid[:, None], other=0)
    if KV_KIND == KIND_FP8:
        q = q.to(gl.float8e4nv, bitcast=True)  # e4m3 codes travel as uint8
    q_smem = q_bufs.index(WG)
    q_smem.store(q)
    fence_async_shared()
    _gc.cta_barrier()  # this warpgroup's threads (a named barrier inside a partition)

    offs_m = gl.arange(0, BLOCK_M, layout=ROW)
    tok = offs_m // GROUP
    row_valid = (tok < BLOCK_Q) & (tok < q_len)
    row_scale = gl.load(q_scale_ptr + (q_start + tok).to(gl.int64) * stride_qst
                        + (kv_head * GROUP + offs_m % GROUP) * stride_qsh, mask=row_valid, other=1.0) * qk_scale
    full_end = ((ctx + 1) // BLOCK_N) * BLOCK_N  # keys every query token sees
    row_limit = gl.minimum(ctx + tok, kv_end - 1)

    m_i = gl.full([BLOCK_M], NEG_BIG, gl.float32, ROW)
    l_i = gl.zeros([BLOCK_M], gl.float32, ROW)
    r_i = gl.full([BLOCK_M], 1.0, gl.float32, ROW)
    acc0 = gl.zeros([BLOCK_M, DV], gl.float32, PV_LAYOUT)
    acc1 = acc0
    acc2 = acc0
    acc3 = acc0
    acc4 = acc0  # chunks 4-7: int8 PV in 32-column chunks at head_dim 256
    acc5 = acc0
    acc6 = acc0
    acc7 = acc0
    if PV_KIND == PV_INT8:
        levels: gl.constexpr = 127.0
    else:
        levels: gl.constexpr = 448.0

    for k in range(0, count):
        i = 2 * k + WG
        st = i % STAGES
        start = (lo + k) * BLOCK_N
        mbarrier.wait(ready.index(st), (i // STAGES) & 1)
        fence_async_shared()
        s = warpgroup_mma_wait(0, deps=[_qk(q_smem, k_ring.index(st), BLOCK_M, BLOCK_N, KV_KIND, QK_LAYOUT)])
        k_scale, v_scale = _stage_scales(ks_ring.index(st), vs_ring.index(st), start, kv_end, BLOCK_N, COL)
        p_op, factor, m_i, l_i, r_i = _softmax_tile(s, k_scale, v_scale, m_i, l_i, r_i, row_scale, row_limit, start,
                                                     full_end, levels, BLOCK_N, KV_KIND, PV_KIND, COL, PV_ROW,
                                                     P_LAYOUT)
        v_buf = v_ring.index(st)
        if PV_KIND == PV_INT8:
            acc0, acc1, acc2, acc3 = _pv_int8_chunks(acc0, acc1, acc2, acc3, p_op, factor, v_buf, 0, BLOCK_M, DV,
                                                     NUM_DV, PV_LAYOUT)
            if NUM_DV > 4:
                acc4, acc5, acc6, acc7 = _pv_int8_chunks(acc4, acc5, acc6, acc7, p_op, factor, v_buf, 4, BLOCK_M,
                                                         DV, NUM_DV, PV_LAYOUT)
        else:
            acc0 = _pv_8bit(acc0, p_op, factor, _v_chunk(v_buf, 0, DV), BLOCK_M, DV, PV_KIND, PV_LAYOUT)
            if NUM_DV > 1:
                acc1 = _pv_8bit(acc1, p_op, factor, _v_chunk(v_buf, 1, DV), BLOCK_M, DV, PV_KIND, PV_LAYOUT)
            if NUM_DV > 2:
                acc2 = _pv_8bit(acc2, p_op, factor, _v_chunk(v_buf, 2, DV), BLOCK_M, DV, PV_KIND, PV_LAYOUT)
                acc3 = _pv_8bit(acc3, p_op, factor, _v_chunk(v_buf, 3, DV), BLOCK_M, DV, PV_KIND, PV_LAYOUT)
        mbarrier.arrive(empty.index(st), count=1)

    r_i = gl.where(poison != 0, float("nan"), r_i)  # metadata out of range: NaN rows (partials)
    if vsplit < n_virtual:
        if n_virtual == 1:
            _store_output(out_ptr, acc0, acc1, acc2, acc3, l_i, r_i, q_start, 0, q_len, kv_head, stride_ot,
                          stride_oh, GROUP, BLOCK_M, BLOCK_Q, DV, NUM_DV, PV_LAYOUT)
            if NUM_DV > 4:
                _store_output(out_ptr, acc4, acc5, acc6, acc7, l_i, r_i, q_start, 0, q_len, kv_head, stride_ot,
                              stride_oh, GROUP, BLOCK_M, BLOCK_Q, DV, NUM_DV, PV_LAYOUT, 0, 4 * DV)
        else:
            _store_partials(part_acc_ptr + vsplit * stride_ps, part_ml_ptr + vsplit * stride_ms, acc0, acc1, acc2,
                            acc3, m_i, l_i, r_i, q_start, q_len, kv_head, stride_pt, stride_ph, stride_mt, stride_mh,
                            GROUP, BLOCK_M, BLOCK_Q, DV, NUM_DV, PV_LAYOUT, ROW)
            if NUM_DV > 4:
                _store_partials(part_acc_ptr + vsplit * stride_ps, part_ml_ptr + vsplit * stride_ms, acc4, acc5,
                                acc6, acc7, m_i, l_i, r_i, q_start, q_len, kv_head, stride_pt, stride_ph, stride_mt,
                                stride_mh, GROUP, BLOCK_M, BLOCK_Q, DV, NUM_DV, PV_LAYOUT, ROW, 4 * DV)


@gluon.jit
def _store_partials(acc_ptr, ml_ptr, acc0, acc1, acc2, acc3, m_i, l_i, r_i, q_start, q_len, kv_head,
                    stride_pt, stride_ph, stride_mt, stride_mh, GROUP: gl.constexpr, BLOCK_M: gl.constexpr,
                    BLOCK_Q: gl.constexpr, DV: gl.constexpr, NUM_DV: gl.constexpr, PV_LAYOUT: gl.constexpr,
                    ROW: gl.constexpr, COL0: gl.constexpr = 0):
    """One virtual split's partial rows in the portable kernel's format: the accumulator in
    true units (``acc * r``) of up to four column chunks from ``COL0``, and (with the first
    chunks) each row's running max and sum."""
    scale = gl.convert_layout(r_i, gl.SliceLayout(1, PV_LAYOUT))
    _store_rows(acc_ptr, acc0, COL0, scale, q_start, 0, q_len, kv_head, stride_pt, stride_ph, GROUP, BLOCK_M, BLOCK_Q,
                DV, PV_LAYOUT, 0)
    if NUM_DV > 1:
        _store_rows(acc_ptr, acc1, COL0 + DV, scale, q_start, 0, q_len, kv_head, stride_pt, stride_ph, GROUP,
                    BLOCK_M, BLOCK_Q, DV, PV_LAYOUT, 0)
    if NUM_DV > 2:
        _store_rows(acc_ptr, acc2, COL0 + 2 * DV, scale, q_start, 0, q_len, kv_head, stride_pt, stride_ph, GROUP,
                    BLOCK_M, BLOCK_Q, DV, PV_LAYOUT, 0)
        _store_rows(acc_ptr, acc3, COL0 + 3 * DV, scale, q_start, 0, q_len, kv_head, stride_pt, stride_ph, GROUP,
                    BLOCK_M, BLOCK_Q, DV, PV_LAYOUT, 0)
    if COL0 == 0:
        offs_m = gl.arange(0, BLOCK_M, layout=ROW)
        tok = offs_m // GROUP
        valid = (tok < BLOCK_Q) & (tok < q_len)
        ml = ml_ptr + (q_start + tok).to(gl.int64) * stride_mt + (kv_head * GROUP + offs_m % GROUP) * stride_mh
        gl.store(ml, m_i, mask=valid)
        gl.store(ml + 1, l_i, mask=valid)


@gluon.jit
def _decode_hopper_kernel(
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
    GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, PAGE: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_Q: gl.constexpr, BLOCK_N: gl.constexpr, DV: gl.constexpr,
    KV_KIND: gl.constexpr, PV_KIND: gl.constexpr, STAGES: gl.constexpr,
    QK_LAYOUT: gl.constexpr, PV_LAYOUT: gl.constexpr, P_LAYOUT: gl.constexpr,
    Q_SMEM: gl.constexpr, K_SMEM: gl.constexpr, V_SMEM: gl.constexpr, V16_SMEM: gl.constexpr,
    LOAD_Q: gl.constexpr, LOAD_K: gl.constexpr, LOAD_V: gl.constexpr,
    LOAD_S: gl.constexpr, PV_IN_FLIGHT: gl.constexpr, QK_AHEAD: gl.constexpr, CONSUMER_REGS: gl.constexpr,
    LOADER_REGS: gl.constexpr,
):
    gl.static_assert(KV_KIND != KIND_BF16, "8-bit caches only")
    gl.static_assert(STAGES >= 2, "a ring of at least two stages")
    split = gl.program_id(0)
    kv_head = gl.program_id(1)
    seq = gl.program_id(2)
    bt_row = block_table_ptr + seq.to(gl.int64) * stride_bt
    q_start, q_len, seq_len, num_tiles, n_virtual, lo, n_items, poison = _checked_program(
        query_start_loc_ptr, seq_lens_ptr, bt_row, flags_ptr, seq, split, num_splits, max_query_len, num_tokens,
        num_blocks, max_blocks, PAGE, BLOCK_N, 2)
    if (q_len <= 0) | (q_len > max_query_len) | (2 * split >= n_virtual):
        return  # nothing to do, left to the prefill kernel (max_query_len <= BLOCK_Q), or no tiles
    ctx = seq_len - q_len
    last_page = (seq_len - 1) // PAGE

    elem: gl.constexpr = k_ptr.dtype.element_ty
    q_bufs = gl.allocate_shared_memory(elem, [2, WG_ROWS, HEAD_DIM], Q_SMEM)
    # each ring stage has one reader: the consumer whose virtual split owns its tile
    k_ring, v_ring, ks_ring, vs_ring, ready, empty = _alloc_ring(elem, STAGES, BLOCK_N, HEAD_DIM, KV_KIND, K_SMEM,
                                                                 V_SMEM, 1)

    gl.warp_specialize([
        (_decode_consumer, (q_ptr, q_scale_ptr, out_ptr, part_acc_ptr, part_ml_ptr, q_bufs, k_ring, v_ring, ks_ring,
                            vs_ring, ready, empty, kv_head, q_start, q_len, ctx, seq_len, split, num_tiles,
                            n_virtual, poison, qk_scale, stride_qt, stride_qh, stride_qst, stride_qsh, stride_ot,
                            stride_oh, stride_pt, stride_ph, stride_ps, stride_mt, stride_mh, stride_ms,
                            0, GROUP, HEAD_DIM, BLOCK_Q, BLOCK_N, DV, KV_KIND, PV_KIND, STAGES, QK_LAYOUT, PV_LAYOUT,
                            P_LAYOUT, LOAD_Q)),
        (_decode_consumer, (q_ptr, q_scale_ptr, out_ptr, part_acc_ptr, part_ml_ptr, q_bufs, k_ring, v_ring, ks_ring,
                            vs_ring, ready, empty, kv_head, q_start, q_len, ctx, seq_len, split, num_tiles,
                            n_virtual, poison, qk_scale, stride_qt, stride_qh, stride_qst, stride_qsh, stride_ot,
                            stride_oh, stride_pt, stride_ph, stride_ps, stride_mt, stride_mh, stride_ms,
                            1, GROUP, HEAD_DIM, BLOCK_Q, BLOCK_N, DV, KV_KIND, PV_KIND, STAGES, QK_LAYOUT, PV_LAYOUT,
                            P_LAYOUT, LOAD_Q)),
        (_decode_loader, (k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, bt_row, kv_head.to(gl.int64) * stride_ch,
                          kv_head.to(gl.int64) * stride_sh, stride_cb, stride_sb, seq_len, last_page, num_blocks,
                          num_tiles, n_virtual, 2 * split, n_items, k_ring, v_ring, ks_ring, vs_ring, ready, empty,
                          HEAD_DIM, PAGE, BLOCK_N, STAGES, KV_KIND, LOAD_K, LOAD_V, LOAD_S, 2)),
    ], [4, LOADER_WARPS], [CONSUMER_REGS, LOADER_REGS])
