"""KV caches are sized by what a request can use: a huge k costs no memory, a large valid k never overflows
a drafter's cache partway through, and absurd lookahead settings are refused in one line."""

import json

import pytest
import torch

from specdec.adaptive import FixedK
from specdec.decode import Request, decode
from specdec.drafters.base import Context
from specdec.drafters.draft_model import DraftModel
from specdec.drafters.early_exit import EarlyExit
from specdec.drafters.lookahead import Lookahead
from specdec.drafters.prompt_lookup import PromptLookup
from specdec.runtime.kv_cache import KVCache
from specdec.runtime.loader import load_transformer
from specdec.sampling import SamplingParams
from specdec.tokenizer import Tokenizer
from tests.tiny import save_tiny


@pytest.fixture(scope="module")
def long_tiny(tmp_path_factory):
    """The tiny Llama with an 8k context and no end-of-sequence token, so long requests run to their limit."""
    folder = save_tiny("llama", tmp_path_factory.mktemp("long"))
    cfg = json.loads((folder / "config.json").read_text())
    cfg["max_position_embeddings"] = 8192
    (folder / "config.json").write_text(json.dumps(cfg))
    model, tok = load_transformer(folder), Tokenizer(folder)
    tok.eos_ids = frozenset()
    return model, tok


def sizes(monkeypatch, model):
    """Record the length of every cache the model allocates."""
    seen = []
    new_cache = model.new_cache

    def record(max_len=None, batch=1):
        seen.append(max_len)
        return new_cache(max_len, batch)

    monkeypatch.setattr(model, "new_cache", record)
    return seen


def run(model, tok, ids, drafter, k, new):
    return list(decode(model, tok, ids, Request(max_new_tokens=new), drafter, FixedK(k)))[-1].result


@pytest.mark.parametrize("drafter", [PromptLookup(), Lookahead(window=3, ngram=16, guesses=3)])
def test_a_huge_k_is_cut_to_the_tokens_left(long_tiny, monkeypatch, drafter):
    model, tok = long_tiny
    ids = tok.encode("abcabcabcabc", chat=False)
    seen = sizes(monkeypatch, model)
    r = run(model, tok, ids, drafter, 10**12, 4)
    assert r.new_tokens == 4
    assert seen == [len(ids) + 4 + drafter.room(3) + 1] and seen[0] < 200


def test_lookahead_room_counts_what_a_forward_carries():
    la = Lookahead(window=3, ngram=4, guesses=2)
    assert la.room(2) == 2 * 2                  # near the limit: candidates cut to 2, no window
    assert la.room(3) == 2 * 3 + 3 * 3          # G candidates of N-1 tokens and the W x (N-1) window
    assert la.room(10**12) == la.room(3)


@pytest.mark.parametrize("settings", [dict(ngram=10**9), dict(window=10**9), dict(guesses=10**9), dict(ngram=1)])
def test_absurd_lookahead_settings_are_refused(settings):
    with pytest.raises(ValueError, match="lookahead needs"):
        Lookahead(**settings)


def test_draft_model_with_a_large_k_runs_to_the_limit(long_tiny):
    model, tok = long_tiny
    ids = tok.encode("Count from 1 to 1000.", chat=False)
    twin = DraftModel(model, model.cfg.vocab_size, model.cfg.vocab_size)  # drafts the target's own tokens
    r = run(model, tok, ids, twin, 600, 700)
    assert r.new_tokens == 700 and r.accepted >= 600
    assert twin.cache.max_len <= len(ids) + 700 + 1


def test_early_exit_with_a_large_k_runs_to_the_limit(long_tiny):
    model, tok = long_tiny
    ids = tok.encode("Count from 1 to 1000. " * 190, chat=False)  # 4180 tokens: past the old 4096-slot floor
    whole = EarlyExit(model, model.cfg.num_layers)  # every layer: drafts the target's own tokens
    r = run(model, tok, ids, whole, 300, 310)  # drafting on the target's cache
    assert r.new_tokens == 310 and r.accepted >= 300 and whole.shared
    whole.reset()  # and on its own cache, sized by the request
    ctx = Context(tokens=ids, prompt_len=len(ids), sampling=SamplingParams(), generator=torch.Generator(),
                  remaining=310)
    assert len(whole.propose(ctx, 300)) == 300 and not whole.shared
    assert whole.cache.max_len == len(ids) + 310


def test_grow_keeps_the_cached_positions():
    cache = KVCache(2, 1, 2, 4, 3)
    cache.write(1, torch.ones(1, 2, 3, 3), torch.full((1, 2, 3, 3), 2.0), 0)
    cache.length = 3
    before = cache.pointers()
    cache.grow(10)
    assert cache.max_len == 10 and cache.k[1].shape[2] == 10 and cache.length == 3
    # the fused layers' addresses follow the new tensors
    assert cache.pointers() == [t.data_ptr() for t in (cache.k[0], cache.v[0], cache.k[1], cache.v[1])] != before
    assert bool((cache.k[1][:, :, :3] == 1).all()) and bool((cache.v[1][:, :, :3] == 2).all())
    cache.grow(5)
    assert cache.max_len == 10


# --- the bounds of compact (found by mutating kv_cache.py) ---


def _cache(length):
    c = KVCache(1, 1, 1, 8, 1)
    c.k[0][0, 0, :length, 0] = torch.arange(length, dtype=torch.float32)
    c.length = length
    return c


@pytest.mark.parametrize("keep", [[3], [-1]])
def test_compact_refuses_slots_outside_the_newest(keep):
    with pytest.raises(ValueError):
        _cache(5).compact(keep, newest=3)


def test_compact_may_cover_the_whole_cache():  # a one-token prompt's first tree round
    c = _cache(3)
    c.compact([0, 2], newest=3)
    assert c.length == 2 and c.k[0][0, 0, :2, 0].tolist() == [0.0, 2.0]
