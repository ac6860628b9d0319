"""KVCache: block sizes, layer views, writes into slots, blocks as bytes; in the compute dtype and quantized."""

import pytest
import torch

from offload.kernels.kv_quant import dequantize_kv, quantize_kv
from offload.tiers.kv.kv_cache import KVCache

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


# --- quantized formats ---------------------------------------------------------------------------------------------

HAS_FP8 = hasattr(torch, "float8_e4m3fn")
QUANT = ["int8", "int4", pytest.param("fp8", marks=pytest.mark.skipif(not HAS_FP8, reason="torch lacks float8"))]


@pytest.mark.parametrize(
    ("kv_dtype", "group_size", "per_head", "ratio"),
    [
        # bytes of one token's K (or V) in one head at head_dim 128: float16 scales (int4: and zeros) + codes
        ("int8", 32, 4 * 2 + 128, 0.53125),  # 136 / 256: half of bf16, plus 1/16 of it for scales
        ("int8", 64, 2 * 2 + 128, 0.515625),  # 132 / 256
        ("int4", 32, 4 * 4 + 64, 0.3125),  # 80 / 256: a quarter of bf16, plus 1/16 for scales and zeros
        ("int4", 64, 2 * 4 + 64, 0.28125),  # 72 / 256
        pytest.param("fp8", 32, 4 * 2 + 128, 0.53125, marks=QUANT[2].marks),  # 136 / 256
    ],
)
def test_quantized_block_bytes_against_bf16(kv_dtype: str, group_size: int, per_head: int, ratio: float) -> None:
    geometry = dict(num_layers=32, block_size=16, kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    bf16 = KVCache.block_bytes(**geometry)
    quant = KVCache.block_bytes(**geometry, kv_dtype=kv_dtype, group_size=group_size)
    assert bf16 == 2 * 32 * 16 * 8 * 128 * 2
    assert quant == 2 * 32 * 16 * 8 * per_head
    assert quant / bf16 == ratio


@pytest.mark.parametrize(
    ("kv_dtype", "fmt", "per_head"),
    [("int8", "int8-g16", 18), ("int4", "int4-g16", 12), pytest.param("fp8", "fp8-g16", 18, marks=QUANT[2].marks)],
)
def test_quantized_cache_size_and_format(kv_dtype: str, fmt: str, per_head: int) -> None:
    """head_dim 16, below the group of 32: one group per head. float32 compute stores 64 bytes per head."""
    cache = KVCache(3, 5, 4, 2, 16, torch.float32, torch.device("cpu"), kv_dtype)
    assert cache.format == fmt
    assert (
        cache.bytes_per_block == KVCache.block_bytes(3, 4, 2, 16, torch.float32, kv_dtype) == 2 * 3 * 4 * 2 * per_head
    )
    assert cache.nbytes == 5 * cache.bytes_per_block
    assert cache.storage.dtype == torch.uint8 and cache.storage.shape == (3, 2, 5, 4, 2, per_head)
    k, v = cache.layer(2).k, cache.layer(2).v
    assert k.shape == v.shape == (5, 4, 2, 16)
    assert k.dtype == v.dtype == torch.float32


def test_plain_formats_are_named_by_their_dtype() -> None:
    assert KVCache(1, 2, 4, 1, 8, torch.bfloat16, torch.device("cpu")).format == "bfloat16"
    assert KVCache(1, 2, 4, 1, 8, torch.float32, torch.device("cpu"), "float32").format == "float32"


@pytest.mark.parametrize(
    ("kv_dtype", "head_dim", "group_size", "match"),
    [
        ("float16", 16, 32, "stores the compute dtype \\(float32\\) or one of int8, int4, fp8"),
        ("int2", 16, 32, "one of int8, int4, fp8"),
        ("int8", 48, 32, "int8 KV cache: head_dim 48 is not a multiple of the group 32"),
        ("int4", 64, 16, "group size must be one of"),
    ],
)
def test_bad_kv_dtypes_are_refused(kv_dtype: str, head_dim: int, group_size: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        KVCache(2, 3, 4, 1, head_dim, torch.float32, torch.device("cpu"), kv_dtype, group_size)
    with pytest.raises(ValueError, match=match):
        KVCache.block_bytes(2, 4, 1, head_dim, torch.float32, kv_dtype, group_size)


def test_fp8_is_refused_where_torch_lacks_it(monkeypatch) -> None:
    monkeypatch.delattr(torch, "float8_e4m3fn", raising=False)
    with pytest.raises(ValueError, match="fp8 KV cache: needs torch.float8_e4m3fn"):
        KVCache(2, 3, 4, 1, 32, torch.bfloat16, torch.device("cpu"), "fp8")


@pytest.mark.parametrize("kv_dtype", QUANT)
def test_quantized_layer_write_then_read(kv_dtype: str) -> None:
    """What a layer reads back at the written slots is the tokens quantized and dequantized; nothing else changes."""
    cache = KVCache(2, 3, 4, 2, 32, torch.bfloat16, torch.device("cpu"), kv_dtype)
    cache.storage.zero_()
    layer = cache.layer(1)
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(2, 2, 32, generator=gen).to(torch.bfloat16)
    v = torch.randn(2, 2, 32, generator=gen).to(torch.bfloat16)
    layer.write(torch.tensor([5, 9]), k, v)  # block 1 offset 1, block 2 offset 1
    fmt = cache.quant
    for read, new in ((layer.k, k), (layer.v, v)):
        got = read.index_select(0, torch.tensor([1, 2]))[:, 1]  # [2, heads, head_dim]
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, dequantize_kv(quantize_kv(new, fmt), fmt, torch.bfloat16))
        step = {"int8": 1 / 127, "int4": 1 / 15, "fp8": 1 / 16}[kv_dtype]  # of a group's largest magnitude
        assert (got.float() - new.float()).abs().max() <= step * new.float().abs().max() * 2
    written = torch.zeros(2, 2, 3, 4, dtype=torch.bool)  # [layers, K/V, blocks, offsets]
    written[1, :, 1, 1] = written[1, :, 2, 1] = True
    assert torch.equal(cache.storage.flatten(4).any(-1), written)


@pytest.mark.parametrize("kv_dtype", ["auto", *QUANT])
def test_blocks_round_trip_byte_identically_in_every_format(kv_dtype: str) -> None:
    """read_blocks' rows hold codes and scales together: written into another cache they give the same bytes and
    the same reads, and read again they are the same rows."""
    cache = KVCache(3, 6, 4, 2, 32, torch.bfloat16, torch.device("cpu"), kv_dtype)
    gen = torch.Generator().manual_seed(1)
    for layer in range(3):
        x = (torch.randn(2, 24, 2, 32, generator=gen) * 3).to(torch.bfloat16)
        cache.layer(layer).write(torch.arange(24), x[0], x[1])
    rows = cache.read_blocks([4, 1])
    assert rows.shape == (2, cache.bytes_per_block) and rows.dtype == torch.uint8
    other = KVCache(3, 6, 4, 2, 32, torch.bfloat16, torch.device("cpu"), kv_dtype)
    other.storage.zero_()
    other.write_blocks([0, 5], rows)
    assert torch.equal(other.storage[:, :, 0], cache.storage[:, :, 4])
    assert torch.equal(other.storage[:, :, 5], cache.storage[:, :, 1])
    assert not other.storage[:, :, 1:5].any()
    assert torch.equal(other.read_blocks([0, 5]), rows)
    index = torch.tensor([4, 1])
    for layer in range(3):
        for mine, theirs in (
            (cache.layer(layer).k, other.layer(layer).k),
            (cache.layer(layer).v, other.layer(layer).v),
        ):
            assert torch.equal(theirs.index_select(0, torch.tensor([0, 5])), mine.index_select(0, index))
