"""The gate's launch tracker: :func:`int8attn.launches.track` (``with track_launches() as
launched:`` collects ``{kernel name: compiled kernel}`` of the block's launches; empty
under the interpreter, which compiles nothing)."""

from __future__ import annotations

from ..launches import track as track_launches

__all__ = ["track_launches"]
