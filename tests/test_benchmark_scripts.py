"""Benchmark scripts' CPU-side logic: the P-step emulation's finding (benchmarks/emulate_p_step.py)
and the prefill benchmark's tables (benchmarks/bench_prefill_hopper.print_table)."""

import importlib.util
import sys
from pathlib import Path

import pytest


def _script(name: str):
    """benchmarks/<name>.py as a module."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


bench_prefill_hopper = _script("bench_prefill_hopper")
emulate_p_step = _script("emulate_p_step")


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_the_per_row_p_step_beats_a_step_shared_by_the_tile(fmt):
    """The kernels' rule (each row's largest P * sV maps to the top code) against one step per
    tile: smaller error for both P formats (the dominant term stays exact)."""
    kw = dict(n_q=64, n_k=1024, d=64, seed=3)
    row, tile = emulate_p_step.p_step_error("row", fmt, **kw), emulate_p_step.p_step_error("tile", fmt, **kw)
    assert 0 < row < tile, (row, tile)
    assert row < 0.01


@pytest.mark.parametrize("mode", ["held", "held-row"])
def test_a_p_step_held_across_tiles_loses_to_the_per_tile_step(mode):
    """An int8 P step held across KV tiles (an int32 PV accumulator converted only when the
    step grows) rounds the tiles far from a row's maximum coarsely: several times the
    kernels' per-tile error."""
    kw = dict(n_q=64, n_k=1024, d=64, seed=3)
    row, held = emulate_p_step.p_step_error("row", "int8", **kw), emulate_p_step.p_step_error(mode, "int8", **kw)
    assert held > 2 * row, (row, held)


def test_prefill_table_prints_eager_and_graph_ratios(capsys):
    rows = [dict(shape="s", prefix=0, kv_dtype="int8", pv_mode="int8", kernel="portable", us=200.0, graph_us=150.0,
                 tops=10.0),
            dict(shape="s", prefix=0, kv_dtype="int8", pv_mode="int8", kernel="hopper-ws", us=100.0, graph_us=90.0,
                 tops=20.0, rel_l2_vs_portable=0.001),
            dict(shape="s", prefix=0, kv_dtype="bf16 dense", kernel="fa4_bf16", us=80.0, graph_us=72.0, tops=25.0),
            dict(shape="s", prefix=0, kv_dtype="int8", error="boom")]
    bench_prefill_hopper.print_table(rows)
    bench_prefill_hopper.print_table(rows, "graph_us")
    out = capsys.readouterr().out
    eager, graph = out.split("graph_us", 1)
    ws_eager = next(line for line in eager.splitlines() if "hopper-ws" in line).split()
    ws_graph = next(line for line in graph.splitlines() if "hopper-ws" in line).split()
    # us, TOP/s, x portable, x SDPA, x FA4 (eager: 200 / 100, 80 / 100; graph: 150 / 90, 72 / 90)
    assert ws_eager[4:9] == ["100.0", "20.0", "2.00", "-", "0.80"]
    assert ws_graph[4:9] == ["90.0", "22.2", "1.67", "-", "0.80"]
    assert eager.count("boom") == 1 and "boom" not in graph
