"""Bad-metadata cases for compute-sanitizer: prefill, write_kv, the producer and decode
(its in-kernel clamps on: the default, which this script insists on) with value checks off and one
sequence / token out of range, so only the kernels' own clamps stand between the
metadata and memory.

Run on the GPU, one op per sanitizer process (a process stops at its first error report)::

    for op in prefill write producer decode; do
        INT8ATTN_CHECK_VALUES=0 compute-sanitizer --tool memcheck --error-exitcode 1 \\
            python benchmarks/memcheck_cases.py --op $op || echo "memcheck FAILED: $op"
    done

Every case also checks what the CPU tests check: the affected outputs NaN, the others
finite, ``check_errors()`` raising naming the index; a case that does not prints FAIL and
the script exits 1. Without a GPU it runs the same cases under Triton's interpreter
(small shapes, no sanitizer).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

os.environ["INT8ATTN_CHECK_VALUES"] = "0"
os.environ["INT8ATTN_DECODE_SAFE"] = "1"
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from int8attn import reference, testing  # noqa: E402
from int8attn.cache import PagedKVCache  # noqa: E402
from int8attn.ops.decode import decode_attention  # noqa: E402
from int8attn.errors import DeviceMetadataError, check_errors  # noqa: E402
from int8attn.ops.prefill import prefill_attention  # noqa: E402
from int8attn.ops.producer import rope_quantize_and_write  # noqa: E402
from int8attn.ops.write import write_kv  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FAILURES: list[str] = []


def expect(ok: bool, what: str) -> None:
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    if not ok:
        FAILURES.append(what)


def expect_flag(index: int, what: str) -> None:
    try:
        check_errors(DEVICE)
    except DeviceMetadataError as e:
        expect(f"index {index};" in str(e), f"{what}: flag names index {index} ({e})")
        return
    expect(False, f"{what}: no flag raised")


def _cases(b, overrun: int) -> dict:
    """testing.bad_metadata_cases plus a block id just past the cache and a negative query start."""
    cases = testing.bad_metadata_cases(b, overrun=overrun)
    bt = b.block_table.clone()
    bt[1, 2] = b.cache.num_blocks
    cases["block id num_blocks"] = (bt, b.seq_lens, b.query_start_loc, 1, "block id")
    qsl = b.query_start_loc.clone()
    qsl[0] = -50
    cases["qsl start negative"] = (b.block_table, b.seq_lens, qsl, 0, "query range")
    return cases


def prefill_cases() -> None:
    # GPU: a long prefix and real head counts; interpreter: small
    big = DEVICE == "cuda"
    seq_lens, q_lens = ([900, 1500, 700], [300, 600, 200]) if big else ([30, 40, 25], [12, 21, 9])
    for kv in ("int8", "fp8", "bf16"):
        b = testing.make_paged_batch(seq_lens, q_lens, num_q_heads=8 if big else 4, num_kv_heads=2,
                                     head_dim=128 if big else 64, kv_dtype=kv, seed=3, device=DEVICE)
        starts = b.query_start_loc.tolist()
        cases = _cases(b, overrun=10 ** 6)
        ref = reference.attention_reference(b.query, b.cache, b.block_table, b.seq_lens, b.query_start_loc)
        for name, (bt, sl, qsl, bad_seq, _) in cases.items():
            # the dense grid (max_query_len given) for the first case, the searched one for all
            for max_query_len in ((None, max(q_lens)) if name == "block id too large" else (None,)):
                out = torch.full(b.query.shape, float("nan"), dtype=torch.bfloat16, device=DEVICE)
                prefill_attention(b.query, b.cache, bt, sl, qsl, out=out, max_query_len=max_query_len)
                nan_rows = torch.isnan(out.float()).any(-1).any(-1).cpu()
                want = torch.zeros(b.query.shape[0], dtype=torch.bool)
                want[starts[bad_seq]:starts[bad_seq + 1]] = True
                what = f"prefill {kv} {name} grid={'dense' if max_query_len else 'searched'}"
                if name == "qsl start negative":
                    # the searched grid maps tiles from the (broken) offsets: only the flag
                    # and the other sequences' rows are defined
                    keep = ~want
                    ok = not nan_rows[keep].any()
                else:
                    ok = torch.equal(nan_rows, want)
                expect(ok, f"{what}: NaN rows exactly the bad sequence's")
                err = reference.error_stats(out.cpu()[~want], ref[~want])["rel_l2"]
                expect(err < 0.05, f"{what}: other rows rel-L2 {err:.4f}")
                expect_flag(bad_seq, what)


DECODE_PARTS = ("split", "last", "barrier", "window", "stamped")


def decode_cases(parts: tuple[str, ...] = DECODE_PARTS) -> None:
    """Every case with the split + merge kernels (part ``split``) and with each fused merge
    (one launch: the last split merges, ``last``, or every split after a barrier, ``barrier``,
    only on a GPU); ``parts`` picks some of them (a memcheck of all takes minutes). The
    split kernel is the query quantization's programmatic dependent wherever the GPU takes
    that launch (``query_pdl=None``), whatever the default: the split + merge and "last"
    runs quantize their query in a kernel of their own. Part ``window``: the default merge
    with a sliding window; ``stamped``, on a GPU: the timeline diagnostic's stamped kernels
    (:func:`_stamped_cases`)."""
    import dataclasses

    from int8attn.ops import decode as dec

    real = dec.default_config
    merges = {"split": (False, ""), "last": (True, "fused "), "barrier": ("barrier", "barrier ")}
    for part, (fused, label) in merges.items():
        if part not in parts or (fused == "barrier" and DEVICE != "cuda"):
            continue
        dec.default_config = lambda *a, k_=fused, **k: dataclasses.replace(real(*a, **k), fused_merge=k_,
                                                                           query_pdl=None)
        try:
            _decode_cases(label)
        finally:
            dec.default_config = real
    # the default merge with a window: tiles start at the window, so a bad block id before it
    # is never read (no flag, no NaN rows); only memory safety and the other rows are checked
    if "window" in parts:
        _decode_cases("window ", window=300)
    if "stamped" in parts and DEVICE == "cuda":
        _stamped_cases()


def _stamped_cases() -> None:
    """The timeline diagnostic's stamped split and merge kernels (``DecodeLaunch.stamped``)
    over the same bad metadata, int8 with the producer's codes: the bad sequence's rows NaN,
    the others equal to the unstamped launch's, every split program's start stamped."""
    import contextlib
    import dataclasses

    from int8attn.kernels._timeline import SPLIT_STAMPS
    from int8attn.ops import decode as dec
    from int8attn.ops.producer import quantize_query

    b = testing.make_paged_batch([9000, 32768, 700], [1, 1, 1], num_q_heads=24, num_kv_heads=4, head_dim=256,
                                 kv_dtype="int8", seed=5, device=DEVICE)
    qq, qs = quantize_query(b.query, "int8")
    shape, table = tuple(b.query.shape), tuple(b.block_table.shape)
    plan = dec.plan_decode(shape, b.cache, table, config=dataclasses.replace(
        dec.plan_decode(shape, b.cache, table).config, fused_merge=False))
    launch = dec.DecodeLaunch.for_tensors(plan, b.cache, b.query, qq, qs, b.block_table, b.query.stride())
    scale = dec.qk_scale_of(None, 256)
    starts = b.query_start_loc.tolist()
    for name, (bt, sl, qsl, bad_seq, _) in _cases(b, overrun=3).items():
        if name == "qsl start negative":
            continue
        split_rows, merge_rows = launch.stamp_rows()
        outs = []
        for mode in (contextlib.nullcontext(), launch.stamped(split_rows, merge_rows)):  # unstamped, stamped
            out = torch.full(b.query.shape, float("nan"), dtype=torch.bfloat16, device=DEVICE)
            with mode:
                launch(b.query, qq, qs, b.cache, bt, sl, qsl, out, scale)
            torch.cuda.synchronize()
            outs.append(out.cpu())
            _clear_flags()
        want = torch.zeros(b.query.shape[0], dtype=torch.bool)
        want[starts[bad_seq]:starts[bad_seq + 1]] = True
        what = f"decode stamped int8 {name}"
        expect(torch.equal(outs[1][~want], outs[0][~want]), f"{what}: other rows as unstamped")
        expect(bool(torch.isnan(outs[1][want].float()).all()), f"{what}: the bad sequence's rows are NaN")
        started = split_rows[:, SPLIT_STAMPS.index("start")] > 0
        expect(bool(started.all()), f"{what}: every split program stamped its start")


def _clear_flags() -> None:
    """Clear the device flags a bad case raised, where a case does not check them."""
    try:
        check_errors(DEVICE)
    except DeviceMetadataError:
        pass


def _decode_cases(label: str, window: int | None = None) -> None:
    # GPU: long sequences over real head counts, several splits; interpreter: small
    big = DEVICE == "cuda"
    seq_lens, q_lens = ([9000, 32768, 700], [1, 4, 2]) if big else ([37, 97, 20], [1, 3, 2])
    for kv in ("int8", "fp8", "bf16"):
        b = testing.make_paged_batch(seq_lens, q_lens, num_q_heads=24 if big else 4, num_kv_heads=4 if big else 2,
                                     head_dim=256 if big else 64, kv_dtype=kv, seed=5, device=DEVICE)
        starts = b.query_start_loc.tolist()
        cases = _cases(b, overrun=3)
        del cases["qsl start negative"]  # a decode-length range from a negative start is prefill's case
        # one clean run per split count: a different split count rounds differently
        good = {splits: decode_attention(b.query, b.cache, b.block_table, b.seq_lens, b.query_start_loc,
                                         num_splits=splits, window=window).cpu() for splits in (None, 1)}
        for name, (bt, sl, qsl, bad_seq, _) in cases.items():
            for splits in (None, 1):
                out = torch.full(b.query.shape, float("nan"), dtype=torch.bfloat16, device=DEVICE)
                decode_attention(b.query, b.cache, bt, sl, qsl, out=out, num_splits=splits, window=window)
                want = torch.zeros(b.query.shape[0], dtype=torch.bool)
                want[starts[bad_seq]:starts[bad_seq + 1]] = True
                what = f"decode {label}{kv} {name} splits={splits or 'auto'}"
                rows = out.cpu()
                expect(torch.equal(rows[~want], good[splits][~want]), f"{what}: other rows unchanged")
                if window is None:
                    expect(bool(torch.isnan(rows[want].float()).all()), f"{what}: the bad sequence's rows are NaN")
                    expect_flag(bad_seq, what)
                else:
                    _clear_flags()  # whether the bad entry was read depends on the window


def write_cases() -> None:
    for kv in ("int8", "fp8", "bf16"):
        for n in (1, 17, 4096 if DEVICE == "cuda" else 64):
            cache = PagedKVCache(n // 16 + 4, 16, 4, 128, kv_dtype=kv, device=DEVICE)
            key = testing.make_keys(n, 4, 128, device=DEVICE)
            value = testing.make_normal((n, 4, 128), device=DEVICE)
            slots = torch.arange(n, device=DEVICE)
            for name, bad_value in (("slot num_slots", cache.num_slots), ("slot -2", -2), ("slot 2**40", 2 ** 40)):
                bad = slots.clone()
                bad[n // 2] = bad_value
                # the last 3 pages hold no slot of the write: they must stay as they were
                before = [t[-3:].clone() for t in (cache.key, cache.value)]
                write_kv(cache, key, value, bad)
                what = f"write_kv {kv} n={n} {name}"
                expect(all(torch.equal(t[-3:].view(torch.uint8), t0.view(torch.uint8))
                           for t, t0 in zip((cache.key, cache.value), before)), f"{what}: pages not written unchanged")
                expect_flag(n // 2, what)


def producer_cases() -> None:
    for kv in ("int8", "fp8", "bf16"):
        n, max_pos = (4096, 8192) if DEVICE == "cuda" else (33, 64)
        cache = PagedKVCache(n // 16 + 4, 16, 4, 128, kv_dtype=kv, device=DEVICE)
        q = testing.make_normal((n, 24, 128), device=DEVICE)
        k = testing.make_keys(n, 4, 128, device=DEVICE)
        v = testing.make_normal((n, 4, 128), device=DEVICE)
        cos_sin = reference.rope_cos_sin_cache(max_pos, 64, device=DEVICE)
        pos = torch.arange(n, device=DEVICE) % max_pos
        slots = torch.arange(n, device=DEVICE)
        for name, (which, value) in {"position max_pos": ("pos", max_pos), "position -1": ("pos", -1),
                                     "position 2**40": ("pos", 2 ** 40), "slot num_slots": ("slot", cache.num_slots),
                                     "slot 2**40": ("slot", 2 ** 40)}.items():
            p, s = pos.clone(), slots.clone()
            (p if which == "pos" else s)[n // 3] = value
            out_q, out_s = rope_quantize_and_write(q, k, v, p, cos_sin, cache, s)
            what = f"producer {kv} {name}"
            if which == "pos":
                bad_q = torch.isnan(out_q.float()).any(-1).any(-1) if out_s is None else torch.isnan(out_s).any(-1)
                want = torch.zeros(n, dtype=torch.bool)
                want[n // 3] = True
                expect(torch.equal(bad_q.cpu(), want), f"{what}: NaN Q exactly for the bad token")
            expect_flag(n // 3, what)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--op", choices=("prefill", "write", "producer", "decode", "all"), default="all")
    ap.add_argument("--decode-parts", default=",".join(DECODE_PARTS),
                    help="comma-separated decode parts: " + ", ".join(DECODE_PARTS))
    args = ap.parse_args()
    parts = tuple(p for p in args.decode_parts.split(",") if p)
    if not set(parts) <= set(DECODE_PARTS):
        ap.error(f"--decode-parts: unknown {sorted(set(parts) - set(DECODE_PARTS))}; known: {', '.join(DECODE_PARTS)}")
    ops = ("prefill", "write", "producer", "decode") if args.op == "all" else (args.op,)
    cases = {"prefill": prefill_cases, "write": write_cases, "producer": producer_cases,
             "decode": lambda: decode_cases(parts)}
    for op in ops:
        cases[op]()
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    print(f"{len(FAILURES)} failure(s)" + (": " + "; ".join(FAILURES) if FAILURES else ""))
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
