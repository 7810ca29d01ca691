"""The Hopper prefill route of several source trees, timed side by side in one GPU session.

A change to a Gluon kernel's instruction stream is judged by timing the kernel it replaces
in the same run, on the same card: each tree's ``src/`` is imported by its own process (a
git revision exported with ``git archive REV src``, or a directory that holds ``src/``),
``.`` is the working tree; every tree's routed warp-specialized config is compiled first,
in parallel (one process per tree, sharing Triton's cache directory), then the trees
are timed one after another in the order given -- name a tree twice to interleave them
(``A,B,B,A``) and see the drift. Per tree and case: CUDA-graph replay of the 4096-token
chunk (as ``bench_prefill_hopper.py --graph`` times it), rel-L2 against the portable kernel,
and whether every output element was written (outputs poisoned first).

    python3 benchmarks/ab_trees_prefill_hopper.py --trees aac8480,.,.,aac8480 \\
        [--shapes 32q8kv_d128,24q4kv_d256] [--kv int8] [--pv bf16] [--out DIR]

Rows ``kind: "tree_ab"`` (``tree``, ``round``) go to ``DIR/prefill_hopper.jsonl``
(``benchmarks/results/`` by default). Needs an sm_90 GPU; nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
#: bench_prefill_hopper.py's cases, restated rather than imported: a child imports its own tree's
#: int8attn, and an older tree may lack names that module imports
SHAPES = {"24q4kv_d256": (24, 4, 256), "32q8kv_d128": (32, 8, 128), "16q4kv_d64": (16, 4, 64)}
PREFIXES = (28672, 0)
CHUNK = 4096


def export(tree: str, into: Path) -> Path:
    """The ``src`` directory of ``tree``: a directory holding ``src/``, or a git revision
    exported under ``into``."""
    if (Path(tree) / "src").is_dir():
        return Path(tree).resolve() / "src"
    dest = into / tree.replace("/", "_")
    if not dest.exists():
        dest.mkdir(parents=True)
        archive = subprocess.run(["git", "-C", str(REPO), "archive", tree, "src"], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    return dest / "src"


def measure(tree: str, mode: str, rnd: int, shapes, kv: str, pvs) -> list[dict]:
    """In this process (``src`` of ``tree`` first on sys.path): compile (``mode`` "compile":
    one launch per config) or time every case."""
    import torch
    import triton

    from int8attn import bench, reference, testing
    from int8attn.ops import prefill_hopper as hop
    from int8attn.ops.prefill import prefill_attention
    from int8attn.ops.producer import quantize_query

    rows = []
    for shape in shapes:
        hq, hkv, d = SHAPES[shape]
        for prefix in PREFIXES if mode == "time" else (0,):
            b = testing.make_paged_batch([prefix + CHUNK], [CHUNK], num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                                         kv_dtype=kv, seed=7, device="cuda")
            args = (b.query, b.cache, b.block_table, b.seq_lens, b.query_start_loc)
            codes = {} if kv == "bf16" else dict(zip(("q_quant", "q_scale"), quantize_query(b.query, kv)))
            for pv in pvs:
                cfg = hop.warp_specialized_config(kv, d, pv)
                portable = prefill_attention(*args, pv_mode=pv)
                out = testing.poisoned_like(portable)

                def run():
                    hop.prefill(*args, kernel="hopper", pv_mode=pv, out=out, config=cfg, **codes)

                run()
                torch.cuda.synchronize()
                if mode != "time":
                    continue
                finite = bool(torch.isfinite(out.float()).all())
                err = reference.error_stats(out, portable)["rel_l2"]
                us = bench.time_graph(run, replays=max(2, min(50, int(20000 / (prefix / 7 + 300)))), repeats=7)
                rows.append(dict(bench="prefill_hopper", kind="tree_ab", tree=tree, round=rnd, shape=shape,
                                 prefix=prefix, chunk=CHUNK, kv_dtype=kv, block_size=16, pv_mode=pv,
                                 kernel="hopper-ws", graph_us=round(us, 2), rel_l2_vs_portable=round(err, 5),
                                 all_written=finite, config=str(cfg), gpu=torch.cuda.get_device_name(),
                                 torch=torch.__version__, triton=triton.__version__))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trees", required=True, help="timing order: git revisions or directories holding src/")
    ap.add_argument("--shapes", default="32q8kv_d128,24q4kv_d256", help=f"of {sorted(SHAPES)}")
    ap.add_argument("--kv", default="int8", choices=("int8", "fp8", "bf16"))
    ap.add_argument("--pv", default="bf16", help="PV modes, comma-separated")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    ap.add_argument("--child", nargs=3, metavar=("TREE", "MODE", "ROUND"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    shapes, pvs = args.shapes.split(","), args.pv.split(",")
    if args.child:  # a tree's own process: its src is first on sys.path (set by the parent)
        tree, mode, rnd = args.child
        for row in measure(tree, mode, int(rnd), shapes, args.kv, pvs):
            print(json.dumps(row), flush=True)
        return 0
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (sm_90): the Hopper prefill kernel does not run under the interpreter")
    order = args.trees.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        srcs = {t: export(t, Path(tmp)) for t in dict.fromkeys(order)}

        def child(tree: str, mode: str, rnd: int) -> list[dict]:
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(srcs[tree]), os.environ.get("PYTHONPATH", "")])}
            cmd = [sys.executable, __file__, "--trees", args.trees, "--shapes", args.shapes, "--kv", args.kv,
                   "--pv", args.pv, "--child", tree, mode, str(rnd)]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                print(f"{tree} {mode}: exit {proc.returncode}\n{proc.stderr[-2000:]}", file=sys.stderr)
            return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]

        with ThreadPoolExecutor(len(srcs)) as pool:  # compile every tree's kernels at once
            list(pool.map(lambda t: child(t, "compile", 0), srcs))
        rows = [row for rnd, tree in enumerate(order, 1) for row in child(tree, "time", rnd)]
    Path(args.out).mkdir(parents=True, exist_ok=True)
    command = " ".join(["python3", "benchmarks/ab_trees_prefill_hopper.py", *(argv or sys.argv[1:])])
    date = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    with open(Path(args.out) / "prefill_hopper.jsonl", "a") as f:
        for row in rows:
            f.write(json.dumps({**row, "command": command, "date": date}, sort_keys=True) + "\n")
    for shape in shapes:
        for prefix in PREFIXES:
            for pv in pvs:
                cells = [f"{r['tree']} {r['graph_us']:.1f}" for r in rows
                         if (r["shape"], r["prefix"], r["pv_mode"]) == (shape, prefix, pv)]
                print(f"{shape} p{prefix} {args.kv}/{pv}: " + ", ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
