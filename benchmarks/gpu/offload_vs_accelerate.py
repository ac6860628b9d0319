"""On a CUDA machine: a checkpoint about 3x the device budget, our engine at the batch the cost model picks vs
Accelerate's offload at the largest batch that fits the same budget.

    PYTHONPATH=. python3 benchmarks/gpu/offload_vs_accelerate.py [--budget 4GB] [--requests 256]
        [--prompt-len 128] [--gen-len 8] [--work-dir /tmp/offload-gpu] [--out benchmarks/results/gpu_<card>.json]

The checkpoint is a random bf16 Llama of Llama-2-7B's layer shape with as many layers as make it about three
times the budget, written once with safetensors (weights drawn on the GPU: seconds, not minutes). Both engines
get the same device budget, enforced for Accelerate with torch.cuda.set_per_process_memory_fraction (its KV cache
and activations must fit too) and by our allocator for ours; host RAM for layers is 0 for both, so every layer
that does not fit the card comes from disk through the page cache (Accelerate) or O_DIRECT (ours). The page cache
is dropped (or the checkpoint's pages evicted) before each run. Ours: `offload probe --quick` measures the machine,
the cost model picks batch, KV size and micro-batches (offload.planner.autoconfig), and one generate call serves every
request. Accelerate: batches 1, 2, 4, ... until one runs out of the budget; the largest that ran is reported.
Prints a table, writes JSON with the card named. Sized to finish in a few minutes on an H100/H200 class machine.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

HERE = Path(__file__).resolve().parent
LAYER_SHAPE = {  # Llama-2-7B's decoder layer
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
}


def sibling(name: str) -> ModuleType:
    """benchmarks/<name>.py, loaded by path (benchmarks/ is not on sys.path when this script runs) and registered in
    sys.modules under its name: dataclasses look their module up while being defined, and offload_vs_peers imports
    bench_common by name."""
    spec = importlib.util.spec_from_file_location(name, HERE.parent / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def siblings() -> tuple[ModuleType, ModuleType]:
    """benchmarks/bench_common.py (machine facts, generation, the report) and benchmarks/offload_vs_peers.py
    (page-cache helpers, the prompts), loaded in import order: offload_vs_peers imports peer_engines, which
    imports bench_common."""
    common, _ = sibling("bench_common"), sibling("peer_engines")
    return common, sibling("offload_vs_peers")


def layer_params() -> int:
    h, i = LAYER_SHAPE["hidden_size"], LAYER_SHAPE["intermediate_size"]
    return 4 * h * h + 3 * h * i + 2 * h


def build_checkpoint(work_dir: Path, budget: int) -> Path:
    """A random bf16 Llama about 3x `budget` bytes, written once."""
    from safetensors.torch import save_file

    h, vocab = LAYER_SHAPE["hidden_size"], LAYER_SHAPE["vocab_size"]
    layers = max(2, round((3 * budget - 2 * vocab * h * 2) / (layer_params() * 2)))
    model_dir = work_dir / f"llama7b-shape-{layers}L-bf16"
    if (model_dir / "config.json").exists():
        return model_dir
    tmp = model_dir.with_name(model_dir.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device="cuda", dtype=torch.bfloat16) * 0.02).cpu()

    i = LAYER_SHAPE["intermediate_size"]
    index = {}
    for shard, start in enumerate(range(0, layers, 4)):
        tensors = {}
        for layer in range(start, min(start + 4, layers)):
            p = f"model.layers.{layer}."
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                tensors[p + f"self_attn.{name}.weight"] = rand(h, h)
            tensors[p + "mlp.gate_proj.weight"] = rand(i, h)
            tensors[p + "mlp.up_proj.weight"] = rand(i, h)
            tensors[p + "mlp.down_proj.weight"] = rand(h, i)
            tensors[p + "input_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
            tensors[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        if start == 0:
            tensors["model.embed_tokens.weight"] = rand(vocab, h)
            tensors["lm_head.weight"] = rand(vocab, h)
            tensors["model.norm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        name = f"model-{shard:05d}.safetensors"
        save_file(tensors, tmp / name, metadata={"format": "pt"})
        index |= {t: name for t in tensors}
    (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_hidden_layers": layers,
        "rms_norm_eps": 1e-5,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        **LAYER_SHAPE,
    }
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    tmp.rename(model_dir)
    return model_dir


def prompts(peers: ModuleType, n: int, length: int) -> list[list[int]]:
    """The peer benchmark's seeded random prompts (its Workload), n of `length` tokens."""
    return peers.Workload(prompts=n, prompt_tokens=length).prompt_ids(LAYER_SHAPE["vocab_size"])


def run_ours(peers: ModuleType, model_dir: Path, args: argparse.Namespace) -> dict:
    from offload.api import LLM
    from offload.common.config import EngineConfig, SamplingParams
    from offload.planner.autoconfig import autoconfigure, describe
    from offload.planner.probe import ProbeSizes, probe

    hw = probe(args.work_dir, ProbeSizes.quick(), log=lambda line: print(line, file=sys.stderr))
    ids = prompts(peers, args.requests, args.prompt_len)
    base = EngineConfig(device="cuda", dtype="bfloat16", device_memory=args.budget_bytes, host_memory=0)
    config, prediction = autoconfigure(model_dir, base, [len(p) for p in ids], args.gen_len, hw)
    print(f"ours: {describe(prediction)}", flush=True)
    peers.drop_page_cache(sorted(model_dir.glob("*.safetensors")))
    llm = LLM(model_dir, config)
    start = time.perf_counter()
    out = llm.generate_ids(ids, SamplingParams(max_new_tokens=args.gen_len, ignore_eos=True))
    wall = time.perf_counter() - start
    stats, placement = llm.last_run, llm.placement
    result = {
        "status": "ok",
        "batch": config.max_num_seqs,
        "wall_seconds": wall,
        "generated_tokens": stats.generated_tokens,
        "tokens_per_second": stats.generated_tokens / wall,
        "predicted_tokens_per_second": prediction.tokens_per_second,
        "predicted_bound": prediction.bound,
        "layers": list(prediction.candidate.policy.counts),
        "device_peak_bytes": placement.device_peak,
        "cuda_max_allocated_bytes": torch.cuda.max_memory_allocated(),
        "bytes_read": stats.bytes_read,
        "read_gbps": stats.read_gbps,
        "overlap_efficiency": stats.overlap_efficiency,
        "stall_seconds": stats.stall_seconds,
        "first_tokens": [list(c.token_ids[:4]) for c in out[:2]],
        "profile": {"disk_read_gbps": hw.disk_read / 1e9, "h2d_gbps": hw.host_to_device / 1e9},
    }
    llm.close()
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return result


def run_accelerate_batch(
    common: ModuleType, peers: ModuleType, model_dir: Path, args: argparse.Namespace, batch: int
) -> dict:
    from transformers import AutoModelForCausalLM

    offload_dir = args.work_dir / "accelerate_offload"
    offload_dir.mkdir(parents=True, exist_ok=True)
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(args.budget_bytes / total, 1.0))
    torch.cuda.reset_peak_memory_stats()
    peers.drop_page_cache(peers.files_under(model_dir, offload_dir))
    model = AutoModelForCausalLM.from_pretrained(
        model_dir,
        device_map="auto",
        # weights may take 80% of the budget; the rest is for its KV cache and activations
        max_memory={0: int(args.budget_bytes * 0.8), "cpu": 0},
        offload_folder=str(offload_dir),
        dtype=torch.bfloat16,
    )
    model.eval()
    ids = torch.tensor(prompts(peers, batch, args.prompt_len), device="cuda")
    try:
        start = time.perf_counter()
        new = common.generate_exactly(model, ids, torch.ones_like(ids), args.gen_len)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
        return {
            "status": "ok",
            "batch": batch,
            "wall_seconds": wall,
            "generated_tokens": new.numel(),
            "tokens_per_second": new.numel() / wall,
            "cuda_max_allocated_bytes": torch.cuda.max_memory_allocated(),
            "first_tokens": new[:2, :4].tolist(),
        }
    except torch.cuda.OutOfMemoryError:
        return {"status": "out of memory", "batch": batch}
    finally:
        del model
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(1.0)


def main() -> None:
    from offload.common.sizes import parse_size

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default="4GB", help="device memory for each engine (weights, KV, activations)")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--gen-len", type=int, default=8)
    parser.add_argument("--max-accelerate-batch", type=int, default=256)
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/offload-gpu"))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA device")
    args.budget_bytes = parse_size(args.budget, "--budget")
    args.work_dir.mkdir(parents=True, exist_ok=True)
    card = torch.cuda.get_device_name(0)
    common, peers = siblings()
    start = time.perf_counter()
    model_dir = build_checkpoint(args.work_dir, args.budget_bytes)
    ckpt_bytes = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    print(f"checkpoint {model_dir.name}: {ckpt_bytes / 1e9:.1f} GB, built in {time.perf_counter() - start:.0f} s")
    ours = run_ours(peers, model_dir, args)
    accelerate = []
    batch = 1
    while batch <= min(args.max_accelerate_batch, args.requests):
        r = run_accelerate_batch(common, peers, model_dir, args, batch)
        accelerate.append(r)
        print(f"accelerate batch {batch}: {r['status']} {r.get('tokens_per_second', 0):.3f} tok/s", flush=True)
        if r["status"] != "ok":
            break
        batch *= 2
    fitted = [r for r in accelerate if r["status"] == "ok"]
    best_acc = max(fitted, key=lambda r: r["tokens_per_second"]) if fitted else None
    ratio = ours["tokens_per_second"] / best_acc["tokens_per_second"] if best_acc else None
    print()
    times = ckpt_bytes / args.budget_bytes
    print(f"card {card}, budget {args.budget}, checkpoint {ckpt_bytes / 1e9:.1f} GB ({times:.1f}x the budget)")
    print(
        f"ours        batch {ours['batch']:>4}: {ours['tokens_per_second']:9.2f} tok/s "
        f"(predicted {ours['predicted_tokens_per_second']:.2f}, {ours['predicted_bound']}-bound), "
        f"read {ours['read_gbps']:.2f} GB/s, overlap {ours['overlap_efficiency']:.2f}"
    )
    if best_acc:
        print(f"accelerate  batch {best_acc['batch']:>4}: {best_acc['tokens_per_second']:9.2f} tok/s")
        print(f"{'PASS' if ratio >= 20 else 'FAIL'}  ours / accelerate = {ratio:.1f}x (goal 20x)")
    report = {
        "benchmark": "gpu_offload_vs_accelerate",
        "date": common.timestamp(),
        "card": card,
        "machine": common.machine(args.work_dir),
        "budget_bytes": args.budget_bytes,
        "checkpoint_bytes": ckpt_bytes,
        "workload": {"requests": args.requests, "prompt_len": args.prompt_len, "gen_len": args.gen_len},
        "ours": ours,
        "accelerate": accelerate,
        "ours_over_accelerate": ratio,
    }
    slug = "".join(ch if ch.isalnum() else "_" for ch in card.lower()).strip("_")
    out = args.out or HERE.parent / "results" / f"gpu_{slug}.json"
    common.write_report(out, report)


if __name__ == "__main__":
    main()
