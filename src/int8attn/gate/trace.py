"""Prove which GPU kernels a call launched (docs/design.md §5 item 4, runtime half).

A binary that *contains* the intended instruction proves nothing if the call is routed to
another kernel. :func:`launched_kernels` runs the call under ``torch.profiler`` (CUPTI)
and returns the names of the device kernels it launched, in order; :func:`match` checks a
kernel name (exact, for our Triton kernels) or a pattern (for library kernels) against them.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Callable

import torch

_NOT_KERNELS = re.compile(r"^(Memcpy|Memset|cuda|Context Sync|Activity Buffer|Event)", re.I)


def launched_kernels(fn: Callable[[], object], repeats: int = 1) -> dict:
    """Run ``fn`` ``repeats`` times under the profiler.

    Returns ``{"status": "ok" | "skipped", "kernels": [names in launch order, first call
    only], "counts": {name: launches over all repeats}, "note": str}``.
    """
    if not torch.cuda.is_available():
        return {"status": "skipped", "kernels": [], "counts": {}, "note": "no GPU: no kernel trace"}
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    events = []
    for evt in prof.events():
        dev = getattr(evt, "device_type", None)
        if dev is None or "CUDA" not in str(dev):
            continue
        if _NOT_KERNELS.match(evt.name):
            continue
        start = getattr(evt, "time_range", None)
        events.append((start.start if start is not None else 0, evt.name))
    events.sort()
    names = [name for _, name in events]
    counts = Counter(names)
    per_call = len(names) // max(repeats, 1)
    return {"status": "ok", "kernels": names[:per_call] if repeats > 1 else names, "counts": dict(counts), "note": ""}


def match(trace: dict, kernel: str, pattern: bool = False) -> list[str]:
    """Kernel names in ``trace`` naming ``kernel`` (exactly, or followed by a compiler
    suffix such as ``_0d1d``), or matching it as a regex when ``pattern``."""
    names = trace.get("kernels", [])
    if pattern:
        rx = re.compile(kernel, re.I)
        return [n for n in names if rx.search(n)]
    rx = re.compile(rf"^{re.escape(kernel)}(?:_[0-9a-z]+)?$")
    return [n for n in names if rx.match(n)]
