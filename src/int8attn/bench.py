"""The one timing and recording harness, used by benchmarks/ scripts and the gate.

* :func:`time_eager` / :func:`time_graph` -- median of many runs (CUDA events through
  ``triton.testing.do_bench`` / CUDA-graph replay), in microseconds.
* :func:`interleaved_us` / :func:`per_call_us` -- host time to issue a call and wall time
  per call of eager loops (host cost, not GPU time).
* :func:`copy_bandwidth` -- measured device-to-device copy bandwidth (bytes read + written
  per second), the ceiling memory-bound kernels are compared against.
* :func:`environment` and :class:`Recorder` -- every figure is stored as a JSON row with
  GPU name, torch/Triton versions, date and the command that produced it.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

RESULTS_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


#: The command recorded in every row and report; None -> the interpreter's own argv.
#: Console entry points set it to the command as the user typed it (see set_command).
_COMMAND: str | None = None


def set_command(command: str | None) -> None:
    """Record ``command`` (e.g. ``"int8attn gate --size tiny"``) as the command of every
    later :func:`environment`, instead of ``python <argv>``."""
    global _COMMAND
    _COMMAND = command


def source_commit() -> str | None:
    """The commit of the int8attn source that runs: ``INT8ATTN_COMMIT`` when the caller set
    it (a copied tree, as on a lent GPU machine, whose git metadata may be missing or
    stale), else the git commit of its checkout (``+dirty`` when ``src`` has uncommitted
    changes), else None."""
    import subprocess

    root = Path(__file__).resolve().parents[2]
    given = os.environ.get("INT8ATTN_COMMIT")
    if given:
        return given
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no", "--", "src"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty else "")


def environment() -> dict:
    import triton

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none (CPU)"
    return {
        "gpu": gpu,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": _COMMAND or " ".join([os.path.basename(sys.executable)] + sys.argv),
        "interpreter": os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
        "commit": source_commit(),
    }


class Recorder:
    """Collects result rows and appends them as JSON lines to ``benchmarks/results/<name>.jsonl``
    (or ``path``). Each row carries :func:`environment`. :meth:`save` appends the rows not
    saved yet, so a script that may be stopped by a deadline saves after every row."""

    def __init__(self, name: str, path: str | os.PathLike | None = None):
        self.env = environment()
        self.path = Path(path) if path else RESULTS_DIR / f"{name}.jsonl"
        self.rows: list[dict] = []
        self._saved = 0

    def add(self, **row) -> dict:
        full = {**row, **self.env}
        if row.get("commit"):  # a row that names its commit keeps it
            full["commit"] = row["commit"]
        self.rows.append(full)
        return full

    def save(self) -> Path:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            for row in self.rows[self._saved:]:
                f.write(json.dumps(row, sort_keys=True) + "\n")
        self._saved = len(self.rows)
        return self.path


def time_eager(fn: Callable[[], object], warmup_ms: float = 25, rep_ms: float = 200) -> float:
    """Median time of ``fn()`` in microseconds (CUDA events; L2 flushed between runs)."""
    import triton.testing

    return 1e3 * triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def time_graph(fn: Callable[[], object], replays: int = 50, repeats: int = 15, warmup: int = 3,
               after_replay: Callable[[], object] | None = None) -> float:
    """Median time per call in microseconds when ``fn`` is captured in a CUDA graph
    ``replays`` times back to back (after ``warmup`` eager calls) and the graph is replayed
    ``repeats`` times; ``after_replay`` is called after each timed replay, outside the
    timing (to read what the replay wrote)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(replays):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / replays)
        if after_replay is not None:
            after_replay()
    del graph
    return statistics.median(times)


def time_queued(fn: Callable[[], object], calls: int = 100, repeats: int = 5) -> tuple[float, bool]:
    """GPU time per eager call in microseconds, host cost hidden: ``calls`` calls are issued
    while the stream is held by a sleep kernel longer than issuing them takes, and timed
    between events recorded after the sleep and after the last call -- the launches run
    back to back, gaps between them included, as a GPU-bound eager loop runs them
    (CUDA-graph replays skip those gaps). Returns (median, queued): ``queued`` False when
    the GPU reached the calls before the host had issued them all in some repeat (then
    the figure includes host time)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    issue_s = time.perf_counter() - t0
    torch.cuda.synchronize()
    cycles = int(3 * issue_s * 2.0e9) + 1_000_000  # 3x the issue time at a 2 GHz SM clock
    times, queued = [], True
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(cycles)
        start.record()
        for _ in range(calls):
            fn()
        queued &= not start.query()  # the GPU was still asleep when the last call was issued
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times), queued


def interleaved_us(fns: dict, n: int, repeats: int, sync) -> dict:
    """{name: (host_us, wall_us)} as :func:`per_call_us` measures them, with the loops of
    every call interleaved round by round: the host's speed drifts by tens of percent over
    a run on the GPU box, so only calls timed side by side compare."""
    for fn in fns.values():
        for _ in range(max(3, n // 10)):
            fn()
    host = {name: [] for name in fns}
    wall = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            sync()
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            t1 = time.perf_counter()
            sync()
            t2 = time.perf_counter()
            host[name].append((t1 - t0) / n * 1e6)
            wall[name].append((t2 - t0) / n * 1e6)
    return {name: (statistics.median(host[name]), statistics.median(wall[name])) for name in fns}


def per_call_us(fn, n: int, repeats: int, sync) -> tuple[float, float]:
    """(host_us, wall_us) per call, medians over ``repeats`` loops of ``n`` calls: host =
    until the last call returned, wall = until the device finished too."""
    return interleaved_us({"call": fn}, n, repeats, sync)["call"]


_COPY_BW: dict[str, float] = {}


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted), measured once."""
    key = torch.cuda.get_device_name()
    if key not in _COPY_BW:
        src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
        src.random_(0, 255)
        dst = torch.empty_like(src)
        us = time_eager(lambda: dst.copy_(src), rep_ms=300)
        _COPY_BW[key] = nbytes / (us * 1e-6)
        del src, dst
    return _COPY_BW[key]
