"""Draft trees (speculative decoding): several candidate continuations verified in one step, each node attending the
cached positions and its own ancestors at the position of its depth."""

from __future__ import annotations

import pytest
import torch
from test_speculative import GREEDY, PROMPTS, chi_square_p

from conftest import make_checkpoint
from offload.api import LLM
from offload.common.config import EngineConfig, SamplingParams
from offload.kernels.paged_batch import tree_visible
from offload.model.speculation.drafters import NgramDrafter
from offload.model.speculation.tree import DraftTree, accept_tree, expected_tokens
from offload.scheduler.drafts import depth, depths, kept_in_place, main_chain


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("trees")
    make_checkpoint(path, "llama", dtype=torch.float32)
    return path


class TreeOracle:
    """Knows each prompt's plain output; proposes a tree whose main chain is right for its first token only, a side
    branch that holds the next `side` true tokens, and a branch of noise: a pass keeps 1 + side tokens and the
    target's own after them, the side branch's computed again in the next step's chunk."""

    def __init__(self, prompts: list[list[int]], outputs: list[tuple[int, ...]], side: int = 3) -> None:
        self.known = {tuple(p): o for p, o in zip(prompts, outputs, strict=True)}
        self.side = side
        self.trees: list[DraftTree] = []

    def propose(self, sequences, k):
        out = []
        for ids in sequences:
            prompt = next(p for p in self.known if tuple(ids[: len(p)]) == p)
            truth = self.known[prompt][len(ids) - len(prompt) :][: self.side + 1]
            if not truth:
                out.append(())
                continue
            wrong = tuple((t + 1) % 256 for t in truth[1:])  # the main chain parts from the truth after its first
            noise = ((truth[0] + 7) % 256, (truth[0] + 9) % 256)
            tree = DraftTree.from_paths([(truth[0], *wrong), truth, noise])
            out.append(tree)
            self.trees.append(tree)
        return out

    def close(self):
        pass


def run(model_dir, prompts, params, drafter=None, **config):
    config = {"block_size": 4, "kv_cache_bytes": 1 << 22, "speculate": "ngram", "num_speculative_tokens": 16} | config
    with LLM(model_dir, EngineConfig(**config)) as llm:
        if drafter is not None or not config["speculate"]:
            llm.core.drafter = drafter
        out = llm.generate_ids(prompts, params)
        llm.check_integrity()
        assert llm.stats().kv_blocks_used == 0
        return [c.token_ids for c in out], llm.core.counters()


@pytest.mark.parametrize(
    "config", [{}, {"max_step_tokens": 12, "micro_batch_tokens": 4}, {"prefix_cache": False}], ids=str
)
def test_a_tree_whose_side_branch_holds_the_truth_gives_the_targets_greedy_output(model_dir, config) -> None:
    plain, before = run(model_dir, PROMPTS, GREEDY, speculate=None, **config)
    oracle = TreeOracle(PROMPTS, plain)
    got, counters = run(model_dir, PROMPTS, GREEDY, oracle, **config)
    assert got == plain
    assert any(main_chain(t.parents) < len(t) for t in oracle.trees)  # trees, not chains
    # each full pass keeps the main chain's first token, the side branch's 3 and the target's own: 5 tokens a pass
    assert counters.accepted_tokens >= 3 * counters.verify_passes
    assert counters.steps < before.steps / (1 if "max_step_tokens" in config else 2)  # a small budget cuts trees


def test_a_tree_with_one_sequence_steps_as_theory_says(model_dir) -> None:
    (plain,), before = run(model_dir, PROMPTS[:1], GREEDY, speculate=None)
    oracle = TreeOracle(PROMPTS[:1], [plain], side=3)
    (got,), counters = run(model_dir, PROMPTS[:1], GREEDY, oracle)
    assert got == plain
    # the prefill gives the first token; then every pass gives 5 (the last ones fewer, cut by the length)
    assert counters.steps == 1 + -(-(GREEDY.max_new_tokens - 1) // 5)
    # the passes' depths, for the planner's acceptance per depth: each tree's deepest path (4 while the output lasts)
    assert counters.draft_depth == sum(max(depths(t.parents)) for t in oracle.trees)
    assert counters.draft_depth < counters.drafted_tokens


def test_seeded_sampling_with_trees_is_reproducible_and_keeps_the_length(model_dir) -> None:
    (plain,), _ = run(model_dir, PROMPTS[:1], GREEDY, speculate=None)
    params = SamplingParams(max_new_tokens=16, ignore_eos=True, temperature=0.8, seed=5)
    once, _ = run(model_dir, PROMPTS[:1], params, TreeOracle(PROMPTS[:1], [plain]))
    again, _ = run(model_dir, PROMPTS[:1], params, TreeOracle(PROMPTS[:1], [plain]))
    assert once == again and len(once[0]) == 16


def test_ngram_offers_what_followed_its_earlier_occurrences_as_a_tree(model_dir) -> None:
    drafter = NgramDrafter(min_n=1, max_n=3, topk=2)
    (tree,) = drafter.propose([[1, 2, 9, 1, 2, 7, 1, 2]], 2)
    assert tree == DraftTree((7, 1, 9, 1), (-1, 0, -1, 2))  # the latest occurrence's (7, 1) the main chain
    assert drafter.propose([[1, 2, 9, 1, 2, 9, 1, 2]], 2) == [(9, 1)]  # both continue alike: a chain
    plain, _ = run(model_dir, PROMPTS, GREEDY, speculate=None)
    got, counters = run(model_dir, PROMPTS, GREEDY, None, speculative_topk=2)
    assert got == plain and counters.accepted_tokens > 0


def test_the_tree_shape_helpers() -> None:
    tree = DraftTree.from_paths([(1, 2, 3), (1, 5), (4,), (1, 2, 6)])
    assert tree.tokens == (1, 2, 3, 5, 4, 6) and tree.parents == (-1, 0, 1, 0, -1, 1)
    assert depths(tree.parents) == [1, 2, 3, 2, 1, 3] and main_chain(tree.parents) == 3
    assert depth(tree.parents, len(tree)) == 3 and depth(None, 5) == 5 and depth(None, 0) == 0
    seen = tree_visible(tree.parents)
    assert seen[5].nonzero().flatten().tolist() == [0, 1, 5] and seen[4].nonzero().flatten().tolist() == [4]
    assert kept_in_place(tree.parents, tree.tokens, (1, 2, 6, 9)) == 2  # 6 is off the main chain
    assert kept_in_place(tree.parents, tree.tokens, (1, 5, 9)) == 1
    with pytest.raises(ValueError, match="node 1: parent 1"):
        DraftTree((1, 2), (-1, 1))
    # a chain: (1 - a^(k+1)) / (1 - a); two children of the root, each right with its own chance
    assert expected_tokens((-1, 0, 1), [0.5] * 3) == pytest.approx((1 - 0.5**4) / 0.5)
    assert expected_tokens((-1, -1), [0.5, 0.25]) == pytest.approx(1.75)


def test_greedy_walk_follows_the_branch_the_target_chooses() -> None:
    tree = DraftTree.from_paths([(1, 2), (3, 4, 5)])  # nodes: 1, 2, 3, 4, 5
    logits = torch.full((6, 8), -5.0)
    for row, best in enumerate([3, 0, 0, 4, 5, 7]):  # root -> 3 -> 4 -> 5, then 7 after the leaf
        logits[row, best] = 5.0
    tokens, rows = accept_tree(logits, tree, 7, SamplingParams(), None)
    assert tokens == (3, 4, 5, 7) and rows == [0, 3, 4, 5]
    logits[4, 5], logits[4, 6] = -5.0, 5.0  # the target parts from the branch after 4
    assert accept_tree(logits, tree, 7, SamplingParams(), None) == ((3, 4, 6), [0, 3, 4])


def test_sampling_through_a_tree_keeps_the_targets_distribution() -> None:
    """Two tokens sampled through a tree (the root's children 0 and 1, node 0 with children 2 and 3) against the
    target's own sampling of them, by a chi-square test over 10,000 draws of the pair."""
    vocab = 5
    gen = torch.Generator().manual_seed(0)
    first = torch.randn(vocab, generator=gen)
    after = torch.randn(vocab, vocab, generator=gen)  # the logits after each first token
    tree = DraftTree((0, 1, 2, 3), (-1, -1, 0, 0))
    params = SamplingParams(temperature=1.0)
    counts = torch.zeros(vocab * vocab)
    for _ in range(10_000):
        # rows: root, then after nodes 0 (token 0), 1 (token 1), 2 and 3 (tokens 0, 2 and 0, 3: a third token's
        # logits, unused by this count)
        logits = torch.stack([first, after[0], after[1], first, first])
        sampled = int(torch.multinomial(first.softmax(-1), 1, generator=gen))
        tokens, _ = accept_tree(logits, tree, sampled, params, gen)
        a = tokens[0]
        b = tokens[1] if len(tokens) > 1 else int(torch.multinomial(after[a].softmax(-1), 1, generator=gen))
        counts[a * vocab + b] += 1
    probs = (first.softmax(-1)[:, None] * after.softmax(-1)).flatten()
    assert chi_square_p(counts, probs) > 0.01
