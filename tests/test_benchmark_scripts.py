"""Benchmark scripts' CPU-side logic: the P-step emulation's finding (benchmarks/emulate_p_step.py),
the prefill benchmark's tables (benchmarks/bench_prefill_hopper.print_table), the source-tree
A/B's exports (benchmarks/ab_trees_prefill_hopper.py), the reader of Nsight Compute's
per-instruction tables (benchmarks/ncu_source_table.py) and the decode timeline's summary
(benchmarks/timeline_decode.py)."""

import importlib.util
import sys
from pathlib import Path

import pytest


def _script(name: str):
    """benchmarks/<name>.py as a module (its directory importable, as when it is run: the
    scripts import the shared harness)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    if str(path.parent) not in sys.path:
        sys.path.append(str(path.parent))
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


bench_prefill_hopper = _script("bench_prefill_hopper")
emulate_p_step = _script("emulate_p_step")
ncu_source_table = _script("ncu_source_table")


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


@pytest.mark.parametrize("kv,pv", [("int8", "int8"), ("int8", "bf16"), ("fp8", "fp8"), ("fp8", "bf16"),
                                   ("bf16", "bf16")])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_every_prefill_benchmark_variant_is_a_valid_config(kv, pv, d):
    """Each Hopper config the prefill benchmark times passes the launcher's config check (a
    variant the launcher rejects would cost a device call to find), once per label, and the
    8-bit caches' 16-bit PV at head_dim <= 128 and a BF16 cache at 64 include 128-key tiles."""
    from types import SimpleNamespace

    from int8attn.ops import prefill_hopper as hop

    configs = bench_prefill_hopper.hopper_configs(kv, d, pv)
    labels = [label for label, _ in configs]
    assert len(set(labels)) == len(labels) and "hopper-ws" in labels
    cache = SimpleNamespace(kv_dtype=kv, head_dim=d)
    for label, config in configs:
        assert hop._check_config(config, cache, 4, pv) is not None, label
    # before de-duplication: a variant equal to the route's config is timed as "hopper-ws"
    wide = {label: c for label, c in bench_prefill_hopper._all_hopper_configs(kv, d, pv) if "n128" in label}
    both = {"hopper-ws-n128", "hopper-ws-pv-ahead-n128", "hopper-ws-shared-pv-ahead-n128"}
    if pv == "bf16" and kv != "bf16" and d <= 128:
        assert set(wide) == both | {"hopper-ws-pv-ahead-n128-split"}
    elif kv == "bf16" and d == 64:  # a BF16 cache: no split release (it has no 8-bit copies to give back early)
        assert set(wide) == both
    else:
        assert not wide
    assert all(c.block_n == 128 and c.block_m == 128 for c in wide.values())


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


_NCU_CSV = """\
"Kernel Name","_k"
"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed","L2 Theoretical Sectors Global",\
"L2 Theoretical Sectors Global Excessive","L1 Wavefronts Shared","L1 Wavefronts Shared Ideal","stall_long_sb",\
"stall_barrier","stall_long_sb (Not Issued)"
"0x0","MOV R1, R2","3","10","0","0","0","0","1","2","9"
"0x10","USETMAXREG.DEALLOC.CTAPOOL 0x28","0","10","0","0","0","0","0","0","0"
"0x20","LDGSTS.E.BYPASS.128 [R2], desc[UR4][R4.64]","5","100","3,200","1,600","3,200","400","5","0","0"
"0x30","LDGSTS.E.BYPASS.128 [R2+0x400], desc[UR4][R6.64]","1","100","1,600","0","400","400","1","0","0"
"0x40","USETMAXREG.ALLOC.CTAPOOL 0xe8","0","10","0","0","0","0","0","0","0"
"0x50","@!P0  BRA 0x90","40","100","0","0","0","0","10","30","7"
"""


def test_ncu_source_table_names_the_excess_and_the_stalls(tmp_path, capsys, monkeypatch):
    """The reader finds the copy that moves twice its sectors and eight times its wavefronts
    (and not its coalesced neighbour), cuts the partitions at USETMAXREG, shares each one's
    stall samples by reason (the "(Not Issued)" columns left out) and ranks instructions."""
    path = tmp_path / "k.csv"
    path.write_text(_NCU_CSV)
    rows = ncu_source_table.read_table(str(path))
    assert len(rows) == 6
    assert ncu_source_table.excess(rows) == [(2, "LDGSTS.E.BYPASS.128 [R2], desc[UR4][R4.64]", 32.0, 16.0, 32.0, 4.0)]
    assert ncu_source_table.partitions(rows) == [(0, 1), (1, 4), (4, 6)]
    total, shares = ncu_source_table.stall_shares(rows, 4, 6)
    assert total == 40 and shares == {"long_sb": 0.25, "barrier": 0.75}
    # instruction mix: predicates and modifiers stripped, shares of each partition's executions
    assert ncu_source_table.opcode("@!P0  BRA 0x90") == "BRA"
    assert ncu_source_table.opcode("LDGSTS.E.BYPASS.128 [R2], desc[UR4][R4.64]") == "LDGSTS"
    total, mix = ncu_source_table.instruction_mix(rows, 1, 4)
    assert total == 210 and mix == [("LDGSTS", 200 / 210), ("USETMAXREG", 10 / 210)]
    monkeypatch.setattr(sys, "argv", ["ncu_source_table.py", str(path), "--top", "2"])
    ncu_source_table.main()
    out = capsys.readouterr().out
    assert "excess  16.0" in out and "rows 4-6: 40 samples: barrier 75%, long_sb 25%" in out
    assert "rows 1-4: 210: LDGSTS 95.2%, USETMAXREG 4.8%" in out


def test_tree_ab_exports_revisions_and_directories_and_refuses_without_a_gpu(tmp_path, monkeypatch):
    """benchmarks/ab_trees_prefill_hopper.py: a git revision is exported to its own ``src``, a
    directory holding ``src/`` is used as it is, and without a CUDA GPU the run stops with a
    clear message before any tree is compiled."""
    ab = _script("ab_trees_prefill_hopper")
    src = ab.export("HEAD", tmp_path)
    assert (src / "int8attn" / "kernels" / "prefill_hopper_pipe.py").is_file()
    assert src.parent.parent == tmp_path
    assert ab.export(str(ab.REPO), tmp_path) == ab.REPO / "src"
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        ab.main(["--trees", "HEAD,HEAD", "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_decode_timeline_reads_one_call_from_its_stamps(tmp_path, monkeypatch):
    """benchmarks/timeline_decode.py: one call's figures (µs, from the previous call's last
    store) out of its split and merge programs' stamp rows (ns; -1 not written: a split program
    that left early has no tiles or stores, and takes no part in the per-program figures), the
    tiles also split by whether a program's SM ran another one; its points with an optional
    split count; without a CUDA GPU the script stops with a clear message."""
    import torch
    timeline = _script("timeline_decode")
    # rows: start, metadata, tiles, stored, SM (split); start, waited, stored, SM (merge)
    split = torch.tensor([[1000, 1600, 5600, 5900, 3], [1100, 1700, -1, -1, 7], [1300, 1800, 6800, 7000, 3]])
    merge = torch.tensor([[2000, 7100, 7900, 1], [2100, 7200, 8100, 2]])
    assert timeline.last_store(split, merge) == 8100 and timeline.last_store(split, None) == 7000
    assert timeline.first_start(split) == 1000
    got = timeline.summarize(split, merge, prev_end=400, next_start=9400)
    assert got == {"programs": 3, "active_programs": 2, "sms": 2, "launch_us": 0.6, "ramp_us": 0.3,
                   "metadata_us": 0.55, "metadata_max_us": 0.6, "tiles_us": 4.5, "tiles_max_us": 5.0,
                   "tiles_sole_us": None, "tiles_shared_us": 4.5, "store_us": 0.25, "store_max_us": 0.3,
                   "split_end_us": 6.6, "merge_programs": 2, "merge_start_us": 1.6, "merge_waited_us": 6.8,
                   "merge_end_us": 7.7, "period_us": 8.4}, got
    assert "merge_start_us" not in timeline.summarize(split, None, 400, None)
    # programs by their SM: the first alone on SM 5, the other two sharing SM 3
    apart = split.clone()
    apart[1] = torch.tensor([1100, 1700, 3700, 3800, 3])
    apart[0, 4] = 5
    got = timeline.summarize(apart, None, 400, None)
    assert (got["tiles_sole_us"], got["tiles_shared_us"]) == (4.0, 3.5), got
    assert [timeline.parse_point(p) for p in ("1x8192", "16x8192s4")] == [(1, 8192, None), (16, 8192, 4)]
    with pytest.raises(SystemExit, match="bad point"):
        timeline.parse_point("1x8192x4")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        timeline.main(["--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()
