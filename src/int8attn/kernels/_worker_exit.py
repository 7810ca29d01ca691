"""Worker partitions that exit instead of looping back: a PTX rewrite that lets ptxas keep a
worker's wgmma in flight.

Triton lowers ``gl.warp_specialize`` to a dispatch loop: the worker warps wait at a CTA
barrier, read their partition's state from shared memory, run that partition, meet the
default partition at the region's closing barrier and loop back to wait for the next state
(another region, or exit). ptxas (12.8, Triton 3.6's, and 13.5 alike) serialises every wgmma of
a kernel in which a worker partition keeps a wgmma in flight across its own loop's iterations
*inside that dispatch loop* (C7512, "insufficient register resources"); the same PTX with the
worker's back edge gone keeps it in flight. A kernel with one ``warp_specialize`` region sends
its workers exactly one state after the region -- exit -- so :func:`rewrite` replaces the back
edge at the end of each worker partition by the barrier that the loop header would meet next
and a jump to the exit: the same barrier sequence, no loop. Kernels ask for it by emitting
:data:`MARK` (:func:`int8attn.kernels.prefill_hopper_ws._mark_worker_exit`); PTX without it,
any other kernel's, passes through unchanged.

:func:`install` adds the rewrite to Triton's compile pipeline (``knobs.runtime.
add_stages_inspection_hook``, chained after a hook already there). Triton 3.8+ also asks the
hook for a cache key (the hook is called with no arguments), at every compile and at every
launch through Triton's JIT dispatch: once installed, every kernel the process compiles gets
a key of its own (one more compile each, then cached on disk), and a JIT launch a Python call
more. 3.6 does not ask, so the mark lives in the kernel source (a kernel built before the hook
existed has another cache key) and launchers install the hook before compiling a marked
kernel -- only configs that keep PV in flight in worker partitions do (``kernel_fn``). Under
3.6 a marked kernel compiled in a process that never installed the hook (the Gluon kernel
called directly, not through ``kernel_fn``) is cached with its wgmma serialised, and later
processes load that entry: compile marked kernels through ``kernel_fn`` only.
"""

from __future__ import annotations

import re

#: A PTX comment the kernel emits (inline asm) where its workers may exit.
MARK = "int8attn:worker-exit"
#: Part of Triton 3.8+'s cache key for kernels compiled while the hook is installed.
_KEY = "int8attn-worker-exit-1"

_LABEL = re.compile(r"^(\$L__BB\d+_\d+):")
_STATE_LOAD = re.compile(r"^\s*ld\.shared\.b8\s+(%r\w+),")
_STATE_TEST = re.compile(r"^\s*setp\.eq\.b16\s+(%p\d+),\s*(%r\w+),\s*(\d+);")
_BRANCH = re.compile(r"^\s*@(%p\d+)\s+bra\s+(\$L__BB\d+_\d+);")
_TABLE = re.compile(r"^\s*(\$L_brx_\d+):\s*\.branchtargets")
_BACK_EDGE = re.compile(r"^\s*bra\.uni\s+(\$L__BB\d+_\d+);")
_STATE_STORE = re.compile(r"^\s*st\.shared(?:\.v\d)?\.b32\s+\[global_smem\+\d+\],\s*(?:\{([\d,\s]+)\}|(\d+));")


def _code(line: str) -> str:
    """The line without comments and ``.loc`` directives ('' if nothing else is on it)."""
    line = line.split("//")[0].strip()
    return "" if line.startswith(".loc") else line


def _last_code(lines: list) -> str:
    """The last line of ``lines`` that holds an instruction ('' if none)."""
    return next((c for c in (_code(x) for x in reversed(lines)) if c), "")


def _dispatch(lines: list, load: int) -> dict:
    """{state: label} of the worker dispatch after the state load at ``lines[load]``: a chain
    of ``setp.eq`` tests and branches (Triton 3.6 - 3.9 with two workers) or a ``brx.idx``
    jump table (three or more)."""
    reg = _STATE_LOAD.match(lines[load]).group(1)
    targets = {}
    for i in range(load + 1, min(load + 40, len(lines))):
        table = _TABLE.match(lines[i])
        if table:
            labels = []
            for line in lines[i + 1:i + 20]:
                labels += re.findall(r"\$L__BB\d+_\d+", line)
                if line.rstrip().endswith(";"):
                    break
            return dict(enumerate(labels))
        test = _STATE_TEST.match(lines[i])
        if test and test.group(2) == reg:
            branch = next((_BRANCH.match(x) for x in lines[i + 1:i + 4] if _BRANCH.match(x)), None)
            if branch is None or branch.group(1) != test.group(1):
                raise ValueError(f"{MARK}: a worker-state test without its branch")
            targets[int(test.group(3))] = branch.group(2)
        elif _BACK_EDGE.match(lines[i]):
            break
    return targets


def rewrite(ptx: str) -> str:
    """The PTX with each worker partition's jump back to the dispatch loop replaced by the
    next dispatch barrier and a jump to the exit; unchanged without :data:`MARK`. Raises
    ``ValueError`` where a marked kernel's dispatch is not the shape this handles (one state
    load, states 0 .. n with n the exit, one region's states published once)."""
    if MARK not in ptx:
        return ptx
    lines = ptx.split("\n")
    loads = [i for i, line in enumerate(lines) if _STATE_LOAD.match(line)]
    if len(loads) != 1:
        raise ValueError(f"{MARK}: expected one worker-state load in the PTX, found {len(loads)}")
    header = next((_LABEL.match(lines[i]).group(1) for i in range(loads[0], -1, -1) if _LABEL.match(lines[i])),
                  None)
    targets = _dispatch(lines, loads[0])
    if header is None or len(targets) < 2 or sorted(targets) != list(range(len(targets))):
        raise ValueError(f"{MARK}: unexpected worker dispatch (header {header}, states {sorted(targets)})")
    exit_state = max(targets)
    exit_word = int.from_bytes(bytes([exit_state] * 4), "little")
    # one region: the states other than exit are published by one run of stores
    stores = ((i, _STATE_STORE.match(line)) for i, line in enumerate(lines))
    publishing = [i for i, m in stores if m and any(int(v) != exit_word for v in (m.group(1) or m.group(2)).split(","))]
    if not publishing or publishing[-1] - publishing[0] > 4:
        raise ValueError(f"{MARK}: the rewrite handles kernels with one warp_specialize region")
    out, edges = [], 0
    for line in lines:
        edge = _BACK_EDGE.match(line)
        if edge and edge.group(1) == header and _last_code(out).startswith("setmaxnreg.dec"):
            out.append("\tbarrier.sync \t1;")
            out.append(f"\tbra.uni \t{targets[exit_state]};")
            edges += 1
            continue
        out.append(line)
    if edges == 0:
        raise ValueError(f"{MARK}: no worker partition ends with a jump back to the dispatch loop")
    return "\n".join(out)


def _hook(previous):
    def hook(*args):
        if not args:  # Triton 3.8+: the cache key of this pipeline
            key, digest = previous() if previous is not None else ("", "")
            return key + _KEY, digest + _KEY
        backend, stages, options, language, capability = args
        if previous is not None:
            previous(*args)
        if "ptx" in stages:
            make_ptx = stages["ptx"]
            stages["ptx"] = lambda src, metadata: rewrite(make_ptx(src, metadata))

    hook.int8attn_worker_exit = True
    return hook


def install() -> bool:
    """Add :func:`rewrite` to Triton's compile pipeline once per process (idempotent); False
    where this Triton has no stage hook (the marked kernels then compile as Triton emits them:
    correct, with their in-flight wgmma serialised by ptxas)."""
    from triton import knobs

    if not hasattr(knobs.runtime, "add_stages_inspection_hook"):
        return False
    current = knobs.runtime.add_stages_inspection_hook
    if not getattr(current, "int8attn_worker_exit", False):
        knobs.runtime.add_stages_inspection_hook = _hook(current)
    return True
