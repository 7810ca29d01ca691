"""Write the gate report: report.md, report.json, PNG plots, and the console table.

The Markdown gives, per experiment, a table of paths per case and then the seven items of
docs/design.md §5 for every path, and ends with one verdict line per path. Plots need
matplotlib (optional): without it the report says the plots were skipped.
"""

from __future__ import annotations

import json
from pathlib import Path

from .articles import article_lines
from .metrics import fmt_bytes, fmt_sci, fmt_us, fmt_x
from .results import ExperimentResult, PathResult, to_jsonable

DECISION_MARK = {"adopt": "ADOPT", "reject": "REJECT", "inconclusive": "INCONCLUSIVE"}


# --------------------------------------------------------------------------- small formatters
def _mma_text(path: PathResult) -> str:
    parts = []
    for proof in path.proofs:
        if proof.expected_class is None:
            continue
        if proof.sass_status in ("found", "missing"):
            ops = ", ".join(f"{op} ×{n}" for op, n in proof.mma.items()) or "none"
            parts.append(f"{ops} [{proof.sass_status}]")
        elif proof.sass_status == "library":
            if proof.trace_status == "skipped":
                parts.append("library (no GPU)")
            else:
                parts.append(f"library ({', '.join(proof.classes) or '?'} by name)")
        else:
            parts.append("SASS skipped")
    return "; ".join(parts) or "—"


#: the "ran" cell of a path that ran (its output was checked) without a profiler trace to
#: prove which kernel did the work (no GPU, or the trace failed)
RAN_UNTRACED = "yes (not traced)"


def _ran_text(path: PathResult) -> str:
    statuses = {p.trace_status for p in path.proofs}
    if not statuses:
        return "—"
    if "not-seen" in statuses:
        return "NO"
    if statuses == {"ran"}:
        return "yes"
    return RAN_UNTRACED


def _acc(stats: dict | None, key: str) -> str:
    if not stats:
        return "—"
    return fmt_sci(stats.get(key))


def _timing_cell(us, meaningful: bool) -> str:
    text = fmt_us(us)
    return text if meaningful or us is None else f"{text}*"


def _ratio_cell(x, meaningful: bool) -> str:
    """A speed ratio; marked ``*`` (meaningless) when it comes from interpreter/CPU timings."""
    text = fmt_x(x)
    return text if meaningful or x is None else f"{text}*"


def _md_table(headers, rows) -> list[str]:
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    for row in rows:
        out.append("| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |")
    return out


# --------------------------------------------------------------------------- markdown
def path_items(path: PathResult, interpret: bool) -> list[str]:
    """The seven items of docs/design.md §5 for one path, as Markdown lines."""
    L = [f"#### {path.label} (`{path.name}`, {path.precision}, {path.role})", ""]
    if path.error:
        L += [f"**Failed:** `{path.error}`", ""]
        return L
    bm = path.bytes_model
    ach = path.achieved or {}
    e, g = ach.get("eager", {}), ach.get("graph", {})
    stages = "; ".join(f"{s['stage']}: read {fmt_bytes(s['read'])}, write {fmt_bytes(s['write'])}"
                       + ("" if s["per_call"] else " (once, outside the window)") for s in bm.get("stages", []))
    line1 = (f"1. **Bytes** (model, per call): read {fmt_bytes(bm.get('read'))}, write {fmt_bytes(bm.get('write'))}"
             f" — {stages}. Achieved: {fmt_sci(e.get('GBps'))} GB/s eager, {fmt_sci(g.get('GBps'))} GB/s graph; "
             f"{fmt_sci(e.get('TFLOPs'))} TFLOP/s eager, {fmt_sci(g.get('TFLOPs'))} graph.")
    fl = path.floor or {}
    if fl.get("floor_us"):
        line1 += (f" Floor {fmt_us(fl['floor_us'])} ({fl['bound']}-bound: memory {fmt_us(fl.get('memory_us'))} at "
                  f"{fmt_sci(fl.get('copy_bw_GBps'))} GB/s copy, compute {fmt_us(fl.get('compute_us'))} at "
                  f"{fl.get('peak_source')}); measured eager chain is "
                  f"{fmt_sci(path.chain.eager_us / fl['floor_us'] if path.chain.eager_us else None)}x the floor.")
    L.append(line1)
    L.append(f"2. **Quantization / conversion**: {path.conversion or 'none'}.")
    if path.steps:
        L.append("")
        L += ["   " + r for r in _md_table(
            ["step", "kind", "when", "eager", "graph", "note"],
            [[s.name, s.kind, "every call (inside window)" if s.per_call else "once (outside window)",
              _timing_cell(s.timing.eager_us, s.timing.meaningful), _timing_cell(s.timing.graph_us, s.timing.meaningful),
              s.note or s.timing.note] for s in path.steps])]
        L.append("")
    if path.scales:
        L.append("3. **Scales**:")
        for sc in path.scales:
            L.append(f"   - {sc.name}: {sc.granularity}; lifetime {sc.lifetime}; reuse: {sc.reuse}"
                     + ("; recomputed every call" if sc.recomputed_every_call else "; computed once"))
    else:
        L.append("3. **Scales**: none (BF16).")
    proof_lines = []
    for pr in path.proofs:
        what = "no matrix instruction expected" if pr.expected_class is None else f"expects {pr.expected_class}"
        if pr.sass_status in ("found", "missing", "none-expected"):
            ops = ", ".join(f"`{op}` ×{n}" for op, n in pr.mma.items()) or "no MMA"
            conv = ", ".join(f"`{op}` ×{n}" for op, n in list(pr.convert.items())[:4])
            sass_txt = f"SASS: {ops} → **{pr.sass_status}**" + (f"; conversions {conv}" if conv else "")
        else:
            sass_txt = f"SASS: {pr.sass_status}" + (f" ({pr.note})" if pr.note else "")
        ran = {"ran": "**ran** (" + ", ".join(f"`{n}`" for n in sorted(set(pr.matched))[:2]) + ")",
               "not-seen": "**NOT seen in the trace**", "skipped": "trace skipped (no GPU)"}[pr.trace_status]
        proof_lines.append(f"   - `{pr.kernel}` ({what}): {sass_txt}; profiler trace: {ran}")
    L.append("4. **Instruction and runtime proof**:" + ("" if proof_lines else " —"))
    L += proof_lines
    if path.launched:
        L.append("   - kernels launched by one call: " + ", ".join(f"`{n[:70]}`" for n in path.launched[:6]))
    sp = path.speedup or {}
    ok = path.chain.meaningful
    mark = "" if ok else " (*meaningless: interpreter/CPU*)"
    L.append(f"5. **Full chain**: {fmt_us(path.chain.eager_us)} eager, {fmt_us(path.chain.graph_us)} graph{mark}; "
             f"vs BF16: {_ratio_cell(sp.get('eager'), ok)} eager, {_ratio_cell(sp.get('graph'), ok)} graph "
             f"(kernel alone: {fmt_us(path.kernel.eager_us)}, {_ratio_cell(sp.get('kernel_eager'), ok)}){mark}."
             + (f" {path.chain.note}." if path.chain.note and path.chain.meaningful else ""))
    a64, abf = path.accuracy.get("vs_fp64"), path.accuracy.get("vs_bf16")
    acc = (f"6. **Accuracy** vs float64: finite {a64.get('finite') if a64 else '—'}, rel-L2 {_acc(a64, 'rel_l2')}, "
           f"p99 abs {_acc(a64, 'p99_abs')}, max abs {_acc(a64, 'max_abs')}")
    acc += (f"; vs BF16: rel-L2 {_acc(abf, 'rel_l2')}, p99 abs {_acc(abf, 'p99_abs')}, max abs {_acc(abf, 'max_abs')}"
            if abf else "; vs BF16: — (this is the BF16 path)" if path.role == "baseline" else "")
    extra = path.accuracy.get("timed_row_max_vs_fp64")
    if extra:
        acc += f"; the timed run's row maxima vs float64: rel-L2 {_acc(extra, 'rel_l2')}"
    L.append(acc + ".")
    agree = sp.get("agree")
    agree_txt = ("agree" if agree else "**disagree**") if agree is not None else "graph not measured"
    if not path.chain.meaningful:
        agree_txt = "meaningless (interpreter/CPU)"
    L.append(f"7. **Eager vs CUDA graph**: {agree_txt}. Full generation path: not measured by this experiment.")
    if path.config:
        L.append(f"   - config: `{path.config}`")
    for note in path.notes:
        if not note.startswith("Traceback"):
            L.append(f"   - note: {note}")
    L.append("")
    return L


def experiment_markdown(exp: ExperimentResult, interpret: bool) -> list[str]:
    L = [f"## {exp.key} — {exp.title}", "", f"*Article:* {exp.claim}", ""]
    if exp.status != "ran":
        L += [f"**{exp.status}**: {exp.reason}", ""]
        return L
    if exp.accuracy_bound is not None:
        L += [f"*Accuracy bound:* {exp.accuracy_note or exp.accuracy_bound}", ""]
    for note in exp.notes:
        L.append(f"- {note}")
    L.append("")
    for case in exp.cases:
        head = " (headline)" if case.name in exp.headline_cases else ""
        L += [f"### {exp.key} {case.name}{head}", ""]
        rows = []
        for p in case.paths:
            if p.error:
                rows.append([p.label, "FAILED", "", "", "", "", "", "", "", _mma_text(p), _ran_text(p)])
                continue
            sp = p.speedup or {}
            a64, abf = p.accuracy.get("vs_fp64"), p.accuracy.get("vs_bf16")
            rows.append([
                p.label,
                _timing_cell(p.chain.eager_us, p.chain.meaningful),
                _timing_cell(p.chain.graph_us, p.chain.meaningful),
                _ratio_cell(sp.get("eager"), p.chain.meaningful), _ratio_cell(sp.get("graph"), p.chain.meaningful),
                fmt_bytes(p.bytes_model.get("total")),
                fmt_sci((p.achieved.get("eager") or {}).get("TFLOPs")),
                _acc(a64, "rel_l2"), _acc(abf, "rel_l2"),
                _mma_text(p), _ran_text(p),
            ])
        L += _md_table(["path", "chain eager", "chain graph", "×BF16 eager", "×BF16 graph", "bytes/call",
                        "TFLOP/s", "rel-L2 vs f64", "rel-L2 vs BF16", "MMA in SASS", "ran"], rows)
        if interpret or any(not p.chain.meaningful for p in case.paths):
            L.append("")
            L.append("\\* timings and ratios meaningless (Triton interpreter on a CPU).")
        if any(_ran_text(p) == RAN_UNTRACED for p in case.paths):
            L.append("")
            L.append(f"ran \"{RAN_UNTRACED}\": the path ran and its output was checked; no profiler trace "
                     "proves which kernel did the work (no GPU, or the trace failed).")
        for note in case.notes:
            L.append(f"\n- {note}")
        L.append("")
        for p in case.paths:
            L += path_items(p, interpret)
    for plot in exp.plots:
        L += [f"![{exp.key}]({plot})", ""]
    L.append(f"**Verdicts ({exp.key})**")
    L.append("")
    for v in exp.verdicts:
        L.append(f"- `{v.path}`: **{DECISION_MARK.get(v.decision, v.decision)}** — {v.reason}")
    L.append("")
    return L


def to_markdown(report: dict, experiments: list) -> str:
    env, mode = report["env"], report["mode"]
    L = ["# int8attn low-precision gate", ""]
    L.append(f"- GPU: {env.get('gpu')}; torch {env.get('torch')}, Triton {env.get('triton')}, CUDA {env.get('cuda')}, "
             f"Python {env.get('python')}")
    L.append(f"- Date: {env.get('date')}; command: `{env.get('command')}`")
    L.append("- Reproduces the two articles of docs/design.md §2:")
    L += [f"  - {line}" for line in article_lines()]
    L.append(f"- Mode: {mode['mode']}; size: {mode['size']}; experiments: {', '.join(mode['experiments'])}; "
             f"adopt needs ≥{mode['min_speedup']:g}x in eager and graph timings plus the accuracy bound")
    if mode.get("interpret"):
        L.append("- **Every timing in this report is meaningless** (Triton interpreter on a CPU); SASS is skipped. "
                 "Run on a GPU for verdicts.")
    if mode.get("tensors"):
        L.append(f"- User tensors: `{mode['tensors']}`")
    if mode.get("plots_note"):
        L.append(f"- {mode['plots_note']}")
    L += ["", "## Verdicts", ""]
    rows = []
    for exp in experiments:
        if exp.status != "ran":
            rows.append([exp.key, "—", exp.status, exp.reason])
        for v in exp.verdicts:
            rows.append([exp.key, f"`{v.path}`", f"**{DECISION_MARK.get(v.decision, v.decision)}**", v.reason])
    L += _md_table(["exp", "path", "verdict", "reason"], rows)
    L.append("")
    for exp in experiments:
        L += experiment_markdown(exp, mode.get("interpret", False))
    return "\n".join(L) + "\n"


# --------------------------------------------------------------------------- plots

def _numeric_axis(exp: ExperimentResult):
    """(param, values) when the cases differ in exactly one numeric parameter (a line plot
    over it reads well), else None (the cases get labelled, grouped bars)."""
    if len(exp.cases) < 2 or len({tuple(c.params) for c in exp.cases}) != 1:
        return None
    keys = list(exp.cases[0].params)
    varying = [k for k in keys if len({c.params[k] for c in exp.cases}) > 1]
    if len(varying) != 1:
        return None
    key = varying[0]
    xs = [c.params[key] for c in exp.cases]
    if not all(isinstance(x, (int, float)) and x > 0 for x in xs):
        return None
    return key, xs


def _grouped_bars(exp: ExperimentResult, names: list, ax_s, ax_a) -> None:
    """Cases that are not points on one axis (E4: decode and prefill shapes): one group of
    bars per case, labelled with the case's name; speed-ups of each candidate (eager and
    CUDA graph) on the left, rel-L2 of every path on the right."""
    colors = {name: f"C{i % 10}" for i, name in enumerate(names)}
    ticks, labels, x = [], [], 0.0
    for case in exp.cases:
        cands = [p for p in case.paths if p.role == "candidate" and not p.error]
        for p in cands:
            eager, graph = p.speedup.get("eager"), p.speedup.get("graph")
            if eager is not None:
                ax_s.bar(x - 0.2, eager, width=0.4, color=colors[p.name], label=f"{p.name} eager")
            if graph is not None:  # not measured without a GPU
                ax_s.bar(x + 0.2, graph, width=0.4, color=colors[p.name], alpha=0.45, hatch="//",
                         label=f"{p.name} CUDA graph")
            ticks.append(x)
            labels.append(case.name if len(cands) == 1 else f"{case.name}\n{p.name}")
            x += 1.0
        x += 0.5
    ax_s.axhline(1.0, color="k", lw=1)
    ax_s.set_xticks(ticks, labels, rotation=30, ha="right", fontsize=8)
    ax_s.set_ylabel("speed vs BF16 (x, higher is faster)")
    ax_s.set_xlabel(exp.x_label or "case")
    ticks, labels, x = [], [], 0.0
    for case in exp.cases:
        paths = [p for p in case.paths if not p.error]
        width = 0.8 / max(1, len(paths))
        for i, p in enumerate(paths):
            rel = (p.accuracy.get("vs_fp64") or {}).get("rel_l2")
            if rel:
                ax_a.bar(x + (i - (len(paths) - 1) / 2) * width, rel, width=width, color=colors[p.name],
                         label=p.name)
        ticks.append(x)
        labels.append(case.name)
        x += 1.0
    ax_a.set_yscale("log")
    ax_a.set_xticks(ticks, labels, rotation=30, ha="right", fontsize=8)
    ax_a.set_ylabel("rel-L2 vs float64")
    ax_a.set_xlabel(exp.x_label or "case")


def _dedup_legend(ax, **kw) -> None:
    handles, labels = ax.get_legend_handles_labels()
    seen = {}
    for h, label in zip(handles, labels):
        seen.setdefault(label, h)
    if seen:
        ax.legend(list(seen.values()), list(seen), **kw)

def write_plots(experiments: list, out_dir: Path) -> tuple[list[str], str]:
    """One PNG per experiment that ran: speed-up vs BF16 (eager/graph) and rel-L2 vs
    float64. Returns (file names, note)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import NullFormatter
    except ImportError:
        return [], "plots skipped: matplotlib is not installed (pip install matplotlib)"
    files = []
    for exp in experiments:
        if exp.status != "ran" or not exp.cases:
            continue
        names = []
        for case in exp.cases:
            for p in case.paths:
                if p.name not in names:
                    names.append(p.name)
        wide = _numeric_axis(exp) is None and len(exp.cases) > 1
        n_bars = sum(len(c.paths) for c in exp.cases) if wide else 0
        fig, (ax_s, ax_a) = plt.subplots(1, 2, figsize=(max(12.0, 4.0 + 0.9 * n_bars), 5.5 if wide else 4.5))
        meaningful = all(p.chain.meaningful for c in exp.cases for p in c.paths)
        if len(exp.cases) == 1:
            case = exp.cases[0]
            cands = [p for p in case.paths if p.role == "candidate" and not p.error]
            ys = range(len(cands))
            eager = [p.speedup.get("eager") or 0 for p in cands]
            graph = [p.speedup.get("graph") or 0 for p in cands]
            ax_s.barh([y + 0.2 for y in ys], eager, height=0.4, label="eager")
            if any(graph):  # no CUDA graph without a GPU
                ax_s.barh([y - 0.2 for y in ys], graph, height=0.4, label="CUDA graph")
            ax_s.set_yticks(list(ys), [p.name for p in cands])
            ax_s.axvline(1.0, color="k", lw=1)
            ax_s.set_xlabel("speed vs BF16 (x, higher is faster)")
            if any(v > 0 for v in eager + graph):
                ax_s.set_xscale("log")
            rel = [(p.accuracy.get("vs_fp64") or {}).get("rel_l2") or 0 for p in case.paths if not p.error]
            ax_a.barh(range(len(rel)), rel, height=0.6)
            ax_a.set_yticks(range(len(rel)), [p.name for p in case.paths if not p.error])
            ax_a.set_xlabel("rel-L2 vs float64")
            if all(v > 0 for v in rel):
                ax_a.set_xscale("log")
                ax_a.xaxis.set_minor_formatter(NullFormatter())
        elif _numeric_axis(exp) is not None:
            key, xs = _numeric_axis(exp)
            for name in names:
                ps = [c.path(name) for c in exp.cases]
                if all(p is None or p.role == "baseline" for p in ps):
                    continue
                eager = [p.speedup.get("eager") if p and not p.error else None for p in ps]
                graph = [p.speedup.get("graph") if p and not p.error else None for p in ps]
                line, = ax_s.plot(xs, [v if v is not None else float("nan") for v in eager], "o-", label=f"{name} eager")
                if any(v is not None for v in graph):  # no CUDA graph without a GPU
                    ax_s.plot(xs, [v if v is not None else float("nan") for v in graph], "s--",
                              color=line.get_color(), label=f"{name} graph")
            for name in names:
                ps = [c.path(name) for c in exp.cases]
                rel = [((p.accuracy.get("vs_fp64") or {}).get("rel_l2") if p and not p.error else None) for p in ps]
                ax_a.plot(xs, [v if v is not None else float("nan") for v in rel], "o-", label=name)
            ax_s.axhline(1.0, color="k", lw=1)
            ax_a.set_yscale("log")
            ax_s.set_xscale("log", base=2)
            ax_a.set_xscale("log", base=2)
            ax_s.set_xticks(xs, [str(x) for x in xs])
            ax_a.set_xticks(xs, [str(x) for x in xs])
            ax_s.xaxis.set_minor_formatter(NullFormatter())
            ax_a.xaxis.set_minor_formatter(NullFormatter())
            ax_s.set_xlabel(exp.x_label or key)
            ax_a.set_xlabel(exp.x_label or key)
            ax_s.set_ylabel("speed vs BF16 (x, higher is faster)")
            ax_a.set_ylabel("rel-L2 vs float64")
            ax_a.legend(fontsize=8)
        else:
            _grouped_bars(exp, names, ax_s, ax_a)
        if not meaningful:
            ax_s.set_title("ratios MEANINGLESS (interpreter/CPU timings)", fontsize=8, color="r")
        if exp.accuracy_bound is not None:
            (ax_a.axvline if len(exp.cases) == 1 else ax_a.axhline)(exp.accuracy_bound, color="r", ls=":",
                                                                    label="bound")
        _dedup_legend(ax_s, fontsize=8)
        if wide:
            _dedup_legend(ax_a, fontsize=8)
        title = f"{exp.key}: {exp.title}"
        if not meaningful:
            title += "\n(timings MEANINGLESS: interpreter/CPU)"
        fig.suptitle(title, fontsize=9)
        fig.tight_layout()
        fname = f"{exp.key.lower()}.png"
        fig.savefig(out_dir / fname, dpi=110)
        plt.close(fig)
        files.append(fname)
        exp.plots.append(fname)
    return files, ""


# --------------------------------------------------------------------------- console
def console_table(experiments: list) -> str:
    """A fixed-width summary for the terminal; the case and path columns are as wide as
    their longest entry, so no label is cut."""
    ran = [e for e in experiments if e.status == "ran"]
    case_w = max([len("case")] + [len(c.name) for e in ran for c in e.cases])
    path_w = max([len("path")] + [len(p.name) for e in ran for c in e.cases for p in c.paths])
    mma_w = 22
    header = (f"{'exp':<4} {'case':<{case_w}} {'path':<{path_w}} {'eager':>10} {'graph':>10} {'xBF16 e':>8} "
              f"{'xBF16 g':>8} {'relL2':>9} {'MMA':<{mma_w}} ran")
    lines = [header, "-" * len(header)]
    for exp in experiments:
        if exp.status != "ran":
            lines.append(f"{exp.key:<4} {exp.status}: {exp.reason}")
            continue
        for case in exp.cases:
            for p in case.paths:
                if p.error:
                    lines.append(f"{exp.key:<4} {case.name:<{case_w}} {p.name:<{path_w}} FAILED: {p.error[:60]}")
                    continue
                ok = p.chain.meaningful
                star = "" if ok else "*"
                sp = p.speedup or {}
                mma = _mma_text(p)
                lines.append(
                    f"{exp.key:<4} {case.name:<{case_w}} {p.name:<{path_w}} {fmt_us(p.chain.eager_us) + star:>10} "
                    f"{_timing_cell(p.chain.graph_us, ok):>10} {_ratio_cell(sp.get('eager'), ok):>8} "
                    f"{_ratio_cell(sp.get('graph'), ok):>8} "
                    f"{fmt_sci((p.accuracy.get('vs_fp64') or {}).get('rel_l2')):>9} {mma[:mma_w]:<{mma_w}} "
                    f"{_ran_text(p)}")
        for v in exp.verdicts:
            lines.append(f"     -> {v.path}: {DECISION_MARK.get(v.decision, v.decision)} — {v.reason}")
    if any(not p.chain.meaningful for e in experiments for c in e.cases for p in c.paths):
        lines.append("* meaningless timing or ratio (Triton interpreter / CPU)")
    return "\n".join(lines)


def write_report(report: dict, experiments: list, out_dir: Path, plots: bool = True) -> dict:
    """Write report.md, report.json and the plots into ``out_dir``; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {}
    if plots:
        names, note = write_plots(experiments, out_dir)
        report["mode"]["plots_note"] = note
        files["plots"] = [str(out_dir / n) for n in names]
    else:
        report["mode"]["plots_note"] = "plots skipped (--no-plots)"
    report["experiments"] = to_jsonable(experiments)
    (out_dir / "report.json").write_text(json.dumps(report, indent=1, sort_keys=False) + "\n")
    (out_dir / "report.md").write_text(to_markdown(report, experiments))
    files["json"] = str(out_dir / "report.json")
    files["markdown"] = str(out_dir / "report.md")
    return files
