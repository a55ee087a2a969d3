"""Token trees: a root (the last committed token) plus draft nodes, each with a parent that precedes it.

Index convention used everywhere: node 0 is the root; draft node i (0-based in the proposal) is tree index i+1;
`parents[i]` is -1 for children of the root, else the proposal index of the parent (< i).

Worked example: tokens [a, b, c], parents [-1, -1, 0] -> a and b are children of the root, c a child of a;
depths [1, 1, 2]; verify input [root, a, b, c] at positions base + [0, 1, 1, 2].
"""

from __future__ import annotations

import collections
import functools
from dataclasses import dataclass

import torch

from specdec.errors import InvalidInput


@dataclass(frozen=True)
class TokenTree:
    tokens: tuple[int, ...]  # [num_draft_tokens] target-vocab ids
    parents: tuple[int, ...]  # [num_draft_tokens] -1 = root

    def __len__(self) -> int:
        return len(self.tokens)


def trees_valid(trees, vocab_size: int, max_nodes: int) -> bool:
    """Are all of `trees` ((tokens, parents) pairs) well formed? Each shape is checked once and the tokens' range
    over all of them at once (a verify of 128 requests repeats one shape: one by one it cost ~0.4 ms of host time);
    `validate_tree` says what is wrong with one."""
    shapes, tokens = set(), []
    for toks, parents in trees:
        if len(toks) != len(parents):
            return False
        shapes.add(tuple(parents))
        tokens += toks
    if any(len(p) > max_nodes or _bad_parent(p) is not None for p in shapes):
        return False
    return not tokens or (min(tokens) >= 0 and max(tokens) < vocab_size)


def validate_tree(tokens, parents, vocab_size: int, max_nodes: int) -> None:
    """InvalidInput naming the first thing wrong with one tree."""
    if len(tokens) != len(parents):
        raise InvalidInput(f"tree has {len(tokens)} tokens but {len(parents)} parents")
    if len(tokens) > max_nodes:
        raise InvalidInput(f"tree has {len(tokens)} draft tokens, more than the maximum {max_nodes}")
    for i, tok in enumerate(tokens):
        if not 0 <= tok < vocab_size:
            raise InvalidInput(f"draft token {tok} at index {i} outside the vocabulary [0, {vocab_size})")
    bad = _bad_parent(tuple(parents))
    if bad is not None:
        raise InvalidInput(f"parent {parents[bad]} of draft node {bad} must be -1 (root) or an earlier node index")


@functools.lru_cache(maxsize=4096)
def _bad_parent(parents: tuple[int, ...]) -> int | None:
    """The first node whose parent is neither the root (-1) nor an earlier node, or None."""
    return next((i for i, p in enumerate(parents) if not -1 <= p < i), None)


# The helpers below read a tree's shape only, and a batch repeats one shape (a chain, the same top-k tree) for every
# request: they are cached by the parents tuple (per request they cost ~15 us of host work a verify, ~2 ms at 128).

def depths(parents) -> list[int]:
    """Depth of each draft node (children of the root have depth 1)."""
    return list(_depths(tuple(parents)))


@functools.lru_cache(maxsize=4096)
def _depths(parents: tuple[int, ...]) -> tuple[int, ...]:
    out: list[int] = []
    for p in parents:
        out.append(1 if p < 0 else out[p] + 1)
    return tuple(out)


def max_depth(parents) -> int:
    """Depth of the deepest draft node (0 for no draft nodes)."""
    return max(_depths(tuple(parents)), default=0)


@dataclass(frozen=True)
class TreeCap:
    """A request's own, smaller tree shape (`SpecParams` on its Generate): at most `num_steps` levels, `topk`
    children per node and `num_draft_tokens` nodes, each no more than the draft service's."""

    num_steps: int
    topk: int
    num_draft_tokens: int

    def prune(self, tree: TokenTree) -> TokenTree:
        """The part of the service's `tree` this shape allows: nodes at most `num_steps` deep, each node's first
        `topk` children (a proposal lists a node's children best first), then the first `num_draft_tokens` of what
        is left in the tree's order (parents before children: for a chain, its first levels); parents remapped.
        Any such subtree verifies losslessly: it only drafts less."""
        if (len(tree.tokens) <= self.num_draft_tokens and max_depth(tree.parents) <= self.num_steps
                and max(collections.Counter(tree.parents).values(), default=0) <= self.topk):
            return tree  # within the shape already (a chain the service proposed as this request asks)
        new_index: dict[int, int] = {}
        children: dict[int, int] = {}
        tokens: list[int] = []
        parents: list[int] = []
        for i, (token, parent, depth) in enumerate(zip(tree.tokens, tree.parents, depths(tree.parents),
                                                       strict=True)):
            if len(tokens) == self.num_draft_tokens:
                break
            if depth > self.num_steps or (parent >= 0 and parent not in new_index) or \
                    children.get(parent, 0) == self.topk:
                continue
            children[parent] = children.get(parent, 0) + 1
            new_index[i] = len(tokens)
            tokens.append(token)
            parents.append(new_index[parent] if parent >= 0 else -1)
        return TokenTree(tuple(tokens), tuple(parents))


def is_chain(parents) -> bool:
    """Every node the child of the one before it (the first the root's): causal attention is its tree mask."""
    return _is_chain(tuple(parents))


@functools.lru_cache(maxsize=4096)
def _is_chain(parents: tuple[int, ...]) -> bool:
    return all(p == i - 1 for i, p in enumerate(parents))


def children_lists(parents) -> tuple[tuple[int, ...], ...]:
    """children[t] = tree indices of the children of tree node t (0 = root), in proposal order (shared between
    calls with the same parents: read only)."""
    return _children_lists(tuple(parents))


@functools.lru_cache(maxsize=4096)
def _children_lists(parents: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    children: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, p in enumerate(parents):
        children[p + 1].append(i + 1)
    return tuple(tuple(c) for c in children)


def ancestor_mask(parents) -> torch.Tensor:
    """[n+1, n+1] bool over tree indices: row t is True at t's ancestors (root included) and at t itself.
    Shared between calls with the same shape (a batch of chains asks for one mask): read it, never write it."""
    return _ancestor_mask(tuple(parents))


@functools.lru_cache(maxsize=4096)
def _ancestor_mask(parents: tuple[int, ...]) -> torch.Tensor:
    n = len(parents)
    mask = torch.zeros(n + 1, n + 1, dtype=torch.bool)
    mask[0, 0] = True
    for i, p in enumerate(parents):
        row = i + 1
        mask[row] = mask[p + 1]
        mask[row, row] = True
    return mask
