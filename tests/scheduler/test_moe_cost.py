"""offload.scheduler.cost.moe_cost and the cost model's mixtures: experts touched per step, the expert cache's hit rate,
the bytes expert streaming reads, and the search and report offering it."""

from __future__ import annotations

import dataclasses

import pytest
from test_cost import MB, cpu_machine, gpu_machine

from offload.common.config import Policy
from offload.common.model_config import parse_model_config
from offload.planner.report import report
from offload.scheduler.cost.moe_cost import distinct_experts, expert_params, hit_rate, routed_params, sparse_layers
from offload.scheduler.cost.predict import Budgets, Candidate, Workload, predict
from offload.scheduler.cost.search import AUTO_EXPERT_CACHE, best, place_layers, search

MIXTRAL = parse_model_config(
    {
        "architectures": ["MixtralForCausalLM"],
        "vocab_size": 1000,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "torch_dtype": "bfloat16",
    },
    "test",
    "toy-mixtral",
)
EXPERT_BYTES = 3 * 64 * 128 * 2  # gate, up, down in bf16


def test_distinct_experts_grow_from_k_to_every_expert():
    assert distinct_experts(MIXTRAL, 1) == pytest.approx(2.0)
    assert distinct_experts(MIXTRAL, 8) == pytest.approx(8 * (1 - 0.75**8))  # 7.2
    assert distinct_experts(MIXTRAL, 1000) == pytest.approx(8.0)
    assert expert_params(MIXTRAL) * 2 == EXPERT_BYTES and routed_params(MIXTRAL) == 8 * expert_params(MIXTRAL)


def test_hit_rate_is_the_caches_share_of_the_sparse_layers_experts():
    assert hit_rate(MIXTRAL, 8) == 8 / 32 and hit_rate(MIXTRAL, 64) == 1.0
    qwen = dataclasses.replace(MIXTRAL, architecture="Qwen3MoeForCausalLM", dense_layers=(0,))
    assert sparse_layers(qwen) == 3 and hit_rate(qwen, 6) == 6 / 24


def _streaming(batch: int, slots: int) -> Candidate:
    return Candidate(batch, 1, Policy.from_counts(4, 0, 0), expert_cache=slots * EXPERT_BYTES)


def test_expert_streaming_reads_the_misses_of_the_touched_experts_and_waits_for_them():
    hw = cpu_machine(disk_read=1e6)  # slow reads: they dominate
    work = Workload(prompt_len=1, gen_len=5)
    p = predict(MIXTRAL, hw, work, _streaming(1, 8))
    # every step (prefill of one token, then 4 decode steps) touches 2 experts in each of 4 layers, 3/4 not cached
    reads = 5 * 4 * 2 * (1 - 8 / 32) * EXPERT_BYTES
    assert p.resources["disk"] == pytest.approx(reads / 1e6)
    # the reads overlap no other work, and the experts' compute only as a pipeline would: of each layer's two
    # experts, one computes while the other is read (20 layer steps)
    from offload.scheduler.cost.gemm_rates import gemm_seconds
    from offload.scheduler.cost.moe_cost import EXPERT_OVERHEAD

    one = gemm_seconds(hw.device, "bfloat16", expert_params(MIXTRAL), EXPERT_BYTES, 1) + EXPERT_OVERHEAD
    assert p.round_seconds == pytest.approx(p.resources["disk"] + p.resources["compute"] - 20 * one)
    assert p.memory["device"] >= 8 * EXPERT_BYTES
    whole = predict(MIXTRAL, hw, work, Candidate(1, 1, Policy.from_counts(4, 0, 0)))
    assert whole.resources["disk"] == 0.0  # every expert resident with its layer


def test_the_first_token_waits_for_every_expert_its_prompts_touch_from_an_empty_cache():
    hw = cpu_machine(disk_read=1e6)  # slow reads: they dominate
    work = Workload(prompt_len=8, gen_len=4)
    p = predict(MIXTRAL, hw, work, _streaming(1, 24))
    touched = 4 * distinct_experts(MIXTRAL, 8) * EXPERT_BYTES / 1e6  # seconds to read what the prompt touches
    # the cache of 24 starts empty: the first prompt reads every expert it touches, a later one the quarter of them
    # the cache misses (24 of the 32 held)
    assert touched <= p.first_prefill_seconds == p.ttft_seconds < 1.1 * touched
    assert touched / 4 <= p.prefill_seconds < 1.1 * touched / 4
    assert p.round_seconds == p.prefill_seconds + p.decode_seconds  # rounds are priced warm
    resident = predict(MIXTRAL, hw, work, Candidate(1, 1, Policy.from_counts(4, 0, 0)))
    assert resident.first_prefill_seconds is None and resident.ttft_seconds == resident.prefill_seconds


def test_a_large_decode_step_reads_every_experts_weights_from_memory():
    hw = cpu_machine(flops=1e18)  # memory-bound GEMMs
    work = Workload(prompt_len=1, gen_len=2)
    small = predict(MIXTRAL, hw, work, Candidate(1, 1, Policy.from_counts(4, 0, 0)))
    large = predict(MIXTRAL, hw, work, Candidate(256, 1, Policy.from_counts(4, 0, 0)))
    expert_share = 8 * EXPERT_BYTES / (MIXTRAL.params.active_layer * 2 + 6 * EXPERT_BYTES)
    assert large.decode_seconds > small.decode_seconds * (1 + expert_share)  # 8 experts' bytes, not 2


def test_auto_expert_cache_keeps_every_dense_part_resident_and_fills_the_budget_but_one_expert():
    budget = 2 * MB
    work = Workload(prompt_len=16, gen_len=16)
    cand = place_layers(
        MIXTRAL, cpu_machine(), work, 1, 1, budgets=Budgets(device=budget), expert_cache=AUTO_EXPERT_CACHE
    )
    assert cand.policy.counts == (4, 0, 0) and cand.expert_cache >= 2 * EXPERT_BYTES
    p = predict(MIXTRAL, cpu_machine(), work, cand, budgets=Budgets(device=budget))
    # the cache takes what the dense parts leave, less one expert for what the engine charges beyond this count
    assert p.fits and 0 <= budget - p.memory["device"] - EXPERT_BYTES < 16


def test_search_offers_expert_streaming_for_mixtures_only_on_either_device():
    work = Workload(prompt_len=16, gen_len=8)
    preds = search(MIXTRAL, cpu_machine(), work, budgets=Budgets(device=2 * MB), batches=[1, 4])
    assert {bool(p.candidate.expert_cache) for p in preds} == {False, True}
    assert all(not p.unsupported for p in preds)
    gpu = search(MIXTRAL, gpu_machine(device_memory=2 * MB), work, batches=[1])
    assert {bool(p.candidate.expert_cache) for p in gpu} == {False, True} and all(not p.unsupported for p in gpu)
    dense = dataclasses.replace(MIXTRAL, num_experts=0, experts_per_token=0, architecture="LlamaForCausalLM")
    dense = dataclasses.replace(dense, params=None)
    assert not any(p.candidate.expert_cache for p in search(dense, cpu_machine(), work, batches=[1]))


def test_on_cuda_each_miss_is_copied_or_run_on_the_cpu_whichever_is_priced_faster():
    """A miss waits on the router for its read, then for its copy over the link or its run on the CPU; the host
    keeps as many experts again, as read, in pinned RAM."""
    work = Workload(prompt_len=1, gen_len=5)
    misses = 5 * 4 * 2 * (1 - 8 / 32)  # as in the CPU case above
    gpu = gpu_machine(device_memory=2 * MB)
    fast = dataclasses.replace(gpu, host_to_device=1e13)  # a copy beats reading the expert on a 100 GB/s host
    p = predict(MIXTRAL, fast, work, _streaming(1, 8))
    assert p.resources["link"] == pytest.approx(misses * EXPERT_BYTES / 1e13, rel=1e-6)
    assert p.memory["host"] >= 8 * EXPERT_BYTES
    q = predict(MIXTRAL, gpu, work, _streaming(1, 8))  # a 10 GB/s link: the host reads the expert 10x faster
    assert 0 < q.resources["link"] < misses * EXPERT_BYTES / 1e10 / 5  # the misses ran on the CPU instead
    assert q.round_seconds > p.round_seconds


def test_the_plan_names_the_expert_cache_flag_and_what_a_step_touches():
    from offload.common.sizes import typed_size
    from offload.planner.commands import expert_cache_size

    work = Workload(prompt_len=16, gen_len=8)
    budgets = Budgets(device=int(1.5 * MB), host=0)
    hw = cpu_machine(disk_read=1e7)
    preds = search(MIXTRAL, hw, work, budgets=budgets, batches=[1, 2])
    winner = best(preds)
    assert winner.candidate.expert_cache  # the whole layers do not fit beside a ring: only experts stream
    text = report(MIXTRAL, hw, work, "bfloat16", budgets, preds, 3)
    flag = typed_size(expert_cache_size(MIXTRAL, hw, "bfloat16", winner.candidate), 0)  # its whole experts, typed
    assert "+E" in text and f"--expert-cache-memory {flag}" in text
    assert "a decode step touches per layer (uniform routing) batch 1: 2.0, batch 8: 7.2" in text
    assert "a chosen expert is cached with chance" in text and "experts with their layers" in text


def test_misses_read_at_the_small_read_rate_up_to_its_size_and_the_large_rate_from_the_extent():
    from offload.common.hardware import LARGE_READ_BYTES, SMALL_READ_BYTES
    from offload.scheduler.cost.moe_cost import expert_read_rate

    hw = dataclasses.replace(cpu_machine(), disk_read=2e9, disk_read_small=0.5e9)
    assert expert_read_rate(hw, 100_000) == expert_read_rate(hw, SMALL_READ_BYTES) == 0.5e9
    assert expert_read_rate(hw, LARGE_READ_BYTES) == expert_read_rate(hw, 1 << 30) == 2e9
    middle = (SMALL_READ_BYTES * LARGE_READ_BYTES) ** 0.5  # halfway in log size: halfway in log rate
    assert expert_read_rate(hw, middle) == pytest.approx(1e9)
    assert expert_read_rate(dataclasses.replace(hw, disk_read_small=None), 100_000) == 2e9  # an older profile


def test_the_placed_layers_lose_the_average_layers_routed_experts():
    """DeepSeek-V3's leading dense layers hold no experts: the average layer (which ParamCounts counts) has fewer
    routed parameters than a sparse one, and expert streaming takes out only those."""
    from offload.planner.models import load_model_spec
    from offload.scheduler.cost.moe_cost import average_routed_params
    from offload.scheduler.cost.predict import make_context

    spec = load_model_spec("deepseek-v3")
    assert average_routed_params(spec) == routed_params(spec) * 58 / 61
    ctx = make_context(spec, cpu_machine(), "bfloat16", 16)
    streamed = Candidate(1, 1, Policy(("device",) * 61), expert_cache=1 << 30)
    assert ctx.placed_params(streamed) == spec.params.layer - int(routed_params(spec) * 58 / 61) > 0


def test_expert_reads_pipeline_with_the_experts_compute():
    from offload.scheduler.cost.moe_cost import ExpertStep, expert_wait

    step = ExpertStep(compute_seconds=8.0, read_bytes=1.0, one_seconds=1.0)  # 8 experts of 1 s each
    assert expert_wait(step, 4.0, 0.5) == 0.5  # reads hidden but the first one's
    assert expert_wait(step, 20.0, 2.5) == 20.0 + 1.0 - 8.0  # compute hidden but the last expert's
    assert expert_wait(ExpertStep(8.0, 0.0, one_seconds=1.0), 0.0, 0.0) == 0.0  # every expert cached
    # a quarter of a miss expected: its read (2 s) runs while the cached experts compute (7.75 s): nothing waits
    assert expert_wait(step, 0.5, 2.0) == 0.0
    # two experts, a tenth of a miss: the read outlasts the cached compute by 2.1 s, in a tenth of the steps
    assert expert_wait(ExpertStep(2.0, 1.0, one_seconds=1.0), 0.4, 4.0) == pytest.approx(0.1 * (4.0 - 1.9))


def test_gpt_oss_s_published_mxfp4_experts_are_priced_at_4_25_bits_and_only_they_run():
    """configs/models/gpt-oss-120b.json is the published config, its quantization_config MXFP4: the experts stay in
    their layers or stream by expert at 4.25 bits a weight, the rest at the compute dtype's width; 8- and 4-bit
    candidates would need a conversion that refuses gpt-oss."""
    from offload.planner.models import load_model_spec
    from offload.scheduler.cost.moe_cost import average_routed_params
    from offload.scheduler.cost.predict import make_context

    spec = load_model_spec("gpt-oss-120b")
    assert spec.mxfp4_experts
    ctx = make_context(spec, cpu_machine(), "bfloat16", 16)
    assert ctx.expert_bytes(16) == ctx.expert_bytes(4) == expert_params(spec) * 4.25 / 8
    whole = Candidate(1, 1, Policy(("device",) * spec.num_layers))
    routed = average_routed_params(spec)
    assert ctx.placed_bytes(whole) == pytest.approx((spec.params.layer - routed) * 2 + routed * 4.25 / 8, rel=1e-9)
    streamed = dataclasses.replace(whole, expert_cache=1 << 30)
    assert ctx.placed_bytes(streamed) == ctx.weight_bytes(ctx.placed_params(streamed), 16)
    work = Workload(prompt_len=16, gen_len=4)
    assert predict(spec, cpu_machine(ram=400_000 * MB), work, dataclasses.replace(whole, weight_bits=4)).unsupported
    assert not predict(spec, cpu_machine(ram=400_000 * MB), work, whole).unsupported


def test_quantized_products_at_a_few_rows_take_their_kernels_measured_curve():
    """A profile's measured curve of a quantized kernel prices its products up to the rows it covers; beyond them,
    and without such a curve, the dense curve scaled by the codes' bytes does."""
    from offload.common.quant import WeightQuant
    from offload.scheduler.cost.gemm_rates import gemm_seconds

    hw = cpu_machine()
    measured = dataclasses.replace(hw.device, gguf_matmul_curve={"bfloat16": ((1, 2e10), (8, 1e11), (32, 2e11))})
    params, codes = 4096 * 4096, 4096 * 4096 * 4.5 / 8
    assert gemm_seconds(measured, "bfloat16", params, codes, 8, kernel="gguf") == pytest.approx(2 * 8 * params / 1e11)
    scaled = [gemm_seconds(hw.device, "bfloat16", params, codes, rows) for rows in (8, 64)]
    assert gemm_seconds(measured, "bfloat16", params, codes, 64, kernel="gguf") == scaled[1]
    assert gemm_seconds(measured, "bfloat16", params, codes, 8, kernel="int4") == scaled[0]
    assert gemm_seconds(measured, "bfloat16", params, codes, 8) == scaled[0]

    # the cost model takes the curve for a GGUF model's products on a CPU device: a slower kernel, a slower step
    gguf = dataclasses.replace(MIXTRAL, quant=WeightQuant(4, 32, "gguf", stored_bits=4.5))
    work, cand = Workload(prompt_len=1, gen_len=4), Candidate(1, 1, Policy.from_counts(4, 0, 0), weight_bits=4)
    slow = dataclasses.replace(hw.device, gguf_matmul_curve={"bfloat16": ((1, 1e6), (32, 3.2e7))})
    plain, curved = (predict(gguf, dataclasses.replace(hw, device=u), work, cand) for u in (hw.device, slow))
    assert curved.decode_seconds > 10 * plain.decode_seconds


def test_a_decode_steps_gguf_rows_take_their_own_curve_where_the_profile_measured_one():
    """Where a decode step's GGUF rows take another kernel than a prompt's (AMX tiles), the profile's
    gguf_decode_matmul_curve prices the decode steps and gguf_matmul_curve the prompt's; without the first, both
    take the second."""
    from offload.common.quant import WeightQuant

    hw = cpu_machine()
    gguf = dataclasses.replace(MIXTRAL, quant=WeightQuant(4, 32, "gguf", stored_bits=4.5))
    work, cand = Workload(prompt_len=8, gen_len=4), Candidate(8, 1, Policy.from_counts(4, 0, 0), weight_bits=4)
    blocks = {"bfloat16": ((1, 1e6), (32, 3.2e7))}
    one = dataclasses.replace(hw.device, gguf_matmul_curve=blocks)
    two = dataclasses.replace(one, gguf_decode_matmul_curve={"bfloat16": ((1, 1e7), (32, 3.2e8))})
    plain, tiled = (predict(gguf, dataclasses.replace(hw, device=u), work, cand) for u in (one, two))
    assert tiled.decode_seconds < plain.decode_seconds / 3
    assert tiled.prefill_seconds == pytest.approx(plain.prefill_seconds, rel=1e-9)


def test_an_expert_is_priced_at_the_rows_it_takes_on_average_not_rounded_up():
    """A decode step of 8 sequences routes 16 token-experts over 7.2 distinct experts of 8 (2.2 rows each): each is
    priced between its kernel's time at 2 rows and at 3, not at 3 (a quantized kernel's time at a few rows is close to
    affine in them)."""
    from offload.scheduler.cost.gemm_rates import gemm_seconds
    from offload.scheduler.cost.moe_cost import EXPERT_OVERHEAD, expert_step

    unit = dataclasses.replace(cpu_machine().device, gguf_matmul_curve={"bfloat16": ((1, 1e10), (8, 5e10), (32, 6e10))})
    params, nbytes = expert_params(MIXTRAL), expert_params(MIXTRAL) * 4.5 / 8
    step = expert_step(MIXTRAL, unit, "bfloat16", nbytes, 8, 1, None, False, kernel="gguf")
    each = step.compute_seconds / distinct_experts(MIXTRAL, 8) - EXPERT_OVERHEAD
    at = {rows: gemm_seconds(unit, "bfloat16", params, nbytes, rows, kernel="gguf") for rows in (2, 3)}
    assert at[2] < each < at[3] - (at[3] - at[2]) / 10
