"""The gate's report writer: Markdown with the seven items, JSON, plots, console table."""

import json

import pytest

from int8attn.gate import report
from int8attn.gate.results import (CaseResult, ExperimentResult, KernelProof, PathResult, ScaleInfo, Step, Timing,
                                   Verdict, to_jsonable)
from int8attn.gate.runner import fill_speedups


def _result(meaningful=True):
    base = PathResult("bf16", "BF16 baseline", "bf16", "baseline", chain=Timing(2071.0, 2050.0, meaningful),
                      kernel=Timing(2071.0, 2050.0, meaningful))
    base.bytes_model = {"read": 400, "write": 285, "total": 685, "stages": [
        {"stage": "GEMM", "read": 400, "write": 285, "per_call": True}]}
    base.accuracy = {"vs_fp64": {"finite": True, "rel_l2": 0.0031, "max_abs": 0.01, "p99_abs": 0.005,
                                 "mean_abs": 0.001}}
    base.proofs = [KernelProof("gemm|nvjet", "BF16", sass_status="library", trace_status="ran",
                               matched=["sm90_xmma_gemm_bf16bf16"], classes={"BF16": None})]
    cand = PathResult("int8_dyn", "INT8 dynamic", "int8", "candidate", chain=Timing(60000.0, 59000.0, meaningful),
                      kernel=Timing(60000.0, 59000.0, meaningful))
    cand.bytes_model = dict(base.bytes_model)
    cand.conversion = "inside the timed window"
    cand.steps = [Step("quantize W (once)", "quantize", False, Timing(900.0, None, meaningful)),
                  Step("kernel", "compute", True, Timing(60000.0, 59000.0, meaningful))]
    cand.scales = [ScaleInfo("W tile scale", "per (channel, K slice)", "one K-step", "128 rows", 128, True)]
    cand.proofs = [KernelProof("_gemm_dynamic_int8_kernel", "INT8", sass_status="found", trace_status="ran",
                               mma={"IGMMA.64x128x32.S8.S8": 2}, classes={"INT8": 2}, convert={"F2I.S16": 8},
                               matched=["_gemm_dynamic_int8_kernel"])]
    cand.accuracy = {"vs_fp64": {"finite": True, "rel_l2": 0.013, "max_abs": 0.05, "p99_abs": 0.03, "mean_abs": 0.01},
                     "vs_bf16": {"finite": True, "rel_l2": 0.0135, "max_abs": 0.05, "p99_abs": 0.03, "mean_abs": 0.01}}
    failed = PathResult("fp8", "FP8", "fp8", "candidate", error="RuntimeError: no fp8 here")
    case = CaseResult("4096x34816x5120", {"M": 4096}, [base, cand, failed])
    fill_speedups(case)
    exp = ExperimentResult("E1", "GEMM", "article claim", accuracy_bound=0.05, cases=[case],
                           headline_cases=[case.name], x_label="GEMM")
    exp.verdicts = [Verdict("int8_dyn", "reject", "not faster: 0.03x of BF16"),
                    Verdict("fp8", "reject", "failed to run: RuntimeError: no fp8 here")]
    multi = ExperimentResult("E3", "QK", "claim", accuracy_bound=0.05, x_label="T")
    for t, us in ((256, 10.0), (4096, 100.0)):
        c = CaseResult(f"T={t}", {"T": t}, [
            PathResult("bf16", "bf16", "bf16", "baseline", chain=Timing(us, us, meaningful)),
            PathResult("int8_native", "native", "int8", "candidate", chain=Timing(us / 1.5, us / 1.4, meaningful))])
        for p in c.paths:
            p.accuracy = {"vs_fp64": {"finite": True, "rel_l2": 0.02 if p.role == "candidate" else 1e-3}}
        fill_speedups(c)
        multi.cases.append(c)
    multi.verdicts = [Verdict("int8_native", "adopt", "1.4–1.5x")]
    unavailable = ExperimentResult("E2", "FP8 decode", "claim", status="unavailable", reason="not available yet: x")
    return [exp, unavailable, multi]


def _report_dict(interpret=False):
    return {"env": {"gpu": "NVIDIA H200", "torch": "2.11", "triton": "3.6", "cuda": "13.0", "python": "3.12",
                    "date": "2026-01-01", "command": "int8attn gate"},
            "mode": {"mode": "GPU", "interpret": interpret, "size": "default", "experiments": ["E1", "E2", "E3"],
                     "min_speedup": 1.05}}


def test_write_report_produces_markdown_json_and_plots(tmp_path):
    exps = _result()
    files = report.write_report(_report_dict(), exps, tmp_path)
    md = (tmp_path / "report.md").read_text()
    for item in ("1. **Bytes**", "2. **Quantization / conversion**", "3. **Scales**",
                 "4. **Instruction and runtime proof**", "5. **Full chain**", "6. **Accuracy**",
                 "7. **Eager vs CUDA graph**"):
        assert item in md, item
    assert "IGMMA.64x128x32.S8.S8" in md and "**found**" in md
    assert "REJECT" in md and "ADOPT" in md
    assert "not available yet: x" in md
    assert "**Failed:** `RuntimeError: no fp8 here`" in md
    assert "0.035x" in md  # 2071 / 60000
    data = json.loads((tmp_path / "report.json").read_text())
    assert [e["key"] for e in data["experiments"]] == ["E1", "E2", "E3"]
    assert data["experiments"][0]["cases"][0]["paths"][1]["proofs"][0]["mma"] == {"IGMMA.64x128x32.S8.S8": 2}
    pytest.importorskip("matplotlib")
    assert sorted(p.split("/")[-1] for p in files["plots"]) == ["e1.png", "e3.png"]
    for p in files["plots"]:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert "![E1](e1.png)" in md


def test_interpreter_report_says_timings_are_meaningless(tmp_path):
    exps = _result(meaningful=False)
    report.write_report(_report_dict(interpret=True), exps, tmp_path, plots=False)
    md = (tmp_path / "report.md").read_text()
    assert "Every timing in this report is meaningless" in md
    assert "*meaningless: interpreter/CPU*" in md
    assert "plots skipped" in md
    table = report.console_table(exps)
    assert "meaningless timing" in table and "*" in table


def test_console_table_lists_paths_and_verdicts():
    table = report.console_table(_result())
    assert "int8_dyn" in table and "REJECT" in table and "FAILED" in table and "E2   unavailable" in table


def test_to_jsonable_handles_non_finite_floats():
    assert to_jsonable({"a": float("inf"), "b": [float("nan"), 1.0]}) == {"a": "inf", "b": ["nan", 1.0]}


def test_interpreter_ratios_are_marked_meaningless(tmp_path):
    exps = _result(meaningful=False)
    report.write_report(_report_dict(interpret=True), exps, tmp_path, plots=False)
    md = (tmp_path / "report.md").read_text()
    assert "0.035x*" in md and "1.000x*" in md  # table cells and item 5
    assert "timings and ratios meaningless" in md
    table = report.console_table(exps)
    assert "0.035x*" in table and "meaningless timing or ratio" in table
    # GPU timings carry no mark
    md_gpu = report.to_markdown(_report_dict(), _result())
    assert "0.035x" in md_gpu and "0.035x*" not in md_gpu


def test_ran_column_says_yes_for_paths_that_ran_without_a_trace():
    exps = _result(meaningful=False)
    for exp in exps:
        for case in exp.cases:
            for p in case.paths:
                for proof in p.proofs:
                    proof.trace_status, proof.matched = "skipped", []
    md = report.to_markdown(_report_dict(interpret=True), exps)
    rows = [line for line in md.splitlines() if line.startswith("| INT8 dynamic |")]
    assert rows and rows[0].rstrip(" |").endswith(report.RAN_UNTRACED)
    assert "| skipped |" not in md
    assert "no profiler trace proves which kernel" in md
    assert report.RAN_UNTRACED in report.console_table(exps)


def test_ran_column_flags_a_kernel_the_trace_did_not_see():
    exps = _result()
    exps[0].cases[0].paths[1].proofs[0].trace_status = "not-seen"
    md = report.to_markdown(_report_dict(), exps)
    row = next(line for line in md.splitlines() if line.startswith("| INT8 dynamic |"))
    assert row.rstrip(" |").endswith("NO")


def test_report_names_the_reproduced_articles():
    md = report.to_markdown(_report_dict(), _result())
    assert "《gfx936 DCU上实现INT8 QK MMAC：分页访存、Fragment映射与GQA适配》" in md
    assert "Implementing INT8 QK MMAC on the gfx936 DCU" in md
    assert "dynamic INT8 GEMM and FP8 KV cache" in md
    assert "DESIGN.md" not in md


def _mixed_cases_experiment(meaningful=True):
    """E4-like: decode and prefill cases with different parameters and candidate names."""
    exp = ExperimentResult("E4", "decode and prefill", "claim", accuracy_bound=0.05, x_label="case")
    for name, params, cand in (("decode bs16 L8192 q4", {"batch": 16, "L": 8192, "q_len": 4}, "int8_decode"),
                               ("decode bs1 L32768", {"batch": 1, "L": 32768, "q_len": 1}, "int8_decode"),
                               ("prefill 4096 over 28672", {"q_len": 4096, "prefix": 28672}, "int8_prefill")):
        c = CaseResult(name, params, [
            PathResult("bf16", "bf16", "bf16", "baseline", chain=Timing(100.0, 90.0, meaningful)),
            PathResult(cand, cand, "int8", "candidate", chain=Timing(60.0, 50.0, meaningful))])
        for p in c.paths:
            p.accuracy = {"vs_fp64": {"finite": True, "rel_l2": 0.014 if p.role == "candidate" else 2e-3}}
        fill_speedups(c)
        exp.cases.append(c)
    return exp


def test_console_table_keeps_full_case_labels():
    table = report.console_table([_mixed_cases_experiment()])
    for label in ("decode bs16 L8192 q4", "prefill 4096 over 28672", "int8_prefill"):
        assert label in table
    widths = {len(line) for line in table.splitlines()[2:] if line.startswith("E4 ")}
    assert len(widths) == 1  # the columns line up


def test_cases_on_one_numeric_axis_get_lines_other_cases_grouped_bars(tmp_path):
    mixed = _mixed_cases_experiment()
    assert report._numeric_axis(mixed) is None
    multi = _result()[2]  # cases T=256, T=4096
    assert report._numeric_axis(multi) == ("T", [256, 4096])
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    drawn = {}
    real_savefig = plt.Figure.savefig

    def savefig(fig, path, *args, **kwargs):
        ax_s, ax_a = fig.axes[:2]
        drawn[str(path).rsplit("/", 1)[-1]] = (
            [t.get_text() for t in ax_s.get_xticklabels()], len(ax_s.patches), len(ax_s.lines))
        return real_savefig(fig, path, *args, **kwargs)

    plt.Figure.savefig = savefig
    try:
        files, _ = report.write_plots([mixed, multi], tmp_path)
    finally:
        plt.Figure.savefig = real_savefig
    assert files == ["e4.png", "e3.png"]
    labels, bars, _ = drawn["e4.png"]
    assert labels == [c.name for c in mixed.cases]  # one labelled group per case, no numeric axis
    assert bars == 2 * len(mixed.cases)  # eager and graph bar of each case's candidate
    _, bars, lines = drawn["e3.png"]
    assert bars == 0 and lines >= 2
