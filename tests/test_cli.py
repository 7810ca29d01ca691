"""The ``int8attn`` command line: what a user types is what the report records."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from int8attn import bench, cli

needs_cpu_mode = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU (interpreter) mode")
SRC = Path(__file__).resolve().parents[1] / "src"


@needs_cpu_mode
def test_cli_records_the_command_as_typed(tmp_path, capsys):
    out = tmp_path / "r"
    args = ["gate", "--out", str(out), "--experiments", "E1", "--no-plots", "--quiet"]
    assert cli.main(args) == 0
    capsys.readouterr()
    expected = "int8attn " + " ".join(args)
    assert json.loads((out / "report.json").read_text())["env"]["command"] == expected
    assert f"command: `{expected}`" in (out / "report.md").read_text()
    rows = [json.loads(line) for line in (out / "gate.jsonl").read_text().splitlines()]
    assert rows and {r["command"] for r in rows} == {expected}
    assert bench._COMMAND is None  # not left set for later callers


@needs_cpu_mode
def test_cli_relaunch_under_the_interpreter_keeps_arguments_sizes_and_command(tmp_path):
    """Without TRITON_INTERPRET the gate re-launches itself under the interpreter; the
    relaunched run keeps the arguments (also when called from ``python -c``), reports the
    tiny sizes it ran in its titles and records ``int8attn gate ...``."""
    out = tmp_path / "r"
    args = ["gate", "--out", str(out), "--experiments", "E1,E3", "--no-plots", "--quiet", "--no-record"]
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "_INT8ATTN_GATE_REEXEC")}
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", f"from int8attn.cli import main; main({args!r})"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    md = (out / "report.md").read_text()
    assert "command: `int8attn " + " ".join(args) + "`" in md
    assert "## E1 — Dynamic INT8 GEMM vs BF16 (M=48, N=80, K=136, BF16 weights)" in md
    assert "(6q/1kv heads, D=256, T 64/160)" in md
    assert "4096" not in md.split("## E1", 1)[1].split("\n", 1)[0]
    assert "| BF16 torch.matmul (CPU) |" in md and "cuBLAS (torch.matmul)" not in md
    assert "1.000x*" in md
    e1_rows = [r for r in md.split("### E1", 1)[1].split("####", 1)[0].splitlines() if r.startswith("| ")][1:]
    assert len(e1_rows) == 6 and all(r.endswith("| yes (not traced) |") for r in e1_rows)
    assert "yes (not traced)" in proc.stdout
