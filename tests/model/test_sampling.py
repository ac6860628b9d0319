"""filter_logits and sample: exact surviving sets, seeded draws, and config validation."""

from __future__ import annotations

import math

import pytest
import torch

from offload.common.config import EngineConfig, SamplingParams
from offload.common.errors import OffloadError
from offload.model.sampling import filter_logits, sample


def kept(logits: torch.Tensor) -> set[int]:
    return set(torch.isfinite(logits).nonzero().flatten().tolist())


def log_probs(*probs: float) -> torch.Tensor:
    return torch.tensor([math.log(p) for p in probs], dtype=torch.float32)


def params(**kw) -> SamplingParams:
    return SamplingParams(**({"temperature": 1.0} | kw))


# --- filter_logits -----------------------------------------------------------------------------


def test_temperature_divides_logits() -> None:
    logits = torch.tensor([1.0, -2.0, 3.5, 0.0])
    assert torch.equal(filter_logits(logits, params(temperature=2.0)), torch.tensor([0.5, -1.0, 1.75, 0.0]))
    assert torch.equal(filter_logits(logits, params(temperature=0.5)), logits * 2)


def test_no_filters_is_a_no_op() -> None:
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    assert torch.equal(filter_logits(logits, params()), logits)


@pytest.mark.parametrize(
    ("top_k", "expected"),
    [
        (1, {1}),
        (2, {1, 3}),
        (3, {1, 2, 3}),
        (4, {0, 1, 2, 3}),
        (5, {0, 1, 2, 3, 4}),
        (0, {0, 1, 2, 3, 4}),
        (99, {0, 1, 2, 3, 4}),
    ],
)
def test_top_k_keeps_the_k_largest(top_k: int, expected: set[int]) -> None:
    logits = torch.tensor([1.0, 5.0, 3.0, 4.0, -2.0])
    out = filter_logits(logits, params(top_k=top_k))
    assert kept(out) == expected
    assert torch.equal(out[sorted(expected)], logits[sorted(expected)])
    assert (out[[i for i in range(5) if i not in expected]] == float("-inf")).all()


def test_top_k_keeps_every_token_tied_with_the_kth() -> None:
    logits = torch.tensor([1.0, 3.0, 3.0, 2.0, 3.0])
    assert kept(filter_logits(logits, params(top_k=2))) == {1, 2, 4}
    assert kept(filter_logits(logits, params(top_k=4))) == {1, 2, 3, 4}


@pytest.mark.parametrize(
    ("top_p", "expected"),
    [
        (1e-6, {2}),  # the most likely token is always kept
        (0.4, {2}),
        (0.6, {2, 0}),
        (0.75, {2, 0}),
        (0.85, {2, 0, 3}),
        (0.99, {2, 0, 3, 1}),
        (1.0, {0, 1, 2, 3}),
    ],
)
def test_top_p_keeps_the_smallest_prefix_reaching_p(top_p: float, expected: set[int]) -> None:
    logits = log_probs(0.3, 0.05, 0.5, 0.15)  # ranked: 2 (0.5), 0 (0.3), 3 (0.15), 1 (0.05)
    out = filter_logits(logits, params(top_p=top_p))
    assert kept(out) == expected
    assert torch.equal(out[sorted(expected)], logits[sorted(expected)])


def test_top_p_one_is_a_no_op() -> None:
    logits = torch.tensor([0.0, -30.0, 2.0, -1e4])
    assert torch.equal(filter_logits(logits, params(top_p=1.0)), logits)


def test_top_p_with_ties_keeps_just_enough_tied_tokens() -> None:
    logits = torch.zeros(4)  # 0.25 each
    assert len(kept(filter_logits(logits, params(top_p=0.5)))) == 2
    assert len(kept(filter_logits(logits, params(top_p=0.51)))) == 3
    assert len(kept(filter_logits(logits, params(top_p=0.2)))) == 1


def test_top_p_applies_after_temperature() -> None:
    logits = log_probs(0.6, 0.3, 0.1)
    assert kept(filter_logits(logits, params(top_p=0.65))) == {0, 1}
    # temperature 0.25 sharpens to 0.6^4 : 0.3^4 : 0.1^4, about 0.94 : 0.06 : 0.001
    assert kept(filter_logits(logits, params(temperature=0.25, top_p=0.65))) == {0}


def test_top_p_applies_after_top_k_renormalises() -> None:
    logits = log_probs(0.4, 0.3, 0.2, 0.1)
    assert kept(filter_logits(logits, params(top_p=0.5))) == {0, 1}
    # inside the top 2 the first holds 4/7 > 0.5 of the mass
    assert kept(filter_logits(logits, params(top_k=2, top_p=0.5))) == {0}
    assert kept(filter_logits(logits, params(top_k=3, top_p=0.9))) == {0, 1, 2}


# --- sample ------------------------------------------------------------------------------------


def test_greedy_rows_take_the_argmax() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.9], [5.0, -1.0, 4.0, 0.0], [-3.0, -2.0, -1.0, -1.5]])
    greedy = SamplingParams(temperature=0.0, top_k=1)
    assert sample(logits, [greedy] * 3, [None] * 3) == [1, 0, 2]


def test_mixed_rows_greedy_and_sampled() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0], [0.0, 0.0, 50.0], [9.0, 0.0, 0.0]])
    rows = [SamplingParams(), params(top_k=1), SamplingParams()]
    gen = torch.Generator().manual_seed(3)
    assert sample(logits, rows, [None, gen, None]) == [1, 2, 0]


def test_sample_needs_one_param_and_generator_per_row() -> None:
    with pytest.raises(ValueError):
        sample(torch.zeros(2, 4), [SamplingParams()], [None, None])


def draws(seed: int, n: int, p: SamplingParams, vocab: int = 64) -> list[int]:
    logits = torch.zeros(1, vocab)
    gen = torch.Generator().manual_seed(seed)
    return [sample(logits, [p], [gen])[0] for _ in range(n)]


def test_same_seed_same_draws() -> None:
    assert draws(1234, 30, params()) == draws(1234, 30, params())


def test_different_seeds_differ() -> None:
    runs = [draws(seed, 30, params()) for seed in range(4)]
    assert len({tuple(r) for r in runs}) == 4


def test_sampled_tokens_stay_inside_the_filtered_set() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 40, generator=gen) * 3
    for p in (params(top_k=5), params(top_p=0.6), params(top_k=8, top_p=0.9, temperature=2.0)):
        allowed = kept(filter_logits(logits[0], p))
        assert 1 < len(allowed) < 40
        seen = {sample(logits, [p], [gen])[0] for _ in range(400)}
        assert seen <= allowed
        # not collapsed to the argmax: several allowed tokens actually come up
        assert len(seen) > 1


def test_sampling_follows_the_distribution() -> None:
    logits = log_probs(0.7, 0.2, 0.1).unsqueeze(0)
    gen = torch.Generator().manual_seed(5)
    counts = torch.bincount(torch.tensor([sample(logits, [params()], [gen])[0] for _ in range(2000)]), minlength=3)
    freqs = counts.float() / 2000
    torch.testing.assert_close(freqs, torch.tensor([0.7, 0.2, 0.1]), atol=0.04, rtol=0)


# --- validation --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field", "value"),
    [
        ({"max_new_tokens": -1}, "max_new_tokens", "-1"),
        ({"max_new_tokens": 2.5}, "max_new_tokens", "2.5"),
        ({"temperature": -0.1}, "temperature", "-0.1"),
        ({"top_k": -1}, "top_k", "-1"),
        ({"top_p": 0.0}, "top_p", "0.0"),
        ({"top_p": 1.5}, "top_p", "1.5"),
        ({"top_p": float("nan")}, "top_p", "nan"),
    ],
)
def test_sampling_params_errors_name_field_and_value(kwargs: dict, field: str, value: str) -> None:
    with pytest.raises(OffloadError) as info:
        SamplingParams(**kwargs)
    assert field in str(info.value)
    assert value in str(info.value)


def test_sampling_params_stop_strings() -> None:
    assert SamplingParams(stop="END").stop == ("END",)
    assert SamplingParams(stop=("a", "b")).stop == ("a", "b")
    with pytest.raises(OffloadError, match="stop"):
        SamplingParams(stop=("a", ""))


def test_sampling_params_greedy() -> None:
    assert SamplingParams().greedy
    assert not SamplingParams(temperature=0.7).greedy


def test_sampling_params_rejects_nan_temperature() -> None:
    with pytest.raises(OffloadError, match="temperature"):
        SamplingParams(temperature=float("nan"))


@pytest.mark.parametrize(
    ("kwargs", "field", "value"),
    [
        ({"dtype": "float64"}, "dtype", "'float64'"),
        ({"device": "tpu"}, "device", "'tpu'"),
        ({"block_size": 0}, "block_size", "0"),
        ({"kv_cache_bytes": -1}, "kv_cache_bytes", "-1"),
        ({"max_num_seqs": "4"}, "max_num_seqs", "'4'"),
        ({"max_step_tokens": 0}, "max_step_tokens", "0"),
        ({"micro_batch_tokens": 1.5}, "micro_batch_tokens", "1.5"),
    ],
)
def test_engine_config_errors_name_field_and_value(kwargs: dict, field: str, value: str) -> None:
    with pytest.raises(OffloadError) as info:
        EngineConfig(**kwargs)
    assert field in str(info.value)
    assert value in str(info.value)


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "cuda:1"])
def test_engine_config_accepts_devices(device: str) -> None:
    assert EngineConfig(device=device).device == device
