"""``attention()``: one call for a mixed batch of decode and prefill sequences.

Routing: a sequence with ``1 <= q_len <= MAX_DECODE_QUERY_LEN`` goes to the split-K decode
kernel (:mod:`int8attn.ops.decode`), a longer one to the chunked-prefill kernel: the
portable Triton one (:mod:`int8attn.ops.prefill`) or, on sm_90, the Hopper one
(:mod:`int8attn.ops.prefill_hopper`) where :func:`int8attn.ops.prefill_hopper.choose`
picks it (``prefill_kernel=`` or ``INT8ATTN_PREFILL_KERNEL``: "auto" | "hopper" |
"portable"; the launch record names the kernel that ran). Each kernel skips the other's
sequences on the device, so the router needs no query lengths on the host:

* without a plan, ``attention()`` launches both kernels; it leaves one out only on
  host-known facts (``T <= MAX_DECODE_QUERY_LEN`` means no prefill sequence can exist;
  an empty batch launches nothing). The first call of an input layout is validated in
  full (:func:`int8attn._checks.check_attention_inputs`) and its route remembered: a later
  call with the same cache object, input layouts (dtype, shape, strides, device of every
  tensor argument), options and environment switches launches the remembered decode
  launch directly, for about the host cost of a planned run. Value checks read the device
  back, so on a CUDA device they run only with ``INT8ATTN_CHECK_VALUES=1`` (then on every
  call): an unplanned call never synchronises by default (the kernels clamp bad metadata
  themselves);
* :func:`plan_attention` plans a batch once (the plan/run split of FlashInfer): it reads
  the metadata values once (one host sync, which also checks them: block ids, lengths,
  ``query_start_loc``), records which kernels are needed, the longest query (a tighter
  prefill grid), the decode split count, its workspace and the query-code buffers.
  :meth:`AttentionPlan.run` then launches only what is needed, reads nothing back,
  allocates nothing but ``out`` (when not given) and can be captured in a CUDA graph and
  replayed. A serving engine plans once per step and runs every layer with the plan.

Host cost of a run (what an eager decode step pays per layer): the first run with a new
input layout (dtype / shape / strides / device of the query, ``out``, ``q_quant``,
``q_scale``) validates everything and builds the launch
(:class:`int8attn.ops.decode.DecodeLaunch`: grid, stride arguments, constexprs); later runs
with that layout and the plan's metadata tensors compare a few attributes and launch (a
cache object the plan has not run with, e.g. the next layer's, is first checked for its
storage layout and the plan's geometry: a few microseconds). A run with other
``block_table`` / ``seq_lens`` / ``query_start_loc`` tensors than the plan's is validated
in full again, values included.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from .. import _checks
from ..cache import PagedKVCache
from ..errors import check_errors
from ..runtime import capturing, interpret_mode, side_stream, stream_id
from . import decode as _decode
from . import decode_hopper as _decode_hopper
from . import prefill as _prefill
from . import prefill_hopper as _hopper
from .decode import MAX_DECODE_QUERY_LEN

_MISSING = object()
#: ``plan_attention(overlap=None)``: whether a mixed plan (decode and prefill sequences) on a
#: GPU runs its decode launch on a side stream beside its prefill launch, so the decode
#: kernel's K/V streaming (memory-bound) shares the GPU with the prefill kernel's MMAs
#: (compute-bound) instead of running before them. Measured on an H100 (one 4096-token chunk
#: beside 16 decode sequences at context 8192, benchmarks/notes/prefill_hopper.md): 4-6%
#: less time per eager step, 2-4% per graph replay, for INT8 and FP8 caches at head_dim 128
#: and 256, every order and priority tried.
OVERLAP_DEFAULT = True
#: The side stream's priority (torch's convention: lower is higher): the decode launch's
#: programs take the multiprocessors the prefill programs free first.
OVERLAP_PRIORITY = -1
#: Launch the prefill kernel before the decode kernel when overlapping (False: decode first).
OVERLAP_PREFILL_FIRST = False
#: Caches / input layouts a plan remembers at most (then forgets them all and starts over).
_MAX_REMEMBERED = 256


def _prefill_config(cache: PagedKVCache, pv_mode: str, group: int) -> _prefill.PrefillConfig:
    """The checked default prefill config for this cache / PV mode / GQA group, made once
    per combination (it depends on nothing else; the interpreter flag and the config
    function in use are part of the key)."""
    return _checked_default_config(cache.kv_dtype, cache.head_dim, pv_mode, group, interpret_mode(),
                                   _prefill.default_config)


@functools.lru_cache(maxsize=256)  # (kv dtype, head_dim, PV mode, group) combinations in use: a handful
def _checked_default_config(kv_dtype: str, head_dim: int, pv_mode: str, group: int, interpret: bool,
                            config_fn) -> _prefill.PrefillConfig:
    return _prefill.check_config(config_fn(kv_dtype, head_dim, pv_mode), head_dim, group)


def _prefill_route(cache: PagedKVCache, pv_mode: str, num_q_heads: int, kernel: str | None,
                   window: int = 0) -> tuple:
    """(kernel, checked config) of this batch's prefill launch: "hopper" or "portable"
    (``window``: a checked sliding window, which only the portable kernel implements)."""
    if _hopper.choose(cache, num_q_heads, pv_mode, kernel, window=window) == "hopper":
        return "hopper", _hopper.route_config(cache, num_q_heads, pv_mode)
    return "portable", _prefill_config(cache, pv_mode, num_q_heads // cache.num_kv_heads)


def _run_prefill(kernel: str, config, *args, window: int = 0) -> None:
    """Launch the kernel :func:`_prefill_route` chose (arguments of
    :func:`int8attn.ops.prefill.run_prefill`; a ``window`` is the portable kernel's only)."""
    if kernel == "hopper":
        _hopper.run_prefill(config, *args)
    else:
        _prefill.run_prefill(config, *args, window)


def _layout(t):
    """What the metadata checks of one tensor argument depend on (None for None)."""
    return None if t is None else (t.dtype, t.shape, t.stride(), t.device)


def _geometry(cache: PagedKVCache) -> tuple:
    return (cache.kv_dtype, cache.num_blocks, cache.num_kv_heads, cache.block_size, cache.head_dim, cache.device)


def _scale_strides(cache: PagedKVCache):
    """The scale strides the kernels take (all caches of one geometry share the rest)."""
    return cache.key_scale.stride() if cache.quantized else None


@dataclass
class AttentionPlan:
    """What one batch needs, computed once on the host (see :func:`plan_attention`).

    Valid for any later call with the same ``num_tokens``, ``num_seqs``, heads and cache
    geometry (``kv_dtype``, ``num_blocks``, KV heads, page size, head_dim, device; any
    cache object of that geometry, e.g. every layer's) whose query lengths keep the
    recorded facts true: no sequence longer than ``max_query_len``, no decode sequence when
    ``has_decode`` is False, no prefill sequence when ``has_prefill`` is False.

    The plan owns the decode workspace and, for 8-bit caches, the query codes and scales
    its runs quantize into (overwritten by every run, in stream order): runs of one plan
    must not overlap on different streams. It keeps references to the metadata tensors and
    to the caches it ran with (at most 256, then it forgets them and checks again).
    """

    num_tokens: int
    num_seqs: int
    num_q_heads: int
    head_dim: int
    kv_dtype: str
    max_query_len: int
    has_decode: bool
    has_prefill: bool
    decode_plan: "_decode.DecodePlan | None" = None
    workspace: "_decode.DecodeWorkspace | None" = None
    prefill_config: "_prefill.PrefillConfig | _hopper.HopperPrefillConfig | None" = None
    prefill_kernel: str = "portable"
    pv_mode: str | None = None
    prefill_pv_mode: str | None = None
    #: the decode kernel of the runs: "portable" (:mod:`int8attn.ops.decode`) or "hopper"
    #: (:mod:`int8attn.ops.decode_hopper`: multi-token steps on sm_90)
    decode_kernel: str = "portable"
    #: the Hopper decode launch's (config, num_splits, max_query_len, query-code buffers, keys_on_m,
    #: consumer warpgroups)
    decode_hopper: tuple | None = None
    launches: tuple = field(default=())
    #: the decode launch runs on a side stream beside the prefill launch (both needed, on a
    #: GPU; see ``OVERLAP_DEFAULT``), forked from and joined back into the caller's stream
    overlap: bool = False
    #: whether plan_attention checked the metadata values (False: value checks were off)
    values_checked: bool = False
    # --- run-time memory (private): what earlier runs validated
    _geometry: tuple | None = field(default=None, repr=False, compare=False)
    _metadata: tuple | None = field(default=None, repr=False, compare=False)  # (block_table, seq_lens, qsl)
    _caches: dict = field(default_factory=dict, repr=False, compare=False)  # id -> (cache, state, scale strides)
    # -> (decode launch, checked window, prefill (kernel, config))
    _launch_by_layout: dict = field(default_factory=dict, repr=False, compare=False)
    _scale_memo: tuple | None = field(default=None, repr=False, compare=False)  # (softmax_scale, qk_scale)
    # (codes, scales) the prefill launch's query is quantized into (8-bit caches)
    _prefill_codes: tuple | None = field(default=None, repr=False, compare=False)

    def run(self, query, cache, block_table, seq_lens, query_start_loc, softmax_scale=None, out=None, *,
            q_quant=None, q_scale=None, window=None) -> torch.Tensor:
        """Launch the planned kernels (no host sync; CUDA-graph capturable).

        Arguments as :func:`attention`; ``window`` is per run (a model's sliding-window and
        full-attention layers share the step's plan). Checks: a call with the plan's metadata tensors
        and an input layout an earlier run validated costs a few attribute comparisons (a
        new cache object: its storage layout and geometry too); anything else is validated
        in full first (metadata values too when the metadata tensors are not the plan's),
        so bad input still raises before any launch. Contents of the metadata tensors
        changed in place after planning are not re-checked (as with
        ``INT8ATTN_CHECK_VALUES=0``); the kernels still clamp them, and a sequence whose
        metadata went out of range gets NaN rows and a device error flag.
        """
        launch = _MISSING
        if self._is_plan_metadata(block_table, seq_lens, query_start_loc):
            seen = self._caches.get(id(cache))
            if seen is None or seen[0] is not cache or not _checks.cache_state_is(cache, seen[1]):
                seen = self._admit_cache(cache)  # another layer's cache: its storage and geometry
            try:
                key = (_layout(query), _layout(out), _layout(q_quant), _layout(q_scale), seen[2], type(window),
                       window)
                launch = self._launch_by_layout.get(key, _MISSING)
            except (AttributeError, TypeError):  # not a tensor, an unhashable window: the full checks say so
                launch = _MISSING
        if launch is _MISSING:
            launch = self._validate(query, cache, block_table, seq_lens, query_start_loc, out, q_quant, q_scale,
                                    window)
        launch, win, (kernel, config) = launch
        qk_scale = self._qk_scale(softmax_scale, cache)
        if out is None:
            out = torch.empty((self.num_tokens, self.num_q_heads, self.head_dim), dtype=torch.bfloat16,
                              device=cache.device)
        decode_args = (query, q_quant, q_scale, cache, block_table, seq_lens, query_start_loc, out, qk_scale)
        prefill_args = (kernel, config, win, query, cache, block_table, seq_lens, query_start_loc, softmax_scale,
                        out, q_quant, q_scale)
        if launch is not None and self.overlap:
            # fork: the side stream starts after everything the caller queued (its inputs);
            # the two launches write disjoint rows of out; join before returning, so any
            # later work on the caller's stream (and a freed out's memory) comes after both
            main = torch.cuda.current_stream(cache.device)
            side = side_stream(cache.device, OVERLAP_PRIORITY)
            side.wait_stream(main)
            if OVERLAP_PREFILL_FIRST:
                self._run_prefill(*prefill_args)
            with torch.cuda.stream(side):
                launch(*decode_args)
            if not OVERLAP_PREFILL_FIRST:
                self._run_prefill(*prefill_args)
            main.wait_stream(side)
            return out
        if launch is not None:
            launch(*decode_args)
        if self.has_prefill:
            self._run_prefill(*prefill_args)
        return out

    def _run_prefill(self, kernel, config, window, query, cache, block_table, seq_lens, query_start_loc,
                     softmax_scale, out, q_quant, q_scale) -> None:
        """The prefill launch of a run (its query codes first where the kernel needs them)."""
        if q_quant is None and self.kv_dtype != "bf16" and (kernel == "hopper" or cache.key_channel_scale is not None):
            q_quant, q_scale = self._prefill_query_codes(query, cache)
        _run_prefill(kernel, config, self.prefill_pv_mode, query, cache, block_table, seq_lens, query_start_loc,
                     softmax_scale, out, q_quant, q_scale, MAX_DECODE_QUERY_LEN if self.has_decode else 0,
                     self.max_query_len, window=window)

    def _prefill_query_codes(self, query, cache) -> tuple:
        """The query's codes and scales for a prefill launch that needs them (the Hopper
        kernel; the portable one under channel migration), quantized into buffers the plan
        owns: the same tensors every run, so both launches stay on their cached path (fresh
        codes per call would cost two allocations and a full argument check per launch).
        Buffers first needed during a CUDA-graph capture are that capture's own."""
        from .producer import query_code_buffers, quantize_query_unchecked

        codes = self._prefill_codes
        if codes is None:
            codes = query_code_buffers(self.num_tokens, self.num_q_heads, self.head_dim, self.kv_dtype,
                                       query.device)
            if not capturing(query.device):
                self._prefill_codes = codes
        # the query, the cache and its channel scale were checked when this layout was admitted
        return quantize_query_unchecked(query, self.kv_dtype, codes[0], codes[1], cache.key_channel_scale)

    # ------------------------------------------------------------------ slow path
    def _validate(self, query, cache, block_table, seq_lens, query_start_loc, out, q_quant, q_scale, window=None):
        """Full checks of a call the plan has not seen; remembers what passed and returns
        (the decode launch for this layout, None when the plan launches no decode; the
        checked window; the prefill (kernel, config): the plan's, or the portable kernel for
        a window)."""
        known_meta = self._is_plan_metadata(block_table, seq_lens, query_start_loc)
        _checks.check_attention_inputs(query, cache, block_table, seq_lens, query_start_loc, out=out,
                                       q_quant=q_quant, q_scale=q_scale, check_values=False)
        win = _checks.check_window(window)
        self._check_matches(query, cache, block_table)
        if not known_meta:
            if self.num_seqs > 0 and _checks.value_checks_enabled(cache.device):
                facts = _checks.check_attention_values(self.num_tokens, cache, block_table, seq_lens,
                                                       query_start_loc, decode_limit=MAX_DECODE_QUERY_LEN)
                self._check_facts(*facts[1:4])
            self._metadata = (block_table, seq_lens, query_start_loc)
            self._launch_by_layout.clear()  # the block table's stride is part of every launch
        scale_strides = self._admit_cache(cache)[2]
        launch = None
        if self.has_decode and self.num_tokens > 0 and self.num_seqs > 0:
            out_strides = out.stride() if out is not None else (self.num_q_heads * self.head_dim, self.head_dim, 1)
            if self.decode_kernel == "hopper" and not win:
                config, splits, decode_q, codes, keys_on_m, consumers = self.decode_hopper
                launch = _decode_hopper.DecodeHopperLaunch(config, splits, decode_q, self.workspace, codes, keys_on_m,
                                                           consumers)
            else:  # the Hopper kernel has no sliding window: a windowed run takes the portable kernel
                launch = _decode.DecodeLaunch.for_tensors(self.decode_plan, cache, query, q_quant, q_scale,
                                                          block_table, out_strides, self.workspace, win)
        if len(self._launch_by_layout) >= _MAX_REMEMBERED:
            self._launch_by_layout.clear()
        prefill = (self.prefill_kernel, self.prefill_config)
        if win and self.has_prefill:
            prefill = _prefill_route(cache, self.prefill_pv_mode, self.num_q_heads, "portable", win)
        key = (_layout(query), _layout(out), _layout(q_quant), _layout(q_scale), scale_strides, type(window), window)
        self._launch_by_layout[key] = entry = (launch, win, prefill)
        return entry

    def _is_plan_metadata(self, block_table, seq_lens, query_start_loc) -> bool:
        """Whether these are the metadata tensors whose values the plan (or an earlier run)
        checked: compared by identity."""
        meta = self._metadata
        return meta is not None and block_table is meta[0] and seq_lens is meta[1] and query_start_loc is meta[2]

    def _admit_cache(self, cache) -> tuple:
        """Check a cache object the plan has not run with (its storage layout, remembered
        by :func:`int8attn._checks.check_cache`, and the plan's geometry) and remember it:
        a step's plan serves every layer's cache. Returns (cache, state, scale strides)."""
        _checks.check_cache(cache)
        self._check_geometry(cache)
        if len(self._caches) >= _MAX_REMEMBERED:
            self._caches.clear()
        seen = (cache, _checks.cache_state(cache), _scale_strides(cache))
        self._caches[id(cache)] = seen
        return seen

    def _check_geometry(self, cache) -> None:
        geometry = _geometry(cache)
        if self._geometry is None:
            self._geometry = geometry
        elif geometry[:5] != self._geometry[:5] or not _checks.same_device(geometry[5], self._geometry[5]):
            raise ValueError(
                "this AttentionPlan was made for a cache of (kv_dtype, num_blocks, num_kv_heads, block_size, "
                f"head_dim, device) = {self._geometry}, got {geometry}: make a new plan for this cache"
            )

    def _check_matches(self, query, cache, block_table) -> None:
        got = (query.shape[0], block_table.shape[0], query.shape[1], query.shape[2], cache.kv_dtype)
        want = (self.num_tokens, self.num_seqs, self.num_q_heads, self.head_dim, self.kv_dtype)
        if got != want:
            raise ValueError(
                "this AttentionPlan was made for (num_tokens, num_seqs, num_q_heads, head_dim, kv_dtype) = "
                f"{want}, got {got}: make a new plan for this batch"
            )
        self._check_geometry(cache)

    def _check_facts(self, max_query_len: int, has_decode: bool, has_prefill: bool) -> None:
        """The batch's query lengths (read from the device) fit what the plan launches."""
        problems = []
        if max_query_len > self.max_query_len:
            problems.append(f"a query of {max_query_len} tokens (plan: at most {self.max_query_len})")
        if has_decode and not self.has_decode:
            problems.append("a decode sequence (plan: none)")
        if has_prefill and not self.has_prefill:
            problems.append("a prefill sequence (plan: none)")
        if problems:
            raise ValueError("this batch does not fit its AttentionPlan: it has " + " and ".join(problems)
                             + "; make a new plan for this batch")

    def _qk_scale(self, softmax_scale, cache) -> float:
        """The kernels' score multiplier; a new softmax_scale is checked first."""
        memo = self._scale_memo
        if memo is not None and memo[0] is softmax_scale or (
                type(softmax_scale) is float and memo is not None and softmax_scale == memo[0]):
            return memo[1]
        _checks.check_kernel_options(cache, softmax_scale, "attention")
        qk_scale = _decode.qk_scale_of(softmax_scale, self.head_dim)
        self._scale_memo = (softmax_scale, qk_scale)
        return qk_scale


def plan_attention(cache: PagedKVCache, block_table, seq_lens, query_start_loc, num_q_heads: int, *,
                   num_tokens: int | None = None, max_query_len: int | None = None,
                   has_decode: bool | None = None, has_prefill: bool | None = None,
                   pv_mode: str | None = None, num_splits: int | None = None,
                   prefill_kernel: str | None = None, decode_kernel: str | None = None,
                   overlap: bool | None = None) -> AttentionPlan:
    """Plan a batch once: which kernels it needs, its longest query, decode splits,
    workspace and query-code buffers.

    Reads the metadata back to the host once (one sync, whatever the device: the kernels
    do not need it, but a plan is the one place per batch where the read-back is cheap),
    calls :func:`int8attn.check_errors` for flags earlier kernels raised, and checks the values (block ids
    in range, ``q_len <= seq_len <= capacity``, ``query_start_loc`` from 0 to
    ``num_tokens``, non-decreasing) and takes the facts not given (``num_tokens``,
    ``max_query_len``, ``has_decode``, ``has_prefill``), or checks the given ones against
    the lengths. With value checks off (``INT8ATTN_CHECK_VALUES=0``, or while a CUDA graph
    is being captured) and all four facts given, nothing is read: a plan for bounds the
    caller knows. Runs with these metadata tensors do not check their values again. The
    decode launch of a mixed batch is sized by its longest decode query where the lengths
    were read (else by the mean query length, which the prefill tokens inflate: tiles for up
    to ``MAX_DECODE_QUERY_LEN`` tokens per decode sequence).
    ``prefill_kernel`` ("auto" | "hopper" | "portable", None: ``INT8ATTN_PREFILL_KERNEL``)
    picks the prefill kernel once, for every run (see :mod:`int8attn.ops.prefill_hopper`);
    ``decode_kernel`` (the same names, None: ``INT8ATTN_DECODE_KERNEL``) the decode kernel
    (see :func:`int8attn.ops.decode_hopper.route`: "auto" runs a batch of decode sequences
    only whose longest query packs more than 16 rows -- GQA group x tokens -- on the Hopper
    kernel on sm_90; a mixed batch keeps the portable decode kernel). ``overlap`` (None:
    ``OVERLAP_DEFAULT``): a mixed batch on a GPU runs its decode launch on a side stream
    beside its prefill launch (forked from the caller's stream and joined back within each
    run, CUDA-graph capturable); elsewhere, or for a batch needing one kernel, it is ignored.
    """
    _checks.check_cache(cache)
    if overlap not in (None, True, False):
        raise ValueError(f"overlap must be None, True or False, got {overlap!r}")
    if not _checks.is_int(num_q_heads, 1) or num_q_heads % cache.num_kv_heads:
        raise ValueError(f"num_q_heads must be a positive multiple of the cache's {cache.num_kv_heads} KV heads, "
                         f"got {num_q_heads!r}")
    _checks.check_kernel_options(cache, None, "attention")
    if has_decode is not False:
        _decode.check_decode_options(cache, None, None)
    dev = cache.device
    _checks.check_tensor("block_table", block_table, dtypes=(torch.int32,), ndim=2, device=dev)
    num_seqs = block_table.shape[0]
    _checks.check_tensor("seq_lens", seq_lens, dtypes=(torch.int32,), shape=(num_seqs,), device=dev,
                         contiguous=True)
    _checks.check_tensor("query_start_loc", query_start_loc, dtypes=(torch.int32,), shape=(num_seqs + 1,),
                         device=dev, contiguous=True)
    for name, value in (("num_tokens", num_tokens), ("max_query_len", max_query_len)):
        if value is not None and not _checks.is_int(value):
            raise ValueError(f"{name} must be None or an int >= 0, got {value!r}")
    given = (num_tokens, max_query_len, has_decode, has_prefill)
    values_checked = False
    # Planning checks values on every device (device=None: only INT8ATTN_CHECK_VALUES=0 or
    # a CUDA-graph capture turn it off): one sync per batch, shared by every layer's run.
    if num_seqs and _checks.value_checks_enabled():
        seen = _checks.check_attention_values(num_tokens, cache, block_table, seq_lens, query_start_loc,
                                              decode_limit=MAX_DECODE_QUERY_LEN)  # the one sync
        values_checked = True
        check_errors(dev)  # flags raised by earlier kernels (the device is idle now: no extra wait)
    elif None in given:
        seen = _read_facts(query_start_loc, num_seqs)
    else:
        seen = None
    if seen is not None:
        if num_tokens is not None and seen[0] != num_tokens:
            raise ValueError(f"num_tokens={num_tokens} but query_start_loc ends at {seen[0]}")
        num_tokens = seen[0]
        if max_query_len is None:
            max_query_len = seen[1]
        elif seen[1] > max_query_len:
            raise ValueError(f"max_query_len={max_query_len} but the batch has a query of {seen[1]} tokens")
        for name, flag, real in (("has_decode", has_decode, seen[2]), ("has_prefill", has_prefill, seen[3])):
            if flag is not None and real and not flag:
                raise ValueError(f"{name}=False but the batch has such a sequence")
        has_decode = seen[2] if has_decode is None else has_decode
        has_prefill = seen[3] if has_prefill is None else has_prefill
    has_decode, has_prefill = bool(has_decode), bool(has_prefill)
    head_dim = cache.head_dim
    query_shape = (num_tokens, num_q_heads, head_dim)

    decode_plan = workspace = decode_hopper = None
    decode_kernel_name = "portable"
    if has_decode:
        _decode.check_num_seqs(num_seqs)
        # a mixed batch's decode rows per program follow its longest decode query where the
        # lengths were read (else the mean query length, which a prefill chunk inflates to
        # MAX_DECODE_QUERY_LEN tokens: 8-token tiles and GQA groups split over programs that
        # each re-read the K/V, for what are mostly one-token decode steps)
        decode_query_len = seen[4] if seen is not None and has_prefill else None
        decode_plan = _decode.plan_decode(query_shape, cache, tuple(block_table.shape), pv_mode=pv_mode,
                                          num_splits=num_splits, max_query_len=decode_query_len)
        # the Hopper decode serves pure decode batches: in a mixed batch the longest decode
        # query is not known on the host (max_query_len is a prefill's), and its q1 rows run
        # faster on the portable kernel
        decode_q = max(1, min(max_query_len or 1, MAX_DECODE_QUERY_LEN))
        if not has_prefill and _decode_hopper.route(cache, num_q_heads, decode_q, pv_mode, decode_kernel):
            decode_kernel_name = "hopper"
            config, splits, keys_on_m, consumers = _decode_hopper.plan_launch(cache, num_q_heads, num_seqs,
                                                                              block_table.shape[1], decode_q, pv_mode,
                                                                              num_splits)
            from .producer import query_code_buffers  # made here, outside any capture of the runs

            codes = query_code_buffers(num_tokens, num_q_heads, head_dim, cache.kv_dtype, dev)
            decode_hopper = (config, splits, decode_q, codes, keys_on_m, consumers)
            # the portable kernel's splits too: a run with a sliding window takes it
            workspace = _decode.DecodeWorkspace(max(num_tokens, 1), num_q_heads, head_dim,
                                                max(consumers * splits, decode_plan.num_splits), device=dev)
        elif decode_plan.num_splits > 1:
            workspace = _decode.DecodeWorkspace(max(num_tokens, 1), num_q_heads, head_dim,
                                                decode_plan.num_splits, device=dev)
    else:
        _decode_hopper.requested_kernel(decode_kernel)  # a bad name fails here too
    prefill_config = prefill_pv = None
    prefill_kernel_name = "portable"
    if has_prefill:
        prefill_pv = _prefill.resolve_pv_mode(cache.kv_dtype, pv_mode)
        _prefill.check_prefill_options(cache, None, 0, max_query_len)
        prefill_kernel_name, prefill_config = _prefill_route(cache, prefill_pv, num_q_heads, prefill_kernel)
    else:
        _hopper.requested_kernel(prefill_kernel)  # a bad name fails here too
    launches = tuple(name for name, used in (("decode", has_decode), ("prefill", has_prefill)) if used)
    plan = AttentionPlan(num_tokens=num_tokens, num_seqs=num_seqs, num_q_heads=num_q_heads, head_dim=head_dim,
                         kv_dtype=cache.kv_dtype, max_query_len=max_query_len, has_decode=has_decode,
                         has_prefill=has_prefill, decode_plan=decode_plan, workspace=workspace,
                         prefill_config=prefill_config, prefill_kernel=prefill_kernel_name, pv_mode=pv_mode,
                         prefill_pv_mode=prefill_pv, decode_kernel=decode_kernel_name,
                         decode_hopper=decode_hopper, launches=launches, values_checked=values_checked,
                         overlap=bool(OVERLAP_DEFAULT if overlap is None else overlap) and has_decode and has_prefill
                         and dev.type == "cuda" and not interpret_mode())
    plan._geometry = _geometry(cache)
    plan._metadata = (block_table, seq_lens, query_start_loc)
    if has_prefill and prefill_kernel_name == "hopper" and cache.kv_dtype != "bf16":
        # made here, outside any capture of the runs
        from .producer import query_code_buffers

        plan._prefill_codes = query_code_buffers(num_tokens, num_q_heads, head_dim, cache.kv_dtype, dev)
    return plan


def _read_facts(query_start_loc, num_seqs: int) -> tuple:
    """(num_tokens, max_query_len, has_decode, has_prefill, max_decode_query_len) from
    query_start_loc alone (one sync; used when value checks are off but the caller left
    facts to the plan)."""
    qsl = query_start_loc.to("cpu", torch.int64)
    q_lens = qsl[1:] - qsl[:-1]
    if num_seqs and (int(qsl[0]) != 0 or bool((q_lens < 0).any())):
        raise ValueError("query_start_loc must start at 0 and be non-decreasing")
    decode = (q_lens >= 1) & (q_lens <= MAX_DECODE_QUERY_LEN)
    has_decode = bool(decode.any())
    return (int(qsl[-1]), int(q_lens.max()) if num_seqs else 0, has_decode,
            bool((q_lens > MAX_DECODE_QUERY_LEN).any()), int(q_lens[decode].max()) if has_decode else 0)


def attention(query, cache, block_table, seq_lens, query_start_loc, softmax_scale=None, out=None, *,
              plan: AttentionPlan | None = None, q_quant=None, q_scale=None, pv_mode=None,
              prefill_kernel: str | None = None, window: int | None = None) -> torch.Tensor:
    """Causal attention of a mixed varlen batch over the paged cache (docs/design.md §6).

    Args:
        query: [T, Hq, D] bf16 (fp16 / fp32 accepted); Hq a multiple of the cache's KV heads.
        cache: :class:`int8attn.PagedKVCache`; the new tokens' K/V are already written.
        block_table: [num_seqs, max_blocks] int32; seq_lens: [num_seqs] int32 (new tokens
            included); query_start_loc: [num_seqs + 1] int32.
        softmax_scale: defaults to ``head_dim ** -0.5``.
        out: optional [T, Hq, D] bf16 output.
        plan: an :class:`AttentionPlan` from :func:`plan_attention` for this batch:
            launches only the kernels the batch needs (its pv_mode applies), with the
            per-call checks of :meth:`AttentionPlan.run` (no host sync).
        q_quant, q_scale: the query pre-quantized for the cache (from the producer).
        pv_mode: PV precision ("int8" | "bf16" for INT8 caches, "fp8" | "bf16" for FP8)
            for both kernels; None lets each take its measured default (decode: 8-bit
            PV; prefill: 16-bit PV, see :data:`int8attn.ops.prefill.DEFAULT_PV`).
        prefill_kernel: "auto" | "hopper" | "portable" (None: ``INT8ATTN_PREFILL_KERNEL``,
            default "auto"): the prefill kernel, see :mod:`int8attn.ops.prefill_hopper`
            ("hopper" where it cannot run raises ValueError before any launch; "auto"
            takes the Hopper kernel on the routes measured faster, ``AUTO_ROUTES``).
            With a plan, pass it to :func:`plan_attention`.
        window: sliding window (None: full causal attention), per call: each query token
            sees only the ``window`` most recent positions up to its own, its own included
            (transformers' ``sliding_window``; FlashAttention's ``window_size=(window - 1,
            0)``); keys before the window are not read. Prefill with a window runs the
            portable kernel.

    Query token j of sequence s sits at position ``seq_lens[s] - q_len_s + j`` and attends
    to every cached key at a position <= its own (within ``window``). Returns ``out`` [T, Hq, D] bf16; rows of
    sequences with q_len 0 do not exist, every other row is written.

    Checks: types, shapes, strides and devices before any launch, in full on the first
    call of a layout (a repeat with the same cache object, layouts and options compares
    them with the remembered ones, see the module docstring). Value checks
    (block ids, lengths, ``query_start_loc``; a device read-back) run in
    :func:`plan_attention` (one sync per batch, shared by every layer's run), in unplanned
    calls on CPU tensors, and in unplanned calls on a CUDA device only with
    ``INT8ATTN_CHECK_VALUES=1``: an unplanned GPU call never synchronises the device by
    default. No kernel moves an address outside its tensors whatever the metadata: the
    affected sequences' rows are NaN and a device error flag is raised, which
    :func:`int8attn.check_errors` (or the next plan) turns into
    :class:`int8attn.DeviceMetadataError` (``INT8ATTN_DECODE_SAFE=0`` builds decode
    launches without their clamps, for callers that check every batch themselves). Decode
    and prefill take any head_dim that is a multiple of 16 from 16 to 256 (a tile padded to
    the next power of two, the padding channels masked).
    """
    if plan is not None:
        if not isinstance(plan, AttentionPlan):
            raise TypeError(f"plan must be an AttentionPlan, got {type(plan).__name__}")
        if pv_mode is not None and pv_mode != plan.pv_mode:
            raise ValueError(f"pv_mode {pv_mode!r} differs from the plan's {plan.pv_mode!r}: pass it to plan_attention")
        if prefill_kernel is not None:
            raise ValueError("prefill_kernel applies when planning: pass it to plan_attention")
        return plan.run(query, cache, block_table, seq_lens, query_start_loc, softmax_scale, out,
                        q_quant=q_quant, q_scale=q_scale, window=window)
    key = _route_key(query, cache, block_table, seq_lens, query_start_loc, softmax_scale, out, q_quant, q_scale,
                     pv_mode, prefill_kernel, window)
    route = _ROUTES.get(key) if key is not None else None
    if route is not None and route.cache() is cache and route.makers == _makers():
        _checks.check_cache(cache)  # remembered: an identity test unless the storage was replaced
        if route.cache_facts == _cache_facts(cache):
            return _launch_route(route, query, cache, block_table, seq_lens, query_start_loc, softmax_scale, out,
                                 q_quant, q_scale)
    _check_common(query, cache, block_table, seq_lens, query_start_loc, softmax_scale, out, q_quant, q_scale)
    win = _checks.check_window(window)
    _hopper.requested_kernel(prefill_kernel)  # a bad name fails on every call
    num_tokens = query.shape[0]
    num_seqs = block_table.shape[0]
    prefill_pv = _prefill.resolve_pv_mode(cache.kv_dtype, pv_mode)
    decode_plan = _decode.plan_decode(tuple(query.shape), cache, tuple(block_table.shape), pv_mode=pv_mode)
    if num_tokens == 0 or num_seqs == 0:
        return torch.empty(query.shape, dtype=torch.bfloat16, device=query.device) if out is None else out
    check_values = _checks.value_checks_enabled(cache.device)
    prefill = None
    if num_tokens > MAX_DECODE_QUERY_LEN:
        prefill = (*_prefill_route(cache, prefill_pv, query.shape[1], prefill_kernel, win), prefill_pv)
    _decode.check_num_seqs(num_seqs)
    out_strides = out.stride() if out is not None else (query.shape[1] * query.shape[2], query.shape[2], 1)
    launch = _decode.reused_launch(decode_plan, cache, query, q_quant, q_scale, block_table, out_strides, None, win)
    if launch is None:  # being captured into a CUDA graph: a launch for this capture only
        launch = _decode.DecodeLaunch.for_tensors(decode_plan, cache, query, q_quant, q_scale, block_table,
                                                  out_strides, None, win)
    route = _Route(weakref.ref(cache), _cache_facts(cache), _makers(), launch,
                   _decode.qk_scale_of(softmax_scale, cache.head_dim), check_values, prefill, win)
    if key is not None:
        if len(_ROUTES) >= _MAX_REMEMBERED:
            _ROUTES.clear()
        _ROUTES[key] = route
    # checked above: the route's own value checks are for later calls
    return _launch_route(route._replace(check_values=False), query, cache, block_table, seq_lens, query_start_loc,
                         softmax_scale, out, q_quant, q_scale)


#: Unplanned calls whose inputs passed the full checks, by everything those checks and the
#: launch choices depend on (:func:`_route_key`, and the route's makers): a later call with
#: the same cache object, input layouts, options, environment switches, planners and kernels
#: skips the checks and the planning and launches the remembered decode launch, as a plan's
#: runs do (value checks, where enabled, still run on every call). Cleared when full.
_ROUTES: dict = {}


class _Route(NamedTuple):
    """What an unplanned call launches, worked out once per layout."""

    cache: weakref.ref  # the cache the key's id() named: a new object at a reused id misses
    cache_facts: tuple  # its geometry and scale strides (the launch's fixed arguments)
    makers: tuple  # the planners and kernels it was made with (_makers(); compared, not hashed)
    decode: "_decode.DecodeLaunch"
    qk_scale: float
    check_values: bool  # read the metadata back on every call (CPU tensors, INT8ATTN_CHECK_VALUES=1)
    prefill: tuple | None  # (kernel, config, PV mode) when the batch may hold a prefill sequence
    window: int  # the checked sliding window (0: none)


def _cache_facts(cache) -> tuple:
    return _geometry(cache), _scale_strides(cache)


def _makers() -> tuple:
    """The planners and kernels a route is made with, as their modules hold them now (a
    test or a sweep may replace one). Kept in the route and compared by identity on a hit:
    hashing Triton kernels in the key costs more than the rest of the key."""
    return _decode.launch_makers() + (_prefill.default_config,)


def _route_key(query, cache, block_table, seq_lens, query_start_loc, softmax_scale, out, q_quant, q_scale,
               pv_mode, prefill_kernel, window):
    """The key of an unplanned call in :data:`_ROUTES`, or None for a call that is not
    remembered (one being captured into a CUDA graph, or with arguments that are not
    tensors or not hashable: the full checks then say what is wrong)."""
    try:
        stream = stream_id(cache.device)
        if stream is None:
            return None
        key = (id(cache), _layout(query), _layout(out), _layout(q_quant), _layout(q_scale), _layout(block_table),
               _layout(seq_lens), _layout(query_start_loc), type(softmax_scale), softmax_scale, pv_mode,
               prefill_kernel, type(window), window, stream, _checks.switches())
        hash(key)
    except (AttributeError, TypeError):
        return None
    return key


def _launch_route(route: _Route, query, cache, block_table, seq_lens, query_start_loc, softmax_scale, out, q_quant,
                  q_scale) -> torch.Tensor:
    if route.check_values:
        _checks.check_values_now(query.shape[0], cache, block_table, seq_lens, query_start_loc)
    if out is None:
        out = torch.empty(query.shape, dtype=torch.bfloat16, device=query.device)
    route.decode(query, q_quant, q_scale, cache, block_table, seq_lens, query_start_loc, out, route.qk_scale)
    if route.prefill is not None:
        kernel, config, pv = route.prefill
        _run_prefill(kernel, config, pv, query, cache, block_table, seq_lens, query_start_loc, softmax_scale, out,
                     q_quant, q_scale, MAX_DECODE_QUERY_LEN, None, window=route.window)
    return out


def _check_common(query, cache, block_table, seq_lens, query_start_loc, softmax_scale, out, q_quant, q_scale):
    """Everything both kernels need, checked once before any launch."""
    _checks.check_attention_inputs(query, cache, block_table, seq_lens, query_start_loc, out=out,
                                   q_quant=q_quant, q_scale=q_scale)
    if query.shape[0] > MAX_DECODE_QUERY_LEN:  # the prefill kernel may run (see attention())
        _prefill.check_prefill_options(cache, softmax_scale, 0, None)
    _decode.check_decode_options(cache, softmax_scale, None)
