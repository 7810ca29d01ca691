"""What every benchmark script shares: device mode, the command line, a run with sections
under a deadline, logging, JSON rows, the parallel precompile pool, the SASS summary of a
compiled kernel, per-kernel device times, optional peers and the closing summary.

A script is setup + cases::

    import _harness as H
    SMOKE = "--smoke" in sys.argv
    INTERPRET = H.start(SMOKE)           # before anything imports the int8attn kernels
    ...
    @H.section("grid")
    def grid(run): ...

    args = H.parser("decode", sections=SECTIONS, budget_s=200).parse_args()
    run = H.Run("decode", args.out, deadline_s=args.budget_s, interpret=INTERPRET)
    H.attempt(run, "setup", setup, run)  # logged, timed, a failure recorded, the run goes on
    H.run_sections(run, SECTIONS, args.skip)
    H.finish(run, "decode_summary.md", lambda: summary(run))

Timing and recording primitives are :mod:`int8attn.bench` (shared with the gate); optional
peer libraries are :mod:`_peers` (:func:`peer` runs one and records why it is missing).
Nothing here asserts a timing. Under the interpreter (no GPU) a "time" is one call's wall
clock: it only proves the code path runs.

Nothing from int8attn is imported at module level: :func:`start` must run first, because
Triton decides interpreter vs compiler when a kernel module is imported.
"""

from __future__ import annotations

import argparse
import functools
import os
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Callable, Iterable

import torch


def start(smoke: bool) -> bool:
    """Pick the device mode; returns True for the Triton interpreter on the CPU. Without a
    GPU (or with TRITON_INTERPRET=1 already set) only ``--smoke`` sizes can run."""
    interpret = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") or not torch.cuda.is_available()
    if interpret:
        if not smoke:
            raise SystemExit("no GPU (or TRITON_INTERPRET=1): only --smoke runs, under the Triton interpreter")
        os.environ["TRITON_INTERPRET"] = "1"
    return interpret


# --------------------------------------------------------------------------- command line
def parser(name: str, *, sections: Iterable = (), quick: bool = False, out_default: str | None = None,
           out_help: str | None = None, smoke_help: str | None = None, budget_s: float = 200,
           budget_env: str | None = None) -> argparse.ArgumentParser:
    """The options every script takes, to which it adds its own: ``--out DIR``, ``--smoke``,
    ``--budget-s`` (start no new section after this many seconds; its default is
    ``budget_s``, or the environment variable ``budget_env`` where set), ``--quick`` where
    ``quick``, and ``--skip a,b`` (parsed to a set of names) where the script has
    ``sections`` (:func:`section` functions)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=out_default,
                    help=out_help or f"directory for {name}.jsonl, the summary and the log")
    ap.add_argument("--smoke", action="store_true",
                    help=smoke_help or "toy sizes, every section and peer (CPU: interpreter)")
    if quick:
        ap.add_argument("--quick", action="store_true", help="fewer points (about half the time)")
    default = float(os.environ.get(budget_env, budget_s)) if budget_env else budget_s
    ap.add_argument("--budget-s", type=float, default=default,
                    help="start no new section after this many seconds"
                         + (f" (default: ${budget_env} or {budget_s:g})" if budget_env else ""))
    names = [s.section for s in sections]

    def skip_list(value: str) -> set:
        # a misspelt name would silently run the section it meant to skip (device time)
        chosen = set(filter(None, value.split(",")))
        if chosen - set(names):
            raise argparse.ArgumentTypeError(f"no section named {','.join(sorted(chosen - set(names)))} "
                                             f"(sections: {','.join(names)})")
        return chosen

    if names:
        ap.add_argument("--skip", default="", type=skip_list,
                        help="comma list of sections to skip: " + ",".join(names))
    return ap


# --------------------------------------------------------------------------- run, sections
class Run:
    """State of one benchmark run: JSON rows (``<out>/<name>.jsonl``, else
    ``benchmarks/results/<name>.jsonl``), the log (``<out>/<name>_log.txt``, written as it
    goes so a killed run keeps it), the deadline and the timers."""

    def __init__(self, name: str, out_dir: str | os.PathLike | None, *, deadline_s: float, interpret: bool):
        from int8attn.bench import Recorder

        self.name = name
        self.out_dir = Path(out_dir) if out_dir else None
        if self.out_dir:
            self.out_dir.mkdir(parents=True, exist_ok=True)
        self.rec = Recorder(name, path=self.out_dir / f"{name}.jsonl" if self.out_dir else None)
        self._log = open(self.out_dir / f"{name}_log.txt", "a") if self.out_dir else None
        self.deadline_s = deadline_s
        self.interpret = interpret
        self.device = "cpu" if interpret else "cuda"
        self.t0 = time.time()
        self.rows: list[dict] = []   # every row of this run, for the summary
        self.unavailable: set[str] = set()   # peers found missing (see peer)

    @property
    def env(self) -> dict:
        return self.rec.env

    def log(self, *parts) -> None:
        msg = " ".join(str(p) for p in parts)
        print(msg, flush=True)
        if self._log:
            self._log.write(msg + "\n")
            self._log.flush()

    def row(self, **fields) -> dict:
        """Record one JSON row (environment added) and append it to the file at once
        (:meth:`Recorder.save` appends the rows not saved yet)."""
        full = self.rec.add(**fields)
        self.rows.append(full)
        try:
            self.rec.save()
        except Exception as e:  # never lose the run over a write error
            self.log(f"row save failed: {e!r}")
        return full

    def elapsed(self) -> float:
        return time.time() - self.t0

    def late(self, what: str) -> bool:
        """True (logged and recorded) once the deadline has passed: skip ``what``."""
        if self.elapsed() > self.deadline_s:
            self.log(f"deadline ({self.deadline_s:.0f}s): skipping {what}")
            self.row(kind="skipped", section=what, elapsed_s=self.elapsed())
            return True
        return False

    def sync(self) -> None:
        if not self.interpret:
            torch.cuda.synchronize()

    def time(self, fn: Callable[[], object], graph: bool = False, *, rep_ms: float = 60, replays: int = 30,
             repeats: int = 9) -> float:
        """Median µs per call: CUDA-graph replay (``graph``) or eager CUDA events with L2
        flushed; under the interpreter one call's wall clock (meaningless as a timing)."""
        from int8attn import bench

        if self.interpret:
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e6
        if graph:
            return bench.time_graph(fn, replays=replays, repeats=repeats)
        return bench.time_eager(fn, warmup_ms=10, rep_ms=rep_ms)

    def write(self, filename: str, text: str) -> None:
        if self.out_dir:
            (self.out_dir / filename).write_text(text)


def attempt(run: Run, name: str, fn: Callable, *args, **kwargs):
    """``fn(*args, **kwargs)`` as one section: timed and logged; a failure is logged and
    recorded (a ``section_failed`` row), returns None, and the run goes on."""
    t = time.time()
    try:
        return fn(*args, **kwargs)
    except Exception as e:
        run.log(f"SECTION {name} FAILED: {e!r}")
        traceback.print_exc()
        run.row(kind="section_failed", section=name, error=repr(e)[:500])
        return None
    finally:
        run.log(f"-- {name} done in {time.time() - t:.1f}s (total {run.elapsed():.1f}s)")


def section(name: str):
    """Decorator: ``fn(run)`` becomes ``fn(run, skip=())``, skipped when ``name`` is in
    ``skip`` or the deadline has passed (a ``skipped`` row), else run by :func:`attempt`."""
    def wrap(fn):
        @functools.wraps(fn)
        def run_section(run: Run, skip: Iterable[str] = ()):
            if name in skip or run.late(name):
                return None
            return attempt(run, name, fn, run)
        run_section.section = name
        return run_section
    return wrap


def run_sections(run: Run, sections: Iterable, skip: Iterable[str] = ()) -> None:
    """Every :func:`section` in order; a name in ``skip`` that is no section's is logged
    (and skips nothing)."""
    sections = list(sections)
    unknown = set(skip) - {s.section for s in sections}
    if unknown:
        run.log(f"--skip: no section named {','.join(sorted(unknown))} "
                f"(sections: {','.join(s.section for s in sections)})")
    for sec in sections:
        sec(run, skip)


def finish(run: Run, filename: str, make: Callable[[], str]) -> None:
    """The closing Markdown summary ``make()``: logged and written to ``<out>/<filename>``
    (a failure is only logged: every row is already saved); then the run's total time."""
    try:
        text = make()
        run.log("==== summary ====\n" + text)
        run.write(filename, text)
    except Exception as e:
        run.log(f"summary failed: {e!r}")
    run.log(f"total {run.elapsed():.1f}s")


# --------------------------------------------------------------------------- precompile pool
def _timed_job(worker: Callable, job) -> tuple:
    t = time.time()
    try:
        label = worker(job)
        return label, round(time.time() - t, 1), None
    except Exception as e:  # reported; the main process compiles it again on first use
        return repr(job)[:120], round(time.time() - t, 1), repr(e)[:300]


def precompile(run: Run, worker: Callable, jobs: list, workers: int | None = None) -> None:
    """Run ``worker(job)`` for every job in spawned worker processes so every kernel variant
    lands in Triton's on-disk cache in parallel; the main process then only loads them.
    ``worker`` is a module-level function of the script (it must pickle) that runs one
    variant once on toy inputs with the same specialization and returns a label. Skipped
    under the interpreter (nothing to compile)."""
    if run.interpret or not jobs:
        return
    import concurrent.futures as cf
    import multiprocessing as mp

    t0 = time.time()
    workers = min(len(jobs), workers or max(1, (os.cpu_count() or 4) - 2))
    try:
        with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
            for label, secs, err in ex.map(functools.partial(_timed_job, worker), jobs):
                if err:
                    run.log(f"  precompile {label}: {err}")
    except Exception as e:  # a broken pool costs only parallelism
        run.log(f"precompile pool failed {e!r} (kernels compile on first use)")
    run.log(f"precompiled {len(jobs)} variants with {workers} processes in {time.time() - t0:.1f}s")


# --------------------------------------------------------------------------- kernels that ran
def launched(kernel: str):
    """The compiled kernel of the latest launch of ``kernel`` (:mod:`int8attn.launches`);
    None before one and under the interpreter."""
    from int8attn import launches

    rec = launches.last(kernel)
    return rec.compiled if rec is not None else None


def kernel_times(fn: Callable[[], object], match: str, calls: int = 50, warmup: int = 5) -> dict[str, float]:
    """Median device time (µs) of every CUDA kernel whose name contains ``match``, over
    ``calls`` eager calls of ``fn`` after ``warmup`` (torch profiler); GPU only."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    per_kernel: dict[str, list] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and match in ev.name:
            per_kernel.setdefault(ev.name, []).append(ev.device_time)
    return {k: sorted(v)[len(v) // 2] for k, v in per_kernel.items()}


# --------------------------------------------------------------------------- SASS
_MIX = {"LDL_STL": ("LDL", "STL"), "MUFU": ("MUFU",), "BAR": ("BAR",), "STS": ("STS",), "PRMT": ("PRMT",)}
_OPS = ("LDS.U8", "STS.U8", "LDL", "STL", "LDGSTS", "LDG.E")


def sass_summary(kernel, min_loop: int = 100) -> dict:
    """What the compiled Triton kernel really is, from its cubin (cuobjdump via
    :mod:`int8attn.gate.sass`): matrix instructions and their classes, conversions,
    registers, spills, shared memory, warps, stages, the memory-op counts, ``loop_instr``
    (instructions of each loop longer than ``min_loop``, in program order: a tile loop per
    entry) and the instruction mix of the two largest loops (``main_loop``: the shorter,
    ``diagonal_loop``: the longer -- the unmasked and the masked KV loop of prefill)."""
    from int8attn.gate import sass

    meta = getattr(kernel, "metadata", None)
    info = {"n_regs": getattr(kernel, "n_regs", None), "n_spills": getattr(kernel, "n_spills", None),
            "shared_bytes": getattr(meta, "shared", None), "num_warps": getattr(meta, "num_warps", None),
            "num_stages": getattr(meta, "num_stages", None)}
    try:
        text = sass.sass_of_compiled(kernel)
        counts = sum(sass.parse_sass(text).values(), Counter())
        cls = sass.classify(counts)
        info.update(mma=cls["mma"], classes=cls["classes"], convert=sum(cls["convert"].values()))
        info["ops"] = {p: sum(n for op, n in counts.items() if op.startswith(p)) for p in _OPS}
        info["count_LDL_STL"] = info["ops"]["LDL"] + info["ops"]["STL"]
        bodies = sass.loops(text)
        info["loop_instr"] = [len(b) for b in bodies if len(b) > min_loop]
        for tag, body in zip(("main_loop", "diagonal_loop"), sorted(sorted(bodies, key=len)[-2:], key=len)):
            info[tag] = {"instructions": len(body), "mma": sum(op.split(".")[0] in sass.MMA_OPCODES for op in body),
                         **{k: sum(op.startswith(p) for op in body) for k, p in _MIX.items()}}
    except Exception as e:
        info["sass_error"] = repr(e)[:200]
    return info


# --------------------------------------------------------------------------- peers
def peer(run: Run, name: str, call: Callable[[], dict], label: str, *, fields: dict | None = None,
         failed: dict | None = None, error_chars: int = 500) -> dict | None:
    """One optional peer (:mod:`_peers`): ``call()``'s result, or None with the reason
    recorded -- a ``peer_unavailable`` row (``reason``; ``name`` joins ``run.unavailable``)
    when it is not installed or cannot run here, a ``peer_failed`` row (``error``, at most
    ``error_chars``) when it raised. ``fields`` go into both rows, ``failed`` into the
    failure row only; the caller records the result row."""
    import _peers as P

    try:
        return call()
    except P.Unavailable as e:
        run.log(f"{label} {name}: {e}")
        run.unavailable.add(name)
        run.row(kind="peer_unavailable", peer=name, reason=str(e)[:300], **(fields or {}))
    except Exception as e:
        run.log(f"{label} {name} FAILED {e!r}"[:600])
        run.row(kind="peer_failed", peer=name, error=repr(e)[:error_chars], **(fields or {}), **(failed or {}))
    return None


# --------------------------------------------------------------------------- summary
def fmt(x, f: str = "{:.1f}", missing: str = "–") -> str:
    """A number for a Markdown table; ``missing`` when None."""
    return missing if x is None else f.format(x)


def table(header: Iterable, rows: Iterable[Iterable]) -> list[str]:
    """Markdown table lines: the header, its rule, one line per row (cells as str)."""
    header = [str(h) for h in header]
    return (["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])
