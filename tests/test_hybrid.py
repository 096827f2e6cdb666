"""Hybrid drafting: first non-empty source per round; greedy output equals plain decoding with both
sources in play, all-empty sources are plain decoding, feedback reaches the right source, per-source
policies cap or skip a source, and sampled output keeps the target's law."""

import pytest
import torch

from specdec.draft import Draft
from specdec.drafters.base import Context, Drafter, Outcome
from specdec.drafters.early_exit import EarlyExit
from specdec.drafters.hybrid import Hybrid
from specdec.drafters.prompt_lookup import PromptLookup
from specdec.runtime.loader import load_transformer
from specdec.sampling import SamplingParams, make_generator
from specdec.tokenizer import Tokenizer
from tests.test_early_exit import PROMPTS, first_tokens_match, run


@pytest.fixture(scope="module")
def tiny(tiny_folder):
    return load_transformer(tiny_folder, torch.float32), Tokenizer(tiny_folder)


class Empty(Drafter):
    name = "empty"

    def propose(self, ctx, k):
        return Draft.empty()


@pytest.mark.parametrize("reuse", [False, True], ids=["plain-verify", "kv-reuse"])
def test_greedy_equals_plain_with_lookup_then_early_exit(tiny, reuse):
    model, tok = tiny
    used = {"prompt-lookup": 0, "early-exit": 0}
    for prompt in PROMPTS:  # repetitive prompts: lookup hits in some rounds and misses in others
        ids = tok.encode(prompt, chat=False)
        plain = run(model, tok, ids, max_new_tokens=40)
        ee = EarlyExit(model, 1, max_len=128, reuse=reuse)
        h = Hybrid([PromptLookup(), ee])
        r = run(model, tok, ids, h, 3, max_new_tokens=40)
        assert r.token_ids == plain.token_ids, prompt
        stats = h.stats()
        # the proposer's verification hook: every early-exit round reuses its layer-<L work (LayerSkip)
        assert ee.reused == (stats["early-exit"]["rounds"] if reuse else 0)
        assert sum(stats[n]["drafted"] for n in used) == r.drafted
        assert sum(stats[n]["accepted"] for n in used) == r.accepted
        for n in used:
            used[n] += stats[n]["rounds"]
    assert all(used.values()), used  # both sources proposed


def test_all_sources_empty_is_plain_decoding(tiny):
    model, tok = tiny
    ids = tok.encode(PROMPTS[0], chat=False)
    plain = run(model, tok, ids, max_new_tokens=24)
    h = Hybrid([Empty(), Empty()])
    r = run(model, tok, ids, h, 4, max_new_tokens=24)
    assert r.token_ids == plain.token_ids and r.drafted == 0
    assert r.target_forwards == r.new_tokens == 24
    assert h.stats()["none"]["rounds"] == 23  # the last round has room for no draft (k = 0): not asked
    assert h.names == ["empty", "empty#2"]
    assert h.last_source is None


class Scripted(Drafter):
    """Proposes a fixed chain (or nothing) and records what it observes."""

    def __init__(self, name, tokens):
        self.name, self.tokens, self.seen, self.asked = name, tokens, [], []

    def propose(self, ctx, k):
        self.asked.append(k)
        return Draft.chain(self.tokens[:k])

    def observe(self, outcome):
        self.seen.append(outcome)


def ctx():
    return Context(tokens=[5, 6, 7], prompt_len=3, sampling=SamplingParams(), generator=make_generator(0))


def test_first_nonempty_source_proposes_and_feedback_is_routed():
    a, b, c = Scripted("a", []), Scripted("b", [9, 9, 9]), Scripted("c", [8, 8])
    h = Hybrid([a, b, c])
    d = h.propose(ctx(), 2)
    assert d.tokens.tolist() == [9, 9] and h.last_source == "b"
    assert a.asked == [2] and b.asked == [2] and c.asked == []  # c is never asked
    h.observe(Outcome(d, 1, [9, 4]))
    assert b.seen[-1].num_accepted == 1 and len(b.seen[-1].draft) == 2
    for bystander in (a, c):  # told what was committed, not credited with b's acceptance
        assert len(bystander.seen[-1].draft) == 0 and bystander.seen[-1].num_accepted == 0
        assert bystander.seen[-1].emitted == [9, 4]
    s = h.stats()
    assert s["b"] == dict(rounds=1, drafted=2, accepted=1, acceptance_rate=0.5, share=1.0)
    assert s["a"]["rounds"] == 0 and s["none"]["rounds"] == 0
    assert len(h.propose(ctx(), 0)) == 0 and h.last_source is None
    h.reset()
    assert h.stats()["b"]["rounds"] == 0
    with pytest.raises(ValueError):
        Hybrid([])


class Policy:
    def __init__(self, k):
        self.k, self.observed = k, []

    def choose(self):
        return self.k

    def observe(self, drafted, accepted):
        self.observed.append((drafted, accepted))


def test_per_source_policies_cap_and_skip():
    a, b = Scripted("a", [1, 1, 1, 1]), Scripted("b", [2, 2, 2, 2])
    pa, pb = Policy(0), Policy(2)
    h = Hybrid([a, b], policies=[pa, pb])
    d = h.propose(ctx(), 4)
    assert a.asked == [] and b.asked == [2] and d.tokens.tolist() == [2, 2]  # a predicted to lose: skipped
    h.observe(Outcome(d, 2, [2, 2, 3]))
    assert pb.observed == [(2, 2)] and pa.observed == []
    pa.k = 3
    d = h.propose(ctx(), 2)  # the loop's k still caps every source
    assert a.asked == [2] and h.last_source == "a"
    h.use_policies(lambda s: Policy(1))
    assert len(h.propose(ctx(), 4)) == 1 and h.last_source == "a"
    with pytest.raises(ValueError, match="one policy per source"):
        Hybrid([a, b], policies=[pa])


class Tree(Drafter):
    name = "tree"

    def propose(self, ctx, k):
        return Draft([1, 2, 3], [-1, -1, 0])  # three nodes, two deep


def test_tree_sources_are_counted_by_nodes_and_priced_by_depth():
    policy = Policy(4)
    h = Hybrid([Tree()], policies=[policy])
    d = h.propose(ctx(), 4)
    h.observe(Outcome(d, 1, [1, 5]))
    assert h.stats()["tree"]["drafted"] == 3  # tokens drafted: every node
    assert policy.observed == [(2, 1)]  # the policy's k is a depth


def test_bystanders_learn_the_committed_roots_row():
    """Recycling behind another source learns from the rounds it sat out: the root's logits row."""
    from specdec.drafters.recycling import Recycling

    a, rec = Scripted("a", []), Recycling(nodes=2, lookup_chain=False)
    h = Hybrid([a, rec])
    assert len(h.propose(ctx(), 2)) == 0  # nobody drafts (the table is empty): a plain round
    row = torch.zeros(1, 32)
    row[0, 8] = 1.0
    h.observe(Outcome(Draft.empty(), 0, [8], logits=row))
    assert rec.table[(6, 7)][0] == 8
    a.tokens = [9, 9]
    d = h.propose(Context(tokens=[5, 6, 7, 8], prompt_len=3, sampling=SamplingParams(), generator=make_generator(0)), 2)
    assert h.last_source == "a"
    rows = torch.zeros(3, 32)
    rows[0, 11] = rows[1, 12] = rows[2, 13] = 1.0
    h.observe(Outcome(d, 0, [11], logits=rows))
    assert rec.table[(7, 8)][0] == 11 and (8, 9) not in rec.table  # the root's row only: a's nodes are a's


class Window(Drafter):
    """Drafts nothing but carries a lookahead window (any object here)."""

    name = "window"
    aux = object()

    def propose(self, ctx, k):
        d = Draft.empty()
        d.aux = self.aux
        return d


class TimedPolicy(Policy):
    def timing(self, drafted, draft_seconds, target_seconds):
        self.timed = getattr(self, "timed", []) + [(drafted, draft_seconds, target_seconds)]

    def plain_timing(self, seconds):
        self.plain = getattr(self, "plain", []) + [seconds]


def test_the_mix_reports_its_proposers_properties():
    a, b = Scripted("a", []), Scripted("b", [9, 9])
    a.tau_prior, b.tau_prior, a.stale, b.stale, b.deterministic = 0.3, 0.0, True, False, False
    pa, pb = TimedPolicy(2), TimedPolicy(2)
    h = Hybrid([a, b], policies=[pa, pb])
    assert h.tau_prior == 0.3  # before any round: the first source's
    assert not h.deterministic  # one source samples its own q
    assert h.room(3) == 6  # one source's draft and another's window may share a forward
    d = h.propose(ctx(), 2)
    assert h.last_source == "b" and not h.stale  # the proposer's staleness, not the first source's
    h.timing(2, 0.01, 0.1)
    assert pb.timed == [(2, 0.01, 0.1)] and not hasattr(pa, "timed")  # the proposer's tau
    h.plain_timing(0.1)
    assert pa.plain == pb.plain == [0.1]  # a plain step prices every source
    h.observe(Outcome(d, 2, [9, 9, 4]))
    b.tokens = []
    assert len(h.propose(ctx(), 2)) == 0
    s = h.stats()
    assert s["b"]["share"] == 1.0 and s["none"]["rounds"] == 1  # shares of the speculative rounds only
    # a lookahead window from a source that drafts nothing rides with the next source's draft
    w = Window()
    h = Hybrid([w, Scripted("c", [7])])
    assert h.propose(ctx(), 2).aux is w.aux and h.last_source == "c"


def test_mixed_tau_follows_the_shares(tiny):
    model, _ = tiny
    ee = EarlyExit(model, 1)
    h = Hybrid([PromptLookup(), ee])
    assert h.tau_prior == 0.0
    h.counts["prompt-lookup"]["rounds"], h.counts["early-exit"]["rounds"] = 3, 1
    assert h.tau_prior == pytest.approx(0.25 * ee.tau_prior)


def test_sampled_first_tokens_follow_the_target(tmp_path_factory):
    from tests.tiny import save_tiny

    folder = save_tiny("llama", tmp_path_factory.mktemp("hybrid-sampling"))
    model, tok = load_transformer(folder, torch.float32), Tokenizer(folder)
    ids = tok.encode("the cat", chat=False)  # lookup proposes from the "t" of "the"; early exit when it cannot
    h = Totals([PromptLookup(), EarlyExit(model, 1, max_len=64)])
    ok, info = first_tokens_match(model, tok, ids, h)
    assert ok, info
    h.reset()
    assert h.totals["prompt-lookup"] and h.totals["early-exit"], h.totals  # both sources drafted


class Totals(Hybrid):
    """Keeps per-source round counts across requests (reset clears them per request)."""

    def reset(self):
        if hasattr(self, "totals"):
            for n in self.names:
                self.totals[n] += self.counts[n]["rounds"]
        else:
            self.totals = dict.fromkeys(self.names, 0)
        super().reset()
