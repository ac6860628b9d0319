"""How often a drafter's tokens are accepted for a model, measured before any real run: `offload probe --model M
--speculate METHOD` generates greedily from a few built-in chat prompts of two kinds and keeps what the drafts
scored in the model's record (offload/planner/speculation.py), which `offload plan --speculate` and the engine's own
chain length then price with instead of an assumed rate.

    rate = measure_acceptance(model, "self", k=8, topk=1, new_tokens=64)

The prompts are the speculative benchmark's (benchmarks/speculative.py): three that ask to repeat their input
(copy, quote, rewrite a passage of the bundled corpus), where prompt lookup shines, and three open-ended ones, where a
reply is the model's own. The record weighs them together, as a mixed workload would.
"""

from __future__ import annotations

from pathlib import Path

from offload.common.config import EngineConfig, SamplingParams
from offload.common.errors import OffloadError
from offload.planner.speculation import Acceptance, acceptance

CORPUS = Path(__file__).with_name("demo_corpus.txt")
PROBE_K = 8  # drafts a step where none is given: long enough that the rate, not the chain, limits a pass


def acceptance_prompts() -> dict[str, list[str]]:
    """Chat prompts by kind: "grounded" (the reply repeats its input) and "open" (the reply is the model's own)."""
    text = CORPUS.read_text()
    passages = [text[i : i + 700].rsplit(" ", 1)[0] for i in (0, 2000, 4000)]
    return {
        "grounded": [
            f"Copy the following passage exactly, word for word.\n\n{passages[0]}",
            f"List every sentence of this passage that mentions a number, quoting each exactly.\n\n{passages[1]}",
            f"Rewrite this passage with every sentence on its own line, keeping the words unchanged.\n\n{passages[2]}",
        ],
        "open": [
            "Write a short story about a lighthouse keeper who finds a message in a bottle.",
            "What are three good habits for staying healthy? Explain each briefly.",
            "Describe your ideal weekend in a few sentences.",
        ],
    }


def measure_acceptance(
    model: str, method: str, k: int | None = None, topk: int = 1, new_tokens: int = 64
) -> Acceptance:
    """Generate `new_tokens` greedy tokens from each of the prompts in turn with `method` drafting `k` tokens a step
    (trees of the top `topk`), which records the drafts' counts for `model`; the acceptance the plan now reads."""
    from offload.api import LLM

    k = k or PROBE_K
    engine = EngineConfig(speculate=method, num_speculative_tokens=k, speculative_topk=topk)
    with LLM(model, engine) as llm:
        if llm.prompts.tokenizer is None:
            raise OffloadError(f"--model {model}: has no tokenizer to encode the probe's prompts")
        for prompt in (p for kind in acceptance_prompts().values() for p in kind):  # one at a time: a stream's drafts
            ids = llm.encode_chat([{"role": "user", "content": prompt}])
            llm.generate_ids([ids], SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
        return acceptance(llm.model_dir, method, topk=topk)
