import pytest
import torch

from specdec.errors import InvalidInput
from specdec.tree import TokenTree, TreeCap, ancestor_mask, children_lists, depths, max_depth, validate_tree
from specdec.verify import verify_greedy


def test_worked_example_layout():
    # root r; a, b children of r; c child of a; d child of c
    parents = [-1, -1, 0, 2]
    assert depths(parents) == [1, 1, 2, 3]
    assert children_lists(parents) == ((1, 2), (3,), (), (4,), ())
    expected = torch.tensor([
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 0, 1, 0, 0],
        [1, 1, 0, 1, 0],
        [1, 1, 0, 1, 1],
    ], dtype=torch.bool)
    assert torch.equal(ancestor_mask(parents), expected)


def test_chain_mask_is_causal():
    assert torch.equal(ancestor_mask([-1, 0, 1]), torch.ones(4, 4, dtype=torch.bool).tril())


@pytest.mark.parametrize("tokens,parents,msg", [
    ([1, 2], [-1], "parents"),
    ([1, 2], [-1, 1], "earlier"),
    ([1, 2], [-2, 0], "root"),
    ([1, 999], [-1, 0], "vocabulary"),
    ([1] * 9, [-1] * 9, "maximum"),
])
def test_validate_tree_rejects_malformed(tokens, parents, msg):
    with pytest.raises(InvalidInput, match=msg):
        validate_tree(tokens, parents, vocab_size=100, max_nodes=8)


def test_greedy_walks_matching_children():
    tokens = [5, 6, 7, 8]
    parents = [-1, -1, 1, 2]  # 5 and 6 under root; 7 under 6; 8 under 7
    # target argmax per tree index: root->6, node1(5)->0, node2(6)->7, node3(7)->9, node4(8)->1
    v = verify_greedy(tokens, parents, [6, 0, 7, 9, 1])
    assert v.accepted == [2, 3] and v.bonus == 9
    v = verify_greedy(tokens, parents, [4, 0, 0, 0, 0])
    assert v.accepted == [] and v.bonus == 4


# ---- a request's own smaller tree shape (TreeCap) -----------------------------------------------------------


def _tree(parents):
    return TokenTree(tuple(100 + i for i in range(len(parents))), tuple(parents))


# two children of the root (10x, 101), each with two children, one grandchild under the first: depth-major order
WIDE = _tree([-1, -1, 0, 0, 1, 1, 2])


@pytest.mark.parametrize("cap, tokens, parents", [
    (TreeCap(3, 2, 7), WIDE.tokens, WIDE.parents),  # the service's own shape: unchanged
    (TreeCap(1, 2, 7), (100, 101), (-1, -1)),  # one level
    (TreeCap(3, 1, 7), (100, 102, 106), (-1, 0, 1)),  # each node's first child: a chain
    (TreeCap(3, 2, 3), (100, 101, 102), (-1, -1, 0)),  # the first 3 nodes, parents before children
    (TreeCap(2, 1, 1), (100,), (-1,)),
])
def test_tree_cap_prunes_the_services_tree(cap, tokens, parents):
    pruned = cap.prune(WIDE)
    assert (pruned.tokens, pruned.parents) == (tokens, parents)
    assert len(pruned.tokens) <= cap.num_draft_tokens and max_depth(pruned.parents) <= cap.num_steps
    assert all(list(pruned.parents).count(p) <= cap.topk for p in set(pruned.parents))


def test_tree_cap_of_a_chain_keeps_its_first_levels():
    chain = _tree([-1, 0, 1, 2, 3])
    assert TreeCap(5, 1, 2).prune(chain) == _tree([-1, 0])
    assert TreeCap(3, 1, 5).prune(chain) == _tree([-1, 0, 1])
    assert TreeCap(5, 1, 5).prune(chain) is chain
    assert TreeCap(5, 1, 5).prune(TokenTree((), ())) == TokenTree((), ())  # no proposal (near the context's end)
