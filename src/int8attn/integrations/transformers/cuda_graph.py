"""CUDA-graph capture and replay of one decode step (see :class:`CUDAGraphDecoder`)."""

from __future__ import annotations

import torch

from .cache import Int8PagedCache
from .registry import cache_argument_name


class CUDAGraphDecoder:
    """One decode step (one new token for each of ``batch_size`` sequences) of a causal LM,
    captured in a CUDA graph and replayed.

    Works with :class:`Int8PagedCache` (the host allocates pages and refills the static
    metadata before each replay; the captured kernels read it) and with transformers'
    ``StaticCache`` (its write position is a device counter advanced inside the graph).
    The prompt must already be in the cache (an eager prefill).

    ``step(input_ids [B, 1], position_ids [B, 1])`` -> logits [B, vocab] (a static buffer,
    overwritten by the next step).

    A ``StaticCache`` write past ``max_cache_len`` would be a device-side assert that ends the
    CUDA context, so the decoder reads the write position once at capture, counts replays on
    the host and refuses (``ValueError``) a step that would not fit; after eager steps on the
    same cache, call :meth:`sync_length` to re-read the position.
    """

    def __init__(self, model, cache, batch_size: int, warmup: int = 2):
        if not torch.cuda.is_available():
            raise RuntimeError("CUDA graphs need a CUDA device")
        self.model = model
        self.cache = cache
        self.batch_size = batch_size
        self.warmup = warmup
        self.graph = None
        device = next(model.parameters()).device
        self.input_ids = torch.zeros((batch_size, 1), dtype=torch.long, device=device)
        self.position_ids = torch.zeros((batch_size, 1), dtype=torch.long, device=device)
        self.logits = None
        self._cache_kw = cache_argument_name(model)
        self._paged = isinstance(cache, Int8PagedCache)
        self._static_length: int | None = None  # host copy of a StaticCache's write position
        self._static_capacity: int | None = None

    def sync_length(self) -> None:
        """Re-read a ``StaticCache``'s write position (one host sync); no-op for
        :class:`Int8PagedCache`, whose lengths live on the host."""
        if self._paged:
            return
        lengths, capacities = [], []
        for layer in self.cache.layers:
            length = getattr(layer, "cumulative_length", None)
            if isinstance(length, torch.Tensor):
                lengths.append(int(length))
            capacity = getattr(layer, "max_cache_len", None)
            if isinstance(capacity, int):
                capacities.append(capacity)
        self._static_length = max(lengths) if lengths else None
        self._static_capacity = min(capacities) if capacities else None

    def _check_room(self, num_tokens: int) -> None:
        if self._paged or self._static_length is None or self._static_capacity is None:
            return  # Int8PagedCache.prepare_step checks its own capacity
        if self._static_length + num_tokens > self._static_capacity:
            raise ValueError(
                f"decode step at position {self._static_length} does not fit the cache's "
                f"max_cache_len={self._static_capacity}"
            )

    def _forward(self):
        kwargs = {self._cache_kw: self.cache, "use_cache": True, "logits_to_keep": 1}
        return self.model(input_ids=self.input_ids, position_ids=self.position_ids, **kwargs).logits

    def _undo_one_token(self) -> None:
        if self._paged:
            self.cache.rollback(1)
        else:  # transformers StaticCache: device-side write counters
            for layer in self.cache.layers:
                length = getattr(layer, "cumulative_length", None)
                if isinstance(length, torch.Tensor):
                    length.sub_(1)
                else:
                    raise TypeError(f"cannot roll back cache layer {type(layer).__name__} after a warm-up step")

    @torch.inference_mode()
    def capture(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> None:
        """Capture the step (the warm-up steps run for real and are rolled back)."""
        self.sync_length()
        self._check_room(1)  # the warm-up steps write one position (then roll back)
        self.input_ids.copy_(input_ids)
        self.position_ids.copy_(position_ids)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                if self._paged:
                    self.cache.prepare_step(self.batch_size, 1)
                self._forward()
                self._undo_one_token()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        if self._paged:
            self.cache.prepare_step(self.batch_size, 1)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self._forward()
        if self._paged:
            # Capture ran no kernel: the Python-side lengths advanced, the cache did not.
            self.cache.rollback(1)

    @torch.inference_mode()
    def step(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        if self.graph is None:
            self.capture(input_ids, position_ids)
        self._check_room(1)
        self.input_ids.copy_(input_ids)
        self.position_ids.copy_(position_ids)
        if self._paged:
            self.cache.prepare_step(self.batch_size, 1)
        self.graph.replay()
        if self._paged:
            self.cache.advance(1)
        elif self._static_length is not None:
            self._static_length += 1
        return self.logits[:, -1]

