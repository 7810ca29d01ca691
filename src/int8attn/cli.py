"""``int8attn`` console entry point.

    int8attn gate [--out DIR] [--size tiny|default|full] [--experiments E1,E3]
                  [--tensors FILE.safetensors] [--seed N] [--no-plots] [--record PATH | --no-record]
                  [--save-sass DIR] [--min-speedup X] [--time-budget S] [--quiet]

Without a GPU the gate runs tiny sizes under the Triton interpreter (it re-launches itself
with TRITON_INTERPRET=1 when kernels may already have been compiled for a GPU) and marks
every timing meaningless.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def _gate_parser(sub) -> None:
    p = sub.add_parser("gate", help="measure whether low-precision paths pay off (DESIGN.md section 5)",
                       description="Run the low-precision gate and write report.md, report.json and plots.")
    p.add_argument("--out", default="gate-report", help="output folder (default: ./gate-report)")
    p.add_argument("--size", choices=("tiny", "default", "full"), default=None,
                   help="problem sizes (default: 'default' on a GPU, 'tiny' without one)")
    p.add_argument("--experiments", default="all", help="comma-separated keys, e.g. E1,E3 (default: all)")
    p.add_argument("--list", action="store_true", help="list the experiments and exit")
    p.add_argument("--tensors", default=None, help=".safetensors file with q, k, v replacing synthetic inputs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    rec = p.add_mutually_exclusive_group()
    rec.add_argument("--record", default=None, help="JSONL file for result rows (default: OUT/gate.jsonl)")
    rec.add_argument("--no-record", action="store_true", help="do not write result rows")
    p.add_argument("--save-sass", default=None, metavar="DIR", help="save the full SASS of every inspected kernel")
    p.add_argument("--min-speedup", type=float, default=None, help="speed-up needed to adopt (default 1.05)")
    p.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                   help="skip remaining experiments/cases once this much time is spent")
    p.add_argument("--quiet", action="store_true", help="no progress lines")


def _gate(args) -> int:
    import torch

    from .runtime import interpret_mode

    if not torch.cuda.is_available() and not interpret_mode() and os.environ.get("_INT8ATTN_GATE_REEXEC") != "1":
        # Triton decides interpreter vs compiler when a kernel module is imported; start
        # afresh with the interpreter on so nothing imported earlier is GPU-only.
        env = dict(os.environ, TRITON_INTERPRET="1", _INT8ATTN_GATE_REEXEC="1")
        if not args.quiet:
            print("int8attn gate: no GPU found -> tiny sizes under the Triton interpreter (timings meaningless)",
                  flush=True)
        os.execve(sys.executable, [sys.executable, "-m", "int8attn.cli", *sys.argv[1:]], env)

    from . import gate
    from .gate import registry

    if args.list:
        for key in registry.keys():
            try:
                mod = registry.load(key)
                print(f"{key}: {mod.TITLE}")
            except Exception as exc:
                print(f"{key}: cannot import ({type(exc).__name__}: {exc})")
        return 0
    size = args.size
    if (not torch.cuda.is_available() or interpret_mode()) and size not in (None, "tiny"):
        print(f"int8attn gate: --size {size} needs a GPU; running 'tiny' instead", file=sys.stderr)
        size = "tiny"
    start = time.perf_counter()

    def progress(msg: str) -> None:
        if not args.quiet:
            print(f"[{time.perf_counter() - start:6.1f}s] {msg}", flush=True)

    record = False if args.no_record else (args.record or True)
    try:
        report = gate.run_gate(args.out, size=size, experiments=args.experiments, tensors=args.tensors,
                               seed=args.seed, plots=not args.no_plots, record=record, sass_dir=args.save_sass,
                               min_speedup=args.min_speedup, time_budget_s=args.time_budget, progress=progress)
    except (ValueError, TypeError) as exc:
        print(f"int8attn gate: error: {exc}", file=sys.stderr)
        return 2
    print()
    print(report["console"])
    print()
    for name, path in report["files"].items():
        print(f"{name}: {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="int8attn", description="int8attn command line")
    sub = parser.add_subparsers(dest="command")
    _gate_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "gate":
        return _gate(args)
    parser.print_help()
    return 1


if __name__ == "__main__":
    sys.exit(main())
