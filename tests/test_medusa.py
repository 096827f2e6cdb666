"""Medusa on tiny models: trees from rank paths, the calibrated tree, greedy equivalence with trees and
chains, exact sampling by enumeration (with a broken-residual control), deep-path cache compaction,
training (loss goes down, an interrupted run resumes to the same heads), heads refused for another
target, typical acceptance only when asked."""

import copy
import signal

import numpy as np
from collections import defaultdict

import pytest
import torch

from specdec import verify as V
from specdec.adaptive import FixedK
from specdec.decode import Request, decode
from specdec.draft import Draft, children, forward_layout
from specdec.drafters.base import Context
from specdec.drafters.medusa import (Medusa, MedusaHeads, TreeLayout, auto_nodes, calibrated_paths, chain,
                                     check_paths, path_probability)
from specdec.errors import SpecdecError
from specdec.runtime.loader import load_transformer
from specdec.sampling import SamplingParams, make_generator, probs_from_logits
from specdec.tokenizer import Tokenizer
from tests.tiny import VOCAB, save_tiny

K = 3


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    folder = save_tiny("llama", tmp_path_factory.mktemp("target"), seed=0)
    return dict(folder=folder, target=load_transformer(folder), tok=Tokenizer(folder))


def random_heads(seed=0, scale=0.3):
    torch.manual_seed(seed)
    heads = MedusaHeads(K, 64)
    with torch.no_grad():
        heads.weight.normal_(0, scale / 8)
        heads.bias.normal_(0, scale)
    return heads


def medusa(env, paths, heads=None):
    return Medusa(heads or random_heads(), env["target"].lm_head.weight.detach(), torch.arange(VOCAB), paths)


TREE = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 1, 0)]


class Oracle(Medusa):
    """Heads that know the target's greedy continuation: at depth i it sits at rank (i + round) % 3 (so
    accepted paths run through later siblings too), the other ranks are wrong tokens."""

    def __init__(self, env, paths):
        super().__init__(MedusaHeads(K, 64), env["target"].lm_head.weight.detach(), torch.arange(VOCAB), paths)
        self.model, self.round = env["target"], 0

    def propose(self, ctx, k):
        self.tokens, self.round = ctx.tokens, self.round + 1
        return super().propose(ctx, k)

    def candidates(self, hidden):
        ids, truth = list(self.tokens), []
        for _ in range(K):  # head i's true token: the target's greedy token i + 1 after the root
            ids.append(int(self.model(torch.tensor([ids]), self.model.new_cache(len(ids))).logits[0, -1].argmax()))
            truth.append(ids[-1])
        out = torch.zeros(K, self.layout.ranks, dtype=torch.long)
        for i in range(K):
            wrong = [t for t in range(3, VOCAB) if t != truth[i]]
            row = wrong[self.round % 7: self.round % 7 + self.layout.ranks]
            row[(i + self.round) % self.layout.ranks] = truth[i]
            out[i] = torch.tensor(row)
        return out


def run(env, ids, drafter=None, policy=None, **kw):
    chunks = list(decode(env["target"], env["tok"], ids, Request(**kw), drafter, policy))
    return chunks[-1].result


# --- trees ------------------------------------------------------------------------------------------

def test_layout_from_rank_paths():
    lay = TreeLayout([(0,), (1,), (0, 0), (0, 1), (0, 0, 0)])  # the module docstring's example
    assert lay.parents.tolist() == [-1, -1, 0, 0, 2]
    assert lay.depth.tolist() == [0, 0, 1, 1, 2] and lay.rank.tolist() == [0, 1, 0, 1, 0]
    assert [lay.size[d] for d in range(4)] == [0, 2, 4, 5] and lay.max_depth == 3
    with pytest.raises(ValueError, match="no parent path"):
        check_paths([(0,), (1, 0)], 3, 4)
    with pytest.raises(ValueError, match="1..3 ranks"):
        check_paths([(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)], 3, 4)
    check_paths([(0,), (3,)], 3, 4)
    with pytest.raises(ValueError, match=r"each in \[0, 4\)"):
        check_paths([(0,), (4,)], 3, 4)  # rank 4 of a 4-token draft vocabulary does not exist
    for bad in (5, None, {"a": 1}, [None], [[0], 5], [[0.5]], [[True]], [[0], ["1"]], []):  # a tree file's JSON
        with pytest.raises(ValueError, match="each a list of integer ranks"):  # was a TypeError, or 0.5 and true
            check_paths(bad, 3, 4)                                             # read as ranks 0 and 1
    assert check_paths([[0], [np.int64(1)]], 3, 4) == [(0,), (1,)]


def test_calibrated_tree_picks_the_likeliest_paths():
    acc = [[0.6, 0.2], [0.4, 0.15]]
    paths = calibrated_paths(acc, 4)
    assert paths == [(0,), (0, 0), (1,), (0, 1)]  # .6, .24, .2, .09
    for n in range(1, 7):  # every prefix is a tree
        check_paths(calibrated_paths(acc, n), 2, 2)
    assert auto_nodes(acc, lambda n: 1.0) == 6            # free positions: take every path
    assert auto_nodes(acc, lambda n: 1.0 + 0.5 * (n - 1)) == 1   # steep cost: one node


def test_calibrated_tree_scores_each_depth_with_its_own_rates():
    # head 1 is right 90% of the time after head 0's top token was: (0, 0) .45 beats (1,) .4
    acc = [[0.5, 0.4], [0.9, 0.1]]
    assert calibrated_paths(acc, 6) == [(0,), (0, 0), (1,), (1, 0), (0, 1), (1, 1)]  # .5 .45 .4 .36 .05 .04
    g = torch.Generator().manual_seed(0)
    acc = (torch.rand(3, 3, generator=g) * 0.5).tolist()
    every = [(a,) for a in range(3)] + [(a, b) for a in range(3) for b in range(3)] + [
        (a, b, c) for a in range(3) for b in range(3) for c in range(3)]
    by_probability = sorted(every, key=lambda p: -path_probability(acc, p))
    assert calibrated_paths(acc, len(every)) == by_probability  # the greedy is the exact ranking


def test_auto_nodes_counts_the_root_as_a_verified_position():
    # positions verified: the root + N nodes; 3 positions cost one step, 4 cost two
    acc = [[0.6, 0.2], [0.4, 0.15]]  # tree .6, .24, .2, ...: expected 1.6, 1.84, 2.04, ...
    assert auto_nodes(acc, lambda positions: 1.0 if positions <= 3 else 2.0) == 2
    assert auto_nodes(acc, lambda positions: 1.0 if positions <= 4 else 2.0) == 3


def test_draft_tokens_are_each_depths_head_at_each_rank(env):
    # the module docstring's tree: node (r0, .., rd) drafts head d's rank-rd candidate
    class Fixed(Medusa):
        def candidates(self, hidden):
            return torch.tensor([[10, 11], [20, 21], [30, 31]])

    d = Fixed(MedusaHeads(K, 64), env["target"].lm_head.weight.detach(), torch.arange(VOCAB),
              [(0,), (1,), (0, 0), (0, 1), (0, 0, 0)])
    ctx = Context([5, 6], 2, SamplingParams(), make_generator(0), hidden=torch.zeros(64))
    draft = d.propose(ctx, 3)
    assert draft.tokens.tolist() == [10, 11, 20, 21, 30] and draft.parents.tolist() == [-1, -1, 0, 0, 2]
    assert d.propose(ctx, 2).tokens.tolist() == [10, 11, 20, 21]


def test_candidates_are_target_ids_of_the_draft_vocabulary(env):
    vocab = torch.tensor([40, 7, 93, 12, 65, 3])  # draft index -> target id, not sorted
    lm = env["target"].lm_head.weight.detach()
    d = Medusa(MedusaHeads(K, 64), lm[vocab], vocab, chain(K))
    h = torch.randn(64, generator=torch.Generator().manual_seed(0))
    best = vocab[(lm[vocab] @ h).argmax()]  # zero heads: the LM head's favourite among the six
    assert d.candidates(h).flatten().tolist() == [int(best)] * K


def test_zero_initialised_heads_predict_what_the_lm_head_predicts(env):
    d = medusa(env, chain(K), MedusaHeads(K, 64))
    h = torch.randn(64)
    top = env["target"].lm_head.weight.detach() @ h
    assert (d.candidates(h) == top.topk(1).indices).all()


def test_tree_cut_at_depth_k(env):
    d = medusa(env, TREE)
    ctx = Context(tokens=[5, 6], prompt_len=2, sampling=SamplingParams(), generator=make_generator(0),
                  hidden=torch.randn(64))
    for k, n in [(1, 3), (2, 6), (3, 9), (8, 9)]:
        draft = d.propose(ctx, k)
        assert len(draft) == n == d.nodes(k) and draft.depth == min(k, 3) and draft.q is None
        for kids in children(draft.parents):  # siblings are distinct tokens: exact with q = None
            assert len({int(draft.tokens[c]) for c in kids}) == len(kids)
    assert len(d.propose(Context([5], 1, SamplingParams(), make_generator(0)), 3)) == 0  # no hidden: plain


# --- the loop: greedy equivalence, compaction, sampling -------------------------------------------

PROMPTS = ["the cat sat on the mat. the cat", "def f(x): return x", "zz"]


@pytest.mark.parametrize("paths", [TREE, chain(K), [(0,), (1,), (2,)]], ids=["tree", "chain", "wide"])
@pytest.mark.parametrize("which", ["random", "oracle"])
def test_greedy_equals_plain(env, paths, which):
    for text in PROMPTS:
        ids = env["tok"].encode(text, chat=False)
        plain = run(env, ids, max_new_tokens=30)
        d = Oracle(env, paths) if which == "oracle" else medusa(env, paths)
        spec = run(env, ids, d, FixedK(K), max_new_tokens=30)
        assert spec.token_ids == plain.token_ids and spec.finish_reason == plain.finish_reason
        if which == "oracle":
            assert spec.mean_accepted > 1.5 and spec.accepted > 0
            assert max(r["accepted"] for r in spec.rounds) >= min(2, max(map(len, paths)))


def test_compacting_a_deep_path_keeps_the_cache_exact(env):
    """Verify a 9-node tree, keep the path through later siblings (nodes 1 -> 5 ... ), then the next
    forward must equal a fresh forward over the committed tokens."""
    model = env["target"]
    ids = env["tok"].encode("the cat sat", chat=False)
    paths = [(0,), (1,), (2,), (0, 0), (1, 0), (1, 1), (1, 1, 0), (1, 1, 1), (1, 1, 2)]
    lay = TreeLayout(paths)
    tokens = torch.tensor([10, 11, 12, 20, 21, 22, 30, 31, 32])
    draft = Draft(tokens, lay.parents)
    keep = [1, 5, 8]  # (1,), (1, 1), (1, 1, 2): the second, then second, then third candidates
    cache = model.new_cache(64)
    model(torch.tensor([ids[:-1]]), cache)
    offsets, local = forward_layout(draft)
    start = cache.length
    mask = torch.ones(1, 1 + len(draft), start + 1 + len(draft), dtype=torch.bool)
    mask[0, :, start:] = local
    model(torch.tensor([[ids[-1]] + tokens.tolist()]), cache, positions=(start + offsets)[None], mask=mask)
    cache.compact([0] + [i + 1 for i in keep], newest=1 + len(draft))
    committed = ids + tokens[keep].tolist()
    assert cache.length == len(committed)
    nxt = model(torch.tensor([[40]]), cache).logits[0, -1]
    fresh = model(torch.tensor([committed + [40]]), model.new_cache(64)).logits[0, -1]
    assert torch.allclose(nxt, fresh, atol=1e-5)


def tree_law(tokens, parents, p_rows, residual):
    """Exact law {emitted tuple: probability} of the multi-candidate walk over a deterministic tree:
    at each node try the children in order, accept child x with probability cur(x), on rejection move
    to residual(cur, x); with no child accepted emit a token from cur."""
    kids, law = children(parents), defaultdict(float)

    def walk(node, prefix, w):
        cur, reach = p_rows[node + 1], w
        for c in kids[node + 1]:
            x = int(tokens[c])
            a = V.acceptance_probability(cur[x])
            if a > 0:
                walk(c, prefix + (x,), reach * a)
            reach *= 1 - a
            cur = residual(cur, x)
        for y in range(len(cur)):
            if reach * float(cur[y]) > 0:
                law[prefix + (y,)] += reach * float(cur[y])

    walk(-1, (), 1.0)
    return law


def correct_residual(cur, x):
    return V.residual_distribution(cur, None, x)


def broken_residual(cur, x):
    return cur  # forgets to remove the rejected candidate


def two_token_law(env, drafter, ids, sampling, residual):
    """Exact law of the first two emitted tokens of the Medusa loop: round 1 drafts from the hidden state
    at the prompt's second-to-last position; a round that emits one token is followed by a round drafting
    from the hidden state at that round's root."""
    model = env["target"]

    @torch.no_grad()
    def forward(prefix):
        out = model(torch.tensor([prefix]), model.new_cache(len(prefix)), hidden_layers=(-1,))
        p = probs_from_logits(out.logits[0, -1], sampling).double()
        return p / p.sum(), out.hidden[-1][0, -1]  # rows exactly normalized in float64

    def round_law(context, hidden_prefix):
        ctx = Context(list(context), len(context), sampling, make_generator(0), hidden=forward(hidden_prefix)[1])
        draft = drafter.propose(ctx, K)
        rows = [forward(list(context))[0]]
        for node in range(len(draft)):
            path = [int(draft.tokens[j]) for j in _path(draft.parents, node)]
            rows.append(forward(list(context) + path)[0])
        return tree_law(draft.tokens, draft.parents, torch.stack(rows), residual)

    joint = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    for seq, w in round_law(ids, ids[:-1]).items():
        if len(seq) >= 2:
            joint[seq[0], seq[1]] += w
        else:
            for seq2, w2 in round_law(ids + [seq[0]], ids).items():
                joint[seq[0], seq2[0]] += w * w2
    p1 = forward(ids)[0]
    exact = torch.stack([p1[t] * forward(ids + [t])[0] for t in range(VOCAB)])
    return joint, exact


def _path(parents, node):
    out = []
    while node >= 0:
        out.append(node)
        node = int(parents[node])
    return out[::-1]


def test_tree_sampling_is_exact_by_enumeration(env):
    ids = env["tok"].encode("the cat", chat=False)
    sampling = SamplingParams(temperature=1.5, top_k=6)  # peaky enough that drafts get accepted
    for d in (medusa(env, TREE), Oracle(env, TREE)):
        joint, exact = two_token_law(env, d, ids, sampling, correct_residual)
        assert abs(joint.sum().item() - 1) < 1e-9
        assert (joint - exact).abs().max().item() < 1e-9
        broken, _ = two_token_law(env, d, ids, sampling, broken_residual)
        assert 0.5 * (broken - exact).abs().sum().item() > 0.01  # the enumeration catches a broken residual


def test_the_loop_samples_like_its_exact_law(env):
    """The decode loop itself (verify's tree walk) against the enumerated law: first-token histogram."""
    tok = copy.copy(env["tok"])
    tok.eos_ids = frozenset()
    e = dict(env, tok=tok)
    ids = tok.encode("the cat", chat=False)
    sampling = SamplingParams(temperature=1.5, top_k=6)
    d = medusa(env, TREE)
    _, exact = two_token_law(env, d, ids, sampling, correct_residual)
    n, counts = 600, torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    for seed in range(n):
        sp = SamplingParams(temperature=1.5, top_k=6, seed=seed)
        r = run(e, ids, d, FixedK(K), max_new_tokens=2, sampling=sp)
        counts[r.token_ids[0], r.token_ids[1]] += 1
    tv1 = 0.5 * (counts.sum(1) / n - exact.sum(1)).abs().sum().item()
    tv2 = 0.5 * (counts.sum(0) / n - exact.sum(0)).abs().sum().item()
    assert tv1 < 0.1 and tv2 < 0.15, (tv1, tv2)


def test_typical_acceptance_only_when_asked(env):
    ids = env["tok"].encode("the cat", chat=False)
    d = Oracle(env, TREE)
    sp = SamplingParams(temperature=0.8, seed=3)
    exact = run(env, ids, d, FixedK(K), max_new_tokens=20, sampling=sp)
    assert exact.distribution_exact
    lossy = run(env, ids, d, FixedK(K), max_new_tokens=20, sampling=sp, acceptance="typical",
                posterior_threshold=0.3, posterior_alpha=0.5)
    assert not lossy.distribution_exact
    assert run(env, ids, d, FixedK(K), max_new_tokens=5, acceptance="typical").distribution_exact  # greedy
    plain = run(env, ids, max_new_tokens=20, sampling=sp, acceptance="typical")  # no drafter: nothing accepted loosely
    assert plain.distribution_exact and plain.token_ids == run(env, ids, max_new_tokens=20, sampling=sp).token_ids
    with pytest.raises(ValueError, match="acceptance"):
        Request(acceptance="lossy")


def test_typical_acceptance_reads_threshold_as_epsilon_and_alpha_as_delta(env):
    """Request.posterior_threshold is verify's epsilon (the cap, at most 1) and posterior_alpha its delta (the
    entropy factor, any positive value): threshold min(epsilon, delta * exp(-H)). Epsilon 1 with delta 50
    (50 * exp(-H) >= 50 / 96 > 1 here) makes the threshold 1, which no probability beats: every draft is
    rejected. Epsilon 1e-6 with delta 0.5: the oracle's true tokens (p well above 1e-6) are accepted."""
    ids = env["tok"].encode("the cat", chat=False)
    sp = SamplingParams(temperature=0.8, seed=3)
    none = run(env, ids, Oracle(env, TREE), FixedK(K), max_new_tokens=12, sampling=sp, acceptance="typical",
               posterior_threshold=1.0, posterior_alpha=50.0)
    assert none.accepted == 0 and none.drafted > 0 and none.new_tokens == 12
    most = run(env, ids, Oracle(env, TREE), FixedK(K), max_new_tokens=12, sampling=sp, acceptance="typical",
               posterior_threshold=1e-6, posterior_alpha=0.5)
    assert most.mean_accepted > 2


# --- training and the heads file --------------------------------------------------------------------

@pytest.fixture(scope="module")
def hidden(env, tmp_path_factory):
    from specdec.training import corpus, hidden_cache

    words = ["the cat", "sat on", "a mat", "and then", "it ran", "far away"]
    g = torch.Generator().manual_seed(0)
    docs = [" ".join(words[int(i)] for i in torch.randint(0, 6, (60,), generator=g)) for _ in range(8)]
    folder = tmp_path_factory.mktemp("hidden")
    toks = corpus.token_documents(docs, env["tok"], max_len=200)
    cache = hidden_cache.build(env["target"], toks, folder / "c", 1200, {"test": 1}, progress=False)
    assert len(cache) == 1200 and cache.hidden.shape == (1200, 64)
    again = hidden_cache.build(None, iter(()), folder / "c", 1200, {"test": 1}, progress=False)  # no target pass
    assert (again.labels == cache.labels).all()
    return cache


def mean_loss(heads, cache, lm, ex):
    import numpy as np
    import torch.nn.functional as F

    idx = ex.train
    logits = heads(torch.from_numpy(np.asarray(cache.hidden[idx], dtype=np.float32))) @ lm[ex.vocab].t()
    return F.cross_entropy(logits.flatten(0, 1), torch.from_numpy(ex.target[idx]).flatten(), ignore_index=-1).item()


def test_examples_label_head_i_with_the_targets_token_i_plus_one_ahead():
    """Examples by hand (found by mutating training/medusa.py: a shift by one or labels across a document boundary
    went unnoticed): head i at position t learns labels[t + i + 1] of the same document, -1 past its end; the draft
    vocabulary is the training documents' labels, most frequent first; held-out positions have a head-0 label."""
    import numpy as np

    from specdec.training import medusa as T
    from specdec.training.hidden_cache import HiddenCache

    labels = np.array([10, 11, 12, 13, 14, 15, 16, 17, 18, 19], np.int32)
    doc = np.array([0, 0, 0, 0, 1, 1, 1, 2, 2, 2], np.int32)
    cache = HiddenCache(None, {"tokens": 10}, labels=labels, tokens=labels, doc=doc)
    ex = T.Examples(cache, T.TrainSettings(heads=2, val_fraction=0.05))
    assert ex.full.tolist() == [[11, 12], [12, 13], [13, -1], [-1, -1], [15, 16], [16, -1], [-1, -1],
                                [18, 19], [19, -1], [-1, -1]]
    assert ex.vocab.tolist() == [10, 11, 12, 13, 14, 15, 16]  # documents 0 and 1 train, document 2 is held out
    assert ex.target[:, 0].tolist() == [1, 2, 3, -1, 5, 6, -1, -1, -1, -1]  # 18, 19: outside the draft vocabulary
    assert ex.train.tolist() == [0, 1, 2, 4, 5] and ex.val.tolist() == [7, 8]


@pytest.mark.parametrize("doc", [[0] * 10, [0] * 9 + [1]], ids=["one document", "a held-out document of one token"])
def test_a_corpus_without_validation_positions_is_one_clear_error(doc):
    """`specdec train medusa --data notes.txt` (one file: one document) ended in numpy's "need at least one array
    to concatenate" from the validation pass; it is the corpus-too-small line EAGLE's training gives."""
    import numpy as np

    from specdec.errors import SpecdecError
    from specdec.training import medusa as T
    from specdec.training.hidden_cache import HiddenCache

    labels = np.arange(10, 20, dtype=np.int32)
    cache = HiddenCache(None, {"tokens": 10}, labels=labels, tokens=labels, doc=np.array(doc, np.int32))
    with pytest.raises(SpecdecError, match="corpus is too small: need at least two documents"):
        T.Examples(cache, T.TrainSettings(heads=2))


def test_after_hits_counts_a_head_only_where_the_heads_before_it_hit():
    """evaluate by hand, with oracle heads (each head's top candidate is its label when the label is in the draft
    vocabulary): a held-out label outside the vocabulary is a miss for its head, and the next head's "after_hits"
    then leaves that position out (found by mutating training/medusa.py)."""
    import numpy as np

    from specdec.training import medusa as T
    from specdec.training.hidden_cache import HiddenCache

    labels = np.array([1, 2, 3, 1, 2, 3, 1, 2, 4, 1, 2, 3], np.int32)  # 4: only in the held-out document
    hidden = np.arange(12, dtype=np.float32)[:, None]  # row t holds t: the fake heads look their logits up by it
    cache = HiddenCache(None, {"tokens": 12}, labels=labels, tokens=labels, doc=np.repeat([0, 1], 6).astype(np.int32),
                        hidden=hidden)
    ex = T.Examples(cache, T.TrainSettings(heads=2, val_fraction=0.5))
    assert ex.val.tolist() == [6, 7, 8, 9, 10] and ex.vocab.tolist() == [1, 2, 3]
    assert ex.target[6:11].tolist() == [[1, -1], [-1, 0], [0, 1], [1, 2], [2, -1]]
    table = torch.nn.functional.one_hot(torch.from_numpy(ex.target).clamp(min=0), 3).float()
    table[torch.from_numpy(ex.target) < 0] = 0

    class Oracle:
        num_heads = 2

        def __call__(self, h):
            return table[h[:, 0].long()]

    val = T.evaluate(Oracle(), torch.eye(3), cache, ex)
    assert val["positions"] == 5 and val["top1"] == [0.8, 0.75]  # head 1: position 10's label is past the end
    assert val["after_hits"][0][0] == 0.8
    assert val["after_hits"][1][0] == 2 / 3  # positions 6, 8, 9: head 0 missed at 7


def test_evaluate_by_rank_top5_and_after_hits_within_the_top_8():
    """evaluate by hand with heads that put each label at a chosen rank: top5 sums ranks 0-4, and head 1's
    "after_hits" keeps every position where head 0's label was within its top RANKS = 8 candidates (a tree path
    through head 0's rank-1..7 candidates is reached too), not only where it was head 0's top-1."""
    import numpy as np

    from specdec.training import medusa as T
    from specdec.training.hidden_cache import HiddenCache

    labels = np.r_[np.arange(3, 13), [3, 4, 5, 6, 7, 8, 9]].astype(np.int32)  # document 0: 3..12, each once
    doc = np.r_[np.zeros(10), np.ones(7)].astype(np.int32)
    cache = HiddenCache(None, {"tokens": 17}, labels=labels, tokens=labels, doc=doc,
                        hidden=np.arange(17, dtype=np.float32)[:, None])
    ex = T.Examples(cache, T.TrainSettings(heads=2, val_fraction=0.5))
    assert ex.vocab.tolist() == list(range(3, 13)) and ex.val.tolist() == [10, 11, 12, 13, 14, 15]
    rank = {10: (0, 0), 11: (1, 0), 12: (4, 3), 13: (5, 1), 14: (9, 0), 15: (2, None)}  # 9: not in the top 8
    table = torch.zeros(17, 2, 10)
    for t, rs in rank.items():
        for i, r in enumerate(rs):
            if r is not None:
                label = int(ex.target[t, i])
                order = [d for d in range(10) if d != label]
                order.insert(r, label)
                table[t, i, order] = torch.arange(10, 0, -1).float()

    class Heads:
        num_heads = 2

        def __call__(self, h):
            return table[h[:, 0].long()]

    val = T.evaluate(Heads(), torch.eye(10), cache, ex)
    assert val["positions"] == 6
    assert val["by_rank"][0] == pytest.approx([1 / 6, 1 / 6, 1 / 6, 0, 1 / 6, 1 / 6, 0, 0])
    assert val["top1"] == pytest.approx([1 / 6, 3 / 5]) and val["top5"] == pytest.approx([4 / 6, 1.0])
    assert val["after_hits"][0] == val["by_rank"][0]
    assert val["after_hits"][1] == pytest.approx([2 / 4, 1 / 4, 0, 1 / 4, 0, 0, 0, 0])  # positions 10-13


def test_training_lowers_the_loss_and_resumes_exactly(env, hidden, tmp_path, monkeypatch):
    from specdec.training import medusa as T

    lm = env["target"].lm_head.weight.detach()
    s = T.TrainSettings(heads=K, epochs=2, batch=64, lr=3e-3, draft_vocab=40, checkpoint_every=5)
    full, report = T.train(hidden, lm, s, tmp_path / "a", progress=False)
    ex = T.Examples(hidden, s)
    trained = MedusaHeads(K, 64)
    trained.load_state_dict({"weight": full["weight"].float(), "bias": full["bias"].float()})
    assert mean_loss(trained, hidden, lm, ex) < mean_loss(MedusaHeads(K, 64), hidden, lm, ex) - 0.1
    assert len(report["val_accuracy"]["top1"]) == K and report["tree"]["paths"][0] == [0]

    calls = {"n": 0}
    real = T.F.cross_entropy

    def interrupted(*a, **kw):  # Ctrl-C in the 13th step (after the checkpoint at step 10): held to its end
        calls["n"] += 1
        if calls["n"] == 13:
            signal.raise_signal(signal.SIGINT)
        return real(*a, **kw)

    monkeypatch.setattr(T.F, "cross_entropy", interrupted)
    with pytest.raises(KeyboardInterrupt):
        T.train(hidden, lm, s, tmp_path / "b", progress=False)
    monkeypatch.setattr(T.F, "cross_entropy", real)
    assert torch.load(tmp_path / "b" / T.CHECKPOINT, weights_only=False)["step"] == 13  # saved at the step's end
    resumed, report_b = T.train(hidden, lm, s, tmp_path / "b", resume=True, progress=False)
    assert report_b["training"]["steps"] == report["training"]["steps"]
    assert torch.equal(resumed["weight"], full["weight"]) and torch.equal(resumed["bias"], full["bias"])
    with pytest.raises(SpecdecError, match="no checkpoint"):
        T.train(hidden, lm, s, tmp_path / "c", resume=True, progress=False)


def test_heads_for_another_target_are_refused(env, tmp_path):
    from specdec.training import heads

    other = save_tiny("llama", tmp_path / "other", seed=1)
    tensors = {"weight": torch.zeros(K, 64, 64), "bias": torch.zeros(K, 64), "vocab": torch.arange(VOCAB)}
    acc = {"after_hits": [[0.5, 0.2, 0.1]] * K}
    heads.save(tmp_path / "h", tensors, {"kind": "medusa", "target": {"name": "tiny-0",
               "fingerprint": heads.fingerprint(env["folder"])}, "heads": K, "hidden_size": 64, "val_accuracy": acc})
    got, config = heads.load(tmp_path / "h", "medusa", env["folder"], "tiny-0")
    assert config["heads"] == K and torch.equal(got["vocab"], torch.arange(VOCAB))
    with pytest.raises(SpecdecError, match="trained for 'tiny-0'.*not for 'tiny-1'.*specdec train medusa"):
        heads.load(tmp_path / "h", "medusa", other, "tiny-1")
    with pytest.raises(SpecdecError, match="no config.json"):
        heads.find("tiny-0", "medusa", tmp_path / "nothing")


def test_a_damaged_heads_folder_is_one_line(env, tmp_path, capsys):
    """A heads file cut short (a copy or download that stopped) or a config.json that is not JSON: one line naming
    the file and what to do, exit 2, never safetensors' or json's traceback."""
    from specdec.cli import main
    from specdec.training import heads

    tensors = {"weight": torch.zeros(K, 64, 64), "bias": torch.zeros(K, 64), "vocab": torch.arange(VOCAB)}
    heads.save(tmp_path / "h", tensors, {"kind": "medusa", "target": {"name": "tiny-0",
               "fingerprint": heads.fingerprint(env["folder"])}, "heads": K, "hidden_size": 64,
               "val_accuracy": {"after_hits": [[0.5, 0.2, 0.1]] * K}})
    weights, config = tmp_path / "h" / heads.WEIGHTS, tmp_path / "h" / heads.CONFIG
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(SpecdecError, match=r"heads\.safetensors: damaged or unreadable weights .*specdec train medusa"):
        heads.load(tmp_path / "h", "medusa", env["folder"], "tiny-0")
    gen = ["generate", "x", "--model", str(env["folder"]), "--method", "medusa", "--heads", str(tmp_path / "h"),
           "--max-new-tokens", "2"]
    for damaged in ("truncated", "config"):
        if damaged == "config":
            config.write_text("{")
        capsys.readouterr()
        assert main(gen) == 2
        err = capsys.readouterr().err.strip()
        assert "Traceback" not in err and "\n" not in err, err
        assert ("heads.safetensors: damaged" if damaged == "truncated" else "config.json: damaged") in err


def test_build_sizes_the_tree_and_the_prior_from_the_heads_file(env, tmp_path):
    from types import SimpleNamespace

    from specdec.drafters.medusa import build
    from specdec.training import heads

    tensors = {"weight": torch.zeros(K, 64, 64), "bias": torch.zeros(K, 64), "vocab": torch.arange(VOCAB)}
    acc = {"after_hits": [[0.5, 0.2, 0.1]] * K}  # tree (0,) .5, (0, 0) .25, (1,) .2, (0, 0, 0) .125, ...
    heads.save(tmp_path / "h", tensors, {"kind": "medusa", "target": {"name": "tiny-0",
               "fingerprint": heads.fingerprint(env["folder"])}, "heads": K, "hidden_size": 64, "val_accuracy": acc})
    llm = SimpleNamespace(name="tiny-0", folder=env["folder"], model=env["target"])
    d = build(llm, tmp_path / "h", "chain", tree_nodes=2)
    assert d.layout.parents.tolist() == [-1, 0] and d.k_max == 2  # a chain of tree_nodes nodes
    d = build(llm, tmp_path / "h", "auto", tree_nodes=3)
    assert d.layout.parents.tolist() == [-1, -1, 0]
    assert d.prior_alpha == pytest.approx(0.7)  # P(a first-level candidate is right): .5 + .2
    assert build(llm, tmp_path / "h", "auto", tree_nodes=4).prior_alpha == pytest.approx(0.7)
    acc["after_hits"][0] = [0.9, 0.08, 0.02]  # every first-level candidate: 1.0
    heads.save(tmp_path / "h2", tensors, {"kind": "medusa", "target": {"name": "tiny-0",
               "fingerprint": heads.fingerprint(env["folder"])}, "heads": K, "hidden_size": 64, "val_accuracy": acc})
    assert build(llm, tmp_path / "h2", "auto", tree_nodes=39).prior_alpha == pytest.approx(0.95)  # capped
    for config_heads, keep in ((K + 5, ("weight", "bias", "vocab")), (K, ("weight", "bias"))):
        heads.save(tmp_path / "h3", {n: tensors[n] for n in keep}, {  # heads: 9 by hand; no vocabulary
            "kind": "medusa", "target": {"name": "tiny-0", "fingerprint": heads.fingerprint(env["folder"])},
            "heads": config_heads, "hidden_size": 64, "val_accuracy": acc})
        with pytest.raises(SpecdecError, match=f"not {config_heads} heads of width 64 .*specdec train medusa"):
            build(llm, tmp_path / "h3", "auto", tree_nodes=3)  # was: load_state_dict's or a KeyError's traceback
    tree = tmp_path / "tree.json"  # ranks past the 3 that validation measured: drafted, counted 0 in the prior
    tree.write_text("[[0], [5], [0, 7]]")
    d = build(llm, tmp_path / "h", str(tree))
    assert d.prior_alpha == pytest.approx(0.5) and d.layout.rank.tolist() == [0, 5, 7]


class Recorder(Medusa):
    def propose(self, ctx, k):
        self.seen.append((list(ctx.tokens), ctx.hidden))
        return super().propose(ctx, k)


def test_heads_read_the_hidden_state_at_the_last_accepted_position(env):
    """Every round's Context.hidden is the target's final hidden state at the token before the root, as a
    fresh forward over the committed tokens computes it (prefill for round 1, the verify pass after)."""
    model = env["target"]
    for d in (Recorder(random_heads(), model.lm_head.weight.detach(), torch.arange(VOCAB), TREE),
              type("OracleRecorder", (Recorder, Oracle), {})(env, TREE)):
        d.seen = []
        run(env, env["tok"].encode("the cat sat", chat=False), d, FixedK(K), max_new_tokens=24)
        assert len(d.seen) > 5
        for tokens, hidden in d.seen:
            out = model(torch.tensor([tokens[:-1]]), model.new_cache(len(tokens)), hidden_layers=(-1,))
            assert torch.allclose(hidden, out.hidden[-1][0, -1], atol=1e-4)


def test_train_and_generate_from_the_command_line(env, tmp_path, monkeypatch, capsys):
    import json

    from specdec.cli import main

    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    data = tmp_path / "corpus.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"count {i}"}, {"role": "assistant", "content": "1 2 3 4 " * 9}]}
            for i in range(6)]
    data.write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "heads"
    args = ["train", "medusa", "--model", str(env["folder"]), "--data", str(data), "--tokens", "500", "--epochs", "1",
            "--heads", "2", "--draft-vocab", "30", "--batch", "32", "--out", str(out), "--quiet"]
    assert main(args) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["heads"] == 2 and config["data"]["tokens"] == 500 and len(config["tree"]["paths"]) > 2
    capsys.readouterr()
    gen = ["generate", "count 9", "--model", str(env["folder"]), "--method", "medusa", "--heads", str(out),
           "--tree-nodes", "3", "--k", "2", "--max-new-tokens", "8", "--json"]
    assert main(gen) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["distribution_exact"] and max(result["drafted_per_round"]) == 3
    other = save_tiny("llama", tmp_path / "other", seed=1)
    assert main(["generate", "x", "--model", str(other), "--method", "medusa", "--heads", str(out)]) == 2
    assert "trained for" in capsys.readouterr().err


def test_medusa_as_a_hybrid_source(env):
    """Rounds drafted by prompt lookup still bring the hidden state back for Medusa's next proposal."""
    from specdec.drafters.hybrid import Hybrid
    from specdec.drafters.prompt_lookup import PromptLookup

    ids = env["tok"].encode("the cat sat on the mat. the cat sat on", chat=False)
    plain = run(env, ids, max_new_tokens=40)
    h = Hybrid([PromptLookup(), Oracle(env, TREE)])
    assert h.wants_hidden
    spec = run(env, ids, h, FixedK(K), max_new_tokens=40)
    assert spec.token_ids == plain.token_ids
    stats = h.stats()
    assert stats["medusa"]["accepted"] > 0


def test_an_interrupted_hidden_cache_build_continues(env, tmp_path):
    from specdec.training import corpus, hidden_cache

    docs = [f"document {i}: " + "abc " * 30 for i in range(6)]
    toks = list(corpus.token_documents(docs, env["tok"], max_len=100))
    whole = hidden_cache.build(env["target"], iter(toks), tmp_path / "a", 400, {"t": 1}, progress=False)

    def stops_after_three():
        yield from toks[:3]
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        hidden_cache.build(env["target"], stops_after_three(), tmp_path / "b", 400, {"t": 1}, progress=False,
                           save_every=0)
    assert not (tmp_path / "b" / "meta.json").exists()
    calls = []

    class Counting:  # the target, counting its forwards
        cfg = env["target"].cfg
        new_cache = env["target"].new_cache

        def __call__(self, tokens, *a, **kw):
            calls.append(tokens.shape[1])
            return env["target"](tokens, *a, **kw)

    rest = hidden_cache.build(Counting(), iter(toks), tmp_path / "b", 400, {"t": 1}, progress=False)
    assert len(calls) == whole.meta["documents"] - 3  # only the documents the first build did not reach
    assert rest.meta == whole.meta
    for a in hidden_cache.arrays(None):
        assert np.array_equal(getattr(rest, a), getattr(whole, a))


def test_ctrl_c_during_an_optimizer_step_leaves_a_consistent_checkpoint(env, hidden, tmp_path, monkeypatch):
    """A real SIGINT arriving inside opt.step() (after the weights moved, before the step was counted) is held
    to the step's end: the checkpoint holds step 13's weights with step 13's count, so --resume ends exactly
    where an uninterrupted run does (before: weights one step ahead of the count, that batch applied twice)."""
    import signal

    from specdec.training import medusa as T

    lm = env["target"].lm_head.weight.detach()
    s = T.TrainSettings(heads=K, epochs=1, batch=64, lr=3e-3, draft_vocab=40, checkpoint_every=5)
    full, _ = T.train(hidden, lm, s, tmp_path / "a", progress=False)
    real = T.torch.optim.AdamW
    calls = {"n": 0}

    class Interrupted(real):
        def step(self, *a, **kw):
            out = super().step(*a, **kw)
            calls["n"] += 1
            if calls["n"] == 13:
                signal.raise_signal(signal.SIGINT)  # Ctrl-C lands right after the update
            return out

    monkeypatch.setattr(T.torch.optim, "AdamW", Interrupted)
    with pytest.raises(KeyboardInterrupt):
        T.train(hidden, lm, s, tmp_path / "b", progress=False)
    monkeypatch.setattr(T.torch.optim, "AdamW", real)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored
    assert torch.load(tmp_path / "b" / T.CHECKPOINT, weights_only=False)["step"] == 13
    resumed, _ = T.train(hidden, lm, s, tmp_path / "b", resume=True, progress=False)
    assert torch.equal(resumed["weight"], full["weight"]) and torch.equal(resumed["bias"], full["bias"])


def test_a_tiny_draft_vocabulary_trains_and_resume_names_what_differs(env, hidden, tmp_path):
    """Fewer draft tokens than the 8 ranks the accuracies measure (--draft-vocab 4, or a tiny corpus) trains and
    reports (before: a topk traceback at the first epoch's end); a resume may change how often it checkpoints
    (and Medusa's epochs), and a refusal names the setting that differs."""
    from specdec.training import medusa as T

    lm = env["target"].lm_head.weight.detach()
    s = T.TrainSettings(heads=K, epochs=1, batch=64, lr=3e-3, draft_vocab=4, checkpoint_every=5)
    tensors, report = T.train(hidden, lm, s, tmp_path / "a", progress=False)
    assert len(tensors["vocab"]) == 4 and report["val_accuracy"]["by_rank"][0][4:] == [0.0] * (T.RANKS - 4)
    more = T.TrainSettings(heads=K, epochs=2, batch=64, lr=3e-3, draft_vocab=4, checkpoint_every=7)
    _, again = T.train(hidden, lm, more, tmp_path / "a", resume=True, progress=False)
    assert again["training"]["steps"] == 2 * report["training"]["steps"]
    other = T.TrainSettings(heads=K, epochs=2, batch=32, lr=3e-3, draft_vocab=4, checkpoint_every=7)
    with pytest.raises(SpecdecError, match=r"batch 64 \(now 32\).*drop --resume"):
        T.train(hidden, lm, other, tmp_path / "a", resume=True, progress=False)


@pytest.mark.parametrize("bad, said", [(["--lr", "nan"], "--lr must be a positive number"),
                                       (["--lr", "0"], "--lr must be a positive number"),
                                       (["--max-len", "2"], "--max-len must be at least 3")])
def test_train_refuses_bad_numbers_before_the_target_loads(bad, said, capsys):
    from specdec.cli import main

    for kind in ("medusa", "eagle"):  # an unknown model: the check comes before anything resolves or loads
        assert main(["train", kind, "--model", "no-such-model", "--quiet", *bad]) == 2
        err = capsys.readouterr().err
        assert said in err and "unknown model" not in err


def test_an_eagle_folder_given_as_medusa_heads_is_named(env, tmp_path):
    """--method medusa --heads <an EAGLE head>: the error says it holds an EAGLE head (before: "holds None heads")."""
    import json

    from specdec.training import heads

    folder = tmp_path / "eagle"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"],
                                                    "specdec": {"kind": "eagle"}}))
    with pytest.raises(SpecdecError, match="holds 'eagle' heads, not 'medusa'.*specdec train medusa"):
        heads.load(folder, "medusa", env["folder"], "tiny-0")
    (folder / "config.json").write_text("{}")
    with pytest.raises(SpecdecError, match="names no kind"):
        heads.load(folder, "medusa", env["folder"], "tiny-0")


def test_resume_without_a_checkpoint_is_refused_before_the_corpus_pass(tmp_path, capsys):
    from specdec.cli import main

    for kind in ("medusa", "eagle"):  # an unknown model: the check comes before anything resolves or loads
        assert main(["train", kind, "--model", "no-such-model", "--out", str(tmp_path / kind), "--resume"]) == 2
        err = capsys.readouterr().err
        assert "--resume: no checkpoint in" in err and "unknown model" not in err
    afile = tmp_path / "afile"
    afile.write_text("x")
    for kind in ("medusa", "eagle"):  # a file for --out (or inside it): refused as early (was a FileExistsError after it)
        for out in (afile, afile / "heads"):
            assert main(["train", kind, "--model", "no-such-model", "--out", str(out)]) == 2
            err = capsys.readouterr().err
            assert f"{afile} is a file, not a folder" in err and "unknown model" not in err


def test_step_boundary_saves_only_a_whole_step():
    """Ctrl-C after the last step's end saves as the block ends (it was lost); a KeyboardInterrupt raised anywhere
    but at a step's end (mid-step: weights and count may disagree) keeps the last periodic checkpoint."""
    from specdec.training.medusa import StepBoundary

    saved = []
    with pytest.raises(KeyboardInterrupt):
        with StepBoundary(lambda: saved.append("step end")) as boundary:
            boundary.at_boundary()
            signal.raise_signal(signal.SIGINT)  # held: no step boundary follows
    assert saved == ["step end"]
    with pytest.raises(KeyboardInterrupt):
        with StepBoundary(lambda: saved.append("mid-step")):
            raise KeyboardInterrupt
    assert saved == ["step end"] and signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_an_empty_corpus_is_one_clear_error_and_leaves_no_out_folder(tmp_path):
    """`--data empty.txt` (or jsonl rows with none of the fields read) ended in an IndexError traceback; a corpus
    refused as too small left an empty --out folder behind (EAGLE's too)."""
    import numpy as np

    from specdec.training import eagle as E
    from specdec.training import medusa as T
    from specdec.training.hidden_cache import HiddenCache

    none = np.zeros(0, np.int32)
    empty = HiddenCache(None, {"tokens": 0}, labels=none, tokens=none, doc=none)
    with pytest.raises(SpecdecError, match=r"the corpus is empty: .*check --data"):
        T.Examples(empty, T.TrainSettings(heads=2))
    labels = np.arange(10, 20, dtype=np.int32)
    one = HiddenCache(None, {"tokens": 10}, labels=labels, tokens=labels, doc=np.zeros(10, np.int32),
                      features=np.zeros((10, 3), np.float16))
    with pytest.raises(SpecdecError, match="too small"):
        T.train(one, torch.zeros(VOCAB, 4), T.TrainSettings(heads=2), tmp_path / "medusa", progress=False)
    with pytest.raises(SpecdecError, match="too small"):
        E.train(one, None, "tiny", "fp", E.TrainSettings(), tmp_path / "eagle", progress=False)
    assert not list(tmp_path.iterdir())


def test_resume_refuses_fewer_epochs_than_the_checkpoint_trained(env, hidden, tmp_path):
    """`--resume --epochs 1` on a checkpoint past its first epoch finished at once and wrote the heads with a report
    of 1 epoch (the lower --epochs silently ignored); raising --epochs still trains on."""
    from specdec.training import medusa as T

    lm = env["target"].lm_head.weight.detach()
    s = T.TrainSettings(heads=K, epochs=2, batch=64, lr=3e-3, draft_vocab=40, checkpoint_every=5)
    T.train(hidden, lm, s, tmp_path / "a", progress=False)
    with pytest.raises(SpecdecError, match=r"--epochs 1: .* has trained 2 epoch\(s\); pass --epochs 2 or more"):
        T.train(hidden, lm, T.TrainSettings(**{**s.__dict__, "epochs": 1}), tmp_path / "a", resume=True,
                progress=False)
    with pytest.raises(SpecdecError, match=r"trained 0 epoch\(s\) and 3 step\(s\) of the next; pass --epochs 1"):
        T.check_epochs(tmp_path / "c.pt", 0, 3, 0)
    T.check_epochs(tmp_path / "c.pt", 2, 0, 2)  # a finished run resumed with its own epochs: fine


def test_train_refuses_an_empty_out(capsys):
    """`--out ''` was read as no --out: the heads went to the store's folder, where --method medusa|eagle finds them."""
    from specdec.cli import main

    for kind in ("medusa", "eagle"):  # an unknown model: the check comes before anything resolves or loads
        assert main(["train", kind, "--model", "no-such-model", "--out", ""]) == 2
        err = capsys.readouterr().err
        assert "--out is empty" in err and "unknown model" not in err


def test_a_jsonl_file_that_is_not_utf8_is_named(tmp_path):
    """A non-UTF-8 .jsonl gave only "'utf-8' codec can't decode byte 0xff ...": which file, and what to do?"""
    from specdec.training import corpus

    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"text": "\xff hi"}\n')
    with pytest.raises(SpecdecError, match=r"bad.jsonl: not UTF-8 text \(byte 0xff at offset 10\).*iconv"):
        list(corpus.file_documents([bad]))


def test_heads_are_found_under_the_models_safe_name_the_stores_first(tmp_path, monkeypatch):
    """`store_dir` keeps a model name's last part, letters, digits and -._ (the rest become _), and `find` looks in
    the store, then among the shipped heads, under that name (found by mutating training/heads.py: `or` -> `and`
    in `_safe` turned every name into underscores and passed)."""
    from specdec.training import heads

    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    assert heads.store_dir("org/SmolLM2 135M+v1.5_x", "medusa") == tmp_path / "heads" / "SmolLM2_135M_v1.5_x" / "medusa"
    shipped = heads.SHIPPED / "smollm2-135m" / "eagle"
    assert (shipped / heads.CONFIG).is_file() and heads.find("smollm2-135m", "eagle") == shipped
    mine = heads.store_dir("smollm2-135m", "eagle")
    mine.mkdir(parents=True)
    (mine / heads.CONFIG).write_text("{}")
    assert heads.find("smollm2-135m", "eagle") == mine
    with pytest.raises(SpecdecError, match="no medusa heads for tiny-9: .*specdec train medusa --model tiny-9"):
        heads.find("tiny-9", "medusa")
