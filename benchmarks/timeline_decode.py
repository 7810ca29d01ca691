"""Where a small decode call's time goes: a per-program timeline of the split and merge kernels.

Each point (batch x context, 24q/4kv, head_dim 256, page 16) is planned and launched as the
decode benchmark's default rows are (the producer's codes given, CUDA-graph replays of
back-to-back calls over rotating block tables). The same launches are then run with the
kernels' ``STAMPS`` constexpr (``DecodeLaunch.stamped``; :mod:`int8attn.kernels._timeline`):
every split program stores when it started, had its metadata (query bounds and length), had
its last tile's accumulator and had issued its stores, and its SM; every merge program when
it started, was past its wait for the split grid and had issued its stores. One graph holds ``CALLS``
calls, each stamping into its own rows; the middle call of each replay is read, its times
taken from the previous call's last store (the merge's, else the split's) -- so the figures
split one call of a back-to-back stream into:

* ``launch``: previous call's last store -> first split program's start (the next kernel's
  launch, and the previous one's drain);
* ``ramp``: first -> last split program's start (the grid's admission);
* ``metadata``: a program's start -> its lengths (one load round trip);
* ``tiles``: metadata -> last tile's accumulator (block table, the K/V copies, the tiles'
  compute; ``tiles_per_program`` of them); ``tiles_sole`` / ``tiles_shared``: its median over
  the programs whose SM ran no other program of the call, and over the rest;
* ``store``: accumulator -> stores issued;
* ``split_end`` / ``merge_start`` / ``merge_waited`` / ``merge_end``: when the split grid's
  last store was issued, and the merge programs' first start, last release from their
  wait and last store (all from the reference);
* ``period``: this call's first split start -> the next call's (the call's time in the stream).

Medians over ``--replays`` replays; per-program figures as median / max over the call's active
programs. Rows (``timeline_decode.jsonl``): kind ``timeline`` per point, with ``graph_us``
(unstamped, the benchmark's timer) and ``stamped_us`` (the same graph with stamps: what they
cost); each point's middle-call stamps of the first replay go to
``<out>/timeline_<kv>_bs<bs>_L<ctx>.json`` for later reading. Needs a CUDA GPU (the stamps
read ``%globaltimer``, which advances in 32 ns steps on Hopper).

    PYTHONPATH=src python3 benchmarks/timeline_decode.py --out DIR [--points 1x8192,1x32768] [--kv int8,fp8]
"""

from __future__ import annotations

import collections
import itertools
import json
import os
import re
import statistics

import torch

import _harness as H
from int8attn import bench
from int8attn.kernels._timeline import MERGE_STAMPS, SPLIT_STAMPS

POINTS = ((1, 8192), (1, 32768), (4, 8192), (16, 8192))
CALLS = 30        # calls per captured graph, as the decode benchmark's graph timer
SPLIT = {name: i for i, name in enumerate(SPLIT_STAMPS)}
MERGE = {name: i for i, name in enumerate(MERGE_STAMPS)}


def summarize(split: torch.Tensor, merge: torch.Tensor | None, prev_end: int, next_start: int | None) -> dict:
    """One call's figures in µs (module docstring) from its stamp rows: ``split`` [P, 5] and
    ``merge`` [Q, 4] int64 (-1: not written; a program that left early has no ``tiles`` or
    ``stored``), ``prev_end`` the previous call's last store (ns), ``next_start`` the next
    call's first split start (ns) or None."""
    def us(x):
        return None if x is None else round(x / 1000.0, 3)

    def stats(vals):
        vals = sorted(vals)
        return (us(statistics.median(vals)), us(vals[-1])) if vals else (None, None)

    s = split.tolist()
    starts = [r[SPLIT["start"]] for r in s if r[SPLIT["start"]] > 0]
    active = [r for r in s if r[SPLIT["tiles"]] > 0 and r[SPLIT["metadata"]] > 0 and r[SPLIT["start"]] > 0]
    out = {
        "programs": len(s), "active_programs": len(active),
        "sms": len({r[SPLIT["sm"]] for r in s if r[SPLIT["sm"]] >= 0}),
        "launch_us": us(min(starts) - prev_end) if starts else None,
        "ramp_us": us(max(starts) - min(starts)) if starts else None,
    }
    out["metadata_us"], out["metadata_max_us"] = stats([r[SPLIT["metadata"]] - r[SPLIT["start"]] for r in active])
    out["tiles_us"], out["tiles_max_us"] = stats([r[SPLIT["tiles"]] - r[SPLIT["metadata"]] for r in active])
    # the same split by the SM: programs whose SM ran no other program of the call, and the rest
    # (two 4-warp programs share an SM's schedulers when the grid exceeds the SM count)
    per_sm = collections.Counter(r[SPLIT["sm"]] for r in s if r[SPLIT["start"]] > 0)
    for name, sole in (("sole", True), ("shared", False)):
        out[f"tiles_{name}_us"] = stats([r[SPLIT["tiles"]] - r[SPLIT["metadata"]] for r in active
                                         if (per_sm[r[SPLIT["sm"]]] == 1) is sole])[0]
    stored = [r for r in active if r[SPLIT["stored"]] > 0]
    out["store_us"], out["store_max_us"] = stats([r[SPLIT["stored"]] - r[SPLIT["tiles"]] for r in stored])
    out["split_end_us"] = us(max(r[SPLIT["stored"]] for r in stored) - prev_end) if stored else None
    if merge is not None:
        m = [r for r in merge.tolist() if r[MERGE["start"]] > 0]
        out["merge_programs"] = len(m)
        out["merge_start_us"] = us(min(r[MERGE["start"]] for r in m) - prev_end) if m else None
        waited = [r[MERGE["waited"]] for r in m if r[MERGE["waited"]] > 0]
        out["merge_waited_us"] = us(max(waited) - prev_end) if waited else None
        ends = [r[MERGE["stored"]] for r in m if r[MERGE["stored"]] > 0]
        out["merge_end_us"] = us(max(ends) - prev_end) if ends else None
    out["period_us"] = us(next_start - min(starts)) if next_start is not None and starts else None
    return out


def last_store(split: torch.Tensor, merge: torch.Tensor | None) -> int:
    """A call's last store (ns): its merge's, else its split kernel's."""
    if merge is not None:
        return int(merge[:, MERGE["stored"]].max())
    return int(split[:, SPLIT["stored"]].max())


def first_start(split: torch.Tensor) -> int:
    starts = split[:, SPLIT["start"]]
    return int(starts[starts > 0].min())


def timeline(r: H.Run, cache, kv: str, bs: int, ctx: int, replays: int, num_splits: int | None = None) -> None:
    import bench_decode as BD

    d = BD.Decode(cache, BD.HEADLINE, bs, ctx, 1, None, num_splits=num_splits)
    d()
    r.sync()
    graph_us = r.time(d, True)  # the benchmark's figure, no stamps
    launch = d.launch
    rows = [launch.stamp_rows() for _ in range(CALLS)]  # each call's own (split, merge) rows
    order = itertools.count()
    mid = CALLS // 2
    per_replay = []

    def call():
        # the warm-up takes CALLS calls (compiling and loading the stamped kernels before the
        # capture), so the i-th captured call stamps into rows[i]
        with launch.stamped(*rows[next(order) % CALLS]):
            d()

    def read():
        sp = [split.cpu() for split, _ in rows[mid - 1:mid + 2]]
        mg = [None if merge is None else merge.cpu() for _, merge in rows[mid - 1:mid + 2]]
        prev_end, next_start = last_store(sp[0], mg[0]), first_start(sp[2])
        per_replay.append(summarize(sp[1], mg[1], prev_end, next_start))
        if len(per_replay) == 1:
            r.write(f"timeline_{kv}_bs{bs}_L{ctx}" + (f"_S{num_splits}" if num_splits else "") + ".json", json.dumps(
                {"split_stamps": list(SPLIT_STAMPS), "merge_stamps": list(MERGE_STAMPS), "prev_end": prev_end,
                 "next_start": next_start, "split": sp[1].tolist(),
                 "merge": None if mg[1] is None else mg[1].tolist()}))

    stamped_us = bench.time_graph(call, replays=CALLS, repeats=replays, warmup=CALLS, after_replay=read)
    fig = {k: (statistics.median([p[k] for p in per_replay if p[k] is not None])
               if any(p[k] is not None for p in per_replay) else None)
           for k in per_replay[0]}
    plan = d.plan
    tiles = -(-ctx // plan.config.block_n)
    row = r.row(kind="timeline", kv_dtype=kv, bs=bs, context=ctx, num_splits=plan.num_splits,
                splits_given=num_splits is not None,
                block_n=plan.config.block_n, tiles_per_program=round(tiles / plan.num_splits, 2),
                pdl=BD._pdl_trigger(plan), graph_us=graph_us, stamped_us=stamped_us,
                replays=replays, calls=CALLS, **fig)
    r.log(f"{kv} bs{bs} L{ctx} S{plan.num_splits} graph {graph_us:.2f} stamped {row['stamped_us']:.2f} | "
          + " ".join(f"{k.replace('_us', '')} {H.fmt(fig[k], '{:.2f}')}" for k in fig if k.endswith("_us")
                     and k != "stamped_us")
          + f" | programs {fig['active_programs']}/{fig['programs']} on {fig['sms']} SMs")


def parse_point(text: str) -> tuple[int, int, int | None]:
    """``BxL`` or ``BxLsS`` (batch, context, split count or None for the planner's)."""
    m = re.fullmatch(r"(\d+)x(\d+)(?:s(\d+))?", text.strip())
    if not m:
        raise SystemExit(f"timeline_decode.py: bad point {text!r} (BxL or BxLsS, e.g. 1x8192s32)")
    return int(m[1]), int(m[2]), int(m[3]) if m[3] else None


def main(argv: list[str] | None = None) -> None:
    ap = H.parser("timeline_decode", budget_s=240, smoke_help="one small point, two replays (still on a GPU)")
    ap.add_argument("--points", default=",".join(f"{b}x{c}" for b, c in POINTS),
                    help="batch x context points, e.g. 1x8192,16x8192; a split count after 's' "
                         "overrides the planner's (1x8192s32)")
    ap.add_argument("--kv", default="int8", help="cache dtypes: int8, fp8 (comma list)")
    ap.add_argument("--replays", type=int, default=9)
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") or not torch.cuda.is_available():
        raise SystemExit("timeline_decode.py needs a CUDA GPU (the stamps read the GPU's global timer)")
    import bench_decode as BD  # (imported on a GPU only: its import picks the device mode)

    r = H.Run("timeline_decode", args.out, deadline_s=args.budget_s, interpret=False)
    points = [parse_point(p) for p in args.points.split(",") if p]
    if args.smoke:
        points, args.replays = [(1, 1024, None)], 2
    r.log(f"device {r.env['gpu']} torch {r.env['torch']} triton {r.env['triton']}")
    for kv in args.kv.split(","):
        blocks = max(bs * ctx for bs, ctx, _ in points) // BD.HEADLINE["page"] * 4 + 8
        cache = BD.make_cache(kv, blocks, BD.HEADLINE)
        for bs, ctx, splits in points:
            what = f"timeline {kv} bs{bs} L{ctx}" + (f" S{splits}" if splits else "")
            if r.late(what):
                return
            H.attempt(r, what, timeline, r, cache, kv, bs, ctx, args.replays, splits)
        del cache
    r.log(f"total {r.elapsed():.1f}s")


if __name__ == "__main__":
    main()
