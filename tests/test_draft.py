"""specdec.draft: the Draft type and the pure functions deriving masks and positions."""

import pytest
import torch

from specdec.draft import Draft, children, depths, path_to, position_offsets, tree_attention_mask

# the lesson's K=2, s=2 tree (Ch. 4): b1, b2, b1c1, b1c2, b2c1, b2c2
TREE = [-1, -1, 0, 0, 1, 1]


def test_chain():
    d = Draft.chain([5, 6, 7])
    assert d.parents.tolist() == [-1, 0, 1] and d.is_chain and len(d) == 3 and d.q is None
    assert depths(d.parents).tolist() == [0, 1, 2]
    assert position_offsets(d.parents).tolist() == [1, 2, 3]
    assert torch.equal(tree_attention_mask(d.parents), torch.tril(torch.ones(3, 3, dtype=torch.bool)))


def test_empty():
    d = Draft.empty()
    assert len(d) == 0 and d.is_chain
    assert tree_attention_mask(d.parents).shape == (0, 0)
    assert children(d.parents) == [[]]


def test_lesson_tree():
    d = Draft(torch.tensor([1, 2, 3, 4, 5, 6]), torch.tensor(TREE))
    assert not d.is_chain
    assert depths(TREE).tolist() == [0, 0, 1, 1, 1, 1]
    assert position_offsets(TREE).tolist() == [1, 1, 2, 2, 2, 2]
    m = tree_attention_mask(TREE)
    # "b₁c₁ attends to itself, b₁, and the root — never to b₂ or anything under it"
    assert m[2].tolist() == [True, False, True, False, False, False]
    assert m[5].tolist() == [False, True, False, False, False, True]
    assert m.diagonal().all() and not m.triu(1).any()
    assert children(TREE) == [[0, 1], [2, 3], [4, 5], [], [], [], []]
    assert path_to(TREE, 4) == [1, 4]


def test_deeper_tree_mask_matches_ancestors():
    parents = [-1, 0, 0, 1, 3, -1, 5, 2]
    m = tree_attention_mask(parents)
    for i in range(len(parents)):
        anc = set(path_to(parents, i))
        assert {j for j in range(len(parents)) if m[i, j]} == anc
        assert depths(parents)[i] == len(anc) - 1


def test_chain_with_q():
    q = torch.full((2, 4), 0.25)
    d = Draft.chain(torch.tensor([1, 2]), q)
    assert d.q is q


@pytest.mark.parametrize(
    "make, name",
    [
        (lambda: Draft(torch.tensor([1, 2]), torch.tensor([-1, 1])), r"parents\[1\]"),
        (lambda: Draft(torch.tensor([1, 2]), torch.tensor([-1, -2])), r"parents\[1\]"),
        (lambda: Draft(torch.tensor([1, 2]), torch.tensor([-1])), "parents"),
        (lambda: Draft(torch.tensor([1.0, 2.0]), torch.tensor([-1, 0])), "tokens"),
        (lambda: Draft(torch.tensor([[1, 2]]), torch.tensor([-1, 0])), "tokens"),
        (lambda: Draft(torch.tensor([1, -2]), torch.tensor([-1, 0])), "tokens"),
        (lambda: Draft([1, 2], [-1, 1]), r"parents\[1\]"),  # lists are checked in Python (`_check_lists`)
        (lambda: Draft([1, 2], [-1, -2]), r"parents\[1\]"),
        (lambda: Draft([1, 2], [-1]), "parents"),
        (lambda: Draft([1.0, 2.0], [-1, 0]), "tokens"),
        (lambda: Draft([[1, 2]], [-1, 0]), "tokens"),
        (lambda: Draft([1, -2], [-1, 0]), "tokens"),
        (lambda: Draft([1, 2], [-1, 0], q=torch.ones(3, 4) / 4), "q"),
        (lambda: Draft.chain([1, 2], q=torch.ones(3, 4) / 4), "q"),
        (lambda: Draft.chain([1, 2], q=torch.ones(2, 4, dtype=torch.long)), "q"),
    ],
)
def test_bad_drafts_name_the_field(make, name):
    with pytest.raises(ValueError, match=name):
        make()


@pytest.mark.parametrize("tokens, parents", [([5, 6, 7], [-1, 0, 1]), ([1, 2, 3, 4, 5, 6], TREE), ([], []),
                                              ([4, 9], [-1, -1]), ([3, 3, 3], [-1, 0, 0])])
def test_lists_and_tensors_make_the_same_draft(tokens, parents):
    a, b = Draft(tokens, parents), Draft(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long))
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
    assert a.tokens.dtype == a.parents.dtype == torch.long and a.is_chain == b.is_chain and a.depth == b.depth
    assert Draft([torch.tensor(t) for t in tokens], parents).tokens.tolist() == tokens  # not ints: the tensor checks


def test_path_to_out_of_range():
    with pytest.raises(ValueError, match="node"):
        path_to(TREE, 6)


def test_aux_positions_come_after_the_root():
    from specdec.draft import Aux

    Aux(torch.tensor([5]), torch.tensor([1]), torch.ones(1, 1, dtype=torch.bool))
    with pytest.raises(ValueError, match="aux offsets must be >= 1"):
        Aux(torch.tensor([5]), torch.tensor([0]), torch.ones(1, 1, dtype=torch.bool))


def test_feedback_hands_each_learner_its_part_of_the_round():
    """The drafter gets the aux rows (after the root and the nodes) and the root's and nodes' rows; the
    policy learns from the tree's depth, not its node count (a tree of 3 nodes, 2 deep, one aux position)."""
    from specdec import round as rnd
    from specdec.draft import Aux
    from specdec.verify import VerifyResult

    class Spy:
        def __init__(self):
            self.seen = []

        def observe(self, *args):
            self.seen.append(args)

    aux = Aux(torch.tensor([7]), torch.tensor([1]), torch.ones(1, 1, dtype=torch.bool))
    draft = Draft(torch.tensor([1, 2, 3]), torch.tensor([-1, 0, -1]), aux=aux)
    logits = torch.arange(5.0)[:, None].expand(5, 4)  # row i holds i: root, 3 nodes, 1 aux
    result = VerifyResult(torch.tensor([1, 2, 0]), 2, [True, True, False], "bonus", [0, 1])
    drafter, policy = Spy(), Spy()
    rnd.feedback(drafter, policy, draft, result, [1, 2, 0], logits, 0.0, 0.0)
    (outcome,), = drafter.seen
    assert outcome.aux_logits[:, 0].tolist() == [4.0] and outcome.logits[:, 0].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert policy.seen == [(2, 2)]
