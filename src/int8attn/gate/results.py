"""Plain result records of a gate run (what report.py writes and verdict.py judges).

Every record turns into JSON through :func:`to_jsonable`. Times are microseconds; a
``Timing`` with ``meaningful=False`` came from the Triton interpreter or a CPU and must not
be read as a speed.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field


@dataclass
class Timing:
    eager_us: float | None = None
    graph_us: float | None = None
    meaningful: bool = True
    note: str = ""


@dataclass
class Step:
    """One stage of a path's chain (e.g. "quantize activations", "int8 GEMM")."""

    name: str
    kind: str  # "quantize" | "convert" | "compute" | "epilogue"
    per_call: bool  # True: runs on every call (inside the timed chain); False: once, outside
    timing: Timing = field(default_factory=Timing)
    note: str = ""


@dataclass
class ScaleInfo:
    """docs/design.md §5 item 3: one scale's granularity, lifetime and reuse."""

    name: str
    granularity: str
    lifetime: str
    reuse: str
    reuse_count: float | None = None
    recomputed_every_call: bool = False


@dataclass
class KernelProof:
    """Item 4: the matrix instruction in the SASS of a kernel, and whether the trace saw it run.

    ``sass_status``: "found" (expected class present), "missing" (absent), "none-expected"
    (a kernel without a matrix product, e.g. a quantizer), "skipped" (no GPU / no
    cuobjdump), "library" (closed-source kernel: class inferred from its name only).
    ``trace_status``: "ran", "not-seen", "skipped".
    """

    kernel: str
    expected_class: str | None
    sass_status: str = "skipped"
    mma: dict = field(default_factory=dict)
    classes: dict = field(default_factory=dict)
    convert: dict = field(default_factory=dict)
    trace_status: str = "skipped"
    matched: list = field(default_factory=list)
    note: str = ""


@dataclass
class PathResult:
    name: str
    label: str
    precision: str  # "bf16" | "int8" | "fp8"
    role: str  # "baseline" | "candidate"
    chain: Timing = field(default_factory=Timing)
    kernel: Timing = field(default_factory=Timing)
    steps: list = field(default_factory=list)  # list[Step], per-call and one-time
    bytes_model: dict = field(default_factory=dict)
    flops: float = 0.0
    achieved: dict = field(default_factory=dict)
    floor: dict = field(default_factory=dict)
    scales: list = field(default_factory=list)  # list[ScaleInfo]
    conversion: str = ""
    proofs: list = field(default_factory=list)  # list[KernelProof]
    launched: list = field(default_factory=list)  # kernel names seen in the trace
    accuracy: dict = field(default_factory=dict)  # vs_fp64, vs_bf16 (error_stats dicts), sample
    speedup: dict = field(default_factory=dict)  # eager, graph, agree (vs the case baseline)
    config: dict = field(default_factory=dict)
    error: str | None = None
    notes: list = field(default_factory=list)


@dataclass
class CaseResult:
    name: str
    params: dict
    paths: list = field(default_factory=list)  # list[PathResult]
    notes: list = field(default_factory=list)

    def baseline(self) -> PathResult | None:
        return next((p for p in self.paths if p.role == "baseline"), None)

    def path(self, name: str) -> PathResult | None:
        return next((p for p in self.paths if p.name == name), None)


@dataclass
class Verdict:
    path: str
    decision: str  # "adopt" | "reject" | "inconclusive"
    reason: str
    details: dict = field(default_factory=dict)


@dataclass
class ExperimentResult:
    key: str
    title: str
    claim: str
    status: str = "ran"  # "ran" | "unavailable" | "failed"
    reason: str = ""
    cases: list = field(default_factory=list)  # list[CaseResult]
    verdicts: list = field(default_factory=list)  # list[Verdict]
    headline_cases: list = field(default_factory=list)
    accuracy_bound: float | None = None
    accuracy_note: str = ""
    x_label: str = ""  # what distinguishes the cases, for plots
    notes: list = field(default_factory=list)
    plots: list = field(default_factory=list)


def to_jsonable(obj):
    """Dataclasses, dicts, lists and floats -> JSON-safe values (inf/nan become strings)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    return str(obj)
