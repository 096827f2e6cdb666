"""Token recycling: the table and the tree it drafts (the module's worked example), greedy output equal to
plain decoding, the sampled distribution kept, and multi-token commits ending where plain decoding ends."""

import copy

import pytest
import torch

from specdec.adaptive import AdaptiveK, FixedK
from specdec.draft import Draft
from specdec.drafters.base import Context, Outcome
from specdec.drafters.recycling import Recycling
from specdec.sampling import SamplingParams
from tests.test_speculative import PROMPTS, empirical, env, exact_two_token_law, run, with_eos  # noqa: F401

THE, CAT, SAT, ON, IS, WAS, DOWN, THERE, A = range(10, 19)


def context(tokens):
    return Context(tokens=list(tokens), prompt_len=len(tokens), sampling=SamplingParams(),
                   generator=torch.Generator())


def test_the_worked_example():
    r = Recycling(nodes=3, paths=[(0,), (0, 0), (1,)], lookup_chain=False)
    r.table = {(THE, CAT): (SAT, IS, WAS), (CAT, SAT): (ON, DOWN, THERE)}
    d = r.propose(context([A, THE, CAT]), k=2)
    assert d.tokens.tolist() == [SAT, ON, IS] and d.parents.tolist() == [-1, 0, -1]
    # k bounds the depth: a depth-1 draft keeps the two siblings
    d = r.propose(context([A, THE, CAT]), k=1)
    assert d.tokens.tolist() == [SAT, IS] and d.parents.tolist() == [-1, -1]
    # the last token alone is the fallback key
    r.table = {CAT: (IS,)}
    assert r.propose(context([A, THE, CAT]), k=2).tokens.tolist() == [IS]
    assert len(r.propose(context([A, THE, ON]), k=2)) == 0  # nothing known after ON: a plain step


def test_observe_keys_every_verified_row_by_its_parent_and_token():
    r = Recycling(nodes=3, paths=[(0,), (0, 0), (1,)], lookup_chain=False)
    r.propose(context([A, THE, CAT]), k=2)  # the root is CAT, after THE
    logits = torch.zeros(4, 32)
    for row, best in enumerate([SAT, ON, DOWN, THERE]):
        logits[row, best] = 5.0
    draft = Draft([SAT, ON, IS], [-1, 0, -1])
    r.observe(Outcome(draft, 2, [SAT, ON, DOWN], logits=logits))
    top = lambda key: r.table[key][0]  # noqa: E731
    assert top((THE, CAT)) == SAT and top((CAT, SAT)) == ON and top((SAT, ON)) == DOWN and top((CAT, IS)) == THERE
    assert top(CAT) == SAT and top(IS) == THERE and len(r.table[CAT]) == r.ranks
    assert r.tail == [ON, DOWN]  # the committed tokens move the context on, ready for a round nobody drafted
    # the prompt-lookup chain comes first, recycled paths fill the nodes left, repeats are one node
    r = Recycling(nodes=3, paths=[(0,), (1,), (0, 0)])
    r.table = {(5, 6): (7, 9)}
    d = r.propose(context([5, 6, 7, 8, 5, 6]), k=2)
    assert d.tokens.tolist() == [7, 8, 9] and d.parents.tolist() == [-1, 0, -1]
    # a lookup matching the last token only comes after the recycled candidates
    r.table = {(3, 6): (4,)}
    d = r.propose(context([5, 6, 9, 3, 6]), k=2)
    assert d.tokens.tolist() == [4, 9, 3] and d.parents.tolist() == [-1, -1, 1]
    # recurring text: the chain may go k deep, past N nodes (and the policy prices k positions)
    r = Recycling(nodes=2)
    d = r.propose(context([1, 2, 3, 4, 5, 6, 7, 1, 2]), k=5)
    assert d.tokens.tolist() == [3, 4, 5, 6, 7] and d.is_chain and r.nodes(5) == 5 and r.nodes(1) == 2


def test_the_table_forgets_its_oldest_entries():
    r = Recycling(limit=3)
    for key in range(5):
        r._store(key, (1,))
    r._store(2, (7,))  # refreshed: now the newest
    r._store(9, (1,))
    assert list(r.table) == [4, 2, 9]


def test_table_rows_hold_every_rank_the_paths_use():
    # paths up to rank 1 need rows of two candidates; the default paths go to rank 3 (path (3,))
    assert Recycling(paths=[(0,), (0, 0), (1,)]).ranks == 2 and Recycling().ranks == 4
    r = Recycling(nodes=3, paths=[(0,), (1,)], lookup_chain=False)
    r.propose(context([A, THE, CAT]), k=1)
    logits = torch.zeros(1, 32)
    logits[0, SAT], logits[0, IS] = 5.0, 4.0
    r.observe(Outcome(Draft.empty(), 0, [SAT], logits=logits))
    assert r.table[(THE, CAT)] == (SAT, IS)
    assert r.propose(context([A, THE, CAT]), k=1).tokens.tolist() == [SAT, IS]  # the runner-up drafts too


def test_the_policy_may_ask_the_lookup_chain_as_deep_as_prompt_lookup():
    # k_max bounds adaptive k (LLM.policy): the lookup chain goes 8 deep, as PromptLookup alone; the
    # table's own paths only 6 (the deepest default path)
    assert Recycling().k_max == 8 and Recycling(lookup_chain=False).k_max == 6


def test_reset_forgets_the_last_requests_tokens():
    """A new request's first round, drafted by another source (a hybrid bystander), must not file the new
    root's row under the old request's last tokens."""
    r = Recycling(nodes=3, lookup_chain=False)
    r.propose(context([A, THE, CAT]), k=2)
    r.reset()
    logits = torch.zeros(1, 32)
    logits[0, SAT] = 5.0
    r.observe(Outcome(Draft.empty(), 0, [ON], logits=logits))
    assert r.table == {}


def test_bad_trees_are_refused():
    with pytest.raises(ValueError, match="parent path"):
        Recycling(paths=[(0, 0)])
    with pytest.raises(ValueError, match="at least one"):
        Recycling(nodes=0)


@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_equals_plain(env, k):  # noqa: F811
    for nodes in (1, 3, 8):
        drafter = Recycling(nodes=nodes)  # one table across the prompts, as in use
        for text in PROMPTS:
            ids = env["tok"].encode(text, chat=False)
            plain = run(env, ids, max_new_tokens=40)
            spec = run(env, ids, drafter, FixedK(k), max_new_tokens=40)
            assert spec.token_ids == plain.token_ids and spec.text == plain.text
            assert spec.finish_reason == plain.finish_reason
    assert spec.accepted > 0  # the table learned something worth drafting


def test_adaptive_k_greedy_equals_plain_and_the_table_learns(env):  # noqa: F811
    ids = env["tok"].encode(PROMPTS[1], chat=False)
    plain = run(env, ids, max_new_tokens=60)
    drafter = Recycling(nodes=4, lookup_chain=False)  # the table alone
    first = run(env, ids, drafter, AdaptiveK(), max_new_tokens=60)
    again = run(env, ids, drafter, AdaptiveK(), max_new_tokens=60)
    assert first.token_ids == again.token_ids == plain.token_ids
    # the second pass finds the first pass's rows: the same contexts, the same next tokens
    assert again.mean_accepted > first.mean_accepted and again.mean_accepted > 2


def test_sampling_keeps_the_target_distribution(env):  # noqa: F811
    """Trees of recycled candidates under temperature 1.5, top-k 12: the first two tokens keep the target's
    law (the exact law from V forwards against 800 samples, as for the other drafters)."""
    tok = copy.copy(env["tok"])
    tok.eos_ids = frozenset()
    env = dict(env, tok=tok)
    ids = tok.encode("the cat", chat=False)
    sampling = SamplingParams(temperature=1.5, top_k=12)
    p1, p2 = exact_two_token_law(env, ids, sampling)
    drafter = Recycling(nodes=4, lookup_chain=False)
    likely = p1.topk(8).indices.tolist()
    drafter.table = {tuple(ids[-2:]): tuple(likely[:4])}
    drafter.table.update({t: tuple(likely[4:]) for t in likely})  # and after each of them
    first = run(env, ids, drafter, FixedK(2), max_new_tokens=2, sampling=SamplingParams(temperature=1.5, top_k=12, seed=0))
    assert first.rounds[0]["drafted"] == 4 and first.rounds[0]["depth"] == 1  # four siblings: the tree rule
    emp = empirical(env, ids, drafter, sampling, 800)
    tv = [0.5 * (emp[i] - p).abs().sum().item() for i, p in enumerate((p1, p2))]
    assert tv[0] < 0.1 and tv[1] < 0.18, tv


def test_stops_inside_an_accepted_block(env):  # noqa: F811
    """A table that has seen the text drafts whole blocks; EOS, a stop string and the token limit inside a
    block end exactly where plain decoding ends."""
    env = with_eos(env, -1)
    ids = env["tok"].encode(PROMPTS[0], chat=False)
    plain = run(env, ids, max_new_tokens=30)
    drafter = Recycling(nodes=6, lookup_chain=False)
    run(env, ids, drafter, FixedK(4), max_new_tokens=30)  # learn the text
    learned = run(env, ids, drafter, FixedK(4), max_new_tokens=30)
    assert max(r["accepted"] for r in learned.rounds) >= 3 and learned.mean_accepted > 1.5
    for m in (2, 4, 7, 13):
        b = run(env, ids, drafter, FixedK(4), max_new_tokens=m)
        assert b.token_ids == plain.token_ids[:m] and b.finish_reason == "length"
    eos_env = with_eos(env, plain.token_ids[7])
    a = run(eos_env, ids, max_new_tokens=30)
    b = run(eos_env, ids, drafter, FixedK(4), max_new_tokens=30)
    assert b.token_ids == a.token_ids and b.text == a.text and b.finish_reason == a.finish_reason == "stop"
    stop = plain.text[9:11]
    b = run(env, ids, drafter, FixedK(4), max_new_tokens=30, stop=(stop,))
    assert b.text == plain.text[:plain.text.index(stop)] and b.finish_reason == "stop"
