"""rotary: the Triton kernel (in Triton's CPU interpreter, or compiled on a GPU) against its torch reference bit for
bit and against the rotation written out element by element in float64, over odd head counts and head_dims, strided
q/k views and each dtype; the launcher's checks; and the CPU dispatcher against offload/model/rope.apply_rope."""

from __future__ import annotations

import pytest
import torch

from conftest import interpreted

pytest.importorskip("triton")

from offload.common.model_config import RopeSpec  # noqa: E402
from offload.kernels import dispatch, native  # noqa: E402
from offload.kernels.rotary import apply_rotary, rotary, rotary_ref  # noqa: E402
from offload.model.rope import apply_rope, cos_sin, inverse_frequencies  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# against float64: two products and a sum, each rounded to the dtype; relative to the largest |x|
NAIVE_TOL = {torch.float32: 1e-6, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}
# (tokens, q heads, kv heads, head_dim): one token, heads past one program's 16, head_dim/2 not a power of two
SHAPES = [(1, 4, 2, 16), (5, 3, 1, 6), (9, 32, 8, 128), (3, 40, 8, 96), (2, 1, 1, 2)]

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def inputs(tokens, heads, kv_heads, head_dim, dtype, device="cpu", seed=0):
    """q and k as views of one fused qkv projection [tokens, (Hq + 2 Hkv) * D] (strided over tokens), and cos/sin
    of Llama 3 frequencies at scattered positions."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype).to(device)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    positions = torch.randint(0, 10_000, (tokens,), generator=g).to(device)
    cos, sin = cos_sin(inverse_frequencies(RopeSpec(kind="llama3", theta=500000.0), head_dim), positions, dtype)
    return q, k, cos, sin


def naive(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """out[t, h, i] = x[t, h, i] cos[t, i] + partner sin[t, i], one head_dim index at a time in float64, where the
    partner of i < D/2 is -x[i + D/2] and of i >= D/2 is x[i - D/2]."""
    x, cos, sin = x.double(), cos.double(), sin.double()
    half = x.shape[-1] // 2
    out = torch.empty_like(x)
    for i in range(x.shape[-1]):
        partner = -x[:, :, i + half] if i < half else x[:, :, i - half]
        out[:, :, i] = x[:, :, i] * cos[:, None, i] + partner * sin[:, None, i]
    return out


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_kernel_matches_reference_exactly_and_float64(shape, dtype):
    q, k, cos, sin = inputs(*shape, dtype)
    before = [t.clone() for t in (q, k, cos, sin)]

    q_rot, k_rot = rotary(q, k, cos, sin)
    q_ref, k_ref = rotary_ref(q, k, cos, sin)

    assert q_rot.shape == q.shape and k_rot.shape == k.shape
    assert q_rot.dtype == k_rot.dtype == dtype
    assert torch.equal(q_rot, q_ref) and torch.equal(k_rot, k_ref)
    for out, x in ((q_rot, q), (k_rot, k)):
        scale = x.abs().max().item()
        torch.testing.assert_close(out.double(), naive(x, cos, sin), rtol=0, atol=NAIVE_TOL[dtype] * scale)
    assert all(torch.equal(t, b) for t, b in zip((q, k, cos, sin), before, strict=True))  # inputs untouched


@interpreted
def test_many_tokens():
    q, k, cos, sin = inputs(64, 16, 4, 128, torch.float16, seed=1)  # float16: the interpreter's bfloat16 is slow
    q_rot, k_rot = rotary(q, k, cos, sin)
    q_ref, k_ref = rotary_ref(q, k, cos, sin)
    assert torch.equal(q_rot, q_ref) and torch.equal(k_rot, k_ref)


@interpreted
def test_no_tokens():
    q, k, cos, sin = inputs(0, 4, 2, 16, torch.float32)
    q_rot, k_rot = rotary(q, k, cos, sin)
    assert q_rot.shape == (0, 4, 16) and k_rot.shape == (0, 2, 16)


@interpreted
@pytest.mark.parametrize(
    "change, match",
    [
        (lambda q, k, c, s: (q[..., :-1], k[..., :-1], c[:, :-1], s[:, :-1]), "head_dim must be even"),
        (lambda q, k, c, s: (q.double(), k.double(), c.double(), s.double()), "q must be"),
        (lambda q, k, c, s: (q[0], k, c, s), r"q must be \[tokens, heads, head_dim\]"),
        (lambda q, k, c, s: (q, k[..., :8], c, s), "k must be"),
        (lambda q, k, c, s: (q, k[:-1], c, s), "k must be"),
        (lambda q, k, c, s: (q, k, c[:-1], s), "cos must be"),
        (lambda q, k, c, s: (q, k, c, s[:, :8]), "sin must be"),
        (lambda q, k, c, s: (q, k.half(), c, s), "k is torch.float16"),
        (lambda q, k, c, s: (q, k, c.half(), s), "cos is torch.float16"),
        (lambda q, k, c, s: (q.transpose(1, 2).contiguous().transpose(1, 2), k, c, s), "q's last dim"),
        (lambda q, k, c, s: (q, k, c, torch.ones(16, 3).t()), "sin's last dim"),
    ],
)
def test_launcher_rejects_bad_inputs(change, match):
    q, k, cos, sin = change(*inputs(3, 4, 2, 16, torch.float32))
    with pytest.raises(ValueError, match=match):
        rotary(q, k, cos, sin)


def test_cpu_tensors_need_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="q is on cpu; the kernel runs on a CUDA device"):
        rotary(*inputs(2, 4, 2, 16, torch.float32))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cpu_dispatch_is_apply_rope_bit_for_bit(dtype):
    q, k, cos, sin = inputs(7, 8, 2, 64, dtype, seed=2)
    q_rot, k_rot = apply_rotary(q, k, cos, sin)
    assert torch.equal(q_rot, apply_rope(q, cos, sin))
    assert torch.equal(k_rot, apply_rope(k, cos, sin))
    native_ran = dtype == torch.bfloat16 and native._rotary() is not None  # kernels/native.py's, where it runs
    assert dispatch.picked()["rotary"] == ("native" if native_ran else "torch")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 32, 8, 128), (333, 40, 8, 128), (17, 28, 4, 96), (4, 3, 1, 6)], ids=str)
def test_compiled_on_gpu(shape, dtype):
    q, k, cos, sin = inputs(*shape, dtype, device="cuda")
    q_rot, k_rot = apply_rotary(q, k, cos, sin)
    assert dispatch.picked()["rotary"] == "triton"
    q_ref, k_ref = rotary_ref(q, k, cos, sin)
    # half precision rounds exactly as torch; float32 may fuse a multiply-add (one rounding fewer)
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=0, atol=0)
    torch.testing.assert_close(q_rot, q_ref, **tol)
    torch.testing.assert_close(k_rot, k_ref, **tol)
