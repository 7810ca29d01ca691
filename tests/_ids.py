"""Readable ids for curated parameter tables: every case is named by its fields."""

from __future__ import annotations

import dataclasses

import pytest
import torch


def _fmt(value) -> str:
    if value is None:
        return "auto"
    if isinstance(value, (list, tuple)):
        return "_".join(_fmt(v) for v in value)
    if isinstance(value, dict):
        return "+".join(f"{k}:{_fmt(v)}" for k, v in value.items())
    if isinstance(value, torch.dtype):
        return str(value).replace("torch.", "")
    if isinstance(value, type):
        return value.__name__
    if dataclasses.is_dataclass(value):
        changed = [f"{f.name}:{_fmt(getattr(value, f.name))}" for f in dataclasses.fields(value)
                   if getattr(value, f.name) != f.default]
        return "+".join(changed) or type(value).__name__
    return str(value)


def cases(argnames: str, rows) -> pytest.MarkDecorator:
    """``@cases("kv,hq,d", [("int8", 8, 64), ...])``: ``pytest.mark.parametrize`` with one
    ``pytest.param`` per row, its id naming every field (``kv=int8,hq=8,d=64``)."""
    names = [n.strip() for n in argnames.split(",")]
    params = []
    for row in rows:
        if len(names) == 1:
            row = (row,)
        params.append(pytest.param(*row, id=",".join(f"{n}={_fmt(v)}" for n, v in zip(names, row))))
    return pytest.mark.parametrize(argnames, params)
