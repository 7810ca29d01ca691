"""The low-precision gate: does a low-precision path really pay?

``int8attn gate`` (see :mod:`int8attn.cli`) and :func:`run_gate` run experiments that
each compare low-precision paths with their BF16 counterpart on the same inputs, report
the seven items of DESIGN.md section 5 per path, and end with an adopt/reject verdict:

* E1 -- dynamic INT8 GEMM vs cuBLAS BF16 (the second article's negative result);
* E2 -- FP8 KV paged decode vs BF16 (plugs in with the decode kernel);
* E3 -- QK alone: INT8 K -> BF16 dot vs native INT8 dot vs BF16 (the first article's table);
* E4 -- our INT8 decode/prefill vs their BF16-cache counterparts (plugs in with them).

Without a GPU the gate runs tiny sizes under the Triton interpreter, marks every timing
meaningless and skips SASS, and still writes report.md / report.json / plots.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable

import torch

from . import registry
from .results import ExperimentResult, to_jsonable

SIZES = ("tiny", "default", "full")


def load_tensors(path: str | os.PathLike) -> dict:
    """q, k, v from a .safetensors file: q [tokens, num_q_heads, head_dim], k and v
    [tokens, num_kv_heads, head_dim]; num_q_heads a multiple of num_kv_heads."""
    try:
        from safetensors.torch import load_file
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError("--tensors needs the safetensors package (pip install safetensors)") from exc
    if not Path(path).is_file():
        raise ValueError(f"tensor file {str(path)!r} does not exist")
    tensors = load_file(str(path))
    missing = [name for name in ("q", "k", "v") if name not in tensors]
    if missing:
        raise ValueError(f"{path}: missing tensor(s) {missing}; need q, k, v (has {sorted(tensors)})")
    q, k, v = tensors["q"], tensors["k"], tensors["v"]
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 3:
            raise ValueError(f"{path}: {name} must be [tokens, heads, head_dim], got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"{path}: {name} must be a floating-point tensor, got {t.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"{path}: k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"{path}: q head_dim {q.shape[2]} != k head_dim {k.shape[2]}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{path}: {q.shape[1]} query heads is not a multiple of {k.shape[1]} KV heads")
    if not torch.isfinite(q.float()).all() or not torch.isfinite(k.float()).all():
        raise ValueError(f"{path}: q and k must be finite")
    return {"q": q, "k": k, "v": v}


def _record_rows(recorder, experiments, size: str) -> None:
    for exp in experiments:
        if exp.status != "ran":
            recorder.add(bench="gate", experiment=exp.key, status=exp.status, reason=exp.reason, size=size)
            continue
        decisions = {v.path: (v.decision, v.reason) for v in exp.verdicts}
        for case in exp.cases:
            for p in case.paths:
                a64 = p.accuracy.get("vs_fp64") or {}
                abf = p.accuracy.get("vs_bf16") or {}
                decision = decisions.get(p.name, ("baseline" if p.role == "baseline" else None, ""))
                recorder.add(
                    bench="gate", experiment=exp.key, case=case.name, params=case.params, size=size, path=p.name,
                    precision=p.precision, role=p.role, error=p.error,
                    chain_eager_us=p.chain.eager_us, chain_graph_us=p.chain.graph_us,
                    kernel_eager_us=p.kernel.eager_us, kernel_graph_us=p.kernel.graph_us,
                    timing_meaningful=p.chain.meaningful,
                    speedup_eager=p.speedup.get("eager"), speedup_graph=p.speedup.get("graph"),
                    bytes_per_call=p.bytes_model.get("total"), flops=p.flops,
                    rel_l2_fp64=a64.get("rel_l2"), max_abs_fp64=a64.get("max_abs"), p99_abs_fp64=a64.get("p99_abs"),
                    rel_l2_bf16=abf.get("rel_l2"),
                    mma={pr.kernel: pr.mma for pr in p.proofs if pr.mma},
                    sass=[pr.sass_status for pr in p.proofs], trace=[pr.trace_status for pr in p.proofs],
                    steps=[{"name": s.name, "per_call": s.per_call, "eager_us": s.timing.eager_us,
                            "graph_us": s.timing.graph_us} for s in p.steps],
                    verdict=decision[0], reason=decision[1],
                )


def run_gate(
    out: str | os.PathLike | None = "gate-report",
    *,
    size: str | None = None,
    experiments: str | list | None = None,
    tensors: str | os.PathLike | dict | None = None,
    seed: int = 0,
    plots: bool = True,
    record: str | os.PathLike | bool | None = True,
    sass_dir: str | os.PathLike | None = None,
    min_speedup: float | None = None,
    time_budget_s: float | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """Run the gate and write its report. Returns a dict: ``env``, ``mode``, ``verdicts``
    (flat list of {experiment, path, decision, reason}), ``unavailable``, ``experiments``
    (JSON form), ``files`` (paths written), ``console`` (the summary table) and ``results``
    (the :class:`~int8attn.gate.results.ExperimentResult` objects).

    size: "tiny" | "default" | "full" (default: "default" on a GPU, "tiny" otherwise; without
    a GPU only "tiny" is allowed). experiments: "E1,E3", a list of keys, or None for all.
    tensors: a .safetensors path (or dict) with q, k, v replacing synthetic inputs.
    record: True -> rows appended to ``<out>/gate.jsonl``; a path -> there; False/None -> off.
    sass_dir: where to save the full SASS of every kernel inspected.
    time_budget_s: once spent, remaining experiments and cases are skipped (and reported
    as skipped); the report is rewritten after every experiment, so an interrupted run
    still leaves one.
    """
    from ..bench import Recorder, environment
    from ..runtime import interpret_mode
    from . import report as report_mod
    from . import verdict as verdict_mod
    from .runner import GateContext

    progress = progress or (lambda msg: None)
    gpu = torch.cuda.is_available()
    if not gpu and not interpret_mode():
        # Kernels are decorated when first imported: the gate imports them lazily, after this.
        os.environ["TRITON_INTERPRET"] = "1"
    interpret = interpret_mode()
    if size is None:
        size = "default" if gpu and not interpret else "tiny"
    if size not in SIZES:
        raise ValueError(f"size must be one of {SIZES}, got {size!r}")
    if (not gpu or interpret) and size != "tiny":
        raise ValueError(f"size {size!r} needs a GPU; without one (or under TRITON_INTERPRET=1) only 'tiny' runs")
    keys = registry.parse_selection(experiments if not isinstance(experiments, (list, tuple))
                                    else ",".join(experiments))
    tensors_path = None
    if isinstance(tensors, (str, os.PathLike)):
        tensors_path = str(tensors)
        tensors = load_tensors(tensors)
    min_speedup = verdict_mod.DEFAULT_MIN_SPEEDUP if min_speedup is None else float(min_speedup)

    ctx = GateContext(size=size, interpret=interpret, seed=seed, tensors=tensors, tensors_path=tensors_path,
                      progress=progress, sass_dir=sass_dir, time_budget_s=time_budget_s)
    env = environment()
    results: list[ExperimentResult] = []
    t_start = time.perf_counter()
    def build_report() -> dict:
        rep = {
            "env": env,
            "mode": {
                "mode": "GPU" if ctx.on_gpu and not interpret else "Triton interpreter on CPU (timings meaningless)",
                "interpret": interpret or not ctx.on_gpu, "size": size, "experiments": keys,
                "device": ctx.gpu_name, "seed": seed, "tensors": tensors_path, "min_speedup": min_speedup,
                "wall_s": time.perf_counter() - t_start,
            },
        }
        rep["verdicts"] = [{"experiment": e.key, "path": v.path, "decision": v.decision, "reason": v.reason}
                           for e in results for v in e.verdicts]
        rep["unavailable"] = [{"experiment": e.key, "status": e.status, "reason": e.reason}
                              for e in results if e.status != "ran"]
        return rep

    for key in keys:
        if ctx.out_of_time():
            results.append(ExperimentResult(key=key, title=key, claim="", status="skipped",
                                            reason="the run's time budget was spent before it started"))
            continue
        try:
            module = registry.load(key)
        except Exception as exc:
            results.append(ExperimentResult(key=key, title=key, claim="", status="unavailable",
                                            reason=f"cannot import: {type(exc).__name__}: {exc}"))
            progress(f"{key}: unavailable ({results[-1].reason})")
            continue
        reason = module.availability(ctx)
        if reason:
            results.append(ExperimentResult(key=key, title=module.TITLE, claim=module.CLAIM, status="unavailable",
                                            reason=reason))
            progress(f"{key}: {reason}")
            continue
        progress(f"{key}: {module.TITLE}")
        t0 = time.perf_counter()
        try:
            exp = module.run(ctx)
        except Exception as exc:
            exp = ExperimentResult(key=key, title=module.TITLE, claim=module.CLAIM, status="failed",
                                   reason=f"{type(exc).__name__}: {str(exc)[:300]}")
        exp.verdicts = verdict_mod.decide(exp, min_speedup) if exp.status == "ran" else []
        exp.notes.append(f"experiment wall time {time.perf_counter() - t0:.1f} s")
        results.append(exp)
        for v in exp.verdicts:
            progress(f"{key}: {v.path}: {v.decision.upper()} — {v.reason}")
        if out is not None and key != keys[-1]:
            report_mod.write_report(build_report(), results, Path(out), plots=False)  # partial, in case of a kill

    report = build_report()
    files = {}
    if out is not None:
        files = report_mod.write_report(report, results, Path(out), plots=plots)
    else:
        report["experiments"] = to_jsonable(results)
    if record:
        path = Path(out) / "gate.jsonl" if record is True and out is not None else record
        if path not in (True, None):
            rec = Recorder("gate", path=path)
            _record_rows(rec, results, size)
            files["jsonl"] = str(rec.save())
    report["files"] = files
    report["console"] = report_mod.console_table(results)
    report["results"] = results
    return report


__all__ = ["run_gate", "load_tensors", "registry", "SIZES"]
