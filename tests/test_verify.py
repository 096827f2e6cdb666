"""specdec.verify: exactness proved by enumeration, checked by statistics, with negative controls.

Enumeration: for tiny vocabularies every drafted path is enumerated with its probability under
q, and `outcome_distribution` (built from the same acceptance and residual functions as
`rejection_sample`) gives the exact law of what each path emits. Each emitted position must be
distributed exactly as the target, conditioned on the tokens before it and on the round reaching
it (to 1e-9, float64). Statistics then tie `rejection_sample` itself to that law and to p.
"""

import inspect
import itertools
import math
from collections import defaultdict

import numpy as np
import pytest
import torch

from specdec import verify as V
from specdec.draft import Draft
from specdec.sampling import SamplingParams, make_generator, probs_from_logits, sample

A, B, C = 0, 1, 2
P_ABC = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
# q implied by the lesson: only B is over-drafted, and the residual mass 0.1 falls on A alone
Q_ABC = torch.tensor([0.4, 0.4, 0.2], dtype=torch.float64)


# --- test helpers: toy models, exact laws, the naive scheme -----------------------------------


class ToyLM:
    """A random autoregressive model over a tiny vocabulary: a fixed random distribution per
    prefix (float64), drawn lazily from a seeded generator. `zeros` is the chance an entry is
    forced to 0; `params` turns random logits into p through specdec.sampling instead."""

    def __init__(self, vocab, seed, zeros=0.0, params=None):
        self.vocab, self.zeros, self.params = vocab, zeros, params
        self.rng = np.random.default_rng(seed)
        self.cache = {}

    def __call__(self, prefix):
        prefix = tuple(prefix)
        if prefix not in self.cache:
            if self.params is not None:
                logits = torch.tensor(self.rng.normal(0, 2, self.vocab), dtype=torch.float32)
                d = probs_from_logits(logits, self.params).double()
            else:
                d = torch.tensor(self.rng.dirichlet(np.ones(self.vocab)))
                d = d * torch.tensor(self.rng.random(self.vocab) >= self.zeros)
                if d.sum() == 0:
                    d[self.rng.integers(self.vocab)] = 1.0
            self.cache[prefix] = d / d.sum()
        return self.cache[prefix]


def draft_paths(drafter, prefix, k, deterministic):
    """(draft tuple, probability) for every path the drafter can propose."""
    if deterministic:  # prompt-lookup-like: a fixed function of the context
        path = []
        for _ in range(k):
            path.append(int(drafter(prefix + tuple(path)).argmax()))
        yield tuple(path), 1.0
        return
    for path in itertools.product(range(drafter.vocab), repeat=k):
        w = 1.0
        for i in range(k):
            w *= float(drafter(prefix + path[:i])[path[i]])
        if w > 0:
            yield path, w


def round_law(target, drafter, prefix, k, deterministic=False, verifier="exact"):
    """Exact law of the tokens one round emits from `prefix`: {emitted tuple: probability}."""
    law = defaultdict(float)
    for path, w in draft_paths(drafter, prefix, k, deterministic):
        p = torch.stack([target(prefix + path[:i]) for i in range(k + 1)])
        q = None if deterministic else torch.stack([drafter(prefix + path[:i]) for i in range(k)])
        outcomes = V.outcome_distribution(p, q, torch.tensor(path)) if verifier == "exact" else naive_outcomes(p, path)
        for j, (pj, dist) in enumerate(outcomes):
            if pj == 0:
                continue
            for y in range(target.vocab):
                if pj * float(dist[y]) > 0:
                    law[path[:j] + (y,)] += w * pj * float(dist[y])
    return law


def max_conditional_error(law, target, prefix=()):
    """Largest |P(emitted position m = t | earlier emitted tokens, round reached m) - p(t | ...)|."""
    worst = 0.0
    longest = max(len(s) for s in law)
    for m in range(1, longest + 1):
        mass = defaultdict(float)
        for seq, w in law.items():
            if len(seq) >= m:
                mass[seq[:m]] += w
        for head in {s[:-1] for s in mass}:
            total = sum(mass[head + (t,)] for t in range(target.vocab))
            ref = target(prefix + head)
            for t in range(target.vocab):
                worst = max(worst, abs(mass[head + (t,)] / total - float(ref[t])))
    return worst


def naive_outcomes(p, path):
    """The chapter's broken scheme as an outcome list: accept a drafted token only if it is the
    target's top-1; at the first mismatch (or the bonus position) emit the target's top-1."""
    out, top = [], p.argmax(-1)
    for j, x in enumerate(path):
        if x != int(top[j]):
            return out + [(1.0, torch.nn.functional.one_hot(top[j], p.shape[1]).double())]
        out.append((0.0, None))
    return out + [(1.0, torch.nn.functional.one_hot(top[len(path)], p.shape[1]).double())]


def naive_top1_verify(p, q, draft_tokens, generator=None):
    """The same broken scheme as a sampler with rejection_sample's signature."""
    top = p.argmax(-1)
    for j, x in enumerate(draft_tokens.tolist()):
        if x != int(top[j]):
            return j, torch.cat([draft_tokens[:j], top[j : j + 1]])
    return len(draft_tokens), torch.cat([draft_tokens, top[-1:]])


def tv(counts, probs):
    emp = counts.double() / counts.sum()
    return 0.5 * float((emp - probs.double()).abs().sum())


def tv_bound(probs, n, delta=1e-6):
    """A bound on TV(empirical, probs) after n samples that fails with probability < delta:
    E[TV] <= 1/2 sum sqrt(p(1-p)/n), plus McDiarmid's sqrt(ln(1/delta) / 2n)."""
    p = probs.double()
    return 0.5 * float((p * (1 - p) / n).sqrt().sum()) + math.sqrt(math.log(1 / delta) / (2 * n))


# --- Chapter 1's toy example, exactly -------------------------------------------------------


def test_toy_example_acceptance_and_residual():
    # "accept(x) = min(1, p(x) / q(x))": A and C always accepted, B with 0.3/0.4
    acc = [V.acceptance_probability(P_ABC[x], Q_ABC[x]) for x in (A, B, C)]
    assert acc == pytest.approx([1.0, 0.75, 1.0], abs=1e-15)
    # "Sum of the leftover mass: 0.1 + 0 + 0 = 0.1"
    assert float((P_ABC - Q_ABC).clamp(min=0).sum()) == pytest.approx(0.1, abs=1e-15)
    # "The residual distribution is deterministic here — whenever B gets rejected, the
    #  algorithm resamples A with certainty"
    assert V.residual_distribution(P_ABC, Q_ABC).tolist() == pytest.approx([1.0, 0.0, 0.0], abs=1e-15)


def test_toy_example_output_distribution_and_overlap():
    accepted, recovered, first_accept = torch.zeros(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64), 0.0
    bonus_row = torch.tensor([1 / 3] * 3, dtype=torch.float64)
    for x in (A, B, C):
        outcomes = V.outcome_distribution(torch.stack([P_ABC, bonus_row]), Q_ABC[None], torch.tensor([x]))
        (p_reject, residual), (p_accept, _) = outcomes
        accepted[x] += Q_ABC[x] * p_accept
        recovered += Q_ABC[x] * p_reject * residual
        first_accept += float(Q_ABC[x]) * p_accept
    # "P(output = A)": 0.4 * 1 (drafted A, accepted) + 0.4 * 0.25 * 1 (B rejected, residual A)
    assert float(accepted[A]) == pytest.approx(0.4, abs=1e-12)
    assert float(recovered[A]) == pytest.approx(0.1, abs=1e-12)
    # "Compare to the target: p(A) = 0.5 ... p(B) = 0.3 ... p(C) = 0.2. Exact match."
    assert (accepted + recovered).tolist() == pytest.approx([0.5, 0.3, 0.2], abs=1e-12)
    # "Both routes land on exactly 0.9": the overlap equals P(the drafted token is accepted)
    assert first_accept == pytest.approx(float(torch.minimum(P_ABC, Q_ABC).sum()), abs=1e-12)
    assert first_accept == pytest.approx(0.9, abs=1e-12)


def test_toy_example_naive_scheme_collapses_onto_A():
    # "Every single round outputs A, with total certainty"
    target = ToyLM(3, 0)
    target.cache[()] = P_ABC
    drafter = ToyLM(3, 1)
    drafter.cache[()] = Q_ABC
    naive = round_law(target, drafter, (), 1, verifier="naive")
    first = defaultdict(float)
    for seq, w in naive.items():
        first[seq[0]] += w
    assert dict(first) == pytest.approx({A: 1.0})
    # negative control: the same distribution check that exact verification passes fails here
    assert max_conditional_error(naive, target) >= 0.5 - 1e-12
    exact = round_law(target, drafter, (), 1)
    assert max_conditional_error(exact, target) < 1e-12


# --- exact enumeration on random models -----------------------------------------------------


@pytest.mark.parametrize("vocab, k", [(2, 1), (2, 3), (3, 2), (4, 1), (4, 3), (6, 1), (6, 2), (6, 3)])
@pytest.mark.parametrize("deterministic", [False, True], ids=["q", "q=None"])
def test_enumeration_each_position_is_distributed_as_the_target(vocab, k, deterministic):
    for seed in range(3):
        target = ToyLM(vocab, 100 + seed, zeros=0.25 if seed == 2 else 0.0)
        drafter = ToyLM(vocab, 200 + seed, zeros=0.25 if seed == 1 else 0.0)
        law = round_law(target, drafter, (), k, deterministic)
        assert sum(law.values()) == pytest.approx(1.0, abs=1e-12)
        assert max_conditional_error(law, target) <= 1e-9
        # and the naive scheme fails the same check on the same models
        if not deterministic:
            assert max_conditional_error(round_law(target, drafter, (), k, verifier="naive"), target) > 1e-3


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.0, top_k=3),
        SamplingParams(temperature=1.3, top_p=0.8),
        SamplingParams(temperature=1.0, min_p=0.2),
        SamplingParams(temperature=0.9, top_k=4, top_p=0.9, min_p=0.1),
    ],
    ids=["temperature", "top-k", "top-p", "min-p", "all"],
)
def test_enumeration_with_sampling_filters(params):
    # "temperature and top-p live entirely inside p(x)": any p the filters produce is reproduced
    target = ToyLM(6, 7, params=params)
    drafter = ToyLM(6, 8, params=SamplingParams(temperature=1.0))
    law = round_law(target, drafter, (), 2)
    assert max_conditional_error(law, target) <= 1e-9
    # tokens the filters removed are never emitted
    for seq, w in law.items():
        assert w == 0 or float(target(seq[:-1])[seq[-1]]) > 0


def test_enumeration_across_rounds_gives_the_target_joint():
    # "the whole chain of accepted tokens is, by induction, an exact draw from the target's true
    #  joint distribution over the full sequence" — run rounds until 3 tokens are out
    vocab, k, n = 3, 2, 3
    for deterministic in (False, True):
        target, drafter = ToyLM(vocab, 11, zeros=0.2), ToyLM(vocab, 12)
        frontier, done = {(): 1.0}, defaultdict(float)
        while frontier:
            nxt = defaultdict(float)
            for prefix, w in frontier.items():
                for seq, pw in round_law(target, drafter, prefix, k, deterministic).items():
                    out = (prefix + seq)[:n]
                    (done if len(out) == n else nxt)[out] += w * pw
            frontier = nxt
        for seq in itertools.product(range(vocab), repeat=n):
            joint = math.prod(float(target(seq[:i])[seq[i]]) for i in range(n))
            assert done.get(seq, 0.0) == pytest.approx(joint, abs=1e-12)


def test_expected_tokens_matches_theory_for_constant_alpha():
    # with the same p and q at every position, acceptance is i.i.d. with alpha = sum min(p, q),
    # so the mean tokens per round is Chapter 2's (1 - alpha^(k+1)) / (1 - alpha)
    from specdec import theory

    class Constant(ToyLM):
        def __init__(self, row):
            super().__init__(len(row), 0)
            self.row = row

        def __call__(self, prefix):
            return self.row

    k = 3
    law = round_law(Constant(P_ABC), Constant(Q_ABC), (), k)
    mean = sum(len(s) * w for s, w in law.items())
    assert mean == pytest.approx(theory.expected_tokens(0.9, k), abs=1e-12)


# --- statistics: rejection_sample itself ---------------------------------------------------


def test_rejection_sample_follows_its_exact_law():
    torch.manual_seed(3)
    vocab, k, n = 5, 3, 4000
    p = torch.softmax(torch.randn(k + 1, vocab, dtype=torch.float64) * 1.5, -1)
    q = torch.softmax(torch.randn(k, vocab, dtype=torch.float64) * 1.5, -1)
    draft = torch.tensor([0, 2, 1])
    law = torch.tensor([pj * float(d[y]) for pj, d in V.outcome_distribution(p, q, draft) for y in range(vocab)])
    g = make_generator(0)
    counts = torch.zeros((k + 1) * vocab)
    for _ in range(n):
        j, tokens = V.rejection_sample(p, q, draft, g, validate=False)
        assert torch.equal(tokens[:j], draft[:j]) and len(tokens) == j + 1
        counts[j * vocab + int(tokens[-1])] += 1
    assert tv(counts, law) <= tv_bound(law, n)
    # the naive scheme is far outside the same bound
    naive = torch.zeros_like(counts)
    for _ in range(200):
        j, tokens = naive_top1_verify(p, q, draft)
        naive[j * vocab + int(tokens[-1])] += 1
    assert tv(naive, law) > tv_bound(law, 200)


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=0.8), SamplingParams(temperature=1.2, top_k=6, top_p=0.9, min_p=0.05)],
    ids=["temperature", "top-k+top-p+min-p"],
)
def test_histograms_converge_to_p(params):
    # vLLM-style: the total variation between the emitted tokens and p shrinks as samples grow
    torch.manual_seed(5)
    vocab, k = 8, 2
    p = probs_from_logits(torch.randn(k + 1, vocab) * 2, params)  # [k+1, V]
    q = probs_from_logits(torch.randn(k, vocab) * 2, params)  # [k, V]
    g = make_generator(1)
    sizes = [60, 600, 3000]
    drafts = sample(q.expand(sizes[-1], k, vocab), g)  # [N, k]
    first, second = torch.zeros(vocab), torch.zeros(vocab)
    naive_first = torch.zeros(vocab)
    tvs = []
    for i in range(sizes[-1]):
        j, tokens = V.rejection_sample(p, q, drafts[i], g, validate=False)
        first[tokens[0]] += 1
        if j >= 1:
            second[tokens[1]] += 1
        naive_first[naive_top1_verify(p, q, drafts[i])[1][0]] += 1
        if i + 1 in sizes:
            tvs.append(tv(first, p[0]))
    assert tvs[0] > tvs[1] > tvs[2]
    assert tvs[2] <= tv_bound(p[0], sizes[-1])
    assert tv(second, p[1]) <= tv_bound(p[1], int(second.sum()))
    # tokens the filters removed never appear
    assert first[p[0] == 0].sum() == 0 and second[p[1] == 0].sum() == 0
    # negative control: the naive scheme fails the same bound
    assert tv(naive_first, p[0]) > tv_bound(p[0], sizes[-1])


# --- rejection_sample edge cases -------------------------------------------------------------


def test_perfect_draft_is_always_accepted():
    # "Suppose the draft distribution q happened to equal the target distribution p exactly ...
    #  every drafted token is accepted with certainty"
    g = make_generator(0)
    p = torch.softmax(torch.randn(4, 10), -1)
    for _ in range(50):
        draft = sample(p[:3], g)
        n, tokens = V.rejection_sample(p, p[:3].clone(), draft, g)
        assert n == 3 and torch.equal(tokens[:3], draft)


def test_zero_target_probability_is_always_rejected():
    g = make_generator(0)
    p = torch.tensor([[0.0, 0.5, 0.5], [0.2, 0.3, 0.5]])
    for q in (torch.tensor([[0.9, 0.05, 0.05]]), None):
        for _ in range(30):
            n, tokens = V.rejection_sample(p, q, torch.tensor([0]), g)
            assert n == 0 and int(tokens[0]) in (1, 2)


def test_deterministic_draft_never_recovers_the_rejected_token():
    g = make_generator(0)
    p = torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.3, 0.5]])
    for _ in range(100):
        n, tokens = V.rejection_sample(p, None, torch.tensor([0]), g)
        if n == 0:
            assert int(tokens[0]) != 0


def test_empty_draft_is_plain_decoding():
    p = torch.tensor([[0.0, 1.0, 0.0]])
    n, tokens = V.rejection_sample(p, None, torch.zeros(0, dtype=torch.long))
    assert n == 0 and tokens.tolist() == [1]
    r = V.verify(Draft.empty(), p)
    assert r.tokens.tolist() == [1] and r.kind == "bonus" and r.path == [] and r.accepted == []


def test_same_seed_same_result():
    p = torch.softmax(torch.randn(5, 50), -1)
    q = torch.softmax(torch.randn(4, 50), -1)
    draft = torch.tensor([1, 2, 3, 4])
    runs = []
    for _ in range(2):
        g = make_generator(123)
        runs.append([V.rejection_sample(p, q, draft, g) for _ in range(20)])
    assert all(a[0] == b[0] and torch.equal(a[1], b[1]) for a, b in zip(*runs))


def test_large_vocabulary_smoke():
    g = make_generator(0)
    p = torch.softmax(torch.randn(5, 150_000) * 3, -1)
    q = torch.softmax(torch.randn(4, 150_000) * 3, -1)
    n, tokens = V.rejection_sample(p, q, sample(q, g), g)
    assert 0 <= n <= 4 and tokens.dtype == torch.long and len(tokens) == n + 1


# --- greedy ----------------------------------------------------------------------------------


def test_greedy_verify():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0], [0.0, 0.0, 9.0]])
    n, tokens = V.greedy_verify(logits, torch.tensor([1, 0]))
    assert n == 2 and tokens.tolist() == [1, 0, 2]
    n, tokens = V.greedy_verify(logits, torch.tensor([1, 2]))
    assert n == 1 and tokens.tolist() == [1, 0]
    n, tokens = V.greedy_verify(torch.softmax(logits, -1), torch.tensor([0, 0]))
    assert n == 0 and tokens.tolist() == [1]


def test_exact_mode_with_greedy_p_equals_greedy_mode():
    g = make_generator(0)
    torch.manual_seed(0)
    vocab, k = 5, 4
    for trial in range(100):
        logits = torch.randn(k + 1, vocab)
        p = probs_from_logits(logits, SamplingParams())  # greedy: one-hot rows
        q = torch.softmax(torch.randn(k, vocab), -1) if trial % 2 else None
        # drafts that often agree with the target, sometimes not
        draft = torch.where(torch.rand(k) < 0.7, logits[:k].argmax(-1), torch.randint(vocab, (k,)))
        if q is not None:
            q[torch.arange(k), draft] += 0.5
            q /= q.sum(-1, keepdim=True)
        exact = V.rejection_sample(p, q, draft, g)
        greedy = V.greedy_verify(p, draft)
        assert exact[0] == greedy[0] and torch.equal(exact[1], greedy[1])
        assert torch.equal(V.greedy_verify(logits, draft)[1], greedy[1])
        d = Draft.chain(draft, q)
        results = [V.verify(d, p, g, mode=m) for m in V.MODES]
        for r in results[1:]:
            assert r.num_accepted == results[0].num_accepted and torch.equal(r.tokens, results[0].tokens)
            assert r.kind == results[0].kind and r.accepted == results[0].accepted


# --- typical acceptance (lossy, opt-in) --------------------------------------------------------


def test_typical_is_opt_in_and_documented_lossy():
    assert inspect.signature(V.verify).parameters["mode"].default == "exact"
    assert "lossy" in V.typical_verify.__doc__.lower() and "lossy" in V.__doc__.lower()


def test_typical_thresholds():
    uniform = torch.full((1, 4), 0.25, dtype=torch.float64)
    assert float(V.typical_thresholds(uniform)[0]) == pytest.approx(0.3 * 0.25)  # delta * exp(-ln 4)
    one_hot = torch.tensor([[0.0, 1.0, 0.0]])
    assert float(V.typical_thresholds(one_hot)[0]) == pytest.approx(0.09)  # min(epsilon, delta)


def test_typical_is_lossy_on_the_toy_example():
    # the lesson: it "trades away the exact-distribution guarantee of Chapter 1 for a somewhat
    # higher acceptance rate": a drafted B (p = 0.3 > 0.09) is always kept, though p(B) = 0.3
    p = torch.stack([P_ABC, P_ABC])
    g = make_generator(0)
    kept = sum(V.typical_verify(p, torch.tensor([B]), g)[0] for _ in range(200))
    assert kept == 200
    exact_kept = sum(V.rejection_sample(p, None, torch.tensor([B]), g)[0] for _ in range(200))
    assert 30 < exact_kept < 90  # ~ 0.3 * 200


# --- VerifyResult and trees -----------------------------------------------------------------


def one_hot_rows(rows, vocab=8):
    return torch.nn.functional.one_hot(torch.tensor(rows), vocab).float()


def test_greedy_mode_accepts_logits():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0], [0.0, 0.0, 9.0]])
    r = V.verify(Draft.chain([1, 0]), logits, mode="greedy")
    assert r.tokens.tolist() == [1, 0, 2] and r.kind == "bonus"
    r = V.verify(Draft(torch.tensor([2, 1]), torch.tensor([-1, -1])), logits, mode="greedy")
    assert r.path == [1] and r.tokens.tolist() == [1, 2] and r.kind == "bonus"  # node 1 reads row 2
    with pytest.raises(ValueError, match="p"):
        V.verify(Draft.chain([1, 0]), logits)  # exact mode needs probabilities


def test_verify_result_on_a_chain():
    p = one_hot_rows([3, 4, 7])
    r = V.verify(Draft.chain([3, 5]), p, mode="greedy")
    assert r.tokens.tolist() == [3, 4] and r.num_accepted == 1 and r.num_emitted == 2
    assert r.accepted == [True, False] and r.kind == "recovered" and r.path == [0]
    r = V.verify(Draft.chain([3, 4]), p)
    assert r.tokens.tolist() == [3, 4, 7] and r.accepted == [True, True] and r.kind == "bonus"


TREE_PARENTS = [-1, -1, 0, 0, 1, 1]  # the lesson's K=2, s=2 tree


def test_greedy_tree():
    tokens = torch.tensor([1, 2, 3, 4, 5, 6])  # b1, b2, b1c1, b1c2, b2c1, b2c2
    # rows: root, then after each node; the target's argmax path is b2 -> b2c1 -> 7
    p = one_hot_rows([2, 0, 5, 0, 0, 7, 0])
    d = Draft(tokens, torch.tensor(TREE_PARENTS))
    for mode in V.MODES:
        r = V.verify(d, p, make_generator(0), mode=mode)
        assert r.path == [1, 4] and r.tokens.tolist() == [2, 5, 7], mode
        assert r.accepted == [False, True, False, False, True, False] and r.kind == "bonus"
    # the root's argmax matches no child: nothing accepted, the argmax is recovered
    p2 = one_hot_rows([6, 0, 5, 0, 0, 7, 0])
    for mode in V.MODES:
        r = V.verify(d, p2, make_generator(0), mode=mode)
        assert r.path == [] and r.tokens.tolist() == [6] and r.kind == "recovered"


class Branches(V.Draws):
    """Enumerates the exact law of `verify` itself: every accept test (u < a) and every draw (`sample`) is a branch
    point, taken as the script says (then the first branch), each weighted by its probability (a, 1 - a, or the
    drawn row's mass). It cannot see two decisions share a uniform (the stub tests above pin that)."""

    def __init__(self, script):
        self.script, self.taken, self.weight = list(script), [], 1.0

    def choose(self, weights):
        i = self.script[len(self.taken)] if len(self.taken) < len(self.script) else 0
        self.taken.append((i, len(weights)))
        self.weight *= weights[i]
        return i

    def uniform(self, position, stream=0):
        branches = self

        class U:
            def __lt__(self, a):
                return branches.choose([float(a), 1 - float(a)]) == 0
        return U()

    def uniforms(self, start, count, stream=0):
        return torch.zeros(count, dtype=torch.float64)

    def sample(self, probs, generator=None, u=None):
        row = probs.reshape(-1, probs.shape[-1])[0].double()
        tokens = [t for t in range(row.numel()) if row[t] > 0]
        return torch.tensor([tokens[self.choose([float(row[t] / row.sum()) for t in tokens])]])


def law_of_verify(draft, p, monkeypatch):
    """{emitted tokens: probability} of `verify(draft, p)` (exact mode), by walking every branch."""
    law, todo = defaultdict(float), [[]]
    while todo:
        branches = Branches(todo.pop())
        monkeypatch.setattr(V, "sample", branches.sample)
        r = V.verify(draft, p, branches, validate=False)
        if branches.weight > 0:  # a branch of probability 0 (an accept test with a = 1 failing) emits nothing
            law[tuple(r.tokens.tolist())] += branches.weight
        for d in range(len(branches.script), len(branches.taken)):  # the branches not taken, from the new ones
            todo += [[i for i, _ in branches.taken[:d]] + [j] for j in range(1, branches.taken[d][1])]
    return law


def test_multi_candidate_level_is_exact_by_enumeration(monkeypatch):
    """SpecInfer's multi-candidate speculative sampling in `verify`: s siblings drawn independently from q, tried in
    order against the running residual, give the root's token distributed exactly as p (each candidate tuple
    weighted by its q probability; every branch of the real tree walk enumerated). Deterministic distinct
    candidates (q = None) too."""
    rng = np.random.default_rng(0)
    for vocab, s in [(3, 2), (4, 3), (5, 2)]:
        p = torch.tensor(rng.dirichlet(np.ones(vocab)))
        q = torch.tensor(rng.dirichlet(np.ones(vocab)))
        rows = torch.stack([p] * (s + 1))
        law = torch.zeros(vocab, dtype=torch.float64)
        for cands in itertools.product(range(vocab), repeat=s):
            w = math.prod(float(q[x]) for x in cands)
            draft = Draft(torch.tensor(cands), torch.full((s,), -1), q.expand(s, vocab).clone())
            for tokens, mass in law_of_verify(draft, rows, monkeypatch).items():
                law[tokens[0]] += w * mass
        assert torch.allclose(law, p, atol=1e-12)
        law = torch.zeros(vocab, dtype=torch.float64)
        for tokens, mass in law_of_verify(Draft(torch.arange(s), torch.full((s,), -1)), rows, monkeypatch).items():
            law[tokens[0]] += mass
        assert torch.allclose(law, p, atol=1e-12)


def test_a_chain_round_follows_its_exact_law_by_enumeration(monkeypatch):
    """Every branch of `verify` on a drafted chain against `outcome_distribution` (the law the enumeration tests
    above check is the target's): P(j accepted) times the residual or bonus row, for each j."""
    rng = np.random.default_rng(1)
    vocab, k = 4, 3
    p = torch.tensor(rng.dirichlet(np.ones(vocab), size=k + 1))
    q = torch.tensor(rng.dirichlet(np.ones(vocab), size=k))
    draft = torch.tensor([0, 2, 1])
    want = defaultdict(float)
    for j, (reach, row) in enumerate(V.outcome_distribution(p, q, draft)):
        for t in range(vocab):
            want[tuple(draft[:j].tolist()) + (t,)] += reach * float(row[t])
    got = law_of_verify(Draft.chain(draft, q), p, monkeypatch)
    assert set(got) == {x for x, w in want.items() if w > 0}
    assert all(abs(got[x] - want[x]) < 1e-12 for x in got)


def test_tree_verify_statistics():
    # verify() on the lesson's tree with siblings drawn i.i.d. from q: the first emitted token
    # follows p at the root, the second follows p after the first
    torch.manual_seed(2)
    vocab, n = 4, 1500
    p_root = torch.softmax(torch.randn(vocab) * 1.5, -1)
    p_next = torch.softmax(torch.randn(vocab, vocab) * 1.5, -1)  # row t: target after token t
    q_root = torch.softmax(torch.randn(vocab), -1)
    q_next = torch.softmax(torch.randn(vocab, vocab), -1)
    g = make_generator(3)
    first, second = torch.zeros(vocab), torch.zeros(vocab, vocab)
    for _ in range(n):
        b = sample(q_root.expand(2, vocab), g)  # b1, b2
        c = sample(q_next[b].repeat_interleave(2, 0), g)  # b1c1, b1c2, b2c1, b2c2
        tokens = torch.cat([b, c])
        q = torch.cat([q_root.expand(2, vocab), q_next[b].repeat_interleave(2, 0)])
        p = torch.cat([p_root[None], p_next[tokens]])  # row j+1: target after node j
        r = V.verify(Draft(tokens, torch.tensor(TREE_PARENTS), q), p, g)
        assert r.tokens[: r.num_accepted].tolist() == tokens[r.path].tolist()
        first[r.tokens[0]] += 1
        if r.num_emitted >= 2:
            second[r.tokens[0], r.tokens[1]] += 1
    assert tv(first, p_root) <= tv_bound(p_root, n)
    for t in range(vocab):
        m = int(second[t].sum())
        if m >= 100:
            assert tv(second[t], p_next[t]) <= tv_bound(p_next[t], m)


# --- bad input ----------------------------------------------------------------------------------


GOOD_P = torch.full((3, 4), 0.25)
GOOD_Q = torch.full((2, 4), 0.25)
DRAFT = torch.tensor([1, 2])


@pytest.mark.parametrize(
    "p, q, draft, name",
    [
        (GOOD_P * 2, GOOD_Q, DRAFT, "p row 0 sums to 2"),
        (torch.tensor([[1.5, -0.5, 0, 0]] * 3), GOOD_Q, DRAFT, "p has negative"),
        (torch.tensor([[float("nan"), 1, 0, 0]] * 3), GOOD_Q, DRAFT, "p has NaN"),
        (GOOD_P, GOOD_Q * 0.5, DRAFT, "q row 0 sums"),
        (GOOD_P, torch.tensor([[float("inf"), 0, 0, 0]] * 2), DRAFT, "q has NaN or infinite"),
        (GOOD_P[:2], GOOD_Q, DRAFT, "p must have k\\+1 = 3 rows"),
        (GOOD_P, GOOD_Q[:1], DRAFT, "q must be"),
        (GOOD_P, torch.full((2, 5), 0.2), DRAFT, "q must be"),
        (GOOD_P, GOOD_Q, torch.tensor([1, 4]), "draft_tokens"),
        (GOOD_P, GOOD_Q, torch.tensor([[1, 2]]), "draft_tokens"),
        (GOOD_P, GOOD_Q, torch.tensor([1.0, 2.0]), "draft_tokens"),
        (GOOD_P[0], GOOD_Q, DRAFT, "p must be a 2-D"),
    ],
)
def test_bad_input_names_the_argument(p, q, draft, name):
    with pytest.raises(ValueError, match=name):
        V.rejection_sample(p, q, draft)


def test_validation_can_be_skipped_and_verify_checks_too():
    V.rejection_sample(GOOD_P * 2, GOOD_Q, DRAFT, validate=False)  # caller vouches for p
    with pytest.raises(ValueError, match="mode"):
        V.verify(Draft.chain(DRAFT), GOOD_P, mode="fast")
    with pytest.raises(ValueError, match="p"):
        V.verify(Draft.chain(DRAFT), GOOD_P * 2)
    with pytest.raises(ValueError, match="^p must be"):
        V.verify(Draft(torch.tensor([1, 2, 3]), torch.tensor([-1, -1, 0])), GOOD_P)
    with pytest.raises(ValueError, match="q"):
        V.verify(Draft(DRAFT, torch.tensor([-1, -1]), GOOD_Q * 3), GOOD_P)
    with pytest.raises(ValueError, match="draft"):
        V.verify("not a draft", GOOD_P)


# --- which uniform each decision reads (a stub Draws with chosen values; found by mutating verify.py) -------


class Chosen(V.Draws):
    """Draws whose uniform at (position, stream) is chosen by the test (0.5 otherwise), each read recorded."""

    def __init__(self, table: dict):
        self.table, self.read = table, []

    def uniform(self, position: int, stream: int = 0) -> float:
        self.read.append((position, stream))
        return self.table.get((position, stream), 0.5)


# p = (0.1, 0.45, 0.45); two siblings A = 0, B = 1, each drawn from q = (0.5, 0.4, 0.1)
P3, Q3 = torch.tensor([0.1, 0.45, 0.45]), torch.tensor([0.5, 0.4, 0.1])
SIBLINGS = Draft(torch.tensor([0, 1]), torch.tensor([-1, -1]), torch.stack([Q3, Q3]))


def test_tree_siblings_are_tested_with_their_own_uniforms():
    """A is accepted with min(1, 0.1/0.5) = 0.2: u = 0.9 rejects it. The residual (0, 0.125, 0.875) then
    accepts B with 0.125 / 0.4 = 0.3125, tested with B's own uniform 0.1: accepted. With A's uniform again
    (>= 0.2 by the rejection) B would be tested unfairly, and here rejected."""
    draws = Chosen({(0, 1): 0.9, (0, 2): 0.1})
    r = V.verify(SIBLINGS, torch.stack([P3] * 3), draws)
    assert r.path == [1] and r.tokens[0] == 1
    assert len(draws.read) == len(set(draws.read))  # no uniform read twice in a round


def test_tree_residual_carries_over_from_sibling_to_sibling():
    """Both siblings rejected: after A the residual is (0, 0.125, 0.875), after B max(0, that - q) puts
    everything on C, so the recovered token is C whatever the residual's uniform. Restarting from p for B's
    residual would give (0, 0.05/0.4, 0.35/0.4) again: u = 0.05 draws B."""
    draws = Chosen({(0, 1): 0.9, (0, 2): 0.9, (0, V.Draws.RESIDUAL): 0.05})
    r = V.verify(SIBLINGS, torch.stack([P3] * 3), draws)
    assert r.path == [] and r.tokens.tolist() == [2] and r.kind == "recovered"


def test_the_residual_is_drawn_with_a_uniform_of_its_own():
    """Chain: p(B) / q(B) = 0.3 / 0.8 = 0.375; u = 0.95 rejects B. The residual (0.6, 0, 0.4) at its own
    uniform 0.05 gives A; at the accept test's 0.95 (known to be >= 0.375) it would give C."""
    p = torch.tensor([[0.4, 0.3, 0.3], [1 / 3, 1 / 3, 1 / 3]])
    draws = Chosen({(0, 1): 0.95, (0, V.Draws.RESIDUAL): 0.05})
    n, tokens = V.rejection_sample(p, torch.tensor([[0.1, 0.8, 0.1]]), torch.tensor([1]), draws)
    assert (n, tokens.tolist()) == (0, [0]) and len(draws.read) == len(set(draws.read))


def test_tree_round_kind_is_bonus_only_after_a_leaf():
    """A chain of two under a root with a second child: stopping inside the tree is "recovered", after
    the leaf "bonus" (greedy p one-hot on the drafted tokens, then on token 3)."""
    tree = Draft(torch.tensor([1, 2, 0]), torch.tensor([-1, 0, -1]))
    hot = lambda *ids: torch.nn.functional.one_hot(torch.tensor(ids), 4).float()  # noqa: E731
    assert V.verify(tree, hot(1, 2, 3, 3), mode="greedy").kind == "bonus"       # root -> 1 -> 2 (a leaf)
    r = V.verify(tree, hot(1, 3, 3, 3), mode="greedy")                           # root -> 1, then 3: not 2
    assert r.path == [0] and r.kind == "recovered"


def test_typical_tree_breaks_ties_by_the_lowest_index():
    """Two siblings both clear the typical threshold (p 0.45 each): the first is kept, as documented."""
    p = torch.tensor([[0.45, 0.45, 0.1]] * 3)
    r = V.verify(Draft(torch.tensor([0, 1]), torch.tensor([-1, -1])), p, V.Draws(0), mode="typical")
    assert r.path == [0]


def test_typical_tree_tests_a_node_against_its_parents_row():
    """A node's token was proposed for the row after its parent: its threshold is that row's. Row 0 is flat
    (threshold 0.3 / 16 ~ 0.019, so p = 0.06 clears it); the rows after the nodes are one-hot (threshold 0.09)."""
    row0 = torch.full((16,), 0.94 / 15, dtype=torch.float64)
    row0[0] = 0.06
    hot = torch.nn.functional.one_hot(torch.tensor(5), 16).double()
    p = torch.stack([row0, hot, hot])
    r = V.verify(Draft(torch.tensor([0, 1]), torch.tensor([-1, -1])), p, V.Draws(0), mode="typical")
    assert r.path == [0] and r.tokens.tolist() == [0, 5]


def test_typical_extra_token_draws_the_uniform_of_its_position():
    """The token after the accepted ones is the inverse CDF of its row at the request's uniform for its
    position (position + accepted), as plain decoding would draw it there."""
    flat = torch.full((3, 8), 1 / 8, dtype=torch.float64)
    draws = V.Draws(1)
    for position in range(6):
        want = int(sample(flat[1], u=draws.uniforms(position + 1, 1)))
        n, tokens = V.typical_verify(flat[:2], torch.tensor([3]), draws, position=position, epsilon=0.05)
        assert n == 1 and tokens.tolist() == [3, want]
        r = V.verify(Draft(torch.tensor([3, 4]), torch.tensor([-1, -1])), flat, draws, mode="typical",
                     typical_epsilon=0.05, position=position)
        assert r.path == [0] and r.tokens.tolist() == [3, want]


# --- edges found by a second mutation pass over verify.py ----------------------------------------


def test_check_distributions_names_the_bad_row_with_an_inclusive_tolerance():
    """A single bad row is caught and named wherever it sits (not only when every row is bad); the tolerance is
    inclusive (|sum - 1| = atol passes) and 1e-4 by default; rows of one entry and any leading shape ([V],
    [2, 3, V]) are checked; integer tensors are refused."""
    f64 = lambda rows: torch.tensor(rows, dtype=torch.float64)  # noqa: E731
    V.check_distributions(f64([[0.5, 0.5], [0.25, 0.75]]), "p")
    with pytest.raises(ValueError, match="p row 1 sums to 2,"):
        V.check_distributions(f64([[0.5, 0.5], [1.0, 1.0]]), "p")
    V.check_distributions(f64([[0.75, 0.75]]), "p", atol=0.5)  # off by exactly atol
    with pytest.raises(ValueError, match="p row 1 sums to 3,"):
        V.check_distributions(f64([[0.75, 0.75], [1.5, 1.5]]), "p", atol=0.5)
    V.check_distributions(f64([[0.5, 0.5 + 0.8e-4]]), "p")
    with pytest.raises(ValueError, match="p row 0 sums to 1.00012"):
        V.check_distributions(f64([[0.5, 0.5 + 1.2e-4]]), "p")
    V.check_distributions(torch.ones(1, 1), "p")
    with pytest.raises(ValueError, match="p row 0 sums to 2,"):
        V.check_distributions(torch.full((1, 1), 2.0), "p")
    V.check_distributions(torch.full((4,), 0.25), "p")
    V.check_distributions(torch.full((2, 3, 4), 0.25), "p")
    with pytest.raises(ValueError, match="p row 4 sums to 2,"):
        V.check_distributions(torch.full((2, 3, 4), 0.25).index_put_((torch.tensor(1), torch.tensor(1)),
                                                                     torch.tensor(0.5)), "p")
    with pytest.raises(ValueError, match="floating-point"):
        V.check_distributions(torch.tensor([[0, 1]]), "p")


def test_bad_input_that_is_not_a_float_tensor_or_not_a_token_id():
    """Lists for p or q, integer p, 1-D p, a negative draft token (which would index p from the end) and tree
    tokens >= V are refused with a ValueError naming the argument, not an AttributeError or IndexError later."""
    with pytest.raises(ValueError, match="p must be a 2-D"):
        V.rejection_sample(GOOD_P.tolist(), GOOD_Q, DRAFT)
    with pytest.raises(ValueError, match="q must be"):
        V.rejection_sample(GOOD_P, GOOD_Q.tolist(), DRAFT)
    with pytest.raises(ValueError, match="draft_tokens"):
        V.rejection_sample(GOOD_P, GOOD_Q, torch.tensor([-1, 2]))
    with pytest.raises(ValueError, match="p_or_logits must be a 2-D float"):
        V.greedy_verify(torch.tensor([[0, 5, 1], [3, 0, 1], [0, 0, 9]]), torch.tensor([1, 0]))
    tree = Draft(torch.tensor([1, 2]), torch.tensor([-1, -1]))
    with pytest.raises(ValueError, match="^p must be"):
        V.verify(tree, GOOD_P.tolist())
    with pytest.raises(ValueError, match="^p must be"):
        V.verify(tree, torch.tensor([[0, 5, 1], [3, 0, 1], [0, 0, 9]]), mode="greedy")
    with pytest.raises(ValueError, match="^p must be"):
        V.verify(tree, torch.full((3,), 1 / 3))
    for tokens in ([1, 4], [4, 1]):  # V = 4
        with pytest.raises(ValueError, match="draft tokens must be token ids"):
            V.verify(Draft(torch.tensor(tokens), torch.tensor([-1, -1])), GOOD_P)


def test_acceptance_where_q_is_zero_or_p_rounds_past_one():
    """q(x) = 0 (a token the draft could not have drawn) accepts iff p(x) > 0, without dividing by zero; a
    deterministic draft's min(1, p(x)) stays a probability for a p(x) a rounding past 1 (rows pass validation up
    to 1e-4 off)."""
    assert V.acceptance_probability(0.3, 0.0) == 1.0
    assert V.acceptance_probability(1e-30, 0.0) == 1.0
    assert V.acceptance_probability(0.0, 0.0) == 0.0
    assert V.acceptance_probability(0.3) == 0.3
    assert V.acceptance_probability(1.00005) == 1.0
    # through rejection_sample: q drafted token 1 with q(1) = 0, p(1) = 0.3: always accepted
    p = torch.tensor([[0.2, 0.3, 0.5], [1.0, 0.0, 0.0]], dtype=torch.float64)
    q = torch.tensor([[0.5, 0.0, 0.5]], dtype=torch.float64)
    n, tokens = V.rejection_sample(p, q, torch.tensor([1]), V.Draws(0))
    assert (n, tokens.tolist()) == (1, [1, 0])


def test_residual_without_mass_falls_back_to_p():
    """p == q (a rejection had probability ~0) or p one-hot on the rejected deterministic token: no residual mass,
    p itself is returned, never 0 / 0."""
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    assert torch.equal(V.residual_distribution(p, p.clone()), p)
    hot = torch.tensor([0.0, 1.0, 0.0])
    assert torch.equal(V.residual_distribution(hot, None, 1), hot)


def test_a_chain_round_reads_the_uniforms_of_its_own_positions():
    """Row j of a chain round rooted at `position` tests its token with u(position + j, stream 1), and the token
    after the accepted ones is the residual's draw (stream RESIDUAL) or the bonus (stream 0, as plain decoding)
    at its own position: rows must not read earlier positions, whose uniforms earlier rounds already used.
    `position` defaults to 0."""
    p = torch.full((3, 4), 0.25, dtype=torch.float64)
    q = torch.tensor([[0.1, 0.5, 0.2, 0.2], [0.1, 0.2, 0.5, 0.2]], dtype=torch.float64)
    draft = torch.tensor([1, 2])  # each accepted with 0.25 / 0.5 = 0.5
    res = V.Draws.RESIDUAL
    # accept (0.1 < 0.5), reject (0.9); residual after 2: (0.15, 0.05, 0, 0.05) / 0.25, at u = 0.7 token 1
    draws = Chosen({(5, 1): 0.1, (6, 1): 0.9, (6, res): 0.7})
    n, tokens = V.rejection_sample(p, q, draft, draws, position=5)
    assert (n, tokens.tolist(), draws.read) == (1, [1, 1], [(5, 1), (6, 1), (6, res)])
    # both accepted: the bonus is p[2]'s inverse CDF at u(7) = 0.6, token 2
    draws = Chosen({(5, 1): 0.1, (6, 1): 0.1, (7, 0): 0.6})
    n, tokens = V.rejection_sample(p, q, draft, draws, position=5)
    assert (n, tokens.tolist(), draws.read) == (2, [1, 2, 2], [(5, 1), (6, 1), (7, 0)])
    draws = Chosen({})
    V.rejection_sample(p, q, draft, draws)
    assert draws.read[0] == (0, 1)
    draws = Chosen({})
    V.rejection_sample(p, None, draft, draws)
    assert draws.read == [(0, 0), (1, 0), (2, 0)]
    draws = Chosen({})
    V.typical_verify(p[:2], torch.tensor([3]), draws, epsilon=0.05)  # accepted: the extra token draws position 1
    assert draws.read == [(1, 0)]


def test_typical_acceptance_is_strict_and_checks_its_arguments():
    """p(x) must exceed the threshold: p(x) = min(epsilon, ...) exactly is rejected, in a chain and in a tree.
    epsilon in (0, 1], delta > 0 finite; rows of any leading shape; validation on by default; an empty draft is
    plain decoding."""
    p = torch.tensor([[0.09, 0.09, 0.82]] * 3, dtype=torch.float64)  # 0.3 exp(-H) = 0.165: threshold 0.09
    assert V.typical_thresholds(p).tolist() == [0.09] * 3
    assert V.typical_verify(p[:2], torch.tensor([0]), V.Draws(0))[0] == 0
    assert V.typical_verify(p[:2], torch.tensor([2]), V.Draws(0))[0] == 1
    r = V.verify(Draft(torch.tensor([0, 1]), torch.tensor([-1, -1])), p, V.Draws(0), mode="typical")
    assert r.path == [] and r.kind == "recovered"
    for epsilon, delta in [(0.0, 0.3), (-0.1, 0.3), (1.5, 0.3), (0.09, 0.0), (0.09, -1.0), (0.09, math.inf),
                           (0.09, math.nan)]:
        with pytest.raises(ValueError, match="epsilon"):
            V.typical_thresholds(p, epsilon, delta)
    entropy = -(2 * 0.09 * math.log(0.09) + 0.82 * math.log(0.82))
    assert V.typical_thresholds(p, 1.0, 0.3).tolist() == pytest.approx([0.3 * math.exp(-entropy)] * 3)
    assert float(V.typical_thresholds(torch.full((4,), 0.25))) == pytest.approx(0.075)
    with pytest.raises(ValueError, match="p row 0 sums to 2"):
        V.typical_verify(GOOD_P * 2, DRAFT)
    n, tokens = V.typical_verify(p[:1], torch.zeros(0, dtype=torch.long), V.Draws(0))
    assert n == 0 and tokens.tolist() == [int(sample(p[0], u=V.Draws(0).uniforms(0, 1)))]


def test_typical_tree_keeps_whole_paths_and_counts_depth_below_the_first_root_child():
    """Node 2 hangs off node 0 (a root child with index 0). Row 0 = (0.5, 0.5, 0, 0) clears tokens 0 and 1 only;
    the row after node 0 is one-hot on 3, so node 2 (token 3) clears it. With node 0 failing (token 2), node 2
    is not kept though it clears its row: the path is [1]. With node 0 passing, node 2 is the deepest: [0, 2]."""
    hot = lambda t: torch.nn.functional.one_hot(torch.tensor(t), 4).double()  # noqa: E731
    p = torch.stack([torch.tensor([0.5, 0.5, 0.0, 0.0], dtype=torch.float64), hot(3), hot(0), hot(1)])
    parents = torch.tensor([-1, -1, 0])
    r = V.verify(Draft(torch.tensor([2, 1, 3]), parents), p, V.Draws(0), mode="typical")
    assert r.path == [1] and r.tokens.tolist() == [1, 0]
    r = V.verify(Draft(torch.tensor([0, 1, 3]), parents), p, V.Draws(0), mode="typical")
    assert r.path == [0, 2] and r.tokens.tolist() == [0, 3, 1] and r.kind == "bonus"


def test_outcome_distribution_takes_rows_as_given():
    """Like rejection_sample(validate=False), the exact law does not insist on normalized rows (bf16 rows may
    be off by more than the tolerance): acceptance min(1, p/q) on the rows as given."""
    p = torch.full((2, 4), 0.25 * (1 + 1e-3), dtype=torch.float64)
    q = torch.tensor([[0.5, 0.25, 0.125, 0.125]], dtype=torch.float64)
    (reject, _), (accept, _) = V.outcome_distribution(p, q, torch.tensor([0]))
    assert accept == pytest.approx(0.5 * (1 + 1e-3)) and reject == pytest.approx(1 - accept)


def test_a_deterministic_chain_is_checked_against_plain_decodings_draw_at_every_row():
    """q = None: row j compares the draft with the target's own draw at position + j (its row's inverse CDF at
    u(position + j), as plain decoding draws it). A chain guessing those draws is accepted whole and the bonus is
    plain decoding's next token; a chain wrong at row 2 keeps 2 and emits plain decoding's token there. Rows past
    the first are exercised here: the end-to-end seed test rarely gets a tiny random model to accept them."""
    torch.manual_seed(4)
    vocab, k = 6, 4
    p = torch.softmax(torch.randn(k + 1, vocab, dtype=torch.float64), -1)
    for seed in range(5):
        draws = V.Draws(seed)
        for position in (0, 9):
            plain = [int(sample(p[j], u=draws.uniforms(position + j, 1))) for j in range(k + 1)]
            n, tokens = V.rejection_sample(p, None, torch.tensor(plain[:k]), draws, position=position)
            assert (n, tokens.tolist()) == (k, plain)
            wrong = plain[:2] + [(plain[2] + 1) % vocab] + plain[3:k]
            n, tokens = V.rejection_sample(p, None, torch.tensor(wrong), draws, position=position)
            assert (n, tokens.tolist()) == (2, plain[:3])
