"""Split-K paged decode attention (1..8 query tokens per sequence) and its merge kernel.

One program of :func:`_decode_split_kernel` owns one (split, KV head, sequence). Its M
rows pack every query head of the KV group times the query tokens of one pass
(row ``r`` = token ``r // GROUP`` of the pass, head ``kv_head * GROUP + r % GROUP``),
padded to ``BLOCK_M >= 16`` rows, so each K/V tile is read from memory once for all of
them. With ``HEAD_SPLIT > 1`` the group's heads are shared out over that many programs
(grid axis 1 is ``KV head x HEAD_SPLIT``), each packing ``GROUP // HEAD_SPLIT`` heads:
a multi-token step then fits the 16-row tile, and sibling programs, adjacent in the
grid, read the same K/V tiles at about the same time (part of the second read hits L2).
The program walks its share of the sequence's KV tiles (``BLOCK_N`` keys, a
multiple of the page size; one block-table entry per page, broadcast to the page's keys).
When all the sequence's query tokens fit in one pass (the common case) Q, its scales and
the causal limits are loaded once before the tile loop; longer queries take a flat
(pass, tile) loop. K, V and the K scales are loaded without masks (see
:func:`_attend_tile`), so the loop body is mostly the arithmetic below:

* QK: ``tl.dot(Q, K^T)`` in the cache's precision -- int8 x int8 -> int32 (IMMA with
  16/32 rows, IGMMA with 64), e4m3 x e4m3 -> fp32 (QGMMA with 64 rows; with fewer rows
  Triton 3.6 converts e4m3 to f16 for mma.sync on sm_90), or bf16 -- then
  ``score = acc * sQ[row] * sK[col] * softmax_scale * log2(e)``: each key's scale is
  applied per column *before* the online softmax (exp2 form);
* masks: keys past ``seq_len`` (tile tail) and, for a multi-token step, keys after the
  query token's own position ``seq_len - q_len + j`` (causal);
* PV (``PV_KIND``): the V scale of each key is folded into P, then
  ``PV_INT8``: P quantized per row per tile to 0..255, stored as ``u - 128`` in int8,
  ``P . V = (u - 128) . V + 128 * colsum(V)`` with both products int8 -> int32 on the
  tensor cores (the colsum is a dot of a ones tile with V); ``PV_INT8_SIGNED``: P
  quantized to 0..127 (half the levels, a measurement variant); ``PV_FP8``: P
  quantized per row to e4m3, fp8 dot; ``PV_BF16``: V converted to bf16 in registers.

Operand-swapped tiles (``SWAP_AB``, 8-bit caches, :func:`_attend_tile_swapped`): the same
arithmetic transposed, ``S^T = K . Q^T`` and ``O^T += V^T . P^T``, so the tile's keys and
head_dim are the MMA's M dimension and the 16 packed rows its N: Hopper's warpgroup MMA
(M = 64 per warpgroup, N = 16 allowed) then runs the 16-row tile natively -- IGMMA for int8,
QGMMA for fp8, where the row-major 16-row e4m3 dot is lowered to HMMA after f16 conversions.
The softmax runs down the columns; its denominators are kept per (key, row) and summed once
per pass.

Splits: a sequence of ``num_tiles = cdiv(seq_len, BLOCK_N)`` tiles is cut into ``n_active
= min(num_splits, num_tiles)`` contiguous runs of tiles whose sizes differ by at most one
-- or, with ``CYCLIC_SPLITS``, dealt out in turn (split ``s`` takes tiles ``s, s +
num_splits, ...``: its first tiles are known before the sequence's length, see
:func:`_prefetch_block_ids`); programs with ``split >= n_active`` exit at once. The sizes
come from ``seq_len`` on the device, so the host never reads lengths. A sequence with one
active split writes its output directly; otherwise each split writes (running max, sum,
unnormalized output) per row to the workspace and :func:`_decode_merge_kernel` combines
them (``PDL_TRIGGER``, codes ``PDL_TRIGGER``: where the split programs let the merge
kernel, launched as their programmatic dependent, start) -- or, with ``FUSED_MERGE``
(codes ``MERGE``), the split kernel itself: the last of the sequence's splits to finish
(``MERGE_LAST``, :func:`_arrive_and_merge`) or, in a cooperative launch, every split after
a barrier, each its share of the columns (``MERGE_BARRIER``, :func:`_barrier_and_merge`);
counters ``counter_ptr`` [num_seqs, Hkv x HEAD_SPLIT, num_splits (last) or 2 (barrier)]
int32, which need no reset between launches: one launch per call. Sequences with ``q_len
== 0`` or ``q_len > MAX_QUERY_LEN`` are skipped (their rows are not written).

Query (``QUERY_IN``, codes ``QUERY_IN``): the kernel reads the query's codes and scales
(``codes``), or -- in a launch whose programs are all resident -- quantizes a float query
itself (``quantize`` / ``quantize_lam``, :func:`_quantize_slot_query`): split 0 of each
(sequence, grid axis 1) slot rounds the slot's rows into ``qc`` / ``qcs`` and the slot's
other splits wait for them on a ready count that precedes the merge's words in the
counters (one more word per slot). The query is then quantized once per launch, never
per split, and an eager decode that quantizes its query is one launch. ``QUERY_WAIT``: the
codes come from :func:`int8attn.kernels.quantize._quantize_query_kernel` launched just
before, this launch being its programmatic dependent (``griddepcontrol.wait`` once the
metadata is loaded, before any other access).

``STAMPS`` (both kernels; no library launch sets it): each program writes a row of times and
its SM id into ``stamp_ptr`` (:mod:`int8attn.kernels._timeline`), for the decode timeline
diagnostic; off, the kernels compile to the same instructions as without it.

head_dim: any multiple of 16 from 16 to 256. The tiles span ``BLOCK_D``, head_dim rounded
up to a power of two (``tl.arange`` and the MMA shapes need one); when the two differ, every
load masks the padding channels to zero (they add nothing to a score) and the stores skip
them. A power-of-two head_dim compiles without those masks.

Metadata: ``SAFE`` launches (the default; ``INT8ATTN_DECODE_SAFE=0`` builds launches
without) clamp query ranges, lengths and block ids before they form an address, give a
sequence whose metadata is out of range NaN rows and raise device error flags
(``flags_ptr``, :mod:`int8attn.errors`), as the prefill kernel always does; the trailing
arguments ``flags_ptr, num_tokens, num_blocks, max_blocks`` are read only then. Without
``SAFE`` the kernels trust the metadata and compile to the instructions they had before
the clamps existed.

Tensor layouts (strides passed explicitly, last dims unit stride):

* q [T, Hq, D] (int8 | e4m3 | bf16/fp16/fp32 for the bf16 cache), q_scale [T, Hq] fp32;
  with ``QUERY_IN != codes``: q the float query, q_scale the channel-migration scale
  [Hkv, D] fp32 contiguous (``quantize_lam``; unread otherwise), and qc [T, Hq, D] int8 |
  e4m3, qcs [T, Hq] fp32 the codes the launch writes and reads;
* cache key [num_blocks, Hkv, PAGE, D]; value [num_blocks, Hkv, D, PAGE] for 8-bit caches
  (pages transposed, see :func:`_load_v_pages`), [num_blocks, Hkv, PAGE, D] for bf16; both
  with key's block and head strides; key_scale/value_scale [num_blocks, Hkv, PAGE];
* block_table [num_seqs, max_blocks] int32, seq_lens [num_seqs] int32,
  query_start_loc [num_seqs + 1] int32;
* out [T, Hq, D]; part_acc [T, Hq, S, D] fp32; part_ml [T, Hq, S, 2] fp32 (max, sum).

The merge kernel folds a sequence's split partials online, a chunk of splits per step.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ._errors import ERR_BLOCK_ID, ERR_QUERY_LEN, ERR_SEQ_LEN, _raise_error
from ._masks import _visible
from ._timeline import MERGE_STAMP_WIDTH, SPLIT_STAMP_WIDTH, _program_row, _stamp, _stamp_sm
from .codes import (KIND_BF16, KIND_FP8, KIND_INT8, MERGE_BARRIER, MERGE_LAST, PDL_AT_START, PDL_AT_STORE, PV_BF16,
                    PV_FP8, PV_INT8, PV_INT8_SIGNED, QUERY_CODES, QUERY_QUANTIZE_LAM)
from .quantize import _quantize_rows, _round_to_e4m3_grid

#: Running-max start value: finite, so a row that sees no key in a tile keeps
#: ``exp2(-inf - NEG_BIG) = 0`` instead of ``exp2(-inf + inf) = NaN``.
NEG_BIG = tl.constexpr(-1.0e30)


@triton.jit
def _first_tile(seq_len, q_len, WINDOW: tl.constexpr, BLOCK_N: tl.constexpr):
    """The first KV tile any query token of the sequence sees: 0, or with a sliding
    ``WINDOW`` the tile of the first token's oldest visible key ``seq_len - q_len - WINDOW
    + 1``. Shared by both kernels, as the two below."""
    if WINDOW == 0:
        first = 0
    else:
        first = tl.maximum(seq_len - q_len - WINDOW + 1, 0) // BLOCK_N
    return first


@triton.jit
def _num_active_splits(seq_len, first_tile, num_splits, BLOCK_N: tl.constexpr):
    """Splits that hold at least one tile: ``min(num_splits, cdiv(seq_len, BLOCK_N) -
    first_tile)``.

    Shared by both kernels so they agree on which splits hold partials.
    """
    return tl.minimum(num_splits, tl.cdiv(seq_len, BLOCK_N) - first_tile)


@triton.jit
def _split_tiles(seq_len, first_tile, split, num_splits, BLOCK_N: tl.constexpr, CYCLIC: tl.constexpr):
    """Tiles ``lo, lo + step, ...`` (``count`` of them) of split ``split`` among the tiles
    from ``first_tile`` on: runs whose sizes differ by at most one, the non-empty ones
    first (step 1); with ``CYCLIC`` every ``num_splits``-th tile from ``first_tile +
    split`` (step ``num_splits``, the caller's). Either way splits below ``min(num_splits,
    tiles)`` hold at least one tile and the others none, so the merge sees the same active
    splits."""
    num_tiles = tl.cdiv(seq_len, BLOCK_N) - first_tile
    if CYCLIC:
        lo = first_tile + split
        count = tl.maximum(tl.cdiv(num_tiles - split, num_splits), 0)
    else:
        base = num_tiles // num_splits
        rem = num_tiles % num_splits
        lo = first_tile + split * base + tl.minimum(split, rem)
        count = base + (split < rem).to(tl.int32)
    return lo, count


#: ``prefetch.global.L1 [$1]`` when ``$2`` is non-zero (Triton has no prefetch op; the
#: result register only gives the asm an output).
PREFETCH_L1_PTX = tl.constexpr("{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L1 [$1]; mov.b32 $0, 0; }")
#: Tiles whose block ids a ``CYCLIC_SPLITS`` program prefetches before its metadata arrives.
PREFETCH_TILES = tl.constexpr(4)


@triton.jit
def _prefetch_block_ids(bt_row, split, num_splits, max_blocks, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """``CYCLIC_SPLITS`` without a window: the block ids of this split's first
    PREFETCH_TILES tiles (``split + k * num_splits``: they do not depend on the sequence's
    length) prefetched into L1 in the same issue slot as the length loads. A program's start
    is otherwise three dependent memory round trips (lengths -> block ids -> K/V); the
    pipeline's block-id copies then find their lines in L1. One line per tile (its first
    page's id; a tile's ids are contiguous); addresses past the table row are not touched
    (predicated off), and a split past the sequence's tiles only warms lines it never reads."""
    k = tl.arange(0, PREFETCH_TILES)
    page = (split + k * num_splits) * (BLOCK_N // PAGE)
    tl.inline_asm_elementwise(PREFETCH_L1_PTX, "=r,l,r", [bt_row + page, (page < max_blocks).to(tl.int32)],
                              dtype=tl.int32, is_pure=False, pack=1)




@triton.jit
def _untrusted_metadata(q_start, q_len, seq_len, num_tokens, max_blocks, PAGE: tl.constexpr,
                        MAX_QUERY_LEN: tl.constexpr):
    """``SAFE`` launches: a decode sequence's query range and length clamped into its
    tensors. A query range past ``num_tokens``, decreasing or longer than ``seq_len``, or a
    ``seq_len`` beyond its block-table row or negative, is bad: the range is clamped to the
    tokens that exist, ``seq_len`` into ``[1, max_blocks * PAGE]`` (so the sequence's
    programs still run and write its NaN rows). Shared by both kernels, so they agree on the splits.
    Returns (q_start, q_len, seq_len, bad_q, bad_len)."""
    q_end = q_start + q_len
    decode = (q_len > 0) & (q_len <= MAX_QUERY_LEN)
    # a decreasing range is flagged (it has no rows to poison); longer queries are prefill's
    bad_q = (q_len < 0) | (decode & ((q_start < 0) | (q_end > num_tokens) | (q_len > seq_len)))
    bad_len = decode & ((seq_len < 0) | (seq_len > max_blocks * PAGE))
    q_start = tl.minimum(tl.maximum(q_start, 0), num_tokens)
    q_len = tl.where(decode, tl.maximum(tl.minimum(q_end, num_tokens) - q_start, 0), q_len)
    seq_len = tl.where(bad_q | bad_len, tl.minimum(tl.maximum(seq_len, 1), max_blocks * PAGE), seq_len)
    return q_start, q_len, seq_len, bad_q, bad_len


# Integer arguments that only index scalars: not specialized, so one compiled kernel
# serves every split count and batch width (the vector strides stay specialized).
_SCALAR_ARGS = ["num_splits", "stride_qst", "stride_qsh", "stride_sb", "stride_sh", "stride_bt",
                "stride_mt", "stride_mh", "stride_ms", "num_tokens", "num_blocks", "max_blocks",
                "stride_cs", "stride_ck", "stride_qcst", "stride_qcsh"]


@triton.jit(do_not_specialize=_SCALAR_ARGS)
def _decode_split_kernel(
    q_ptr, q_scale_ptr,
    k_ptr, v_ptr, k_scale_ptr, v_scale_ptr,
    block_table_ptr, seq_lens_ptr, query_start_loc_ptr,
    out_ptr, part_acc_ptr, part_ml_ptr,
    qk_scale, num_splits,
    stride_qt, stride_qh, stride_qst, stride_qsh,
    stride_cb, stride_ch,
    stride_sb, stride_sh,
    stride_bt,
    stride_ot, stride_oh,
    stride_pt, stride_ph, stride_ps,
    stride_mt, stride_mh, stride_ms,
    flags_ptr, num_tokens, num_blocks, max_blocks,
    counter_ptr, stride_cs, stride_ck,
    qc_ptr, qcs_ptr, stride_qct, stride_qch, stride_qcst, stride_qcsh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, TOKENS_PER_PASS: tl.constexpr,
    MAX_QUERY_LEN: tl.constexpr, KV_KIND: tl.constexpr, PV_KIND: tl.constexpr,
    INTERPRET: tl.constexpr, SWAP_AB: tl.constexpr = False, SAFE: tl.constexpr = False,
    FUSED_MERGE: tl.constexpr = 0, MERGE_GROUP: tl.constexpr = 8, MERGE_M: tl.constexpr = 16,
    MERGE_CHUNK: tl.constexpr = 1, HEAD_SPLIT: tl.constexpr = 1, MERGE_COLS: tl.constexpr = 16,
    QUERY_IN: tl.constexpr = 0, WINDOW: tl.constexpr = 0, PDL_TRIGGER: tl.constexpr = 0,
    CYCLIC_SPLITS: tl.constexpr = False, QUERY_WAIT: tl.constexpr = False,
    stamp_ptr=None, STAMPS: tl.constexpr = False,
):
    if STAMPS:  # a timeline diagnostic's row (kernels._timeline.SPLIT_STAMPS)
        stamps = _program_row(stamp_ptr, SPLIT_STAMP_WIDTH)
        _stamp(stamps, 0, tl.program_id(0))
        _stamp_sm(stamps, 4)
    if PDL_TRIGGER == PDL_AT_START:
        # the merge kernel (launched as this grid's programmatic dependent) may start once
        # every program got here: its programs load their metadata while these run, then
        # wait for this whole grid (griddepcontrol.wait) before reading a partial
        gdc_launch_dependents()
    split = tl.program_id(0)
    # HEAD_SPLIT programs share a KV head, each with GROUP // HEAD_SPLIT of its query heads
    # (siblings read the same K/V tiles at about the same time: part of the second read
    # hits L2)
    kv_prog = tl.program_id(1)
    HEADS: tl.constexpr = GROUP // HEAD_SPLIT
    if HEAD_SPLIT == 1:
        kv_head = kv_prog
        head0 = kv_head * GROUP
    else:
        kv_head = kv_prog // HEAD_SPLIT
        head0 = kv_head * GROUP + (kv_prog % HEAD_SPLIT) * HEADS
    seq = tl.program_id(2)
    if CYCLIC_SPLITS and WINDOW == 0 and not INTERPRET:
        _prefetch_block_ids(block_table_ptr + seq.to(tl.int64) * stride_bt, split, num_splits, max_blocks, PAGE,
                            BLOCK_N)

    # The program's start is a chain of loads (lengths -> block table -> K/V). seq_len is
    # part of the exit test so that its load is issued with the query bounds, one memory
    # round trip for both (the compiler sinks a load below an exit that does not use it).
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    if STAMPS:
        _stamp(stamps, 1, seq_len + q_len)
    if QUERY_WAIT:
        # Launched as the query quantization's programmatic dependent: the metadata above is
        # the caller's, loaded while that grid runs; the codes are read and anything at all
        # is written only after the whole quantize grid has completed and flushed. Every
        # program waits (also those that exit below), so this grid never completes first.
        gdc_wait()
    bad = False
    if SAFE:
        q_start, q_len, seq_len, bad_q, bad_len = _untrusted_metadata(q_start, q_len, seq_len, num_tokens,
                                                                     max_blocks, PAGE, MAX_QUERY_LEN)
        bad = bad_q | bad_len
        _raise_error(flags_ptr, tl.where(bad_q, ERR_QUERY_LEN, 0) | tl.where(bad_len, ERR_SEQ_LEN, 0), seq,
                     bad & (split == 0) & (kv_prog == 0))
    if (q_len <= 0) | (q_len > MAX_QUERY_LEN) | (seq_len <= 0):
        return
    first_tile = _first_tile(seq_len, q_len, WINDOW, BLOCK_N)
    n_active = _num_active_splits(seq_len, first_tile, num_splits, BLOCK_N)
    if split >= n_active:
        return
    # the fused merges' counters of this program's (sequence, grid axis 1) slot
    counters = counter_ptr + seq.to(tl.int64) * stride_cs + kv_prog * stride_ck
    if QUERY_IN != QUERY_CODES:
        # split 0 quantizes the slot's query rows into qc / qcs; the others wait for them.
        # From here on the kernel reads those codes, as if they had been passed in.
        _quantize_slot_query(q_ptr, q_scale_ptr, qc_ptr, qcs_ptr, counters, q_start, q_len, kv_head, head0, split,
                             n_active, stride_qt, stride_qh, stride_qct, stride_qch, stride_qcst, stride_qcsh, HEADS,
                             HEAD_DIM, BLOCK_D, BLOCK_M, TOKENS_PER_PASS, KV_KIND, QUERY_IN == QUERY_QUANTIZE_LAM,
                             INTERPRET)
        counters = counters + 1  # the merges' words follow the query's ready count
        q_ptr, q_scale_ptr = qc_ptr, qcs_ptr
        stride_qt, stride_qh, stride_qst, stride_qsh = stride_qct, stride_qch, stride_qcst, stride_qcsh
    gen0 = 0
    if FUSED_MERGE == MERGE_BARRIER:
        # the barrier's generation, read now so that its round trip overlaps the tile loop
        # (it cannot change before this program arrives: see _barrier_and_merge)
        gen0 = tl.atomic_add(counters + 1, 0, sem="relaxed", scope="gpu")

    tile_lo, tile_count = _split_tiles(seq_len, first_tile, split, num_splits, BLOCK_N, CYCLIC_SPLITS)
    tile_step = 1
    if CYCLIC_SPLITS:
        tile_step = num_splits

    offs_m = tl.arange(0, BLOCK_M)
    row_tok = offs_m // HEADS
    row_head = head0 + offs_m % HEADS
    bt_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    data_head = kv_head.to(tl.int64) * stride_ch
    scale_head = kv_head.to(tl.int64) * stride_sh

    if q_len <= TOKENS_PER_PASS:
        # The common case: every query token of the sequence fits in one pass, so Q, its
        # scales and the causal limits are loaded once, outside the tile loop.
        row_valid = (row_tok < TOKENS_PER_PASS) & (row_tok < q_len)
        tok = (q_start + row_tok).to(tl.int64)
        row_limit = tl.where(row_valid, seq_len - q_len + row_tok, -1)
        q, row_scale = _load_query(q_ptr, q_scale_ptr, tok, row_head, row_valid, qk_scale, stride_qt, stride_qh,
                                   stride_qst, stride_qsh, HEAD_DIM, BLOCK_D, BLOCK_M, KV_KIND, INTERPRET,
                                   QUERY_IN != QUERY_CODES)
        m_i = tl.full([BLOCK_M], NEG_BIG, tl.float32)
        l_i = _zero_sums(BLOCK_N, BLOCK_M, SWAP_AB)
        acc = _zero_acc(BLOCK_D, BLOCK_M, SWAP_AB)
        # Only the sequence's last tile holds slots past seq_len. An fp8 cache zeroes their
        # V (stale e4m3 bytes may be NaN), so that tile is peeled off the loop (by the split
        # whose last tile it is) and the others skip the select; int8 and bf16 tiles take one loop.
        tile_end = tile_lo + tile_count * tile_step
        loop_end = tile_end
        if KV_KIND == KIND_FP8:
            if CYCLIC_SPLITS:
                loop_end = tl.where(tile_end - tile_step == tl.cdiv(seq_len, BLOCK_N) - 1, tile_end - tile_step,
                                    tile_end)
            else:
                loop_end = tl.minimum(tile_end, tl.cdiv(seq_len, BLOCK_N) - 1)
        bad_pages = _no_bad_pages(SAFE)
        for tile in range(tile_lo, loop_end, tile_step):
            m_i, l_i, acc, n_bad = _attend(q, row_scale, row_limit, m_i, l_i, acc, tile, seq_len, bt_row,
                                           k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, data_head, scale_head,
                                           stride_cb, stride_sb, num_blocks, HEAD_DIM, BLOCK_D, PAGE, BLOCK_N,
                                           BLOCK_M, KV_KIND, PV_KIND, KV_KIND != KIND_FP8, INTERPRET, SWAP_AB, SAFE, WINDOW)
            if SAFE:
                bad_pages += n_bad
        if KV_KIND == KIND_FP8:
            if loop_end < tile_end:
                m_i, l_i, acc, n_bad = _attend(q, row_scale, row_limit, m_i, l_i, acc, tile_end - tile_step, seq_len,
                                               bt_row, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, data_head, scale_head,
                                               stride_cb, stride_sb, num_blocks, HEAD_DIM, BLOCK_D, PAGE, BLOCK_N,
                                               BLOCK_M, KV_KIND, PV_KIND, True, INTERPRET, SWAP_AB, SAFE, WINDOW)
                if SAFE:
                    bad_pages += n_bad
        if STAMPS:
            _stamp(stamps, 2, tl.max(tl.max(acc, 1), 0))
        if PDL_TRIGGER == PDL_AT_STORE:
            # the tile loop is done: only the stores remain (multi-pass programs below store
            # inside their loop and trigger as they exit)
            gdc_launch_dependents()
        if SAFE:
            acc, l_i = _poison_bad(acc, l_i, bad, bad_pages, flags_ptr, seq, True)
        _store_rows(out_ptr, part_acc_ptr, part_ml_ptr, acc, m_i, _row_sums(l_i, SWAP_AB), tok, row_head, split,
                    n_active, row_valid, stride_ot, stride_oh, stride_pt, stride_ph, stride_ps, stride_mt, stride_mh,
                    stride_ms, HEAD_DIM, BLOCK_D, SWAP_AB)
    else:
        # Longer queries: one flat loop over (pass, tile). Two things keep Triton's
        # software pipeline intact (checked in the TTGIR: async waits leave tiles in
        # flight): the tile and pass are pure functions of the induction variable, and
        # the end-of-pass stores are masked stores, not a branch. (A pass loop around
        # the tile loop made the INT8 kernel spill registers; a tile index carried
        # through a select, or an `if` around the stores, left every load waited for in
        # its own iteration.)
        num_iters = tl.cdiv(q_len, TOKENS_PER_PASS) * tile_count
        m_i = tl.full([BLOCK_M], NEG_BIG, tl.float32)
        l_i = _zero_sums(BLOCK_N, BLOCK_M, SWAP_AB)
        acc = _zero_acc(BLOCK_D, BLOCK_M, SWAP_AB)
        bad_pages = _no_bad_pages(SAFE)
        for it in range(0, num_iters):
            pass_idx = it // tile_count
            tile_idx = it - pass_idx * tile_count
            tok0 = pass_idx * TOKENS_PER_PASS
            row_valid = (row_tok < TOKENS_PER_PASS) & (tok0 + row_tok < q_len)
            tok = (q_start + tok0 + row_tok).to(tl.int64)
            # Causal limit of each row: its own position; -1 hides every key from padding rows.
            row_limit = tl.where(row_valid, seq_len - q_len + tok0 + row_tok, -1)
            q, row_scale = _load_query(q_ptr, q_scale_ptr, tok, row_head, row_valid, qk_scale, stride_qt,
                                       stride_qh, stride_qst, stride_qsh, HEAD_DIM, BLOCK_D, BLOCK_M, KV_KIND,
                                       INTERPRET, QUERY_IN != QUERY_CODES)
            # A new pass starts from an empty state: alpha = 0 drops the previous pass.
            fresh = tile_idx == 0
            m_i = tl.where(fresh, NEG_BIG, m_i)
            l_i = tl.where(fresh, 0.0, l_i)
            acc = tl.where(fresh, 0.0, acc)
            tile = tile_lo + tile_idx * tile_step
            m_i, l_i, acc, n_bad = _attend(q, row_scale, row_limit, m_i, l_i, acc, tile, seq_len, bt_row, k_ptr,
                                           v_ptr, k_scale_ptr, v_scale_ptr, data_head, scale_head, stride_cb,
                                           stride_sb, num_blocks, HEAD_DIM, BLOCK_D, PAGE, BLOCK_N, BLOCK_M, KV_KIND,
                                           PV_KIND, True, INTERPRET, SWAP_AB, SAFE, WINDOW)
            # Last tile of the pass: its rows go to out (one active split) or to the partials.
            # (tl.where rather than `row_valid & last`: the interpreter mistypes that mask)
            last = tile_idx == tile_count - 1
            acc_out, l_out = acc, l_i
            if SAFE:
                # every pass walks the same tiles: the first pass's last tile has seen them all
                bad_pages += tl.where(pass_idx == 0, n_bad, 0)
                acc_out, l_out = _poison_bad(acc, l_i, bad, bad_pages, flags_ptr, seq, last & (pass_idx == 0))
            _store_rows(out_ptr, part_acc_ptr, part_ml_ptr, acc_out, m_i, _row_sums(l_out, SWAP_AB), tok, row_head,
                        split, n_active, tl.where(last, row_valid, False), stride_ot, stride_oh, stride_pt,
                        stride_ph, stride_ps, stride_mt, stride_mh, stride_ms, HEAD_DIM, BLOCK_D, SWAP_AB)
    if STAMPS:
        _stamp(stamps, 3, n_active)
    if FUSED_MERGE == MERGE_BARRIER:
        if n_active > 1:
            _barrier_and_merge(out_ptr, part_acc_ptr, part_ml_ptr, counters, gen0, q_start, q_len, head0, split,
                               n_active, stride_ot, stride_oh, stride_pt, stride_ph, stride_ps, stride_mt, stride_mh,
                               stride_ms, HEADS, HEAD_DIM, TOKENS_PER_PASS, MERGE_M, MERGE_CHUNK, MERGE_COLS)
    elif FUSED_MERGE == MERGE_LAST:
        if n_active > 1:
            _arrive_and_merge(out_ptr, part_acc_ptr, part_ml_ptr, counters, q_start, q_len, head0, split, n_active,
                              num_splits, stride_ot, stride_oh, stride_pt, stride_ph, stride_ps, stride_mt, stride_mh,
                              stride_ms, HEADS, HEAD_DIM, BLOCK_D, TOKENS_PER_PASS, MERGE_GROUP, MERGE_M, MERGE_CHUNK)


@triton.jit
def _quantize_slot_query(x_ptr, lam_ptr, qc_ptr, qcs_ptr, ready, q_start, q_len, kv_head, head0, split, n_active,
                         stride_xt, stride_xh, stride_ct, stride_ch, stride_cst, stride_csh, HEADS: tl.constexpr,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                         TOKENS_PER_PASS: tl.constexpr, KV_KIND: tl.constexpr, HAS_LAM: tl.constexpr,
                         INTERPRET: tl.constexpr):
    """``QUERY_IN != QUERY_CODES``: the query quantized once per launch, not per split.

    Split 0 of a (sequence, grid axis 1) slot rounds the slot's query rows -- every token of
    the sequence, the program's heads -- exactly as the query quantization kernel does
    (fp32, times ``lam[kv_head]`` with HAS_LAM, :func:`~int8attn.kernels.quantize._quantize_rows`)
    into ``qc`` [T, Hq, D] / ``qcs`` [T, Hq] and, when the slot has other active splits,
    adds ``n_active - 1`` to the slot's ready count (CTA barrier, then a release atomic at
    GPU scope, as the merges publish partials). Every other split spins on an acquire load
    until the count is non-zero, then takes one off: the count is back at zero when the
    launch ends (no reset between launches or graph replays), and it is indexed by grid
    coordinates, never by metadata values.

    A waiter needs split 0 to make progress: valid in a cooperative launch (every program
    resident) and under the interpreter, which runs split 0 of every slot first (grid axis
    0 is its outer loop; a waiter that finds the count at zero there fails an assert
    instead of spinning)."""
    if split == 0:
        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        row_tok = offs_m // HEADS
        row_head = head0 + offs_m % HEADS
        d_ok = offs_d < HEAD_DIM
        if HAS_LAM:
            lam = tl.load(lam_ptr + kv_head * HEAD_DIM + offs_d, mask=d_ok, other=0.0)
        for t0 in range(0, q_len, TOKENS_PER_PASS):
            valid = (row_tok < TOKENS_PER_PASS) & (t0 + row_tok < q_len)
            tok = (q_start + t0 + row_tok).to(tl.int64)
            mask = valid[:, None] & d_ok[None, :]
            x = tl.load(x_ptr + (tok * stride_xt + row_head * stride_xh)[:, None] + offs_d[None, :], mask=mask,
                        other=0.0).to(tl.float32)
            if HAS_LAM:
                x = x * lam[None, :]
            codes, scale = _quantize_rows(x, KV_KIND, INTERPRET)
            tl.store(qc_ptr + (tok * stride_ct + row_head * stride_ch)[:, None] + offs_d[None, :], codes, mask=mask)
            tl.store(qcs_ptr + tok * stride_cst + row_head * stride_csh, scale, mask=valid)
        if n_active > 1:
            tl.debug_barrier()
            tl.atomic_add(ready, n_active - 1, sem="release", scope="gpu")
    else:
        count = tl.atomic_add(ready, 0, sem="acquire", scope="gpu")
        if INTERPRET:
            tl.device_assert(count > 0, "decode: a split ran before its slot's query quantization")
        else:
            while count == 0:
                count = tl.atomic_add(ready, 0, sem="acquire", scope="gpu")
        tl.atomic_add(ready, -1, sem="relaxed", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _arrive_and_merge(out_ptr, part_acc_ptr, part_ml_ptr, counters, q_start, q_len, head0, split, n_active,
                      num_splits, stride_ot, stride_oh, stride_pt, stride_ph, stride_ps, stride_mt, stride_mh,
                      stride_ms, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                      TOKENS_PER_PASS: tl.constexpr, MERGE_GROUP: tl.constexpr, MERGE_M: tl.constexpr,
                      MERGE_CHUNK: tl.constexpr):
    """``FUSED_MERGE``: the merge of one program's rows -- query heads ``head0 .. head0 +
    HEADS - 1`` of one sequence -- inside the split kernel, called by each of its active
    splits once its partial rows are stored; the last to arrive combines them, so a decode
    call is one launch.

    ``counters`` points at the ``num_splits`` int32 arrival counters of the program's
    (sequence, grid axis 1) slot -- its KV head, or its share of it under HEAD_SPLIT --
    (indexed by the program's own grid coordinates, never by metadata values, so no
    metadata can make two programs share one). Two levels bound the serial work at the
    end: splits arrive in groups of MERGE_GROUP (counter ``group``); the last arrival of a
    group merges the group into its first partial slot, then arrives at the top counter
    (``num_splits - 1``, unused by the groups when there is more than one); the last group
    merger combines the group results into ``out``. With one group its last arrival writes
    ``out`` directly. Each last arrival resets its counter to 0, so the counters are ready
    for the next launch (and CUDA-graph replays) without a memset.

    Memory ordering (the CUTLASS semaphore pattern): a CTA barrier orders every thread's
    partial stores before the counter's atomic, which has acquire-release semantics at GPU
    scope (release of this program's stores, acquire of the earlier arrivals'); the last
    arrival reads the partials past L1 (``.cg``)."""
    group = split // MERGE_GROUP
    first = group * MERGE_GROUP
    count = tl.minimum(n_active - first, MERGE_GROUP)
    n_groups = tl.cdiv(n_active, MERGE_GROUP)
    tl.debug_barrier()
    ticket = tl.atomic_add(counters + group, 1, sem="acq_rel", scope="gpu")
    if ticket == count - 1:
        tl.store(counters + group, 0)
        if n_groups == 1:
            _merge_splits(out_ptr, part_acc_ptr, part_ml_ptr, q_start, q_len, head0, 0, count, 1, 0, stride_ot,
                          stride_oh, stride_pt, stride_ph, stride_ps, stride_mt, stride_mh, stride_ms, HEADS, HEAD_DIM,
                          BLOCK_D, TOKENS_PER_PASS, MERGE_M, MERGE_CHUNK, True)
        else:
            _merge_splits(out_ptr, part_acc_ptr, part_ml_ptr, q_start, q_len, head0, first, count, 1, 0, stride_ot,
                          stride_oh, stride_pt, stride_ph, stride_ps, stride_mt, stride_mh, stride_ms, HEADS, HEAD_DIM,
                          BLOCK_D, TOKENS_PER_PASS, MERGE_M, MERGE_CHUNK, False)
            tl.debug_barrier()
            top = counters + num_splits - 1
            ticket_top = tl.atomic_add(top, 1, sem="acq_rel", scope="gpu")
            if ticket_top == n_groups - 1:
                tl.store(top, 0)
                _merge_splits(out_ptr, part_acc_ptr, part_ml_ptr, q_start, q_len, head0, 0, n_groups, MERGE_GROUP, 0,
                              stride_ot, stride_oh, stride_pt, stride_ph, stride_ps, stride_mt, stride_mh, stride_ms,
                              HEADS, HEAD_DIM, BLOCK_D, TOKENS_PER_PASS, MERGE_M, MERGE_CHUNK, True)


@triton.jit
def _barrier_and_merge(out_ptr, part_acc_ptr, part_ml_ptr, counters, gen0, q_start, q_len, head0, split, n_active,
                       stride_ot, stride_oh, stride_pt, stride_ph, stride_ps, stride_mt, stride_mh, stride_ms,
                       HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, TOKENS_PER_PASS: tl.constexpr,
                       MERGE_M: tl.constexpr, MERGE_CHUNK: tl.constexpr, MERGE_COLS: tl.constexpr):
    """``FUSED_MERGE == MERGE_BARRIER``: every active split of one program slot (sequence,
    grid axis 1) waits until all of them have stored their partials, then merges its share
    of the output columns -- column block ``split``, ``split + n_active``, ... of
    MERGE_COLS columns -- into ``out``: the merge is spread over the slot's programs, so
    it adds one barrier and one read of a few KB per program, not a serial tail.

    Only valid when every program of the grid is resident at once: the launch is
    cooperative (the driver refuses a grid that cannot be co-resident, so a wrong
    occupancy estimate is an error, never a hang), and never under the interpreter, which
    runs programs one after another.

    ``counters`` points at the slot's int32 pair [arrivals, generation] (indexed by grid
    coordinates, never by metadata values). A sense-reversing barrier: each split reads the
    generation (``gen0``, at its start: the generation only moves once every split of the
    slot has arrived, this one included), then takes an arrival ticket; the last arrival
    resets the arrival count and advances the generation (release), the others spin until
    it changes (acquire). The counters need no reset between launches or CUDA-graph
    replays (the generation wraps freely: only a change is tested). Memory ordering as in
    :func:`_arrive_and_merge`: CTA barrier, then acq_rel / release atomics at GPU scope,
    partials read past L1."""
    arrivals = counters
    generation = counters + 1
    tl.debug_barrier()
    ticket = tl.atomic_add(arrivals, 1, sem="acq_rel", scope="gpu")
    if ticket == n_active - 1:
        tl.atomic_xchg(arrivals, 0, sem="relaxed", scope="gpu")
        tl.atomic_add(generation, 1, sem="release", scope="gpu")
    else:
        gen = tl.atomic_add(generation, 0, sem="acquire", scope="gpu")
        while gen == gen0:
            gen = tl.atomic_add(generation, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()
    n_blocks: tl.constexpr = (HEAD_DIM + MERGE_COLS - 1) // MERGE_COLS
    for blk in range(split, n_blocks, n_active):
        _merge_splits(out_ptr, part_acc_ptr, part_ml_ptr, q_start, q_len, head0, 0, n_active, 1, blk * MERGE_COLS,
                      stride_ot, stride_oh, stride_pt, stride_ph, stride_ps, stride_mt, stride_mh, stride_ms, HEADS,
                      HEAD_DIM, MERGE_COLS, TOKENS_PER_PASS, MERGE_M, MERGE_CHUNK, True)


@triton.jit
def _merge_splits(out_ptr, part_acc_ptr, part_ml_ptr, q_start, q_len, head0, first, count, step, d0, stride_ot,
                  stride_oh, stride_pt, stride_ph, stride_ps, stride_mt, stride_mh, stride_ms, HEADS: tl.constexpr,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, TOKENS_PER_PASS: tl.constexpr,
                  MERGE_M: tl.constexpr, MERGE_CHUNK: tl.constexpr, TO_OUT: tl.constexpr):
    """Combine the partials in slots ``first, first + step, ...`` (``count`` of them) of
    every query row of one program's heads (``head0 ..``, HEADS of them), columns ``d0 ..
    d0 + BLOCK_D - 1`` (those below HEAD_DIM): into ``out`` (normalized; TO_OUT) or back
    into slot ``first`` (unnormalized, with its max and sum).
    Rows are packed as in the split kernel (MERGE_M >= TOKENS_PER_PASS x HEADS rows per pass); MERGE_CHUNK partials
    are loaded at once as a [chunk, rows, D] tile and folded in online (base-2
    log-sum-exp, as :func:`_decode_merge_kernel`)."""
    offs_r = tl.arange(0, MERGE_M)
    offs_c = tl.arange(0, MERGE_CHUNK)
    offs_d = d0 + tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    r_tok = offs_r // HEADS
    r_head = head0 + offs_r % HEADS
    for t0 in range(0, q_len, TOKENS_PER_PASS):
        valid = (offs_r < TOKENS_PER_PASS * HEADS) & (t0 + r_tok < q_len)
        tok = (q_start + t0 + r_tok).to(tl.int64)
        ml_row = tok * stride_mt + r_head * stride_mh
        acc_row = tok * stride_pt + r_head * stride_ph
        m_run = tl.full([MERGE_M], NEG_BIG, tl.float32)
        den = tl.zeros([MERGE_M], tl.float32)
        acc = tl.zeros([MERGE_M, BLOCK_D], tl.float32)
        for c0 in range(0, count, MERGE_CHUNK):
            idx = c0 + offs_c
            slot = (first + idx * step).to(tl.int64)
            live = (idx < count)[:, None] & valid[None, :]
            ml = part_ml_ptr + slot[:, None] * stride_ms + ml_row[None, :]
            m_c = tl.load(ml, mask=live, other=NEG_BIG, cache_modifier=".cg")
            l_c = tl.load(ml + 1, mask=live, other=0.0, cache_modifier=".cg")
            a = tl.load(part_acc_ptr + slot[:, None, None] * stride_ps + acc_row[None, :, None] + offs_d[None, None, :],
                        mask=live[:, :, None] & d_ok[None, None, :], other=0.0, cache_modifier=".cg")
            m_new = tl.maximum(m_run, tl.max(m_c, 0))
            alpha = tl.exp2(m_run - m_new)
            w = tl.where(live, tl.exp2(m_c - m_new[None, :]), 0.0)
            acc = acc * alpha[:, None] + tl.sum(a * w[:, :, None], 0)
            den = den * alpha + tl.sum(w * l_c, 0)
            m_run = m_new
        if TO_OUT:
            o = acc / tl.where(den == 0.0, 1.0, den)[:, None]  # NaN stays NaN (see _store_rows)
            tl.store(out_ptr + tok[:, None] * stride_ot + r_head[:, None] * stride_oh + offs_d[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=valid[:, None] & d_ok[None, :])
        else:
            dst = first.to(tl.int64)
            tl.store(part_acc_ptr + acc_row[:, None] + dst * stride_ps + offs_d[None, :], acc,
                     mask=valid[:, None] & d_ok[None, :])
            tl.store(part_ml_ptr + ml_row + dst * stride_ms, m_run, mask=valid)
            tl.store(part_ml_ptr + ml_row + dst * stride_ms + 1, den, mask=valid)


@triton.jit
def _no_bad_pages(SAFE: tl.constexpr):
    """The running count of out-of-range block ids: an int32 scalar with ``SAFE``, else a
    compile-time 0 that leaves no trace in the loop."""
    if SAFE:
        n = tl.zeros([], tl.int32)
    else:
        n = 0
    return n


@triton.jit
def _poison_bad(acc, l_i, bad, bad_pages, flags_ptr, seq, raise_flag):
    """``SAFE``: a sequence with bad metadata (``bad``) or an out-of-range block id in the
    program's tiles gets NaN rows -- NaN accumulator and denominators, so its partials
    carry NaN into the merge too -- and a block-id error flag naming it (raised when
    ``raise_flag``: once per program)."""
    _raise_error(flags_ptr, ERR_BLOCK_ID, seq, (bad_pages > 0) & raise_flag)
    poisoned = bad | (bad_pages > 0)
    return tl.where(poisoned, float("nan"), acc), tl.where(poisoned, float("nan"), l_i)


@triton.jit
def _zero_acc(BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, SWAP_AB: tl.constexpr):
    """The empty output accumulator: O [BLOCK_M, BLOCK_D], or O^T [BLOCK_D, BLOCK_M] when swapped."""
    if SWAP_AB:
        acc = tl.zeros([BLOCK_D, BLOCK_M], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    return acc


@triton.jit
def _zero_sums(BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, SWAP_AB: tl.constexpr):
    """The empty softmax denominators: one per row, or per (key, row) when swapped."""
    if SWAP_AB:
        l_i = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        l_i = tl.zeros([BLOCK_M], tl.float32)
    return l_i


@triton.jit
def _row_sums(l_i, SWAP_AB: tl.constexpr):
    """Each row's softmax denominator from the running state (see _zero_sums)."""
    if SWAP_AB:
        l_i = tl.sum(l_i, 0)
    return l_i


@triton.jit
def _attend(q, row_scale, row_limit, m_i, l_i, acc, tile, seq_len, bt_row, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr,
            data_head, scale_head, stride_cb, stride_sb, num_blocks, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
            PAGE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, KV_KIND: tl.constexpr,
            PV_KIND: tl.constexpr, TAIL: tl.constexpr, INTERPRET: tl.constexpr, SWAP_AB: tl.constexpr,
            SAFE: tl.constexpr, WINDOW: tl.constexpr = 0):
    """One tile in the orientation the launch chose (see _attend_tile_swapped); also
    returns the tile's count of out-of-range block ids (``SAFE``; else 0)."""
    if SWAP_AB:
        m_i, l_i, acc, n_bad = _attend_tile_swapped(q, row_scale, row_limit, m_i, l_i, acc, tile, seq_len, bt_row,
                                                    k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, data_head, scale_head,
                                                    stride_cb, stride_sb, num_blocks, HEAD_DIM, BLOCK_D, PAGE,
                                                    BLOCK_N, BLOCK_M, KV_KIND, PV_KIND, TAIL, INTERPRET, SAFE, WINDOW)
    else:
        m_i, l_i, acc, n_bad = _attend_tile(q, row_scale, row_limit, m_i, l_i, acc, tile, seq_len, bt_row, k_ptr,
                                            v_ptr, k_scale_ptr, v_scale_ptr, data_head, scale_head, stride_cb,
                                            stride_sb, num_blocks, HEAD_DIM, BLOCK_D, PAGE, BLOCK_N, BLOCK_M,
                                            KV_KIND, PV_KIND, TAIL, INTERPRET, SAFE, WINDOW)
    return m_i, l_i, acc, n_bad


@triton.jit
def _load_query(q_ptr, q_scale_ptr, tok, row_head, row_valid, qk_scale, stride_qt, stride_qh, stride_qst, stride_qsh,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, KV_KIND: tl.constexpr,
                INTERPRET: tl.constexpr, PAST_L1: tl.constexpr = False):
    """The packed query rows [BLOCK_M, BLOCK_D] in the dot's precision and each row's score
    scale ``sQ * softmax_scale * log2(e)`` (padding rows and padding channels: zeros).
    PAST_L1: codes another program of this launch wrote (read from L2, ``.cg``)."""
    cache: tl.constexpr = ".cg" if PAST_L1 else ""
    offs_d = tl.arange(0, BLOCK_D)
    q_ptrs = q_ptr + tok[:, None] * stride_qt + row_head[:, None] * stride_qh + offs_d[None, :]
    if BLOCK_D == HEAD_DIM:
        q = tl.load(q_ptrs, mask=row_valid[:, None], other=0.0, cache_modifier=cache)
    else:
        q = tl.load(q_ptrs, mask=row_valid[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0, cache_modifier=cache)
    if KV_KIND == KIND_BF16:
        q = q.to(tl.bfloat16)
        if INTERPRET:
            q = q.to(tl.float32)
        row_scale = tl.full([BLOCK_M], 1.0, tl.float32) * qk_scale
    else:
        q_scale = tl.load(q_scale_ptr + tok * stride_qst + row_head * stride_qsh, mask=row_valid, other=0.0,
                          cache_modifier=cache)
        row_scale = q_scale * qk_scale
    return q, row_scale


@triton.jit
def _tile_addresses(tile, seq_len, bt_row, data_head, scale_head, stride_cb, stride_sb, num_blocks,
                    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, SAFE: tl.constexpr):
    """Where the keys of tile ``tile`` live: their positions, which are in the sequence,
    the tile's pages and block ids, each key's K-row and scale offsets, and (``SAFE``) how
    many of the tile's block ids were outside ``[0, num_blocks)`` (read as block 0). One
    block-table entry per page, broadcast to the page's keys; a page past ``seq_len``
    reads block 0 (valid memory, masked later)."""
    offs_n = tl.arange(0, BLOCK_N)
    pos = tile * BLOCK_N + offs_n
    in_seq = pos < seq_len
    NUM_PAGES: tl.constexpr = BLOCK_N // PAGE
    page = tile * NUM_PAGES + tl.arange(0, NUM_PAGES)
    blk_page = tl.load(bt_row + page, mask=page * PAGE < seq_len, other=0)
    n_bad = 0
    if SAFE:
        out_of_range = (blk_page < 0) | (blk_page >= num_blocks)
        n_bad = tl.sum(out_of_range.to(tl.int32), 0)
        blk_page = tl.where(out_of_range, 0, blk_page)
    blk = tl.reshape(tl.broadcast_to(blk_page[:, None], (NUM_PAGES, PAGE)), (BLOCK_N,)).to(tl.int64)
    slot = offs_n % PAGE
    row_off = blk * stride_cb + data_head + slot * HEAD_DIM
    scale_off = blk * stride_sb + scale_head + slot
    return pos, in_seq, page, blk_page, row_off, scale_off, n_bad


@triton.jit
def _load_key_rows(ptrs, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """A [keys, BLOCK_D] K tile: unmasked (see _attend_tile) but for the padding channels
    of a head_dim below BLOCK_D, which load as zeros (they would read the next row)."""
    if BLOCK_D == HEAD_DIM:
        k = tl.load(ptrs)
    else:
        k = tl.load(ptrs, mask=(offs_d < HEAD_DIM)[None, :], other=0.0)
    return k


@triton.jit
def _attend_tile(q, row_scale, row_limit, m_i, l_i, acc, tile, seq_len, bt_row,
                 k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, data_head, scale_head, stride_cb, stride_sb, num_blocks,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_M: tl.constexpr, KV_KIND: tl.constexpr, PV_KIND: tl.constexpr, TAIL: tl.constexpr,
                 INTERPRET: tl.constexpr, SAFE: tl.constexpr, WINDOW: tl.constexpr = 0):
    """One KV tile (keys ``tile * BLOCK_N ...``) folded into the online-softmax state.

    Loads carry as few masks as correctness allows: a key past ``seq_len`` reads block 0
    (the block id load is masked to 0) or a stale slot of its own last page -- valid
    memory either way -- and is removed by the score mask (a ``where``, so a NaN K scale
    there cannot leak). Only what the PV product would multiply by P = 0 must be finite:
    the V scale always, and V itself for fp8 / bf16 caches (int8 is always finite).
    A head_dim padded to BLOCK_D masks the padding channels of every load (zeros: they add
    nothing to the scores, and their output columns are not stored)."""
    offs_d = tl.arange(0, BLOCK_D)
    pos, in_seq, page, blk_page, row_off, scale_off, n_bad = _tile_addresses(
        tile, seq_len, bt_row, data_head, scale_head, stride_cb, stride_sb, num_blocks, HEAD_DIM, PAGE, BLOCK_N, SAFE)
    NUM_PAGES: tl.constexpr = BLOCK_N // PAGE
    k = _load_key_rows(k_ptr + row_off[:, None] + offs_d[None, :], offs_d, HEAD_DIM, BLOCK_D)
    if KV_KIND == KIND_INT8:
        k_scale = tl.load(k_scale_ptr + scale_off)
        qk = tl.dot(q, tl.trans(k), out_dtype=tl.int32).to(tl.float32)
        s = qk * row_scale[:, None] * k_scale[None, :]
    elif KV_KIND == KIND_FP8:
        k_scale = tl.load(k_scale_ptr + scale_off)
        qk = tl.dot(q, tl.trans(k), out_dtype=tl.float32)
        s = qk * row_scale[:, None] * k_scale[None, :]
    else:
        if INTERPRET:
            k = k.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), out_dtype=tl.float32)
        s = qk * row_scale[:, None]
    s = tl.where(_visible(pos[None, :], row_limit[:, None], WINDOW), s, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]

    if KV_KIND == KIND_BF16:
        v_ptrs = v_ptr + row_off[:, None] + offs_d[None, :]
        if BLOCK_D == HEAD_DIM:
            v = tl.load(v_ptrs, mask=in_seq[:, None], other=0.0)
        else:
            v = tl.load(v_ptrs, mask=in_seq[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
    else:
        v = _load_v_pages(v_ptr, blk_page, page, seq_len, data_head, stride_cb, HEAD_DIM, BLOCK_D, PAGE, NUM_PAGES,
                          KV_KIND == KIND_FP8 and TAIL)
    if KV_KIND == KIND_BF16:
        if INTERPRET:
            acc += tl.dot(p, v.to(tl.float32))
        else:
            acc += tl.dot(p.to(tl.bfloat16), v)
    else:
        v_scale = tl.load(v_scale_ptr + scale_off, mask=in_seq, other=0.0)
        acc += _pv_product(p * v_scale[None, :], v, BLOCK_M, BLOCK_N, PV_KIND, INTERPRET)
    return m_new, l_i, acc, n_bad


@triton.jit
def _max_pair(a, b, c, d):
    return tl.maximum(a, c), tl.maximum(b, d)


@triton.jit
def _attend_tile_swapped(q, row_scale, row_limit, m_i, l_i, acc_t, tile, seq_len, bt_row,
                         k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, data_head, scale_head, stride_cb, stride_sb,
                         num_blocks, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, KV_KIND: tl.constexpr, PV_KIND: tl.constexpr,
                         TAIL: tl.constexpr, INTERPRET: tl.constexpr, SAFE: tl.constexpr, WINDOW: tl.constexpr = 0):
    """:func:`_attend_tile` with the operands swapped, for 8-bit caches: the tile's keys
    fill the MMA's M rows and the packed query rows its N columns.

    ``S^T = K . Q^T`` [BLOCK_N, BLOCK_M] and ``O^T += V^T . P^T`` [BLOCK_D, BLOCK_M]: M is
    BLOCK_N (64, 128) and BLOCK_D, so Hopper's warpgroup MMA applies with only 16 query
    rows (N = 16), where the row-major form needs 64 padded rows (4x the MMA work and a
    64-row accumulator that spills). Both 8-bit operands stay K-major as the MMA needs:
    K rows are D-contiguous, and the transposed V pages are key-contiguous, exactly
    V^T's reduction axis. The softmax runs down the columns (axis 0); ``acc_t`` is O^T.
    P (v_scale folded in) is quantized per column (query row) to its exact max, found
    by the same reduction as the score max."""
    offs_d = tl.arange(0, BLOCK_D)
    pos, in_seq, page, blk_page, row_off, scale_off, n_bad = _tile_addresses(
        tile, seq_len, bt_row, data_head, scale_head, stride_cb, stride_sb, num_blocks, HEAD_DIM, PAGE, BLOCK_N, SAFE)
    NUM_PAGES: tl.constexpr = BLOCK_N // PAGE
    k = _load_key_rows(k_ptr + row_off[:, None] + offs_d[None, :], offs_d, HEAD_DIM, BLOCK_D)
    k_scale = tl.load(k_scale_ptr + scale_off)
    if KV_KIND == KIND_INT8:
        qk = tl.dot(k, tl.trans(q), out_dtype=tl.int32).to(tl.float32)
    else:
        qk = tl.dot(k, tl.trans(q), out_dtype=tl.float32)
    s = qk * k_scale[:, None] * row_scale[None, :]
    s = tl.where(_visible(pos[:, None], row_limit[None, :], WINDOW), s, float("-inf"))

    v_scale = tl.load(v_scale_ptr + scale_off, mask=in_seq, other=0.0)
    if PV_KIND == PV_BF16:
        tile_max = tl.max(s, 0)
    else:
        # One reduction down the columns gives both the score max and the exact max of
        # P * v_scale (as exp2(max(s + log2 v_scale) - m_new)), which P's quantization
        # maps to the top of the 8-bit range: the dominant key of a peaked row is then
        # represented exactly (a looser bound, e.g. max(v_scale), rounds it and doubles
        # the fp8 PV error). (v_scale 0 -- a masked key -- gives a finite log; the score
        # of a masked key is -inf anyway, and a larger bound never overflows.)
        tile_max, pv_log_max = tl.reduce((s, s + tl.log2(tl.maximum(v_scale, 1e-30))[:, None]), 0, _max_pair)
    m_new = tl.maximum(m_i, tile_max)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[None, :])
    # l_i is [BLOCK_N, BLOCK_M] here: per-key partial sums, reduced once at the end
    # (a column sum per tile would cost a cross-warp reduction, see _row_sums)
    l_i = l_i * alpha[None, :] + p
    acc_t = acc_t * alpha[None, :]

    v_t = _load_v_pages(v_ptr, blk_page, page, seq_len, data_head, stride_cb, HEAD_DIM, BLOCK_D, PAGE, NUM_PAGES,
                        KV_KIND == KIND_FP8 and TAIL, True)
    pv = p * v_scale[:, None]
    if PV_KIND == PV_BF16:
        if INTERPRET:
            acc_t += tl.dot(v_t.to(tl.float32), pv.to(tl.bfloat16).to(tl.float32))
        else:
            acc_t += tl.dot(v_t.to(tl.bfloat16), pv.to(tl.bfloat16))
    else:
        # a column that saw no key has pv_log_max = -inf and p_max 0
        p_max = tl.exp2(pv_log_max - m_new)
        if PV_KIND == PV_FP8:
            p_inv = tl.where(p_max > 0.0, 448.0 / tl.maximum(p_max, 1e-30), 0.0)
            r = tl.minimum(pv * p_inv[None, :], 448.0)
            if INTERPRET:
                r = _round_to_e4m3_grid(r)
            acc_t += tl.dot(v_t, r.to(tl.float8e4nv), out_dtype=tl.float32) * (p_max * (1.0 / 448.0))[None, :]
        else:
            # the shifted 0..255 encoding of _pv_product, transposed
            p_inv = tl.where(p_max > 0.0, 255.0 / tl.maximum(p_max, 1e-30), 0.0)
            u = tl.minimum(pv * p_inv[None, :] + 0.5, 255.0).to(tl.int32)
            p8 = (u - 128).to(tl.int8)
            ones = tl.full([BLOCK_N, BLOCK_M], 1, tl.int8)
            o_i32 = tl.dot(v_t, p8, out_dtype=tl.int32) + 128 * tl.dot(v_t, ones, out_dtype=tl.int32)
            acc_t += o_i32.to(tl.float32) * (p_max * (1.0 / 255.0))[None, :]
    return m_new, l_i, acc_t, n_bad


@triton.jit
def _load_v_pages(v_ptr, blk_page, page, seq_len, data_head, stride_cb, HEAD_DIM: tl.constexpr,
                  BLOCK_D: tl.constexpr, PAGE: tl.constexpr, NUM_PAGES: tl.constexpr, ZERO_STALE: tl.constexpr,
                  KEYS_LAST: tl.constexpr = False):
    """The [NUM_PAGES * PAGE, BLOCK_D] V tile of an 8-bit cache, whose pages are stored
    transposed ([HEAD_DIM, PAGE], keys contiguous; see int8attn.cache).

    Loaded page by page as a [NUM_PAGES, BLOCK_D, PAGE] tile -- one base address per
    page, so the compiler sees PAGE contiguous bytes per (page, channel) and issues 16-byte
    async copies -- then permuted to [keys, BLOCK_D] in registers. That view is K-major
    for the PV dot (the keys are its reduction axis), the operand layout 8-bit MMAs need,
    so no byte transpose happens. (Gathering per key instead loses the contiguity and
    falls back to 1-byte loads.) int8 loads need no mask: stale slots past ``seq_len``
    are finite and meet P = 0; stale e4m3 bytes may be NaN, so on a tile that may hold
    keys past ``seq_len`` (ZERO_STALE) an fp8 cache's are set to 0.

    ``KEYS_LAST``: return the tile as [BLOCK_D, keys] instead (V^T, the left operand of
    the operand-swapped product; keys stay the contiguous reduction axis). Padding channels
    of a head_dim below BLOCK_D load as zeros (a mask that is constant along the pages'
    contiguous axis, so the copies stay 16 bytes wide)."""
    offs_d = tl.arange(0, BLOCK_D)
    offs_s = tl.arange(0, PAGE)
    base = blk_page.to(tl.int64) * stride_cb + data_head
    ptrs = v_ptr + base[:, None, None] + (offs_d * PAGE)[None, :, None] + offs_s[None, None, :]
    key_pos = tl.reshape(page[:, None] * PAGE + offs_s[None, :], (NUM_PAGES * PAGE,))
    if BLOCK_D == HEAD_DIM:
        pages = tl.load(ptrs)
    else:
        pages = tl.load(ptrs, mask=(offs_d < HEAD_DIM)[None, :, None], other=0.0)
    if KEYS_LAST:
        v = tl.reshape(tl.permute(pages, (1, 0, 2)), (BLOCK_D, NUM_PAGES * PAGE))
        if ZERO_STALE:
            v = tl.where((key_pos < seq_len)[None, :], v, 0.0)
    else:
        v = tl.reshape(tl.permute(pages, (0, 2, 1)), (NUM_PAGES * PAGE, BLOCK_D))
        if ZERO_STALE:
            # a mask on the load itself would cost the 16-byte copies (its pattern varies
            # along the contiguous axis); zero the stale keys in registers instead
            v = tl.where((key_pos < seq_len)[:, None], v, 0.0)
    return v


@triton.jit
def _store_rows(out_ptr, part_acc_ptr, part_ml_ptr, acc, m_i, l_i, tok, row_head, split, n_active, rows,
                stride_ot, stride_oh, stride_pt, stride_ph, stride_ps, stride_mt, stride_mh, stride_ms,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, TRANSPOSED: tl.constexpr = False):
    """Rows ``rows`` of a finished pass: normalized to ``out`` when the sequence has one
    active split, else (unnormalized acc, max, sum) to the split partials. ``acc`` is
    [rows, BLOCK_D], or [BLOCK_D, rows] when TRANSPOSED (the swapped tile's O^T); only the
    first HEAD_DIM columns are stored."""
    offs_d = tl.arange(0, BLOCK_D)
    direct = tl.where(n_active == 1, rows, False)
    partial = tl.where(n_active > 1, rows, False)
    # l is 0 only for a row that saw no key; NaN (a poisoned key or query row: its p is NaN)
    # must stay NaN here, since its accumulator may be finite (8-bit P rounds NaN to 0)
    inv_l = 1.0 / tl.where(l_i == 0.0, 1.0, l_i)
    part = tok * stride_pt + row_head * stride_ph + split * stride_ps
    out_row = tok * stride_ot + row_head * stride_oh
    if TRANSPOSED:
        direct_t = direct[None, :]
        partial_t = partial[None, :]
        if BLOCK_D != HEAD_DIM:
            direct_t = direct_t & (offs_d < HEAD_DIM)[:, None]
            partial_t = partial_t & (offs_d < HEAD_DIM)[:, None]
        tl.store(out_ptr + out_row[None, :] + offs_d[:, None], (acc * inv_l[None, :]).to(out_ptr.dtype.element_ty),
                 mask=direct_t)
        tl.store(part_acc_ptr + part[None, :] + offs_d[:, None], acc, mask=partial_t)
    else:
        direct_r = direct[:, None]
        partial_r = partial[:, None]
        if BLOCK_D != HEAD_DIM:
            direct_r = direct_r & (offs_d < HEAD_DIM)[None, :]
            partial_r = partial_r & (offs_d < HEAD_DIM)[None, :]
        tl.store(out_ptr + out_row[:, None] + offs_d[None, :], (acc * inv_l[:, None]).to(out_ptr.dtype.element_ty),
                 mask=direct_r)
        tl.store(part_acc_ptr + part[:, None] + offs_d[None, :], acc, mask=partial_r)
    ml = tok * stride_mt + row_head * stride_mh + split * stride_ms
    tl.store(part_ml_ptr + ml, m_i, mask=partial)
    tl.store(part_ml_ptr + ml + 1, l_i, mask=partial)


@triton.jit
def _pv_product(pv, v, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PV_KIND: tl.constexpr,
                INTERPRET: tl.constexpr):
    """``pv . v`` in fp32 for a quantized V tile: ``pv`` [BLOCK_M, BLOCK_N] fp32 holds the
    probabilities with each key's V scale folded in (>= 0); ``v`` [BLOCK_N, D] is int8 or
    e4m3. P is quantized per row of this tile as ``PV_KIND`` says."""
    if PV_KIND == PV_BF16:
        if INTERPRET:
            o = tl.dot(pv.to(tl.bfloat16).to(tl.float32), v.to(tl.float32))
        else:
            o = tl.dot(pv.to(tl.bfloat16), v.to(tl.bfloat16))
    elif PV_KIND == PV_FP8:
        p_max = tl.max(pv, 1)
        p_inv = tl.where(p_max > 0.0, 448.0 / tl.maximum(p_max, 1e-30), 0.0)
        r = tl.minimum(pv * p_inv[:, None], 448.0)
        if INTERPRET:
            r = _round_to_e4m3_grid(r)
        o = tl.dot(r.to(tl.float8e4nv), v, out_dtype=tl.float32) * (p_max * (1.0 / 448.0))[:, None]
    elif PV_KIND == PV_INT8_SIGNED:
        p_max = tl.max(pv, 1)
        p_inv = tl.where(p_max > 0.0, 127.0 / tl.maximum(p_max, 1e-30), 0.0)
        p8 = (pv * p_inv[:, None] + 0.5).to(tl.int32).to(tl.int8)
        o = tl.dot(p8, v, out_dtype=tl.int32).to(tl.float32) * (p_max * (1.0 / 127.0))[:, None]
    else:
        # PV_INT8: the full 0..255 range for P >= 0. u - 128 fits int8, and the shift
        # comes back as 128 * colsum(V), itself an int8 dot of a ones tile with V.
        p_max = tl.max(pv, 1)
        p_inv = tl.where(p_max > 0.0, 255.0 / tl.maximum(p_max, 1e-30), 0.0)
        u = (pv * p_inv[:, None] + 0.5).to(tl.int32)
        p8 = (u - 128).to(tl.int8)
        ones = tl.full([BLOCK_M, BLOCK_N], 1, tl.int8)
        o_i32 = tl.dot(p8, v, out_dtype=tl.int32) + 128 * tl.dot(ones, v, out_dtype=tl.int32)
        o = o_i32.to(tl.float32) * (p_max * (1.0 / 255.0))[:, None]
    return o


@triton.jit(do_not_specialize=["num_splits", "stride_mt", "stride_mh", "stride_ms", "num_tokens", "max_blocks"])
def _decode_merge_kernel(
    out_ptr, part_acc_ptr, part_ml_ptr,
    seq_lens_ptr, query_start_loc_ptr,
    num_splits,
    stride_ot, stride_oh,
    stride_pt, stride_ph, stride_ps,
    stride_mt, stride_mh, stride_ms,
    num_tokens, max_blocks,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MAX_QUERY_LEN: tl.constexpr, SPLIT_CHUNK: tl.constexpr,
    BLOCK_D: tl.constexpr, PAGE: tl.constexpr = 16, SAFE: tl.constexpr = False, WINDOW: tl.constexpr = 0,
    PDL: tl.constexpr = False, stamp_ptr=None, STAMPS: tl.constexpr = False,
):
    """One program per (query head, sequence, BLOCK_D output columns): combine the split
    partials of each of the sequence's query tokens into ``out`` (log-sum-exp weights in
    base 2). Column blocks multiply the programs of a small batch (24 heads x 1 sequence
    would leave most SMs idle while each program walks every split's partial row). ``PDL``:
    launched as the split kernel's programmatic dependent, so it may run beside it.
    ``STAMPS``: a timeline diagnostic's row per program (kernels._timeline.MERGE_STAMPS)."""
    if STAMPS:
        stamps = _program_row(stamp_ptr, MERGE_STAMP_WIDTH)
        _stamp(stamps, 0, tl.program_id(0))
        _stamp_sm(stamps, 3)
    head = tl.program_id(0)
    seq = tl.program_id(1)
    col0 = tl.program_id(2) * BLOCK_D
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)  # tested with q_len: one round trip (see the split kernel)
    if PDL:
        # The metadata is the caller's, not the split kernel's: loaded before the wait. Every
        # program waits, also those that exit below, so this grid never completes before the
        # split grid does (the stream's next kernel may read what the split kernel wrote).
        gdc_wait()
    if STAMPS:
        _stamp(stamps, 1, seq_len + q_len)
    if SAFE:  # the split kernel's clamps (its partials of a bad sequence are NaN)
        q_start, q_len, seq_len, bad_q, bad_len = _untrusted_metadata(q_start, q_len, seq_len, num_tokens,
                                                                     max_blocks, PAGE, MAX_QUERY_LEN)
    if (q_len <= 0) | (q_len > MAX_QUERY_LEN) | (seq_len <= 0):
        return
    n_active = _num_active_splits(seq_len, _first_tile(seq_len, q_len, WINDOW, BLOCK_N), num_splits, BLOCK_N)
    if n_active <= 1:
        return  # written directly by the split kernel

    offs_c = tl.arange(0, SPLIT_CHUNK)
    offs_d = col0 + tl.arange(0, BLOCK_D)
    for t in range(0, q_len):
        tok = (q_start + t).to(tl.int64)
        ml = part_ml_ptr + tok * stride_mt + head * stride_mh
        part = part_acc_ptr + tok * stride_pt + head * stride_ph
        # One pass, online over chunks of splits: a chunk's maxima, sums and partial rows
        # are loaded together (one memory round trip when all splits fit in a chunk, the
        # usual case) and folded in with the running max, as the split kernel folds tiles.
        m_run = float("-inf")
        acc = tl.zeros([BLOCK_D], tl.float32)
        denom = 0.0
        for c0 in range(0, n_active, SPLIT_CHUNK):
            sp = c0 + offs_c
            live = sp < n_active
            m_c = tl.load(ml + sp * stride_ms, mask=live, other=float("-inf"))
            l_c = tl.load(ml + sp * stride_ms + 1, mask=live, other=0.0)
            a = tl.load(part + sp[:, None] * stride_ps + offs_d[None, :], mask=live[:, None], other=0.0)
            m_new = tl.maximum(m_run, tl.max(m_c, 0))
            alpha = tl.exp2(m_run - m_new)
            w = tl.where(live, tl.exp2(m_c - m_new), 0.0)
            acc = acc * alpha + tl.sum(a * w[:, None], 0)
            denom = denom * alpha + tl.sum(w * l_c, 0)
            m_run = m_new
        o = acc / denom
        tl.store(out_ptr + tok * stride_ot + head * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty))
    if STAMPS:
        _stamp(stamps, 2, n_active)
