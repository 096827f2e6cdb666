"""CUDA graphs' captured forward (`specdec.runtime.cuda_graphs`), run eagerly on the CPU: the same logits, hidden
states and KV cache as the eager forward for chains, padded widths, trees, hidden layers and last-only rows, and
plain decoding's greedy tokens from every drafter when every eligible forward takes it. The capture itself needs a
GPU (tests/test_device.py)."""

import pytest
import torch

from specdec.runtime import cuda_graphs
from specdec.runtime.loader import load_transformer
from tests.tiny import save_tiny


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_transformer(save_tiny("qwen2", tmp_path_factory.mktemp("graphs")), torch.float32)


def twin_caches(model, prompt, max_len=40):
    a, b = model.new_cache(max_len), model.new_cache(max_len)
    model.prefill(prompt, a)
    model.prefill(prompt, b)
    return a, b


def test_widths():
    assert [cuda_graphs.width(n) for n in (1, 2, 3, 5, 33, 64, 65)] == [1, 2, 4, 8, 64, 64, None]


@pytest.mark.parametrize("n", [1, 2, 3, 7])
def test_a_chain_matches_the_eager_forward(model, n):
    a, b = twin_caches(model, [1, 5, 9, 13, 17, 21])
    tokens = torch.tensor([[30 + i for i in range(n)]])
    want = model(tokens, a, hidden_layers=(0, -1))
    mask, _ = model.attention_plan(n, b.length)
    logits, hidden = cuda_graphs.forward(model, tokens, b, range(b.length, b.length + n), mask, (0, -1), False)
    assert b.length == a.length and logits.shape == want.logits.shape
    torch.testing.assert_close(logits, want.logits, rtol=1e-5, atol=1e-5)
    for i in (0, -1):
        torch.testing.assert_close(hidden[i], want.hidden[i], rtol=1e-5, atol=1e-5)
    for layer in range(model.cfg.num_layers):  # the written KV, not the padding rows' (past the length)
        torch.testing.assert_close(b.k[layer][:, :, :b.length], a.k[layer][:, :, :a.length], rtol=1e-5, atol=1e-5)
    nxt = torch.tensor([[44]])  # the next step reads what this one wrote
    torch.testing.assert_close(cuda_graphs.forward(model, nxt, b, range(b.length, b.length + 1), None, (), True)[0],
                               model(nxt, a, last_only=True).logits, rtol=1e-5, atol=1e-5)


def test_padding_rows_see_their_own_slot_and_last_only_is_the_last_real_row(model):
    """Three positions after 5 cached run as width 4: the padding row attends its own slot alone (a row that sees
    nothing gives NaN on some kernels, and NaN values poison every row that weighs them by 0); `last_only` is the
    third row, not the padding's."""
    x = cuda_graphs.Inputs(4, 12, "cpu")
    x.fill(torch.tensor([[7, 8, 9]]), 5, range(5, 8), None)
    mask = x.mask[0, 0]
    assert x.tokens.tolist() == [[7, 8, 9, 0]] and x.slots.tolist() == [5, 6, 7, 8]
    assert mask[3].nonzero().flatten().tolist() == [8]
    assert [row.nonzero().flatten().tolist() for row in mask[:3]] == [list(range(6)), list(range(7)), list(range(8))]
    a, b = twin_caches(model, [1, 5, 9, 13, 17])
    tokens = torch.tensor([[30, 31, 32]])
    want = model(tokens, a, last_only=True).logits
    got, _ = cuda_graphs.forward(model, tokens, b, range(5, 8), model.attention_plan(3, 5)[0], (), True)
    assert got.shape == want.shape == (1, 1, model.cfg.vocab_size)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_tree_matches_the_eager_forward(model):
    """Five nodes (root, two children, a grandchild under each): positions by depth, the ancestors' mask."""
    a, b = twin_caches(model, [1, 5, 9, 13])
    parents = [-1, 0, 0, 1, 2]
    tokens = torch.tensor([[40, 41, 42, 43, 44]])
    start, n = a.length, 5
    mask = torch.zeros(1, n, start + n, dtype=torch.bool)
    mask[0, :, :start] = True
    depth = []
    for i, p in enumerate(parents):
        mask[0, i, start + i] = True
        j = p
        while j >= 0:
            mask[0, i, start + j] = True
            j = parents[j]
        depth.append(0 if p < 0 else depth[p] + 1)
    positions = torch.tensor([[start + d for d in depth]])
    want = model(tokens, a, positions=positions, mask=mask)
    plan_mask, _ = model.attention_plan(n, start, mask)
    logits, _ = cuda_graphs.forward(model, tokens, b, positions, plan_mask, (), False)
    torch.testing.assert_close(logits, want.logits, rtol=1e-5, atol=1e-5)


def test_what_it_leaves_to_the_eager_forward(model):
    cache = model.new_cache(9)
    model.prefill([1, 2, 3, 4, 5, 6], cache)
    assert cuda_graphs.forward(model, torch.tensor([[7, 8, 9]]), cache, range(6, 9), None, (), False) is None  # 6 + 4 > 9
    assert cache.length == 6
    wide = model.new_cache(200)
    assert cuda_graphs.forward(model, torch.ones(1, 65, dtype=torch.long), wide, range(65), None, (), False) is None
    half = model.new_cache(20)
    half.k = [k.half() for k in half.k]
    assert cuda_graphs.forward(model, torch.tensor([[7]]), half, range(1), None, (), False) is None
    assert not cuda_graphs.enabled(model)  # a CPU model never takes it by itself


def test_every_drafter_gives_plain_tokens_through_it(model, tmp_path, monkeypatch):
    """Every forward that can take the captured route takes it (as on a GPU): greedy tokens equal plain's."""
    from specdec.api import LLM
    from tests.test_device import save_heads

    folder = save_tiny("qwen2", tmp_path / "m")
    heads = save_heads(folder, tmp_path)
    draft = save_tiny("qwen2", tmp_path / "draft", seed=1)
    ids = [1, 2, 3, 4, 5, 1, 2, 3]
    plain = LLM(str(folder), dtype="fp32").generate(ids, max_new_tokens=16).token_ids
    calls = []
    graphed = cuda_graphs.forward
    monkeypatch.setattr(cuda_graphs, "enabled", lambda m: True)
    monkeypatch.setattr(cuda_graphs, "forward", lambda *a: calls.append(a[1].shape[1]) or graphed(*a))
    llm = LLM(str(folder), dtype="fp32", draft=str(draft), sources="prompt-lookup,draft")
    for method in ("plain", "prompt-lookup", "lookahead", "early-exit", "recycling", "draft", "hybrid"):
        assert llm.generate(ids, method=method, max_new_tokens=16).token_ids == plain, method
    for method, where in heads.items():
        got = LLM(str(folder), dtype="fp32", heads=str(where)).generate(ids, method=method, max_new_tokens=16)
        assert got.token_ids == plain, method
    assert calls and max(calls) > 1  # verification forwards went through it, not only single steps


def test_the_cache_pool_never_hands_out_a_cache_in_use(model, monkeypatch):
    monkeypatch.setattr(cuda_graphs, "enabled", lambda m: True)
    model.__dict__.pop("cache_pool", None)
    a = model.new_cache(100)
    b = model.new_cache(900)
    assert a is not b and a.max_len == b.max_len == cuda_graphs.CACHE_ROUND
    model.prefill([1, 2, 3], a)
    assert cuda_graphs.forward(model, torch.tensor([[4]]), a, range(3, 4), None, (), False) is not None
    graphs, ident = a.graphs, id(a)
    del a
    c = model.new_cache(10)  # a's, emptied, its graphs kept
    assert id(c) == ident and c.length == 0 and c.graphs is graphs and c is not b
    assert model.new_cache(cuda_graphs.CACHE_ROUND + 1).max_len == 2 * cuda_graphs.CACHE_ROUND
    assert len(model.cache_pool) == 3
    model.__dict__.pop("cache_pool")


def test_a_step_that_ends_at_the_caches_last_slot_takes_it(model):
    """start + width == max_len fits (the padding's last slot is max_len - 1): only a step past the end is left to
    the eager forward."""
    a, b = twin_caches(model, [1, 2, 3, 4, 5, 6], max_len=8)
    tokens = torch.tensor([[7, 8]])
    got = cuda_graphs.forward(model, tokens, b, range(6, 8), model.attention_plan(2, 6)[0], (), False)
    assert got is not None and b.length == 8
    torch.testing.assert_close(got[0], model(tokens, a).logits, rtol=1e-5, atol=1e-5)


def test_pooled_caches_round_up_to_the_next_multiple_only(model, monkeypatch):
    monkeypatch.setattr(cuda_graphs, "enabled", lambda m: True)
    model.__dict__.pop("cache_pool", None)
    r = cuda_graphs.CACHE_ROUND
    assert [model.new_cache(n).max_len for n in (1, r, r + 1, 2 * r)] == [r, r, 2 * r, 2 * r]
    model.__dict__.pop("cache_pool")


def test_batches_stay_eager(model, monkeypatch):
    """Graphs take one row: a two-row cache is a plain one of the length asked, not pooled, and a two-row forward
    runs eagerly (the same logits)."""
    tokens = torch.tensor([[1, 5, 9], [2, 6, 10]])
    want = model(tokens, model.new_cache(16, batch=2)).logits
    monkeypatch.setattr(cuda_graphs, "enabled", lambda m: True)
    model.__dict__.pop("cache_pool", None)
    cache = model.new_cache(16, batch=2)
    assert cache.k[0].shape[0] == 2 and cache.max_len == 16 and not model.__dict__.get("cache_pool")

    def graphed(*a):
        raise AssertionError("a two-row forward went through the graph")

    monkeypatch.setattr(cuda_graphs, "forward", graphed)
    torch.testing.assert_close(model(tokens, cache).logits, want)


def test_a_grown_cache_drops_its_old_graphs_and_leaves_the_pool_when_let_go(model, monkeypatch):
    """A drafter's cache may `grow` (new tensors): graphs of the old tensors go, and once nobody holds the grown
    cache (its length no multiple of the rounding) the pool lets it go instead of keeping it forever."""
    monkeypatch.setattr(cuda_graphs, "enabled", lambda m: True)
    model.__dict__.pop("cache_pool", None)
    cache = model.new_cache(100)
    model.prefill([1, 2, 3], cache)
    cuda_graphs.forward(model, torch.tensor([[4]]), cache, range(3, 4), None, (), False)
    cache.grow(cuda_graphs.CACHE_ROUND + 5)
    cuda_graphs.forward(model, torch.tensor([[5]]), cache, range(4, 5), None, (), False)
    assert len(cache.graphs) == 1 and next(iter(cache.graphs))[2] == cache.k[0].data_ptr()
    held = model.new_cache(100)
    assert held is not cache and len(model.cache_pool) == 2
    del cache
    model.new_cache(5000)
    assert held in model.cache_pool and len(model.cache_pool) == 2  # the grown one went, a 5120-slot one came
    model.__dict__.pop("cache_pool")


def test_no_garbage_collection_while_a_graph_captures(model, monkeypatch):
    """torch no longer collects before a capture, so a collection during one could free a dead cycle's CUDA graph,
    which invalidates the capture (session 32's H200: a test's dead LLMs). The capture runs with the collector off,
    and it is back on afterwards, also when the capture fails. CUDA's calls are faked here: the CPU has none."""
    import contextlib
    import gc
    from types import SimpleNamespace

    seen = []

    @contextlib.contextmanager
    def graph(g, pool=None):
        seen.append(gc.isenabled())
        yield

    stream = SimpleNamespace(wait_stream=lambda other: None)
    for name, fake in dict(Stream=lambda: stream, stream=lambda s: contextlib.nullcontext(), graph=graph,
                           current_stream=lambda: stream, graph_pool_handle=lambda: object(),
                           CUDAGraph=lambda: SimpleNamespace(replay=lambda: None)).items():
        monkeypatch.setattr(torch.cuda, name, fake)
    cache = model.new_cache(16)
    model.prefill([1, 5, 9], cache)
    assert gc.isenabled()
    cuda_graphs.Graph(model, 2, cache.max_len, (), capture=True).run(cache)
    assert seen == [False] and gc.isenabled()
    calls = []
    monkeypatch.setattr(cuda_graphs, "static_forward", lambda *a: calls.append(1) or len(calls) > 1 and 1 / 0)
    with pytest.raises(ZeroDivisionError):  # the warm-up runs, the capture fails
        cuda_graphs.Graph(model, 2, cache.max_len, (), capture=True).run(cache)
    assert gc.isenabled()
