"""PagedKVCache layout and BlockAllocator bookkeeping."""

import pytest
import torch

from _ids import cases
from int8attn.cache import BlockAllocator, PagedKVCache


@cases("kv_dtype,storage", [("int8", torch.int8), ("fp8", torch.float8_e4m3fn),
                                              ("bf16", torch.bfloat16)])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_layout(kv_dtype, storage, head_dim, device):
    cache = PagedKVCache(5, 16, 4, head_dim, kv_dtype=kv_dtype, device=device)
    for t in (cache.key, cache.value_rows):
        assert t.shape == (5, 4, 16, head_dim) and t.dtype == storage
        assert (head_dim * t.element_size()) % 16 == 0
    # each (block, head) page is block_size x head_dim contiguous, rows 16-byte aligned;
    # 8-bit V pages are transposed (keys contiguous), bf16 V pages are not
    assert cache.key.stride() == (4 * 16 * head_dim, 16 * head_dim, head_dim, 1)
    assert cache.value_transposed == (kv_dtype != "bf16")
    if cache.value_transposed:
        assert cache.value.shape == (5, 4, head_dim, 16) and cache.value.is_contiguous()
        assert cache.value.stride() == (4 * 16 * head_dim, 16 * head_dim, 16, 1)
    else:
        assert cache.value.shape == (5, 4, 16, head_dim) and cache.value.is_contiguous()
        assert cache.value_rows.data_ptr() == cache.value.data_ptr()
    # value_rows is a view: a write through it lands in the storage
    cache.value_rows[3, 1, 7, 5] = 2
    assert float(cache.value.float()[3, 1, 5, 7] if cache.value_transposed else cache.value.float()[3, 1, 7, 5]) == 2
    if kv_dtype == "bf16":
        assert cache.key_scale is None and cache.value_scale is None and not cache.quantized
        assert cache.key_smoothing == "none"
    else:
        for s in (cache.key_scale, cache.value_scale):
            assert s.shape == (5, 4, 16) and s.dtype == torch.float32 and s.is_contiguous()
            assert s.data_ptr() != cache.key.data_ptr()  # scales never inline
        assert cache.key_smoothing == "first_write"
    assert cache.key_mean is None
    assert cache.num_slots == 80
    per_elem = storage.itemsize if hasattr(storage, "itemsize") else torch.empty(0, dtype=storage).element_size()
    expect = 2 * 5 * 4 * 16 * head_dim * per_elem + (0 if kv_dtype == "bf16" else 2 * 5 * 4 * 16 * 4)
    assert cache.nbytes() == expect
    assert kv_dtype in repr(cache)


@cases(
    "kwargs,match",
    [
        (dict(kv_dtype="int4"), "kv_dtype"),
        (dict(block_size=12), "block_size"),
        (dict(block_size=4), "block_size"),
        (dict(head_dim=100), "head_dim"),
        (dict(head_dim=512), "head_dim"),
        (dict(num_blocks=0), "num_blocks"),
        (dict(num_kv_heads=0), "num_kv_heads"),
        (dict(key_smoothing="always"), "key_smoothing"),
        (dict(kv_dtype="bf16", key_smoothing="first_write"), "quantized"),
    ],
)
def test_constructor_errors(kwargs, match, device):
    args = dict(num_blocks=4, block_size=16, num_kv_heads=2, head_dim=64, device=device)
    with pytest.raises(ValueError, match=match):
        PagedKVCache(**{**args, **kwargs})


def test_block_sizes_and_smoothing_modes(device):
    for bs in (8, 16, 32, 64, 128):
        assert PagedKVCache(2, bs, 1, 64, device=device).key.shape[2] == bs
    assert PagedKVCache(2, 16, 1, 64, key_smoothing="none", device=device).key_smoothing == "none"
    assert PagedKVCache(2, 16, 1, 64, kv_dtype="fp8", device=device).key_smoothing == "first_write"


def test_set_key_mean(device):
    cache = PagedKVCache(2, 16, 2, 64, device=device)
    cache.set_key_mean(torch.ones(2, 64, dtype=torch.float64))
    assert cache.key_mean.dtype == torch.float32 and cache.key_mean.device.type == torch.device(device).type
    with pytest.raises(ValueError):
        cache.set_key_mean(torch.ones(2, 32))
    cache.set_key_mean(None)
    assert cache.key_mean is None
    with pytest.raises(ValueError):
        PagedKVCache(2, 16, 2, 64, kv_dtype="bf16", device=device).set_key_mean(torch.ones(2, 64))


def test_allocator_slots_and_tables():
    alloc = BlockAllocator(num_blocks=6, block_size=4)
    assert alloc.allocate(0, 5) == [0, 1, 2, 3, 4]  # blocks 0, 1 in ascending order
    assert alloc.allocate(1, 2) == [8, 9]  # block 2
    assert alloc.allocate(0, 4) == [5, 6, 7, 12]  # fills block 1, then block 3
    assert alloc.blocks(0) == [0, 1, 3] and alloc.seq_len(0) == 9
    assert alloc.num_free_blocks == 2
    table = alloc.block_table([0, 1])
    assert table.dtype == torch.int32 and table.tolist() == [[0, 1, 3], [2, 0, 0]]
    assert alloc.block_table([1], max_blocks_per_seq=5).shape == (1, 5)
    with pytest.raises(ValueError):
        alloc.block_table([0], max_blocks_per_seq=2)
    assert alloc.seq_lens([0, 1]).tolist() == [9, 2]
    alloc.free(0)
    assert alloc.num_free_blocks == 5 and alloc.seq_len(0) == 0 and alloc.blocks(0) == []
    # freed blocks are reused
    assert sorted({s // 4 for s in alloc.allocate(2, 12)}) == [0, 1, 3]


def test_allocator_errors_and_slot_mapping():
    alloc = BlockAllocator(num_blocks=2, block_size=8)
    with pytest.raises(ValueError):
        alloc.allocate(0, -1)
    with pytest.raises(RuntimeError, match="out of KV cache blocks"):
        alloc.allocate(0, 17)
    assert alloc.num_free_blocks == 2 and alloc.seq_len(0) == 0  # a failed allocation takes nothing
    sm = alloc.slot_mapping(0, 3)
    assert sm.dtype == torch.int64 and sm.tolist() == [0, 1, 2]
    assert alloc.allocate(0, 0) == []
    assert BlockAllocator.for_cache(PagedKVCache(3, 16, 1, 64, device="cpu")).num_free_blocks == 3


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8", "bf16"])
def test_from_tensors_wraps_storage_like_init(kv_dtype):
    """from_tensors over a cache's own storage gives the same cache (every attribute, the
    same tensor objects): __init__ and from_tensors cannot drift apart."""
    made = PagedKVCache(5, 16, 3, 64, kv_dtype=kv_dtype, device="cpu", key_smoothing="none")
    view = PagedKVCache.from_tensors(made.key, made.value, made.key_scale, made.value_scale)
    assert vars(view).keys() == vars(made).keys()
    for name, want in vars(made).items():
        got = getattr(view, name)
        assert got is want if isinstance(want, torch.Tensor) else got == want, name
    if kv_dtype != "bf16":
        mean = torch.zeros(3, 64)
        smoothed = PagedKVCache.from_tensors(made.key, made.value, made.key_scale, made.value_scale, mean)
        assert smoothed.key_smoothing == "first_write" and smoothed.key_mean is mean
