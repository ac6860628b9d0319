"""How far weight-quantized checkpoints move a model's logits and greedy tokens from the float model's.

    python benchmarks/quant_accuracy.py [--new-tokens 64] [--work-dir DIR] [--quick] [--out PATH]

Models: the demo model (offload.demo: a small trained Llama, bf16, prompted with its own DEMO_PROMPTS through its
tokenizer) and one random checkpoint per test family (tests/conftest.py's make_checkpoint, TINY shape, seed 0, saved
in bfloat16; prompts of 8, 16, 24 and 32 seeded random token ids). Formats: int8 per output channel (cpu layout),
int8 in groups of 32/64/128 (triton layout: on a CPU dequantized, then multiplied) and int4 in groups of 32/64/128
(cpu layout). `offload convert` writes each format into the work dir (a temporary folder, under --work-dir if given,
removed afterwards); the float model and every conversion run in this engine in bfloat16 on this machine.

Per model and format:
  logits     the float model greedily generates --new-tokens tokens per prompt; both models score the prompt plus
             that continuation (`LLM.score`); max and mean |logit difference| over every position, also divided by
             the std of the float model's logits (over all positions and the vocabulary)
  greedy     each model generates --new-tokens tokens per prompt (greedy, eos ignored); prefix agreement is the share
             of the positions before the first token that differs, identical whether all are equal. At a divergence
             the float model's top-2 logit margin there (from its scores of the same context, as the contexts are
             equal up to it): a near-tie flips on any perturbation, a wide margin means the error was large
  bytes      the converted checkpoint's weight files against the source's (*.safetensors). Embeddings and the head
             stay in bf16 and every tensor starts on a 4 KiB boundary, so on the tiny checkpoints the files can grow

A group size that does not divide a weight's input width is halved until it does, down to 32; a weight no such group
divides stays in bf16 (kernels/quant_linear.py). On the TINY checkpoints (inputs 64 or 96 wide) g128 therefore runs
as g64 on 64-wide inputs and g64/g128 as g32 on 96-wide ones; the demo model's down_proj (688 inputs) is quantized
only per channel, so its grouped formats quantize 24 of its 28 projections (the "quantized" column).
Prints a table and writes benchmarks/results/quant_accuracy.json with the machine it ran on.
"""

from __future__ import annotations

import argparse
import importlib.util
import tempfile
import time
from pathlib import Path

import torch
from bench_common import machine, timestamp, write_report

RESULTS = Path(__file__).parent / "results" / "quant_accuracy.json"
TESTS = Path(__file__).resolve().parents[1] / "tests"
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
FORMATS = ((8, 0, "cpu"), (8, 32, "triton"), (8, 64, "triton"), (8, 128, "triton"),
           (4, 32, "cpu"), (4, 64, "cpu"), (4, 128, "cpu"))  # fmt: skip  # (bits, group_size, layout)
QUICK_FORMATS = ((8, 0, "cpu"), (4, 32, "cpu"))
RANDOM_PROMPT_LENGTHS = (8, 16, 24, 32)  # tokens
FIRST_ID = 3  # random prompts skip the special ids 0..2 (unk, bos, eos)


def make_random_checkpoints(root: Path, families: tuple[str, ...]) -> dict[str, Path]:
    """One bf16 checkpoint per family at root/<family>, by the test suite's make_checkpoint (loaded from its file)."""
    spec = importlib.util.spec_from_file_location("offload_tests_conftest", TESTS / "conftest.py")
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    dirs = {}
    for family in families:
        dirs[family] = root / family
        conftest.make_checkpoint(dirs[family], family, dtype=torch.bfloat16, seed=0)
    return dirs


def demo_model() -> dict[str, tuple[Path, list[list[int]]]]:
    """{"demo": (its directory, DEMO_PROMPTS encoded by its tokenizer)}; built into the offload cache if missing."""
    from offload.demo import DEMO_PROMPTS, ensure_demo_model
    from offload.prompts import Prompts

    model_dir = ensure_demo_model()
    encoder = Prompts.load(model_dir)
    return {"demo": (model_dir, [encoder.encode(text) for text in DEMO_PROMPTS])}


def random_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(FIRST_ID, vocab_size, (n,), generator=gen).tolist() for n in RANDOM_PROMPT_LENGTHS]


def weight_bytes(model_dir: Path) -> int:
    return sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))


def run_model(
    model_dir: Path,
    prompts: list[list[int]],
    new_tokens: int,
    scored: list[list[int]] | None = None,
    dtype: str = "bfloat16",
):
    """Greedy tokens [prompt][new_tokens] for `prompts`, and the logits [len, vocab] of each of `scored` (the prompts
    plus this run's own tokens when None), both computed by the engine in `dtype`."""
    from offload.api import LLM
    from offload.common.config import EngineConfig, SamplingParams

    config = EngineConfig(dtype=dtype, kv_cache_bytes=64 << 20, prefix_cache=False)
    with LLM(model_dir, config) as llm:
        out = llm.generate_ids(prompts, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
        tokens = [list(c.token_ids) for c in out]
        if scored is None:
            scored = [p + t for p, t in zip(prompts, tokens, strict=True)]
        logits = llm.score(scored)
    return tokens, scored, logits


def logit_error(ref: list[torch.Tensor], quant: list[torch.Tensor]) -> dict:
    diff = torch.cat([(q - r).abs().flatten() for r, q in zip(ref, quant, strict=True)])
    std = torch.cat([r.flatten() for r in ref]).std().item()
    return {
        "positions": sum(r.shape[0] for r in ref),
        "max_abs": diff.max().item(),
        "mean_abs": diff.mean().item(),
        "ref_std": std,
        "max_rel": diff.max().item() / std,
        "mean_rel": diff.mean().item() / std,
    }


def agreement(prompts, ref_tokens, quant_tokens, ref_logits) -> dict:
    """Prefix agreement per prompt and, where the tokens diverge, the float model's top-2 margin at that position."""
    prompts_out = []
    for prompt, ref, quant, logits in zip(prompts, ref_tokens, quant_tokens, ref_logits, strict=True):
        first = next((i for i, (a, b) in enumerate(zip(ref, quant, strict=True)) if a != b), len(ref))
        entry = {"prefix_agreement": first / len(ref), "identical": first == len(ref)}
        if first < len(ref):
            top2 = logits[len(prompt) - 1 + first].topk(2).values  # the logits that chose generated token `first`
            entry |= {"diverges_at": first, "ref_top2_margin": (top2[0] - top2[1]).item()}
        prompts_out.append(entry)
    margins = [p["ref_top2_margin"] for p in prompts_out if "ref_top2_margin" in p]
    return {
        "prefix_agreement": sum(p["prefix_agreement"] for p in prompts_out) / len(prompts_out),
        "identical_prompts": sum(p["identical"] for p in prompts_out),
        "min_divergence_margin": min(margins) if margins else None,
        "per_prompt": prompts_out,
    }


def evaluate(name: str, model_dir: Path, prompts: list[list[int]], formats, work: Path, new_tokens: int) -> dict:
    from offload.common.quant import WeightQuant
    from offload.convert.quantize import convert

    ref_tokens, scored, ref_logits = run_model(model_dir, prompts, new_tokens)
    source_bytes = weight_bytes(model_dir)
    results = {}
    for bits, group, layout in formats:
        quant = WeightQuant(bits, group, layout)
        start = time.perf_counter()
        stats = convert(model_dir, work / f"{name}-{quant.name}", quant)
        tokens, _, logits = run_model(stats.out, prompts, new_tokens, scored)
        results[quant.name] = {
            "logits": logit_error(ref_logits, logits),
            "greedy": agreement(prompts, ref_tokens, tokens, ref_logits),
            "tensors_quantized": stats.tensors_quantized,
            "weight_bytes": stats.bytes_written,
            "source_weight_bytes": source_bytes,
            "bytes_ratio": stats.bytes_written / source_bytes,
            "wall_s": time.perf_counter() - start,
        }
    # the same weights in float32 arithmetic: how far bf16's own rounding moves logits and greedy tokens
    f32_tokens, _, f32_logits = run_model(model_dir, prompts, new_tokens, scored, dtype="float32")
    return {
        "model_dir": str(model_dir),
        "prompt_lengths": [len(p) for p in prompts],
        "float32_arithmetic": {
            "logits": logit_error(ref_logits, f32_logits),
            "greedy": agreement(prompts, ref_tokens, f32_tokens, ref_logits),
        },
        "ref_scores_pick_ref_tokens": self_agreement(prompts, ref_tokens, ref_logits),
        "formats": results,
    }


def self_agreement(prompts, tokens, logits) -> float:
    """The share of the float model's generated tokens that its own scores' argmax picks too: the margins read from
    the scores describe its decisions only as far as its prefill and decode steps agree."""
    picks = [
        a == b
        for prompt, toks, scores in zip(prompts, tokens, logits, strict=True)
        for a, b in zip(scores[len(prompt) - 1 : len(prompt) - 1 + len(toks)].argmax(-1).tolist(), toks, strict=True)
    ]
    return sum(picks) / len(picks)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--new-tokens", type=int, default=64, help="greedy tokens generated per prompt")
    p.add_argument("--work-dir", type=Path, default=None, help="where the temporary checkpoints go (default: TMPDIR)")
    p.add_argument("--quick", action="store_true", help="llama only, two formats, 16 tokens, no demo model (the tests)")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    from offload.common.model_config import read_config

    families, formats = (FAMILIES[:1], QUICK_FORMATS) if args.quick else (FAMILIES, FORMATS)
    if args.quick:
        args.new_tokens = 16
    if args.work_dir is not None:
        args.work_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="quant_accuracy-", dir=args.work_dir) as tmp:
        work = Path(tmp)
        models = demo_model() if not args.quick else {}
        for family, path in make_random_checkpoints(work / "random", families).items():
            models[family] = (path, random_prompts(read_config(path)["vocab_size"]))
        results = {name: evaluate(name, d, ids, formats, work, args.new_tokens) for name, (d, ids) in models.items()}
        report = {
            "benchmark": "quant_accuracy",
            "time": timestamp(),
            "machine": machine(work),
            "settings": {
                "compute_dtype": "bfloat16",
                "new_tokens": args.new_tokens,
                "random_checkpoints": "tests/conftest.py make_checkpoint(family, dtype=bfloat16, seed=0), TINY shape",
                "random_prompts": f"seed 0, lengths {list(RANDOM_PROMPT_LENGTHS)}",
                "formats": [f"int{b}-{'channel' if g == 0 else f'g{g}'}-{lay}" for b, g, lay in formats],
                "torch": torch.__version__,
            },
            "models": results,
        }
    print(table(report))
    write_report(args.out, report)
    return report


def table(report: dict) -> str:
    n_prompts = {m: len(r["prompt_lengths"]) for m, r in report["models"].items()}
    lines = [
        f"{'model':<8} {'format':<18} {'max|dl|':>8} {'mean|dl|':>9} {'max/std':>8} {'mean/std':>9} "
        f"{'prefix agree':>12} {'identical':>9} {'min margin':>10} {'quantized':>9} {'bytes':>6}"
    ]
    for model, r in report["models"].items():
        for fmt, f in {**r["formats"], "float32 arithmetic": r["float32_arithmetic"]}.items():
            lg, gr = f["logits"], f["greedy"]
            margin = "-" if gr["min_divergence_margin"] is None else f"{gr['min_divergence_margin']:.3f}"
            lines.append(
                f"{model:<8} {fmt:<18} {lg['max_abs']:>8.4f} {lg['mean_abs']:>9.5f} {lg['max_rel']:>8.4f} "
                f"{lg['mean_rel']:>9.5f} {gr['prefix_agreement']:>12.1%} "
                f"{gr['identical_prompts']:>5}/{n_prompts[model]:<3} {margin:>10} {f.get('tensors_quantized', 0):>9} "
                f"{f.get('bytes_ratio', 1.0):>6.2f}"
            )
    lines += [
        "",
        f"|dl|: |logit difference| from the bf16 model over each prompt + its {report['settings']['new_tokens']} "
        "greedy tokens; std: the bf16 logits'",
        "min margin: the smallest bf16 top-2 logit margin where the greedy tokens diverge (0: an exact bf16 tie)",
        "quantized: projection matrices stored as codes; bytes: weight files converted / source",
        "float32 arithmetic: the unquantized weights computed in float32 against bf16 (bf16 rounding's own effect)",
        "bf16 scores whose argmax is the bf16 greedy token: "
        + ", ".join(f"{m} {r['ref_scores_pick_ref_tokens']:.1%}" for m, r in report["models"].items()),
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
