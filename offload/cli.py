"""`offload` command line: `offload generate`, `serve`, `batch`, `probe`, `convert`, `plan`.

Over 400 lines: one parser and one handler per command, and the flags `generate`, `serve` and `batch` share."""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

from offload.common.config import COLD_EXPERTS, EXPERT_PREFETCH, HOST_KV_ATTENTION, IO_BACKENDS, KV_GROUP_SIZES
from offload.common.dtypes import KV_DTYPES
from offload.common.errors import OffloadError
from offload.planner.report import add_plan_parser


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """The memory, placement and batching flags that `generate` and `serve` share (mapped by engine_config)."""
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    p.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    p.add_argument(
        "--kv-cache-memory",
        metavar="SIZE",
        help="KV cache size, e.g. 512MiB (default: 1GiB; with --device-memory and no --max-num-seqs, or --memory, "
        "sized by the cost model for the batch it picks)",
    )
    p.add_argument(
        "--device-memory",
        metavar="SIZE",
        help="budget for weights + KV cache on the compute device (e.g. 600MB); layers that do not fit "
        "are streamed from the checkpoint",
    )
    p.add_argument(
        "--memory",
        metavar="SIZE",
        help="cap on the whole process's resident memory on a CPU device (e.g. 2GiB), instead of --device-memory: "
        "the cost model sizes the batch, KV cache and device budget to what the process does not hold yet",
    )
    p.add_argument(
        "--host-memory",
        default="0",
        metavar="SIZE",
        help="host RAM that may keep layers read once instead of streaming them (default 0)",
    )
    p.add_argument(
        "--io-backend",
        default="auto",
        choices=IO_BACKENDS,
        help="NVMe reads: O_DIRECT thread pool (pread), DeepSpeed's AsyncIO op (aio), or auto (default): the faster "
        "of the two as `offload probe` measured them here, else aio only on CUDA",
    )
    p.add_argument(
        "--offload-dir",
        metavar="DIR",
        help="a folder on fast local disk: streamed layers stored in another dtype than the compute dtype are "
        "converted once and streamed from there (checksummed, reused by later runs)",
    )
    p.add_argument(
        "--disk-memory", metavar="SIZE", help="budget for the converted layers in --offload-dir (default: no budget)"
    )
    p.add_argument(
        "--kv-dtype",
        default="auto",
        choices=KV_DTYPES,
        help="KV cache format: auto (the compute dtype, default), a float dtype, or int8 / int4 / fp8, quantized per "
        "group along head_dim (fewer bytes in every tier)",
    )
    p.add_argument(
        "--kv-group-size",
        type=int,
        default=32,
        choices=KV_GROUP_SIZES,
        help="values along head_dim sharing one scale in an int8 / int4 / fp8 KV cache: 64 stores fewer scales, 32 "
        "keeps the error lower (default 32)",
    )
    p.add_argument(
        "--kv-host-memory",
        default="0",
        metavar="SIZE",
        help="host RAM for KV blocks demoted from the KV cache, kept for prefix reuse (default 0)",
    )
    p.add_argument(
        "--host-kv-attention",
        choices=HOST_KV_ATTENTION,
        default="auto",
        help="on CUDA, where sequences whose KV is in --kv-host-memory attend: on the CPU where the KV is (cpu), on "
        "the GPU over their blocks copied there each layer (device), or whichever the cost model prices faster for "
        "each micro-batch (auto, default: prompt chunks on the GPU, decode on the CPU where no profile is saved)",
    )
    p.add_argument(
        "--kv-disk-memory",
        default="0",
        metavar="SIZE",
        help="disk in --offload-dir for KV blocks demoted from host RAM; they persist, so later runs start warm "
        "(default 0)",
    )
    p.add_argument(
        "--no-kv-prefetch",
        action="store_true",
        help="read cached KV blocks from --kv-disk-memory only when a request is admitted, instead of while the "
        "step before computes",
    )
    p.add_argument(
        "--expert-cache-memory",
        default="0",
        metavar="SIZE",
        help="part of the device budget for a mixture's routed experts, read only when the router chooses them and "
        "cached by selection frequency; the rest of each layer is placed like a dense layer (default 0: off, "
        "whole layers stream)",
    )
    p.add_argument(
        "--expert-host-memory",
        default="0",
        metavar="SIZE",
        help="on CUDA, pinned host RAM keeping experts as read, from which the device's expert slots are filled "
        "(default 0: as many experts as those slots)",
    )
    p.add_argument(
        "--cold-experts",
        choices=COLD_EXPERTS,
        default="auto",
        help="on CUDA, where a chosen expert not on the device runs: copied there (device), on the CPU from host RAM, "
        "moving its tokens instead of its weights (cpu), or whichever the cost model prices faster for its tokens "
        "(auto, default)",
    )
    p.add_argument(
        "--expert-prefetch",
        choices=EXPERT_PREFETCH,
        default="router",
        help="how the next sparse layer's experts are prefetched while a layer computes: those its router chooses "
        "for the current hidden state (a copy of each router stays resident), or those selected most often "
        "(default router)",
    )
    p.add_argument(
        "--no-prefix-cache",
        action="store_true",
        help="compute every prompt in full instead of reusing the KV blocks of prefixes seen before",
    )
    p.add_argument("--show-placement", action="store_true", help="print each layer's tier and size before running")
    p.add_argument("--block-size", type=int, default=16, metavar="TOKENS", help="tokens per KV block")
    p.add_argument(
        "--max-num-seqs",
        type=int,
        metavar="N",
        help="sequences per step (default: 64; with --device-memory and no --kv-cache-memory, or --memory, the batch "
        "with the highest throughput the cost model predicts for these prompts on this machine)",
    )
    p.add_argument(
        "--max-step-tokens",
        type=int,
        default=4096,
        metavar="N",
        help="tokens computed per step: one per decoding sequence, the rest prefill chunks; longer prompts "
        "are prefilled in chunks interleaved with decoding (default 4096)",
    )


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="complete prompts with a model (default: the embedded demo model)",
        description="Complete prompts. Without --model, runs the embedded demo model "
        "(built once, locally, in your cache directory) on a few prompts.",
    )
    p.add_argument(
        "--model", metavar="DIR", help="Hugging Face model directory (config.json, *.safetensors, tokenizer)"
    )
    p.add_argument("--prompt", action="append", metavar="TEXT", help="a prompt; repeat for a batch")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user turn with the chat template")
    p.add_argument("--max-new-tokens", type=int, default=32, metavar="N")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, metavar="K", help="0 = no limit")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P")
    p.add_argument("--seed", type=int, help="seed for reproducible sampling")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string; repeatable")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    add_engine_flags(p)
    p.add_argument("--json", action="store_true", help="print one JSON object per completion, then the stats")
    p.set_defaults(run=_generate)


def engine_config(args: argparse.Namespace):
    """The EngineConfig that add_engine_flags' flags say (before the cost model sizes what they leave open)."""
    from offload.common.config import EngineConfig
    from offload.common.sizes import parse_size

    config = EngineConfig(
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        kv_cache_bytes=parse_size(args.kv_cache_memory or "1GiB", "--kv-cache-memory"),
        device_memory=None if args.device_memory is None else parse_size(args.device_memory, "--device-memory"),
        memory=None if args.memory is None else parse_size(args.memory, "--memory"),
        host_memory=parse_size(args.host_memory, "--host-memory"),
        io_backend=args.io_backend,
        max_num_seqs=args.max_num_seqs or 64,
        max_step_tokens=args.max_step_tokens,
        offload_dir=args.offload_dir,
        disk_memory=None if args.disk_memory is None else parse_size(args.disk_memory, "--disk-memory"),
        kv_dtype=args.kv_dtype,
        kv_group_size=args.kv_group_size,
        prefix_cache=not args.no_prefix_cache,
        kv_host_memory=parse_size(args.kv_host_memory, "--kv-host-memory"),
        kv_disk_memory=parse_size(args.kv_disk_memory, "--kv-disk-memory"),
        kv_prefetch=not args.no_kv_prefetch,
        expert_cache_memory=parse_size(args.expert_cache_memory, "--expert-cache-memory"),
        expert_prefetch=args.expert_prefetch,
        expert_host_memory=parse_size(args.expert_host_memory, "--expert-host-memory"),
        cold_experts=args.cold_experts,
        host_kv_attention=args.host_kv_attention,
    )
    fixed = args.kv_cache_memory is not None or args.max_num_seqs is not None
    if config.memory is not None and fixed:
        raise OffloadError("--memory sizes the batch and KV cache itself: drop --max-num-seqs and --kv-cache-memory")
    return config


def needs_plan(args: argparse.Namespace, config) -> bool:
    """A budget was given and neither the batch nor the KV cache: the cost model sizes both for the workload."""
    fixed = args.kv_cache_memory is not None or args.max_num_seqs is not None
    return (config.device_memory is not None or config.memory is not None) and not fixed


def _generate(args: argparse.Namespace) -> None:
    from offload.api import LLM, chat_ids, load_tokenizer
    from offload.common.config import SamplingParams
    from offload.demo import DEMO_PROMPTS, ensure_demo_model

    config = engine_config(args)
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
    )
    prompts = args.prompt if args.prompt is not None else list(DEMO_PROMPTS if args.model is None else [])
    if not prompts:
        raise OffloadError("--prompt is required with --model")
    if needs_plan(args, config):  # the user fixed neither the batch nor the KV cache: sized for these prompts
        tokenizer = load_tokenizer(_model_dir(args, ensure_demo_model))
        if args.chat:
            chats = [[{"role": "user", "content": p}] for p in prompts]
            lengths = [len(chat_ids(tokenizer, c)) for c in chats]
        else:
            lengths = [len(tokenizer(p)["input_ids"]) for p in prompts]
        config = planned_config(args, config, lengths, args.max_new_tokens)
    with LLM(args.model, config) as llm:  # closing writes the KV blocks queued for disk
        if args.show_placement:
            print(_placement_table(llm), file=sys.stderr if args.json else sys.stdout)
        if args.chat:
            completions = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
        else:
            completions = llm.generate(prompts, params)
    if args.json:
        for p, c in zip(prompts, completions, strict=True):
            print(
                json.dumps(
                    {
                        "prompt": p,
                        "text": c.text,
                        "finish_reason": c.finish_reason,
                        "prompt_tokens": c.prompt_tokens,
                        "completion_tokens": len(c.token_ids),
                    }
                )
            )
    else:
        for p, c in zip(prompts, completions, strict=True):
            print(f"\033[1m{p}\033[0m{c.text}" if sys.stdout.isatty() else f"{p}{c.text}")
            print()
    print(_summary(llm, completions), file=sys.stderr if args.json else sys.stdout)


def _model_dir(args: argparse.Namespace, ensure_demo_model) -> Path:
    return Path(args.model).expanduser() if args.model is not None else ensure_demo_model()


def planned_config(args: argparse.Namespace, config, lengths: list[int], max_new_tokens: int):
    """`config` with the batch, KV cache (and, under --memory, the device budget) the cost model picks for
    prompts of `lengths` tokens generating `max_new_tokens` each."""
    from offload.demo import ensure_demo_model
    from offload.planner.autoconfig import autoconfigure, describe

    model_dir = _model_dir(args, ensure_demo_model)
    planned, prediction = autoconfigure(model_dir, config, lengths, max_new_tokens)
    print(
        f"plan       {describe(prediction)} (the cost model's choice; --max-num-seqs or --kv-cache-memory fix it)",
        file=sys.stderr,
    )
    if config.memory is not None:
        from offload.common.sizes import format_size

        print(
            f"memory     cap {format_size(config.memory)}: {format_size(planned.device_memory)} of it for weights and "
            "KV cache on the device (the rest: what the process holds already, activations and a reserve)",
            file=sys.stderr,
        )
    return planned


def _summary(llm, completions) -> str:
    from offload.common.sizes import format_size
    from offload.kernels import dispatch

    s, pl = llm.stats, llm.placement
    reasons = ", ".join(f"{n} {r}" for r, n in sorted(Counter(c.finish_reason for c in completions).items()))
    kv_used = s.peak_kv_blocks * pl.block_size
    lines = [
        f"model      {llm.model_dir}",
        f"requests   {s.requests}: {s.prompt_tokens} prompt tokens, {s.generated_tokens} generated ({reasons})",
        f"time       {s.wall_seconds:.3f} s wall: prefill {s.prefill_seconds:.3f} s, decode {s.decode_seconds:.3f} s "
        f"in {s.steps} steps" + (f", {s.preemptions} preemptions" if s.preemptions else ""),
        f"speed      {s.tokens_per_second:.1f} tokens/s overall, {s.decode_tokens_per_second:.1f} tokens/s decoding",
        f"weights    {_weights_format(llm)}: {format_size(pl.weight_bytes)} resident on {pl.device}, "
        f"{format_size(pl.host_weight_bytes)} in host RAM, {format_size(pl.streamed_bytes_per_pass)} streamed "
        f"from disk per step{_embedding_note(llm)} ({format_size(pl.checkpoint_bytes_read)} read in all)",
        f"memory     device peak {format_size(pl.device_peak)}"
        + (f" of a {format_size(pl.device_budget)} budget" if pl.device_budget is not None else " (no budget)")
        + f", host peak {format_size(pl.host_peak)}",
        f"kv cache   {format_size(pl.kv_bytes)} {llm.kv.format} on {pl.device}: {pl.kv_blocks} blocks of "
        f"{pl.block_size} tokens, peak {s.peak_kv_blocks} blocks ({kv_used} token slots)",
        f"prefix     {_prefix_line(llm, s)}",
    ]
    if pl.spill is not None:
        lines.append(f"spill      {_spill_line(pl.spill, llm.policy.layer_tiers)}")
    if s.experts is not None:
        x = s.experts
        lines.append(
            f"experts    {x.hits} hits, {x.misses} misses ({x.hit_rate:.0%} hit rate), {format_size(x.bytes_read)} "
            f"read; prefetch by {llm.config.expert_prefetch}: {x.prefetch_used} of {x.prefetches} used "
            f"({x.prefetch_accuracy:.0%} accuracy); "
            f"{format_size(int(s.bytes_per_token))} of weights read per generated token"
        )
        if llm.expert_slots is not None:
            lines.append(
                f"           on {llm.device}: {x.device_hits} hits in its expert slots, {format_size(x.h2d_bytes)} "
                f"copied to it; {x.cpu_runs} cold experts run on the CPU (--cold-experts {llm.config.cold_experts})"
            )
    io = f"i/o        backend {llm.io_backend.name} ({llm.io_backend.why})"
    if s.bytes_read:
        io += (
            f"; {format_size(s.bytes_read)} read at {s.read_gbps:.2f} GB/s; "
            f"compute {s.compute_seconds:.3f} s, "
            f"stalled on reads {s.stall_seconds:.3f} s, overlap efficiency {s.overlap_efficiency:.2f}"
        )
    if llm.backend.lock_note:  # the ring asked the backend for page-locked buffers and was refused
        io += f"; {llm.backend.lock_note}"
    lines.append(io)
    if kernels := dispatch.summary():
        lines.append(f"kernels    {kernels}")
    return "\n".join(lines)


def _weights_format(llm) -> str:
    quant = llm.spec.quant
    if quant is None:
        return llm.placement.dtype
    return f"{llm.placement.dtype}, layer matrices int{quant.bits} ({quant.name})"


def _prefix_line(llm, s) -> str:
    """Prefix reuse in the last run, and what the KV tiers below the device moved."""
    from offload.common.sizes import format_size

    if not llm.tables.prefix_caching:
        return "reuse off (--no-prefix-cache): every prompt token computed"
    line = (
        f"{s.prefix_hit_tokens} of {s.prefix_lookup_tokens} prompt tokens from cached blocks "
        f"({s.prefix_hit_rate:.0%} hit rate), {s.prefill_tokens} computed"
    )
    tiers = llm.kv_tiers
    if tiers is not None:
        parts = []
        if tiers.host_slots:
            parts.append(f"host RAM {tiers.host_blocks}/{tiers.host_slots} blocks")
        if tiers.disk is not None:
            parts.append(f"disk {tiers.disk.blocks} blocks ({format_size(tiers.disk.used)})")
        line += (
            f"; {' and '.join(parts)} below, {format_size(s.kv_bytes_down)} moved down, "
            f"{format_size(s.kv_bytes_up)} brought back"
        )
        if tiers.disk is not None:
            line += f", {s.kv_blocks_prefetched} disk blocks read while a step computed"
    if (where := llm.engine.host_attention) is not None:
        line += (
            f"; host-RAM micro-batches attended on {llm.device} {llm.engine.staged_micro_batches} times "
            f"(--host-kv-attention {where.mode})"
        )
    return line


def _spill_line(spill, tiers: tuple[str, ...]) -> str:
    from offload.common.sizes import format_size

    if not spill.layers:
        why = "no layer needs converting" if not spill.convertible else "no layer that needs converting streams"
        return f"nothing written to --offload-dir: {why} to {spill.dtype}"
    if not spill.bytes_written:
        how = "reused; checksums verified"
    else:
        how = f"{format_size(spill.bytes_written)} written now" + (", the rest reused" if spill.bytes_verified else "")
    streamed = sum(tiers[i] == "nvme" for i in spill.layers)
    return (
        f"{len(spill.layers)} layers converted to {spill.dtype} in {spill.directory}: {format_size(spill.nbytes)}, "
        f"{streamed} streamed from there every step, {len(spill.layers) - streamed} loaded once ({how})"
    )


def _embedding_note(llm) -> str:
    """What the weights line adds when the token table stays on disk."""
    if llm.policy.embed_tier != "nvme":
        return ""
    return f", the embedding's rows as tokens need them ({llm.weights.stats.embed_rows_read} rows)"


def _placement_table(llm) -> str:
    from offload.common.sizes import format_size

    rows = [f"{'layer':>6}  {'bytes':>10}  tier"]
    for i, (tier, layout) in enumerate(zip(llm.policy.layer_tiers, llm.weights.layouts, strict=True)):
        rows.append(f"{i:>6}  {format_size(layout.tensor_bytes):>10}  {tier}")
    counts = Counter(llm.policy.layer_tiers)
    rows.append(", ".join(f"{n} {t}" for t, n in counts.items()) + f"; ring of {llm.policy.ring_slots} slots")
    if llm.policy.embed_tier == "nvme":
        rows.append("embedding: left on disk, each step reading its tokens' rows (its bytes hold resident layers)")
    if llm.experts is not None:
        per_layer = Counter(layer for layer, _ in llm.experts.layouts)
        n = sorted(set(per_layer.values()))
        rows.append(
            f"experts: {'/'.join(map(str, n))} per sparse layer in {len(per_layer)} layers, streamed through a cache "
            f"of {llm.experts.slots} experts ({format_size(llm.experts.budget)} budget, "
            f"{format_size(llm.experts.slot_cost)} each)" + ("" if llm.expert_slots is None else " in pinned host RAM")
        )
        if (d := llm.expert_slots) is not None:
            rows.append(
                f"         and {d.slots} expert slots on {llm.device} ({format_size(d.budget)} budget, "
                f"{format_size(d.slot_cost)} each), filled from there; cold experts: {llm.config.cold_experts}"
            )
    return "\n".join(rows)


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API (default: the embedded demo model)",
        description="Serve /v1/completions, /v1/chat/completions (streaming as server-sent events), /v1/models, "
        "/health and /metrics (Prometheus). Requests join the batch that is already running. SIGTERM or Ctrl-C "
        "drains: running requests finish, new ones get 503.",
    )
    p.add_argument("--model", metavar="DIR", help="Hugging Face model directory (default: the embedded demo model)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", metavar="NAME", help="the `model` clients pass (default: the folder name)")
    p.add_argument(
        "--api-key",
        metavar="KEY",
        help="require `Authorization: Bearer KEY` on /v1 routes (default: $OFFLOAD_API_KEY; unset: no key)",
    )
    p.add_argument(
        "--max-waiting",
        type=int,
        default=256,
        metavar="N",
        help="requests queued beyond the free places in the batch before new ones get 429 (default 256)",
    )
    p.add_argument(
        "--drain-timeout", type=float, default=30.0, metavar="SECONDS", help="on shutdown, time running requests get"
    )
    p.add_argument(
        "--batch-dir",
        metavar="DIR",
        help="where the Batch API keeps uploaded files, batches and their results (default: "
        "~/.cache/offload/batches/MODEL-NAME); unfinished batches resume when the server starts again",
    )
    p.add_argument(
        "--plan-prompt-tokens",
        type=int,
        default=512,
        metavar="N",
        help="with --device-memory or --memory and no --max-num-seqs / --kv-cache-memory: the prompt length the "
        "cost model sizes the batch for (default 512)",
    )
    p.add_argument("--plan-new-tokens", type=int, default=128, metavar="N", help="and the new tokens (default 128)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    add_engine_flags(p)
    p.set_defaults(run=_serve)


def _serve(args: argparse.Namespace) -> None:
    import os

    from offload.api import LLM
    from offload.common.paths import cache_dir
    from offload.demo import ensure_demo_model
    from offload.server.app import ServeSettings
    from offload.server.run import serve

    config = engine_config(args)
    if args.max_waiting < 0:
        raise OffloadError(f"--max-waiting must be >= 0, got {args.max_waiting}")
    if args.drain_timeout < 0:
        raise OffloadError(f"--drain-timeout must be >= 0, got {args.drain_timeout}")
    model_dir = _model_dir(args, ensure_demo_model)
    if not model_dir.is_dir():
        raise OffloadError(f"{model_dir}: model directory not found")
    if needs_plan(args, config):
        planned = max(1, min(args.max_num_seqs or 64, 64))
        config = planned_config(args, config, [args.plan_prompt_tokens] * planned, args.plan_new_tokens)
    name = args.served_model_name or model_dir.name
    settings = ServeSettings(
        model_name=name,
        api_key=args.api_key or os.environ.get("OFFLOAD_API_KEY") or None,
        max_waiting=args.max_waiting,
        drain_timeout=args.drain_timeout,
        batch_dir=Path(args.batch_dir).expanduser() if args.batch_dir else cache_dir() / "batches" / name,
    )
    serve(lambda: LLM(model_dir, config), settings, args.host, args.port, args.log_level)


def _add_batch(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "batch",
        help="run a JSONL file of requests (OpenAI Batch format or plain) into a JSONL file of results, resumably",
        description="Run every request of --input through the model and append each result to --output as it "
        "finishes. Rerun the same command after an interruption (Ctrl-C, SIGTERM, a crash) and it resumes: "
        "every id ends up in the output exactly once. Bad input lines go to OUTPUT.errors.jsonl.",
    )
    p.add_argument("--model", metavar="DIR", help="Hugging Face model directory (default: the embedded demo model)")
    p.add_argument("--input", required=True, metavar="IN.jsonl", help="one request per line")
    p.add_argument("--output", required=True, metavar="OUT.jsonl", help="one result per request")
    p.add_argument("--ordered", action="store_true", help="rewrite the output in the input's order at the end")
    p.add_argument("--json-summary", metavar="FILE", help="write the run's summary as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--fsync-interval", type=float, default=1.0, metavar="SECONDS", help="most time between fsyncs (default 1)"
    )
    p.add_argument("--ray", action="store_true", help="shard the job over Ray workers, one engine each")
    p.add_argument("--ray-workers", type=int, default=2, metavar="N", help="with --ray: workers (default 2)")
    p.add_argument(
        "--ray-address",
        metavar="ADDR",
        help="with --ray: an existing cluster (auto, or ray://HOST:10001); default: start a local one",
    )
    add_engine_flags(p)
    p.set_defaults(run=_batch)


def _batch(args: argparse.Namespace) -> None:
    import signal

    from offload.api import LLM, chat_ids, load_tokenizer
    from offload.batch import run_job
    from offload.batch_io import errors_path, read_input
    from offload.common.sizes import format_size
    from offload.demo import ensure_demo_model

    config = engine_config(args)
    if args.fsync_interval < 0:
        raise OffloadError(f"--fsync-interval must be >= 0, got {args.fsync_interval}")
    model_dir = _model_dir(args, ensure_demo_model)
    input_path, out = Path(args.input).expanduser(), Path(args.output).expanduser()
    if needs_plan(args, config):  # sized for this job's prompts
        requests, _ = read_input(input_path, model_dir.name)
        if not requests:
            raise OffloadError(f"{input_path}: no valid request to plan for")
        tokenizer = load_tokenizer(model_dir)
        lengths = [
            len(chat_ids(tokenizer, r.messages))
            if r.chat
            else len(r.prompt)
            if isinstance(r.prompt, list)
            else len(tokenizer(r.prompt)["input_ids"])
            for r in requests
        ]
        new_tokens = min(max(p.max_new_tokens for r in requests for p in r.params), 4096)
        config = planned_config(args, config, lengths, new_tokens)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM ends the job as Ctrl-C does: synced
    try:
        if args.ray:
            from offload.batch_io import rewrite_in_order
            from offload.batch_ray import run_sharded

            summary = run_sharded(
                model_dir, config, input_path, out, args.ray_workers, args.ray_address, not args.no_progress
            )
            if args.ordered:
                rewrite_in_order(out, [r.id for r in read_input(input_path, model_dir.name)[0]])
        else:
            with LLM(model_dir, config) as llm:
                summary = run_job(llm, input_path, out, args.ordered, args.fsync_interval, not args.no_progress)
    except KeyboardInterrupt:
        print(f"interrupted: {out} holds what finished; rerun the same command to resume", file=sys.stderr)
        raise
    s = summary
    print(
        f"requests   {s.requests} ({s.done_before} done before, {s.completed} now), {s.bad_lines} bad lines"
        + (f" (see {errors_path(out)})" if s.bad_lines else ""),
        file=sys.stderr,
    )
    print(
        f"time       {s.wall_seconds:.1f} s: {s.prompt_tokens} prompt tokens, {s.generated_tokens} generated, "
        f"{s.tokens_per_second:.1f} tokens/s, {s.steps} steps, {s.preemptions} preemptions",
        file=sys.stderr,
    )
    print(
        f"weights    {format_size(s.weight_bytes_read)} read from disk, {s.read_stall_seconds:.2f} s stalled on reads",
        file=sys.stderr,
    )
    if args.json_summary:
        Path(args.json_summary).expanduser().write_text(json.dumps(summary.to_json(), indent=1) + "\n")


def _add_probe(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "probe",
        help="measure this machine (disk, memory, matmul, links) into a hardware profile",
        description="Measure this machine's disk read/write, memory bandwidth, matmul speed per dtype and, on CUDA, "
        "the GPU and its link, through the engine's own I/O and GEMM paths; save the result as a hardware profile "
        "for `offload plan` and print it. Takes under a minute (--quick: about 15 s).",
    )
    p.add_argument("--out", metavar="FILE", help="profile to write (default ~/.cache/offload/hardware/local.json)")
    p.add_argument("--dir", metavar="DIR", help="a directory on the drive to measure (default ~/.cache/offload)")
    p.add_argument("--disk-bytes", metavar="SIZE", help="disk test file size (default 1GiB; --quick: 256MiB)")
    p.add_argument("--quick", action="store_true", help="smaller tests: about 15 seconds")
    p.set_defaults(run=_probe)


def _probe(args: argparse.Namespace) -> None:
    from offload.planner.probe import run_probe

    run_probe(args.out, args.dir, args.disk_bytes, args.quick)


def _add_convert(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "convert",
        help="quantize a model's weights to int4 or int8 into a new directory the engine runs directly",
        description="Write a weight-quantized copy of a float safetensors model, tensor by tensor: the projection "
        "matrices of every decoder layer as int4 or int8 codes with per-group scales, in the layout the compute "
        "path multiplies without repacking (cpu: torch's packed CPU kernels; triton: the Triton kernel on CUDA), "
        "4 KiB-aligned for direct reads, with a manifest of checksums. Embeddings, norms, biases and the LM head "
        "keep their dtype. Run the result with `offload generate --model OUT` like any model.",
    )
    p.add_argument(
        "--model", required=True, metavar="DIR", help="the float model directory (config.json, *.safetensors)"
    )
    p.add_argument("--quant", required=True, choices=["int4", "int8"])
    p.add_argument(
        "--group-size",
        type=int,
        choices=[32, 64, 128],
        help="input features sharing a scale (default: 128 for int4; int8 in the cpu layout has one scale per "
        "output channel, which is what torch's int8 CPU matmul takes)",
    )
    p.add_argument(
        "--layout",
        choices=["cpu", "triton"],
        help="whose matmul reads the codes (default: triton on a machine with CUDA, else cpu)",
    )
    p.add_argument("--out", required=True, metavar="DIR", help="the new model directory (must not exist)")
    p.set_defaults(run=_convert)


def _convert(args: argparse.Namespace) -> None:
    import time

    import torch

    from offload.common.quant import WeightQuant
    from offload.common.sizes import format_size
    from offload.convert import convert

    layout = args.layout or ("triton" if torch.cuda.is_available() else "cpu")
    bits = int(args.quant.removeprefix("int"))
    group = args.group_size if args.group_size is not None else (128 if bits == 4 or layout == "triton" else 0)
    try:
        quant = WeightQuant(bits, group, layout)
    except ValueError as exc:
        raise OffloadError(f"--quant {args.quant} --group-size {args.group_size} --layout {layout}: {exc}") from None
    start = time.perf_counter()
    stats = convert(Path(args.model).expanduser(), Path(args.out).expanduser(), quant)
    print(
        f"converted  {stats.tensors_quantized} matrices to {quant.name}, {stats.tensors_copied} tensors copied: "
        f"{format_size(stats.source_bytes)} -> {format_size(stats.bytes_written)} in "
        f"{time.perf_counter() - start:.1f} s -> {stats.out}",
        file=sys.stderr,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="offload",
        description="Run language models larger than your "
        "accelerator's memory by streaming weights and KV across tiers.",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks instead of one-line errors")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_generate(sub)
    _add_serve(sub)
    _add_batch(sub)
    _add_probe(sub)
    _add_convert(sub)
    add_plan_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.run(args)
    except OffloadError as exc:
        if args.debug:
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
