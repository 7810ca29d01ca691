"""Bytes and FLOP models, achieved rates, floors and small statistics for the gate.

The bytes model counts the fewest bytes a path must move through device memory: each
stage of its chain reads its inputs once and writes its outputs once (re-reads that
tiling causes are not counted; they are part of what the achieved bandwidth exposes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "int32": 4, "int8": 1, "fp8": 1}

# Dense tensor-core rates from the vendor's datasheets (SXM parts), op/s. Leads, not
# measurements: the gate quotes them only to place a measured time against a floor.
DATASHEET_PEAK = {
    "H100": {"bf16": 989e12, "fp16": 989e12, "int8": 1979e12, "fp8": 1979e12},
    "H200": {"bf16": 989e12, "fp16": 989e12, "int8": 1979e12, "fp8": 1979e12},
}


@dataclass
class Traffic:
    """Bytes read and written per stage of a chain."""

    stages: list = field(default_factory=list)  # (stage, read, write, per_call)

    def add(self, stage: str, read: float, write: float, per_call: bool = True) -> "Traffic":
        self.stages.append((stage, int(read), int(write), per_call))
        return self

    def per_call(self) -> tuple[int, int]:
        r = sum(s[1] for s in self.stages if s[3])
        w = sum(s[2] for s in self.stages if s[3])
        return r, w

    def to_dict(self) -> dict:
        r, w = self.per_call()
        return {
            "read": r,
            "write": w,
            "total": r + w,
            "stages": [{"stage": s, "read": rd, "write": wr, "per_call": pc} for s, rd, wr, pc in self.stages],
        }


def gemm_flops(m: int, n: int, k: int) -> float:
    return 2.0 * m * n * k


def qk_flops(num_q_heads: int, rows: int, tokens: int, head_dim: int) -> float:
    return 2.0 * num_q_heads * rows * tokens * head_dim


def achieved(total_bytes: float, flops: float, us: float | None) -> dict:
    """Effective bandwidth (GB/s) and rate (TFLOP/s or TOP/s) of one timing."""
    if not us or us <= 0:
        return {"GBps": None, "TFLOPs": None}
    s = us * 1e-6
    return {"GBps": total_bytes / s / 1e9, "TFLOPs": flops / s / 1e12}


def peak_for(gpu_name: str, precision: str) -> float | None:
    for key, table in DATASHEET_PEAK.items():
        if key in (gpu_name or ""):
            return table.get(precision)
    return None


def floor_us(total_bytes: float, flops: float, copy_bw: float | None, peak: float | None) -> dict:
    """The two lower bounds on a path's time: bytes / measured copy bandwidth and
    flops / datasheet peak; the larger one is the floor and names the limit."""
    mem = total_bytes / copy_bw * 1e6 if copy_bw else None
    comp = flops / peak * 1e6 if peak else None
    candidates = [(v, name) for v, name in ((mem, "memory"), (comp, "compute")) if v is not None]
    if not candidates:
        return {"memory_us": None, "compute_us": None, "floor_us": None, "bound": None}
    value, bound = max(candidates)
    return {"memory_us": mem, "compute_us": comp, "floor_us": value, "bound": bound}


def speedup(baseline_us: float | None, path_us: float | None) -> float | None:
    """baseline time / path time: > 1 means the path is faster."""
    if not baseline_us or not path_us:
        return None
    return baseline_us / path_us


def geomean(values) -> float | None:
    vals = [v for v in values if v is not None and v > 0]
    if not vals:
        return None
    return math.exp(sum(math.log(v) for v in vals) / len(vals))


def same_direction(a: float | None, b: float | None) -> bool | None:
    """Whether two speed-ups point the same way (both faster or both not faster)."""
    if a is None or b is None:
        return None
    return (a >= 1.0) == (b >= 1.0)


def fmt_us(us: float | None) -> str:
    if us is None:
        return "—"
    if us >= 1e4:
        return f"{us / 1e3:.1f} ms"
    if us >= 1e3:
        return f"{us / 1e3:.2f} ms"
    return f"{us:.1f} µs"


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "—"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def fmt_x(x: float | None) -> str:
    return "—" if x is None else f"{x:.3f}x"


def fmt_sci(x) -> str:
    if x is None:
        return "—"
    if isinstance(x, str):
        return x
    if x == 0:
        return "0"
    if not math.isfinite(x):
        return str(x)
    return f"{x:.3g}" if 1e-3 <= abs(x) < 1e4 else f"{x:.2e}"
