"""offload.scheduler.cost.predict and .search: hand-computed step times, layer placement under budgets, the
ranking."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from conftest import toy_spec
from offload.common.config import Policy
from offload.common.errors import OffloadError
from offload.common.hardware import ComputeUnit, HardwareProfile
from offload.scheduler.cost.attention_cost import SEQ_OVERHEAD
from offload.scheduler.cost.predict import LAYER_OVERHEAD, Budgets, Candidate, Workload, matmul_rate, predict
from offload.scheduler.cost.search import RING_SLOTS, best, place_layers, search

MB = 10**6

# 4 layers of 1e6 parameters (2 MB in bf16); heads 4 x 16, 2 KV heads: 256 bytes of KV per token and layer
SHAPE = toy_spec(layer=1_000_000, embed=64_000, head=64_064, name="toy")


def candidate(batch: int, micro_batches: int, layers: tuple[int, int, int], ring_slots: int = RING_SLOTS) -> Candidate:
    """`layers`: (device, host, nvme) counts; a ring only where layers stream from disk (as on a CPU machine)."""
    return Candidate(batch, micro_batches, Policy.from_counts(*layers, ring_slots=ring_slots if layers[2] else 0))


def unit(memory: int, bandwidth: float, flops: float, curve=()) -> ComputeUnit:
    return ComputeUnit(memory, bandwidth, {"bfloat16": flops}, {"bfloat16": tuple(curve)} if curve else {})


def cpu_machine(disk_read: float = 1e9, flops: float = 1e12, ram: int = 10_000 * MB) -> HardwareProfile:
    ram_unit = unit(ram, 1e10, flops)
    return HardwareProfile("cpu box", "cpu", ram_unit, ram_unit, 0.0, 0.0, disk_read, disk_read, "test")


def gpu_machine(device_memory: int = 100 * MB, host_memory: int = 1000 * MB) -> HardwareProfile:
    return HardwareProfile(
        "gpu box",
        "cuda",
        unit(device_memory, 1e12, 1e14),
        unit(host_memory, 1e11, 1e12),
        1e10,
        1e10,
        2e9,
        1e9,
        "test",
    )


def test_matmul_rate_interpolates_the_curve_in_log_rows():
    u = unit(0, 1e10, 5e11, curve=[(1, 1e9), (16, 1e11), (256, 4e11)])
    assert matmul_rate(u, "bfloat16", 1) == 1e9
    assert matmul_rate(u, "bfloat16", 16) == 1e11
    assert matmul_rate(u, "bfloat16", 4) == pytest.approx(1e9 + 0.5 * (1e11 - 1e9))  # halfway in log2
    assert matmul_rate(u, "bfloat16", 4096) == 4e11  # flat past the last point
    flat = unit(0, 1e10, 5e11)
    assert matmul_rate(flat, "bfloat16", 3) == 5e11
    with pytest.raises(OffloadError, match="float16"):
        matmul_rate(flat, "float16", 8)


def test_disk_bound_decode_step_costs_the_reads():
    hw = cpu_machine(disk_read=1e9, flops=1e15)  # compute is nearly free: the disk sets the pace
    cand = candidate(1, 1, (0, 0, 4))
    p = predict(SHAPE, hw, Workload(prompt_len=8, gen_len=3), cand)
    per_layer_read = 2e6 / 1e9  # 2 MB of bf16 weights at 1 GB/s
    # each decode step reads the four layers; compute per layer is far smaller, so the layer costs its read
    head = max(2 * 64_000 * 1 / 1e15, 64_000 * 2 / 1e10)  # the LM head's weights
    assert p.decode_seconds == pytest.approx(2 * (4 * per_layer_read + head))
    assert p.resources["disk"] == pytest.approx(3 * 4 * per_layer_read)  # prefill + 2 decode steps
    assert p.bound == "disk"
    assert p.generated_tokens == 3 and p.rounds == 1


def test_compute_bound_prefill_is_the_roofline_of_its_gemms_and_attention():
    hw = cpu_machine(flops=1e11)
    cand = candidate(2, 1, (4, 0, 0))
    p = predict(SHAPE, hw, Workload(prompt_len=100, gen_len=1), cand)
    rows = 2 * 100
    gemm = max(2 * 1e6 * rows / 1e11, 2e6 / 1e10)
    attention = 2.0 * (2 * 4 * 16) * 100 * 100 / 2 * 2 / 1e11 + 2 * SEQ_OVERHEAD
    head = max(2 * 64_000 * 2 / 1e11, 64_000 * 2 / 1e10)
    # non-GEMM traffic per token: norms 2*7*4*64 + rope 5*96*2 + KV write 2*32*2 + residuals 6*64*2 + MLP 5*5144*2
    # (5144 = the MLP width behind 1e6 parameters, attention's 12,288 removed, over 3 * 64)
    elementwise = rows * (3584 + 960 + 128 + 768 + 51_440) / 1e10
    assert p.prefill_seconds == pytest.approx(4 * (LAYER_OVERHEAD + gemm + elementwise + attention) + head)
    assert p.decode_seconds == 0.0
    assert p.bound == "compute"


def test_measured_curves_price_the_rest_of_a_layer():
    # the probe's elementwise and attention curves replace the memory-bandwidth and GEMM-rate guesses
    import dataclasses

    plain = cpu_machine(flops=1e11)
    measured = dataclasses.replace(
        plain.device,
        elementwise_curve={"bfloat16": ((1, 1e8), (100, 2e9), (1000, 4e9))},
        prefill_attention_curve={"bfloat16": ((10, 1e8), (100, 1e9))},
        decode_attention_curve={"bfloat16": ((10, 1e8), (1000, 2e9))},
    )
    hw = dataclasses.replace(plain, device=measured, host=measured)
    cand = candidate(2, 1, (4, 0, 0))
    p = predict(SHAPE, hw, Workload(prompt_len=100, gen_len=2), cand)
    q = predict(SHAPE, plain, Workload(prompt_len=100, gen_len=2), cand)
    rows, per_token = 200, 3584 + 960 + 128 + 768 + 51_440  # the elementwise bytes of the test above
    # 200 rows: halfway between 100 and 1000 rows in log, 3e9 bytes/s; prefill attention at 100 tokens: 1e9 FLOP/s
    elementwise = rows * per_token / (2e9 + math.log(2) / math.log(10) * 2e9)
    attention = 2 * 2.0 * (2 * 4 * 16) * 100 * 100 / 2 / 1e9  # no SEQ_OVERHEAD: the measured calls include it
    plain_elementwise = rows * per_token / 1e10
    plain_attention = 2.0 * (2 * 4 * 16) * 100 * 100 / 2 * 2 / 1e11 + 2 * SEQ_OVERHEAD
    delta = 4 * (elementwise + attention - plain_elementwise - plain_attention)
    assert p.prefill_seconds - q.prefill_seconds == pytest.approx(delta)
    # decode: 2 queries over 101 tokens of K and V (2 heads x 16, bf16), at the curve's rate at 101 tokens
    kv = 101 * 2 * 2 * 16 * 2
    decode_rate = 1e8 + math.log(10.1) / math.log(100) * (2e9 - 1e8)
    one_row = 1 * per_token
    decode_delta = 4 * (
        2 * kv / decode_rate
        - 2 * (3 * kv / 1e10 + SEQ_OVERHEAD)
        + 2 * one_row / (1e8 + math.log(2) / math.log(100) * (2e9 - 1e8))  # 2 rows on the elementwise curve
        - 2 * one_row / 1e10
    )
    assert p.decode_seconds - q.decode_seconds == pytest.approx(decode_delta)


def test_resident_layers_and_the_head_use_the_packed_gemm_rate_on_a_cpu():
    import dataclasses

    plain = cpu_machine(flops=1e11)
    unit = dataclasses.replace(plain.device, packed_matmul_curve={"bfloat16": ((1, 4e11), (4096, 4e11))})
    packed = dataclasses.replace(plain, device=unit, host=unit)
    work = Workload(prompt_len=100, gen_len=1)
    # the LM head for 64 sequences: compute-bound both ways (128 kB of weights take 12.8 us at 1e10 B/s)
    head_saved = 2 * 64_000 * 64 * (1 / 1e11 - 1 / 4e11)
    # all resident: every GEMM at 4e11 instead of 1e11 FLOP/s (the prefill here is compute-bound)
    resident = candidate(64, 1, (4, 0, 0))
    p, q = predict(SHAPE, packed, work, resident), predict(SHAPE, plain, work, resident)
    assert q.prefill_seconds - p.prefill_seconds == pytest.approx(
        4 * 2 * 1e6 * 6400 * (1 / 1e11 - 1 / 4e11) + head_saved
    )
    # streamed layers stay dense: only the head gains
    streamed = candidate(64, 1, (0, 0, 4))
    p, q = predict(SHAPE, packed, work, streamed), predict(SHAPE, plain, work, streamed)
    assert q.resources["compute"] - p.resources["compute"] == pytest.approx(head_saved)
    assert matmul_rate(unit, "bfloat16", 8, packed=True) == 4e11 and matmul_rate(unit, "bfloat16", 8) == 1e11


def test_a_measured_layer_floor_binds_small_layers_only():
    import dataclasses

    plain = cpu_machine(flops=1e11)
    work = Workload(prompt_len=100, gen_len=2)
    cand = candidate(1, 1, (4, 0, 0))
    base = predict(SHAPE, plain, work, cand)

    def with_floor(seconds):
        unit = dataclasses.replace(plain.device, layer_floor={"bfloat16": seconds})
        return predict(SHAPE, dataclasses.replace(plain, device=unit, host=unit), work, cand)

    # a decode layer here: 1e6 parameters at 1 row on a flat 1e11 FLOP/s and 1e10 B/s = 0.2 ms of weight reads,
    # plus elementwise and attention: a floor of 1 ms replaces all of it; one of 1 us changes nothing
    decode_layer = (base.decode_seconds - max(2 * 64_000 / 1e11, 64_000 * 2 / 1e10)) / 4 - LAYER_OVERHEAD
    assert 0 < decode_layer < 1e-3
    assert with_floor(1e-3).decode_seconds == pytest.approx(base.decode_seconds + 4 * (1e-3 - decode_layer))
    assert with_floor(1e-6).decode_seconds == base.decode_seconds
    assert with_floor(1e-6).prefill_seconds == base.prefill_seconds


def test_a_measured_floor_curve_prices_each_row_count_and_a_mixed_step_counts_it_once():
    from offload.scheduler.cost.predict import layer_floor_seconds, make_context, mixed_step_seconds

    plain = cpu_machine(flops=1e13)  # the work itself far under any floor
    curve = {"bfloat16": ((1, 1e3), (128, 64e3))}  # rows/s: 1 ms at one row, 2 ms at 128
    unit = dataclasses.replace(plain.device, layer_floor={"bfloat16": 5e-3}, layer_floor_curve=curve)
    floored = dataclasses.replace(plain, device=unit, host=unit)
    assert layer_floor_seconds(unit, "bfloat16", 1) == pytest.approx(1e-3)
    assert layer_floor_seconds(unit, "bfloat16", 128) == pytest.approx(2e-3)  # the curve, not the one-row floor
    assert layer_floor_seconds(unit, "bfloat16", 0) == 0
    assert layer_floor_seconds(plain.device, "bfloat16", 8) == 0  # no floor measured: none
    ctx, cand = make_context(SHAPE, floored, "bfloat16", 16), candidate(8, 1, (4, 0, 0))
    decode = mixed_step_seconds(ctx, cand, 1, 128, 0, 128)
    prefill = mixed_step_seconds(ctx, cand, 0, 128, 1, 128)
    assert decode == pytest.approx(4 * (1e-3 + LAYER_OVERHEAD), rel=0.05)
    assert prefill == pytest.approx(4 * (2e-3 + LAYER_OVERHEAD), rel=0.05)
    both = mixed_step_seconds(ctx, cand, 1, 128, 1, 128)  # 129 rows: the floor once, at 129 rows, and the decode
    # part's own work beside it (a one-row GEMM's weight read: 0.25 ms a layer here)
    assert 4 * (layer_floor_seconds(unit, "bfloat16", 129) + 2 * LAYER_OVERHEAD) <= both
    assert both < decode + prefill - 4 * 0.5e-3  # not the one-row floor again


def test_a_decode_step_fills_micro_batches_of_the_prefill_token_budget():
    # 8 prompts of 64 tokens in 4 micro-batches: a budget of 128 tokens, which one decode step of 8 tokens fits
    hw = cpu_machine(flops=1e11)
    work = Workload(prompt_len=64, gen_len=4)
    split = predict(SHAPE, hw, work, candidate(8, 4, (4, 0, 0)))
    whole = predict(SHAPE, hw, work, candidate(8, 1, (4, 0, 0)))
    assert split.decode_seconds == whole.decode_seconds
    assert split.prefill_seconds > whole.prefill_seconds  # 4 x LAYER_OVERHEAD, smaller GEMMs: never cheaper
    assert candidate(8, 4, (4, 0, 0)).decode_micro_batches(64) == 1
    assert candidate(8, 8, (4, 0, 0)).decode_micro_batches(1) == 8  # a budget of one token: one per micro-batch
    assert candidate(10, 4, (4, 0, 0)).decode_micro_batches(2) == 2  # a budget of 5 tokens: 10 tokens need 2


def test_throughput_rises_with_batch_while_disk_bound_then_flattens():
    hw = cpu_machine(disk_read=1e9, flops=1e10)
    work = Workload(prompt_len=16, gen_len=8)
    preds = [predict(SHAPE, hw, work, candidate(b, 1, (0, 0, 4))) for b in (1, 2, 4, 8, 64, 512, 2048)]
    rates = [p.tokens_per_second for p in preds]
    assert rates == sorted(rates)
    # a decode step of 1 or 2 sequences costs its reads alone: twice the tokens for the same time
    assert preds[1].decode_seconds == pytest.approx(preds[0].decode_seconds, rel=0.02)
    assert rates[-1] / rates[-2] < 1.2  # compute-bound by then: more batch buys little
    assert preds[-1].bound == "compute"


def test_place_layers_fills_device_then_host_then_disk():
    hw = cpu_machine(ram=10_000 * MB)
    work = Workload(prompt_len=8, gen_len=8)
    ring = dict(ring_slots=2)
    fixed = predict(SHAPE, hw, work, candidate(1, 1, (0, 0, 4), **ring)).memory["device"] - 2 * 2_000_000
    budget = fixed + 3 * 2_000_000  # three layers' worth beside the embedding, head, KV cache and activations
    # with one layer's room in host RAM, nothing streams: no ring, three resident, one in host RAM
    host_one = place_layers(SHAPE, hw, work, 1, 1, budgets=Budgets(budget, 2_000_000), **ring).policy
    assert host_one == Policy.from_counts(3, 1, 0)
    # with none, layers stream through a ring of two slots, which leaves room for one resident layer
    cand = place_layers(SHAPE, hw, work, 1, 1, budgets=Budgets(budget, 0), **ring)
    assert cand.policy == Policy.from_counts(1, 0, 3, ring_slots=2)
    p = predict(SHAPE, hw, work, cand, budgets=Budgets(budget, 0))
    assert p.fits and p.memory["device"] == budget and p.memory["host"] == 0
    everything = place_layers(SHAPE, hw, work, 1, 1, budgets=Budgets(device=fixed + 4 * 2_000_000), **ring)
    assert everything.policy == Policy(("device",) * 4)  # all layers fit: no ring is needed
    # on CUDA host layers pass through the device ring too; disk reads also need two pinned staging slots, so
    # host RAM for two layers holds either two layers (then one still streams, with no room to stage) or staging
    gpu = gpu_machine(device_memory=10_000 * MB, host_memory=4 * 2_000_000)
    host_three = place_layers(SHAPE, gpu, work, 1, 1, budgets=Budgets(budget), **ring).policy
    assert host_three == Policy.from_counts(1, 3, 0, ring_slots=2)
    two = Budgets(budget, 2 * 2_000_000)
    assert place_layers(SHAPE, gpu, work, 1, 1, budgets=two, **ring).policy == Policy.from_counts(1, 0, 3, ring_slots=2)
    with pytest.raises(ValueError, match="at least 2 slots, got 0"):  # host layers on CUDA need the ring too
        predict(SHAPE, gpu, work, Candidate(1, 1, Policy.from_counts(1, 3, 0)))


def test_overflow_says_by_how_much_a_kv_cache_is_too_big():
    hw = cpu_machine()
    work = Workload(prompt_len=1000, gen_len=24)  # 1024 tokens: 64 blocks of 16
    small = predict(SHAPE, hw, work, candidate(1, 1, (0, 0, 4)))
    budget = small.memory["device"]
    big = predict(SHAPE, hw, work, candidate(2, 1, (0, 0, 4)), budgets=Budgets(device=budget))
    kv_per_seq = 1024 * 4 * 256 * 2  # tokens x layers x (K+V of 2 heads x 16 dims) x bf16
    activation_delta = big.memory["device"] - budget - kv_per_seq
    assert not big.fits
    assert big.overflow == {"device": kv_per_seq + activation_delta}
    assert activation_delta > 0  # the second sequence's activations and logits count too


def test_search_ranks_fitting_policies_by_throughput_and_never_breaks_a_budget():
    rng = random.Random(0)
    for _ in range(20):
        hw = gpu_machine(device_memory=rng.randint(10, 60) * MB, host_memory=rng.randint(0, 20) * MB)
        work = Workload(prompt_len=rng.choice([16, 128]), gen_len=rng.choice([4, 16]))
        budgets = Budgets(device=rng.randint(8, 60) * MB)
        preds = search(SHAPE, hw, work, budgets=budgets, batches=[1, 4, 16, 64])
        fits = [p for p in preds if p.fits]
        assert [p.tokens_per_second for p in fits] == sorted((p.tokens_per_second for p in fits), reverse=True)
        for p in fits:
            assert p.memory["device"] <= budgets.device and p.memory["host"] <= hw.host.memory
        if fits:
            assert best(preds) is fits[0]


def test_host_kv_on_cuda_is_searched_and_runnable():
    """The engine runs KV in host RAM (--kv-host-memory: sequences past the device part attend there)."""
    hw = gpu_machine(device_memory=30 * MB, host_memory=2000 * MB)
    preds = search(SHAPE, hw, Workload(prompt_len=512, gen_len=32), batches=[64])
    tiers = {p.candidate.kv_tier for p in preds}
    assert tiers == {"device", "host"}
    assert not any(p.unsupported for p in preds)
    runnable = best(preds, runnable_only=True)
    assert runnable is best(preds)


def test_host_kv_on_cuda_attends_where_the_engine_would():
    """Host KV on CUDA: a prompt's attention (compute) is priced on the device with its K/V crossing the link; a
    decode step's stays on the CPU (host busy, only the query and output cross) when the link is slower than the
    CPU's reads of the cache, and moves to the device when the link is fast."""
    hw = gpu_machine(device_memory=30 * MB, host_memory=2000 * MB)  # host: 100 GB/s, 1 TFLOP/s; link 10 GB/s
    cand = Candidate(8, 1, Policy.from_counts(4, 0, 0), kv_tier="host")
    prompt = predict(SHAPE, hw, Workload(prompt_len=2048, gen_len=1), cand)
    assert prompt.resources["host"] == 0.0  # the prompt's attention ran on the device
    slow = predict(SHAPE, hw, Workload(prompt_len=16, gen_len=64), cand)
    assert slow.resources["host"] > 0.0  # decode attends on the CPU: the link would carry the cache
    fast = dataclasses.replace(hw, host_to_device=1e13)
    assert predict(SHAPE, fast, Workload(prompt_len=16, gen_len=64), cand).resources["host"] == 0.0


def test_cpu_machine_shares_one_ram_between_device_arena_and_host_tier():
    hw = cpu_machine(ram=100 * MB)
    preds = search(SHAPE, hw, Workload(16, 4), budgets=Budgets(device=40 * MB), batches=[1])
    assert {p.candidate.kv_tier for p in preds} == {"device"}  # host KV is the same RAM on a CPU machine
    for p in preds:
        assert p.memory["device"] + p.memory["host"] <= 100 * MB or not p.fits


def test_requests_make_rounds():
    hw = cpu_machine()
    p = predict(SHAPE, hw, Workload(16, 4, requests=10), candidate(4, 1, (4, 0, 0)))
    assert p.rounds == 3 and p.generated_tokens == 40
    assert p.total_seconds == pytest.approx(3 * (p.prefill_seconds + p.decode_seconds))
    assert math.isclose(p.tokens_per_second, 40 / p.total_seconds)
