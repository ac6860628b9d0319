"""benchmarks/tree_oracle.py: the drafter of known acceptance whose trees benchmarks/speculative.py --synthetic
verifies. Its draws, averaged over many passes, give what theory says a pass takes (the benchmark's few passes sit
around it by chance), and its trees are Sequoia's shape: the likeliest nodes, the main chain first."""

from __future__ import annotations

import pytest

from conftest import benchmark_module
from offload.model.speculation.tree import DraftTree
from offload.scheduler.drafts import main_chain


@pytest.fixture(scope="module")
def oracle_module():
    with benchmark_module("tree_oracle") as module:
        yield module


def walk(tree: DraftTree, truth: list[int]) -> int:
    """Tokens a pass takes when the target's choices are `truth`: the truth's path in the tree, then its own."""
    child = {(p, t): i for i, (p, t) in reversed(list(enumerate(zip(tree.parents, tree.tokens, strict=True))))}
    at, n = -1, 0
    while n < len(truth) and (at, truth[n]) in child:
        at, n = child[at, truth[n]], n + 1
    return n + 1


@pytest.mark.parametrize("accept,size", [(0.6, 32), (0.8, 64), (0.6, 256)])
def test_its_draws_average_to_theory(oracle_module, accept, size) -> None:
    output = list(range(100, 4100))
    oracle = oracle_module.TreeOracle(0, output, accept, 32000, size)
    taken = []
    for done in range(0, 3000, 5):
        tree = oracle.tree(output[:done])
        taken.append(walk(tree, output[done:]))
        assert oracle.starts[-1][2] == taken[-1]  # what it records for a pass is what the walk takes
    assert sum(taken) / len(taken) == pytest.approx(oracle.theory(), rel=0.05)


def test_its_tree_is_the_likeliest_nodes_main_chain_first(oracle_module) -> None:
    parents, ranks = oracle_module.best_tree(8, 0.6)
    assert len(parents) == 8 and main_chain(parents) == 4 and all(r == 1 for r in ranks[:4])
    assert all(p < i for i, p in enumerate(parents))
    chain_parents, _ = oracle_module.best_tree(8, 0.95)  # a drafter that is nearly always right: a chain
    assert main_chain(chain_parents) == 8
