"""One launch of a Hopper decode kernel to profile with Nsight Compute (sm_90; the portable
decode kernel's workload is ``ncu_decode.py``): the keys-on-M kernel with two or three
consumer warpgroups, or the rows-on-M kernel, at one benchmark point of
``bench_decode_hopper.py`` (24 q / 4 KV, D256, page 16, q4).

Why. Three keys-on-M consumers per SM slow each consumer's tile almost in proportion
(benchmarks/notes/decode.md, "Three consumers"): the consumers share a per-SM limit that two
already nearly fill, or the loader's copies are the limit (every q4 variant streams about the
same bytes per µs). Comparing the counters of the two launches names it (shared-memory
bandwidth and bank conflicts, barrier stalls, issue slots, the MMA pipe, memory). One call::

    for n in 2 3; do ncu --clock-control none --kernel-name regex:_decode_hopper_swapped \\
        --launch-skip 3 --launch-count 1 --section SpeedOfLight --section WarpStateStats \\
        --section SchedulerStats --section MemoryWorkloadAnalysis_Tables --section InstructionStats \\
        --section SourceCounters python3 benchmarks/ncu_decode_hopper.py --consumers $n \\
        > $OUT/ncu_$n.txt 2>&1; done

(SourceCounters ranks the SASS by stall: consumers stalled at the ``ready`` mbarrier wait
mean the loader is the limit, stalls at their own barriers and MMA waits mean the consumers.
``ncu -i REP --page source --csv --print-source sass`` exports the per-instruction counters,
L2 sectors and shared-memory wavefronts included: that table named the V^T copies served lane
by lane, benchmarks/notes/decode.md, "The V^T ring".)

(PYTHONPATH=src:benchmarks; ``NCU=1 bash benchmarks/decode_hopper_gpu.sh`` runs it after the
tests and the benchmark.) The script warms the launch up three times (compile, first
launches), then makes the profiled launch and prints its graph-free event time.
"""

from __future__ import annotations

import argparse

import _harness as H

H.start(False)

import torch  # noqa: E402

import bench_decode as BD  # noqa: E402
from bench_decode_hopper import SHAPE, HopperDecode  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--consumers", type=int, default=2, help="keys-on-M consumer warpgroups (2 or 3)")
    ap.add_argument("--rows-on-m", action="store_true", help="the rows-on-M kernel instead")
    ap.add_argument("--bs", type=int, default=16)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--q", type=int, default=4)
    args = ap.parse_args()
    blocks = args.bs * args.context // SHAPE["page"] * 2
    cache = BD.make_cache("int8", blocks, SHAPE)
    tables = BD.block_tables(blocks, args.bs, args.context, SHAPE["page"], 2)
    keys = not args.rows_on_m
    run = HopperDecode(cache, args.bs, args.context, args.q, tables, keys_on_m=keys,
                       consumers=args.consumers if keys else None)  # launch 1 (checked call)
    for _ in range(2):  # launches 2-3
        run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()  # launch 4: the profiled one (--launch-skip 3)
    end.record()
    torch.cuda.synchronize()
    print(f"{'keys-on-M' if keys else 'rows-on-M'} consumers={run.consumers} splits={run.splits} "
          f"bs{args.bs} L{args.context} q{args.q}: {start.elapsed_time(end) * 1e3:.1f} us (one launch and its merge)")


if __name__ == "__main__":
    main()
