"""Test and benchmark helpers: realistic random data, paged batches, verbose comparison.

Shipped with the package so that tests, benchmarks, the gate and users' own checks build
inputs the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from . import reference, runtime
from .cache import BlockAllocator, PagedKVCache

POISON = float("nan")


def make_keys(
    num_tokens: int,
    num_heads: int,
    head_dim: int,
    *,
    outliers: bool = True,
    num_outlier_channels: int = 4,
    outlier_scale: tuple[float, float] = (10.0, 30.0),
    generator: torch.Generator | None = None,
    device="cpu",
    dtype=torch.bfloat16,
) -> torch.Tensor:
    """Keys as attention sees them after RoPE: N(0, 1) plus, with ``outliers``, a few
    channels per head carrying a large consistent offset (10-30x the rest, sign fixed per
    channel), the pattern real LLM keys show. [num_tokens, num_heads, head_dim]."""
    k = torch.randn(num_tokens, num_heads, head_dim, generator=generator, dtype=torch.float32)
    if outliers and num_outlier_channels:
        for h in range(num_heads):
            channels = torch.randperm(head_dim, generator=generator)[:num_outlier_channels]
            lo, hi = outlier_scale
            mag = lo + (hi - lo) * torch.rand(num_outlier_channels, generator=generator)
            sign = torch.where(torch.rand(num_outlier_channels, generator=generator) < 0.5, -1.0, 1.0)
            k[:, h, channels] = k[:, h, channels] * 2.0 + mag * sign
    return k.to(device=device, dtype=dtype)


def make_normal(shape, *, generator=None, device="cpu", dtype=torch.bfloat16, std: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=generator, dtype=torch.float32) * std).to(device=device, dtype=dtype)


@dataclass
class PagedBatch:
    """A ready-to-run attention batch over a randomly paged cache."""

    cache: PagedKVCache
    query: torch.Tensor  # [num_tokens, num_q_heads, head_dim] bf16
    block_table: torch.Tensor  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    key: torch.Tensor  # the raw keys written, [total_kv_tokens, num_kv_heads, head_dim]
    value: torch.Tensor
    slot_mapping: torch.Tensor

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.numel()


def make_paged_batch(
    seq_lens,
    q_lens,
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int = 16,
    kv_dtype: str = "int8",
    outliers: bool = True,
    key_smoothing: str = "auto",
    shuffle_blocks: bool = True,
    extra_blocks: int = 3,
    seed: int = 0,
    device=None,
    writer=None,
) -> PagedBatch:
    """Build a cache holding ``seq_lens[i]`` tokens of sequence i (in randomly permuted
    physical blocks) and ``q_lens[i]`` query tokens per sequence.

    ``writer(cache, key, value, slot_mapping)`` fills the cache; the default is the
    plain-PyTorch :func:`int8attn.reference.write_kv_reference`, so attention tests do not
    depend on the write kernel.
    """
    device = device or runtime.default_device()
    seq_lens = [int(x) for x in seq_lens]
    q_lens = [int(x) for x in q_lens]
    if len(seq_lens) != len(q_lens) or any(q > s for q, s in zip(q_lens, seq_lens)):
        raise ValueError("need one q_len per sequence, each <= its seq_len")
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = sum(-(-s // block_size) for s in seq_lens)
    num_blocks = blocks_needed + extra_blocks
    cache = PagedKVCache(num_blocks, block_size, num_kv_heads, head_dim, kv_dtype=kv_dtype, device=device,
                         key_smoothing=key_smoothing)
    alloc = BlockAllocator.for_cache(cache)
    if shuffle_blocks:
        alloc._free = torch.randperm(num_blocks, generator=gen).tolist()
    slots = []
    for i, s in enumerate(seq_lens):
        slots.extend(alloc.allocate(i, s))
    total = len(slots)
    key = make_keys(total, num_kv_heads, head_dim, outliers=outliers, generator=gen)
    value = make_normal((total, num_kv_heads, head_dim), generator=gen)
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    key, value, slot_mapping = key.to(device), value.to(device), slot_mapping.to(device)
    (writer or reference.write_kv_reference)(cache, key, value, slot_mapping)
    query = make_normal((sum(q_lens), num_q_heads, head_dim), generator=gen, device=device)
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    return PagedBatch(
        cache=cache,
        query=query,
        block_table=alloc.block_table(range(len(seq_lens)), device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=qsl.to(device),
        key=key,
        value=value,
        slot_mapping=slot_mapping,
    )


def bad_metadata_cases(batch: PagedBatch, *, overrun: int) -> dict:
    """Out-of-range metadata of one sequence of ``batch`` (three sequences or more), for the
    kernels' in-kernel clamps: name -> (block_table, seq_lens, query_start_loc, the bad
    sequence, words of the error :func:`int8attn.check_errors` raises). Sequence 1 takes the
    block-id and length cases (its ``seq_len`` below its query length for "seq_len below
    q_len"); sequence 2's query range ends ``overrun`` tokens past the batch (keep it a
    decode-length query for a decode test). Each case is a copy; the batch is untouched."""
    bt, sl, qsl = batch.block_table, batch.seq_lens, batch.query_start_loc
    capacity = bt.shape[1] * batch.cache.block_size
    q_len_1 = int(qsl[2] - qsl[1])

    def with_(t, index, value):
        t = t.clone()
        t[index] = value
        return t

    return {
        "block id too large": (with_(bt, (1, 1), 10 ** 6), sl, qsl, 1, "block id"),
        "block id negative": (with_(bt, (1, 0), -3), sl, qsl, 1, "block id"),
        "seq_len beyond table": (bt, with_(sl, 1, capacity + 40), qsl, 1, "seq_len"),
        "seq_len negative": (bt, with_(sl, 1, -5), qsl, 1, "seq_len"),
        "seq_len below q_len": (bt, with_(sl, 1, q_len_1 - 1), qsl, 1, "query range"),
        "query range past num_tokens": (bt, sl, with_(qsl, 3, int(qsl[3]) + overrun), 2, "query range"),
    }


#: The Hopper prefill kernels the bad-metadata checks run (GPU tests and the memcheck
#: script), as (cache dtype, config name) for :func:`hopper_prefill_kernel`; a name ending in
#: "-d64" runs at head_dim 64 (:func:`hopper_prefill_head_dim`), the others at 128.
HOPPER_PREFILL_KERNELS = (("int8", "ws"), ("fp8", "ws"), ("bf16", "ws"), ("int8", "ws16"), ("int8", "ws16-m192"),
                          ("int8", "ws16-pv-in-flight"), ("int8", "ws16-pv-in-flight-split"), ("int8", "sync"),
                          ("fp8", "pipe"), ("int8", "ws16-d64"), ("fp8", "ws16-d64"), ("bf16", "ws-d64"))


def hopper_prefill_head_dim(which: str) -> int:
    """The head_dim a :data:`HOPPER_PREFILL_KERNELS` name runs at."""
    return 64 if which.endswith("-d64") else 128


def hopper_prefill_kernel(kv_dtype: str, which: str) -> tuple:
    """(pv_mode, config) of a :data:`HOPPER_PREFILL_KERNELS` name: "ws" the warp-specialized
    route in the cache's precision, "ws16" an 8-bit cache's 16-bit PV without PV in flight
    ("-m192": three consumer warpgroups, "-pv-in-flight": two consumer partitions with PV in
    flight, the int8 D128 route; "-split": the same with its ring stages released in two parts,
    ``split_release``; "-d64": the 16-bit-PV route at head_dim 64, 128-key tiles -- "ws-d64" a
    BF16 cache's), "sync" the synchronous kernel, "pipe" the pipelined one."""
    from .ops import prefill_hopper as hop

    head_dim = hopper_prefill_head_dim(which)
    pv = "bf16" if which.startswith("ws16") else kv_dtype
    makers = {"ws": lambda: hop.warp_specialized_config(kv_dtype, head_dim),
              "ws-d64": lambda: makers["ws"](),  # the same route, at head_dim 64
              "ws16": lambda: hop.warp_specialized_config(kv_dtype, head_dim, pv, pv_in_flight=False),
              "ws16-m192": lambda: hop.three_consumer_config(kv_dtype, head_dim, pv),
              "ws16-pv-in-flight": lambda: hop.warp_specialized_config(kv_dtype, head_dim, pv, pv_in_flight=True),
              "ws16-pv-in-flight-split": lambda: replace(makers["ws16-pv-in-flight"](), split_release=True),
              "ws16-d64": lambda: hop.warp_specialized_config(kv_dtype, head_dim, pv),
              "sync": lambda: hop.default_config(kv_dtype, head_dim, kv_dtype),
              "pipe": lambda: hop.pipelined_config(kv_dtype, head_dim)}
    return pv, makers[which]()


def poisoned_like(t: torch.Tensor) -> torch.Tensor:
    """A tensor shaped like ``t`` filled with NaN, to prove a kernel wrote every element."""
    return torch.full_like(t, POISON)


def assert_close_verbose(out: torch.Tensor, ref: torch.Tensor, *, rel_l2: float, max_abs: float | None = None,
                         name: str = "output", top: int = 8) -> dict:
    """Assert ``out`` matches ``ref`` (relative L2 <= rel_l2, optional max abs), printing
    the worst elements and any NaN/inf first. Returns the error stats."""
    stats = reference.error_stats(out, ref)
    ok = stats["finite"] and stats["rel_l2"] <= rel_l2 and (max_abs is None or stats["max_abs"] <= max_abs)
    if not ok:
        o = out.detach().to("cpu", torch.float64)
        r = ref.detach().to("cpu", torch.float64)
        lines = [f"{name}: {stats} (allowed rel_l2 <= {rel_l2}, max_abs <= {max_abs})"]
        bad = ~torch.isfinite(o)
        if bad.any():
            idx = bad.nonzero()[:top].tolist()
            lines.append(f"  {int(bad.sum())} non-finite elements, first at {idx}")
        diff = torch.nan_to_num((o - r).abs(), nan=float("inf"))
        flat = diff.flatten()
        k = min(top, flat.numel())
        vals, pos = flat.topk(k)
        for v, p in zip(vals.tolist(), pos.tolist()):
            index = tuple(int(i) for i in torch.unravel_index(torch.tensor(p), diff.shape))
            lines.append(f"  at {index}: got {o[index].item():.6g}, want {r[index].item():.6g}, |diff| {v:.3g}")
        raise AssertionError("\n".join(lines))
    return stats


def assert_nan_exactly(out: torch.Tensor, ref: torch.Tensor, want_nan: torch.Tensor, rel_l2: float,
                       name: str = "output") -> None:
    """Rows (token, head) of ``want_nan`` [T, H] bool are all NaN in ``out`` [T, H, D];
    every other element is finite and within ``rel_l2`` of ``ref``: a non-finite input
    poisons exactly the rows that read it."""
    got_nan = torch.isnan(out.float()).any(-1).cpu()
    assert torch.equal(got_nan, want_nan), (
        f"{name}: NaN rows {got_nan.nonzero().tolist()[:8]}, want {want_nan.nonzero().tolist()[:8]}")
    assert torch.isnan(out.float()[want_nan.to(out.device)]).all(), f"{name}: a poisoned row is partly finite"
    keep = ~want_nan
    assert_close_verbose(out.cpu()[keep], ref.cpu()[keep], rel_l2=rel_l2, name=name)


def assert_only_sequence_nan(out: torch.Tensor, good: torch.Tensor, query_start_loc: torch.Tensor, seq: int,
                             name: str = "output") -> None:
    """After a run on out-of-range metadata of sequence ``seq``: every row of its (original)
    query range in ``out`` [T, H, D] is NaN and every other row equals ``good``, the run on
    valid metadata, bit for bit."""
    starts = query_start_loc.tolist()
    rows = torch.zeros(out.shape[0], dtype=torch.bool)
    rows[starts[seq]:starts[seq + 1]] = True
    out, good = out.cpu(), good.cpu()
    assert torch.isnan(out[rows].float()).all(), f"{name}: rows of sequence {seq} are not all NaN"
    assert torch.equal(out[~rows], good[~rows]), f"{name}: other sequences changed"


def poison_query_rows(query: torch.Tensor, where, bad: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Put ``bad`` at each (token, head, channel) of ``where`` in ``query`` (in place).
    Returns (the [T, H] bool mask of the poisoned (token, head) rows, on the CPU; a copy
    of the query with those rows zeroed, for the reference of the others)."""
    want = torch.zeros(query.shape[:2], dtype=torch.bool)
    clean = query.clone()
    for tok, head, ch in where:
        query[tok, head, ch] = bad
        want[tok, head] = True
        clean[tok, head] = 0
    return want, clean


def poisoning_writer(where, bad: float):
    """A ``make_paged_batch`` writer: :func:`int8attn.reference.write_kv_reference` after
    putting ``bad`` at each (token, head, channel, "k" | "v") of ``where`` (indices into the
    batch's raw K / V)."""
    def writer(cache, key, value, slots):
        key, value = key.clone(), value.clone()
        for tok, head, ch, tensor in where:
            (key if tensor == "k" else value)[tok, head, ch] = bad
        reference.write_kv_reference(cache, key, value, slots)
    return writer
