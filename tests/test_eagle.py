"""EAGLE drafting on tiny models: the head stays in step with the committed tokens (features handed over,
draft entries rolled back), EAGLE-2 dynamic trees rerank to N nodes, no token outside the draft vocabulary
is drafted, greedy output equals plain decoding (fp32; bf16 on the kernel, q8, q4), sampled output is exact
(enumeration, with a broken-residual control; the loop's histogram for the sampled chain), heads for
another target are refused."""

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from specdec.adaptive import FixedK
from specdec.decode import Request, decode
from specdec.draft import children, depths, path_to
from specdec.drafters.base import Context
from specdec.drafters.eagle import Eagle, build, find_head
from specdec.drafters.eagle_head import EagleConfig, EagleHead
from specdec.errors import SpecdecError
from specdec.runtime import kernels
from specdec.runtime.kernels import quant
from specdec.runtime.loader import load_transformer
from specdec.runtime.model import QLinear
from specdec.sampling import SamplingParams, make_generator, probs_from_logits
from specdec.tokenizer import Tokenizer
from specdec.training.heads import fingerprint
from tests.test_medusa import broken_residual, correct_residual, tree_law
from tests.tiny import VOCAB, save_tiny

DRAFT_VOCAB = 64


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    folder = save_tiny("llama", tmp_path_factory.mktemp("target"), seed=0)
    target = load_transformer(folder)
    return dict(folder=folder, target=target, tok=Tokenizer(folder), head=random_head(target, folder),
                oracle=OracleHead(random_head(target, folder), target))


def random_head(target, folder, seed=0):
    """An EAGLE-3 head with random weights and a random draft vocabulary of 64 of the 96 tokens."""
    torch.manual_seed(seed)
    head = EagleHead(EagleConfig.for_target(target.cfg, "tiny", fingerprint(folder), draft_vocab_size=DRAFT_VOCAB))
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.copy_(torch.empty_like(p).uniform_(0.8, 1.2) if "norm" in name else torch.randn_like(p) * 0.2)
    head.set_vocab(torch.randperm(VOCAB)[:DRAFT_VOCAB])
    return head.eval()


class OracleHead(EagleHead):
    """A head that knows the target: it runs the real head (its KV cache and hidden outputs are real), but its
    logits are the target's at each entry's context (BOS, then the tokens of the entries it sees, in slot
    order), over the draft vocabulary. Drafts are right unless the target's token lies outside it: a good
    share of rounds accept long paths, others reject early, and a wrong mask or position shows up as
    lost acceptance."""

    def __init__(self, head, target):
        super().__init__(head.cfg)
        self.load_state_dict(head.state_dict())
        self.target, self.slot_tokens = target, {}
        self.eval()

    def forward(self, emb, hidden, positions, cache=None, mask=None):
        start = cache.length if cache is not None else 0
        _, h = super().forward(emb, hidden, positions, cache, mask)
        table = self.target.embed.weight.float()
        ids = [int((table - e).abs().sum(-1).argmin()) for e in emb[0]]
        n = len(ids)
        for i, t in enumerate(ids):
            self.slot_tokens[start + i] = t
        rows = []
        for i in range(n):
            seen = range(start + i + 1) if mask is None else mask[0, i].nonzero().flatten().tolist()
            ctx = [1] + [self.slot_tokens[s] for s in seen]
            logits = self.target(torch.tensor([ctx]), self.target.new_cache(len(ctx))).logits[0, -1]
            rows.append(logits[self.to_target(torch.arange(self.cfg.draft_vocab_size))])
        return torch.stack(rows)[None], h


def eagle(env, tree="dynamic", nodes=12, oracle=False, **kw):
    return Eagle(env["oracle" if oracle else "head"], env["target"].embed, tree=tree, nodes=nodes, **kw)


def encode(env, text):
    return [1] + env["tok"].encode(text, chat=False)  # BOS first: the oracle's contexts start with it


def run(env, ids, drafter=None, policy=None, **kw):
    return list(decode(env["target"], env["tok"], ids, Request(**kw), drafter, policy))[-1].result


def fresh_root(env, tokens):
    """The head's (logits, hidden) after the root, computed from scratch: one target forward over the committed
    tokens (all but the root), then one causal head call over (f_t, x_{t+1})."""
    target, head = env["target"], env["head"]
    aux = head.cfg.aux_layers
    out = target(torch.tensor([tokens[:-1]]), target.new_cache(len(tokens)), hidden_layers=aux)
    fused = head.fuse(torch.cat([out.hidden[i] for i in aux], -1))
    n = len(tokens) - 1
    logits, h = head(target.embed(torch.tensor([tokens[1:]])).float(), fused, torch.arange(n)[None])
    return logits[0, -1], h[0, -1]


@torch.inference_mode()
def from_scratch(env, tokens):
    """A generator of the head's draft logits [Vd] after the root, then after each token sent to it: a fresh head
    cache fed (f_t, x_{t+1}) at position t for the committed tokens, then one step per token at the next position."""
    target, head, aux = env["target"], env["head"], env["head"].cfg.aux_layers
    out = target(torch.tensor([tokens[:-1]]), target.new_cache(len(tokens)), hidden_layers=aux)
    cache, pos = head.new_cache(len(tokens) + 16), len(tokens) - 1
    logits, h = head(target.embed(torch.tensor([tokens[1:]])).float(),
                     head.fuse(torch.cat([out.hidden[i] for i in aux], -1)), torch.arange(pos)[None], cache)
    logits, h = logits[0, -1], h[0, -1]
    while True:
        t = yield logits
        logits, h = (x[0, 0] for x in head(target.embed(torch.tensor([[t]])).float(), h[None, None],
                                            torch.tensor([[pos]]), cache))
        pos += 1


def context_for(env, tokens, sampling=None, seed=0):
    """A Context as the loop hands it to round 1: the features of every committed position but the root."""
    target, aux = env["target"], env["head"].cfg.aux_layers
    ctx = Context(list(tokens), len(tokens), sampling or SamplingParams(), make_generator(seed), remaining=64)
    out = target(torch.tensor([tokens[:-1]]), target.new_cache(len(tokens)), hidden_layers=aux)
    ctx.add_features(out.hidden, aux, slice(None))
    return ctx


PROMPTS = ["the cat sat on the mat. the cat", "def f(x): return x", "zz"]


# --- keeping in step ------------------------------------------------------------------------------

class Recorder(Eagle):
    def propose(self, ctx, k):
        draft = super().propose(ctx, k)
        assert self.cache.length == len(ctx.tokens) - 1  # draft entries rolled back to the committed length
        self.seen.append((list(ctx.tokens), self.root[1].clone(), draft))
        return draft


@pytest.mark.parametrize("tree", ["dynamic", "chain"])
def test_head_cache_follows_the_committed_tokens(env, tree):
    """Every round's head state equals a fresh computation over the committed tokens: features reach the head
    for the prompt and each accepted path, and rejected draft entries are dropped (the oracle's logits make
    rounds accept long and short paths; its hidden states are the real head's)."""
    d = Recorder(env["oracle"], env["target"].embed, tree=tree, nodes=8, topk=2)
    d.seen = []
    r = run(env, encode(env, "the cat sat on the mat"), d, FixedK(4), max_new_tokens=40)
    assert len(d.seen) > 5 and r.mean_accepted > 1.5 and any(0 < x["accepted"] < x["depth"] for x in r.rounds)
    for tokens, hidden, draft in d.seen:
        torch.testing.assert_close(hidden, fresh_root(env, tokens)[1], atol=1e-4, rtol=1e-4)
        assert bool(env["head"].t2d[draft.tokens].all())  # never a token outside the draft vocabulary


def test_long_prompts_hand_over_every_prefill_chunk(env, monkeypatch):
    from specdec.runtime import model

    monkeypatch.setattr(model.prefill_spans, "__defaults__", (16,))  # prompts fed in pieces of 16
    ids = encode(env, "abcdefghij" * 4)
    d = Recorder(env["head"], env["target"].embed, tree="chain", nodes=3)
    d.seen = []
    run(env, ids, d, FixedK(3), max_new_tokens=4)
    torch.testing.assert_close(d.seen[0][1], fresh_root(env, ids)[1], atol=1e-4, rtol=1e-4)


# --- trees -----------------------------------------------------------------------------------------

@torch.inference_mode()
def node_scores(env, tokens, draft):
    """Each node's cumulative draft log-probability, by running the head along its path one step at a time."""
    head, target = env["head"], env["target"]
    t2d_index = {int(t): i for i, t in enumerate(head.to_target(torch.arange(DRAFT_VOCAB)))}
    scores = []
    for node in range(len(draft)):
        ctx = context_for(env, tokens)
        d = eagle(env, "chain", nodes=1)
        d._ingest(ctx)
        logits, h = d.root
        total, pos = 0.0, len(tokens) - 1
        for j in path_to(draft.parents, node):
            t = int(draft.tokens[j])
            total += float(torch.log_softmax(logits, -1)[t2d_index[t]])
            out = head(target.embed(torch.tensor([[t]])).float(), h[None, None], torch.tensor([[pos]]), d.cache)
            logits, h, pos = out[0][0, 0], out[1][0, 0], pos + 1
        scores.append(total)
    return scores


def test_dynamic_tree_reranks_to_the_best_n_nodes(env):
    tokens = env["tok"].encode("the cat sat", chat=False)
    full = eagle(env, nodes=10 ** 6, topk=3).propose(context_for(env, tokens), 3)
    assert len(full) == 3 + 3 * 3 + 3 * 3  # depth 1: 3; depths 2 and 3: 3 expanded x 3 children
    scores = node_scores(env, tokens, full)  # the tree mask gives what one-path-at-a-time drafting gives
    paths = [tuple(int(full.tokens[j]) for j in path_to(full.parents, i)) for i in range(len(full))]
    depth = depths(full.parents).tolist()
    for d in (0, 1):  # each depth expands its 3 best-scoring nodes, whoever their parents are
        level = [i for i in range(len(full)) if depth[i] == d]
        expanded = {int(full.parents[i]) for i in range(len(full)) if depth[i] == d + 1}
        assert expanded == set(sorted(level, key=lambda i: -scores[i])[:3])
    for n in (1, 5, 10):
        small = eagle(env, nodes=n, topk=3).propose(context_for(env, tokens), 3)
        assert len(small) == n and small.q is None
        got = {tuple(int(small.tokens[j]) for j in path_to(small.parents, i)) for i in range(n)}
        best = sorted(range(len(full)), key=lambda i: -scores[i])[:n]
        assert got == {paths[i] for i in best}
        for kids in children(small.parents):  # siblings distinct: exact with q = None
            assert len({int(small.tokens[c]) for c in kids}) == len(kids)
    assert eagle(env, nodes=6).propose(context_for(env, tokens), 2).depth <= 2


def test_dynamic_tree_sizes(env):
    """nodes(k) of a dynamic tree is what propose drafts k deep: topk at depth 1, then topk expanded x topk
    children per further depth, at most N (and no deeper than DEPTH); topk is at most N. Worked: topk 3 ->
    3, 12, 21; topk 2, N 5 -> 2, then 2 + 4 = 6 drafted at depth 2, one over N, reranked to 5; N 2 with the
    default topk 8 -> topk 2: two nodes at depth 1 (not a chain of one)."""
    from specdec.drafters.eagle import DEPTH

    tokens = env["tok"].encode("the cat sat", chat=False)
    for nodes, topk, want in ((10 ** 6, 3, [0, 3, 12, 21]), (5, 2, [0, 2, 5, 5]), (2, 8, [0, 2, 2, 2])):
        d = eagle(env, nodes=nodes, topk=topk)
        assert [d.nodes(k) for k in range(4)] == want and d.nodes(DEPTH + 3) == d.nodes(DEPTH)
        for k in (1, 2, 3):
            d.reset()
            assert len(d.propose(context_for(env, tokens), k)) == want[k], (nodes, topk, k)
    assert eagle(env, nodes=2).topk == 2 and eagle(env, nodes=1).topk == 1


def test_static_tree_follows_the_layouts_rank_paths(env):
    """A static tree drafts the calibrated rank paths (a node's rank: its place among its parent's children,
    drafted best first). N 11 is the first tree whose path set is not closed under reversal: (0, 1, 0), the
    rank-1 child's best child, and not (1, 0, 0)."""
    tokens = env["tok"].encode("the cat", chat=False)
    want = {(0,), (0, 0), (0, 0, 0), (1,), (0, 0, 0, 0), (0, 1), (1, 0), (2,), (0, 0, 0, 0, 0), (0, 0, 1), (0, 1, 0)}
    for nodes in (9, 11):
        draft = eagle(env, "static", nodes=nodes).propose(context_for(env, tokens), 6)
        rank = {c: r for kids in children(draft.parents) for r, c in enumerate(kids)}
        got = {tuple(rank[j] for j in path_to(draft.parents, i)) for i in range(len(draft))}
        assert len(got) == len(draft) == nodes
        assert got == (want if nodes == 11 else want - {(0, 0, 1), (0, 1, 0)})


def test_a_fresh_drafter_has_its_own_head_cache(env):
    a = eagle(env, "chain", nodes=3)
    a.propose(context_for(env, encode(env, "the cat")), 3)
    b = a.fresh()  # another request on the same head
    assert b.cache is None and b.root is None and b.head is a.head
    assert len(b.propose(context_for(env, encode(env, "def f(x)")), 3)) == 3
    assert a.cache is not b.cache and a.cache.length == len(encode(env, "the cat")) - 1  # a's entries untouched


def test_streams_of_one_llm_draft_on_their_own_head_caches(env, tmp_path, monkeypatch):
    """Two streams of one `specdec.LLM`, interleaved, each decode as they would alone: every request drafts with a
    fresh EAGLE drafter (one shared drafter's head cache was reset by the second stream, and the first then
    stopped with 'EAGLE: features start at position ..., the head holds ...'). Threads get their own too."""
    import itertools

    from specdec import LLM

    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    env["head"].save(tmp_path / "h")
    llm = LLM(str(env["folder"]), dtype="fp32", heads=str(tmp_path / "h"), tree="chain", tree_nodes=3, exit_layer=1,
              draft=str(env["folder"]))
    prompts = [encode(env, "the cat sat on the mat. the cat"), encode(env, "def f(x): return x; def g")]
    want = [llm.generate(p, max_new_tokens=24).token_ids for p in prompts]
    for method in ("eagle", "early-exit", "draft"):
        streams = [llm.chunks(p, max_new_tokens=24, method=method, k=3) for p in prompts]
        got = [[], []]
        for pair in itertools.zip_longest(*streams):
            for i, chunk in enumerate(pair):
                got[i] += chunk.tokens if chunk else []
        assert got == want, method
        assert llm.drafter(method) is not llm.drafter(method)  # one per request, over one head or model
    assert llm.drafter("eagle").head is llm.drafter("eagle").head


def test_static_tree_and_chain_shapes(env):
    tokens = env["tok"].encode("the cat", chat=False)
    d = eagle(env, "static", nodes=9)
    draft = d.propose(context_for(env, tokens), 6)
    assert len(draft) == 9 == d.nodes(6) and draft.q is None
    c = eagle(env, "chain", nodes=4)
    draft = c.propose(context_for(env, tokens), 6)
    assert draft.is_chain and len(draft) == 4 and draft.q is None
    c.reset()  # a new request
    sampled = c.propose(context_for(env, tokens, SamplingParams(temperature=0.8)), 3)
    assert len(sampled) == 3 and sampled.q.shape == (3, VOCAB)
    assert torch.allclose(sampled.q.sum(-1), torch.ones(3)) and not bool(sampled.q[:, ~env["head"].t2d].any())


def test_sampled_chain_carries_the_heads_own_q_rows(env):
    """Under sampling, row j of q is the head's distribution (at the request's temperature and top-k) after the
    root and drafted tokens 0 .. j-1, run one step at a time at positions root, root + 1, ...: what each token
    was drawn from."""
    tokens = env["tok"].encode("the cat sat", chat=False)
    sampling = SamplingParams(temperature=0.7, top_k=20)
    d = eagle(env, "chain", nodes=4)
    draft = d.propose(context_for(env, tokens, sampling, seed=3), 4)
    assert draft.is_chain and len(draft) == 4
    head = env["head"]
    step = from_scratch(env, tokens)
    logits = next(step)
    for j, t in enumerate(draft.tokens.tolist()):
        want = probs_from_logits(logits, sampling)
        torch.testing.assert_close(draft.q[j, head.to_target(torch.arange(DRAFT_VOCAB))], want)
        assert float(want[int(head.t2d[:t].sum())]) > 0  # the drafted token is one q can draw
        logits = step.send(t)


@pytest.mark.parametrize("tree", ["chain", "static"])
def test_tree_steps_score_with_the_heads_logits_from_scratch(env, monkeypatch, tree):
    """Every node a greedy chain or a static tree expands is scored with the logits the head computes for its path
    one step at a time from a fresh cache (positions, mask and hidden inputs of the tree step), and a chain drafts
    their argmax."""
    from specdec.drafters import eagle as E

    seen, real = [], E.top_logprobs
    monkeypatch.setattr(E, "top_logprobs", lambda logits, *a, **kw: seen.append(logits.clone()) or real(logits, *a, **kw))
    tokens = encode(env, PROMPTS[0])
    draft = eagle(env, tree, nodes=5 if tree == "chain" else 9).propose(context_for(env, tokens), 5)
    rows = torch.cat(seen)  # the root's row, then one row per expanded node, in draft order
    expanded = sorted({int(p) for p in draft.parents if p >= 0})
    assert len(rows) == 1 + len(expanded)
    for row, node in zip(rows, [-1] + expanded):
        step = from_scratch(env, tokens)
        logits = next(step)
        for j in (path_to(draft.parents, node) if node >= 0 else []):
            logits = step.send(int(draft.tokens[j]))
        torch.testing.assert_close(row, logits, atol=1e-4, rtol=1e-4)
    if tree == "chain":
        assert draft.tokens.tolist() == env["head"].to_target(rows.argmax(-1)).tolist()


# --- the loop ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("tree", ["dynamic", "static", "chain"])
def test_greedy_equals_plain(env, tree):
    for text in PROMPTS:
        ids = encode(env, text)
        plain = run(env, ids, max_new_tokens=40)
        for oracle in (False, True):
            spec = run(env, ids, eagle(env, tree, oracle=oracle, topk=2), FixedK(4), max_new_tokens=40)
            assert spec.token_ids == plain.token_ids and spec.finish_reason == plain.finish_reason
            if oracle:
                assert spec.mean_accepted > 1.4


@pytest.mark.parametrize("dtype", ["bf16", "q8", "q4"])
def test_greedy_equals_plain_row_exact(tmp_path, monkeypatch, dtype):
    """bf16 on the kernel and q8/q4: the tree verification forward is bit-identical to plain steps."""
    if dtype == "bf16" and not kernels.available():
        pytest.skip("the bf16 kernel is unavailable")
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    folder = save_tiny("qwen2", tmp_path / "m", seed=0)
    target = load_transformer(folder, torch.bfloat16 if dtype == "bf16" else dtype)
    assert target.row_exact
    e = dict(target=target, tok=Tokenizer(folder))
    torch.manual_seed(0)
    head = EagleHead(EagleConfig.for_target(target.cfg, "tiny", None, draft_vocab_size=48))
    for text in PROMPTS:
        ids = e["tok"].encode(text, chat=False)
        plain = run(e, ids, max_new_tokens=30)
        spec = run(e, ids, Eagle(head, target.embed, nodes=10), FixedK(4), max_new_tokens=30)
        assert spec.token_ids == plain.token_ids


def two_token_law(env, tokens, sampling, residual, tree="dynamic"):
    """Exact law of the first two emitted tokens of the loop with a deterministic EAGLE tree."""
    target = env["target"]

    def forward(prefix):
        p = probs_from_logits(target(torch.tensor([prefix]), target.new_cache(len(prefix))).logits[0, -1], sampling)
        p = p.double()
        return p / p.sum()

    def round_law(context):
        draft = eagle(env, tree, nodes=8, topk=3).propose(context_for(env, context, sampling), 3)
        rows = [forward(list(context))]
        for node in range(len(draft)):
            rows.append(forward(list(context) + [int(draft.tokens[j]) for j in path_to(draft.parents, node)]))
        return tree_law(draft.tokens, draft.parents, torch.stack(rows), residual)

    joint = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    for seq, w in round_law(tokens).items():
        if len(seq) >= 2:
            joint[seq[0], seq[1]] += w
        else:
            for seq2, w2 in round_law(tokens + [seq[0]]).items():
                joint[seq[0], seq2[0]] += w * w2
    p1 = forward(tokens)
    exact = torch.stack([p1[t] * forward(tokens + [t]) for t in range(VOCAB)])
    return joint, exact


def test_tree_sampling_is_exact_by_enumeration(env):
    ids = env["tok"].encode("the cat", chat=False)
    sampling = SamplingParams(temperature=1.5, top_k=6)
    joint, exact = two_token_law(env, ids, sampling, correct_residual)
    assert abs(joint.sum().item() - 1) < 1e-9 and (joint - exact).abs().max().item() < 1e-9
    broken, _ = two_token_law(env, ids, sampling, broken_residual)
    assert 0.5 * (broken - exact).abs().sum().item() > 0.01  # the enumeration catches a broken residual


@pytest.mark.parametrize("tree", ["chain", "dynamic"])
def test_the_loop_samples_like_plain_sampling(env, tree):
    """The decode loop with the sampled chain (q rows) and the dynamic tree: first-two-token histograms
    against the target's exact law."""
    tok = copy.copy(env["tok"])
    tok.eos_ids = frozenset()
    e = dict(env, tok=tok)
    ids = encode(env, "the cat")
    sampling = SamplingParams(temperature=1.5, top_k=6)
    target = env["target"]
    p = lambda prefix: probs_from_logits(target(torch.tensor([prefix]), target.new_cache(len(prefix))).logits[0, -1],
                                         sampling).double()
    p1 = p(ids)
    exact = torch.stack([p1[t] * p(ids + [t]) for t in range(VOCAB)])
    n, counts, accepted = 500, torch.zeros(VOCAB, VOCAB, dtype=torch.float64), 0
    d = eagle(env, tree, nodes=6, oracle=True)
    for seed in range(n):
        r = run(e, ids, d, FixedK(3), max_new_tokens=2, sampling=SamplingParams(temperature=1.5, top_k=6, seed=seed))
        counts[r.token_ids[0], r.token_ids[1]] += 1
        accepted += r.accepted
    assert accepted > n / 2
    tv1 = 0.5 * (counts.sum(1) / n - exact.sum(1)).abs().sum().item()
    tv2 = 0.5 * (counts.sum(0) / n - exact.sum(0)).abs().sum().item()
    assert tv1 < 0.1 and tv2 < 0.15, (tv1, tv2)


# --- loading ----------------------------------------------------------------------------------------

def test_heads_for_another_target_are_refused(env, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    env["head"].save(tmp_path / "h")
    assert find_head("tiny", env["folder"], env["target"].cfg, tmp_path / "h").cfg == env["head"].cfg
    other = save_tiny("llama", tmp_path / "other", seed=1)  # same shapes, other weights: the fingerprint differs
    with pytest.raises(SpecdecError, match="built for 'tiny'.*not for 'tiny-1'.*specdec train eagle --model tiny-1"):
        find_head("tiny-1", other, env["target"].cfg, tmp_path / "h")
    llm = SimpleNamespace(name="tiny-1", folder=other, model=env["target"])
    with pytest.raises(SpecdecError, match="no eagle heads for tiny-1.*specdec train eagle --model tiny-1"):
        build(llm)


def test_a_target_converted_under_another_transformers_keeps_its_heads(env, tmp_path):
    """The fingerprint ignores config.json's `transformers_version` (a conversion under a newer transformers wrote
    another one, and the shipped SmolLM2 heads were refused for their own target), not the config's other fields."""
    import json
    import shutil

    from specdec.training.heads import target_fingerprint

    folder = shutil.copytree(env["folder"], tmp_path / "again")
    config = json.loads((folder / "config.json").read_text())
    config["transformers_version"] = "99.0.0"
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    assert fingerprint(folder) == fingerprint(env["folder"])
    legacy = fingerprint(folder, legacy=True)  # heads trained before keep matching the folder they were trained on
    assert legacy != fingerprint(env["folder"], legacy=True) and target_fingerprint(folder, legacy) == legacy
    config["rms_norm_eps"] = 2 * config["rms_norm_eps"]
    (folder / "config.json").write_text(json.dumps(config))
    assert fingerprint(folder) != fingerprint(env["folder"])


def test_export_to_a_file_is_one_line(tmp_path, capsys):
    from specdec.cli import main

    afile = tmp_path / "afile"
    afile.write_text("x")
    assert main(["export", "eagle", "--model", "smollm2-135m", "--out", str(afile)]) == 2  # before anything loads
    assert "is a file, not a folder" in capsys.readouterr().err and afile.read_text() == "x"
    assert main(["export", "eagle", "--model", "no-such-model", "--out", "/proc/specdec-export"]) == 2
    assert "cannot write there" in capsys.readouterr().err  # a folder that cannot be written: also before loading


def test_export_into_a_folder_whose_config_json_is_a_folder_is_one_line(tmp_path, capsys):
    """config.json or model.safetensors already a folder in --out: said as such, before anything loads."""
    from specdec.cli import main

    (tmp_path / "out" / "config.json").mkdir(parents=True)
    assert main(["export", "eagle", "--model", "no-such-model", "--out", str(tmp_path / "out")]) == 2
    assert "config.json is a folder" in capsys.readouterr().err


def test_a_medusa_folder_given_for_an_eagle_head_says_so(tmp_path):
    """It said "not an EAGLE-3 head config (missing 'num_attention_heads')"."""
    from specdec.drafters.eagle_head import EagleConfig

    with pytest.raises(SpecdecError, match="holds 'medusa' heads, not an EAGLE head"):
        EagleConfig.from_hf({"format": 1, "kind": "medusa", "heads": 4}, "x/config.json")


def test_export_then_import_drafts_the_same(env, tmp_path, monkeypatch, capsys):
    """`specdec export eagle` writes the vLLM/SGLang layout; `--heads` of that folder, with our "specdec" block
    or without it (as a published head), drafts exactly what the original head drafts; generate runs on it."""
    import json

    from specdec.cli import main

    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    env["head"].save(tmp_path / "mine")
    assert main(["export", "eagle", "--model", str(env["folder"]), "--heads", str(tmp_path / "mine"),
                 "--out", str(tmp_path / "out")]) == 0
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == DRAFT_VOCAB
    modes = {f: (tmp_path / "out" / f).stat().st_mode & 0o777 for f in ("config.json", "model.safetensors")}
    assert modes["model.safetensors"] == modes["config.json"], modes  # safetensors alone wrote 0600: unreadable to vLLM
    from transformers import AutoConfig  # what vLLM and SGLang parse config.json with

    hf = AutoConfig.from_pretrained(tmp_path / "out")
    assert (hf.model_type, hf.num_hidden_layers, hf.hidden_size, hf.vocab_size) == ("llama", 1, 64, VOCAB)
    assert hf.draft_vocab_size == DRAFT_VOCAB and hf.eagle_config["eagle_aux_hidden_state_layer_ids"] == [1, 0, 0]
    published = tmp_path / "published"
    published.mkdir()
    (published / "model.safetensors").write_bytes((tmp_path / "out" / "model.safetensors").read_bytes())
    (published / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "specdec"}))
    tokens = encode(env, "the cat sat")
    want = eagle(env, nodes=10).propose(context_for(env, tokens), 4)
    for folder in (tmp_path / "out", published):
        head = find_head(str(env["folder"]), env["folder"], env["target"].cfg, folder)
        got = Eagle(head, env["target"].embed, nodes=10).propose(context_for(env, tokens), 4)
        assert torch.equal(got.tokens, want.tokens) and torch.equal(got.parents, want.parents)
    capsys.readouterr()
    gen = ["generate", "the cat", "--model", str(env["folder"]), "--method", "eagle", "--heads", str(published),
           "--tree-nodes", "5", "--k", "3", "--max-new-tokens", "8", "--json"]
    assert main(gen) == 0
    assert max(json.loads(capsys.readouterr().out)["drafted_per_round"]) == 5
    other = save_tiny("llama", tmp_path / "other", seed=1)
    assert main(["generate", "x", "--model", str(other), "--method", "eagle"]) == 2
    assert "specdec train eagle" in capsys.readouterr().err


def test_eagle_as_a_hybrid_source(env):
    """Rounds drafted by prompt lookup still hand their committed features to EAGLE for its next proposal."""
    from specdec.drafters.hybrid import Hybrid
    from specdec.drafters.prompt_lookup import PromptLookup

    ids = encode(env, "the cat sat on the mat. the cat sat on")
    plain = run(env, ids, max_new_tokens=40)
    d = Recorder(env["oracle"], env["target"].embed, tree="dynamic", nodes=8, topk=2)
    d.seen = []
    h = Hybrid([PromptLookup(), d])
    assert h.wants_hidden_layers == env["head"].cfg.aux_layers
    spec = run(env, ids, h, FixedK(4), max_new_tokens=40)
    assert spec.token_ids == plain.token_ids
    stats = h.stats()
    assert stats["eagle"]["accepted"] > 0 and stats["prompt-lookup"]["rounds"] > 0
    for tokens, hidden, _ in d.seen:
        torch.testing.assert_close(hidden, fresh_root(env, tokens)[1], atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(quant.isa() == "torch", reason="the quantized-matmul kernel is unavailable here")
def test_cpu_drafting_with_q8_head_weights(env):
    """q8 head weights (`use_kernel("q8")`, what `build` picks on a CPU with the quantized matmul): every
    projection is a QLinear, activations and cache fp32, outputs the fp32 head's up to the rounding, and
    greedy decoding still equals plain decoding."""
    fast = Eagle(copy.deepcopy(env["head"]), env["target"].embed, nodes=12, path="q8")
    head = fast.head
    assert isinstance(head.lm_head, QLinear) and isinstance(head.midlayer.self_attn.q_proj, QLinear)
    assert head.compute_dtype == torch.float32 and head.new_cache(8).k[0].dtype == torch.float32
    g = torch.Generator().manual_seed(0)  # fixed inputs: the tolerance below is for these, not any draw
    emb, hidden = (torch.randn(1, 3, head.cfg.hidden_size, generator=g) for _ in range(2))
    want, _ = env["head"](emb, hidden, torch.arange(3)[None])
    got, _ = head(emb, hidden, torch.arange(3)[None])
    assert not torch.equal(got, want)
    torch.testing.assert_close(got, want, rtol=0.05, atol=0.1)
    ids = encode(env, "the cat sat on the mat; the cat")
    assert run(env, ids, fast, FixedK(3), max_new_tokens=16).token_ids == run(env, ids, max_new_tokens=16).token_ids


@pytest.mark.skipif(kernels.matmul_path() == "torch", reason="the bf16 kernel is unavailable here")
def test_cpu_drafting_runs_the_head_through_the_kernel(env):
    """On a CPU the head's projections run in bf16 through specdec's kernel with fp32 activations and cache
    (torch's fp32 mm was ~6x slower a head forward); its outputs stay the fp32 head's up to bf16 rounding,
    and greedy decoding still equals plain decoding."""
    fast = Eagle(copy.deepcopy(env["head"]), env["target"].embed, nodes=12, path=kernels.matmul_path())
    head = fast.head
    assert head.fc.weight.dtype == torch.bfloat16 and head.compute_dtype == torch.float32
    assert head.new_cache(8).k[0].dtype == torch.float32
    g = torch.Generator().manual_seed(0)  # fixed inputs: the tolerance below is for these, not any draw
    emb, hidden = (torch.randn(1, 3, head.cfg.hidden_size, generator=g) for _ in range(2))
    want, _ = env["head"](emb, hidden, torch.arange(3)[None])
    got, _ = head(emb, hidden, torch.arange(3)[None])
    assert got.dtype == torch.float32 and not torch.equal(got, want)
    torch.testing.assert_close(got, want, rtol=0.05, atol=0.1)
    ids = encode(env, "the cat sat on the mat; the cat")
    assert run(env, ids, fast, FixedK(3), max_new_tokens=16).token_ids == run(env, ids, max_new_tokens=16).token_ids


def test_auto_tree_is_a_chain_where_verifying_is_narrow(env, tmp_path, monkeypatch):
    """--tree auto: EAGLE-2's dynamic tree where the probe's budget holds more than a chain, else a chain;
    an explicit --tree-nodes wider than a chain asks for the tree."""
    from specdec.drafters.eagle import DEPTH, auto_tree

    assert auto_tree(3) == "chain" and auto_tree(DEPTH + 1) == "chain" and auto_tree(DEPTH + 2) == "dynamic"
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    env["head"].save(tmp_path / "h")
    for budget, nodes, want in ((3, None, "chain"), (64, None, "dynamic"), (3, 12, "dynamic")):
        llm = SimpleNamespace(name="tiny", folder=env["folder"], model=env["target"], budget=lambda b=budget: b)
        assert build(llm, tmp_path / "h", "auto", nodes).tree == want


def test_build_sizes_the_tree_from_the_probes_budget(env, tmp_path, monkeypatch):
    """N = the probe's budget less the root (the verify forward holds the root and N nodes), at least MIN_NODES;
    a chain drafts DEPTH; --tree-nodes wins."""
    from specdec.drafters.eagle import DEPTH, MIN_NODES

    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    env["head"].save(tmp_path / "h")
    for budget, tree, nodes, want in ((64, "auto", None, 63), (20, "dynamic", None, 19), (20, "static", None, 19),
                                      (3, "dynamic", None, MIN_NODES), (MIN_NODES + 1, "dynamic", None, MIN_NODES),
                                      (64, "chain", None, DEPTH), (64, "dynamic", 7, 7)):
        llm = SimpleNamespace(name="tiny", folder=env["folder"], model=env["target"], budget=lambda b=budget: b)
        assert build(llm, tmp_path / "h", tree, nodes).budget == want, (budget, tree, nodes)


def test_export_never_overwrites_another_models_folder(tmp_path, capsys):
    """--out holding another config.json (a Medusa head, a model) or a lone model.safetensors is refused before
    anything is written; an earlier EAGLE-3 export there is replaced."""
    from specdec.cli import main

    medusa = tmp_path / "medusa"
    medusa.mkdir()
    (medusa / "config.json").write_text('{"kind": "medusa"}')
    (medusa / "heads.safetensors").write_bytes(b"x")
    lone = tmp_path / "lone"
    lone.mkdir()
    (lone / "model.safetensors").write_bytes(b"weights")
    for folder in (medusa, lone):
        assert main(["export", "eagle", "--model", "smollm2-135m", "--out", str(folder)]) == 2
        assert "holds another model or head" in capsys.readouterr().err
    assert (medusa / "config.json").read_text() == '{"kind": "medusa"}' and (lone / "model.safetensors").read_bytes() == b"weights"


def test_a_config_json_rewritten_in_another_key_order_keeps_its_heads(env, tmp_path):
    """The fingerprint reads config.json's fields, not its layout: the same fields in another key order and
    indentation (a conversion by another tool) give the same fingerprint, the legacy one (its bytes) another
    (found by mutating training/heads.py: `sort_keys=False` passed, every test rewriting the config in its order)."""
    import json
    import shutil

    folder = shutil.copytree(env["folder"], tmp_path / "again")
    config = json.loads((folder / "config.json").read_text())
    assert len(config) > 2
    (folder / "config.json").write_text(json.dumps(dict(reversed(list(config.items()))), indent=4))
    assert fingerprint(folder) == fingerprint(env["folder"])
    assert fingerprint(folder, legacy=True) != fingerprint(env["folder"], legacy=True)
