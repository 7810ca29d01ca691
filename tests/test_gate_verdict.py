"""Metrics, bytes model and verdict logic of the gate (pure CPU, synthetic results)."""

import math

import pytest

from int8attn.gate import metrics
from int8attn.gate.results import CaseResult, ExperimentResult, KernelProof, PathResult, Timing
from int8attn.gate.runner import fill_speedups
from int8attn.gate.verdict import check_path, decide


# --------------------------------------------------------------------------- metrics
def test_traffic_counts_per_call_stages_only():
    t = (metrics.Traffic().add("quantize W (once)", 100, 50, per_call=False)
         .add("quantize X", 10, 5).add("gemm", 20, 8))
    d = t.to_dict()
    assert (d["read"], d["write"], d["total"]) == (30, 13, 43)
    assert [s["per_call"] for s in d["stages"]] == [False, True, True]


def test_gemm_bytes_model_of_the_article_shape():
    m, n, k = 4096, 34816, 5120
    bf16 = metrics.Traffic().add("GEMM", 2 * m * k + 2 * n * k, 2 * m * n).to_dict()
    assert bf16["total"] == 2 * (m * k + n * k + m * n)
    assert metrics.gemm_flops(m, n, k) == pytest.approx(1.46e12, rel=1e-2)
    # on an H200 the BF16 GEMM is compute-bound: floor = flops / peak
    fl = metrics.floor_us(bf16["total"], metrics.gemm_flops(m, n, k), 4.2e12, metrics.peak_for("NVIDIA H200", "bf16"))
    assert fl["bound"] == "compute"
    assert fl["floor_us"] == pytest.approx(metrics.gemm_flops(m, n, k) / 989e12 * 1e6)
    assert fl["memory_us"] < fl["compute_us"]


def test_floor_is_memory_bound_for_small_flops_and_unknown_without_ceilings():
    fl = metrics.floor_us(1e9, 1e9, 4e12, 1e15)
    assert fl["bound"] == "memory" and fl["floor_us"] == pytest.approx(250.0)
    assert metrics.floor_us(1e9, 1e9, None, None)["floor_us"] is None
    assert metrics.peak_for("NVIDIA A100", "int8") is None


def test_achieved_speedup_geomean_direction():
    a = metrics.achieved(2e9, 4e12, 1000.0)
    assert a["GBps"] == pytest.approx(2000.0) and a["TFLOPs"] == pytest.approx(4000.0)
    assert metrics.achieved(1, 1, None) == {"GBps": None, "TFLOPs": None}
    assert metrics.speedup(200.0, 100.0) == 2.0
    assert metrics.speedup(None, 1.0) is None
    assert metrics.geomean([0.357, 0.410, 0.372]) == pytest.approx(math.exp(sum(map(math.log, [0.357, 0.41, 0.372])) / 3))
    assert metrics.geomean([None]) is None
    assert metrics.same_direction(1.2, 1.1) and metrics.same_direction(0.5, 0.9)
    assert metrics.same_direction(1.2, 0.9) is False
    assert metrics.same_direction(None, 1.0) is None


def test_formatters():
    assert metrics.fmt_us(None) == "—"
    assert metrics.fmt_us(12.34) == "12.3 µs"
    assert metrics.fmt_us(2071.0) == "2.07 ms"
    assert metrics.fmt_bytes(683e6) == "683.00 MB"
    assert metrics.fmt_x(0.0342) == "0.034x"
    assert metrics.fmt_sci(float("inf")) == "inf"


# --------------------------------------------------------------------------- verdicts
def _path(name, role="candidate", eager=100.0, graph=100.0, rel=0.01, finite=True, meaningful=True,
          proofs=None, error=None):
    p = PathResult(name=name, label=name, precision="bf16" if role == "baseline" else "int8", role=role,
                   chain=Timing(eager, graph, meaningful=meaningful), kernel=Timing(eager, graph, meaningful=meaningful),
                   error=error)
    p.accuracy = {"vs_fp64": {"finite": finite, "rel_l2": rel, "max_abs": 0.1, "p99_abs": 0.05, "mean_abs": 0.01}}
    p.proofs = proofs or [KernelProof("k", "INT8", sass_status="found", trace_status="ran", classes={"INT8": 8})]
    return p


def _exp(cases, headline=None, bound=0.05):
    exp = ExperimentResult(key="EX", title="t", claim="c", accuracy_bound=bound, cases=cases,
                           headline_cases=headline or [])
    for c in cases:
        fill_speedups(c)
    return exp


def _case(name, base_us, cand_us, graph_base=None, graph_cand=None, **kw):
    return CaseResult(name, {"T": name}, [
        _path("bf16", "baseline", eager=base_us, graph=graph_base or base_us, rel=0.002),
        _path("int8", eager=cand_us, graph=graph_cand or cand_us, **kw),
    ])


def test_faster_accurate_proven_path_is_adopted():
    [v] = decide(_exp([_case("T=4096", 160.0, 100.0)]))
    assert v.decision == "adopt"
    assert "1.60x" in v.reason and "rel-L2 0.01" in v.reason


def test_slower_path_is_rejected_with_its_ratio():
    [v] = decide(_exp([_case("4096x34816x5120", 2071.0, 5290.0)]))
    assert v.decision == "reject"
    assert "not faster" in v.reason and "0.39x" in v.reason


def test_a_gain_under_the_threshold_is_not_enough():
    [v] = decide(_exp([_case("c", 102.0, 100.0)]), min_speedup=1.05)
    assert v.decision == "reject"


def test_inaccurate_path_is_rejected_even_if_fast():
    [v] = decide(_exp([_case("c", 200.0, 100.0, rel=0.2)]))
    assert v.decision == "reject" and "rel-L2 0.2" in v.reason and "bound 0.05" in v.reason


def test_slow_and_inaccurate_reports_both():
    [v] = decide(_exp([_case("c", 100.0, 300.0, rel=0.2)]))
    assert v.decision == "reject" and "not faster" in v.reason and "rel-L2 0.2" in v.reason


def test_non_finite_output_is_rejected():
    [v] = decide(_exp([_case("c", 200.0, 100.0, finite=False)]))
    assert v.decision == "reject" and "non-finite" in v.reason


def test_missing_instruction_or_unseen_kernel_is_rejected():
    missing = [KernelProof("k", "INT8", sass_status="missing", trace_status="ran", classes={"BF16": 16})]
    [v] = decide(_exp([_case("c", 200.0, 100.0, proofs=missing)]))
    assert v.decision == "reject" and "INT8 matrix instruction not in the SASS" in v.reason and "BF16" in v.reason
    unseen = [KernelProof("k", "INT8", sass_status="found", trace_status="not-seen")]
    [v] = decide(_exp([_case("c", 200.0, 100.0, proofs=unseen)]))
    assert v.decision == "reject" and "does not show k running" in v.reason


def test_eager_and_graph_must_point_the_same_way():
    [v] = decide(_exp([_case("c", 100.0, 80.0, graph_base=100.0, graph_cand=130.0)]))
    assert v.decision == "reject" and "disagree" in v.reason


def test_failed_path_is_rejected_with_the_error():
    [v] = decide(_exp([_case("c", 100.0, 80.0, error="RuntimeError: boom")]))
    assert v.decision == "reject" and "boom" in v.reason


def test_interpreter_timings_give_no_verdict():
    case = _case("c", 100.0, 1.0, meaningful=False)
    case.paths[0].chain.meaningful = False
    [v] = decide(_exp([case]))
    assert v.decision == "inconclusive" and "meaningless" in v.reason


def test_headline_cases_decide_and_the_rest_is_reported():
    cases = [_case("T=256", 10.0, 10.5), _case("T=4096", 160.0, 100.0), _case("T=16384", 640.0, 400.0)]
    [v] = decide(_exp(cases, headline=["T=4096", "T=16384"]))
    assert v.decision == "adopt"
    assert "no gain at T=256" in v.reason
    [v] = decide(_exp(cases))  # every case is headline: T=256 blocks adoption
    assert v.decision == "reject"


def test_check_path_lists_every_failure():
    p = _path("x", eager=300.0, graph=300.0, rel=0.3)
    p.speedup = {"eager": 0.3, "graph": 0.3}
    kinds = [k for k, _ in check_path(p, 0.05)["failures"]]
    assert kinds == ["accuracy", "speed"]
