"""Adopt or reject a low-precision path, with a one-line reason.

A candidate is adopted only if, in every headline case of its experiment:

1. it ran (no error) and its output is finite;
2. its relative L2 error against float64 is within the experiment's bound;
3. the expected matrix instruction is in the SASS of its kernel (when SASS is available)
   and the profiler trace shows that kernel ran (when a trace is available);
4. its full-chain time beats the BF16 path by at least ``min_speedup``, both eagerly and
   under CUDA-graph replay (where graphs ran), and the two timings point the same way.

The reason names every criterion that failed (speed and accuracy are both reported, so a
path that is slow *and* inaccurate says so). Timings from the interpreter or a CPU are
meaningless: the decision is then "inconclusive" whatever the numbers say.
"""

from __future__ import annotations

from .metrics import fmt_sci
from .results import ExperimentResult, PathResult, Verdict

DEFAULT_MIN_SPEEDUP = 1.05
HARD = ("error", "accuracy", "proof")


def check_path(path: PathResult, accuracy_bound: float | None, min_speedup: float = DEFAULT_MIN_SPEEDUP) -> dict:
    """Per-case checks of one candidate: ``failures`` lists (criterion, why) in the order
    error, accuracy, proof, meaningless, disagree, speed."""
    out = {"eager": path.speedup.get("eager"), "graph": path.speedup.get("graph"), "rel_l2": None,
           "finite": None, "failures": []}
    fail = out["failures"]
    if path.error:
        fail.append(("error", f"failed to run: {path.error}"))
        return out
    acc = path.accuracy.get("vs_fp64") or {}
    out["rel_l2"], out["finite"] = acc.get("rel_l2"), acc.get("finite")
    if acc and not acc.get("finite", True):
        fail.append(("accuracy", "non-finite output"))
    elif accuracy_bound is not None and out["rel_l2"] is not None and out["rel_l2"] > accuracy_bound:
        fail.append(("accuracy", f"rel-L2 {fmt_sci(out['rel_l2'])} vs float64 > bound {accuracy_bound:g}"))
    for proof in path.proofs:
        if proof.sass_status == "missing":
            found = ", ".join(sorted(proof.classes)) or "no matrix instruction"
            fail.append(("proof", f"{proof.expected_class} matrix instruction not in the SASS of {proof.kernel} "
                                  f"(found {found})"))
        if proof.trace_status == "not-seen":
            fail.append(("proof", f"the trace does not show {proof.kernel} running"))
    if not path.chain.meaningful:
        fail.append(("meaningless", "timings are meaningless (interpreter/CPU)"))
        return out
    eager, graph = out["eager"], out["graph"]
    if eager is None and graph is None:
        fail.append(("speed", "no timing"))
        return out
    if eager is not None and graph is not None and (eager >= 1.0) != (graph >= 1.0):
        fail.append(("disagree", f"eager ({eager:.2f}x) and graph ({graph:.2f}x) disagree"))
    worst = min(v for v in (eager, graph) if v is not None)
    if worst < min_speedup:
        fail.append(("speed", f"{worst:.3f}x of BF16"))
    return out


def _range(values) -> str:
    vals = [v for v in values if v is not None]
    if not vals:
        return "—"
    lo, hi = min(vals), max(vals)
    return f"{lo:.2f}x" if abs(hi - lo) < 0.005 else f"{lo:.2f}–{hi:.2f}x"


def _unique(items):
    seen, out = set(), []
    for item in items:
        if item not in seen:
            seen.add(item)
            out.append(item)
    return out


def decide(exp: ExperimentResult, min_speedup: float = DEFAULT_MIN_SPEEDUP) -> list[Verdict]:
    """One verdict per candidate path of ``exp`` (see module docstring)."""
    names = []
    for case in exp.cases:
        for p in case.paths:
            if p.role == "candidate" and p.name not in names:
                names.append(p.name)
    headline = set(exp.headline_cases or [c.name for c in exp.cases])
    bound = exp.accuracy_bound
    verdicts = []
    for name in names:
        checks = {c.name: check_path(c.path(name), bound, min_speedup) for c in exp.cases if c.path(name) is not None}
        head = {k: v for k, v in checks.items() if k in headline} or checks
        rest = {k: v for k, v in checks.items() if k not in head}
        kinds = {kind for v in head.values() for kind, _ in v["failures"]}
        rel = [v["rel_l2"] for v in head.values() if v["rel_l2"] is not None]
        rel_txt = f"rel-L2 {fmt_sci(max(rel))}" if rel else "rel-L2 —"
        bound_txt = "" if bound is None else f" (bound {bound:g})"
        speed_txt = (f"{_range([v['eager'] for v in head.values()])} of BF16 eager, "
                     f"{_range([v['graph'] for v in head.values()])} graph")
        where = ", ".join(head)
        details = {"cases": {k: {**v, "failures": [list(f) for f in v["failures"]]} for k, v in checks.items()},
                   "headline": sorted(head), "min_speedup": min_speedup, "accuracy_bound": bound}
        whys = _unique(f"{why} ({case})" if len(head) > 1 else why
                       for case, v in head.items() for kind, why in v["failures"] if kind in HARD)
        if "meaningless" in kinds:
            text = f"timings are meaningless in interpreter/CPU mode; {rel_txt}{bound_txt}"
            if whys:
                text += "; " + "; ".join(whys[:2])
            verdicts.append(Verdict(name, "inconclusive", text + " — run on a GPU for a verdict", details))
            continue
        if "error" in kinds:
            verdicts.append(Verdict(name, "reject", whys[0], details))
            continue
        if kinds & {"accuracy", "proof", "disagree", "speed"}:
            parts = []
            if "speed" in kinds:
                parts.append(f"not faster: {speed_txt} at {where}")
            if "disagree" in kinds:
                parts.append("eager and graph timings disagree")
            parts.extend(whys[:2])
            if "speed" in kinds and "accuracy" not in kinds:
                parts.append(rel_txt)
            verdicts.append(Verdict(name, "reject", "; ".join(parts), details))
            continue
        tail = ""
        lagging = [k for k, v in rest.items() if v["failures"]]
        if lagging:
            tail = f"; no gain at {', '.join(lagging)} ({_range([rest[k]['eager'] for k in lagging])} eager)"
        within = "" if bound is None else f" within {bound:g}"
        verdicts.append(Verdict(name, "adopt", f"{speed_txt} at {where}, {rel_txt}{within}{tail}", details))
    return verdicts
