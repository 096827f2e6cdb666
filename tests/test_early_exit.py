"""Early-exit self-speculation on tiny models: greedy output equals plain decoding for every exit
layer (with and without LayerSkip's KV reuse), the skip-forward equals the full forward, the
caches hold exactly what they should, and sampled output follows the target's law (a drafter that
hides its q fails the same check)."""

import copy
import dataclasses
import math
import statistics

import pytest
import torch

from specdec.adaptive import FixedK
from specdec.decode import Request, decode
from specdec.draft import Draft
from specdec.drafters.early_exit import EarlyExit, forward_from_layer
from specdec.runtime.loader import load_transformer
from specdec.sampling import SamplingParams, probs_from_logits
from specdec.tokenizer import Tokenizer

PROMPTS = ["abcabcabc", "the cat sat on the mat. the cat"]  # both run to the token limit on both tiny models


@pytest.fixture(scope="module")
def tiny(tiny_folder):
    return load_transformer(tiny_folder, torch.float32), Tokenizer(tiny_folder)


def run(model, tok, ids, drafter=None, k=0, **kw):
    return list(decode(model, tok, ids, Request(**kw), drafter, FixedK(k) if drafter else None))[-1].result


# (exit layer, k, LayerSkip's KV reuse): every layer of the tiny models, k = 1 and a longer k, both verify paths
CASES = [(1, 3, True), (2, 3, True), (3, 4, True), (1, 1, False), (2, 4, False)]


def test_greedy_equals_plain_for_every_exit_layer(tiny):
    model, tok = tiny
    for prompt, new in zip(PROMPTS, (40, 24)):
        ids = tok.encode(prompt, chat=False)
        plain = run(model, tok, ids, max_new_tokens=new)
        for L, k, reuse in CASES if prompt == PROMPTS[0] else CASES[:1]:
            d = EarlyExit(model, L, reuse=reuse)
            r = run(model, tok, ids, d, k, max_new_tokens=new)
            assert r.token_ids == plain.token_ids, (prompt, L, k, reuse)
            speculative = sum(1 for x in r.rounds if x["drafted"])
            assert speculative and d.reused == (speculative if reuse else 0)
            if L == model.cfg.num_layers:  # the whole model drafts: every token is accepted
                assert r.acceptance_rate == 1.0


def test_forward_from_layer_equals_the_full_forward(tiny):
    model, _ = tiny
    g = torch.Generator().manual_seed(0)
    ctx = torch.randint(3, model.cfg.vocab_size, (1, 9), generator=g)
    new = torch.randint(3, model.cfg.vocab_size, (1, 5), generator=g)
    ref = model.new_cache(32)
    model(ctx, ref)
    want = model(new, ref).logits
    for L in range(1, model.cfg.num_layers + 1):
        for m in (1, 3, 5):  # positions whose layer-<L work is given; the rest start at the embedding
            cache = model.new_cache(32)
            model(ctx, cache)
            part = model.new_cache(32)
            model(ctx, part)
            h = model(new[:, :m], part, exit_layer=L, hidden_layers=(L - 1,)).hidden[L - 1]
            for i in range(L):
                cache.k[i][:, :, 9:9 + m] = part.k[i][:, :, 9:9 + m]
                cache.v[i][:, :, 9:9 + m] = part.v[i][:, :, 9:9 + m]
            got = forward_from_layer(model, cache, h, new[:, m:], L).logits
            assert cache.length == ref.length == 14
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            for i in range(model.cfg.num_layers):
                torch.testing.assert_close(cache.k[i][:, :, :14], ref.k[i][:, :, :14], atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(cache.v[i][:, :, :14], ref.v[i][:, :, :14], atol=1e-5, rtol=1e-5)


class Recording(EarlyExit):
    """Checks the drafter's cache around every proposal."""

    def propose(self, ctx, k):
        draft = super().propose(ctx, k)
        if k > 0:
            assert len(self.cache.k) == self.exit_layer  # layers < L only
            assert self.cache.length == len(self.fed) == len(ctx.tokens) + len(draft) - 1
            assert self.fed[:len(ctx.tokens)] == ctx.tokens
            self.log.append(self.cache.max_len)
        return draft


class CacheWatch(Recording):
    """Checks the target's cache at every verification: the committed tokens but the last."""

    def verify_forward(self, model, cache, inputs):
        if self._pending is not None:
            start, expected, _ = self._pending
            assert cache.length == start and inputs[0].tolist() == expected
        self.lengths.append(cache.length + inputs.shape[1])
        return super().verify_forward(model, cache, inputs)


def test_caches_hold_what_they_should(tiny):
    model, tok = tiny
    ids = tok.encode(PROMPTS[1], chat=False)
    d = CacheWatch(model, 2, max_len=64)
    d.log, d.lengths = [], []
    r = run(model, tok, ids, d, 3, max_new_tokens=40)
    assert d.log and len(set(d.log)) == 1  # never reallocated for a 70-token request
    assert d.lengths and max(d.lengths) <= len(ids) + 40 + 3
    assert d.cache.length <= len(ids) + r.new_tokens + 3
    with pytest.raises(ValueError, match="exit_layer"):
        EarlyExit(model, 0)
    with pytest.raises(ValueError, match="exit_layer"):
        EarlyExit(model, model.cfg.num_layers + 1)


def context(tokens, target_cache=None, sampling=SamplingParams(), seed=0):
    from specdec.drafters.base import Context
    from specdec.sampling import make_generator

    return Context(list(tokens), len(tokens), sampling, make_generator(seed), remaining=16, target_cache=target_cache)


def test_own_cache_drafts_and_verifies_as_the_shared_one(tiny):
    """Without the target's cache (called on its own, the server) the drafter prefills its own layers < L: it
    drafts what the shared cache drafts, and `verify_forward` copies that KV into the target's cache, so the
    reused verification gives the plain forward's logits."""
    model, tok = tiny
    ids = tok.encode("the cat sat on the mat. " * 3, chat=False)  # longer than ROW_EXACT_MAX: the prefill path
    for L in (1, 2):
        target = model.new_cache(len(ids) + 16)
        model.prefill(ids[:-1], target)
        want = EarlyExit(model, L).propose(context(ids, target), 3).tokens.tolist()
        own = EarlyExit(model, L)
        draft = own.propose(context(ids), 3).tokens.tolist()
        assert draft == want and own.fed == ids + draft[:-1] and not own.shared
        inputs = torch.tensor([[ids[-1]] + draft])
        cache, ref = model.new_cache(len(ids) + 16), model.new_cache(len(ids) + 16)
        model.prefill(ids[:-1], cache)
        model.prefill(ids[:-1], ref)
        got = own.verify_forward(model, cache, inputs)
        assert got is not None and own.reused == 1
        torch.testing.assert_close(got.logits, model(inputs, ref).logits, atol=1e-5, rtol=1e-5)


def test_shared_cache_follows_the_targets_tensors_when_they_grow(tiny):
    """KVCache.grow replaces the target's tensors: the drafter's view of its first L layers must be taken again,
    else it drafts on the old tensors, which lack every position committed since (and have too few slots)."""
    model, tok = tiny
    ids = tok.encode(PROMPTS[1], chat=False)
    target = model.new_cache(len(ids))
    model.prefill(ids[:-1], target)
    d = EarlyExit(model, 1)
    d.propose(context(ids, target), 1)
    target.grow(len(ids) + 16)
    more = ids[:6]
    model(torch.tensor([[ids[-1]] + more[:-1]]), target)  # the verification commits six more tokens
    sampling = SamplingParams(temperature=1.0)
    got = d.propose(context(ids + more, target, sampling), 2)
    want = EarlyExit(model, 1).propose(context(ids + more, target, sampling), 2)
    assert got.tokens.tolist() == want.tokens.tolist()
    torch.testing.assert_close(got.q, want.q)


# --- sampling: the first tokens follow the target's law -------------------------------------------


def chi2(counts, probs, delta=1e-4):
    """Pearson's chi-square of counts against exact probs: (statistic, the 1 - delta quantile under H0)
    (tokens expected fewer than 5 times share one bin; Wilson-Hilferty for the quantile). A token
    the target never emits (probability 0) makes the statistic infinite."""
    n = float(counts.sum())
    if float(counts[probs == 0].sum()) > 0:
        return math.inf, 0.0
    expected = probs.double() * n
    big = expected >= 5
    obs = torch.cat([counts.double()[big], counts.double()[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    obs, exp = obs[exp > 0], exp[exp > 0]
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = max(len(exp) - 1, 1)
    z = statistics.NormalDist().inv_cdf(1 - delta)
    return stat, df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def target_law(model, ids, sampling):
    """Exact laws of the first two generated tokens under plain sampling: p1 [V] and sum_x p1(x) p2(.|x) [V]."""
    p1 = probs_from_logits(model(torch.tensor([ids]), model.new_cache(len(ids))).logits[0, -1], sampling)
    support = p1.nonzero().flatten()
    batch = torch.cat([torch.tensor([ids]).expand(len(support), -1), support[:, None]], dim=1)
    logits = model(batch, model.new_cache(len(ids) + 1, batch=len(support)), last_only=True).logits[:, -1]
    return p1, p1[support] @ probs_from_logits(logits, sampling)


SAMPLING = SamplingParams(temperature=1.0, top_k=4)  # a few outcomes per step: strong tests from few samples
N_SEEDS = 120


def first_tokens_match(model, tok, ids, drafter, sampling: SamplingParams = SAMPLING, n: int = N_SEEDS, k: int = 2):
    """Decode n seeds speculatively (k draft tokens, k + 1 new tokens, EOS off). Returns (ok, details): ok
    when the histograms of the first and second tokens pass a chi-square test against plain sampling's
    exact laws; a sampler that is not exact fails it (see the negative controls)."""
    tok = copy.copy(tok)
    tok.eos_ids = frozenset()  # every run emits its tokens
    p1, p2 = target_law(model, ids, sampling)
    counts = torch.zeros(2, p1.numel())
    for seed in range(n):
        r = run(model, tok, ids, drafter, k, max_new_tokens=k + 1, sampling=dataclasses.replace(sampling, seed=seed))
        counts[0, r.token_ids[0]] += 1
        counts[1, r.token_ids[1]] += 1
    tests = [chi2(counts[0], p1), chi2(counts[1], p2)]
    return all(stat <= limit for stat, limit in tests), dict(chi2=tests)


class ShiftedQ(EarlyExit):
    """A wrong drafter: samples its tokens from q but reports q's rows off by one (row i+1 for token i)."""

    def propose(self, ctx, k):
        d = super().propose(ctx, k)
        return Draft.chain(d.tokens, d.q.roll(-1, dims=0) if d.q is not None else None)


class HiddenQ(EarlyExit):
    """Samples from q but reports q = None. Not a bug: a deterministic draft is verified exactly whatever
    produced it (the proposal is drawn before, and independently of, the verifier's coin); it is only
    accepted less often (p(x) instead of min(1, p(x)/q(x)))."""

    def propose(self, ctx, k):
        return Draft.chain(super().propose(ctx, k).tokens, None)


@pytest.fixture(scope="module")
def sampled_llama(tmp_path_factory):
    from tests.tiny import save_tiny

    folder = save_tiny("llama", tmp_path_factory.mktemp("ee-sampling"))
    model, tok = load_transformer(folder, torch.float32), Tokenizer(folder)
    return model, tok, tok.encode("the cat", chat=False)


def test_sampled_first_tokens_follow_the_target(sampled_llama):
    model, tok, ids = sampled_llama
    ok, info = first_tokens_match(model, tok, ids, EarlyExit(model, 1, max_len=64))
    assert ok, info


def test_the_sampling_check_can_fail(sampled_llama):
    model, tok, ids = sampled_llama
    ok, info = first_tokens_match(model, tok, ids, ShiftedQ(model, 1, max_len=64))
    assert not ok and max(stat / limit for stat, limit in info["chi2"]) > 2, info  # clearly, not barely
    ok, info = first_tokens_match(model, tok, ids, HiddenQ(model, 1, max_len=64))
    assert ok, info


# --- choosing L by measurement -------------------------------------------------------------------------


def test_exit_layers_command_measures_caches_and_feeds_auto(tiny_folder, monkeypatch, tmp_path, capsys):
    import json
    from types import SimpleNamespace

    from specdec.cli import main
    from specdec.exit_layers import best_exit_layer, default_layers
    from specdec.store import measurement_path
    from specdec.drafters.early_exit import build_early_exit

    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"turns": ["abcabcabc"]}\n{"instruction": "fix", "declaration": "d", "buggy_solution": "b"}\n')
    assert main(["exit-layers", "--model", str(tiny_folder), "--dtype", "fp32", "--layers", "1,3", "--k", "2",
                 "--max-new-tokens", "8", "--prompts", str(prompts), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["exit_layer"] for r in out["rows"]] == [1, 3] and out["prompts"] == 2
    assert out["best"] == 1  # the whole model as draft is a reference row, never the best
    full = out["rows"][1]
    assert full["alpha"] == 1.0 and full["reused"] > 0  # the whole model as draft: every token accepted
    for r in out["rows"]:
        assert r["exit_layer"] / 3 <= r["tau"] and 0 <= r["alpha"] <= 1 and r["tokens_per_s"] > 0
    assert measurement_path("exit_layers", str(tiny_folder), "float32").is_file()

    model, tok = load_transformer(tiny_folder, torch.float32), Tokenizer(tiny_folder)
    llm = SimpleNamespace(name=str(tiny_folder), model=model, tokenizer=tok)
    best, report = best_exit_layer(llm, measure=False)  # from the cache: nothing measured again
    assert best == out["best"]
    d = build_early_exit(llm, "auto")
    assert d.exit_layer == best and d.tau_prior == report.row(best).tau and d.prior_alpha == report.row(best).alpha
    assert build_early_exit(llm, 2).tau_prior == pytest.approx(2 / 3)  # not measured: the layer fraction
    assert default_layers(30) == [4, 8, 11, 15, 19, 22] and default_layers(3) == [1, 2]
    for layers in ("9", "3"):  # past the model; only its last layer (it was measured and saved as the best)
        assert main(["exit-layers", "--model", str(tiny_folder), "--layers", layers]) == 2
        assert "exit layers must be in 1..3, at least one below 3" in capsys.readouterr().err


def test_exit_layers_refuses_bad_numbers_and_binary_prompts_before_loading(tmp_path, capsys):
    """--k 0 / --max-new-tokens 1 are refused naming the flags, before the model resolves (an unknown model here
    would be the error otherwise); a prompts file that is not UTF-8 is one line naming the file."""
    from specdec.cli import main

    for bad, said in ((["--k", "0"], "--k must be at least 1"), (["--max-new-tokens", "1"], "--max-new-tokens at least 2")):
        assert main(["exit-layers", "--model", "no-such-model", *bad]) == 2
        err = capsys.readouterr().err
        assert said in err and "unknown model" not in err
    binary = tmp_path / "p.txt"
    binary.write_bytes(b"\xff\xfe\x00bin")
    assert main(["exit-layers", "--model", "no-such-model", "--prompts", str(binary)]) == 2
    assert f"{binary}: not UTF-8 text" in capsys.readouterr().err


def test_exit_layers_outside_the_model_are_refused_before_it_loads(tiny_folder, capsys, monkeypatch):
    """`--layers 0`, `31` or `30` (the last) on a 30-layer model loaded it (minutes for a GGUF) before refusing:
    now the layer count is read from the folder first; a model not on disk is checked for L >= 1 at least."""
    import specdec.api
    from specdec.cli import main

    def no_load(*a, **kw):
        raise AssertionError("the model loaded")

    monkeypatch.setattr(specdec.api, "LLM", no_load)
    for layers in ("0", "9", "3", "1,4"):
        assert main(["exit-layers", "--model", str(tiny_folder), "--layers", layers]) == 2
        assert "exit layers must be in 1..3, at least one below 3" in capsys.readouterr().err
    assert main(["exit-layers", "--model", "no-such-model", "--layers", "-1"]) == 2
    err = capsys.readouterr().err
    assert "exit layers must be in 1 or more" in err and "unknown model" not in err


def test_exit_layers_prompt_files_are_blamed_for_what_they_are(tmp_path, capsys):
    """A folder given as --prompts read "no such prompts file"; a Spec-Bench record with no turns was told a
    HumanEvalFix record needs an instruction."""
    from specdec.cli import main

    assert main(["exit-layers", "--model", "no-such-model", "--prompts", str(tmp_path)]) == 2
    assert f"{tmp_path} is a folder, not a prompts file" in capsys.readouterr().err
    for record, said in (('{"turns": []}', "not a non-empty string in turns[0]"),
                         ('{"turns": [" "]}', "not a non-empty string in turns[0]"),
                         ('{"buggy_solution": "x"}', "a HumanEvalFix record needs an instruction too"),
                         ('{"prompt": ""}', "the prompt is not a non-empty string")):
        f = tmp_path / "p.jsonl"
        f.write_text(record + "\n")
        assert main(["exit-layers", "--model", "no-such-model", "--prompts", str(f)]) == 2
        err = capsys.readouterr().err
        assert f"{f}:1: " in err and said in err and ("HumanEvalFix" in err) == ("buggy" in record), err
