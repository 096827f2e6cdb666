"""Lookahead decoding (Fu et al. 2024; the lesson, Ch. 6): greedy output equals plain decoding, at least
one token per forward on adversarial inputs, each window/candidate position attends exactly where it
should (against a slow per-branch reference), the pool stays bounded, and sampling keeps the target's law."""

import copy

import pytest
import torch

from specdec.adaptive import FixedK
from specdec.decode import Request, decode
from specdec.draft import Draft, forward_layout
from specdec.drafters.base import Context, Outcome
from specdec.drafters.hybrid import Hybrid
from specdec.drafters.lookahead import Lookahead, NgramPool, auto_config, positions, trie, window_layout
from specdec.drafters.prompt_lookup import PromptLookup
from specdec.runtime.loader import load_transformer
from specdec.sampling import SamplingParams, make_generator
from specdec.tokenizer import Tokenizer
from tests.test_speculative import PROMPTS, empirical, exact_two_token_law
from tests.tiny import VOCAB, save_tiny


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def env(request, tmp_path_factory):
    folder = save_tiny(request.param, tmp_path_factory.mktemp(request.param), seed=0)
    return dict(target=load_transformer(folder), tok=Tokenizer(folder), folder=folder)


def run(env, ids, drafter=None, k=0, **kw):
    chunks = list(decode(env["target"], env["tok"], ids, Request(**kw), drafter, FixedK(k) if drafter else None))
    r = chunks[-1].result
    assert "".join(c.text for c in chunks) == r.text
    return r


CONFIGS = [(3, 4, 3), (1, 2, 1), (0, 3, 2), (5, 5, 4)]


@pytest.mark.parametrize("w,n,g", CONFIGS)
def test_greedy_equals_plain(env, w, n, g):
    eos = tuple(env["tok"].eos_ids)
    for text in PROMPTS[1:] + ["abcabcabcabcabc abcabc"]:
        ids = env["tok"].encode(text, chat=False)
        plain = run(env, ids, max_new_tokens=48)
        for pool in (True, False):
            spec = run(env, ids, Lookahead(w, n, g, pool=pool, eos_ids=eos), n - 1, max_new_tokens=48)
            assert spec.token_ids == plain.token_ids and spec.text == plain.text
            assert spec.finish_reason == plain.finish_reason
            assert spec.target_forwards <= plain.target_forwards


def test_repetitive_text_takes_several_tokens_per_forward(env):
    ids = env["tok"].encode("abcabcabcabcabc abcabc", chat=False)
    plain = run(env, ids, max_new_tokens=48)
    spec = run(env, ids, Lookahead(3, 4, 3), 3, max_new_tokens=48)
    # the tiny random model falls into a loop: the pool sees it and drafts it (a negative control for the
    # "at least one token" tests below, which would pass for plain decoding too)
    assert spec.mean_accepted > 1.5 and spec.target_forwards < plain.target_forwards


def test_statistics_count_tree_depth_not_nodes(env):
    """Trees of up to 3 guesses, 3 deep: acceptance per depth (3 entries, not one per node) and
    accepted / drafted depth (not / nodes)."""
    ids = env["tok"].encode("abcabcabcabcabc abcabc", chat=False)
    r = run(env, ids, Lookahead(3, 4, 3), 3, max_new_tokens=48)
    trees = [x for x in r.rounds if x["drafted"] > x["depth"]]
    assert trees and all(x["depth"] <= 3 and x["accepted"] <= x["depth"] for x in r.rounds)
    assert len(r.accepted_per_position) == 3
    assert r.acceptance_rate == r.accepted / sum(x["depth"] for x in r.rounds) > r.accepted / r.drafted
    first = [x for x in r.rounds if x["depth"]]
    assert r.accepted_per_position[0] == sum(x["accepted"] > 0 for x in first) / len(first)


def near_uniform(folder):
    model = load_transformer(folder)
    with torch.no_grad():
        model.lm_head.weight.mul_(1e-4)  # logits ~ 0: the argmax is an accident, nothing repeats
    return model


def test_at_least_one_token_per_forward_on_adversarial_inputs(env):
    gen = torch.Generator().manual_seed(0)
    random_ids = torch.randint(3, VOCAB, (40,), generator=gen).tolist()
    for target in (env["target"], near_uniform(env["folder"])):
        e = dict(env, target=target)
        for ids in (random_ids, env["tok"].encode("xyz", chat=False)):
            plain = run(e, ids, max_new_tokens=40)
            spec = run(e, ids, Lookahead(3, 4, 3), 3, max_new_tokens=40)
            assert spec.token_ids == plain.token_ids
            assert all(r["committed"] >= 1 for r in spec.rounds)
            assert spec.new_tokens / spec.target_forwards >= 1.0


def test_window_layout_matches_the_worked_example():
    # W = 2, N = 3: a0 a1 (level 0), b0 b1 (level 1), level-major
    offsets, mask = window_layout(2, 2)
    assert offsets.tolist() == [1, 2, 2, 3]
    a0, a1, b0, b1 = range(4)
    seen = {i: set(mask[i].nonzero().flatten().tolist()) for i in range(4)}
    assert seen[a0] == {a0} and seen[a1] == {a0, a1}
    assert seen[b0] == {a0, b0} and seen[b1] == {a0, a1, b1}


def warmed_draft(env, ids, w=3, n=4, g=3):
    """A lookahead draft with a full window (N-1 levels) and pool candidates, as the loop would send it."""
    la = Lookahead(w, n, g)
    ctx = Context(list(ids), len(ids), SamplingParams(), make_generator(0))
    target = env["target"]
    for _ in range(n):  # fill the levels with real updates
        draft = la.propose(ctx, n - 1)
        logits = full_forward(target, ids, draft)
        la.observe(Outcome(draft, 0, [], logits[1 + len(draft):]))
    draft = la.propose(ctx, n - 1)
    assert len(la.levels) == n - 1 and len(draft.aux) == w * (n - 1) and len(draft) >= 2
    return draft


def full_forward(target, ids, draft):
    """The loop's combined forward: cache = ids[:-1], new positions = root + draft nodes + aux."""
    cache = target.new_cache(len(ids) + 64)
    target(torch.tensor([ids[:-1]]), cache)
    start = cache.length
    offsets, local = forward_layout(draft)
    extra = draft.aux.tokens.tolist() if draft.aux is not None else []
    mask = torch.ones(1, len(offsets), start + len(offsets), dtype=torch.bool)
    mask[0, :, start:] = local
    inputs = torch.tensor([[ids[-1]] + draft.tokens.tolist() + extra])
    return target(inputs, cache, positions=(start + offsets)[None], mask=mask).logits[0]


def test_every_position_sees_exactly_its_branch(env):
    """Slow reference: for each new position, a plain causal forward over the context and the tokens that
    position should see (its trajectory: the root, then its ancestors or its window path), in order."""
    ids = env["tok"].encode("the cat sat on the mat. the cat sat", chat=False)
    draft = warmed_draft(env, ids)
    target = env["target"]
    logits = full_forward(target, ids, draft)
    tokens = [ids[-1]] + draft.tokens.tolist() + draft.aux.tokens.tolist()
    offsets, local = forward_layout(draft)
    n, w = len(draft), 3
    for i in range(len(tokens)):
        visible = local[i].nonzero().flatten().tolist()
        assert [int(offsets[j]) for j in visible] == list(range(int(offsets[i]) + 1))  # a consecutive path
        seq = ids[:-1] + [tokens[j] for j in visible]
        ref = target(torch.tensor([seq]), target.new_cache(len(seq))).logits[0, -1]
        torch.testing.assert_close(logits[i], ref, atol=1e-4, rtol=1e-4)
        if i > n:  # a window position (l, c) sees level 0's columns 0..c, then its own column upwards
            l, c = divmod(i - 1 - n, w)
            expect = [0] + [1 + n + j for j in range(c + 1)] + [1 + n + u * w + c for u in range(1, l + 1)]
            assert visible == expect


def test_pool_is_bounded_and_most_recent_first():
    pool = NgramPool(3, per_key=2, max_keys=3)
    pool.add([1, 2, 3])
    pool.add([1, 4, 5])
    pool.add([1, 6, 7])
    assert pool.get(1, 5) == [(6, 7), (4, 5)]  # the oldest continuation fell out
    for key in (8, 9, 10):
        pool.add([key, 0, 0])
    assert pool.get(1, 5) == [] and len(pool.table) == 3  # key 1 was the least recently used
    pool.add_sequence([4, 5, 6, 7])
    assert pool.get(4, 1) == [(5, 6)] and pool.get(5, 1) == [(6, 7)]
    with pytest.raises(ValueError):
        pool.add([1, 2])


def test_trie_merges_shared_prefixes():
    d = trie([(5, 6, 7), (5, 6, 8), (9, 1, 2)], depth=2)
    assert d.tokens.tolist() == [5, 6, 9, 1] and d.parents.tolist() == [-1, 0, -1, 2] and d.depth == 2


def test_auto_config_fits_the_budget():
    for budget in (1, 4, 8, 16, 32, 64, 160):
        w, n, g = auto_config(budget)
        assert positions(w, n, g) <= budget or (w, n, g) == (0, 4, 1)
    assert auto_config(160) == (15, 5, 15)  # the paper's GPU setting once the budget allows it
    assert auto_config(2) == (0, 4, 1)  # no room for a window: the pool's candidates only


def test_window_stops_at_a_guessed_eos_and_near_the_token_limit():
    la = Lookahead(4, 3, 1, eos_ids=(7,))
    la.levels = [[1, 2, 3, 4], [2, 7, 4, 5]]
    assert la._columns(2) == 2    # columns after the guessed EOS are not sent
    assert la._columns(1) == 0    # fewer tokens left than a candidate: no window at all


def test_sampling_keeps_the_target_distribution(tmp_path):
    """Pool candidates are deterministic drafts verified by rejection sampling on a tree (several children
    of the root): the first two tokens' law over many seeds matches plain sampling's exact law."""
    folder = save_tiny("llama", tmp_path, seed=0)
    tok = Tokenizer(folder)
    tok.eos_ids = frozenset()
    env = dict(target=load_transformer(folder), tok=tok)
    ids = tok.encode("ab ac ad a", chat=False)  # the root 'a' has three pool continuations
    sampling = SamplingParams(temperature=1.5, top_k=12)
    p1, p2 = exact_two_token_law(env, ids, sampling)
    emp = empirical(env, ids, Lookahead(2, 3, 3), sampling, 800)
    tv = [0.5 * (emp[i] - p).abs().sum().item() for i, p in enumerate((p1, p2))]
    assert tv[0] < 0.1 and tv[1] < 0.18, tv


def test_hybrid_carries_the_window_and_feeds_the_pool(env):
    ids = env["tok"].encode(PROMPTS[1], chat=False)
    plain = run(env, ids, max_new_tokens=40)
    la = Lookahead(2, 3, 2)
    spec = run(env, ids, Hybrid([PromptLookup(), la]), 2, max_new_tokens=40)
    assert spec.token_ids == plain.token_ids
    assert len(la.levels) == 2  # the window advanced in rounds prompt lookup drafted
    ctx = Context(list(ids), len(ids), SamplingParams(), make_generator(0))
    la.seed(ids[-1], Draft.chain([11, 12, 13]))
    assert (11, 12) in la.pool.get(ids[-1], 8)
    assert la.propose(ctx, 2).aux is not None


def test_cli_lookahead(env, capsys):
    import json

    from specdec.cli import main

    rc = main(["generate", "the cat sat on the mat. the cat", "--model", str(env["folder"]), "--dtype", "fp32",
               "--method", "lookahead", "--window", "2", "--ngram", "3", "--guesses", "2", "--no-chat",
               "--max-new-tokens", "20", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["method"] == "lookahead" and out["new_tokens"] == 20


# --- the window and the pool (found by mutating lookahead.py) ---


def test_observe_follows_the_worked_example():
    la = Lookahead(window=2, ngram=3, guesses=1)
    a0, a1, b0, b1, c0, c1 = 10, 11, 20, 21, 30, 31
    la.levels, la.sent = [[a0, a1], [b0, b1]], 2
    logits = torch.zeros(4, 40)  # level-major rows: (0, 0), (0, 1), (1, 0), (1, 1)
    for row, tok in enumerate([5, 6, c0, c1]):
        logits[row, tok] = 1.0
    la.observe(Outcome(Draft.empty(), 0, [1], aux_logits=logits))
    assert la.harvested == [(a0, b0, c0), (a1, b1, c1)]
    assert la.levels == [[b0, b1], [c0, c1]]


def test_the_pool_evicts_the_least_recently_used_key():
    pool = NgramPool(2, max_keys=2)
    for gram in ((1, 5), (2, 6), (1, 7), (3, 8)):  # key 1 used again after key 2
        pool.add(gram)
    assert pool.get(1, 8) == [(7,), (5,)] and pool.get(2, 8) == []


def test_add_sequence_takes_every_ngram_from_the_first():
    pool = NgramPool(3)
    pool.add_sequence([1, 2, 3, 4])
    assert pool.get(1, 8) == [(2, 3)] and pool.get(2, 8) == [(3, 4)]


def test_a_continuation_seen_again_is_the_most_recent():
    pool = NgramPool(2, per_key=2)
    for gram in ((1, 5), (1, 6), (1, 5), (1, 7)):  # 5 seen again: 6 is the oldest, evicted by 7
        pool.add(gram)
    assert pool.get(1, 8) == [(7,), (5,)]
