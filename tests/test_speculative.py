"""The speculative loop on tiny models: output equals plain decoding (greedy, token for token),
sampling keeps the target's distribution, and multi-token commits stop where plain decoding does."""

import copy
import random

import pytest
import torch

from specdec.adaptive import AdaptiveK, FixedK
from specdec.decode import Request, decode
from specdec.draft import Draft
from specdec.drafters.base import Drafter
from specdec.drafters.draft_model import DraftModel
from specdec.drafters.prompt_lookup import NgramIndex, PromptLookup, lookup, lookup_match
from specdec.runtime.loader import load_transformer
from specdec.sampling import SamplingParams, probs_from_logits
from specdec.tokenizer import Tokenizer
from tests.tiny import VOCAB, save_tiny


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    target_dir = save_tiny("llama", tmp_path_factory.mktemp("target"), seed=0)
    draft_dir = save_tiny("llama", tmp_path_factory.mktemp("draft"), seed=1)
    target = load_transformer(target_dir)
    return dict(target=target, tok=Tokenizer(target_dir), draft=load_transformer(draft_dir),
                twin=load_transformer(target_dir))


def run(env, ids, drafter=None, policy=None, **kw):
    chunks = list(decode(env["target"], env["tok"], ids, Request(**kw), drafter, policy))
    r = chunks[-1].result
    assert "".join(c.text for c in chunks) == r.text
    assert all(c.accepted <= len(c.tokens) for c in chunks)  # a block cut by a stop counts what it kept
    return r


PROMPTS = ["def add(a, b): return a + b. def add(a, b): return", "the cat sat on the mat. the cat", "xyz"]


def drafters(env):
    return {
        "prompt-lookup": PromptLookup(),
        # tiny models prefill at about a step per token: a cheap tau_prior so adaptive k starts them
        "draft": DraftModel(env["draft"], VOCAB, VOCAB, tau_prior=0.01),
        "twin": DraftModel(env["twin"], VOCAB, VOCAB, tau_prior=0.01),  # the target drafting for itself
    }


@pytest.mark.parametrize("name", ["prompt-lookup", "draft", "twin"])
@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_equals_plain(env, name, k):
    for text in PROMPTS:
        ids = env["tok"].encode(text, chat=False)
        plain = run(env, ids, max_new_tokens=40)
        spec = run(env, ids, drafters(env)[name], FixedK(k), max_new_tokens=40)
        assert spec.token_ids == plain.token_ids and spec.text == plain.text
        assert spec.finish_reason == plain.finish_reason
        assert spec.target_forwards <= plain.target_forwards
    if name == "twin":
        assert spec.acceptance_rate == 1.0 and spec.mean_accepted > min(k + 1, 3) - 0.5


def test_adaptive_k_greedy_equals_plain(env):
    ids = env["tok"].encode(PROMPTS[1], chat=False)
    plain = run(env, ids, max_new_tokens=60)
    for d in drafters(env).values():
        r = run(env, ids, d, AdaptiveK(), max_new_tokens=60)
        assert r.token_ids == plain.token_ids and r.drafted > 0


class Wrong(Drafter):
    """Always proposes tokens the target never picks (an adversarial source, alpha = 0)."""

    name = "wrong"

    def __init__(self, model):
        self.model = model

    def propose(self, ctx, k):
        with torch.no_grad():
            logits = self.model(torch.tensor([ctx.tokens]), self.model.new_cache(len(ctx.tokens))).logits[0, -1]
        return Draft.chain([int(logits.argmin())] * k)


def test_adaptive_k_stops_speculating_when_alpha_is_zero(env):
    ids = env["tok"].encode(PROMPTS[2], chat=False)
    r = run(env, ids, Wrong(env["target"]), AdaptiveK(), max_new_tokens=40)
    assert r.accepted == 0
    plain_rounds = sum(1 for x in r.rounds if x["drafted"] == 0)
    assert plain_rounds >= 30  # after a few failures k = 0, with rare k = 1 probes
    assert r.token_ids == run(env, ids, max_new_tokens=40).token_ids


def test_prompt_lookup_finds_the_latest_longest_match():
    assert lookup([5, 6, 7, 8, 5, 6], 3, max_n=3) == [7, 8, 5]
    assert lookup([1, 2, 3, 9, 1, 2, 4, 1, 2], 2) == [4, 1]  # the most recent [1, 2]
    assert lookup([1, 2, 3], 4) == []


def test_the_ngram_index_answers_as_the_scan_does():
    """NgramIndex (what PromptLookup and recycling probe) against lookup_match's scan, on growing lists of a few
    token kinds (so matches at every n are common), with every n range, k = 0..6, and lists replaced or cut."""
    rng = random.Random(0)
    for _ in range(200):
        vocab, max_n = rng.choice([2, 3, 5, 20]), rng.randint(1, 5)
        min_n = rng.randint(1, max_n)
        index, tokens = NgramIndex(max_n, min_n), [rng.randrange(vocab) for _ in range(rng.randint(0, 5))]
        for _ in range(40):
            k = rng.randint(0, 6)
            assert index.match(tokens, k) == lookup_match(tokens, k, max_n, min_n), (tokens, k, max_n, min_n)
            tokens.extend(rng.randrange(vocab) for _ in range(rng.randint(0, 4)))
            if rng.random() < 0.05:  # another list, or this one cut short
                tokens = tokens[:rng.randint(0, len(tokens))]
            elif rng.random() < 0.05:
                del tokens[rng.randint(0, len(tokens)):]


def exact_two_token_law(env, ids, sampling):
    """P(t1) and P(t2) of plain sampling, computed exactly from the target (V forwards)."""
    target = env["target"]
    logits = target(torch.tensor([ids]), target.new_cache(len(ids) + 1)).logits[0, -1]
    p1 = probs_from_logits(logits, sampling).double()
    batch = torch.tensor([ids + [t] for t in range(VOCAB)])
    l2 = target(batch, target.new_cache(len(ids) + 1, batch=VOCAB)).logits[:, -1]
    p2 = (p1[:, None] * probs_from_logits(l2, sampling).double()).sum(0)
    return p1, p2


def empirical(env, ids, drafter, sampling, n):
    counts = torch.zeros(2, VOCAB, dtype=torch.float64)
    for seed in range(n):
        sp = SamplingParams(temperature=sampling.temperature, top_k=sampling.top_k, seed=seed)
        r = run(env, ids, drafter, FixedK(2) if drafter else None, max_new_tokens=2, sampling=sp)
        if len(r.token_ids) == 2:
            counts[0, r.token_ids[0]] += 1
            counts[1, r.token_ids[1]] += 1
    return counts / counts.sum(1, keepdim=True)


class LiesAboutQ(Drafter):
    """Claims q is uniform but always proposes one likely token: verification with a wrong q is biased, and
    the test below must see it. (Dropping q altogether would not be a bug: verifying any proposal as a
    deterministic draft is exact, only less often accepted.)"""

    def __init__(self, token):
        self.token = token

    def propose(self, ctx, k):
        return Draft.chain([self.token] * k, torch.full((k, VOCAB), 1.0 / VOCAB))


def test_sampling_keeps_the_target_distribution(env):
    tok = env["tok"]
    env = dict(env, tok=copy.copy(tok))
    env["tok"].eos_ids = frozenset()  # every run emits both tokens
    ids = tok.encode("the cat", chat=False)
    sampling = SamplingParams(temperature=1.5, top_k=12)
    p1, p2 = exact_two_token_law(env, ids, sampling)
    n = 800
    # t1 is verified against the draft (<= 12 outcomes: E[TV] ~ 0.04 at n = 800); t2 is a bonus or the
    # next round's token (~60 outcomes: E[TV] ~ 0.1)
    bounds = (0.1, 0.18)
    for name, d in [("plain", None), ("draft", DraftModel(env["draft"], VOCAB, VOCAB)), ("lookup", PromptLookup())]:
        emp = empirical(env, ids, d, sampling, n)
        tv = [0.5 * (emp[i] - p).abs().sum().item() for i, p in enumerate((p1, p2))]
        assert tv[0] < bounds[0] and tv[1] < bounds[1], (name, tv)
    bad = empirical(env, ids, LiesAboutQ(int(p1.argmax())), sampling, n)
    assert 0.5 * (bad[0] - p1).abs().sum().item() > 2 * bounds[0]  # the test can fail


def with_eos(env, token):
    tok = copy.copy(env["tok"])
    tok.eos_ids = frozenset({token})
    return dict(env, tok=tok)


@pytest.mark.parametrize("k", [3, 5])
def test_stops_inside_an_accepted_block(env, k):
    """The twin drafter has every draft accepted, so tokens arrive in blocks of k+1; EOS, a stop
    string and the token limit falling inside a block must end exactly where plain decoding ends."""
    env = with_eos(env, -1)  # no natural EOS, so the block boundaries below are where we put them
    ids = env["tok"].encode(PROMPTS[0], chat=False)
    plain = run(env, ids, max_new_tokens=30)
    twin = lambda: DraftModel(env["twin"], VOCAB, VOCAB)  # noqa: E731
    # token limit inside a block
    for m in (2, k, k + 2, 2 * k + 3):
        a = run(env, ids, max_new_tokens=m)
        b = run(env, ids, twin(), FixedK(k), max_new_tokens=m)
        assert b.token_ids == a.token_ids == plain.token_ids[:m] and b.finish_reason == a.finish_reason == "length"
    # EOS inside a block: declare the 8th generated token an end-of-sequence token
    eos_env = with_eos(env, plain.token_ids[7])
    a = run(eos_env, ids, max_new_tokens=30)
    b = run(eos_env, ids, twin(), FixedK(k), max_new_tokens=30)
    assert b.token_ids == a.token_ids and b.text == a.text and b.finish_reason == a.finish_reason == "stop"
    # a stop string inside a block
    stop = plain.text[9:11]
    a = run(env, ids, max_new_tokens=30, stop=(stop,))
    b = run(env, ids, twin(), FixedK(k), max_new_tokens=30, stop=(stop,))
    assert b.text == a.text == plain.text[:plain.text.index(stop)]
    assert b.token_ids == a.token_ids and b.finish_reason == "stop"


def test_same_seed_same_output_with_speculation(env):
    ids = env["tok"].encode(PROMPTS[1], chat=False)
    sp = SamplingParams(temperature=0.8, seed=3)
    a = run(env, ids, DraftModel(env["draft"], VOCAB, VOCAB), FixedK(3), max_new_tokens=30, sampling=sp)
    b = run(env, ids, DraftModel(env["draft"], VOCAB, VOCAB), FixedK(3), max_new_tokens=30, sampling=sp)
    assert a.token_ids == b.token_ids


class Guesses(Drafter):
    """A deterministic tree of seeded random guesses (two children a level), mostly wrong: every round
    rejects somewhere, on every path shape."""

    def __init__(self, seed):
        self.rng = random.Random(seed)

    def propose(self, ctx, k):
        if self.rng.random() < 0.5:
            return Draft.chain([self.rng.randrange(VOCAB) for _ in range(k)])
        tokens, parents = [], []
        for depth in range(k):  # a spine with a second child at every level
            spine = len(tokens) - 2 if depth else -1
            a, b = self.rng.sample(range(VOCAB), 2)
            tokens += [a, b]
            parents += [spine, spine]
        return Draft(torch.tensor(tokens), torch.tensor(parents))


@pytest.mark.parametrize("k", [1, 3])
def test_a_seed_gives_plain_decodings_tokens_under_any_deterministic_draft(env, k):
    """Sampling draws the target's token at each position from that position's uniform (`sampling.Draws`), and
    a deterministic draft is checked against that very draw: with a seed, speculative sampling gives plain
    sampling's tokens, whatever was drafted and whatever k a round had (the server grants k by load)."""
    from specdec.drafters.lookahead import Lookahead
    from specdec.drafters.recycling import Recycling
    for text in PROMPTS[:2]:
        ids = env["tok"].encode(text, chat=False)
        for seed in (0, 1):
            sp = SamplingParams(temperature=1.3, top_k=40, seed=seed)
            plain = run(env, ids, max_new_tokens=24, sampling=sp)
            for drafter, policy in [(PromptLookup(), FixedK(k)), (Recycling(nodes=4), FixedK(k)),
                                    (Guesses(seed), FixedK(k)), (Lookahead(3, 3, 2), FixedK(2))]:
                spec = run(env, ids, drafter, policy, max_new_tokens=24, sampling=sp)
                assert spec.token_ids == plain.token_ids, (text, seed, type(drafter).__name__)
            other = run(env, ids, max_new_tokens=24, sampling=SamplingParams(temperature=1.3, top_k=40, seed=seed + 7))
            assert other.token_ids != plain.token_ids  # the seed matters: the test can fail


def test_adaptive_k_measures_tau_after_the_drafters_prefill():
    policy = AdaptiveK(tau=0.3)
    policy.timing(4, draft_seconds=50.0, target_seconds=1.0)  # round 1: the drafter prefilled a long prompt
    assert policy.tau == 0.3
    policy.timing(4, draft_seconds=0.4, target_seconds=1.0)
    assert policy.tau == pytest.approx(0.1 * policy.cost(5))
    policy = AdaptiveK(prior_alpha=0.9, tau=0.3)
    assert policy.choose() >= 2  # alpha 0.9 at tau 0.3 pays for a few drafted tokens


def test_draft_catch_up_after_plain_steps_does_not_set_tau(env):
    """After plain steps the draft model first feeds the tokens it missed; that round's time is not its
    per-token cost, so adaptive k must not learn tau from it (else tau inflates and k stays 0)."""
    from specdec.drafters.base import Context
    from specdec.sampling import make_generator

    d = DraftModel(env["draft"], VOCAB, VOCAB)
    ids = env["tok"].encode(PROMPTS[0], chat=False)
    ctx = Context(list(ids), len(ids), SamplingParams(), make_generator(0))
    d.propose(ctx, 2)
    assert d.stale  # the prompt itself
    ctx.tokens += [5, 6]
    d.propose(ctx, 2)
    assert not d.stale  # the usual round: the last draft token and the bonus
    ctx.tokens += [5, 6, 7, 8, 9]
    d.propose(ctx, 2)
    assert d.stale

    class Recording(AdaptiveK):
        def timing(self, drafted, draft_seconds, target_seconds, smoothing=0.3):
            self.timed = getattr(self, "timed", 0) + 1

    policy = Recording()
    ids = env["tok"].encode(PROMPTS[1], chat=False)
    r = run(env, ids, DraftModel(env["twin"], VOCAB, VOCAB, tau_prior=0.01), policy, max_new_tokens=30)
    stale_rounds = 1  # at least the prompt's
    assert 0 < policy.timed <= sum(1 for x in r.rounds if x["drafted"]) - stale_rounds


def test_adaptive_k_pays_a_starting_cost_only_when_the_saving_covers_it():
    policy = AdaptiveK(prior_alpha=0.9)
    best = max(policy.predicted())
    saving = 100 * (1 - 1 / best)  # target steps saved over 100 tokens
    assert policy.choose(startup=0.9 * saving, remaining=100) > 0
    assert policy.choose(startup=1.1 * saving, remaining=100) == 0
    assert all(policy.choose(startup=float("inf"), remaining=100) == 0 for _ in range(3 * policy.explore_every))
    assert FixedK(3).choose(startup=float("inf"), remaining=100) == 3  # a fixed k is the user's choice
    policy = AdaptiveK(prior_alpha=0.9, tau=0.3)
    for _ in range(20):  # a started draft that stopped paying: k = 0, yet it still probes now and then,
        policy.observe(4, 0)  # paying only its catch-up over the plain steps since
    assert policy.predicted().index(max(policy.predicted())) == 0
    assert 1 in [policy.choose(startup=0.5, remaining=100) for _ in range(policy.explore_every)]


def test_draft_model_startup_is_its_catch_up():
    from specdec.drafters.base import Context
    from specdec.sampling import make_generator

    d = DraftModel.__new__(DraftModel)
    d.fed, d.tau_prior = [], 0.25
    ctx = Context([1, 2, 3, 4, 5], 5, SamplingParams(), make_generator(0))
    assert d.startup(ctx) == 4 * 0.25  # everything but the last token, at a quarter of the target's cost
    d.fed = [1, 2, 3, 4]
    assert d.startup(ctx) == 0  # in step: only the usual last token to feed


def test_draft_model_drafts_only_shared_token_ids(env):
    """A draft whose vocabulary is larger than the ids both models share (padding rows, a bigger target or
    draft) never proposes an id outside the shared range, and its q rows cover the target's vocabulary."""
    from specdec.drafters.base import Context
    from specdec.sampling import make_generator

    for target_vocab, shared in ((VOCAB, 40), (60, VOCAB)):
        for sampling in (SamplingParams(), SamplingParams(temperature=2.0)):
            d = DraftModel(env["draft"], target_vocab, shared)
            for text in PROMPTS:
                ids = env["tok"].encode(text, chat=False)
                draft = d.propose(Context(list(ids), len(ids), sampling, make_generator(0), remaining=10), 4)
                assert max(draft.tokens.tolist()) < min(target_vocab, shared)
                if draft.q is not None:
                    assert draft.q.shape == (4, target_vocab) and draft.q[:, min(target_vocab, shared):].sum() == 0


def test_draft_model_feeds_all_but_its_last_draft_and_reset_forgets_them(env):
    """k drafts cost k - 1 draft forwards after the catch-up (the last draft is only verified); after a reset the
    drafter's cache is gone, so its starting cost is the whole prompt again."""
    from specdec.drafters.base import Context
    from specdec.sampling import make_generator

    d = DraftModel(env["draft"], VOCAB, VOCAB, tau_prior=0.25)
    ids = env["tok"].encode(PROMPTS[0], chat=False)
    ctx = Context(list(ids), len(ids), SamplingParams(), make_generator(0), remaining=10)
    draft = d.propose(ctx, 4)
    assert d.fed == list(ids) + draft.tokens.tolist()[:3] and d.cache.length == len(ids) + 3
    assert d.startup(ctx) == 0
    d.reset()
    assert d.startup(ctx) == (len(ids) - 1) * 0.25


def test_common_prefix_and_sync_prefix():
    from specdec.drafters.base import common_prefix, sync_prefix
    from specdec.runtime.kv_cache import KVCache

    assert common_prefix([1, 2, 9, 9], [1, 2, 3, 4]) == 2  # a rejected draft at position 2
    assert common_prefix([1, 2], [1, 2, 3, 4]) == 2  # in step: feed the two new tokens
    assert common_prefix([1, 2, 3, 4], [1, 2, 3, 4]) == 3  # the last token is always fed (its logits are needed)
    assert common_prefix([1, 2, 3, 4, 5], [1, 2, 3]) == 2
    cache, fed = KVCache(1, 1, 1, 8, 2, torch.float32), [1, 2, 9, 9]
    cache.length = 4
    assert sync_prefix(cache, fed, [1, 2, 3, 4]) == 2 and cache.length == 2 and fed == [1, 2]


def test_fresh_drafters_do_not_share_per_request_state(env):
    """`Drafter.fresh` (one per request of an LLM) hands out a drafter with no cache of its own yet, and the
    original keeps its own."""
    from specdec.drafters.base import Context
    from specdec.sampling import make_generator

    d = DraftModel(env["draft"], VOCAB, VOCAB)
    ids = env["tok"].encode(PROMPTS[1], chat=False)
    d.propose(Context(list(ids), len(ids), SamplingParams(), make_generator(0), remaining=10), 3)
    other = d.fresh()
    assert other.cache is None and other.fed == [] and other.model is d.model
    assert d.cache is not None and d.fed[:len(ids)] == list(ids)


@pytest.mark.parametrize("tau_prior, drafts", [(1e6, False), (1e-6, True)])
def test_a_draft_model_too_costly_to_start_is_never_started(env, tau_prior, drafts):
    """A draft model whose prompt prefill costs more than speculation could save stays idle: every
    round is a plain step and no draft forward runs (its cache stays empty); a cheap one drafts from
    round 2, after one plain step has priced the prefill. Either way the output is plain decoding's."""
    from specdec.drafters.hybrid import Hybrid

    ids = env["tok"].encode(PROMPTS[1], chat=False)
    plain = run(env, ids, max_new_tokens=30)
    d = DraftModel(env["twin"], VOCAB, VOCAB, tau_prior=tau_prior)
    r = run(env, ids, d, AdaptiveK(prior_alpha=0.9, tau=0.1), max_new_tokens=30)
    assert r.token_ids == plain.token_ids
    assert r.rounds[0]["drafted"] == 0  # the first round is always plain: it prices the prefill
    assert (r.drafted > 0) == drafts and (d.fed != []) == drafts
    h = Hybrid([DraftModel(env["twin"], VOCAB, VOCAB, tau_prior=tau_prior)], [AdaptiveK(prior_alpha=0.9, tau=0.1)])
    r = run(env, ids, h, FixedK(4), max_new_tokens=30)
    assert r.token_ids == plain.token_ids and (r.drafted > 0) == drafts
