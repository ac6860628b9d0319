"""Where one big step's time goes: the engine's own calls timed by kind, the profiler off.

Runs the 1.1B-shaped checkpoint of offload_vs_peers.py at a large batch (default 128 prompts of 128 tokens), the
whole prompt batch in one prefill step, then a few decode steps, twice: streamed under a weight budget (default
600 MB) and with every weight in RAM. Each call the step makes into the engine's parts (the GEMMs, paged
attention and its fused SDPA calls, norms, rotary, the KV write, waits for layer reads, the embedding, the head,
the step's batch preparation) is wrapped in a wall clock that charges nested calls to themselves only, so the
kinds add up to the step; what is left is the step's own Python and the elementwise work between the calls
(SiLU times up, residual adds, copies). On a CPU device every op runs synchronously, so a call's wall time is its
work. Prints a table per step kind and writes benchmarks/results/step_profile.json with the machine.

    python benchmarks/step_profile.py [--batch 128] [--decode-steps 3] [--budget 600MB]
"""

from __future__ import annotations

import argparse
import functools
import time
from collections import defaultdict
from pathlib import Path

from bench_common import machine, timestamp, write_report
from peer_engines import Workload, ours_config, peers_checkpoint


class KindClock:
    """Exclusive wall time per kind: a call's time less the time of the timed calls it made."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._stack: list[float] = []  # time charged to the children of each open call

    def wrap(self, owner: object, name: str, kind: str, setter=setattr) -> None:
        """Time `owner.name` as `kind` from now on; `setter` sets the wrapper (a test's monkeypatch undoes it)."""
        inner = getattr(owner, name)

        @functools.wraps(inner)
        def timed(*args, **kwargs):
            self._stack.append(0.0)
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                total = time.perf_counter() - start
                children = self._stack.pop()
                self.seconds[kind] += total - children
                self.calls[kind] += 1
                if self._stack:
                    self._stack[-1] += total

        setter(owner, name, timed)

    def take(self) -> tuple[dict[str, float], dict[str, int]]:
        out = dict(self.seconds), dict(self.calls)
        self.seconds.clear()
        self.calls.clear()
        return out


def instrument(clock: KindClock, setter=setattr) -> None:
    """Wrap the calls a Llama step makes, where the layer module looks them up (for the rest of the process)."""
    import torch.nn.functional as F

    import offload.model.engine as engine
    import offload.model.llama as llama
    from offload.tiers.kv.kv_cache import KVLayer
    from offload.tiers.weights.weight_store import WeightStore

    clock.wrap(llama, "linear", "GEMMs (projections, LM head)", setter)
    clock.wrap(llama, "logits", "GEMMs (projections, LM head)", setter)
    clock.wrap(llama, "paged_attention", "attention: gathers, masks, copies", setter)
    clock.wrap(F, "scaled_dot_product_attention", "attention: fused SDPA", setter)
    clock.wrap(llama, "fused_rms_norm", "RMS norms (+ residual add)", setter)
    clock.wrap(llama, "apply_rotary", "rotary", setter)
    clock.wrap(KVLayer, "write", "KV write", setter)
    clock.wrap(WeightStore, "acquire", "waiting for layer reads", setter)
    clock.wrap(WeightStore, "embedding", "embedding", setter)
    clock.wrap(llama.LlamaFamily, "head", "head: final norm", setter)
    clock.wrap(engine.Engine, "_prepare", "batch preparation", setter)


def profile(model_dir: Path, budget: int | None, workload: Workload, decode_steps: int, clock: KindClock) -> dict:
    """One prefill step of the whole batch, then `decode_steps` decode steps: each step's wall time and its kinds."""
    from offload.api import LLM
    from offload.common.config import SamplingParams

    config = ours_config(model_dir, budget, workload)
    llm = LLM(model_dir, config)
    params = SamplingParams(max_new_tokens=decode_steps + 1, ignore_eos=True)
    for ids in workload.prompt_ids(llm.spec.vocab_size):
        llm.core.add_request(ids, params)
    steps = []
    clock.take()
    while llm.core.has_work:
        start = time.perf_counter()
        llm.core.step()
        wall = time.perf_counter() - start
        seconds, calls = clock.take()
        kind = "prefill" if not steps else "decode"
        steps.append({"kind": kind, "wall_seconds": wall, "seconds": seconds, "calls": calls})
    placement = {"layers": list(llm.placement.counts), "embedding": llm.placement.embed_tier}
    llm.close()
    return {"placement": placement, "steps": steps}


def summarize(steps: list[dict], kind: str) -> dict:
    """The mean step of `kind`: wall seconds and seconds per part, with the rest as 'step Python and elementwise'."""
    chosen = [s for s in steps if s["kind"] == kind]
    wall = sum(s["wall_seconds"] for s in chosen) / len(chosen)
    parts: dict[str, float] = defaultdict(float)
    for s in chosen:
        for k, v in s["seconds"].items():
            parts[k] += v / len(chosen)
    parts["rest: scheduling, sampling, Python, elementwise (SiLU*up, adds)"] = wall - sum(parts.values())
    return {"steps": len(chosen), "wall_seconds": wall, "parts": dict(parts)}


def table(results: dict[str, dict]) -> str:
    names = list(results)
    kinds = sorted(
        {k for r in results.values() for k in r["parts"]}, key=lambda k: -results[names[0]]["parts"].get(k, 0)
    )
    head = f"{'part of the step':<58}" + "".join(f"{n:>26}" for n in names)
    lines = [head, "-" * len(head)]
    for k in kinds:
        cells = []
        for n in names:
            r = results[n]
            v = r["parts"].get(k, 0.0)
            cells.append(f"{v:>9.3f} s ({100 * v / r['wall_seconds']:4.1f}%)".rjust(26))
        lines.append(f"{k:<58}" + "".join(cells))
    lines.append(f"{'whole step':<58}" + "".join(f"{results[n]['wall_seconds']:>9.3f} s".rjust(26) for n in names))
    return "\n".join(lines)


def summaries(runs: dict[str, dict], batch: int) -> dict[str, dict]:
    """Each step kind's mean step per run, its table printed; a kind no run has (a prompt that fills the
    checkpoint's positions, 2047 tokens of 2048, leaves no decode step) is said and left out."""
    out = {}
    for kind in ("prefill", "decode"):
        if not all(any(s["kind"] == kind for s in r["steps"]) for r in runs.values()):
            print(f"\nno {kind} step: the prompts filled the checkpoint's positions or asked no new token")
            continue
        results = out[kind] = {label: summarize(r["steps"], kind) for label, r in runs.items()}
        n = results[next(iter(results))]["steps"]
        print(f"\n{kind} step (mean of {n}), batch {batch}:")
        print(table(results))
    return out


def main() -> None:
    from offload.common.sizes import parse_size

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work-dir", type=Path, default=Path.home() / ".cache/offload/bench")
    p.add_argument("--layers", type=int, default=22)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--decode-steps", type=int, default=3)
    p.add_argument("--budget", default="600MB", help="RAM for weights in the streamed run")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "step_profile.json")
    args = p.parse_args()
    model_dir = peers_checkpoint(args.work_dir, args.layers)
    workload = Workload(prompts=args.batch, prompt_tokens=args.prompt_tokens, new_tokens=args.decode_steps + 1)
    clock = KindClock()
    instrument(clock)
    runs = {}
    for label, budget in ((f"streamed ({args.budget})", parse_size(args.budget)), ("every weight in RAM", None)):
        print(f"profiling {label}: batch {args.batch}, {args.prompt_tokens}-token prompts ...", flush=True)
        runs[label] = profile(model_dir, budget, workload, args.decode_steps, clock)
    report = {"benchmark": "step_profile", "date": timestamp(), "machine": machine(args.work_dir)}
    report |= {"checkpoint": str(model_dir), "batch": args.batch, "prompt_tokens": args.prompt_tokens}
    report |= {"runs": runs, "summary": summaries(runs, args.batch)}
    for label, r in runs.items():
        where = r["placement"]
        print(f"{label}: layers resident/host/streamed {where['layers']}, embedding {where['embedding']}")
    write_report(args.out, report)


if __name__ == "__main__":
    main()
