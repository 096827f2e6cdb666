"""The batched engine and its scheduler: the packed forward equals each request's own forward, every
request's greedy output equals its single-request decode() (chains, trees, chunked prefill, joins and
leaves), cancelled jobs free their slot, and the scheduler reproduces the lesson's Ch. 7 allocation and
never spends past the budget."""

import random
from types import SimpleNamespace

import pytest
import torch

from specdec import theory
from specdec.adaptive import AdaptiveK, CostCurve, FixedK
from specdec.decode import Request, decode
from specdec.draft import Draft, forward_layout
from specdec.drafters.base import Drafter
from specdec.drafters.prompt_lookup import PromptLookup, lookup
from specdec.errors import SpecdecError
from specdec.runtime.loader import load_transformer
from specdec.serving.batch import Segment, packed_forward
from specdec.serving.engine import Engine, Job
from specdec.serving.metrics import Metrics
from specdec.serving.scheduler import Ask, ModePicker, grant
from specdec.tokenizer import Tokenizer
from tests.test_exact_bf16 import model, wide  # noqa: F401 (fixtures: bf16 on each kernel path; head dims of 32)

PROMPTS = ["abcabcabcabc abc", "hello hello hello", "x", "the cat sat on the mat; the cat sat", "0123456789" * 7]


@pytest.fixture(scope="module")
def tiny(tiny_folder):
    return load_transformer(tiny_folder, torch.float32), Tokenizer(tiny_folder)


# --- the packed forward ------------------------------------------------------------------------------

def test_packed_forward_equals_each_requests_own_forward(tiny):
    check_packed_forward(tiny[0], exact=False)


def test_packed_forward_is_bit_identical_on_exact_models(model):  # noqa: F811 (bf16 on each kernel path)
    check_packed_forward(model, exact=True)


def test_packed_forward_is_bit_identical_with_a_bf16_cache(wide, monkeypatch):  # noqa: F811
    """A bf16 cache with head dims of 32: AMX attention over every request's rows in one call where the CPU has it."""
    monkeypatch.setattr(wide, "kv_choice", torch.bfloat16)
    check_packed_forward(wide, exact=True)


def check_packed_forward(model, exact: bool):
    """Three requests packed (prefill pieces, then chains, then trees) against each request alone: within
    fp32 noise, or bit for bit where the model is exact (row-exact matmuls, attention and fused block ops). The
    70-token prompt's rows attend across a 64-key block boundary of the exact attention."""
    close = (lambda a, b: torch.equal(a, b)) if exact else (lambda a, b: torch.allclose(a, b, rtol=0, atol=1e-4))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 90, (n,), generator=g).tolist() for n in (5, 70, 12)]
    tree = Draft(torch.tensor([5, 6, 7, 8]), torch.tensor([-1, -1, 0, 0]))
    offsets, local = forward_layout(tree)
    own, packed = [], []
    for p in prompts:  # the reference: each request alone, prompt (prefilled, as decode() does) then a chain or a tree
        c = model.new_cache(128)
        model.prefill(p, c)
        start = c.length
        mask = torch.ones(1, 5, start + 5, dtype=torch.bool)
        mask[0, :, start:] = local
        own.append((model(torch.tensor([[9, 10, 11]]), c).logits[0],
                    model(torch.tensor([[9, 5, 6, 7, 8]]), c, positions=(start + 3 + offsets)[None],
                          mask=torch.cat([torch.ones(1, 5, 3, dtype=torch.bool), mask], -1)).logits[0], c))
        packed.append(model.new_cache(128))
    first = packed_forward(model, [Segment(c, p, logits=False) for c, p in zip(packed, prompts)])
    assert first == [None, None, None]
    chains = packed_forward(model, [Segment(c, [9, 10, 11]) for c in packed])
    trees = packed_forward(model, [Segment(c, [9, 5, 6, 7, 8], offsets, local) for c in packed])
    for (chain, tr, c), a, b, pc in zip(own, chains, trees, packed):
        assert close(a, chain) and close(b, tr)
        assert pc.length == c.length
        assert close(pc.k[0][:, :, :pc.length], c.k[0][:, :, :c.length])


@pytest.mark.parametrize("fmt", ["q4", "q8"])
def test_prefill_rows_keep_their_path_beside_decoding_rows(tiny_folder, fmt):
    """Quantized models: prompt rows take the prefill path (`quant.prefill_isa`: AMX where the CPU has it) and
    decoding rows the integer kernel, in one packed forward too: a prompt prefilled between two requests' chains
    gets the cache of its own `prefill`, and the chains the logits of their own forwards, bit for bit."""
    from specdec.runtime.kernels import quant

    model = load_transformer(tiny_folder, fmt)
    check_packed_forward(model, exact=True)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 90, (n,), generator=g).tolist() for n in (7, 30, 9)]
    own, packed = [], []
    for p in prompts:
        c = model.new_cache(128)
        model.prefill(p, c)
        own.append((model(torch.tensor([[9, 10, 11]]), c).logits[0], c))
        packed.append(model.new_cache(128))
    packed_forward(model, [Segment(packed[0], prompts[0], logits=False), Segment(packed[2], prompts[2], logits=False)])
    a, none, b = packed_forward(model, [Segment(packed[0], [9, 10, 11]), Segment(packed[1], prompts[1], logits=False),
                                        Segment(packed[2], [9, 10, 11])])
    assert none is None and torch.equal(a, own[0][0]) and torch.equal(b, own[2][0])
    for (_, c), pc in zip(own, packed):  # the middle request holds its prompt only
        assert all(torch.equal(x[:, :, :pc.length], y[:, :, :pc.length]) for x, y in zip(pc.k + pc.v, c.k + c.v))
    if quant.prefill_isa():  # the prompt really took another path: a plain forward writes other bits
        c = model.new_cache(128)
        model(torch.tensor([prompts[1]]), c)
        assert not torch.equal(c.k[1][:, :, :30], own[1][1].k[1][:, :, :30])


# --- the engine: output equals decode() ---------------------------------------------------------------

class TinyTree(Drafter):
    """A deterministic tree for the tests: prompt lookup's chain, plus a sibling at the first level."""

    name = "tiny-tree"

    def propose(self, ctx, k):
        chain = lookup(ctx.tokens, k)
        if not chain:
            return Draft.empty()
        tokens = [chain[0], (chain[0] + 1) % 90 + 3] + chain[1:]
        parents = [-1, -1] + [0] + list(range(2, len(chain)))
        return Draft(torch.tensor(tokens), torch.tensor(parents[:len(tokens)]))


def reference(model, tok, ids, max_new, drafter=None, policy=None):
    return list(decode(model, tok, ids, Request(max_new_tokens=max_new), drafter, policy))[-1].result


def run_engine(engine, jobs, join_every=2):
    """Submit jobs two at a time, a few steps apart (requests join while others decode)."""
    events = {j.id: [] for j in jobs}
    for j in jobs:
        j.on_event = events[j.id].append
    pending, steps = list(jobs), 0
    while pending or engine.busy:
        if pending and steps % join_every == 0:
            engine.submit(pending.pop(0))
        engine.step()
        steps += 1
    return events


@pytest.mark.parametrize("mode, budget", [("auto", 6), ("auto", None), ("always", 6), ("never", 6)])
def test_engine_greedy_equals_single_request_decode(tiny, mode, budget):
    model, tok = tiny
    ids = [tok.encode(p, chat=False) for p in PROMPTS]
    refs = [reference(model, tok, i, 30, PromptLookup(), AdaptiveK()) for i in ids]
    curve = CostCurve({1: 1.0, 4: 1.1, 8: 1.6, 64: 8.0})  # budget None: this curve decides
    engine = Engine(model, tok, budget=budget, cost=curve, speculation=mode, max_batch=3, prefill_chunk=16)
    jobs = [Job(i, Request(max_new_tokens=30), method="prompt-lookup" if n % 4 else "plain",
                priority="batch" if n % 2 else "interactive") for n, i in enumerate(ids)]
    events = run_engine(engine, jobs)
    for job, ref in zip(jobs, refs):
        ev = events[job.id]
        assert [t for e in ev for t in e.tokens] == ref.token_ids
        assert "".join(e.text for e in ev) == ref.text
        assert ev[-1].finish_reason == ref.finish_reason and ev[-1].completion_tokens == ref.new_tokens
        assert all(e.finish_reason is None for e in ev[:-1])
    assert not engine.running and not engine.waiting
    assert engine.overhead > 0  # measured: a step is more than its forward
    drafted = sum(d for d, _ in engine.metrics.totals.values())
    assert (drafted > 0) == (mode != "never")  # the equality above covered speculative rounds
    if mode == "auto" and budget is None:  # measured arms: whatever auto ran, the outputs above are exact
        assert sum(engine.picker.steps.values()) > 0
        assert 'specdec_auto_arm_steps_total{arm="model"}' in engine.metrics.render().decode()
        assert 'specdec_auto_arm_ratio{arm="model",batch=' in engine.metrics.render().decode()  # explored: 1.0
    else:
        assert engine.picker is None


def test_engine_trees_and_fixed_k_equal_decode(tiny):
    model, tok = tiny
    ids = [tok.encode(p, chat=False) for p in PROMPTS[:4]]
    refs = [reference(model, tok, i, 25, TinyTree(), FixedK(3)) for i in ids]
    engine = Engine(model, tok, budget=100, speculation="always", max_batch=4)
    engine.new_drafter = lambda method: TinyTree()  # the engine runs any per-request drafter
    jobs = [Job(i, Request(max_new_tokens=25), method="prompt-lookup", k=3) for i in ids]
    events = run_engine(engine, jobs, join_every=1)
    for job, ref in zip(jobs, refs):
        assert [t for e in events[job.id] for t in e.tokens] == ref.token_ids


def test_a_cheap_drafter_asks_for_the_draft_it_has(tiny, monkeypatch):
    """Prompt lookup drafts before the grant (`Drafter.cheap`): each ask is one draft's depth and positions, a
    round with no match asks for nothing (the old order asked for k and found nothing in 43% of the grants at 8
    SmolLM2 requests), and the granted drafts are the ones verified: outputs equal single-request decode()."""
    from specdec.serving import scheduler

    model, tok = tiny
    asks, proposed, real = [], [], scheduler.grant
    monkeypatch.setattr(scheduler, "grant", lambda a, *args, **kw: asks.extend(a) or real(a, *args, **kw))
    engine = Engine(model, tok, budget=100, speculation="auto", max_batch=3)
    make = engine.new_drafter

    def recording(method):
        d = make(method)
        propose = d.propose
        d.propose = lambda ctx, k: proposed.append(propose(ctx, k)) or proposed[-1]
        return d

    engine.new_drafter = recording
    ids = [tok.encode(p, chat=False) for p in PROMPTS]
    jobs = [Job(i, Request(max_new_tokens=30), method="prompt-lookup", k=4) for i in ids]
    events = run_engine(engine, jobs)
    for job, i in zip(jobs, ids):
        assert [t for e in events[job.id] for t in e.tokens] == reference(model, tok, i, 30, PromptLookup(),
                                                                          FixedK(4)).token_ids
    drafts = [d for d in proposed if len(d)]
    assert 0 < len(drafts) < len(proposed)  # some rounds had nothing to draft
    assert [(a.k, a.width) for a in asks] == [(d.depth, len(d)) for d in drafts]  # one ask per draft, as it is
    assert len({a.k for a in asks}) > 1  # not every draft is k = 4 deep: the ask follows the draft


@pytest.mark.parametrize("mode", ["never", "always", "auto"])
def test_seeded_sampling_gives_plain_decodes_tokens_in_every_mode(tiny, mode):
    """A seeded sampled request gets plain decode()'s tokens beside others, whatever its rounds drafted and were
    granted (`sampling.Draws`: the target draws each position from that position's uniform)."""
    model, tok = tiny
    from specdec.sampling import SamplingParams

    requests = [Request(max_new_tokens=20, sampling=SamplingParams(temperature=0.9, top_p=0.95, seed=s)) for s in range(4)]
    ids = [tok.encode(p, chat=False) for p in PROMPTS[:4]]
    refs = [list(decode(model, tok, i, r))[-1].result for i, r in zip(ids, requests)]
    from specdec.drafters.recycling import Recycling

    engine = Engine(model, tok, budget=6, speculation=mode, max_batch=3, drafters={"recycling": Recycling(nodes=4).fresh})
    jobs = [Job(i, r, method=("prompt-lookup", "recycling")[n % 2]) for n, (i, r) in enumerate(zip(ids, requests))]
    events = run_engine(engine, jobs + [Job(ids[0], Request(max_new_tokens=9))])
    for job, ref in zip(jobs, refs):
        assert [t for e in events[job.id] for t in e.tokens] == ref.token_ids
    drafted = sum(d for d, _ in engine.metrics.totals.values())
    assert (drafted > 0) == (mode == "always") or mode == "auto"


def test_cancel_frees_the_slot_at_the_next_step(tiny):
    model, tok = tiny
    ids = tok.encode(PROMPTS[1], chat=False)
    engine = Engine(model, tok, budget=6, max_batch=1)
    got = {"a": [], "b": [], "c": []}
    a, b, c = (Job(ids, Request(max_new_tokens=40), on_event=got[n].append) for n in "abc")
    for j in (a, b, c):
        engine.submit(j)
    engine.step()
    engine.step()
    assert [s.job for s in engine.running] == [a] and len(engine.waiting) == 2
    a.cancel()
    b.cancel()  # still waiting: dropped too
    engine.step()
    assert [s.job for s in engine.running] == [c]
    assert got["a"][-1].finish_reason == "cancelled" and got["b"][-1].finish_reason == "cancelled"
    while engine.busy:
        engine.step()
    assert got["c"][-1].finish_reason in ("stop", "length")
    assert sum(len(e.tokens) for e in got["c"]) == reference(model, tok, ids, 40).new_tokens


def test_bad_jobs_are_refused(tiny):
    model, tok = tiny
    engine = Engine(model, tok, budget=6)
    for job, msg in [(Job([], Request()), "empty"), (Job([5] * 200, Request(max_new_tokens=100)), "context"),
                     (Job([5], Request(), method="draft"), "method"), (Job([5], Request(), priority="vip"), "priority"),
                     (Job([5], Request(), k=-1), "k")]:
        with pytest.raises(SpecdecError, match=msg):
            engine.submit(job)
    with pytest.raises(SpecdecError, match="speculation"):
        Engine(model, tok, budget=6, speculation="sometimes")


def test_a_failing_step_ends_its_requests_with_an_error(tiny):
    model, tok = tiny
    engine = Engine(model, tok, budget=6)
    got = []
    engine.submit(Job(tok.encode("abc", chat=False), Request(max_new_tokens=5), on_event=got.append))
    engine.step()
    engine.model = None  # the next forward fails
    engine.step()
    assert got[-1].finish_reason == "error" and "Error" in got[-1].error and not engine.busy


def test_a_failing_listener_cancels_only_its_own_job(tiny):
    model, tok = tiny
    ids = tok.encode(PROMPTS[1], chat=False)
    engine = Engine(model, tok, budget=6)
    got = []

    def broken(event):
        raise RuntimeError("client gone")

    bad = Job(ids, Request(max_new_tokens=20), on_event=broken)
    engine.submit(bad)
    engine.submit(Job(ids, Request(max_new_tokens=20), on_event=got.append))
    while engine.busy:
        engine.step()
    assert bad.cancelled and [t for e in got for t in e.tokens] == reference(model, tok, ids, 20).token_ids


def test_a_job_that_cannot_start_fails_alone(tiny):
    model, tok = tiny
    engine = Engine(model, tok, budget=6)
    plain = engine.new_drafter

    def new_drafter(method):
        if method == "prompt-lookup":
            raise MemoryError("no room")
        return plain(method)

    engine.new_drafter = new_drafter
    a, b = [], []
    ids = tok.encode("abc", chat=False)
    engine.submit(Job(ids, Request(max_new_tokens=5), method="prompt-lookup", on_event=a.append))
    engine.submit(Job(ids, Request(max_new_tokens=5), on_event=b.append))
    while engine.busy:
        engine.step()
    assert a[-1].finish_reason == "error" and "MemoryError: no room" in a[-1].error
    assert b[-1].finish_reason in ("stop", "length")


def test_free_slots_go_to_interactive_jobs_first(tiny):
    model, tok = tiny
    engine = Engine(model, tok, budget=6, max_batch=1)
    ids = tok.encode("abc", chat=False)
    jobs = [Job(ids, Request(max_new_tokens=3), priority=p) for p in ("batch", "batch", "interactive", "batch")]
    engine.submit(jobs[0])
    engine.step()  # the first batch job takes the slot; the others arrive while it runs
    for j in jobs[1:]:
        engine.submit(j)
    started = [jobs[0]]
    while engine.busy:
        engine.step()
        started += [s.job for s in engine.running if s.job not in started]
    assert started == [jobs[0], jobs[2], jobs[1], jobs[3]]


def test_new_requests_start_from_the_servers_realized_alpha(tiny):
    """Adaptive k's prior for a new request is the alpha the server realized for its drafter and class: with
    alpha 0.1 measured, a fresh request predicts k = 0 (plain) instead of drafting on an optimistic 0.6."""
    model, tok = tiny
    engine = Engine(model, tok, budget=6, cost=CostCurve({1: 1.0, 2: 1.17, 4: 1.4, 8: 1.78}))  # SmolLM2 q4's probe
    job = Job(tok.encode("abc", chat=False), Request(max_new_tokens=3), method="prompt-lookup")
    fresh = engine.new_policy(job, PromptLookup())
    assert fresh.prior_alpha == 0.6 and fresh.choose() > 0  # nothing realized yet: optimistic
    engine.metrics.acceptance("prompt-lookup", "interactive", 20, 2)
    assert engine.new_policy(job, PromptLookup()).prior_alpha == 0.6  # too little drafted to trust
    engine.metrics.acceptance("prompt-lookup", "interactive", 80, 8)
    policy = engine.new_policy(job, PromptLookup())
    assert policy.prior_alpha == pytest.approx(0.1) and policy.choose() == 0
    assert engine.new_policy(Job(job.prompt_ids, job.request, method="prompt-lookup", priority="batch"),
                             PromptLookup()).prior_alpha == 0.6  # per class


# --- the scheduler -----------------------------------------------------------------------------------

def test_lesson_allocation_b120():
    """Ch. 7: budget 156, B = 120 -> 36 units; ten interactive sessions asking k = 4 (5 units each):
    seven get k = 4 (35 units), the other three and the batch jobs get k = 0."""
    asks = [Ask(f"chat-{i}", 4, "interactive", tokens=2.77) for i in range(10)]
    asks += [Ask(f"job-{i}", 4, "batch", tokens=4.5) for i in range(5)]  # a larger gain does not jump the class
    got = grant(asks, batch=120, budget=156)
    assert [got[f"chat-{i}"] for i in range(10)] == [4] * 7 + [0] * 3
    assert all(got[f"job-{i}"] == 0 for i in range(5))
    assert 120 + sum(k + 1 for k in got.values() if k) == 155


def test_priorities_gain_and_modes():
    asks = [Ask("a", 4, "interactive", 2.0), Ask("b", 4, "interactive", 3.5), Ask("c", 2, "batch", 2.5)]
    assert grant(asks, batch=3, budget=10) == {"a": 0, "b": 4, "c": 0}  # 7 units: b (larger gain), c does not fit
    assert grant(asks, batch=3, budget=14) == {"a": 4, "b": 4, "c": 0}
    assert grant(asks, batch=3, budget=17) == {"a": 4, "b": 4, "c": 2}
    assert grant(asks, batch=2, prefill=10, budget=12) == {"a": 0, "b": 0, "c": 0}  # prefill fills the room too
    assert grant(asks, batch=8, budget=4) == {"a": 0, "b": 0, "c": 0}  # past the budget: nobody speculates
    assert grant(asks, batch=8, budget=4, mode="always") == {"a": 4, "b": 4, "c": 2}
    assert grant(asks, batch=1, budget=100, mode="never") == {"a": 0, "b": 0, "c": 0}
    # an ask longer than the whole headroom is shortened to fit it (a CPU's budget of 3 positions)
    assert grant([Ask("a", 4, tokens=3.0)], batch=1, budget=3) == {"a": 1}
    assert grant([Ask("a", 4, tokens=3.0), Ask("b", 4, tokens=3.0)], batch=2, budget=3) == {"a": 0, "b": 0}
    # a tree (recycling's 3 nodes at depth 2) spends its positions, whole or not at all
    tree = Ask("t", 2, tokens=2.0, positions=3)
    assert grant([tree], batch=1, budget=5) == {"t": 2} and grant([tree], batch=1, budget=4) == {"t": 0}
    # the chain's gain per unit (1/3) beats the tree's (1/4): it goes first, and the tree's 4 units no longer fit
    assert grant([tree, Ask("c", 2, tokens=2.0)], batch=2, budget=8) == {"t": 0, "c": 2}
    with pytest.raises(ValueError, match="priority"):
        grant([Ask("a", 1, "urgent")], 1, budget=10)
    with pytest.raises(ValueError, match="budget or a cost curve"):
        grant([Ask("a", 1)], 1)


def test_measured_curve_grants_while_throughput_rises():
    """The docstring's example on a CPU-like curve (Qwen2.5-Coder-1.5B bf16, BENCHMARKS.md's probe):
    speculation pays alone and beside a few requests, and stops where the curve turns compute-bound."""
    from specdec.adaptive import CostCurve
    from specdec.serving.scheduler import extend, line_of

    cpu = extend(CostCurve({1: 1.0, 2: 1.05, 3: 1.04, 4: 1.16, 6: 1.43, 8: 1.54, 16: 2.52, 64: 7.64}))
    assert line_of(cpu) == 3 and cpu(128) == pytest.approx(15.28)
    e4 = 1 + 0.8 + 0.8 ** 2 + 0.8 ** 3 + 0.8 ** 4  # 3.36
    assert grant([Ask("a", 4, tokens=e4)], batch=1, cost=cpu) == {"a": 4}
    assert grant([Ask("a", 4, tokens=1.2)], batch=1, cost=cpu) == {"a": 0}  # 1.2 tokens for 1.3 steps
    asks = [Ask(str(i), 4, tokens=e4) for i in range(4)]
    # B = 4: one grant clears the hurdle; the next would add 2.36 tokens for 0.49 more time, 4.8 a step against
    # 6.36 / 1.54 = 4.1: 16% better, under the 20% hurdle. Without it every grant still raises the throughput.
    assert list(grant(asks, batch=4, cost=cpu).values()) == [4, 0, 0, 0]
    assert all(grant(asks, batch=4, cost=cpu, hurdle=0.0).values())
    assert not any(grant(asks, batch=8, cost=cpu).values())  # B = 8: 10.4 tokens / 2.03 < 8 / 1.54
    assert not any(grant(asks * 4, batch=32, cost=cpu).values())  # far past the line: nobody
    # B = 6: room for one more grant; the interactive request gets it, although the batch job asked first
    both = [Ask("job", 4, "batch", tokens=e4), Ask("chat", 4, "interactive", tokens=e4)]
    assert grant(both, batch=6, cost=cpu) == {"job": 0, "chat": 4}
    # the job's 2.36 tokens for 0.49 more time beat the step's 8.36 / 1.785, but by 3%, not the hurdle's 20%
    assert grant(both, batch=6, cost=cpu, hurdle=0.0) == {"job": 4, "chat": 4}
    slow = [Ask("a", 4, tokens=e4, tau=0.6)]  # 3.36 tokens in 1.3 + 4 x 0.6 steps: slower than plain
    assert grant(slow, batch=1, cost=cpu) == {"a": 0}
    # a tree is priced by its positions: 1.5 tokens at depth 1 pay as a chain of 1 (1.05), not as 6 nodes (1.54)
    assert grant([Ask("a", 1, tokens=1.5)], batch=1, cost=cpu) == {"a": 1}
    assert grant([Ask("a", 1, tokens=1.5, positions=7)], batch=1, cost=cpu) == {"a": 0}


def test_never_over_budget_property():
    """Chains and trees (a tree spends its positions, not its depth) never spend past the budget line, each ask
    gets its full reachable k or none, and no interactive ask is refused for room a batch job took."""
    rng = random.Random(0)
    for _ in range(2000):
        budget = rng.randint(1, 200)
        occupancy = rng.randint(0, 220)
        asks = []
        for i in range(rng.randint(0, 40)):
            k = rng.randint(1, 10)
            tree = rng.random() < 0.3
            asks.append(Ask(str(i), k, rng.choice(["interactive", "batch"]), 1 + 3 * rng.random(),
                            positions=k + rng.randint(1, 5) if tree else None))
        got = grant(asks, occupancy, budget=budget)
        units = {a.name: (a.width if a.width != a.k else got[a.name]) if got[a.name] else 0 for a in asks}
        spent = occupancy + sum(theory.speculation_cost(u) for u in units.values() if u)
        cap = max(budget - occupancy - 1, 0)  # the longest draft that fits the headroom at all
        asked = {a.name: min(a.k, cap) if a.width == a.k else (a.k if a.width <= cap else 0) for a in asks}
        asked_units = {a.name: asked[a.name] if a.width == a.k else (a.width if asked[a.name] else 0) for a in asks}
        assert all(got[a.name] in (0, asked[a.name]) for a in asks)  # full (reachable) k or none
        if occupancy >= budget:
            assert not any(got.values())
        else:
            assert spent <= budget
        # no interactive request was refused while a batch job speculated in the room it would have used
        refused = [a for a in asks if a.priority == "interactive" and asked[a.name] and not got[a.name]]
        batch_spent = sum(theory.speculation_cost(units[a.name]) for a in asks if a.priority == "batch" and units[a.name])
        assert all(theory.speculation_cost(asked_units[a.name]) > budget - spent + batch_spent for a in refused)


def test_exact_models_cut_prompts_anywhere_with_the_same_output(model, tmp_path, monkeypatch):  # noqa: F811
    """On an exact model a prompt's pieces are cut to fit `prefill_chunk` (a long prompt never stalls the
    decoding requests for more than that many positions), and every request still equals its decode()."""
    from specdec.serving import engine as engine_module
    from tests.tiny import save_tiny_tokenizer

    save_tiny_tokenizer(tmp_path)
    tok = Tokenizer(tmp_path)
    ids = [tok.encode(p, chat=False) for p in PROMPTS]
    refs = [reference(model, tok, i, 20, PromptLookup(), AdaptiveK()) for i in ids]
    prefilled = []  # prompt positions per step
    real = engine_module.packed_forward

    def spy(m, segments, layers=()):
        prefilled.append(sum(len(s) for s in segments if not s.logits))
        return real(m, segments, layers)
    monkeypatch.setattr(engine_module, "packed_forward", spy)
    engine = Engine(model, tok, budget=6, speculation="always", max_batch=3, prefill_chunk=5)
    assert engine.cut_anywhere
    jobs = [Job(i, Request(max_new_tokens=20), method="prompt-lookup") for i in ids]
    events = run_engine(engine, jobs)
    for job, ref in zip(jobs, refs):
        assert [t for e in events[job.id] for t in e.tokens] == ref.token_ids
    assert max(prefilled) == 5 and sum(prefilled) == sum(len(i) - 1 for i in ids)


def test_prefill_room_from_the_cost_curve():
    """Beside B decoding requests a step prefills at most the positions that keep it within `prefill_stall`
    decode-only steps (the docstring's example: SmolLM2 q4's curve, B = 4, stall 2 -> 12); the whole chunk
    when nobody decodes or the stall is off."""
    curve = CostCurve({1: 1.0, 4: 1.23, 8: 1.5, 16: 2.4, 64: 8.2})

    class Exact:  # only what `prefill_room` reads
        row_exact = True

    def room(batch, stall=2.0, chunk=128):
        engine = Engine.__new__(Engine)
        engine.curve, engine.prefill_chunk, engine.prefill_stall, engine.cut_anywhere = curve, chunk, stall, True
        return engine.prefill_room(batch)

    assert room(4) == 12 and curve(16) <= 2 * curve(4) < curve(17)
    assert room(0) == 128 and room(4, stall=0) == 128 and room(4, chunk=8) == 8
    assert room(1, stall=1.0) == 1  # at least one position: a prompt always moves
    with pytest.raises(SpecdecError):
        Engine(Exact(), None, budget=6, prefill_stall=0.5)


def test_prefill_beside_decoding_keeps_within_the_stall_with_the_same_output(model, tmp_path, monkeypatch):  # noqa: F811
    """With requests decoding, a step's prompt positions stay within `prefill_room` (cut anywhere: same bits),
    less the positions of the step's drafts when it speculates (the stall bounds the whole step; at least one
    prompt position still goes in); with the stall off the whole chunk goes in. Every request still equals its
    decode()."""
    from specdec.serving import engine as engine_module
    from tests.tiny import save_tiny_tokenizer

    save_tiny_tokenizer(tmp_path)
    tok = Tokenizer(tmp_path)
    ids = [tok.encode(p, chat=False) for p in PROMPTS]
    refs = [reference(model, tok, i, 20, PromptLookup(), AdaptiveK()) for i in ids]
    real = engine_module.packed_forward
    curve = CostCurve({1: 1.0, 2: 1.1, 4: 1.3, 8: 1.8, 64: 12.0})
    for speculation, stall in (("never", 1.3), ("always", 1.6), ("never", 0)):
        steps = []  # (decoding requests, prompt positions, draft positions) per step

        def spy(m, segments, layers=()):
            steps.append((sum(1 for s in segments if s.logits), sum(len(s) for s in segments if not s.logits),
                          sum(len(s) - 1 for s in segments if s.logits)))
            return real(m, segments, layers)
        monkeypatch.setattr(engine_module, "packed_forward", spy)
        engine = Engine(model, tok, budget=6, cost=curve, speculation=speculation, max_batch=3, prefill_chunk=64,
                        prefill_stall=stall)
        assert engine.cut_anywhere
        jobs = [Job(i, Request(max_new_tokens=20), method="prompt-lookup") for i in ids]
        events = run_engine(engine, jobs)
        for job, ref in zip(jobs, refs):
            assert [t for e in events[job.id] for t in e.tokens] == ref.token_ids
        beside = [p for b, p, _ in steps if b and p]
        assert beside and sum(p for _, p, _ in steps) == sum(len(i) - 1 for i in ids)
        if stall:
            assert all(p + d <= max(engine.prefill_room(b), d + 1) for b, p, d in steps if b and p)
            assert any(p + d == engine.prefill_room(b) for b, p, d in steps if b and p)  # the room, not less
            assert max(beside) <= engine.prefill_room(1)
        else:
            assert max(beside) > 3  # the 70-token prompt goes in whole beside the others
        if speculation == "always":  # drafts and prompt pieces shared steps, the drafts first
            assert any(p and d for _, p, d in steps)


def test_the_steps_overhead_makes_a_draft_relatively_cheaper():
    """A step's fixed overhead (bookkeeping, verification) does not grow with k: counted in, a borderline ask
    pays. B = 4, cost 1 + 0.05 (n - 1): alpha 0.15 at k = 1 gives 4.15 / 1.20 < 4 / 1.15 alone, but
    4.15 / 2.20 > 4 / 2.15 beside an overhead of one forward."""
    cost = lambda n: 1 + 0.05 * (n - 1)  # noqa: E731
    ask = [Ask("a", 1, tokens=1.15)]
    assert grant(ask, 4, cost=cost) == {"a": 0}
    assert grant(ask, 4, cost=cost, overhead=1.0) == {"a": 1}


def test_a_chain_that_does_not_pay_gets_the_longest_prefix_that_does():
    """The docstring's example: two SmolLM2 q4 requests, alpha 0.3. k = 2 adds 0.39 tokens for 0.24 of a step,
    k = 1 adds 0.3 for 0.09: the chain gets k = 1 where all-or-none gave it nothing. A tree, a fixed k (no
    `shorter`) and the budget line are as before; a prefix is granted only where it pays."""
    cost = CostCurve({1: 1.0, 2: 0.99, 3: 1.08, 4: 1.23, 8: 1.5})
    e = (1.0, 1.3, 1.39)
    assert grant([Ask("a", 2, tokens=e[2])], 2, cost=cost) == {"a": 0}  # all or none: nothing
    assert grant([Ask("a", 2, tokens=e[2], shorter=e)], 2, cost=cost) == {"a": 1}
    assert grant([Ask("a", 2, tokens=e[2], positions=3)], 2, cost=cost) == {"a": 0}  # a tree: whole or not
    assert grant([Ask("a", 2, tokens=1.05, shorter=(1.0, 1.04, 1.05))], 2, cost=cost) == {"a": 0}  # none pays
    rich = (1.0, 1.9, 2.7)
    assert grant([Ask("a", 2, tokens=2.7, shorter=rich)], 2, cost=cost) == {"a": 2}  # the whole chain pays


def test_mode_picker_follows_a_proven_faster_arm_only():
    """The model's grants run first; one step in `explore` tries the others in turn against the current arm's
    recent rate. An arm proven faster (by more than the margin, two standard errors to spare) takes over; a
    noisy tie or a small edge never does; the machine's drift (every rate scaled alike) changes nothing;
    buckets are kept apart."""
    import random

    from specdec.serving.scheduler import ARMS, ModePicker

    rng = random.Random(0)
    rate = {"model": 290.0, "never": 320.0, "always": 297.0}
    p = ModePicker(explore=8, margin=0.02)
    speed = [1.0]

    def run(batch, steps, noise=0.15, drift=0.0):
        picks = []
        for _ in range(steps):
            arm = p.choose(batch)
            picks.append(arm)
            speed[0] *= 1 + drift
            tokens = batch * rng.uniform(1 - noise, 1 + noise)
            p.record(batch, arm, tokens=tokens, seconds=batch / (rate[arm] * speed[0]))
        return picks

    picks = run(8, 64)
    assert picks[:7] == ["model"] * 7 and set(picks[7::8]) == {"never", "always"}  # exploration, in turn
    picks = run(8, 2000)
    assert picks[-100:].count("never") > 80  # never proved 10% faster: it runs, the others are explored
    assert [p.bucket(b) for b in (1, 2, 3, 4, 5, 8, 9, 16)] == [1, 2, 4, 4, 8, 8, 16, 16]
    assert p.choose(7) != "model"  # 5-8 share a bucket
    assert p.choose(2) == "model"  # a smaller bucket starts over (a larger one starts on never: the next test)
    rate.update(model=300.0, never=270.0, always=303.0)  # a 1% edge: nobody takes over from the model
    picks = run(2, 3000, drift=0.0002)  # while the machine speeds up by 80%
    assert picks[-100:].count("model") > 80
    rate["always"] = 400.0  # the load changed: exploration sees it and the choice follows
    picks = run(2, 1000)
    assert picks[-100:].count("always") > 80
    assert set(ARMS) == {"model", "never", "always"}


# --- EAGLE in the server ---------------------------------------------------------------------------------

@pytest.mark.parametrize("tree", ["chain", "dynamic"])
def test_engine_eagle_drafts_as_decode_does(tiny, tiny_folder, tree):
    """EAGLE through the engine: each request's head cache is fed the target's features from its prefill
    pieces (cut at 5 positions here) and from every verify pass (root and accepted path), so with a fixed k
    it proposes exactly the drafts single-request decode() proposes, and its greedy output equals plain
    decoding's. A feature row off by one position, or a piece's rows left out, changes the drafts."""
    from specdec.drafters.eagle import Eagle
    from tests.test_eagle import random_head

    model, tok = tiny
    template = Eagle(random_head(model, tiny_folder), model.embed, tree=tree, nodes=6)
    logs = []

    def recording():
        d, log = template.fresh(), []
        logs.append(log)
        propose = d.propose
        d.propose = lambda ctx, k: log.append(propose(ctx, k)) or log[-1]
        return d

    ids = [tok.encode(p, chat=False) for p in PROMPTS]
    refs = []
    for i in ids:
        d = recording()
        refs.append((reference(model, tok, i, 24, d, FixedK(3)), logs.pop()))
    engine = Engine(model, tok, budget=100, speculation="always", max_batch=3, prefill_chunk=5,
                    drafters={"eagle": recording})
    assert engine.methods == ("plain", "prompt-lookup", "eagle")  # recycling: only when the server offers it
    jobs = [Job(i, Request(max_new_tokens=24), method="eagle", k=3) for i in ids]
    events = run_engine(engine, jobs)
    assert len(logs) == len(jobs)  # one drafter per request, in admission order
    for job, (ref, ref_drafts), drafts in zip(jobs, refs, logs):
        assert [t for e in events[job.id] for t in e.tokens] == ref.token_ids == plain(model, tok, job)
        assert [(d.tokens.tolist(), d.parents.tolist()) for d in drafts] == \
               [(d.tokens.tolist(), d.parents.tolist()) for d in ref_drafts]
    assert sum(len(d) for log in logs for d in log) > 0
    engine.sources.pop("eagle")  # a server without a head refuses the method with a clear error
    with pytest.raises(SpecdecError, match="no EAGLE head"):
        engine.submit(Job(ids[0], Request(max_new_tokens=4), method="eagle"))


def plain(model, tok, job):
    return reference(model, tok, job.prompt_ids, job.request.max_new_tokens).token_ids


def test_engine_recycling_shares_one_table_and_keeps_greedy_output(tiny):
    """Token recycling in the server: every request drafts trees from one table (a drafter per request,
    `Recycling.fresh`), priced by their positions, and each request's greedy output equals plain decoding's."""
    from specdec.drafters.recycling import Recycling

    model, tok = tiny
    shared = Recycling(nodes=4)
    curve = CostCurve({1: 1.0, 4: 1.02, 8: 1.1, 64: 8.0})  # cheap wide forwards: trees get granted
    engine = Engine(model, tok, cost=curve, speculation="auto", max_batch=3, drafters={"recycling": shared.fresh})
    assert engine.methods == ("plain", "prompt-lookup", "recycling")
    ids = [tok.encode(p, chat=False) for p in PROMPTS] * 2  # the second pass finds the first pass's rows
    jobs = [Job(i, Request(max_new_tokens=24), method="recycling") for i in ids]
    events = run_engine(engine, jobs)
    for job in jobs:
        assert [t for e in events[job.id] for t in e.tokens] == plain(model, tok, job)
    drafted, accepted = engine.metrics.totals["recycling", "interactive"]
    assert len(shared.table) > 0 and accepted > 0 and drafted > accepted


def picked(picker, batch, steps, rate, rng):
    """The arms a picker runs for `steps` steps of `batch` requests, each arm at its `rate` tokens/s, +-15%."""
    picks = []
    for _ in range(steps):
        arm = picker.choose(batch)
        picks.append(arm)
        picker.record(batch, arm, tokens=batch * rng.uniform(0.85, 1.15), seconds=batch / rate[arm])
    return picks


def test_mode_picker_carries_a_proof_to_larger_and_smaller_batches():
    """Never proven at 8 requests: the 9-16 bucket, on the model's grants, switches without a proof of its own,
    and a bucket first seen later (17-32) starts on never. Speculation proven against never at 4 sends the
    smaller buckets on never back to the model. Each bucket still explores and its own proof wins."""
    p, rng = ModePicker(explore=8, margin=0.02), random.Random(1)
    run = lambda batch, steps, rate: picked(p, batch, steps, rate, rng)  # noqa: E731

    losing = {"model": 280.0, "never": 340.0, "always": 260.0}
    run(16, 20, losing)  # a few steps at 16: far from a proof
    assert p.current[16] == "model"
    assert run(8, 2000, losing)[-100:].count("never") > 80
    assert p.current[16] == "never" and p.choose(32) == "never"  # carried up, no steps of their own
    assert p.choose(2) == "model"  # not carried down
    paying = {"model": 150.0, "never": 100.0, "always": 140.0}
    run(2, 1000, losing)  # bucket 2 proves never on its own...
    assert p.current[2] == "never"
    assert run(4, 4000, paying)[-100:].count("model") > 80  # ...and 4's proof for the model sends 2 back
    assert p.current[2] == "model" and p.current[16] == "never"
    assert run(16, 3000, paying)[-100:].count("model") > 80  # 16's own evidence overrides what was carried


def test_mode_picker_starts_on_never_where_the_batch_fills_the_budget_line(tiny):
    """The lesson's prior: from B = the budget line on, every drafted position is past it, so a bucket whose
    smallest batch reaches the line starts on never (exploring the model's grants, which take over only with a
    proof); below it, and always at one request, on the model's grants. An engine gives its picker the line of
    its cost curve."""
    p, rng = ModePicker(explore=8, margin=0.02, line=3), random.Random(6)
    assert [p.choose(b) for b in (1, 2, 3, 4, 8, 16, 40)] == ["model", "model"] + ["never"] * 5
    assert [ModePicker(line=n).choose(b) for n, b in ((1, 1), (1, 2), (4, 3), (4, 5), (9, 8), (9, 9))] == \
        ["model", "never", "model", "never", "model", "never"]
    assert ModePicker().choose(40) == "model"  # no line: every bucket starts on the model's grants
    paying = {"model": 150.0, "never": 100.0, "always": 140.0}
    picks = picked(ModePicker(explore=8, margin=0.02, line=3), 4, 3000, paying, rng)
    # explores the model's grants only, one step in 64 (the settled rate) until they prove themselves
    assert set(picks[:63]) == {"never"} and picks[63::64][:4] == ["model"] * 4
    assert picks[-100:].count("model") > 80  # and they prove themselves
    model, tok = tiny
    engine = Engine(model, tok, cost=CostCurve({1: 1.0, 2: 1.05, 3: 1.1, 4: 1.3, 8: 2.0}), speculation="auto")
    assert engine.line == 3 and engine.picker.choose(2) == "model" and engine.picker.choose(3) == "never"


def test_mode_picker_gives_a_tie_to_never_and_does_not_flap():
    """At equal throughput never's steps are shorter (a lower tail of inter-token latency), so never takes over
    from the model's grants on a proven tie (within the margin), and a bucket first seen later starts on it;
    going back to speculation takes a proof of more than the margin, which a tie or a 1% edge never gives. A
    10% deficit is no tie. Running never, a bucket explores only the model's grants, never every ask."""
    p, rng = ModePicker(explore=8, margin=0.02), random.Random(4)
    run = lambda batch, steps, rate: picked(p, batch, steps, rate, rng)  # noqa: E731

    assert run(1, 3000, {"model": 300.0, "never": 270.0, "always": 290.0})[-100:].count("model") > 80
    tie = {"model": 300.0, "never": 306.0, "always": 280.0}  # never 2% ahead: short of a proof (5.9% here)
    steps = next(i for i in range(1, 3001) if run(16, 1, tie) and p.current[16] == "never")
    assert steps < 3000 and p.choose(32) == "never"
    edge = {"model": 303.0, "never": 300.0, "always": 280.0}  # the model 1% ahead of never: never stays
    picks = run(16, 4000, edge)
    assert picks[-100:].count("never") > 80 and p.current[16] == "never"
    assert "always" not in picks  # never explores only its neighbour, the model's grants (`EXPLORES`)
    assert p.current[1] == "model"


def test_mode_picker_judges_bursty_tokens_by_their_mean():
    """A speculating step's tokens come in bursts (nothing accepted, or the whole draft), so its tokens per second
    vary far more than a plain step's. Every ask granted (1 or 6 tokens, 60/40, in 1.5 steps' time: 2.0 a
    step) beats the model's grants (1 or 3, 75/25, 1.5 a step) by a third, and the picker finds it; a mean of
    log rates would measure it 0.91x (its mean log of tokens is 0.72 where the log of its mean is 1.10) and
    never switch. A never step (1 token in 0.9 steps' time: 1.11 a step) is measured 0.74x the model's grants."""
    p, rng = ModePicker(explore=8, margin=0.02), random.Random(5)
    bursts = {"model": ((1, 3), 0.75, 1.0), "always": ((1, 6), 0.6, 1.5), "never": ((1, 1), 1.0, 0.9)}
    for _ in range(1500):
        arm = p.choose(1)
        (low, high), chance, seconds = bursts[arm]
        p.record(1, arm, tokens=low if rng.random() < chance else high, seconds=seconds)
        if p.current[1] == "model":
            current, ratios = p.estimates(1)
    assert p.current[1] == "always"
    assert ratios["never"][0] == pytest.approx(1.11 / 1.5, abs=0.05)


def test_mode_picker_explores_less_once_settled_and_again_after_a_switch():
    """Exploring a losing arm costs a slow step. Once both other arms have filled their windows without a proof,
    the bucket explores half as often, down to one step in 64; a load change is still found, and the switch
    brings exploration back to one step in 8."""
    p, rng = ModePicker(explore=8, window=64), random.Random(2)
    rate = {"model": 300.0, "never": 240.0, "always": 250.0}
    run = lambda steps: picked(p, 4, steps, rate, rng)  # noqa: E731

    picks = run(1000)
    assert 100 <= len([a for a in picks if a != "model"]) <= 130  # one step in 8 explores
    picks = run(7000)  # windows of 128 samples at 1 in 8, 16, 32: 1024 + 2048 + 4096 steps
    assert p.every[4] == 64 and len([a for a in picks[-640:] if a != "model"]) <= 10
    rate["always"] = 450.0  # the load changed: found within ~1536 steps of 12 samples at 1 in 128 each
    steps = next(i for i in range(1, 4001) if run(1) and p.current[4] == "always")
    assert steps < 2500 and p.every.get(4, 8) == 8
    assert run(500)[-100:].count("always") > 80


def test_mode_picker_explores_only_on_steps_without_a_prompt_piece():
    """A step that prefills beside decoding runs the current arm and does not count toward exploring: its sample
    is left out, and an explored arm would lengthen one of the longest steps."""
    p = ModePicker(explore=4)
    p.record(2, p.choose(2), 2, 0.01)  # the current arm's reference
    assert {p.choose(2, prefill=True) for _ in range(100)} == {"model"} and p.steps[2] == 1
    assert [p.choose(2) for _ in range(4)] == ["model", "model", "always", "model"]  # counted step 4 explores


def test_mode_picker_estimates_each_arm_against_the_running_one():
    """`estimates` gives, per batch bucket, what the server measured: each other arm's tokens/s relative to the
    running arm, from steps paired in time (the machine's drift cancels). It keeps a settled bucket's last full
    window while fresh samples come in, forgets everything at a switch, and reaches /metrics per bucket."""
    p, rng = ModePicker(explore=8, window=64), random.Random(3)
    rate = {"model": 300.0, "never": 270.0, "always": 240.0}
    assert p.estimates(4) == ("model", {})  # nothing measured yet
    picked(p, 4, 1200, rate, rng)  # settled: both windows filled without a proof, then fresh samples
    current, ratios = p.estimates(3)  # 3 and 4 share a bucket
    assert current == "model" and set(ratios) == {"never", "always"}
    assert ratios["never"][0] == pytest.approx(0.9, abs=0.04) and ratios["always"][0] == pytest.approx(0.8, abs=0.04)
    assert all(n >= p.least for _, n in ratios.values())
    assert p.estimates(8) == ("model", {}) and [p.span(b) for b in (1, 2, 3, 8, 9)] == ["1", "2", "3-4", "5-8", "9-16"]
    metrics = Metrics()
    metrics.arm_ratios(p.span(4), current, ratios)
    text = metrics.render().decode()
    assert 'specdec_auto_arm_ratio{arm="model",batch="3-4"} 1.0' in text
    assert f'specdec_auto_arm_ratio{{arm="never",batch="3-4"}} {ratios["never"][0]}' in text
    rate["always"] = 500.0  # always takes over: the old figures were relative to the model, so they go
    picked(p, 4, 600, rate, rng)
    assert p.current[4] == "always" and all(n < 64 for _, n in p.estimates(4)[1].values())
    current, ratios = p.estimates(4)
    metrics.arm_ratios(p.span(4), current, ratios)
    text = metrics.render().decode()
    assert 'specdec_auto_arm_ratio{arm="always",batch="3-4"} 1.0' in text
    assert ('arm="model",batch="3-4"' in text) == ("model" in ratios)


def test_a_refused_request_probes_so_its_alphas_can_move():
    """The model's grants refuse an ask whose estimate does not clear the bar, and a request that does not draft
    never updates that estimate. After `explore_every` refusals in a row its next ask is a probe, granted
    beside the others; a drafted round starts the count again."""
    cost = lambda n: 1 + 0.1 * (n - 1)  # noqa: E731
    policy = AdaptiveK(cost=CostCurve({1: 1.0, 2: 1.02, 4: 1.06, 8: 1.14}), prior_alpha=0.3, explore_every=8)
    low = lambda: Ask("a", policy.choose(), tokens=1.1, probe=policy.probing)  # noqa: E731
    for _ in range(8):
        ask = low()
        assert ask.k > 0 and not ask.probe and grant([ask], 4, cost=cost) == {"a": 0}
        policy.refused()
    ask = low()
    assert ask.probe and grant([ask], 4, cost=cost) == {"a": ask.k}  # the probe is granted
    assert grant([ask], 4, mode="never", cost=cost) == {"a": 0}  # never stays never
    policy.observe(ask.k, 1)
    assert not low().probe and policy.refused_asks == 0


# --- found by mutating batch.py, engine.py, scheduler.py and adaptive.py ---


def test_packed_forward_fills_the_cache_to_its_last_slot(tiny):
    model, _ = tiny
    cache = model.new_cache(4)
    packed_forward(model, [Segment(cache, [5, 6, 7, 8])])
    assert cache.length == 4
    with pytest.raises(ValueError, match="overflow"):
        packed_forward(model, [Segment(model.new_cache(4), [5, 6, 7, 8, 9])])


def test_pieces_count_only_the_new_prompt_positions(tiny):
    model, tok = tiny
    engine = Engine(model, tok, budget=8)
    engine.cut_anywhere = True
    a = SimpleNamespace(decoding=False, prefilled=50, job=SimpleNamespace(prompt_ids=[3] * 100))
    b = SimpleNamespace(decoding=False, prefilled=0, job=SimpleNamespace(prompt_ids=[3] * 30))
    engine.running = [a, b]
    assert engine._pieces(64) == ([(a, 99), (b, 15)], 64)


def _sample_count(metrics, name, **labels):
    return metrics.registry.get_sample_value(name, labels) or 0.0


def test_inter_token_latency_is_split_by_speculating(tiny):
    model, tok = tiny
    engine = Engine(model, tok, budget=100, speculation="never")
    ids = tok.encode(PROMPTS[0], chat=False)
    run_engine(engine, [Job(ids, Request(max_new_tokens=12), method="prompt-lookup", k=4)])
    m = engine.metrics
    assert _sample_count(m, "specdec_inter_token_seconds_count", speculating="false") > 0
    assert _sample_count(m, "specdec_inter_token_seconds_count", speculating="true") == 0


def test_an_adaptive_ask_carries_its_expected_tokens_at_its_k(tiny, monkeypatch):
    from specdec.serving import scheduler
    model, tok = tiny
    engine = Engine(model, tok, budget=100, speculation="auto")
    seen, real = [], scheduler.grant

    def spy(asks, *args, **kw):
        for a in asks:
            policy = next(s.policy for s in engine.running if s.job.id == a.name)
            seen.append((a.tokens, policy.expected_tokens()[a.k]))
        return real(asks, *args, **kw)
    monkeypatch.setattr(scheduler, "grant", spy)
    ids = tok.encode(PROMPTS[0], chat=False)
    run_engine(engine, [Job(ids, Request(max_new_tokens=20), method="prompt-lookup")])
    assert seen and all(t == pytest.approx(e) for t, e in seen)


def test_the_picker_leaves_out_steps_that_prefill(tiny):
    model, tok = tiny
    engine = Engine(model, tok, cost=CostCurve(), speculation="auto", max_batch=2)
    assert engine.picker is not None
    recorded = []
    real = engine.picker.record
    engine.picker.record = lambda *a: recorded.append(a) or real(*a)
    a = Job(tok.encode(PROMPTS[1], chat=False), Request(max_new_tokens=30), method="prompt-lookup")
    engine.submit(a)
    engine.step()
    engine.step()
    assert engine.running[0].decoding
    before = len(recorded)
    engine.submit(Job(tok.encode(PROMPTS[4], chat=False), Request(max_new_tokens=4), method="prompt-lookup"))
    engine.step()  # the new prompt is prefilled beside the decoding request
    assert len(recorded) == before


def test_a_fixed_k_of_zero_is_a_valid_job(tiny):
    model, tok = tiny
    engine = Engine(model, tok, budget=6)
    engine.check(Job([5, 6], Request(max_new_tokens=4), method="prompt-lookup", k=0))
    with pytest.raises(Exception, match="k"):
        engine.check(Job([5, 6], Request(max_new_tokens=4), method="prompt-lookup", k=1001))


def test_the_k_histogram_records_the_grants_not_the_asks(tiny):
    model, tok = tiny
    engine = Engine(model, tok, budget=1, speculation="auto")  # B = 1 fills the line: every ask refused
    ids = tok.encode(PROMPTS[0], chat=False)
    run_engine(engine, [Job(ids, Request(max_new_tokens=12), method="prompt-lookup", k=4)])
    m = engine.metrics
    assert _sample_count(m, "specdec_k_granted_count", priority="interactive") > 0
    assert _sample_count(m, "specdec_k_granted_sum", priority="interactive") == 0


def test_a_chain_is_cut_to_exactly_its_grant(tiny):
    model, tok = tiny
    engine = Engine(model, tok, budget=3, speculation="auto", max_batch=1)  # headroom 2: chains cut to k = 1
    rounds, real = [], engine._verify
    engine._verify = lambda slot, k, draft, *a: rounds.append((k, draft.depth)) or real(slot, k, draft, *a)
    ids = tok.encode(PROMPTS[0], chat=False)
    run_engine(engine, [Job(ids, Request(max_new_tokens=20), method="prompt-lookup", k=4)])
    assert any(k for k, _ in rounds) and all(d == k for k, d in rounds if k)


def test_a_curve_grant_prices_the_steps_prompt_positions():
    from specdec.serving.scheduler import Ask, grant
    cost = CostCurve({1: 1.0, 4: 1.0, 8: 3.0})  # flat to 4 positions, then steep
    ask = [Ask("a", 2, tokens=1.5)]
    assert grant(ask, batch=1, cost=cost) == {"a": 2}
    assert grant(ask, batch=1, prefill=3, cost=cost) == {"a": 0}  # the prompt piece took the cheap positions


def test_a_grant_adds_its_drafting_time_to_the_step():
    from specdec.serving.scheduler import Ask, grant
    asks = [Ask("a", 1, tokens=2.0, tau=0.3), Ask("b", 1, tokens=2.0, tau=0.3)]
    # b: 1 more token against 3 in a step of 1.3 (a's 0.3 drafting included): 1 x 1.3 > 1.2 x 3 x 0.3
    assert grant(asks, batch=2, cost=lambda n: 1.0) == {"a": 1, "b": 1}


def test_a_proof_of_never_leaves_a_larger_bucket_on_always():
    from specdec.serving.scheduler import ModePicker
    p = ModePicker(explore=1, least=4, window=8)
    p.current[16] = "always"
    p.current[2] = "model"
    p.reference[2] = [2.0, 1.0]
    for _ in range(8):
        p.record(2, "never", 4, 1.0)  # never makes twice the model's tokens in the same time
    assert p.current[2] == "never" and p.current[16] == "always"


def test_a_proof_that_speculation_pays_lifts_the_never_line():
    from specdec.serving.scheduler import ModePicker
    p = ModePicker(explore=1, least=4, window=8, line=3)  # buckets 4 and up start on never
    assert p.never_above == 2 and p.choose(16) == "never"
    p.reference[16] = [16.0, 1.0]
    for _ in range(8):
        p.record(16, "model", 32, 1.0)  # the model's grants make twice never's tokens at 9-16 requests
    assert p.current[16] == "model"
    assert p.choose(3) == "model"  # 3-4 requests, first seen now: speculation that pays at 16 pays at 4


def test_a_proven_tie_goes_to_never():
    from specdec.serving.scheduler import ModePicker
    p = ModePicker(least=12, window=64)
    p.current[8] = "model"
    p.reference[8] = [8.0, 1.0]
    for i in range(40):
        p.record(8, "never", 8 + (0.1 if i % 2 else -0.1), 1.0)  # never: exactly the model's rate
    assert p.current[8] == "never"


def test_no_exploring_before_the_current_arm_has_a_rate():
    from specdec.serving.scheduler import ModePicker
    p = ModePicker(explore=1)
    assert [p.choose(2) for _ in range(3)] == ["model"] * 3


def test_a_settled_bucket_explores_at_least_one_step_in_8_x_explore():
    from specdec.serving.scheduler import ModePicker
    p = ModePicker(explore=8, window=64)
    p.current[4], p.reference[4], p.every[4], p.unproven[4] = "model", [4.0, 1.0], 64, 2 * 64 - 1
    p.record(4, "never", 3, 1.0)  # completes another unproven window pair
    assert p.every[4] == 64


def test_never_proven_at_a_larger_bucket_keeps_the_lower_never_line():
    from specdec.serving.scheduler import ModePicker
    p = ModePicker(explore=1, least=4, window=8)
    for b, current in ((2, "model"), (16, "always")):
        p.current[b], p.reference[b] = current, [float(b), 1.0]
    for b in (2, 16):
        for _ in range(8):
            p.record(b, "never", 2 * b, 1.0)  # never proven faster at 2, then at 16
    assert p.never_above == 2 and p.choose(6) == "never"  # 5-8 requests, first seen now


def test_a_granted_round_ends_a_run_of_refusals():
    from specdec.adaptive import AdaptiveK
    p = AdaptiveK()
    for _ in range(p.explore_every - 1):
        p.refused()
    p.observe(2, 1)  # a round that ran: the refusals in a row start again
    p.refused()
    assert p.choose() > 0 and not p.probing


def test_a_starting_cost_is_priced_in_target_steps():
    from types import SimpleNamespace as NS
    from specdec.adaptive import AdaptiveK, choose_k
    drafter = NS(startup=lambda ctx: 10)  # 10 prompt tokens to prefill at 0.01 of a step each: 0.1 steps
    assert choose_k(AdaptiveK(prior_alpha=0.9), drafter, NS(prefill_cost=0.01, remaining=5)) > 0
    assert choose_k(AdaptiveK(prior_alpha=0.9), drafter, NS(prefill_cost=1.0, remaining=5)) == 0


def test_alpha_is_the_prior_weighted_acceptance():
    from specdec.adaptive import AdaptiveK
    p = AdaptiveK(prior_alpha=0.6, prior_weight=2.0)
    p.observe(1, 1)  # one draft position tried and accepted
    assert p.alphas()[0] == pytest.approx((1 + 2 * 0.6) / (1 + 2))
    assert all(a <= 1 for a in p.alphas())


def test_a_stop_inside_an_accepted_block_counts_only_the_kept_tokens(tiny):
    """The engine's tokens a step (the metric, and what auto's picker weighs) are the tokens the stopper kept,
    not the round's: a stop string chosen to end inside a block of accepted drafts cuts that block."""
    model, tok = tiny
    ids = tok.encode(PROMPTS[0], chat=False)

    def run(stop=()):
        engine, blocks = Engine(model, tok, budget=100, speculation="always"), []
        verify = engine._verify
        engine._verify = lambda slot, *a: blocks.append(list(slot.ctx.tokens[len(ids):])) or verify(slot, *a)
        events = run_engine(engine, [Job(ids, Request(max_new_tokens=30, stop=stop), method="prompt-lookup", k=8)])
        return engine, blocks, next(iter(events.values()))[-1]

    _, before, last = run()
    generated = before[-1] + last.tokens  # every token, and where each round's block began
    starts = [len(b) for b in before]
    ends = starts[1:] + [len(generated)]
    at = [len(tok.decode(generated[:n])) for n in range(len(generated) + 1)]  # text length after n tokens
    full = tok.decode(generated)

    def stops():  # texts first seen ending at a token e with more of its block after it
        for a, b in zip(starts, ends):
            for e in range(a + 1, b):
                for s in range(e - 1, -1, -1):
                    piece = full[at[s]:at[e]]
                    if piece and full.find(piece) == at[s]:
                        yield piece

    stop = next(stops())
    engine, _, last = run((stop,))
    assert last.finish_reason == "stop"
    assert _sample_count(engine.metrics, "specdec_tokens_per_step_sum") == last.completion_tokens


def test_the_budget_gauge_reads_the_budget_before_any_step(tiny):
    """The dashboard's budget line is there from the start (it read 0 until the first request)."""
    model, tok = tiny[0], tiny[1]
    engine = Engine(model, tok, budget=6)
    assert "specdec_budget_positions 6.0" in engine.metrics.render().decode()
    curve = CostCurve({1: 1.0, 4: 1.05, 8: 1.6, 64: 8.0})  # no --budget: the probe's curve gives the line
    engine = Engine(model, tok, cost=curve)
    assert engine.line == 4 and "specdec_budget_positions 4.0" in engine.metrics.render().decode()


# --- a step of one request on a GPU ----------------------------------------------------------------------

@pytest.mark.parametrize("drafter", ["prompt-lookup", "tree", "eagle"])
def test_a_lone_request_steps_through_the_models_own_forward_as_on_a_gpu(tiny, tiny_folder, monkeypatch, drafter):
    """On a GPU a step with one request and nothing to prefill runs that request's own forward (`Transformer.forward`,
    which replays a CUDA graph there). Forced here on the CPU (one request at a time): chains, trees (offsets and
    mask) and EAGLE's features still give single-request decode()'s tokens and drafts, through that path."""
    from specdec.drafters.eagle import Eagle
    from specdec.serving import batch
    from tests.test_eagle import random_head

    model, tok = tiny
    own, taken = batch._own_forward, []
    monkeypatch.setattr(batch, "on_a_gpu", lambda model: True)
    monkeypatch.setattr(batch, "_own_forward", lambda *a: taken.append(a[1]) or own(*a))
    template = Eagle(random_head(model, tiny_folder), model.embed, tree="dynamic", nodes=6)
    base = {"prompt-lookup": PromptLookup, "tree": TinyTree, "eagle": template.fresh}[drafter]
    logs = []

    def make():  # the drafter, its proposals logged
        d, log = base(), []
        logs.append(log)
        propose = d.propose
        d.propose = lambda ctx, k: log.append(propose(ctx, k)) or log[-1]
        return d

    ids = [tok.encode(p, chat=False) for p in PROMPTS[:3]]
    refs = [reference(model, tok, i, 20, make(), FixedK(3)).token_ids for i in ids]
    ref_drafts = [[(d.tokens.tolist(), d.parents.tolist()) for d in log] for log in logs]
    logs.clear()
    engine = Engine(model, tok, budget=100, speculation="always", max_batch=1, prefill_chunk=5,
                    drafters={"eagle": make})
    engine.new_drafter = lambda method: make()
    jobs = [Job(i, Request(max_new_tokens=20), method="eagle" if drafter == "eagle" else "prompt-lookup", k=3)
            for i in ids]
    events = run_engine(engine, jobs)
    assert [[t for e in events[j.id] for t in e.tokens] for j in jobs] == refs
    assert [[(d.tokens.tolist(), d.parents.tolist()) for d in log] for log in logs] == ref_drafts  # EAGLE: its features
    assert len(taken) >= 3 * 10 and all(s.logits for s in taken)  # every decode step (prefill pieces: packed)
    assert any(s.local is not None for s in taken) == (drafter != "prompt-lookup")  # trees went through it
    assert any(s.features for s in taken) == (drafter == "eagle")


def test_a_trees_acceptance_counts_by_depth_as_decode_does(tiny):
    """A tree's siblings are alternatives for one position (decode()'s `Result`): the server's realized alpha (the
    prior of its next requests' adaptive k) and its per-position counters read a tree round by its depth, so they
    equal decode()'s acceptance_rate and accepted_per_position for the same request, not accepted / nodes."""
    model, tok = tiny
    ids = tok.encode(PROMPTS[2], chat=False)
    ref = reference(model, tok, ids, 25, TinyTree(), FixedK(3))
    engine = Engine(model, tok, budget=100, speculation="always", max_batch=1)
    engine.new_drafter = lambda method: TinyTree()  # two nodes at the first level: more nodes than depth
    run_engine(engine, [Job(ids, Request(max_new_tokens=25), method="prompt-lookup", k=3)])
    m = engine.metrics
    assert ref.accepted and ref.drafted > ref.accepted / ref.acceptance_rate  # nodes outnumber the depth
    assert m.realized_alpha("tiny-tree", "interactive", least=1) == pytest.approx(ref.acceptance_rate)
    reached = [_sample_count(m, "specdec_position_drafted_total", position=str(i)) for i in range(1, 6)]
    accepted = [_sample_count(m, "specdec_position_accepted_total", position=str(i)) for i in range(1, 6)]
    depth = len(ref.accepted_per_position)
    assert not any(reached[depth:])  # no round reaches a position deeper than its tree
    assert [a / r if r else 0.0 for a, r in zip(accepted, reached)][:depth] == pytest.approx(ref.accepted_per_position)


def test_a_curve_grant_at_exactly_break_even_is_refused():
    """An ask must beat the step's tokens per time (by the hurdle), not tie it: 0.5 more tokens for 0.5 more time
    beside one token per 1.0 adds variance and nothing else."""
    ask = [Ask("a", 1, tokens=1.5)]
    cost = lambda n: 1 + 0.5 * (n - 1)  # noqa: E731
    assert grant(ask, batch=1, cost=cost, hurdle=0.0) == {"a": 0}
    assert grant([Ask("a", 1, tokens=1.51)], batch=1, cost=cost, hurdle=0.0) == {"a": 1}


def test_a_granted_tree_adds_its_positions_to_the_step_the_next_ask_is_priced_at():
    """A tree spends its nodes, not its depth: after one tree of 3 nodes at depth 1 the step holds 4 positions, so
    the next tree would reach 7, past the flat part of the curve."""
    cost = lambda n: 1.0 if n <= 5 else 3.0  # noqa: E731
    trees = [Ask("a", 1, tokens=2.0, positions=3), Ask("b", 1, tokens=2.0, positions=3)]
    assert grant(trees, batch=1, cost=cost) == {"a": 1, "b": 0}


def test_a_shortened_chain_is_priced_by_its_own_expected_tokens():
    """A prefix k' < k brings E(k') tokens, not E(k): at alpha 0.3 (E = 1.0, 1.3, 1.39) beside one other request,
    k = 1 adds 0.3 tokens for 0.14 more time, short of the hurdle (0.336); counted at E(2) it would pass."""
    cost = {2: 1.0, 3: 1.14, 4: 1.5}.__getitem__
    assert grant([Ask("a", 2, tokens=1.39, shorter=(1.0, 1.3, 1.39))], batch=2, cost=cost) == {"a": 0}
    assert grant([Ask("a", 2, tokens=1.39, shorter=(1.0, 1.4, 1.49))], batch=2, cost=cost) == {"a": 1}


def test_a_picker_switches_on_its_least_samples():
    """`least` samples are enough for a proof: never making twice the model's tokens switches at the 4th."""
    p = ModePicker(explore=1, least=4, window=8)
    p.current[2], p.reference[2] = "model", [2.0, 1.0]
    for i in range(4):
        assert p.current[2] == "model"
        p.record(2, "never", 4 + 0.1 * i, 1.0)
    assert p.current[2] == "never"


def test_always_taking_over_from_the_model_moves_no_other_bucket():
    """Only an arm that speculates taking over from never carries its proof down; always beating the model's
    grants at 5-8 requests leaves 2 on never and the line where it was."""
    p = ModePicker(explore=1, least=4, window=8)
    p.current[2], p.current[8], p.reference[8] = "never", "model", [8.0, 1.0]
    p.never_above = 1
    for i in range(8):
        p.record(8, "always", 16 + 0.1 * i, 1.0)
    assert p.current[8] == "always" and p.current[2] == "never" and p.never_above == 1


def test_after_a_switch_the_new_arm_sets_its_own_rate_before_anything_is_explored():
    """Samples are taken against the running arm's rate: after a switch the old arm's rate is no reference, so
    the bucket explores again only once the new arm has measured its own."""
    p = ModePicker(explore=1, least=4, window=8)
    p.current[2], p.reference[2] = "model", [2.0, 1.0]
    for i in range(4):
        p.record(2, "never", 4 + 0.1 * i, 1.0)
    assert p.current[2] == "never" and p.choose(2) == "never"  # explore = 1, but no rate of never's yet
    p.record(2, "never", 4, 1.0)
    assert p.reference[2] == [4.0, 1.0] and p.choose(2) == "model"


def test_a_picker_judges_an_arm_on_its_last_window_only():
    """An arm's proof rests on its last `window` samples: old ones, from a load that has changed, drop out. Never
    at half the model's rate for four steps, then at three times it, takes over within the next window."""
    p = ModePicker(explore=1, least=4, window=4)
    p.current[2], p.reference[2] = "model", [2.0, 1.0]
    for tokens in (1.0, 1.1, 1.0, 1.1, 6.0, 6.1, 6.0, 6.1):
        p.record(2, "never", tokens, 1.0)
    assert p.current[2] == "never"


def test_estimates_report_a_new_buckets_starting_arm():
    """A bucket not seen yet reports the arm it would start on: never past the budget line."""
    p = ModePicker(line=3)
    assert p.estimates(2) == ("model", {}) and p.estimates(8) == ("never", {})


def test_a_refused_ask_verifies_no_draft(tiny):
    """Prompt lookup drafts before the grant; a refused ask's draft is dropped, not verified: at budget 1 (B = 1
    fills the line) nothing is drafted or verified."""
    model, tok = tiny
    engine = Engine(model, tok, budget=1, speculation="auto")
    ids = tok.encode(PROMPTS[0], chat=False)
    run_engine(engine, [Job(ids, Request(max_new_tokens=12), method="prompt-lookup", k=4)])
    m = engine.metrics
    assert _sample_count(m, "specdec_k_granted_count", priority="interactive") > 0  # it asked
    assert _sample_count(m, "specdec_drafted_tokens_total", drafter="prompt-lookup", priority="interactive") == 0


def test_the_steps_overhead_is_counted_in_one_position_forwards(tiny, monkeypatch):
    """`Engine.overhead` is a step's time beyond its forward in units of a one-position forward: a step of two
    plain requests (curve(2) = 1.5) whose forward took 1 s of 5 s adds 4 x 1.5 = 6 units, weighted 0.1."""
    import itertools

    from specdec.serving import engine as engine_module
    model, tok = tiny
    engine = Engine(model, tok, cost=CostCurve({1: 1.0, 2: 1.5, 64: 8.0}), speculation="never")
    for _ in range(2):
        engine.submit(Job([5], Request(max_new_tokens=4)))  # one-token prompts: decoding at once
    clock = itertools.count()  # each reading one second later: t0, forward start, forward end, 2 emits, end
    monkeypatch.setattr(engine_module, "time", SimpleNamespace(perf_counter=lambda: float(next(clock))))
    engine.step()
    assert engine.overhead == pytest.approx(0.1 * (5 - 1) / 1 * 1.5)


def test_a_step_that_prefills_runs_the_current_arm_even_when_due_to_explore(tiny):
    """The engine tells the picker which steps prefill: such a step runs the current arm, never an explored one,
    even where every step without a prompt piece would explore (explore = 1)."""
    model, tok = tiny
    engine = Engine(model, tok, cost=CostCurve(), speculation="auto", max_batch=2)
    engine.submit(Job(tok.encode(PROMPTS[1], chat=False), Request(max_new_tokens=30), method="prompt-lookup"))
    while not engine.running or not engine.running[0].decoding:
        engine.step()
    engine.picker.explore, engine.picker.reference[1] = 1, [1.0, 0.01]  # due to explore on every counted step
    engine.submit(Job(tok.encode(PROMPTS[4], chat=False), Request(max_new_tokens=4), method="prompt-lookup"))
    engine.step()  # the new prompt is prefilled beside the decoding request
    assert engine.arm == "model"


def test_a_cheap_tree_asks_for_its_nodes_whole(tiny, monkeypatch):
    """Recycling drafts before the grant: its ask is the tree it has, its depth and all its nodes as positions,
    and never a chain's prefix list (`shorter`): a tree is granted whole or not."""
    from specdec.drafters.recycling import Recycling
    from specdec.serving import scheduler

    model, tok = tiny
    asks, proposed, real = [], [], scheduler.grant
    monkeypatch.setattr(scheduler, "grant", lambda a, *args, **kw: asks.extend(a) or real(a, *args, **kw))
    shared = Recycling(nodes=4)

    def recording():
        d = shared.fresh()
        propose = d.propose
        d.propose = lambda ctx, k: proposed.append(propose(ctx, k)) or proposed[-1]
        return d

    curve = CostCurve({1: 1.0, 4: 1.02, 8: 1.1, 64: 8.0})
    engine = Engine(model, tok, cost=curve, speculation="auto", max_batch=2, drafters={"recycling": recording})
    run_engine(engine, [Job(tok.encode(p, chat=False), Request(max_new_tokens=24), method="recycling")
                        for p in PROMPTS * 2])
    drafts = [d for d in proposed if len(d)]
    assert [(a.k, a.width) for a in asks] == [(d.depth, len(d)) for d in drafts]
    assert any(a.width > a.k for a in asks) and all(a.shorter == () for a in asks)


def test_a_step_counts_past_the_budget_only_beyond_it():
    """B is the requests decoding, not the positions; a forward of exactly the budget's positions is within it."""
    m = Metrics()
    m.step(batch=2, positions=4, budget=4, tokens=2, seconds=0.01)
    assert _sample_count(m, "specdec_batch_size") == 2 and _sample_count(m, "specdec_steps_over_budget_total") == 0
    m.step(batch=2, positions=5, budget=4, tokens=2, seconds=0.01)
    assert _sample_count(m, "specdec_steps_over_budget_total") == 1 and _sample_count(m, "specdec_steps_total") == 2


def test_the_queue_gauge_counts_the_jobs_left_waiting(tiny):
    model, tok = tiny
    engine = Engine(model, tok, budget=8, max_batch=1)
    for p in PROMPTS[:3]:
        engine.submit(Job(tok.encode(p, chat=False), Request(max_new_tokens=2)))
    engine.step()
    assert len(engine.running) == 1 and _sample_count(engine.metrics, "specdec_queue_length") == 2


def test_a_tree_drafters_policy_prices_its_nodes(tiny):
    """Adaptive k for a tree drafter knows its positions per depth (`nodes`), so its rounds are priced as trees."""
    from specdec.drafters.recycling import Recycling
    model, tok = tiny
    engine = Engine(model, tok, budget=8)
    drafter = Recycling(nodes=4)
    policy = engine.new_policy(Job([5, 6], Request(max_new_tokens=8), method="prompt-lookup"), drafter)
    assert policy.nodes == drafter.nodes and policy.k_max == drafter.k_max


def test_a_requests_cache_holds_only_the_drafts_it_can_verify(tiny):
    """A slot's cache: prompt, new tokens and the deepest draft's positions, where no draft goes deeper than the
    tokens left minus one (k = 8 asked, 2 new tokens: drafts of at most 1)."""
    model, tok = tiny
    engine = Engine(model, tok, budget=8)
    ids = tok.encode(PROMPTS[0], chat=False)
    engine.submit(Job(ids, Request(max_new_tokens=2), method="prompt-lookup", k=8))
    engine.step()
    assert engine.running[0].cache.max_len == len(ids) + 2 + 1 + 1


def test_a_fixed_k_is_counted_as_all_accepted_on_a_curve(tiny):
    """A fixed k has no estimate: its ask counts k + 1 tokens, so on a cheap curve the model's grants run it."""
    model, tok = tiny
    engine = Engine(model, tok, cost=CostCurve({1: 1.0, 8: 1.01, 64: 8.0}), speculation="auto")
    engine.picker = None  # the model's grants on every step (no explored arm grants every ask)
    ids = tok.encode(PROMPTS[0], chat=False)
    run_engine(engine, [Job(ids, Request(max_new_tokens=16), method="prompt-lookup", k=3)])
    assert _sample_count(engine.metrics, "specdec_k_granted_sum", priority="interactive") > 0


def test_the_engine_marks_refusals_so_a_request_probes(tiny, monkeypatch):
    """Beside another request a step's drafts cost more than alone (curve flat to 2 positions, then steep): the
    model's grants refuse every estimate, the engine tells each policy (`AdaptiveK.refused`), and its probes are
    granted: the requests still draft now and then."""
    from specdec.serving import scheduler
    model, tok = tiny
    asks, real = [], scheduler.grant
    monkeypatch.setattr(scheduler, "grant", lambda a, *args, **kw: asks.extend(a) or real(a, *args, **kw))
    engine = Engine(model, tok, cost=CostCurve({1: 1.0, 2: 1.0, 3: 2.0, 64: 100.0}), speculation="auto")
    engine.picker = None  # the model's grants on every step
    ids = tok.encode(PROMPTS[0], chat=False)
    run_engine(engine, [Job(ids, Request(max_new_tokens=40), method="prompt-lookup") for _ in range(2)], join_every=1)
    assert any(a.probe for a in asks) and not all(a.probe for a in asks)
    assert _sample_count(engine.metrics, "specdec_k_granted_sum", priority="interactive") > 0


def test_realized_alpha_counts_from_exactly_least_drafted():
    m = Metrics()
    m.acceptance("prompt-lookup", "interactive", 31, 10)
    assert m.realized_alpha("prompt-lookup", "interactive") is None
    m.acceptance("prompt-lookup", "interactive", 1, 0)
    assert m.realized_alpha("prompt-lookup", "interactive") == pytest.approx(10 / 32)
    assert _sample_count(m, "specdec_realized_alpha", drafter="prompt-lookup", priority="interactive") == \
        pytest.approx(10 / 32)  # the gauge: all rounds so far, not the last one's


def test_arm_ratios_drop_an_arm_no_longer_measured():
    """After a switch a bucket's old figures were against the old arm: the gauge loses them, not keeps them stale."""
    m = Metrics()
    m.arm_ratios("2", "model", {"never": (0.9, 20), "always": (0.8, 20)})
    m.arm_ratios("2", "never", {})
    assert _sample_count(m, "specdec_auto_arm_ratio", batch="2", arm="never") == 1.0
    assert m.registry.get_sample_value("specdec_auto_arm_ratio", {"batch": "2", "arm": "model"}) is None
    assert m.registry.get_sample_value("specdec_auto_arm_ratio", {"batch": "2", "arm": "always"}) is None


# --- mutation audit 2: EAGLE's features through the fused layers, and which path a step takes ---------------------

def test_packed_features_from_the_fused_layers_equal_the_models_own(tiny_folder):
    """Quantized CPU models run the layers in one C call (`FusedLayers`): a segment asking for features gets the
    hidden states of the model's own forward, bit for bit, and a segment beside it that did not ask gets none."""
    from specdec.serving import batch

    model = load_transformer(tiny_folder, "q8")
    layers = (0, 1)
    prompt = [5, 9, 13, 17, 21, 4]
    out = model(torch.tensor([prompt]), model.new_cache(32), hidden_layers=layers)
    own = torch.cat([out.hidden[i][0] for i in layers], dim=-1)
    seg, other = Segment(model.new_cache(32), prompt, features=True), Segment(model.new_cache(32), [7, 8, 9])
    packed_forward(model, [seg, other], layers)
    assert torch.equal(seg.hidden, own) and other.hidden is None
    assert not batch.on_a_gpu(model) and batch.on_a_gpu(SimpleNamespace(device=torch.device("cuda")))
