"""The shape of a draft tree (speculative decoding), as the scheduler and the engine need it: a drafter's tokens in
an order where every parent comes before its children, and each one's parent (-1: the sequence's last token, the
root). A chain's parents are -1, 0, 1, ...; a tree's first nodes so linked are its main chain, whose keys and values
the verifying step writes where accepted tokens belong (offload/model/speculation/tree.py has the rest)."""

from __future__ import annotations


def depths(parents: tuple[int, ...]) -> list[int]:
    """Each node's depth: 1 for a child of the root."""
    out: list[int] = []
    for p in parents:
        out.append(1 if p < 0 else out[p] + 1)
    return out


def depth(parents: tuple[int, ...] | None, drafted: int) -> int:
    """How deep a draft of `drafted` tokens goes: a chain's length (`parents` None), a tree's deepest node's depth."""
    return drafted if parents is None else max(depths(parents), default=0)


def main_chain(parents: tuple[int, ...]) -> int:
    """How many of the first nodes form a chain from the root."""
    n = 0
    while n < len(parents) and parents[n] == n - 1:
        n += 1
    return n


def kept_in_place(parents: tuple[int, ...] | None, drafted: tuple[int, ...], taken: tuple[int, ...]) -> int:
    """Of the drafted tokens a step accepted (`taken` without its last token, the target's own), how many stay
    cached: a chain's all (`parents` None); a tree's, those on its main chain, where their keys and values were
    written (an accepted token off it is computed again, as a known token, in the next step). The walk from the root
    moves to a node's first child holding the target's token, and the main chain's next node is its node's first
    child, so these are the leading tokens `taken` shares with the main chain."""
    if parents is None:
        return len(taken) - 1
    n, chain = 0, main_chain(parents)
    while n < min(chain, len(taken) - 1) and drafted[n] == taken[n]:
        n += 1
    return n
