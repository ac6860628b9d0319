"""KVCache: block sizes, layer views, writes into slots, blocks as bytes."""

import pytest
import torch

from tiers.kv import KVCache

# --- KVCache -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [(torch.float32, 2 * 3 * 4 * 2 * 8 * 4), (torch.float16, 768), (torch.bfloat16, 768)],
)
def test_block_bytes(dtype: torch.dtype, expected: int) -> None:
    assert KVCache.block_bytes(num_layers=3, block_size=4, kv_heads=2, head_dim=8, dtype=dtype) == expected


def test_cache_size_matches_block_bytes() -> None:
    cache = KVCache(3, 5, 4, 2, 8, torch.float16, torch.device("cpu"))
    assert cache.nbytes == 5 * 768
    assert cache.bytes_per_block == 768
    assert cache.num_blocks == 5
    assert cache.block_size == 4


def test_layer_views_have_the_cache_shape() -> None:
    cache = KVCache(2, 5, 4, 3, 8, torch.float32, torch.device("cpu"))
    k, v = cache.layer(1).k, cache.layer(1).v
    assert k.shape == v.shape == (5, 4, 3, 8)
    assert k.dtype == v.dtype == torch.float32


def test_layer_views_alias_the_storage() -> None:
    cache = KVCache(3, 4, 2, 1, 2, torch.float32, torch.device("cpu"))
    for layer in range(3):
        k, v = cache.layer(layer).k, cache.layer(layer).v
        k.fill_(10 * layer + 1)
        v.fill_(10 * layer + 2)
    k, v = cache.layer(1).k, cache.layer(1).v
    k[2, 1, 0, 1] = -5.0
    for layer in range(3):  # fresh views see every write, and K, V and layers do not overlap
        k_again, v_again = cache.layer(layer).k, cache.layer(layer).v
        expected_k = torch.full((4, 2, 1, 2), 10.0 * layer + 1)
        if layer == 1:
            expected_k[2, 1, 0, 1] = -5.0
        assert torch.equal(k_again, expected_k)
        assert torch.equal(v_again, torch.full((4, 2, 1, 2), 10.0 * layer + 2))
    assert k.data_ptr() == cache.layer(1).k.data_ptr()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_leave_and_enter_as_bytes_unchanged(dtype: torch.dtype) -> None:
    cache = KVCache(3, 6, 4, 2, 8, dtype, torch.device("cpu"))
    cache.storage.copy_(torch.randn(cache.storage.shape).to(dtype))
    rows = cache.read_blocks([4, 1])
    assert rows.shape == (2, cache.bytes_per_block) and rows.dtype == torch.uint8
    other = KVCache(3, 6, 4, 2, 8, dtype, torch.device("cpu"))
    other.storage.zero_()
    other.write_blocks([0, 5], rows)
    assert torch.equal(other.storage[:, :, 0], cache.storage[:, :, 4])
    assert torch.equal(other.storage[:, :, 5], cache.storage[:, :, 1])
    assert not other.storage[:, :, 1:5].any()  # no other block touched
    with pytest.raises(ValueError, match="uint8"):
        other.write_blocks([0], rows)


def test_layer_write_puts_tokens_in_their_slots() -> None:
    cache = KVCache(2, 3, 4, 1, 2, torch.float32, torch.device("cpu"))
    cache.storage.zero_()
    layer = cache.layer(1)
    k = torch.tensor([[[1.0, 2.0]], [[3.0, 4.0]]])
    layer.write(torch.tensor([5, 9]), k, -k)
    assert torch.equal(layer.k[1, 1, 0], k[0, 0]) and torch.equal(layer.k[2, 1, 0], k[1, 0])
    assert torch.equal(layer.v[2, 1, 0], -k[1, 0])
    assert cache.storage[0].abs().sum() == 0
