"""The gate end to end on the CPU (interpreter, tiny sizes): run_gate, --tensors, the CLI,
the registry."""

import json

import pytest
import torch

from int8attn import cli
from int8attn.gate import load_tensors, registry, run_gate
from int8attn.testing import make_keys, make_normal

needs_cpu_mode = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU (interpreter) mode")


@pytest.fixture
def unavailable_experiment(monkeypatch):
    """A registered experiment whose kernels are "not in the build"."""
    import sys
    import types

    mod = types.ModuleType("int8attn_fake_experiment")
    mod.KEY, mod.TITLE, mod.CLAIM = "EX", "fake", "none"
    mod.availability = lambda ctx: "not available yet: int8attn.ops.nothing is not in this build"
    mod.run = lambda ctx: (_ for _ in ()).throw(AssertionError("must not run"))
    monkeypatch.setitem(sys.modules, "int8attn_fake_experiment", mod)
    monkeypatch.setitem(registry.EXPERIMENTS, "EX", "int8attn_fake_experiment")
    return "EX"


@needs_cpu_mode
def test_run_gate_tiny_writes_a_complete_report(tmp_path, unavailable_experiment):
    lines = []
    rep = run_gate(tmp_path / "out", experiments="E1,E3,EX", progress=lines.append)
    out = tmp_path / "out"
    assert {"report.md", "report.json", "gate.jsonl", "e1.png", "e3.png"} <= {p.name for p in out.iterdir()}
    assert rep["mode"]["size"] == "tiny" and rep["mode"]["interpret"]
    data = json.loads((out / "report.json").read_text())
    keys = [e["key"] for e in data["experiments"]]
    assert keys == ["E1", "E3", "EX"]
    e1, e3, ex = data["experiments"]
    assert ex["status"] == "unavailable" and ex["reason"].startswith("not available yet")
    assert e1["status"] == "ran" and e3["status"] == "ran"
    for exp in (e1, e3):
        for case in exp["cases"]:
            for path in case["paths"]:
                assert path["error"] is None, (exp["key"], path["name"], path["error"], path["notes"])
                assert path["chain"]["meaningful"] is False
                acc = path["accuracy"]["vs_fp64"]
                assert acc["finite"] and acc["rel_l2"] < exp["accuracy_bound"]
                assert all(p["sass_status"] in ("skipped", "library") for p in path["proofs"])
    # the BF16 paths are near exact, the 8-bit ones show their quantization error
    e3_case = e3["cases"][-1]
    by_name = {p["name"]: p for p in e3_case["paths"]}
    assert by_name["bf16"]["accuracy"]["vs_fp64"]["rel_l2"] < 1e-4
    assert 1e-3 < by_name["int8_native"]["accuracy"]["vs_fp64"]["rel_l2"] < 0.05
    assert by_name["int8_native"]["accuracy"]["timed_row_max_vs_fp64"]["finite"]
    assert all(v["decision"] == "inconclusive" for v in rep["verdicts"])
    assert {v["experiment"] for v in rep["verdicts"]} == {"E1", "E3"}
    md = (out / "report.md").read_text()
    assert "Every timing in this report is meaningless" in md and "not available yet" in md
    rows = [json.loads(line) for line in (out / "gate.jsonl").read_text().splitlines()]
    assert any(r.get("path") == "int8_native" and r["interpreter"] for r in rows)
    assert any(r.get("experiment") == "EX" and r.get("status") == "unavailable" for r in rows)
    assert any("E1" in line for line in lines)
    assert "E3" in rep["console"] and "EX   unavailable" in rep["console"]


@needs_cpu_mode
def test_attention_experiments_run_on_the_decode_and_prefill_kernels(tmp_path):
    rep = run_gate(tmp_path / "out", experiments="E2,E4", plots=False, record=False)
    e2, e4 = rep["results"]
    assert e2.status == "ran" and e4.status == "ran", (e2.reason, e4.reason)
    for exp in (e2, e4):
        assert exp.cases
        for case in exp.cases:
            for path in case.paths:
                assert path.error is None, (exp.key, case.name, path.name, path.error)
                acc = path.accuracy["vs_fp64"]
                assert acc["finite"] and acc["rel_l2"] < exp.accuracy_bound
                if path.role == "candidate":
                    assert path.accuracy["vs_bf16"]["rel_l2"] < exp.accuracy_bound
    assert {p.name for p in e2.cases[0].paths} == {"bf16", "fp8_dequant_bf16", "fp8_native"}
    # the dequantize route pays a conversion step inside the window
    dq = e2.cases[0].path("fp8_dequant_bf16")
    assert [s.kind for s in dq.steps if s.per_call] == ["convert", "compute"]


@needs_cpu_mode
def test_user_tensors_replace_synthetic_inputs(tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    gen = torch.Generator().manual_seed(5)
    t, hq, hkv, d = 96, 4, 2, 64
    path = tmp_path / "qkv.safetensors"
    safetensors.save_file({"q": make_normal((t, hq, d), generator=gen),
                           "k": make_keys(t, hkv, d, generator=gen),
                           "v": make_normal((t, hkv, d), generator=gen)}, str(path))
    rep = run_gate(tmp_path / "out", experiments=["E3"], tensors=path, plots=False, record=False)
    [e3] = rep["results"]
    assert e3.status == "ran"
    assert "user tensors" in " ".join(e3.notes)
    assert [c.params["T"] for c in e3.cases] == [64, 96]
    assert all(c.params["q_heads"] == hq and c.params["kv_heads"] == hkv for c in e3.cases)
    assert rep["mode"]["tensors"] == str(path)
    assert "jsonl" not in rep["files"]


def test_load_tensors_validates(tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    bad = tmp_path / "bad.safetensors"
    safetensors.save_file({"q": torch.zeros(4, 3, 16), "k": torch.zeros(4, 2, 16), "v": torch.zeros(4, 2, 16)},
                          str(bad))
    with pytest.raises(ValueError, match="multiple"):
        load_tensors(bad)
    safetensors.save_file({"q": torch.zeros(4, 2, 16), "k": torch.zeros(4, 2, 16)}, str(bad))
    with pytest.raises(ValueError, match="missing"):
        load_tensors(bad)
    safetensors.save_file({"q": torch.zeros(4, 2, 16), "k": torch.zeros(4, 2, 8), "v": torch.zeros(4, 2, 8)},
                          str(bad))
    with pytest.raises(ValueError, match="head_dim"):
        load_tensors(bad)
    with pytest.raises(ValueError, match="does not exist"):
        load_tensors(tmp_path / "nope.safetensors")


def test_registry_selection():
    assert registry.parse_selection(None) == registry.keys()
    assert registry.parse_selection("e3, E1") == ["E1", "E3"]
    with pytest.raises(ValueError, match="E9"):
        registry.parse_selection("E1,E9")
    for key in registry.keys():
        mod = registry.load(key)
        assert mod.KEY == key and mod.TITLE and mod.CLAIM


@needs_cpu_mode
def test_run_gate_refuses_gpu_sizes_without_a_gpu(tmp_path):
    with pytest.raises(ValueError, match="needs a GPU"):
        run_gate(tmp_path, size="default", experiments="E1")


@needs_cpu_mode
def test_cli_gate_runs_and_prints_the_table(tmp_path, capsys):
    rc = cli.main(["gate", "--out", str(tmp_path / "r"), "--experiments", "E1", "--no-plots", "--quiet"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "int8_dyn_triton" in printed and "INCONCLUSIVE" in printed and "report.md" in printed
    assert (tmp_path / "r" / "report.md").exists()
    assert cli.main(["gate", "--list"]) == 0
    assert "E4" in capsys.readouterr().out
    assert cli.main(["gate", "--out", str(tmp_path / "x"), "--experiments", "E7"]) == 2


def test_tracker_records_the_binary_each_launch_returned(monkeypatch):
    import types

    from triton.runtime.jit import JITFunction

    from int8attn.gate.tracker import track_launches

    fake_binary = types.SimpleNamespace(asm={"cubin": b""}, name="_some_kernel")

    def fake_run(self, *args, **kwargs):
        return fake_binary

    monkeypatch.setattr(JITFunction, "run", fake_run)

    def _some_kernel(x):
        pass

    fn = JITFunction(_some_kernel)
    with track_launches() as launched:
        fn.run(1, grid=(1,), warmup=False)
    assert launched == {"_some_kernel": fake_binary}
    assert JITFunction.run is fake_run  # restored


@needs_cpu_mode
def test_time_budget_skips_and_says_so(tmp_path):
    rep = run_gate(tmp_path / "o", experiments="E1,E3", time_budget_s=1e-9, plots=False, record=False)
    statuses = {e.key: e.status for e in rep["results"]}
    assert statuses == {"E1": "skipped", "E3": "skipped"}
    assert "time budget" in (tmp_path / "o" / "report.md").read_text()
