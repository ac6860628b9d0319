"""Latency under a request rate: the engine's own schedule simulated over the cost model.

A continuous-batching engine at a low request rate does not run the planner's one big batch: each step decodes the
sequences running and prefills the prompts that arrived since the last step, so batches are small and fill as
requests arrive. `simulate` replays that schedule: requests arrive (Poisson, or in bursts) at a rate; at each step
boundary the waiting ones are admitted up to the policy's batch, first come first served, and their prompts are
prefilled in that step beside the running sequences' decode (scheduler/cost/predict.py's mixed_step_seconds prices the
step: the weights are read once per layer for both), plus what the served engine itself costs a step, each
stream and each prompt token in it where the profile holds `offload probe`'s measurement of it
(HardwareProfile.served_step); a request's first token comes at the end of the step that prefilled it (and the
request's own handling before it joined), its others one per step after. From the timeline: time to first token
(p50, p90), each stream's decode tokens/s (its tokens after the first over the time they took), and the throughput
served.

The largest rate a policy sustains (max_rate) is the same simulation's completion rate with the queue kept full:
requests arriving at twice the one-batch formula's rate (a full batch prefilled, then decoded, in lockstep), whose
staggered completions let later prompts be prefilled beside running decode; above it the queue grows without
bound.

Plain numbers in, plain numbers out: no tensors, no files; a seeded random.Random for the arrivals.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass

from offload.scheduler.cost.predict import Candidate, Context, Prediction, mixed_step_seconds

ARRIVALS = ("poisson", "burst")
BURST = 8  # requests per burst, when they come in bursts
SIMULATED_REQUESTS = 256  # requests a simulation replays (the first quarter warms the queue up and is left out)


@dataclass(frozen=True, slots=True)
class Latency:
    rate: float  # requests/s offered
    ttft_p50: float  # seconds
    ttft_p90: float
    stream_tps_p50: float  # each stream's decode tokens/s after its first token, the median over requests
    throughput: float  # generated tokens/s over the simulated span
    max_rate: float  # requests/s the policy sustains at most (its full batch's completion rate)
    mean_batch: float  # sequences per step, on average

    @property
    def saturated(self) -> bool:
        return self.rate >= self.max_rate


def arrival_times(rate: float, count: int, pattern: str, seed: int = 0) -> list[float]:
    """`count` arrival times (seconds) at `rate` requests/s: Poisson, or bursts of BURST at once."""
    if pattern not in ARRIVALS:
        raise ValueError(f"arrival pattern {pattern!r}: one of {', '.join(ARRIVALS)}")
    rng = random.Random(seed)
    if pattern == "burst":
        return [(i // BURST) * BURST / rate for i in range(count)]
    t, out = 0.0, []
    for _ in range(count):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def simulate(
    ctx: Context,
    prediction: Prediction,
    prompt_len: int,
    gen_len: int,
    rate: float,
    pattern: str = "poisson",
    requests: int = SIMULATED_REQUESTS,
    seed: int = 0,
) -> Latency:
    """The latency `prediction`'s policy gives at `rate` requests/s of `prompt_len`-token prompts and `gen_len` new
    tokens each, its batch (the policy's) the most sequences a step runs."""
    costs = _served_costs(ctx)
    arrivals = arrival_times(rate, requests, pattern, seed)
    first, done, steps, seqs = _timeline(ctx, prediction.candidate, prompt_len, gen_len, arrivals, costs)
    kept = range(requests // 4, requests)  # after the queue has warmed up
    ttfts = sorted(first[i] - arrivals[i] for i in kept)
    streams = [(gen_len - 1) / (done[i] - first[i]) for i in kept if gen_len > 1 and done[i] > first[i]]
    span = max(done[i] for i in kept) - arrivals[kept[0]]
    return Latency(
        rate=rate,
        ttft_p50=_quantile(ttfts, 0.5),
        ttft_p90=_quantile(ttfts, 0.9),
        stream_tps_p50=statistics.median(streams) if streams else float("inf"),
        throughput=len(kept) * gen_len / span,
        max_rate=max_rate(ctx, prediction, prompt_len, gen_len, pattern, requests, seed),
        mean_batch=seqs / steps,
    )


def max_rate(
    ctx: Context,
    prediction: Prediction,
    prompt_len: int,
    gen_len: int,
    pattern: str = "poisson",
    requests: int = SIMULATED_REQUESTS,
    seed: int = 0,
) -> float:
    """The largest rate the policy sustains: requests arriving (as `pattern` says) at twice its full batch's
    completion rate, which keeps the queue full, completed per second from the fifth to the fifth-last completion.
    Staggered arrivals finish staggered, so later prompts are prefilled beside the running decode, in the same pass
    over the weights: more than the one-batch round's batch / round_seconds, where a whole batch is prefilled, then
    decoded, in lockstep."""
    costs = _served_costs(ctx)
    cand = prediction.candidate
    step, stream, token, _ = costs
    round_ = prediction.round_seconds + gen_len * (step + stream * cand.batch) + token * prompt_len * cand.batch
    requests = max(requests, 4 * cand.batch)  # enough to keep a full batch running, whatever its size
    arrivals = arrival_times(2 * cand.batch / round_, requests, pattern, seed)
    done = sorted(_timeline(ctx, cand, prompt_len, gen_len, arrivals, costs)[1])
    a, b = len(done) // 5, len(done) - len(done) // 5 - 1
    return (b - a) / (done[b] - done[a])


def _served_costs(ctx: Context) -> tuple[float, float, float, float]:
    """The served engine's own seconds per step, per stream in a step, per prompt token and per request, as the
    profile holds them (HardwareProfile.served_step; none for a published card)."""
    s = ctx.hw.served_step
    return (s.step, s.per_stream, s.per_prompt_token, s.request) if s else (0.0, 0.0, 0.0, 0.0)


def _timeline(
    ctx: Context,
    cand: Candidate,
    prompt_len: int,
    gen_len: int,
    arrivals: list[float],
    costs: tuple[float, float, float, float],
) -> tuple[list[float], list[float], int, int]:
    """The engine's schedule replayed: (each request's first token time, its last, steps, sequences over steps).
    `costs`: the served engine's own seconds per step, per stream in a step, per prompt token and per request."""
    step_cost, stream_cost, token_cost, request_cost = costs
    requests = len(arrivals)
    ready = [a + request_cost for a in arrivals]  # handled and waiting to join the batch
    first, done = [0.0] * requests, [0.0] * requests
    made = [0] * requests  # tokens generated so far
    running: list[int] = []
    nxt, t, steps, seqs = 0, 0.0, 0, 0
    cache: dict[tuple[int, int, int], float] = {}
    while nxt < requests or running:
        if not running and nxt < requests and ready[nxt] > t:
            t = ready[nxt]  # idle until the next request
        admitted = []
        while nxt < requests and ready[nxt] <= t and len(running) + len(admitted) < cand.batch:
            admitted.append(nxt)
            nxt += 1
        decoding = [i for i in running if made[i] >= 1]
        context = prompt_len + (sum(made[i] for i in decoding) // len(decoding) if decoding else 0)
        key = (len(decoding), len(admitted), context // 16)
        if key not in cache:
            cache[key] = mixed_step_seconds(ctx, cand, len(decoding), context, len(admitted), prompt_len)
        t += cache[key] + step_cost + stream_cost * (len(decoding) + len(admitted))
        t += token_cost * prompt_len * len(admitted)
        steps += 1
        seqs += len(decoding) + len(admitted)
        for i in decoding + admitted:
            made[i] += 1
            if made[i] == 1:
                first[i] = t
            if made[i] == gen_len:
                done[i] = t
        running = [i for i in running + admitted if made[i] < gen_len]
    return first, done, steps, seqs


def _quantile(ordered: list[float], q: float) -> float:
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]
