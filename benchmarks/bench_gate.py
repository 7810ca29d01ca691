"""Run the low-precision gate on a GPU and keep everything it measured.

    PYTHONPATH=src python benchmarks/bench_gate.py --out gate-report [--size default]
        [--experiments E1,E3,E2,E4] [--time-budget 150] [--sass-samples DIR]

Writes the gate's report.md / report.json / PNG plots into --out, appends its rows (GPU,
torch/Triton versions, date, command: :class:`int8attn.bench.Recorder`) to
benchmarks/results/gate.jsonl (or --record), and with --sass-samples saves excerpts of
real ``cuobjdump --dump-sass`` output: every kernel the gate inspected plus tiny ``tl.dot``
probes per operand type (4 warps -> wgmma, 1 warp -> mma.sync), the samples the SASS
parser tests read.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def _save_sass_samples(sass_dir: Path, out_dir: Path, prefix: str) -> list[str]:
    from int8attn.gate import probe, sass

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for full in sorted(sass_dir.glob("*.sass.txt")):
        name = full.name.replace(".sass.txt", "")
        (out_dir / f"{prefix}_{name}.txt").write_text(sass.excerpt(full.read_text()))
        written.append(name)
    for dtype in ("int8", "fp8", "bf16"):
        for warps in (4, 1):
            block = (64, 64, 64) if warps == 4 else (16, 16, 64)
            try:
                text = probe.probe_sass(dtype, num_warps=warps, block=block)
            except Exception as exc:  # report and go on: a probe is evidence, not a requirement
                print(f"probe {dtype} x{warps} warps failed: {type(exc).__name__}: {exc}", flush=True)
                continue
            (sass_dir / f"probe_{dtype}_{warps}w.sass.txt").write_text(text)
            (out_dir / f"{prefix}_probe_{dtype}_{warps}warp{'s' if warps > 1 else ''}.txt").write_text(
                sass.excerpt(text))
            summary = sass.summarize(text)
            print(f"probe {dtype} x{warps} warps: {summary['mma']}", flush=True)
            written.append(f"probe_{dtype}_{warps}")
    return written


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="gate-report")
    p.add_argument("--size", default="default", choices=("tiny", "default", "full"))
    p.add_argument("--experiments", default="E1,E3,E2,E4")
    p.add_argument("--time-budget", type=float, default=None)
    p.add_argument("--record", default=None, help="JSONL rows (default benchmarks/results/gate.jsonl)")
    p.add_argument("--sass-dir", default=None, help="full SASS of every inspected kernel")
    p.add_argument("--sass-samples", default=None, help="write parser-test excerpts here")
    p.add_argument("--sample-prefix", default="h200")
    args = p.parse_args(argv)

    import torch

    from int8attn import bench
    from int8attn.gate import run_gate

    if not torch.cuda.is_available():
        print("bench_gate: no GPU; use `int8attn gate` for the interpreter run", file=sys.stderr)
        return 1
    start = time.perf_counter()
    record = args.record or str(bench.RESULTS_DIR / "gate.jsonl")
    sass_dir = Path(args.sass_dir or Path(args.out) / "sass-full")
    rep = run_gate(args.out, size=args.size, experiments=args.experiments, record=record, sass_dir=sass_dir,
                   time_budget_s=args.time_budget,
                   progress=lambda m: print(f"[{time.perf_counter() - start:6.1f}s] {m}", flush=True))
    print(rep["console"], flush=True)
    if args.sass_samples:
        _save_sass_samples(sass_dir, Path(args.sass_samples), args.sample_prefix)
    print(f"files: {rep['files']}; wall {time.perf_counter() - start:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
