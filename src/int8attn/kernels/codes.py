"""Kernel mode codes: the one table of the integer codes kernels take as constexpr modes.

Launchers and tests look codes up by name in the maps (plain ints, what a launch passes as a
``tl.constexpr`` argument); ``@triton.jit`` bodies compare against the ``tl.constexpr``
names below (a jitted body may only read constexpr globals). The values are compile-time
constants with no meaning outside this table: change one here and every kernel, launcher
and test follows.

* ``KV_KIND`` -- storage of the KV cache (and of the quantize kernels' output): the
  ``KIND`` argument of the quantize / producer kernels, ``KV_KIND`` of decode and prefill.
* ``PV_KIND`` -- precision of the P·V product in decode and prefill (``PV_KIND``);
  ``int8_signed`` (P on 0..127) is a decode-only measurement variant.
* ``PV_MODES`` -- the PV modes a public call may ask for, per KV kind; the first is
  decode's default (prefill's is ``ops.prefill.DEFAULT_PV``). "bf16" means a 16-bit float
  PV product (fp16 for 8-bit caches: their V values are exact in it).
* ``QK_ROUTE`` -- the route of the gate's QK-only kernel (kernels/qk_tile.py).
* ``MERGE`` -- where decode's split partials are merged (``FUSED_MERGE`` of the split
  kernel): ``kernel`` by the separate merge kernel, ``last`` by the last split of a
  (sequence, KV head) to finish, ``barrier`` by every split after a barrier (cooperative
  launch only: it needs every program resident).
* ``QUERY_IN`` -- what decode's split kernel reads as its query (``QUERY_IN``): ``codes``
  already quantized (or a bf16 query for the bf16 cache); ``quantize`` a float query that
  one program per (sequence, KV head) quantizes in the launch for the others;
  ``quantize_lam`` the same, multiplied by the cache's channel-migration scale first.
* ``PDL_TRIGGER`` -- where decode's split programs let their programmatic dependent (the
  merge kernel, ``DecodeConfig.pdl``) launch (``PDL_TRIGGER``): ``exit`` no trigger
  instruction (a program triggers as it exits; the code of a launch without PDL);
  ``start`` first thing in each program; ``store`` after the tile loop, before the
  partial rows are stored (multi-pass programs: at their end). The merge programs wait for
  the whole split grid before reading a partial whatever the position: it only moves when
  they may be scheduled.
* ``LAZY_RESCALE`` -- when the warp-specialized Hopper prefill kernel rescales a 16-bit-P
  accumulator (``LAZY``): ``off`` every tile; ``warpgroup`` only in tiles where some row's
  maximum grew by more than ``LAZY_TAU`` (one warpgroup-wide test per tile); ``rows`` each
  row's maximum moves only when it grew by more than ``LAZY_TAU``, and a thread skips the
  multiply when both of its rows kept theirs (no cross-thread test).
"""

import triton.language as tl

KV_KIND = {"int8": 0, "fp8": 1, "bf16": 2}
PV_KIND = {"int8": 0, "int8_signed": 1, "fp8": 2, "bf16": 3}
PV_MODES = {"int8": ("int8", "bf16"), "fp8": ("fp8", "bf16"), "bf16": ("bf16",)}
QK_ROUTE = {"bf16": 0, "int8_to_bf16": 1, "int8_native": 2}
MERGE = {"kernel": 0, "last": 1, "barrier": 2}
QUERY_IN = {"codes": 0, "quantize": 1, "quantize_lam": 2}
LAZY_RESCALE = {"off": 0, "warpgroup": 1, "rows": 2}
PDL_TRIGGER = {"exit": 0, "start": 1, "store": 2}

# constexpr names for @triton.jit bodies
KIND_INT8 = tl.constexpr(KV_KIND["int8"])
KIND_FP8 = tl.constexpr(KV_KIND["fp8"])
KIND_BF16 = tl.constexpr(KV_KIND["bf16"])
PV_INT8 = tl.constexpr(PV_KIND["int8"])
PV_INT8_SIGNED = tl.constexpr(PV_KIND["int8_signed"])
PV_FP8 = tl.constexpr(PV_KIND["fp8"])
PV_BF16 = tl.constexpr(PV_KIND["bf16"])
ROUTE_BF16 = tl.constexpr(QK_ROUTE["bf16"])
ROUTE_INT8_TO_BF16 = tl.constexpr(QK_ROUTE["int8_to_bf16"])
ROUTE_INT8_NATIVE = tl.constexpr(QK_ROUTE["int8_native"])
MERGE_LAST = tl.constexpr(MERGE["last"])
MERGE_BARRIER = tl.constexpr(MERGE["barrier"])
QUERY_CODES = tl.constexpr(QUERY_IN["codes"])
QUERY_QUANTIZE_LAM = tl.constexpr(QUERY_IN["quantize_lam"])
PDL_AT_START = tl.constexpr(PDL_TRIGGER["start"])
PDL_AT_STORE = tl.constexpr(PDL_TRIGGER["store"])
LAZY_WARPGROUP = tl.constexpr(LAZY_RESCALE["warpgroup"])
LAZY_ROWS = tl.constexpr(LAZY_RESCALE["rows"])
