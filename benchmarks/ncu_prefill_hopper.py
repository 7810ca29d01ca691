"""One launch of the warp-specialized Hopper prefill kernel for Nsight Compute (sm_90): a
4096-token causal chunk over a cached prefix, the benchmark point of bench_prefill_hopper.py
(24 q / 4 KV, D256, page 16, prefix 28672 by default), int8 cache and PV unless asked.

Why. The keys-on-M decode kernel's profile found the V^T copies of 16-key pages into a
swizzled wgmma tile served lane by lane (twice the L2 sectors, eight times the shared-memory
wavefronts; benchmarks/notes/decode.md, "The V^T ring"). The prefill kernels gather V^T the
same way (32-key tiles at D256, 64 at D128); whether that matters to a kernel whose
consumers are issue-bound is what this profile answers (notes/prefill_hopper.md). One call::

    ncu --clock-control none --kernel-name regex:_prefill_hopper_ws --launch-skip 3 --launch-count 1 \\
        --section SpeedOfLight --section WarpStateStats --section SourceCounters \\
        --section MemoryWorkloadAnalysis_Tables -f -o /tmp/pf python3 benchmarks/ncu_prefill_hopper.py
    ncu -i /tmp/pf.ncu-rep --page source --csv --print-source sass > /tmp/pf.csv
    python3 benchmarks/ncu_source_table.py /tmp/pf.csv

(PYTHONPATH=src:benchmarks.) Launches 1-3 compile and warm up, launch 4 is the profiled one;
the script prints its event time.
"""

from __future__ import annotations

import argparse

import torch

from bench_prefill_hopper import CHUNK, SHAPES
from int8attn import testing
from int8attn.ops import prefill_hopper as hop
from int8attn.ops.producer import quantize_query


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="24q4kv_d256", choices=sorted(SHAPES))
    ap.add_argument("--prefix", type=int, default=28672)
    ap.add_argument("--kv", default="int8", choices=("int8", "fp8", "bf16"))
    ap.add_argument("--pv", default=None, choices=("int8", "fp8", "bf16"), help="PV mode (default: the cache's)")
    args = ap.parse_args()
    pv = args.pv or args.kv
    hq, hkv, d = SHAPES[args.shape]
    b = testing.make_paged_batch([args.prefix + CHUNK], [CHUNK], num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                                 kv_dtype=args.kv, seed=7, device="cuda")
    config = hop.warp_specialized_config(args.kv, d, pv)
    codes = {}
    if args.kv != "bf16":  # the producer's query codes, as the benchmark passes them
        qq, qs = quantize_query(b.query, args.kv)
        codes = dict(q_quant=qq, q_scale=qs)
    out = torch.empty_like(b.query)

    def run():
        hop.prefill(b.query, b.cache, b.block_table, b.seq_lens, b.query_start_loc, kernel="hopper",
                    pv_mode=pv, out=out, config=config, **codes)

    for _ in range(3):  # launches 1-3
        run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()  # launch 4: the profiled one (--launch-skip 3)
    end.record()
    torch.cuda.synchronize()
    print(f"{args.shape} prefix {args.prefix} {args.kv}/{pv} {config}: "
          f"{start.elapsed_time(end) * 1e3:.1f} us (one launch)")


if __name__ == "__main__":
    main()
