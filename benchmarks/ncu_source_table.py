"""Read Nsight Compute's per-instruction table of one kernel (the SASS source page as CSV)
and print what named the keys-on-M decode kernel's limit (benchmarks/notes/decode.md, "The
V^T ring"): the instructions that move more L2 sectors or shared-memory wavefronts than
their bytes need, each warp-specialized partition's stall reasons and instruction mix
(executed warp instructions by opcode: what an issue-bound partition spends its issue slots
on, notes/prefill_hopper.md), and the instructions with the most stall samples.

Export on the GPU machine (no GPU needed to read it)::

    ncu --clock-control none --kernel-name regex:NAME --launch-skip 3 --launch-count 1 \\
        --section SourceCounters --section WarpStateStats -o REP python3 WORKLOAD
    ncu -i REP.ncu-rep --page source --csv --print-source sass > REP.csv
    python3 benchmarks/ncu_source_table.py REP.csv

Partitions are cut at each ``USETMAXREG`` (the register hand-off that starts a partition of a
Gluon ``warp_specialize`` kernel; a kernel without one is a single part).
"""

from __future__ import annotations

import argparse
import csv

SECTORS, SECTORS_X = "L2 Theoretical Sectors Global", "L2 Theoretical Sectors Global Excessive"
WAVES, WAVES_IDEAL = "L1 Wavefronts Shared", "L1 Wavefronts Shared Ideal"
EXECUTED, SAMPLES = "Instructions Executed", "Warp Stall Sampling (All Samples)"


def read_table(path: str) -> list[dict]:
    """The rows of an ``ncu --page source --csv`` export (its first line names the kernel)."""
    with open(path, newline="") as f:
        lines = list(csv.reader(f))
    start = next(i for i, row in enumerate(lines) if "Source" in row and "Address" in row)
    header = lines[start]
    return [dict(zip(header, row)) for row in lines[start + 1:] if len(row) == len(header)]


def number(row: dict, key: str) -> float:
    try:
        return float(row.get(key, "0").replace(",", "") or 0)
    except ValueError:
        return 0.0


def excess(rows: list[dict], top: int = 12) -> list[tuple]:
    """(index, SASS, sectors per execution, of them excess, wavefronts per execution, ideal)
    of the instructions with excess sectors or wavefronts, most excess first."""
    out = []
    for i, row in enumerate(rows):
        n = number(row, EXECUTED)
        extra = number(row, SECTORS_X) + number(row, WAVES) - number(row, WAVES_IDEAL)
        if n and extra > 0:
            out.append((extra, i, row["Source"].strip(), number(row, SECTORS) / n, number(row, SECTORS_X) / n,
                        number(row, WAVES) / n, number(row, WAVES_IDEAL) / n))
    return [entry[1:] for entry in sorted(out, key=lambda e: -e[0])[:top]]


def partitions(rows: list[dict]) -> list[tuple[int, int]]:
    """[start, end) row ranges of the kernel's partitions (cut at USETMAXREG)."""
    cuts = [i for i, row in enumerate(rows) if "USETMAXREG" in row["Source"]]
    bounds = [0] + cuts + [len(rows)]
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def stall_shares(rows: list[dict], start: int, end: int) -> tuple[float, dict]:
    """Stall samples of rows [start, end) and each reason's share of them."""
    reasons = [k for k in rows[0] if k.startswith("stall_") and "(" not in k] if rows else []
    totals = {k[len("stall_"):]: sum(number(r, k) for r in rows[start:end]) for k in reasons}
    total = sum(totals.values())
    return total, {k: v / total for k, v in totals.items() if total and v}


def opcode(sass: str) -> str:
    """The opcode of a SASS line without its predicate and modifiers (``@!P0 FFMA.FTZ`` -> FFMA)."""
    words = sass.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else ""


def instruction_mix(rows: list[dict], start: int, end: int) -> tuple[float, list[tuple[str, float]]]:
    """Executed warp instructions of rows [start, end) and each opcode's share, largest first."""
    counts: dict[str, float] = {}
    for row in rows[start:end]:
        op = opcode(row["Source"].strip())
        counts[op] = counts.get(op, 0.0) + number(row, EXECUTED)
    total = sum(counts.values())
    return total, sorted(((op, n / total) for op, n in counts.items() if n), key=lambda e: -e[1]) if total else []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", help="ncu -i REP --page source --csv --print-source sass output")
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    rows = read_table(args.csv)
    print("instructions with excess L2 sectors or shared-memory wavefronts (per execution):")
    for i, sass, sec, sec_x, waves, ideal in excess(rows, args.top):
        print(f"  {i:5d} {sass[:64]:64s} sectors {sec:5.1f} (excess {sec_x:5.1f})  wavefronts {waves:5.1f} "
              f"(ideal {ideal:5.1f})")
    print("stall samples per partition (cut at USETMAXREG):")
    for a, b in partitions(rows):
        total, shares = stall_shares(rows, a, b)
        if total:
            top = ", ".join(f"{k} {v:.0%}" for k, v in sorted(shares.items(), key=lambda kv: -kv[1])[:5])
            print(f"  rows {a}-{b}: {total:.0f} samples: {top}")
    print("instruction mix per partition (executed warp instructions; partitions above 10% of the kernel's):")
    kernel_total = sum(number(r, EXECUTED) for r in rows)
    for a, b in partitions(rows):
        total, mix = instruction_mix(rows, a, b)
        if kernel_total and total > 0.1 * kernel_total:
            top = ", ".join(f"{op} {share:.1%}" for op, share in mix[:10])
            print(f"  rows {a}-{b}: {total:.3g}: {top}")
    print("most stalled instructions:")
    for i in sorted(range(len(rows)), key=lambda i: -number(rows[i], SAMPLES))[:args.top]:
        print(f"  {i:5d} {rows[i]['Source'].strip()[:64]:64s} {number(rows[i], SAMPLES):8.0f}")


if __name__ == "__main__":
    main()
