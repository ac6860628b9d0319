"""GGUF blocks multiplied as they lie (kernels/gguf_linear.py, kernels/csrc/gguf_blocks.c): the reference dequantizes
as gguf does, bit for bit; the native dequantization is the reference rounded to bfloat16, bit for bit; products are
the float64 product within bfloat16's rounding, each row's the same whatever rows are beside it (within the rows one
kernel takes: the block kernel, AMX tiles for a decode step's rows, the dense product), logits float32."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants

from offload.kernels import gguf_linear
from offload.kernels.dispatch import picked
from offload.kernels.native_build import cpu_missing

TYPES = ("Q4_0", "Q4_1", "Q8_0")
needs_native = pytest.mark.skipif(cpu_missing() is not None, reason="the native kernels do not run on this CPU")


def blocks(kind: str, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, np.ndarray]:
    """A random [n, k] matrix in `kind` blocks ([n, k / 32, bytes]) and the raw rows gguf wrote."""
    a = np.random.default_rng(seed).standard_normal((n, k), dtype=np.float32) * 0.05
    raw = quants.quantize(a, T[kind])
    return torch.from_numpy(raw.reshape(n, k // 32, -1).copy()), raw


@pytest.mark.parametrize("kind", TYPES)
def test_the_reference_dequantizes_as_gguf_does_bit_for_bit(kind: str):
    w, raw = blocks(kind, 40, 96)
    assert gguf_linear.block_type(w) == kind and gguf_linear.is_blocks(w)
    want = torch.from_numpy(quants.dequantize(raw, T[kind])).reshape(40, 96)
    assert torch.equal(gguf_linear.dequantize_ref(w), want)


@needs_native
@pytest.mark.parametrize("kind", TYPES)
def test_native_dequantization_is_the_reference_in_bfloat16(kind: str):
    w, _ = blocks(kind, 67, 320)
    assert torch.equal(gguf_linear.dequantize(w, torch.bfloat16), gguf_linear.dequantize_ref(w).bfloat16())


@needs_native
@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize(("n", "k"), [(1, 32), (7, 64), (9, 96), (130, 576), (64, 1536)])  # 96: a pair and a block
def test_block_products_are_exact_products_summed_and_row_invariant(kind: str, n: int, k: int):
    w, _ = blocks(kind, n, k, seed=n + k)
    exact_w = gguf_linear.dequantize_ref(w).double()
    for m in (1, 3, 5, 16, gguf_linear.DENSE_FROM_ROWS - 1):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
        exact = x.double() @ exact_w.T
        y = gguf_linear.gguf_linear(x, w)
        assert picked()["gguf_linear"] == "native" and y.dtype == torch.bfloat16
        torch.testing.assert_close(y.double(), exact, atol=1e-2 * exact.abs().max().item() + 1e-6, rtol=1e-2)
        logits = gguf_linear.gguf_logits(x, w)  # float32 sums: far closer than bfloat16
        assert logits.dtype == torch.float32
        torch.testing.assert_close(logits.double(), exact, atol=1e-5, rtol=1e-5)
        alone = torch.cat([gguf_linear.gguf_logits(x[i : i + 1], w) for i in range(m)])
        assert torch.equal(logits, alone)  # a row's bits do not depend on the rows beside it


@needs_native
@pytest.mark.parametrize("kind", TYPES)
def test_a_decode_steps_rows_take_amx_tiles_from_their_threshold_and_prompts_and_verify_rows_do_not(kind: str):
    """Where the CPU has AMX, a decode step's TILES_FROM_ROWS rows and more go to kernels/csrc/gguf_tiles.c: exact
    products summed on tiles, each row's bits the same beside any other rows there. Fewer rows, a prompt's rows and
    a speculating engine's verify rows (kernels/choice.py's one_row_path_up_to) stay on the block kernel, each row as
    it rounds alone."""
    if gguf_linear._tiles() is None:
        pytest.skip("this CPU has no AMX tiles")
    from offload.kernels import choice, dispatch

    w, _ = blocks(kind, 40, 1056, seed=9)  # 33 blocks a row: a chunk of 32 and one more
    start = gguf_linear.TILES_FROM_ROWS[kind]
    x = torch.randn(3 * start + 17, 1056, generator=torch.Generator().manual_seed(3)).bfloat16()
    exact = x.double() @ gguf_linear.dequantize_ref(w).double().T
    alone = torch.cat([gguf_linear.gguf_logits(row, w) for row in x.split(1)])
    dispatch._picked.pop("gguf_tiles", None)
    assert torch.equal(gguf_linear.gguf_logits(x, w), alone)  # a prompt's rows
    with choice.decode_rows(True):
        assert torch.equal(gguf_linear.gguf_logits(x[: start - 1], w), alone[: start - 1])
        assert "gguf_tiles" not in picked()
        tiled = gguf_linear.gguf_logits(x, w)
        assert picked()["gguf_tiles"] == "native"
        torch.testing.assert_close(tiled.double(), exact, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(alone.double(), exact, atol=1e-5, rtol=1e-5)
        cuts = [0, start, 2 * start + 5, x.shape[0]]  # the same rows beside others: 16 a tile, then what is left
        parts = [gguf_linear.gguf_logits(x[a:b], w) for a, b in zip(cuts, cuts[1:], strict=False)]
        assert torch.equal(torch.cat(parts), tiled)
        y = gguf_linear.gguf_linear(x, w)
        assert y.dtype == torch.bfloat16 and torch.equal(y, tiled.bfloat16())
        saved = choice._one_row_up_to[0]
        try:
            choice.one_row_path_up_to(start)
            assert torch.equal(gguf_linear.gguf_logits(x[:start], w), alone[:start])
        finally:
            choice._one_row_up_to[0] = saved


@pytest.mark.parametrize("kind", TYPES)
def test_many_rows_and_float32_take_the_dense_product_of_the_dequantized_matrix(kind: str):
    w, _ = blocks(kind, 96, 256)
    x = torch.randn(gguf_linear.DENSE_FROM_ROWS + 3, 256, generator=torch.Generator().manual_seed(1))
    want = x.double() @ gguf_linear.dequantize_ref(w).double().T
    y = gguf_linear.gguf_linear(x, w)  # float32: the reference dequantization, a float32 GEMM
    assert picked()["gguf_linear"] == "torch"
    torch.testing.assert_close(y.double(), want, atol=1e-4, rtol=1e-5)
    y16 = gguf_linear.gguf_linear(x.bfloat16(), w)
    torch.testing.assert_close(y16.double(), want, atol=0.05 * want.abs().max().item(), rtol=0.02)


def test_a_table_in_blocks_gives_its_rows_in_float32():
    table, raw = blocks("Q8_0", 50, 64)
    ids = torch.tensor([3, 3, 49, 0])
    want = torch.from_numpy(quants.dequantize(raw, T.Q8_0)).reshape(50, 64)[ids]
    assert torch.equal(gguf_linear.gguf_rows(table, ids), want)


@needs_native
def test_dense_products_of_one_thread_reuse_their_scratch_without_mixing_weights(monkeypatch):
    """The dense path dequantizes a slice of features at a time into one reused buffer (kernels/native.py's
    `scratch`): products over different matrices, one after the other and in slices, each equal the dense product
    over their own dequantized weight."""
    monkeypatch.setattr(gguf_linear, "DEQUANT_BYTES", 2 * 64 * 32)  # 32 features a slice
    weights = [blocks("Q4_0", n, 64, seed)[0] for seed, n in enumerate((96, 32, 160))]
    x = torch.randn(gguf_linear.DENSE_FROM_ROWS, 64, generator=torch.Generator().manual_seed(2)).bfloat16()
    for w in weights + weights[::-1]:
        want = gguf_linear.dense.linear(x, gguf_linear.dequantize_ref(w).bfloat16())
        assert torch.equal(gguf_linear.gguf_linear(x, w), want)


@needs_native
def test_a_routed_experts_rows_switch_to_the_dense_product_sooner():
    """A mixture's expert (offload/model/llama.py's routed_swiglu) is dequantized for the dense GEMM from
    EXPERT_DENSE_FROM_ROWS rows, a dense layer's matrix from DENSE_FROM_ROWS: at rows between, the two differ only
    in that path, each as exact as its own."""
    w, _ = blocks("Q4_0", 64, 128)
    rows = gguf_linear.EXPERT_DENSE_FROM_ROWS
    assert rows < gguf_linear.DENSE_FROM_ROWS
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(4)).bfloat16()
    layer = gguf_linear.gguf_linear(x, w)
    assert picked()["gguf_linear"] == "native"
    expert = gguf_linear.gguf_linear(x, w, dense_from=rows)
    assert picked()["gguf_linear"] == "torch"
    assert torch.equal(expert, gguf_linear.dense.linear(x, gguf_linear.dequantize_ref(w).bfloat16()))
    exact = x.double() @ gguf_linear.dequantize_ref(w).double().T
    torch.testing.assert_close(layer.double(), exact, atol=0.02 * exact.abs().max().item(), rtol=0.02)
