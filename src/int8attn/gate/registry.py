"""The gate's experiments, by key.

An experiment is a module with ``KEY``, ``TITLE``, ``CLAIM``, ``availability(ctx)``
(None when it can run, else a one-line reason such as "not available yet: ...") and
``run(ctx) -> ExperimentResult``. Modules load lazily, so an experiment whose kernels are
not in the tree (or fail to import) is reported as unavailable instead of breaking the
others. :func:`register` adds one (e.g. from a plugin or a test).
"""

from __future__ import annotations

import importlib

EXPERIMENTS: dict[str, str] = {
    "E1": "int8attn.gate.e1_gemm",
    "E2": "int8attn.gate.e2_fp8_decode",
    "E3": "int8attn.gate.e3_qk",
    "E4": "int8attn.gate.e4_attention",
}


def register(key: str, module: str) -> None:
    """Add (or replace) experiment ``key`` implemented by importable ``module``."""
    if not key or not isinstance(key, str):
        raise ValueError(f"experiment key must be a non-empty string, got {key!r}")
    EXPERIMENTS[key] = module


def keys() -> list[str]:
    return list(EXPERIMENTS)


def load(key: str):
    """Import experiment ``key``'s module (raises KeyError for an unknown key)."""
    if key not in EXPERIMENTS:
        raise KeyError(f"unknown experiment {key!r}; known: {', '.join(EXPERIMENTS)}")
    return importlib.import_module(EXPERIMENTS[key])


def parse_selection(text: str | None) -> list[str]:
    """"E1,E3" / "e1 e3" / "all" / None -> validated keys in registry order."""
    if text is None or text.strip().lower() in ("", "all"):
        return keys()
    wanted = [t.strip().upper() for t in text.replace(" ", ",").split(",") if t.strip()]
    unknown = [w for w in wanted if w not in EXPERIMENTS]
    if unknown:
        raise ValueError(f"unknown experiment(s) {', '.join(unknown)}; known: {', '.join(EXPERIMENTS)}")
    return [k for k in EXPERIMENTS if k in wanted]
