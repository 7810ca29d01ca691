"""Chunked-prefill attention for Hopper (sm_90) in Gluon: the function of
:mod:`int8attn.kernels.prefill` (same rows, scales, masking and P quantization) built from
warpgroup MMAs fed from shared memory.

One program owns one (query tile, KV head); its ``BLOCK_M`` rows pack the ``GROUP`` query
heads of the KV head times ``BLOCK_Q = BLOCK_M // GROUP`` tokens of one sequence (row
``r``: token ``r // GROUP``, head ``kv_head * GROUP + r % GROUP``; rows past
``BLOCK_Q * GROUP`` are padding), ``BLOCK_M // 16`` warps (one or two warpgroups, 64 rows
each). Query token ``j`` sits at ``seq_len - q_len + j`` and sees keys at positions ``<=``
its own; tiles past the last row's position are never loaded.

Data path per KV tile of ``BLOCK_N`` keys (``STAGES``-deep shared-memory ring, filled
with cp.async ``STAGES - 1`` tiles ahead of the one being consumed):

* K: one [BLOCK_N, HEAD_DIM] tile, rows gathered per key through the block table
  (16-byte cp.async per thread, 128-byte swizzled ``NVMMASharedLayout``); QK is
  ``warpgroup_mma(Q_smem, K_smem^T)``: s8 x s8 -> s32 from zero, converted to fp32 by one
  I2FP per score (exact: the dot is below 2**24), or e4m3 x e4m3 -> f32. Q is quantized
  before the launch (one pre-pass) and sits in shared memory for the whole program.
* V: the 8-bit pages are stored transposed ([HEAD_DIM, PAGE], keys contiguous), so the
  [HEAD_DIM, BLOCK_N] tile is gathered page run by page run with 16-byte cp.async and is
  already the K-major B operand the 8-bit MMA needs (``v_smem.permute``: [BLOCK_N, D]).
* Scores ``t * row_scale`` in base 2 with the key scale per column and
  ``row_scale = sQ * softmax_scale * log2(e)``; the causal mask only on tiles that reach
  past the first row's position; online softmax with ``exp2``.
* PV: ``PV_INT8`` P quantized per row and tile (``r = rowmax(p * sV) / 127``, floored at
  ``max(sV) * 2**-20 / 127``), s8 x s8 -> s32 per ``DV``-column chunk, the accumulator
  kept in units of ``r``; ``PV_FP8`` ``r = rowmax / 448``, e4m3 P, f32 accumulate in the
  MMA; ``PV_BF16`` (16-bit PV of an 8-bit cache): the V tile is converted to fp16 in
  registers into a second buffer and P = ``p * sV / unit`` in fp16, ``unit`` 16 x the
  largest V scale of the first tile (portable kernel's rule). Keys past the sequence read
  valid memory (pages clamped to the sequence's last page) and meet P = 0; e4m3 V of the
  tile that crosses the end is zeroed in shared memory first (stale bytes may be NaN).

Tensor layouts as :mod:`int8attn.kernels.prefill` with the query pre-quantized: q
[T, Hq, D] int8 | e4m3 (as uint8), q_scale [T, Hq] fp32; key [num_blocks, Hkv, PAGE, D]; value
[num_blocks, Hkv, D, PAGE]; key_scale / value_scale [num_blocks, Hkv, PAGE] fp32;
block_table [num_seqs, max_blocks] int32; seq_lens [num_seqs], query_start_loc
[num_seqs + 1] int32; flags [3] int32 (:func:`int8attn.errors.error_flags`); out [T, Hq, D]
bf16. Grid: (T // BLOCK_Q + num_seqs, Hkv), tiles numbered as in vLLM's unified attention
and taken longest first (see the portable kernel).

Metadata is not trusted (:func:`_checked_tile`, the portable kernel's rules): a sequence
whose query range leaves ``[0, num_tokens]`` or exceeds its ``seq_len``, whose ``seq_len``
is negative or beyond its block-table row, or whose block ids below ``seq_len`` leave
``[0, num_blocks)`` reads no key, gets NaN rows (within its clamped query range) and raises
the device error flags naming it.

Layouts (register and shared) are built on the host by :func:`kernel_layouts` and passed
as constexprs, so the kernel source holds no version-specific layout code.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared,
                                                                warpgroup_mma)

from . import _gluon_compat as _gc
from ._errors import ERR_BLOCK_ID, ERR_QUERY_LEN, ERR_SEQ_LEN
from .codes import KIND_BF16, KIND_FP8, KIND_INT8, PV_BF16, PV_FP8, PV_INT8

MAGIC_F = gl.constexpr(12582912.0)
MAGIC_I = gl.constexpr(0x4B400000)
NEG_BIG = gl.constexpr(-1.0e30)
MIN_REL_STEP = gl.constexpr(9.5367431640625e-07)
P_UNIT_MARGIN = gl.constexpr(16.0)

#: wgmma N sizes allowed with 8-bit integer operands (floating point: any multiple of 8 <= 256).
_INT8_N = (224, 208, 192, 176, 160, 144, 128, 112, 96, 80, 64, 48, 32, 24, 16, 8)


def _instr_n(n: int, integer: bool) -> int:
    """Largest wgmma N dividing ``n`` (the whole tile per instruction where allowed)."""
    for cand in (_INT8_N if integer else range(256, 7, -8)):
        if cand <= n and n % cand == 0:
            return cand
    raise ValueError(f"no wgmma N divides {n}")


def _copy_layout(rows: int, cols: int, elem_bytes: int, num_warps: int):
    """Blocked layout of a [rows, cols] copy, 16 contiguous bytes per thread along cols."""
    vec = 16 // elem_bytes
    tpc = max(1, min(32, cols // vec))
    return gl.BlockedLayout([1, vec], [32 // tpc, tpc], [num_warps, 1], [1, 0])


def kernel_layouts(block_m: int, block_n: int, head_dim: int, dv: int, kv_kind: int, pv_kind: int) -> dict:
    """The layout constexprs of :func:`_prefill_hopper_kernel` for one tiling."""
    num_warps = block_m // 16
    bf16 = kv_kind == KIND_BF16.value  # a BF16 cache (warp-specialized kernel only): 16-bit QK, V pages row-major
    qk_k = 16 if bf16 else 32  # k = 256 / operand bits
    qk = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                   instr_shape=[16, _instr_n(block_n, kv_kind == KIND_INT8.value), qk_k])
    pv_bits = 16 if pv_kind == PV_BF16.value else 8
    pv = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                   instr_shape=[16, _instr_n(dv, pv_kind == PV_INT8.value), 256 // pv_bits])
    elem = gl.bfloat16 if bf16 else gl.int8 if kv_kind == KIND_INT8.value else gl.float8e4nv
    size = 2 if bf16 else 1
    v_shape = [block_n, head_dim] if bf16 else [head_dim, block_n]
    return dict(
        QK_LAYOUT=qk, PV_LAYOUT=pv,
        P_LAYOUT=gl.DotOperandLayout(operand_index=0, parent=pv, k_width=32 // pv_bits),
        Q_SMEM=gl.NVMMASharedLayout.get_default_for([block_m, head_dim], elem),
        K_SMEM=gl.NVMMASharedLayout.get_default_for([block_n, head_dim], elem),
        V_SMEM=gl.NVMMASharedLayout.get_default_for(v_shape, elem),
        V16_SMEM=gl.NVMMASharedLayout.get_default_for([head_dim, block_n], gl.float16),
        LOAD_Q=_copy_layout(block_m, head_dim, size, num_warps),
        LOAD_K=_copy_layout(block_n, head_dim, size, num_warps),
        LOAD_V=_copy_layout(v_shape[0], v_shape[1], size, num_warps),
    )


@gluon.jit
def _find_seq(query_start_loc_ptr, tile, num_seqs, BLOCK_Q: gl.constexpr):
    """Largest ``s`` with ``qsl[s] // BLOCK_Q + s <= tile`` (binary search)."""
    # tensors from the start (num_seqs == 1 arrives as a constexpr on a launch)
    lo = tile * 0
    hi = lo + num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = gl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@gluon.jit
def _page_of(n, PAGE: gl.constexpr):
    """The page of key positions ``n`` (>= 0), divided unsigned: a shift for a power-of-two
    ``PAGE``, where a signed ``//`` adds a sign fix-up per element to the loader's loop."""
    return (n.to(gl.uint32) // PAGE).to(gl.int32)


@gluon.jit
def _slot_of(n, PAGE: gl.constexpr):
    """The slot in its page of key positions ``n`` (>= 0); unsigned like :func:`_page_of`."""
    return (n.to(gl.uint32) % PAGE).to(gl.int32)


@gluon.jit
def _page_ids(j, bt_row, last_page, PAGE: gl.constexpr, BLOCK_N: gl.constexpr, LAYOUT: gl.constexpr):
    """The block id of each key of tile ``j`` (a ``[BLOCK_N]`` int32 vector in ``LAYOUT``), pages
    past the sequence's last page read as that page (in bounds, P = 0)."""
    n = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=LAYOUT)
    return gl.load(bt_row + gl.minimum(_page_of(n, PAGE), last_page))


@gluon.jit
def _page_blocks(j, bt_row, last_page, PAGE: gl.constexpr, BLOCK_N: gl.constexpr, LAYOUT: gl.constexpr):
    """:func:`_page_ids` widened to int64, ready to scale by a cache stride."""
    return _page_ids(j, bt_row, last_page, PAGE, BLOCK_N, LAYOUT).to(gl.int64)


@gluon.jit
def _issue_rows(j, buf, ptr, bt_row, data_head, stride_cb, last_page, HEAD_DIM: gl.constexpr, PAGE: gl.constexpr,
                BLOCK_N: gl.constexpr, LOAD: gl.constexpr):
    """cp.async of the ``[BLOCK_N, HEAD_DIM]`` rows of tile ``j`` from row-major pages (K, or a
    BF16 cache's V) into ``buf``; pages past the last are read from it (in bounds, P = 0)."""
    kblk = _page_blocks(j, bt_row, last_page, PAGE, BLOCK_N, gl.SliceLayout(1, LOAD))
    _issue_rows_at(j, kblk, buf, ptr, data_head, stride_cb, HEAD_DIM, PAGE, BLOCK_N, LOAD)


@gluon.jit
def _issue_rows_at(j, kblk, buf, ptr, data_head, stride_cb, HEAD_DIM: gl.constexpr, PAGE: gl.constexpr,
                   BLOCK_N: gl.constexpr, LOAD: gl.constexpr):
    """:func:`_issue_rows` with the tile's block ids given (``_page_blocks`` in
    ``SliceLayout(1, LOAD)``)."""
    kn = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LOAD))
    kd = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, LOAD))
    krow = gl.multiple_of(kblk * stride_cb + data_head + _slot_of(kn, PAGE) * HEAD_DIM, 16)
    _gc.cp_async(buf, ptr + krow[:, None] + kd[None, :])


@gluon.jit
def _issue_tile(j, k_buf, v_buf, k_ptr, v_ptr, bt_row, data_head, stride_cb, last_page,
                HEAD_DIM: gl.constexpr, PAGE: gl.constexpr, BLOCK_N: gl.constexpr,
                LOAD_K: gl.constexpr, LOAD_V: gl.constexpr):
    """cp.async of KV tile ``j`` (keys ``[j * BLOCK_N, (j + 1) * BLOCK_N)``) into one ring
    stage. Pages past the sequence's last page are read from that page (in bounds, P = 0)."""
    _issue_rows(j, k_buf, k_ptr, bt_row, data_head, stride_cb, last_page, HEAD_DIM, PAGE, BLOCK_N, LOAD_K)
    vblk = _page_blocks(j, bt_row, last_page, PAGE, BLOCK_N, gl.SliceLayout(0, LOAD_V))
    _issue_v_pages_at(j, vblk, v_buf, v_ptr, data_head, stride_cb, HEAD_DIM, PAGE, BLOCK_N, LOAD_V)


@gluon.jit
def _issue_v_pages_at(j, vblk, v_buf, v_ptr, data_head, stride_cb, HEAD_DIM: gl.constexpr, PAGE: gl.constexpr,
                      BLOCK_N: gl.constexpr, LOAD_V: gl.constexpr):
    """cp.async of tile ``j``'s V^T pages (8-bit caches), block ids given (``_page_blocks`` in
    ``SliceLayout(0, LOAD_V)``): keys of one page are a contiguous run of RUN >= 16 bytes per
    channel."""
    RUN: gl.constexpr = PAGE if PAGE < BLOCK_N else BLOCK_N
    vd = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(1, LOAD_V))
    vn = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, LOAD_V))
    voff = vblk * stride_cb + data_head + _slot_of(vn, PAGE)
    voff = gl.max_contiguous(gl.multiple_of(voff, 16), RUN)
    _gc.cp_async(v_buf, v_ptr + vd[:, None] * PAGE + voff[None, :])


@gluon.jit
def _raise_flags(flags_ptr, bits, seq):
    """Raise the device error ``bits`` for sequence ``seq`` (nothing when ``bits`` is 0):
    the flags of :func:`int8attn.errors.error_flags` -- the bits, the lowest sequence index,
    a count of raising programs."""
    if bits != 0:
        gl.atomic_or(flags_ptr, bits)
        gl.atomic_min(flags_ptr + 1, seq)
        gl.atomic_add(flags_ptr + 2, 1)


@gluon.jit
def _bad_block_ids(bt_row, first_page, end_page, num_blocks):
    """How many block ids of pages ``[first_page, end_page)`` of a block-table row leave
    ``[0, num_blocks)`` (128 ids per load, the calling partition's warps)."""
    SCAN: gl.constexpr = 128
    ids_layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    bad = 0
    for p0 in range(first_page, end_page, SCAN):
        page = p0 + gl.arange(0, SCAN, layout=ids_layout)
        ids = gl.load(bt_row + page, mask=page < end_page, other=0)
        bad += gl.sum(((ids < 0) | (ids >= num_blocks)).to(gl.int32), 0)
    return bad


@gluon.jit
def _checked_tile(query_start_loc_ptr, seq_lens_ptr, block_table_ptr, flags_ptr, out_ptr, num_seqs, num_tiles,
                  num_tokens, num_blocks, max_blocks, min_query_len, stride_bt, stride_ot, stride_oh,
                  GROUP: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_Q: gl.constexpr, HEAD_DIM: gl.constexpr,
                  PAGE: gl.constexpr):
    """The (query tile, KV head) of this program, longest tiles first, with its metadata
    clamped so that nothing it reads or writes lies outside the query, the output, its
    block-table row or the cache, whatever the metadata holds (the portable kernel's rules):
    the query range is clamped into ``[0, num_tokens]``; a range that leaves it, decreases or
    exceeds ``seq_len``, a ``seq_len`` negative or beyond the row's ``max_blocks`` pages, or a
    block id of the sequence's pages below ``seq_len`` outside ``[0, num_blocks)`` makes the
    sequence *bad*: its programs write NaN rows here (:func:`_store_nan_rows`) and raise the
    device flags. Every program of a sequence scans the same ids, so its rows agree.
    Returns (run, kv_head, seq, q_start, q_tile, q_len, seq_len): ``run`` false for a program
    with nothing left to do -- no rows, or a bad sequence's NaN rows written -- which returns
    at once, before any K/V address is formed."""
    tile = num_tiles - 1 - gl.program_id(0)
    kv_head = gl.program_id(1)
    seq = gl.maximum(_find_seq(query_start_loc_ptr, tile, num_seqs, BLOCK_Q), 0)
    q_start = gl.load(query_start_loc_ptr + seq)
    q_end = gl.load(query_start_loc_ptr + seq + 1)
    seq_len = gl.load(seq_lens_ptr + seq)
    q_tile = tile - (q_start // BLOCK_Q + seq)
    bad_q = (q_start < 0) | (q_end < q_start) | (q_end > num_tokens) | (q_end - q_start > seq_len)
    bad_len = (seq_len < 0) | (seq_len > max_blocks * PAGE)
    q_start = gl.minimum(gl.maximum(q_start, 0), num_tokens)
    q_len = gl.maximum(gl.minimum(q_end, num_tokens) - q_start, 0)
    run = (q_len > min_query_len) & (q_tile >= 0) & (q_tile * BLOCK_Q < q_len)
    bits = bad_q.to(gl.int32) * ERR_QUERY_LEN + bad_len.to(gl.int32) * ERR_SEQ_LEN
    if run & (bits == 0):
        bad_ids = _bad_block_ids(block_table_ptr + seq.to(gl.int64) * stride_bt, 0, (seq_len + PAGE - 1) // PAGE,
                                 num_blocks)
        bits += (bad_ids > 0).to(gl.int32) * ERR_BLOCK_ID
    _raise_flags(flags_ptr, bits, seq)
    if run & (bits != 0):
        _store_nan_rows(out_ptr, q_start, q_tile, q_len, kv_head, stride_ot, stride_oh, GROUP, BLOCK_M, BLOCK_Q,
                        HEAD_DIM)
    return run & (bits == 0), kv_head, seq, q_start, q_tile, q_len, seq_len


@gluon.jit
def _store_nan_rows(out_ptr, q_start, q_tile, q_len, kv_head, stride_ot, stride_oh, GROUP: gl.constexpr,
                    BLOCK_M: gl.constexpr, BLOCK_Q: gl.constexpr, HEAD_DIM: gl.constexpr):
    """NaN in every output row of the program's tile (a sequence whose metadata is out of range);
    a block_m of 192 (no power of two) in three 64-row parts."""
    if BLOCK_M == 192:
        for r0 in gl.static_range(0, BLOCK_M, 64):
            _store_nan_part(out_ptr, q_start, q_tile, q_len, kv_head, stride_ot, stride_oh, r0, GROUP, 64, BLOCK_Q,
                            HEAD_DIM)
    else:
        _store_nan_part(out_ptr, q_start, q_tile, q_len, kv_head, stride_ot, stride_oh, 0, GROUP, BLOCK_M, BLOCK_Q,
                        HEAD_DIM)


@gluon.jit
def _store_nan_part(out_ptr, q_start, q_tile, q_len, kv_head, stride_ot, stride_oh, R0: gl.constexpr,
                    GROUP: gl.constexpr, PART: gl.constexpr, BLOCK_Q: gl.constexpr, HEAD_DIM: gl.constexpr):
    """:func:`_store_nan_rows` for rows ``R0 .. R0 + PART`` of the tile."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
    offs_m = R0 + gl.arange(0, PART, layout=gl.SliceLayout(1, layout))
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
    tok = q_tile * BLOCK_Q + offs_m // GROUP
    valid = (offs_m // GROUP < BLOCK_Q) & (tok < q_len)
    rows = (q_start + tok).to(gl.int64) * stride_ot + (kv_head * GROUP + offs_m % GROUP) * stride_oh
    nan = gl.full([PART, HEAD_DIM], float("nan"), out_ptr.dtype.element_ty, layout)
    gl.store(out_ptr + rows[:, None] + offs_d[None, :], nan, mask=valid[:, None])


@gluon.jit
def _load_q_tile(q_ptr, q_scale_ptr, k_ptr, q_start, q_tile, q_len, kv_head, qk_scale,
                 stride_qt, stride_qh, stride_qst, stride_qsh,
                 GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_Q: gl.constexpr,
                 KV_KIND: gl.constexpr, ROW: gl.constexpr, Q_SMEM: gl.constexpr, LOAD_Q: gl.constexpr):
    """The program's Q codes in shared memory (the A operand of every QK MMA, in the cache's
    element type), each row's query token and its score scale ``sQ * qk_scale``."""
    qm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, LOAD_Q))
    qd = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, LOAD_Q))
    q_tok = q_tile * BLOCK_Q + qm // GROUP
    q_valid = (qm // GROUP < BLOCK_Q) & (q_tok < q_len)
    q_rows = (q_start + q_tok).to(gl.int64) * stride_qt + (kv_head * GROUP + qm % GROUP) * stride_qh
    q = gl.load(q_ptr + q_rows[:, None] + qd[None, :], mask=q_valid[:, None], other=0)
    if KV_KIND == KIND_FP8:
        q = q.to(gl.float8e4nv, bitcast=True)  # e4m3 codes travel as uint8 (masked lanes load 0)
    q_smem = gl.allocate_shared_memory(k_ptr.dtype.element_ty, [BLOCK_M, HEAD_DIM], Q_SMEM, q)

    offs_m = gl.arange(0, BLOCK_M, layout=ROW)
    tok = q_tile * BLOCK_Q + offs_m // GROUP
    row_valid = (offs_m // GROUP < BLOCK_Q) & (tok < q_len)
    q_scale = gl.load(q_scale_ptr + (q_start + tok).to(gl.int64) * stride_qst
                      + (kv_head * GROUP + offs_m % GROUP) * stride_qsh, mask=row_valid, other=1.0)
    return q_smem, tok, q_scale * qk_scale


@gluon.jit
def _kv_range(ctx, q_tile, q_len, tok, BLOCK_Q: gl.constexpr, BLOCK_N: gl.constexpr, PAGE: gl.constexpr):
    """The keys the tile's rows see: ``[0, full_end)`` is visible to every row, ``[full_end,
    kv_end)`` is the diagonal band; each row's last visible key, the sequence's last page
    that holds one and the number of KV tiles."""
    first_tok = q_tile * BLOCK_Q
    last_tok = gl.minimum(q_len, first_tok + BLOCK_Q) - 1
    kv_end = ctx + last_tok + 1
    full_end = ((ctx + first_tok + 1) // BLOCK_N) * BLOCK_N
    row_limit = gl.minimum(ctx + tok, kv_end - 1)
    last_page = (kv_end - 1) // PAGE
    num_kv_tiles = (kv_end + BLOCK_N - 1) // BLOCK_N
    return kv_end, full_end, row_limit, last_page, num_kv_tiles


@gluon.jit
def _start_ring(k_ptr, v_ptr, bt_row, data_head, stride_cb, last_page, num_kv_tiles,
                HEAD_DIM: gl.constexpr, PAGE: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                K_SMEM: gl.constexpr, V_SMEM: gl.constexpr, LOAD_K: gl.constexpr, LOAD_V: gl.constexpr):
    """The K and V shared-memory rings, with tiles 0 .. STAGES - 2 in flight (one commit group
    each, empty past the last tile)."""
    k_ring = gl.allocate_shared_memory(k_ptr.dtype.element_ty, [STAGES, BLOCK_N, HEAD_DIM], K_SMEM)
    v_ring = gl.allocate_shared_memory(v_ptr.dtype.element_ty, [STAGES, HEAD_DIM, BLOCK_N], V_SMEM)
    for i in gl.static_range(STAGES - 1):
        if i < num_kv_tiles:
            _issue_tile(i, k_ring.index(i), v_ring.index(i), k_ptr, v_ptr, bt_row, data_head, stride_cb,
                        last_page, HEAD_DIM, PAGE, BLOCK_N, LOAD_K, LOAD_V)
        async_copy.commit_group()
    return k_ring, v_ring


@gluon.jit
def _zero_tail_keys(v_buf, start, kv_end, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, LOAD_V: gl.constexpr):
    """Zero the V^T columns of keys >= kv_end in shared memory (e4m3 stale bytes may be NaN,
    and NaN * 0 = NaN in the MMA), at most 128 channels at a time: the whole tile at head_dim
    256 is 32 registers per loader thread, which a 40-register loader partition spills."""
    keep = (start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, LOAD_V)) < kv_end)[None, :]
    if HEAD_DIM <= 128:
        vt = v_buf.load(LOAD_V)
        v_buf.store(gl.where(keep, vt, gl.zeros_like(vt)))
    else:
        for c in gl.static_range(0, HEAD_DIM, 128):  # 128 >= LOAD_V's rows: no replicated elements
            part = v_buf.slice(c, 128, dim=0)
            vt = part.load(LOAD_V)
            part.store(gl.where(keep, vt, gl.zeros_like(vt)))


@gluon.jit
def _pv_8bit(acc, p_op, factor, v_chunk, BLOCK_M: gl.constexpr, DV: gl.constexpr, PV_KIND: gl.constexpr,
             PV_LAYOUT: gl.constexpr):
    """``acc * factor + P . V_chunk`` for an 8-bit P (acc in units of the tile's ``r``)."""
    if PV_KIND == PV_INT8:
        start = gl.full([BLOCK_M, DV], MAGIC_I, gl.int32, PV_LAYOUT)
        o = warpgroup_mma(p_op, v_chunk, start).to(gl.float32, bitcast=True)
        acc = acc * factor[:, None] + (o - MAGIC_F)
    else:
        acc = warpgroup_mma(p_op, v_chunk, acc * factor[:, None])
    return acc


@gluon.jit
def _store_rows(out_ptr, acc, col0, norm, q_start, q_tile, q_len, kv_head, stride_ot, stride_oh,
                GROUP: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_Q: gl.constexpr, DV: gl.constexpr,
                PV_LAYOUT: gl.constexpr, ROW0: gl.constexpr):
    offs_m = ROW0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, PV_LAYOUT))
    offs_d = col0 + gl.arange(0, DV, layout=gl.SliceLayout(0, PV_LAYOUT))
    tok = q_tile * BLOCK_Q + offs_m // GROUP
    valid = (offs_m // GROUP < BLOCK_Q) & (tok < q_len)
    rows = (q_start + tok).to(gl.int64) * stride_ot + (kv_head * GROUP + offs_m % GROUP) * stride_oh
    o = acc * norm[:, None]
    gl.store(out_ptr + rows[:, None] + offs_d[None, :], o.to(out_ptr.dtype.element_ty), mask=valid[:, None])


@gluon.jit
def _store_output(out_ptr, acc0, acc1, acc2, acc3, l_i, r_i, q_start, q_tile, q_len, kv_head, stride_ot, stride_oh,
                  GROUP: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_Q: gl.constexpr, DV: gl.constexpr,
                  NUM_DV: gl.constexpr, PV_LAYOUT: gl.constexpr, ROW0: gl.constexpr = 0, COL0: gl.constexpr = 0):
    """The normalized output rows (``acc * r / l``; 0 for a row that saw no key) of up to four
    column chunks from column ``COL0`` (acc1..acc3 are ignored past NUM_DV); the accumulators
    hold the program's rows ``ROW0 .. ROW0 + BLOCK_M - 1``."""
    norm = gl.convert_layout(gl.where(l_i > 0.0, r_i / l_i, 0.0), gl.SliceLayout(1, PV_LAYOUT))
    _store_rows(out_ptr, acc0, COL0, norm, q_start, q_tile, q_len, kv_head, stride_ot, stride_oh,
                GROUP, BLOCK_M, BLOCK_Q, DV, PV_LAYOUT, ROW0)
    if NUM_DV > 1:
        _store_rows(out_ptr, acc1, COL0 + DV, norm, q_start, q_tile, q_len, kv_head, stride_ot, stride_oh,
                    GROUP, BLOCK_M, BLOCK_Q, DV, PV_LAYOUT, ROW0)
    if NUM_DV > 2:
        _store_rows(out_ptr, acc2, COL0 + 2 * DV, norm, q_start, q_tile, q_len, kv_head, stride_ot, stride_oh,
                    GROUP, BLOCK_M, BLOCK_Q, DV, PV_LAYOUT, ROW0)
        _store_rows(out_ptr, acc3, COL0 + 3 * DV, norm, q_start, q_tile, q_len, kv_head, stride_ot, stride_oh,
                    GROUP, BLOCK_M, BLOCK_Q, DV, PV_LAYOUT, ROW0)


@gluon.jit
def _prefill_hopper_kernel(
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
    k_ring, v_ring = _start_ring(k_ptr, v_ptr, bt_row, data_head, stride_cb, last_page, num_kv_tiles,
                                 HEAD_DIM, PAGE, BLOCK_N, STAGES, K_SMEM, V_SMEM, LOAD_K, LOAD_V)

    m_i = gl.full([BLOCK_M], NEG_BIG, gl.float32, ROW)
    l_i = gl.zeros([BLOCK_M], gl.float32, ROW)
    r_i = gl.full([BLOCK_M], 1.0, gl.float32, ROW)
    inv_unit = 1.0
    if PV_KIND == PV_BF16:
        # fp16 P unit: P_UNIT_MARGIN x the largest V scale of the first KV tile (see the
        # portable kernel: P = p * sV / unit stays far inside the fp16 range).
        pos0 = gl.arange(0, BLOCK_N, layout=COL)
        blk0 = gl.load(bt_row + gl.minimum(pos0 // PAGE, last_page)).to(gl.int64)
        v_first = gl.load(v_scale_ptr + blk0 * stride_sb + scale_head + pos0 % PAGE, mask=pos0 < kv_end,
                          other=0.0)
        unit = gl.max(v_first, 0) * P_UNIT_MARGIN
        unit = gl.where(unit > 0.0, unit, 1.0)
        inv_unit = 1.0 / unit
        r_i = r_i * unit
        v16 = gl.allocate_shared_memory(gl.float16, [HEAD_DIM, BLOCK_N], V16_SMEM)
    acc0 = gl.zeros([BLOCK_M, DV], gl.float32, PV_LAYOUT)
    acc1 = acc0
    acc2 = acc0
    acc3 = acc0

    for j in range(0, num_kv_tiles):
        stage = j % STAGES
        # tile j landed (this thread's copies), then every thread's copies and every
        # thread's reads of the stage refilled below (consumed at j - 1) are done
        async_copy.wait_group(STAGES - 2)
        fence_async_shared()
        _gc.cta_barrier()
        nxt = j + STAGES - 1
        if nxt < num_kv_tiles:
            _issue_tile(nxt, k_ring.index(nxt % STAGES), v_ring.index(nxt % STAGES), k_ptr, v_ptr, bt_row,
                        data_head, stride_cb, last_page, HEAD_DIM, PAGE, BLOCK_N, LOAD_K, LOAD_V)
        async_copy.commit_group()
        k_buf = k_ring.index(stage)
        v_buf = v_ring.index(stage)
        start = j * BLOCK_N

        # ---- scores t (base-2 score = t * row_scale), per-key K scale applied here
        offs_n = start + gl.arange(0, BLOCK_N, layout=COL)
        in_seq = offs_n < kv_end
        sblk = gl.load(bt_row + gl.minimum(offs_n // PAGE, last_page)).to(gl.int64)
        scale_off = sblk * stride_sb + scale_head + offs_n % PAGE
        k_scale = gl.load(k_scale_ptr + scale_off, mask=in_seq, other=0.0)
        v_scale = gl.load(v_scale_ptr + scale_off, mask=in_seq, other=0.0)
        if KV_KIND == KIND_INT8:  # from zero, one I2FP per score (prefill_hopper_pipe._k_scaled)
            s0 = gl.zeros([BLOCK_M, BLOCK_N], gl.int32, QK_LAYOUT)
            t = warpgroup_mma(q_smem, k_buf.permute((1, 0)), s0, use_acc=False).to(gl.float32) * k_scale[None, :]
        else:
            s0 = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, QK_LAYOUT)
            t = warpgroup_mma(q_smem, k_buf.permute((1, 0)), s0, use_acc=False) * k_scale[None, :]
        if start + BLOCK_N > full_end:
            t = gl.where(offs_n[None, :] <= row_limit[:, None], t, float("-inf"))

        # ---- online softmax (base 2)
        m_new = gl.maximum(m_i, gl.max(t, 1) * row_scale)
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(t * row_scale[:, None] - m_new[:, None])
        l_i = l_i * alpha + gl.sum(p, 1)
        m_i = m_new

        if PV_KIND == PV_BF16:
            # 8-bit V -> fp16 through registers into the 16-bit operand buffer
            vt = v_buf.load(LOAD_V)
            vh = vt.to(gl.float16)
            if start + BLOCK_N > kv_end:
                vn = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, LOAD_V))
                vh = gl.where((vn < kv_end)[None, :], vh, gl.zeros_like(vh))
            v16.store(vh)
            fence_async_shared()
            _gc.cta_barrier()
            p_op = gl.convert_layout((p * (v_scale * inv_unit)[None, :]).to(gl.float16), P_LAYOUT)
            factor = gl.convert_layout(alpha, PV_ROW)
            acc0 = warpgroup_mma(p_op, v16.slice(0, DV, dim=0).permute((1, 0)), acc0 * factor[:, None])
            if NUM_DV > 1:
                acc1 = warpgroup_mma(p_op, v16.slice(DV, DV, dim=0).permute((1, 0)), acc1 * factor[:, None])
            if NUM_DV > 2:
                acc2 = warpgroup_mma(p_op, v16.slice(2 * DV, DV, dim=0).permute((1, 0)), acc2 * factor[:, None])
                acc3 = warpgroup_mma(p_op, v16.slice(3 * DV, DV, dim=0).permute((1, 0)), acc3 * factor[:, None])
        else:
            if KV_KIND == KIND_FP8:
                if start + BLOCK_N > kv_end:
                    _zero_tail_keys(v_buf, start, kv_end, HEAD_DIM, BLOCK_N, LOAD_V)
                    fence_async_shared()
                    _gc.cta_barrier()
            pv = p * v_scale[None, :]
            if PV_KIND == PV_FP8:
                levels: gl.constexpr = 448.0
            else:
                levels: gl.constexpr = 127.0
            floor = gl.max(v_scale, 0) * MIN_REL_STEP
            r_new = gl.maximum(gl.max(pv, 1), floor) * (1.0 / levels)
            inv_r = 1.0 / r_new
            factor = gl.convert_layout(alpha * (r_i / r_new), PV_ROW)
            r_i = r_new
            if PV_KIND == PV_FP8:
                u = gl.minimum(pv * inv_r[:, None], 448.0)
                p_op = gl.convert_layout(u.to(gl.float8e4nv), P_LAYOUT)
            else:
                u = pv * inv_r[:, None] + MAGIC_F
                p_op = gl.convert_layout(u.to(gl.int32, bitcast=True).to(gl.int8), P_LAYOUT)
            acc0 = _pv_8bit(acc0, p_op, factor, v_buf.slice(0, DV, dim=0).permute((1, 0)),
                            BLOCK_M, DV, PV_KIND, PV_LAYOUT)
            if NUM_DV > 1:
                acc1 = _pv_8bit(acc1, p_op, factor, v_buf.slice(DV, DV, dim=0).permute((1, 0)),
                                BLOCK_M, DV, PV_KIND, PV_LAYOUT)
            if NUM_DV > 2:
                acc2 = _pv_8bit(acc2, p_op, factor, v_buf.slice(2 * DV, DV, dim=0).permute((1, 0)),
                                BLOCK_M, DV, PV_KIND, PV_LAYOUT)
                acc3 = _pv_8bit(acc3, p_op, factor, v_buf.slice(3 * DV, DV, dim=0).permute((1, 0)),
                                BLOCK_M, DV, PV_KIND, PV_LAYOUT)
    async_copy.wait_group(0)
    _store_output(out_ptr, acc0, acc1, acc2, acc3, l_i, r_i, q_start, q_tile, q_len, kv_head, stride_ot, stride_oh,
                  GROUP, BLOCK_M, BLOCK_Q, DV, NUM_DV, PV_LAYOUT)
