"""kv_quant: records against a naive per-group computation in numpy (exact bytes and values), error bounds per format,
extreme values, the launchers' checks, and QuantizedKV read by paged attention."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import offload.tiers.kv.kv_cache as kv_module
from offload.kernels import native
from offload.kernels.kv_quant import KVQuantFormat, dequantize_kv, quantize_kv
from offload.kernels.paged_attention import PagedBatch, paged_attention_ref
from offload.tiers.kv.kv_cache import QuantizedKV

HAS_FP8 = hasattr(torch, "float8_e4m3fn")
KINDS = ["int8", "int4", pytest.param("fp8", marks=pytest.mark.skipif(not HAS_FP8, reason="torch lacks float8"))]


# --- naive reference -----------------------------------------------------------------------------------------------


def half_toward(value: np.float32, up: bool) -> np.float16:
    """The nearest float16 at or above (below) `value`, saturating at +-65504."""
    h = np.float16(value)
    if (np.float32(h) < value) if up else (np.float32(h) > value):
        h = np.nextafter(h, np.float16(np.inf if up else -np.inf))
    return np.float16(np.clip(h, -65504, 65504))


def e4m3_table() -> np.ndarray:
    """The value of every non-negative finite float8_e4m3fn code 0..126, decoded from its bits."""
    values = []
    for code in range(127):
        exp, man = code >> 3, code & 7
        values.append(man * 2.0**-9 if exp == 0 else (1 + man / 8) * 2.0 ** (exp - 7))
    return np.array(values)


E4M3 = e4m3_table()


def e4m3_code(t: np.float32) -> int:
    """Round to the nearest e4m3 value, ties to the even code, keeping the sign (a negative zero too)."""
    dist = np.abs(E4M3 - abs(float(t)))
    best = np.flatnonzero(dist == dist.min())
    code = int(best[0]) if len(best) == 1 or best[0] % 2 == 0 else int(best[1])
    return code | (0x80 if np.signbit(t) else 0)


def naive_group(values: np.ndarray, kind: str) -> tuple[list[np.float16], list[int]]:
    """One group of float32 values -> (its float16 parameters, its integer codes), by the formulas, one at a time."""
    if kind == "int4":
        zero = half_toward(values.min(), up=False)
        scale = half_toward(np.float32(values.max() - np.float32(zero)) / np.float32(15), up=True)
        div = np.float32(scale) if scale != 0 else np.float32(1)
        codes = [int(np.clip(np.rint((v - np.float32(zero)) / div), 0, 15)) for v in values]
        return [scale, zero], codes
    top = {"int8": 127, "fp8": 448}[kind]
    scale = half_toward(np.abs(values).max() / np.float32(top), up=True)
    div = np.float32(scale) if scale != 0 else np.float32(1)
    if kind == "int8":
        return [scale], [int(np.clip(np.rint(v / div), -127, 127)) & 0xFF for v in values]
    return [scale], [e4m3_code(np.float32(np.clip(v / div, -448, 448))) for v in values]


def naive_record(vector: np.ndarray, fmt: KVQuantFormat) -> tuple[bytes, np.ndarray]:
    """One head's vector -> (its record's bytes, its dequantized float32 values)."""
    scales, zeros, codes, values = [], [], [], []
    for g in range(fmt.groups):
        params, group_codes = naive_group(vector[g * fmt.group : (g + 1) * fmt.group], fmt.kind)
        scales.append(params[0])
        zeros.extend(params[1:])
        codes.extend(group_codes)
        for c in group_codes:
            if fmt.kind == "int8":
                q = np.float32(c - 256 if c > 127 else c)
            elif fmt.kind == "fp8":
                q = np.float32(-E4M3[c & 0x7F] if c & 0x80 else E4M3[c])
            else:
                q = np.float32(c)
            value = q * np.float32(params[0])
            values.append(value + np.float32(params[1]) if fmt.kind == "int4" else value)
    if fmt.kind == "int4":
        codes = codes + [0] * (len(codes) % 2)
        codes = [lo | (hi << 4) for lo, hi in zip(codes[0::2], codes[1::2], strict=True)]
    raw = np.array(scales + zeros, dtype="<f2").tobytes() + bytes(codes)
    return raw + bytes(fmt.record_bytes - len(raw)), np.array(values, dtype=np.float32)


def naive(x: torch.Tensor, fmt: KVQuantFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> (records [..., record_bytes] uint8, dequantized [..., head_dim] float32)."""
    vectors = x.float().reshape(-1, fmt.head_dim).numpy()
    pairs = [naive_record(v, fmt) for v in vectors]
    records = torch.tensor([list(r) for r, _ in pairs], dtype=torch.uint8).reshape(*x.shape[:-1], -1)
    values = torch.from_numpy(np.stack([v for _, v in pairs])).reshape(x.shape)
    return records, values


# --- formats -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "head_dim", "group_size", "record_bytes", "name"),
    [
        ("int8", 128, 32, 4 * 2 + 128, "int8-g32"),
        ("int8", 128, 64, 2 * 2 + 128, "int8-g64"),
        ("int4", 128, 32, 4 * 2 * 2 + 64, "int4-g32"),
        ("int4", 128, 64, 2 * 2 * 2 + 64, "int4-g64"),
        ("fp8", 128, 32, 4 * 2 + 128, "fp8-g32"),
        ("int8", 16, 32, 2 + 16, "int8-g16"),  # head_dim below the group: one group
        ("int4", 24, 32, 2 * 2 + 12, "int4-g24"),
        ("int8", 7, 32, 2 + 7 + 1, "int8-g7"),  # odd: a pad byte
        ("int4", 5, 32, 2 * 2 + 3 + 1, "int4-g5"),  # an odd count of nibbles, then a pad byte
    ],
)
def test_record_layout(kind: str, head_dim: int, group_size: int, record_bytes: int, name: str) -> None:
    fmt = KVQuantFormat(kind, head_dim, group_size)
    assert fmt.record_bytes == record_bytes and fmt.record_bytes % 2 == 0
    assert fmt.name == name


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (("int2", 64), "one of int8, int4, fp8"),
        (("int8", 64, 16), "group size must be one of"),
        (("int8", 48), "head_dim 48 is not a multiple of the group 32"),
        (("int4", 96, 64), "head_dim 96 is not a multiple of the group 64"),
    ],
)
def test_bad_formats_are_refused(args: tuple, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        KVQuantFormat(*args)


def test_fp8_is_refused_where_torch_lacks_it(monkeypatch) -> None:
    monkeypatch.delattr(torch, "float8_e4m3fn", raising=False)
    with pytest.raises(ValueError, match="fp8 KV cache: needs torch.float8_e4m3fn"):
        KVQuantFormat("fp8", 64)


# --- against the naive computation ---------------------------------------------------------------------------------

# (shape [..., head_dim], group size): one group, several, head_dim below the group, odd sizes, 64-wide groups
SHAPES = [((3, 5, 16), 32), ((2, 3, 64), 32), ((1, 2, 128), 64), ((4, 1, 24), 32), ((7, 10), 32), ((3, 6), 32)]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("shape", "group_size"), SHAPES, ids=str)
def test_matches_naive_exactly(kind: str, shape: tuple[int, ...], group_size: int) -> None:
    """Every record byte, and every dequantized value, as the formulas computed one group at a time give them."""
    fmt = KVQuantFormat(kind, shape[-1], group_size)
    gen = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=gen) * torch.rand(shape[:-1], generator=gen)[..., None] * 8
    expected_records, expected_values = naive(x, fmt)
    records = quantize_kv(x, fmt)
    assert records.dtype == torch.uint8 and records.shape == (*shape[:-1], fmt.record_bytes)
    assert torch.equal(records, expected_records)
    assert torch.equal(dequantize_kv(records, fmt, torch.float32), expected_values)
    assert torch.equal(dequantize_kv(records, fmt, torch.bfloat16), expected_values.to(torch.bfloat16))


def error_bound(x: torch.Tensor, records: torch.Tensor, fmt: KVQuantFormat) -> torch.Tensor:
    """[..., head_dim] the largest error each value may have: half a step of its group's stored scale (int8, int4),
    half an e4m3 spacing in scale units (fp8: 2^-4 relative, 2^-10 scales among subnormals), plus float32 rounding."""
    scale = records[..., : 2 * fmt.groups].view(torch.float16).float().repeat_interleave(fmt.group, -1)
    bound = torch.maximum(x.abs() / 16, scale / 1024) if fmt.kind == "fp8" else scale / 2
    return bound * (1 + 1e-6) + x.abs() * 1e-6


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_error_within_half_a_step(kind: str, dtype: torch.dtype) -> None:
    fmt = KVQuantFormat(kind, 64)
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(9, 3, 64, generator=gen) * 4).to(dtype)
    records = quantize_kv(x, fmt)
    back = dequantize_kv(records, fmt, torch.float32)
    assert (back - x.float()).abs().le(error_bound(x.float(), records, fmt)).all()
    assert dequantize_kv(records, fmt, dtype).dtype == dtype


@pytest.mark.parametrize("kind", KINDS)
def test_extreme_values(kind: str) -> None:
    """All-zero groups read back as exact zeros, constant groups within the bound (int4: exactly), and groups of
    huge, tiny (subnormal float16 scales) and mixed magnitudes within the bound."""
    fmt = KVQuantFormat(kind, 32, 32)
    rows = [
        torch.zeros(32),
        torch.full((32,), -3.0),
        torch.full((32,), 1e4) * torch.linspace(-1, 1, 32),
        torch.full((32,), 1e-6) * torch.linspace(-1, 1, 32),
        torch.cat((torch.tensor([6e4]), torch.full((31,), 1e-3))),
        torch.cat((torch.tensor([-5e3]), torch.linspace(-1, 1, 31))),
    ]
    x = torch.stack(rows)
    records = quantize_kv(x, fmt)
    back = dequantize_kv(records, fmt, torch.float32)
    assert torch.equal(back[0], torch.zeros(32))
    if kind == "int4":
        assert torch.equal(back[1], x[1])
    assert back.isfinite().all()
    assert (back - x).abs().le(error_bound(x, records, fmt)).all()
    assert torch.equal(records, naive(x, fmt)[0])


@pytest.mark.parametrize("kind", ["int8", pytest.param("fp8", marks=KINDS[2].marks)])
def test_values_past_the_float16_scales_saturate(kind: str) -> None:
    """A scale tops out at 65504, so magnitudes past 65504 * (127 or 448) read back as that, with their sign."""
    top = {"int8": 127, "fp8": 448}[kind] * 65504.0
    x = torch.tensor([[1e9] + [0.0] * 31, [-1e9] + [0.0] * 31])
    back = dequantize_kv(quantize_kv(x, KVQuantFormat(kind, 32)), KVQuantFormat(kind, 32), torch.float32)
    assert back[0, 0] == top and back[1, 0] == -top


# --- launcher checks -----------------------------------------------------------------------------------------------


def test_launchers_check_shapes_and_dtypes() -> None:
    fmt = KVQuantFormat("int8", 16)
    with pytest.raises(ValueError, match=r"quantizes \[\.\.\., 16\] floats"):
        quantize_kv(torch.zeros(2, 8), fmt)
    with pytest.raises(ValueError, match="floats"):
        quantize_kv(torch.zeros(2, 16, dtype=torch.int32), fmt)
    with pytest.raises(ValueError, match=r"reads \[\.\.\., 18\] uint8 records"):
        dequantize_kv(torch.zeros(2, 16, dtype=torch.uint8), fmt, torch.float32)
    with pytest.raises(ValueError, match="uint8 records"):
        dequantize_kv(torch.zeros(2, 18, dtype=torch.int8), fmt, torch.float32)
    with pytest.raises(ValueError, match="floating dtype"):
        dequantize_kv(torch.zeros(2, 18, dtype=torch.uint8), fmt, torch.int32)
    with pytest.raises(ValueError, match=r"records must be \[blocks, block_size, kv_heads, 18\]"):
        QuantizedKV(torch.zeros(4, 2, 1, 16, dtype=torch.uint8), fmt, torch.float32)


# --- QuantizedKV ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_quantized_layer_reads_what_was_written(kind: str) -> None:
    fmt = KVQuantFormat(kind, 24)
    cache = QuantizedKV(torch.zeros(5, 4, 2, fmt.record_bytes, dtype=torch.uint8), fmt, torch.bfloat16)
    assert cache.shape == (5, 4, 2, 24) and cache.dim() == 4 and cache.element_size() == 2
    x = torch.randn(3, 2, 24).to(torch.bfloat16)
    cache.write(torch.tensor([17, 2, 8]), x)  # block 4 offset 1, block 0 offset 2, block 2 offset 0
    got = cache.index_select(0, torch.tensor([4, 0, 2]))
    assert got.shape == (3, 4, 2, 24) and got.dtype == torch.bfloat16
    expected = dequantize_kv(quantize_kv(x, fmt), fmt, torch.bfloat16)
    assert torch.equal(torch.stack((got[0, 1], got[1, 2], got[2, 0])), expected)
    assert not cache.records[1].any() and not cache.records[3].any()  # untouched blocks
    with pytest.raises(ValueError, match="dim 0"):
        cache.index_select(1, torch.tensor([0]))


@pytest.mark.parametrize("slice_values", [1, 3 * 4 * 2 * 24, 1 << 30])  # a block at a time, 3 at a time, all at once
def test_gathering_in_slices_equals_dequantizing_the_whole_cache(monkeypatch, slice_values: int) -> None:
    monkeypatch.setattr(kv_module, "DEQUANT_SLICE", slice_values)
    fmt = KVQuantFormat("int4", 24)
    gen = torch.Generator().manual_seed(2)
    cache = QuantizedKV(quantize_kv(torch.randn(9, 4, 2, 24, generator=gen), fmt), fmt, torch.float32)
    index = torch.tensor([8, 0, 3, 3, 5, 1, 7])
    expected = dequantize_kv(cache.records, fmt, torch.float32)[index]
    assert torch.equal(cache.index_select(0, index), expected)


def paged_case(kind: str, dtype: torch.dtype) -> tuple[torch.Tensor, QuantizedKV, QuantizedKV, PagedBatch, int]:
    """Prefills, chunks and decodes (the decode path's grouping too) over a quantized cache whose unowned blocks hold
    records that read back as NaN. Returns q, the K and V layers, the batch and the number of blocks owned."""
    gen = torch.Generator().manual_seed(5)
    seqs = ((7, 7), (13, 5), (1, 1), (20, 1), (33, 1), (9, 1))  # (context, queries)
    block_size, q_heads, kv_heads, head_dim = 4, 4, 2, 32
    fmt = KVQuantFormat(kind, head_dim)
    owned = [-(-ctx // block_size) for ctx, _ in seqs]
    num_blocks = sum(owned) + 4
    nan_record = torch.full((fmt.record_bytes,), 0xFF, dtype=torch.uint8)  # float16 scales of NaN
    k_rec, v_rec = (nan_record.repeat(num_blocks, block_size, kv_heads, 1) for _ in range(2))
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(seqs), max(owned), dtype=torch.int64)
    starts, queries = [0], []
    for s, (ctx, q_len) in enumerate(seqs):
        table = [order.pop() for _ in range(owned[s])]
        tables[s, : len(table)] = torch.tensor(table)
        for pos in range(ctx):
            b, o = table[pos // block_size], pos % block_size
            k_rec[b, o] = quantize_kv(torch.randn(kv_heads, head_dim, generator=gen), fmt)
            v_rec[b, o] = quantize_kv(torch.randn(kv_heads, head_dim, generator=gen), fmt)
        queries.append(torch.randn(q_len, q_heads, head_dim, generator=gen))
        starts.append(starts[-1] + q_len)
    batch = PagedBatch(tuple(starts), tuple(ctx for ctx, _ in seqs), tables, torch.zeros(starts[-1], dtype=torch.int64))
    q = torch.cat(queries).to(dtype)
    return q, QuantizedKV(k_rec, fmt, dtype), QuantizedKV(v_rec, fmt, dtype), batch, sum(owned)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_paged_attention_reads_a_quantized_cache_as_its_dequantized_tensor(
    monkeypatch, kind: str, dtype: torch.dtype
) -> None:
    """The same output, bit for bit, as over the whole cache dequantized up front; no NaN from blocks no sequence
    owns; and each read dequantizes only the blocks it gathers."""
    q, k, v, batch, owned = paged_case(kind, dtype)
    dense_k, dense_v = (dequantize_kv(c.records, c.fmt, dtype) for c in (k, v))
    with monkeypatch.context() as torch_path:  # the path a quantized cache takes: not the native decode kernel's
        torch_path.setattr(native, "decode_attention_fits", lambda *a: False)
        expected = paged_attention_ref(q, dense_k, dense_v, batch, 0.2, None)

    gathered = []

    def counting(records: torch.Tensor, fmt: KVQuantFormat, out_dtype: torch.dtype) -> torch.Tensor:
        gathered.append(records.shape[0])
        return dequantize_kv(records, fmt, out_dtype)

    monkeypatch.setattr(kv_module, "dequantize_kv", counting)
    out = paged_attention_ref(q, k, v, batch, 0.2, None)
    assert torch.equal(out, expected)
    assert out.isfinite().all()
    assert gathered and max(gathered) <= owned < k.shape[0]
