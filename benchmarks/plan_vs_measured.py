"""The planner's latency at a request rate against the served engine's: `offload plan --qps` checked by measurement.

    python benchmarks/plan_vs_measured.py [--models demo,streamed] [--requests 40] [--work-dir ~/.cache/offload/bench]
                                          [--out benchmarks/results/plan_vs_measured.json]

For each model, the policy at batch 8 that `offload plan` would print for this machine (its saved `offload probe`
profile, measured now if there is none) is served with the flags it prints (offload/planner/commands.py), and
--requests requests arrive at two rates, Poisson with a fixed seed: a light one (a fifth of the policy's predicted
largest sustainable rate) and one near saturation (four fifths of it). Each request is a streamed completion of a
token-id prompt of a fixed length with a fixed number of new tokens (eos ignored), sent at its arrival time by an
httpx client in this process. Measured, client-side: time to first token (send to the first chunk with a token) and
each stream's decode tokens/s (its tokens after the first over the time from its first chunk to its last), p50 over
the requests after the first quarter, as the simulation reports them; and the throughput served at a rate twice the
predicted largest (requests completed per second over the run), the measured largest sustainable rate. Predicted:
scheduler/queueing.py's simulation at the same rates and arrival times.

Models: `demo`, the embedded demo model all in memory (128-token prompts, 32 new tokens); `streamed`, the peer
benchmark's random 1.1B checkpoint (TinyLlama's shape) under its 600 MB weight budget, most layers read from disk
every step (128-token prompts, 16 new tokens), the page cache dropped before each rate's run. Goal: each predicted
value within 25% of the measured one. Prints a table and writes the JSON with the machine it ran on.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import httpx
from bench_common import machine, timestamp, write_report
from peer_engines import drop_page_cache, files_under, peers_checkpoint
from served import serving

RESULTS = Path(__file__).parent / "results" / "plan_vs_measured.json"
BATCH = 8
GOAL = 0.25  # relative error allowed
SETTINGS = {  # model -> (prompt tokens, new tokens, device budget or None)
    "demo": (128, 32, None),
    "streamed": (128, 16, 600_000_000),
}


def plan(model: Path, prompt_len: int, gen_len: int, budget: int | None):
    """(the prediction at batch 8, its EngineConfig, the cost model's context) on this machine's profile."""
    from offload.planner.commands import planned_config
    from offload.planner.models import load_model_spec
    from offload.planner.probe import local_profile
    from offload.scheduler.cost import Budgets, Workload, make_context
    from offload.scheduler.search import search

    spec, hw = load_model_spec(str(model)), local_profile()
    # streamed: no host tier, so that what the device budget leaves out streams from disk (a whole-RAM host tier
    # would keep every layer in memory, as the planner rightly prefers)
    workload = Workload(prompt_len, gen_len, BATCH)
    budgets = Budgets(device=budget, host=None if budget is None else 0)
    dtype = "bfloat16"
    preds = search(spec, hw, workload, dtype=dtype, budgets=budgets, batches=[BATCH], kv_tiers=("device",))
    chosen = next(p for p in preds if p.fits and not p.unsupported)
    config = planned_config(spec, hw, dtype, chosen, workload, budgets)
    return chosen, config, make_context(spec, hw, dtype, 16), hw


async def drive(url: str, model: str, prompt: list[int], gen_len: int, arrivals: list[float]) -> list[dict]:
    """Each request sent at its arrival time; what its client saw."""
    async with httpx.AsyncClient(timeout=3600) as client:
        start = time.perf_counter()

        async def one(i: int, at: float) -> dict:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            sent = time.perf_counter()
            # logprobs 0: a chunk for every token, even one whose text is held back or empty (the streamed
            # checkpoint has no tokenizer)
            body = {"model": model, "prompt": prompt, "max_tokens": gen_len, "temperature": 0, "ignore_eos": True}
            body |= {"logprobs": 0, "stream": True}
            chunks = []
            async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        choice = json.loads(line[6:])["choices"]
                        if choice and (choice[0]["logprobs"] or {}).get("tokens"):
                            chunks.append(time.perf_counter())
            return {"sent": sent - start, "first": chunks[0] - start, "last": chunks[-1] - start, "chunks": len(chunks)}

        return await asyncio.gather(*(one(i, at) for i, at in enumerate(arrivals)))


def measured(seen: list[dict], gen_len: int) -> dict:
    kept = seen[len(seen) // 4 :]
    ttft = statistics.median(s["first"] - s["sent"] for s in kept)
    streams = [(gen_len - 1) / (s["last"] - s["first"]) for s in kept if s["last"] > s["first"]]
    span = max(s["last"] for s in kept) - min(s["sent"] for s in kept)
    return {"ttft_p50": ttft, "stream_tps_p50": statistics.median(streams), "requests_per_second": len(kept) / span}


def run_model(name: str, args: argparse.Namespace) -> dict:
    from offload.common.config import EngineConfig
    from offload.common.knobs import to_flags
    from offload.demo import ensure_demo_model
    from offload.scheduler.queueing import arrival_times, simulate

    prompt_len, gen_len, budget = SETTINGS[name]
    model = ensure_demo_model() if name == "demo" else peers_checkpoint(args.work_dir, 22)
    chosen, config, ctx, hw = plan(model, prompt_len, gen_len, budget)
    max_rate = chosen.candidate.batch / chosen.round_seconds
    out = {"policy": str(chosen.candidate), "config": to_flags(EngineConfig, config), "predicted_max_rate": max_rate}
    flags = ["--served-model-name", "m", *to_flags(EngineConfig, config)]
    rates = {"light": 0.2 * max_rate, "near saturation": 0.8 * max_rate, "over": 2.0 * max_rate}
    with serving(model, flags, args.work_dir / f"plan_vs_measured-{name}.log", bound=900) as server:
        prompt = list(range(5, 5 + prompt_len))
        for label, rate in rates.items():
            arrivals = arrival_times(rate, args.requests, "poisson", seed=1)
            if budget is not None:
                drop_page_cache(files_under(model))
            seen = asyncio.run(drive(server.url, "m", prompt, gen_len, arrivals))
            lat = simulate(ctx, chosen, prompt_len, gen_len, rate, requests=args.requests, seed=1)
            got = measured(seen, gen_len)
            predicted = {"ttft_p50": lat.ttft_p50, "stream_tps_p50": lat.stream_tps_p50}
            out[label] = {"rate": rate, "measured": got, "predicted": predicted}
            print(f"{name} {label} ({rate:.3g}/s): measured {got}, predicted {predicted}", flush=True)
    out["measured_max_rate"] = out["over"]["measured"]["requests_per_second"]
    return out


def errors(result: dict) -> dict:
    """Relative error of each predicted value against the measured one."""
    out = {}
    for label in ("light", "near saturation"):
        r = result[label]
        for key in ("ttft_p50", "stream_tps_p50"):
            out[f"{label} {key}"] = r["predicted"][key] / r["measured"][key] - 1
    out["max_rate"] = result["predicted_max_rate"] / result["measured_max_rate"] - 1
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="demo,streamed")
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--work-dir", type=Path, default=Path.home() / ".cache" / "offload" / "bench")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    report: dict = {"machine": machine(args.work_dir), "time": timestamp(), "requests": args.requests, "models": {}}
    rows = [f"{'model':<10} {'value':<32} {'predicted/measured - 1':>22}  within {GOAL:.0%}"]
    for name in args.models.split(","):
        result = run_model(name, args)
        result["errors"] = errors(result)
        report["models"][name] = result
        for key, err in result["errors"].items():
            rows.append(f"{name:<10} {key:<32} {err:>+22.1%}  {'yes' if abs(err) <= GOAL else 'no'}")
    print("\n".join(rows))
    write_report(args.out, report)


if __name__ == "__main__":
    main()
