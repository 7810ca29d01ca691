"""Thin adapters that plug int8attn into engines users already run.

* :mod:`int8attn.integrations.transformers` -- Hugging Face transformers (5.x): an attention
  implementation registered under ``"int8attn"`` and :class:`Int8PagedCache`, a ``Cache``
  that keeps K/V in an INT8 (or FP8 / BF16) :class:`~int8attn.PagedKVCache` and feeds the
  kernels directly. A package: ``cache`` (the Cache), ``attention`` (the attention and mask
  functions), ``paged`` (continuous batching), ``registry`` (``register``), ``cuda_graph``
  (``CUDAGraphDecoder``), ``_common`` (what they share).

Adapters are imported explicitly (``import int8attn.integrations.transformers``) so that the
core package never imports an engine.
"""
