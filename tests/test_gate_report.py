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
