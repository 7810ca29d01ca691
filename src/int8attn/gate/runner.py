"""Measure one path of an experiment: the seven items of DESIGN.md section 5.

An experiment describes each path as a :class:`PathSpec` -- its one-time steps (outside
the timed window, e.g. quantizing weights), its per-call chain (inside the window), the
kernels it must launch with the matrix instruction each must contain, its bytes model and
its scales -- and :func:`measure_path` does the rest the same way for every path:
accuracy against float64 and against the BF16 path, eager and CUDA-graph timings of the
whole chain and of each step, the profiler trace, the SASS of the kernels that ran.
"""

from __future__ import annotations

import hashlib
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from .. import bench
from ..reference import error_stats
from . import metrics, sass, trace
from .results import CaseResult, KernelProof, PathResult, ScaleInfo, Step, Timing
from .tracker import track_launches

MEANINGLESS = "meaningless (interpreter/CPU)"


@dataclass
class StepSpec:
    name: str
    kind: str  # "quantize" | "convert" | "compute" | "epilogue"
    fn: Callable[[], object]
    note: str = ""


@dataclass
class ProofSpec:
    """A kernel the path must launch. ``kernel`` is an exact Triton kernel name, or a
    regex when ``library`` (closed-source kernels, whose SASS is not inspected)."""

    kernel: str
    expected_class: str | None
    library: bool = False


@dataclass
class PathSpec:
    name: str
    label: str
    precision: str
    role: str
    per_call: list
    output: Callable[[], torch.Tensor]
    one_time: list = field(default_factory=list)
    main_step: str | None = None
    proofs: list = field(default_factory=list)
    traffic: metrics.Traffic = field(default_factory=metrics.Traffic)
    flops: float = 0.0
    scales: list = field(default_factory=list)
    conversion: str = ""
    config: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)


class GateContext:
    """What every experiment shares: device, mode, size, user tensors, timing policy."""

    def __init__(self, *, size: str = "default", device: torch.device | str | None = None,
                 interpret: bool = False, seed: int = 0, tensors: dict | None = None,
                 tensors_path: str | None = None, progress: Callable[[str], None] | None = None,
                 sass_dir: str | Path | None = None, warmup_ms: float = 10.0, rep_ms: float = 60.0,
                 graph_target_us: float = 15_000.0, graph_repeats: int = 8, time_budget_s: float | None = None):
        self.size = size
        self.interpret = interpret
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() and not interpret else "cpu"))
        self.on_gpu = self.device.type == "cuda"
        self.seed = seed
        self.tensors = tensors
        self.tensors_path = tensors_path
        self.progress = progress or (lambda msg: None)
        self.sass_dir = Path(sass_dir) if sass_dir else None
        self.warmup_ms = warmup_ms
        self.rep_ms = rep_ms
        self.graph_target_us = graph_target_us
        self.graph_repeats = graph_repeats
        self._copy_bw = None
        self.deadline = time.perf_counter() + time_budget_s if time_budget_s else None

    def out_of_time(self) -> bool:
        """True once the run's time budget is spent (experiments then skip their
        remaining cases and say so)."""
        return self.deadline is not None and time.perf_counter() > self.deadline

    def skip_if_out_of_time(self, exp, case_name: str) -> bool:
        if not self.out_of_time():
            return False
        exp.notes.append(f"case {case_name}: skipped, the run's time budget was spent")
        self.progress(f"{exp.key} {case_name}: skipped (time budget spent)")
        return True

    # ------------------------------------------------------------------ device facts
    @property
    def gpu_name(self) -> str:
        return torch.cuda.get_device_name(self.device) if self.on_gpu else "none (CPU)"

    @property
    def copy_bw(self) -> float | None:
        if not self.on_gpu:
            return None
        if self._copy_bw is None:
            self._copy_bw = bench.copy_bandwidth(1 << 30)
        return self._copy_bw

    def sync(self) -> None:
        if self.on_gpu:
            torch.cuda.synchronize(self.device)

    def generator(self, offset: int = 0) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed + offset)

    # ------------------------------------------------------------------ timing
    def time(self, fn: Callable[[], object], graph: bool = True) -> Timing:
        """Eager (L2 flushed between runs) and CUDA-graph (back-to-back replays) medians."""
        if not self.on_gpu or self.interpret:
            t0 = time.perf_counter()
            fn()
            self.sync()
            return Timing(eager_us=(time.perf_counter() - t0) * 1e6, meaningful=False, note=MEANINGLESS)
        eager = bench.time_eager(fn, warmup_ms=self.warmup_ms, rep_ms=self.rep_ms)
        out = Timing(eager_us=eager)
        if graph:
            replays = max(1, min(50, int(self.graph_target_us / max(eager, 1.0))))
            try:
                out.graph_us = bench.time_graph(fn, replays=replays, repeats=self.graph_repeats, warmup=2)
            except Exception as exc:  # capture can fail for ops that sync or allocate on the host
                out.note = f"CUDA graph failed: {type(exc).__name__}: {str(exc)[:160]}"
                torch.cuda.synchronize()
        return out


def _proof(ctx: GateContext, spec: ProofSpec, trace_result: dict, compiled_by_name: dict) -> KernelProof:
    from .. import launches

    proof = KernelProof(kernel=spec.kernel, expected_class=spec.expected_class)
    if trace_result["status"] == "ok":
        proof.matched = trace.match(trace_result, spec.kernel, pattern=spec.library)
        proof.trace_status = "ran" if proof.matched else "not-seen"
    else:
        proof.trace_status = "skipped"
        proof.note = trace_result.get("note", "")
    if spec.library:
        proof.sass_status = "library"
        inferred = {sass.infer_class_from_name(n) for n in proof.matched} - {None}
        proof.classes = {c: None for c in sorted(inferred)}
        proof.note = ("closed-source library kernel: SASS not inspected; class "
                      + (f"inferred from its name: {', '.join(sorted(inferred))}" if inferred
                         else "not stated by its name"))
        return proof
    if not ctx.on_gpu:
        proof.sass_status = "skipped"
        proof.note = "no GPU (interpreter): no binary, SASS skipped"
        return proof
    recorded = launches.last(spec.kernel)
    compiled = compiled_by_name.get(spec.kernel) or (recorded.compiled if recorded is not None else None)
    if compiled is None:
        proof.sass_status = "skipped"
        proof.note = "no compiled kernel recorded for this launch"
        return proof
    try:
        text = sass.sass_of_compiled(compiled)
    except Exception as exc:
        proof.sass_status = "skipped"
        proof.note = f"SASS unavailable: {type(exc).__name__}: {str(exc)[:160]}"
        return proof
    name = sass.compiled_name(compiled)
    summary = sass.summarize(text, name if name in sass.parse_sass(text) else None)
    proof.mma, proof.classes, proof.convert = summary["mma"], summary["classes"], summary["convert"]
    if spec.expected_class is None:
        proof.sass_status = "none-expected"
    else:
        proof.sass_status = "found" if sass.has_class(summary, spec.expected_class) else "missing"
    if ctx.sass_dir is not None:
        # one file per binary: the variants of one kernel (int8 / fp8 / bf16 cache) differ
        digest = hashlib.sha1(compiled.asm["cubin"]).hexdigest()[:8]
        ctx.sass_dir.mkdir(parents=True, exist_ok=True)
        (ctx.sass_dir / f"{name}.{digest}.sass.txt").write_text(text)
    return proof


def error_text(exc: BaseException, limit: int = 400) -> str:
    """``Type: message`` in one line; long messages (a CompilationError quotes source
    first) keep their head and their tail, where the cause is."""
    msg = " ".join(str(exc).split())
    if len(msg) > limit:
        msg = msg[: limit // 4] + " ... " + msg[-(3 * limit) // 4:]
    return f"{type(exc).__name__}: {msg}"


def measure_path(ctx: GateContext, spec: PathSpec, reference: torch.Tensor | None,
                 baseline_sample: torch.Tensor | None) -> tuple[PathResult, torch.Tensor | None]:
    """Run, check and time one path; returns its result and its output sample (for the
    next paths' "vs BF16" comparison)."""
    res = PathResult(name=spec.name, label=spec.label, precision=spec.precision, role=spec.role,
                     bytes_model=spec.traffic.to_dict(), flops=spec.flops, scales=list(spec.scales),
                     conversion=spec.conversion, config=dict(spec.config), notes=list(spec.notes))
    sample = None
    try:
        def chain():
            for step in spec.per_call:
                step.fn()

        timed = ctx.on_gpu and not ctx.interpret
        compiled = {}
        if timed:
            for step in spec.one_time:
                step.fn()
            with track_launches() as compiled:
                chain()  # compiles and warms every kernel before anything is timed
            ctx.sync()
        else:
            # Interpreter/CPU: one instrumented pass gives every (meaningless) time; the
            # interpreter compiles nothing, so there is nothing to warm.
            one_time = [(step, ctx.time(step.fn, graph=False)) for step in spec.one_time]
            per_call = [(step, ctx.time(step.fn, graph=False)) for step in spec.per_call]
        sample = spec.output()
        if reference is not None:
            res.accuracy["vs_fp64"] = error_stats(sample, reference)
        if baseline_sample is not None and spec.role != "baseline":
            res.accuracy["vs_bf16"] = error_stats(sample, baseline_sample)

        if timed:
            res.chain = ctx.time(chain)
            one_time = [(step, ctx.time(step.fn, graph=False)) for step in spec.one_time]
            per_call = []
            for step in spec.per_call:
                is_main = step.name == spec.main_step
                timing = res.chain if len(spec.per_call) == 1 else ctx.time(step.fn, graph=is_main)
                per_call.append((step, timing))
        else:
            res.chain = Timing(eager_us=sum(t.eager_us for _, t in per_call), meaningful=False, note=MEANINGLESS)
        for step, timing in one_time:
            res.steps.append(Step(step.name, step.kind, per_call=False, timing=timing, note=step.note))
        for step, timing in per_call:
            res.steps.append(Step(step.name, step.kind, per_call=True, timing=timing, note=step.note))
            if step.name == spec.main_step or len(spec.per_call) == 1:
                res.kernel = timing

        traced = trace.launched_kernels(chain)
        res.launched = traced["kernels"]
        res.proofs = [_proof(ctx, p, traced, compiled) for p in spec.proofs]

        total = res.bytes_model["total"]
        res.achieved = {
            "eager": metrics.achieved(total, spec.flops, res.chain.eager_us if res.chain.meaningful else None),
            "graph": metrics.achieved(total, spec.flops, res.chain.graph_us if res.chain.meaningful else None),
        }
        if ctx.on_gpu:
            peak = metrics.peak_for(ctx.gpu_name, spec.precision)
            res.floor = metrics.floor_us(total, spec.flops, ctx.copy_bw, peak)
            res.floor["peak_source"] = "vendor datasheet (dense)" if peak else "unknown GPU: no peak"
            res.floor["copy_bw_GBps"] = ctx.copy_bw / 1e9 if ctx.copy_bw else None
    except Exception as exc:
        res.error = error_text(exc)
        res.notes.append(traceback.format_exc(limit=4)[-1500:])
        if ctx.on_gpu:
            try:
                torch.cuda.synchronize()
            except Exception:
                pass
    return res, sample


def fill_speedups(case: CaseResult) -> None:
    """Speed-up of every path's chain (and kernel) against the case's BF16 baseline."""
    base = case.baseline()
    if base is None:
        return
    for p in case.paths:
        eager = metrics.speedup(base.chain.eager_us, p.chain.eager_us)
        graph = metrics.speedup(base.chain.graph_us, p.chain.graph_us)
        p.speedup = {
            "eager": eager,
            "graph": graph,
            "agree": metrics.same_direction(eager, graph),
            "kernel_eager": metrics.speedup(base.kernel.eager_us, p.kernel.eager_us),
            "kernel_graph": metrics.speedup(base.kernel.graph_us, p.kernel.graph_us),
        }


def run_case(ctx: GateContext, name: str, params: dict, specs: list, reference: torch.Tensor | None,
             tag: str = "") -> CaseResult:
    """Measure ``specs`` in order (the BF16 baseline first) and fill in their speed-ups."""
    case = CaseResult(name=name, params=params)
    baseline_sample = None
    for spec in specs:
        ctx.progress(f"{tag} {name}: {spec.label} ...")
        res, sample = measure_path(ctx, spec, reference, baseline_sample)
        if spec.role == "baseline":
            baseline_sample = sample
        case.paths.append(res)
        ctx.progress(f"{tag} {name}: {spec.label}: " + _one_line(res))
    fill_speedups(case)
    return case


def _one_line(res: PathResult) -> str:
    if res.error:
        return f"FAILED {res.error}"
    acc = res.accuracy.get("vs_fp64", {})
    mark = "" if res.chain.meaningful else " [meaningless]"
    return (f"eager {metrics.fmt_us(res.chain.eager_us)}, graph {metrics.fmt_us(res.chain.graph_us)}{mark}, "
            f"rel-L2 {metrics.fmt_sci(acc.get('rel_l2'))}")


__all__ = ["GateContext", "PathSpec", "ProofSpec", "ScaleInfo", "StepSpec", "measure_path", "run_case",
           "fill_speedups", "MEANINGLESS"]
