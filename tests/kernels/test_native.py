"""kernels/native.py: the C kernels against torch's own products, their dispatch, and the fallback where they cannot
be built."""

from __future__ import annotations

import pytest
import torch

from offload.common.quant import WeightQuant
from offload.kernels import choice, dispatch, native, native_build
from offload.kernels.linear import linear
from offload.kernels.quant_linear import dequantize_cpu_int4, quant_linear

needs_native = pytest.mark.skipif(
    native.cpu_missing() is not None or native._int4_mm() is None or native._bf16_mm() is None,
    reason=f"the native kernels cannot run here ({native.cpu_missing() or 'no C compiler with OpenMP'})",
)


def _int4(n: int, k: int, group: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    q = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=gen)
    codes = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    scales = torch.randn(k // group, n, 2, generator=gen).mul(0.02).to(torch.bfloat16)
    return codes, scales


def _close_to_bf16(got: torch.Tensor, exact: torch.Tensor) -> None:
    """got (bfloat16) is `exact` (float32, the same sum in float64's order) rounded once: within one bfloat16 step of
    it, plus float32 summation's own error."""
    assert got.dtype == torch.bfloat16
    step = exact.abs().clamp(min=1e-3) * 2.0**-7
    assert ((got.float() - exact).abs() <= step + 1e-4).all(), (got.float() - exact).abs().max()


@needs_native
@pytest.mark.parametrize(("n", "k", "group"), [(192, 576, 32), (576, 1536, 32), (128, 512, 64), (64, 1024, 128)])
@pytest.mark.parametrize("rows", [1, 3, 8, 16, 65, 130])
def test_int4_mm_is_the_dequantized_product_rounded_once(n: int, k: int, group: int, rows: int):
    gen = torch.Generator().manual_seed(rows * n + k)
    codes, scales = _int4(n, k, group, gen)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    w = dequantize_cpu_int4(codes, scales, group).double()  # the values torch's kernel multiplies, bit for bit
    exact = (x.double() @ w.t()).float()
    got = native.int4_mm(x, codes, scales, group)
    _close_to_bf16(got, exact)
    torch_kernel = torch.ops.aten._weight_int4pack_mm_for_cpu(x, codes, group, scales)
    assert (got.float() - torch_kernel.float()).abs().max() <= (exact.abs().max() * 2.0**-7)  # as close as torch's


@needs_native
def test_int4_mm_gives_each_row_the_same_bits_in_any_batch():
    """A sequence's output does not depend on its batch: each output feature's sum runs in one order."""
    gen = torch.Generator().manual_seed(1)
    codes, scales = _int4(576, 576, 32, gen)
    x = torch.randn(40, 576, generator=gen).to(torch.bfloat16)
    whole = native.int4_mm(x, codes, scales, 32)
    assert torch.equal(whole[8:16], native.int4_mm(x[8:16], codes, scales, 32))
    assert torch.equal(whole[:33], native.int4_mm(x[:33], codes, scales, 32))


@needs_native
@pytest.mark.parametrize(("n", "k"), [(49152 // 16, 576), (1024, 64), (16, 2048)])
@pytest.mark.parametrize("rows", [1, 3, 6, 16])
def test_bf16_mm_is_the_product_rounded_once(n: int, k: int, rows: int):
    """Within one rounding of the exact product, and each row the same bits whatever rows share its call (blocks of
    4 rows and their 1-3 row remainders sum alike)."""
    gen = torch.Generator().manual_seed(n + rows)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    got = native.bf16_mm(x, w)
    _close_to_bf16(got, (x.double() @ w.double().t()).float())
    alone = torch.cat([native.bf16_mm(x[r : r + 1], w, torch.float32) for r in range(rows)])
    assert torch.equal(native.bf16_mm(x, w, torch.float32), alone)


@needs_native
@pytest.mark.parametrize("rows", [3, 40])
def test_an_lm_heads_logits_keep_their_float32_sums(rows: int):
    """Two logits 1/64 apart near 25: bfloat16 (steps of 1/8 there) rounds them into a tie that greedy decoding
    would give to the lower token id; the head's float32 logits keep them apart, within float32 summation's error,
    for a decode step's few rows and a perplexity window's many alike."""
    from offload.kernels.linear import logits

    gen = torch.Generator().manual_seed(9)
    x = torch.randn(rows, 576, generator=gen).to(torch.bfloat16)
    w = torch.randn(64, 576, generator=gen).div(24).to(torch.bfloat16)
    x[0] = 0
    x[0, :32] = 1
    w[7], w[8] = 0, 0
    w[7, :32] = w[8, :32] = 25 / 32  # row 0's logits 7 and 8: 25, and 25 + 1/64
    w[8, 0] += 2.0**-6
    exact = x.double() @ w.double().t()
    got = logits(x, w)
    assert got.dtype == torch.float32
    assert (got.double() - exact).abs().max() <= exact.abs().max() * 2.0**-20
    assert got[0].argmax() == exact[0].argmax() == 8
    rounded = native.bf16_mm(x, w)
    assert rounded.dtype == torch.bfloat16 and rounded[0, 7] == rounded[0, 8]


@needs_native
def test_products_dispatch_to_the_native_kernels_where_they_fit(monkeypatch):
    gen = torch.Generator().manual_seed(2)
    fmt = WeightQuant(4, 32, "cpu")
    codes, scales = _int4(192, 576, 32, gen)
    calls = []
    monkeypatch.setattr(native, "int4_mm", lambda *a: calls.append("int4") or torch.zeros(a[0].shape[0], 192))
    monkeypatch.setattr(native, "bf16_mm", lambda x, w: calls.append("bf16") or torch.zeros(x.shape[0], w.shape[0]))
    quant_linear(torch.randn(16, 576).to(torch.bfloat16), codes, scales, fmt)
    assert calls == ["int4"] and dispatch.picked()["quant_matmul"] == "native"
    quant_linear(torch.randn(1, 576).to(torch.bfloat16), codes, scales, fmt)  # one row too
    assert calls == ["int4", "int4"]
    quant_linear(torch.randn(16, 576), codes, scales.float(), fmt)  # float32: torch's kernel
    assert calls == ["int4", "int4"] and dispatch.picked()["quant_matmul"] == "torch"
    w = torch.randn(64, 576).to(torch.bfloat16)
    linear(torch.randn(2, 576).to(torch.bfloat16), w)
    assert calls == ["int4", "int4", "bf16"] and dispatch.picked()["linear"] == "native"
    linear(torch.randn(17, 576).to(torch.bfloat16), w)  # more rows: torch's GEMM (choice.UNMEASURED)
    linear(torch.randn(2, 500).to(torch.bfloat16), w[:, :500].contiguous())  # inputs not a multiple of 32
    assert calls == ["int4", "int4", "bf16"]


@needs_native
def test_no_rows_give_no_rows():
    """A step whose chunks all stop short of their last token asks the head for no rows: the kernels, which divide
    rows among threads, return an empty product instead of dividing by zero (a SIGFPE that ended the process)."""
    gen = torch.Generator().manual_seed(4)
    codes, scales = _int4(64, 576, 32, gen)
    none = torch.empty(0, 576, dtype=torch.bfloat16)
    assert native.int4_mm(none, codes, scales, 32).shape == (0, 64)
    w = torch.randn(64, 576).to(torch.bfloat16)
    assert native.bf16_mm(none, w).shape == native.bf16_mm(none, w, torch.float32).shape == (0, 64)


def test_a_failed_build_falls_back_to_torch_and_says_so(monkeypatch, tmp_path, capsys):
    """A compiler that fails: the kernels are None (torch's run), one message on stderr, no library in the cache but
    the failure's log, which keeps this compiler from being called again for that source, in this process or the
    next (tests/kernels/test_choice.py counts the calls across processes); the reason names the log."""
    if native.cpu_missing() is not None:
        pytest.skip(native.cpu_missing())
    compiler = tmp_path / "cc"
    compiler.write_text("#!/bin/sh\necho 'cc: no' >&2\ncase \"$1\" in --version) exit 0;; esac\nexit 1\n")
    compiler.chmod(0o755)
    monkeypatch.setenv("CC", str(compiler))
    monkeypatch.setenv("OFFLOAD_CACHE_DIR", str(tmp_path / "cache"))
    native.library.cache_clear()
    try:
        assert native.library("int4_mm") is None
        assert "building int4_mm.c" in capsys.readouterr().err
        (log,) = (tmp_path / "cache" / "native").iterdir()
        assert log.name.endswith(".failed.log") and "cc: no" in log.read_text()
        native.library.cache_clear()
        assert native.library("int4_mm") is None
        assert capsys.readouterr().err == ""  # remembered: not built again, not said again
        assert str(log) in native_build.known_off()
    finally:
        native.library.cache_clear()


def test_a_cache_folder_that_cannot_be_written_falls_back_to_torch(monkeypatch, tmp_path, capsys):
    if native.cpu_missing() is not None or native._int4_mm() is None:
        pytest.skip("the native kernels cannot run here")
    blocked = tmp_path / "file"
    blocked.write_text("")  # the cache folder's parent is a file: nothing can be made under it
    monkeypatch.setenv("OFFLOAD_CACHE_DIR", str(blocked / "cache"))
    native.library.cache_clear()
    try:
        assert native.library("int4_mm") is None
        assert "building" in capsys.readouterr().err
    finally:
        native.library.cache_clear()


def test_offload_kernels_torch_turns_them_off(monkeypatch):
    monkeypatch.setenv("OFFLOAD_KERNELS", "torch")
    native.library.cache_clear()
    try:
        assert native.cpu_missing() == "OFFLOAD_KERNELS=torch" and native.library("int4_mm") is None
    finally:
        native.library.cache_clear()


def _paged(lens: list[int], block_size: int, gen: torch.Generator, hkv: int = 3, d: int = 64):
    """Caches of shuffled blocks holding `lens` tokens each, and their batch: one query per sequence."""
    from offload.kernels.paged_batch import PagedBatch

    blocks = sum(-(-n // block_size) for n in lens) + 3
    k, v = (torch.randn(blocks, block_size, hkv, d, generator=gen).to(torch.bfloat16) for _ in range(2))
    order, used = torch.randperm(blocks, generator=gen), 0
    tables = torch.zeros(len(lens), max(-(-n // block_size) for n in lens), dtype=torch.int64)
    for i, n in enumerate(lens):
        tables[i, : -(-n // block_size)] = order[used : used + -(-n // block_size)]
        used += -(-n // block_size)
    batch = PagedBatch(tuple(range(len(lens) + 1)), tuple(lens), tables, torch.zeros(len(lens), dtype=torch.int64))
    return k, v, batch


def _dense_attention(q, k, v, batch, scale: float, window: int | None) -> torch.Tensor:
    """Each query (the last of its sequence's positions, in order) over its visible keys, in float64 from the cache's
    values."""
    out = torch.empty(q.shape, dtype=torch.float64)
    block_size, hkv = k.shape[1], k.shape[2]
    for i, n in enumerate(batch.context_lens):
        q0, q1 = batch.query_start[i], batch.query_start[i + 1]
        for row in range(q0, q1):
            end = n - (q1 - row) + 1  # this query's position + 1
            pos = torch.arange(0 if window is None else max(0, end - window), end)
            slots = batch.block_tables[i][pos // block_size] * block_size + pos % block_size
            keys, values = k.flatten(0, 1)[slots].double(), v.flatten(0, 1)[slots].double()
            for h in range(q.shape[1]):
                kv = h // (q.shape[1] // hkv)
                out[row, h] = torch.softmax(keys[:, kv] @ q[row, h].double() * scale, 0) @ values[:, kv]
    return out


@needs_native
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize(("heads", "d"), [(9, 64), (8, 128), (2, 32), (12, 64), (4, 256)])
@pytest.mark.parametrize("block_size", [16, 7])
def test_decode_attention_reads_the_paged_cache_as_dense_attention_would(window, heads: int, d: int, block_size: int):
    """Lengths around block edges, shorter and longer than the window, shuffled blocks (of a size that is not a
    multiple of the 16 keys scored at a time, too): as exact as torch's SDPA path (one bfloat16 rounding of the
    output), and the path paged_attention_ref takes for bfloat16 caches."""
    from offload.kernels.paged_attention import _attend_single_queries, paged_attention_ref

    gen = torch.Generator().manual_seed(heads + d)
    hkv = 1 if heads == 2 else heads // 3 if heads == 9 else 2  # groups of 2, 3, 4, 6, 2
    k, v, batch = _paged([37, 160, 5, 16, 17, 1], block_size, gen, hkv, d)
    q = torch.randn(len(batch.context_lens), heads, d, generator=gen).to(torch.bfloat16)
    exact = _dense_attention(q, k, v, batch, d**-0.5, window)
    got = paged_attention_ref(q, k, v, batch, d**-0.5, window)
    assert dispatch.picked()["paged_attention"] == "native"
    torch_path = torch.empty_like(q)
    _attend_single_queries(q, k, v, batch, list(range(len(batch.context_lens))), d**-0.5, window, torch_path)
    worst = (torch_path.double() - exact).abs().max()
    assert (got.double() - exact).abs().max() <= max(worst, exact.abs().max() * 2.0**-8)


@needs_native
@pytest.mark.parametrize(("hq", "hkv", "d"), [(32, 4, 64), (6, 1, 64), (9, 3, 64), (8, 2, 128), (4, 2, 256)])
def test_decode_attention_gives_a_query_head_the_bits_it_gets_alone(hq: int, hkv: int, d: int):
    """The query heads sharing a KV head read each key and value row together (a few heads' sums at a time): every
    head's output is bit for bit the one it gets as the only head of its KV head, whatever the group's size."""
    gen = torch.Generator().manual_seed(hq * d)
    k, v, batch = _paged([37, 160, 5, 16, 17, 1], 16, gen, hkv, d)
    q = torch.randn(len(batch.context_lens), hq, d, generator=gen).to(torch.bfloat16)
    lens = torch.tensor(batch.context_lens, dtype=torch.int32)
    args = (batch.block_tables, lens, torch.zeros_like(lens), d**-0.5, 160)
    grouped = native.decode_attention(q, k, v, *args)
    group = hq // hkv
    for h in range(hq):
        kv = h // group
        alone = native.decode_attention(
            q[:, h : h + 1], k[:, :, kv : kv + 1].contiguous(), v[:, :, kv : kv + 1].contiguous(), *args
        )
        assert torch.equal(grouped[:, h : h + 1], alone), h
    one = k[:, :, :1].contiguous()
    many = torch.zeros(1, native.ATTENTION_MAX_GROUP + 1, d, dtype=torch.bfloat16)
    assert native.decode_attention_fits(many[:, :-1], one, one) and not native.decode_attention_fits(many, one, one)


@needs_native
def test_kernels_give_the_same_bits_on_one_thread_as_on_several():
    """The kernels that drop to one thread while the CPU is shared (kernels/csrc/team.h) split their work by
    outputs, each computed whole by one thread: a product's and decode attention's bits do not depend on the team."""
    gen = torch.Generator().manual_seed(3)
    codes, scales = _int4(576, 576, 32, gen)
    x = torch.randn(5, 576, generator=gen).to(torch.bfloat16)
    w = torch.randn(1024, 576, generator=gen).to(torch.bfloat16)
    k, v, batch = _paged([37, 160, 5], 16, gen, 3, 64)
    q = torch.randn(3, 9, 64, generator=gen).to(torch.bfloat16)
    lens = torch.tensor(batch.context_lens, dtype=torch.int32)

    def outputs() -> list[torch.Tensor]:
        attention = native.decode_attention(q, k, v, batch.block_tables, lens, torch.zeros_like(lens), 0.125, 160)
        return [
            native.int4_mm(x, codes, scales, 32),
            native.bf16_mm(x, w),
            native.bf16_mm(x, w, torch.float32),
            attention,
        ]

    threads = torch.get_num_threads()
    several = outputs()
    torch.set_num_threads(1)
    try:
        alone = outputs()
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(several, alone, strict=True))


@needs_native
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("max_chunk", [1024, 8])
def test_prompt_chunks_take_the_native_kernel_beside_decode_tokens(window, max_chunk: int, monkeypatch):
    """A whole prompt, a later chunk of one (its queries the last of its positions) and decode tokens in one batch:
    every query one row of the native kernel, or, for chunks of more than `max_chunk` queries, torch's SDPA; as dense
    attention over what it sees either way; float32 caches stay on torch's path."""
    from offload.kernels.paged_attention import paged_attention_ref
    from offload.kernels.paged_batch import PagedBatch

    thresholds = ((1, choice.NATIVE), (max_chunk + 1, choice.TORCH))
    monkeypatch.setitem(choice.UNMEASURED, "prompt_attention", thresholds)

    gen = torch.Generator().manual_seed(5)
    k, v, one = _paged([40, 9, 33, 70], 16, gen)
    batch = PagedBatch((0, 1, 10, 11, 36), one.context_lens, one.block_tables, torch.zeros(36, dtype=torch.int64))
    q = torch.randn(36, 9, 64, generator=gen).to(torch.bfloat16)
    got = paged_attention_ref(q, k, v, batch, 0.125, window)
    assert dispatch.picked()["paged_attention"] == "native"
    exact = _dense_attention(q, k, v, batch, 0.125, window)
    assert (got.double() - exact).abs().max() <= exact.abs().max() * 2.0**-7
    assert not native.decode_attention_fits(q.float(), k.float(), v.float())


@needs_native
@pytest.mark.parametrize(("rows", "hidden"), [(1, 576), (16, 200), (native.ROWS_SERIAL, 576), (300, 200)])
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_is_the_torch_reference_bit_for_bit(rows: int, hidden: int, residual: bool):
    """The same roundings as kernels/rms_norm.py's reference, on one thread and split over threads (a prefill's
    rows), widths that are not a multiple of 16 too; only the float32 sum of squares runs in another order, which can
    move a row's scale by a float32 step and so a rare value by one bfloat16 step."""
    from offload.kernels.rms_norm import fused_rms_norm, rms_norm_residual_ref

    gen = torch.Generator().manual_seed(rows)
    x, r = (torch.randn(rows, hidden, generator=gen).mul(4).to(torch.bfloat16) for _ in range(2))
    w = torch.randn(hidden, generator=gen).to(torch.bfloat16)
    got = fused_rms_norm(x, w, 1e-5, r if residual else None)
    assert dispatch.picked()["rms_norm"] == "native"
    want = rms_norm_residual_ref(x, w, 1e-5, r if residual else None)
    assert torch.equal(got[1], want[1])  # x + residual: one rounding, the same
    moved = got[0] != want[0]
    assert moved.float().mean() < 0.01, moved.sum()
    assert ((got[0].float() - want[0].float()).abs() <= want[0].float().abs() * 2.0**-7).all()


@needs_native
@pytest.mark.parametrize(("tokens", "d"), [(1, 64), (7, 40), (300, 64)])
def test_rotary_is_the_torch_reference_bit_for_bit(tokens: int, d: int):
    """Queries and keys side by side, a view of the fused q/k/v product (rows strided), as the layer passes them; a
    half head that is not a multiple of 16, and a prefill's tokens split over threads."""
    from offload.kernels.rotary import _rotate_ref, apply_rotary_heads

    gen = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, 15, d, generator=gen).to(torch.bfloat16)
    angles = torch.randn(tokens, d // 2, generator=gen) * 50
    cos, sin = (torch.cat((f(angles), f(angles)), dim=-1).to(torch.bfloat16) for f in (torch.cos, torch.sin))
    got = apply_rotary_heads(qkv[:, :12], cos, sin)
    assert dispatch.picked()["rotary"] == "native"
    assert torch.equal(got, _rotate_ref(qkv[:, :12], cos, sin))
    assert not native.rotary_fits(qkv[:, :12].float(), cos.float(), sin.float())


@needs_native
@pytest.mark.parametrize(("n", "k", "group"), [(1088, 160, 32), (128, 512, 128)])
def test_int4_dequant_is_torch_dequantization_rounded_to_bfloat16(n: int, k: int, group: int):
    """What the dense path multiplies from INT4_DENSE_MIN_ROWS rows: bit for bit the values of the torch path."""
    codes, scales = _int4(n, k, group, torch.Generator().manual_seed(n))
    want = dequantize_cpu_int4(codes, scales, group).to(torch.bfloat16)
    assert torch.equal(native.int4_dequant(codes, scales, group), want)


@needs_native
@pytest.mark.parametrize("rows", [1, 16, native.ROWS_SERIAL + 1, 300])
def test_silu_mul_is_torchs_two_ops(rows: int):
    """The halves of a fused gate/up product (rows strided, a width that is not a multiple of 16), serial and split
    over threads: torch's roundings; silu's e^x (within 2 float32 ulps, where torch's is within 1) can move a rare
    value by one bfloat16 step. Extremes: silu saturates to x and to -0, a NaN stays NaN."""
    from offload.kernels.activation import silu_mul

    gen = torch.Generator().manual_seed(rows)
    fused = torch.randn(rows, 2 * 200, generator=gen).mul(4).to(torch.bfloat16)
    fused[0, :4] = torch.tensor([100.0, -100.0, 0.0, 1e-39])  # a denormal gate: kept, not flushed
    fused[-1, 5] = float("nan")
    gate, up = fused.chunk(2, dim=-1)
    got = silu_mul(gate, up)
    assert dispatch.picked()["silu_mul"] == "native"
    want = torch.nn.functional.silu(gate) * up
    assert got.is_contiguous() and got.shape == want.shape
    assert torch.isnan(got[-1, 5]) and not torch.isnan(got[:-1]).any()
    ok = ~torch.isnan(want)
    moved = got[ok] != want[ok]
    assert moved.float().mean() < 0.01, moved.sum()
    assert ((got[ok].float() - want[ok].float()).abs() <= want[ok].float().abs() * 2.0**-7).all()
    assert torch.equal(got[0, :3], want[0, :3])
    assert not native.silu_mul_fits(gate.float(), up.float())


@needs_native
@pytest.mark.parametrize(("rows", "n"), [(1, 49152), (16, 49152), (3, 17), (2, 1)])
def test_argmax_names_torchs_index(rows: int, n: int):
    """Each row's largest value as torch's argmax names it: the first of equal ones, a row of -inf's first, a width
    not a multiple of 16, rows strided; a row holding a NaN is left to torch (None), and the greedy sampler then asks
    torch."""
    from offload.common.config import SamplingParams
    from offload.model.sampling import sample

    gen = torch.Generator().manual_seed(rows + n)
    x = torch.randn(rows, n + 3, generator=gen)[:, :n]  # rows 3 values apart from their ends
    x[0, n // 2] = x[0, n - 1] = 50.0  # a tie: the first
    if rows > 2:
        x[1] = -float("inf")
        x[2] = -5.0
    assert torch.equal(native.argmax(x), x.argmax(-1))
    assert native.argmax(x)[0] == (n // 2 if n > 1 else 0)
    x[-1, 0] = float("nan")
    assert native.argmax(x) is None
    greedy = [SamplingParams(temperature=0.0)] * rows
    assert sample(x, greedy, [None] * rows) == x.argmax(-1).tolist()
    x[-1, 0] = 0.0
    assert sample(x, greedy, [None] * rows) == x.argmax(-1).tolist() and dispatch.picked()["argmax"] == "native"
    assert not native.argmax_fits(x.to(torch.float64))  # float32 rows only


@needs_native
def test_a_verify_chunks_rows_attend_as_decode_tokens_alone(monkeypatch):
    """A speculating engine's verify step gives a sequence k + 1 query rows: each attends through the decode kernel
    as a one-row step at its position would, the same bits (the prompt path's causal SDPA rounds apart, and greedy
    replies parted from plain ones where two tokens were nearly tied)."""
    from offload.kernels import cpu_attention
    from offload.kernels.paged_batch import PagedBatch

    # as timed on the Xeon with AMX: torch's causal SDPA for a prompt chunk of any length, the native decode kernel
    choice.forget()
    monkeypatch.setattr(choice, "_decide", lambda kernel, rows, shape: "torch" if "prompt" in kernel else "native")
    gen = torch.Generator().manual_seed(5)
    k, v, one = _paged([40], 16, gen, 2, 64)
    q = torch.randn(5, 8, 64, generator=gen).to(torch.bfloat16)  # positions 35-39
    chunk = PagedBatch((0, 5), (40,), one.block_tables, torch.zeros(5, dtype=torch.int64))
    try:
        choice.one_row_path_up_to(5)
        got, seqs = cpu_attention.attend(q, k, v, chunk, 0.125, None)
        alone = [
            cpu_attention.attend(
                q[i : i + 1], k, v, PagedBatch((0, 1), (36 + i,), one.block_tables, one.slot_mapping), 0.125, None
            )[0]
            for i in range(5)
        ]
    finally:
        choice.forget()
    assert seqs == {0} and torch.equal(got, torch.cat(alone))
