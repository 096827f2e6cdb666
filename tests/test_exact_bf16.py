"""bf16 weights on the kernel: every forward that verifies (a chain, a tree, a lookahead window, early exit's
KV reuse) gives, at every position, exactly (torch.equal) the logits of single-position forwards over the
keys that position sees: the cache, then its ancestors in order. Greedy speculation then cannot flip a
near-tie, whatever the draft's shape."""

import pytest
import torch

from specdec.draft import Aux, Draft, forward_layout
from specdec.drafters.base import Context
from specdec.drafters.early_exit import EarlyExit
from specdec.drafters.lookahead import trie, window_layout
from specdec.runtime import kernels
from specdec.runtime.loader import load_transformer, matmul_path
from specdec.sampling import SamplingParams
from tests.tiny import VOCAB, save_tiny

CONTEXT = 70  # past one 64-key block: every verified row's keys cross a block boundary of the exact attention


@pytest.fixture(scope="module", params=[p for p in kernels.PATHS if p != "torch"])
def model(tmp_path_factory, request):
    """The tiny model in bf16 on each of the kernel's paths (one the CPU lacks skips with the reason)."""
    why = kernels.unavailable(request.param)
    if why:
        pytest.skip(f"{request.param}: {why}")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECDEC_MATMUL", request.param)
        model = load_transformer(save_tiny("qwen2", tmp_path_factory.mktemp("bf16")), torch.bfloat16)
    assert model.row_exact and matmul_path(model) == request.param
    return model


def context(seed=3, n=CONTEXT):
    return torch.randint(3, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def prefilled(model, ctx):
    cache = model.new_cache(256)
    model(ctx, cache)
    return cache


def singles(model, ctx, path_tokens: list[int]) -> torch.Tensor:
    """Logits after the last of `path_tokens`, fed one position at a time after `ctx` (plain decoding)."""
    cache = prefilled(model, ctx)
    for t in path_tokens:
        logits = model(torch.tensor([[t]]), cache).logits[0, -1]
    return logits


def check_layout(model, draft: Draft, root: int, seed: int = 3):
    """One masked verification forward (as `decode` makes it) against single-position forwards per row.
    Returns the forward's cache."""
    ctx = context(seed)
    cache = prefilled(model, ctx)
    offsets, local = forward_layout(draft)
    extra = draft.aux.tokens.tolist() if draft.aux is not None else []
    inputs = [root] + draft.tokens.tolist() + extra
    n = len(inputs)
    mask = torch.ones(1, n, CONTEXT + n, dtype=torch.bool)
    mask[0, :, CONTEXT:] = local
    if draft.is_chain and draft.aux is None:  # decode's chain call: default positions and causal attention
        out = model(torch.tensor([inputs]), cache).logits[0]
    else:
        out = model(torch.tensor([inputs]), cache, positions=(CONTEXT + offsets)[None], mask=mask).logits[0]
    for row in range(n):
        path = local[row].nonzero().flatten().tolist()  # the root, the row's ancestors, the row
        assert len(path) == int(offsets[row]) + 1
        assert torch.equal(out[row], singles(model, ctx, [inputs[j] for j in path])), row
    return cache


def test_chain_verifies_bit_identically(model):
    check_layout(model, Draft.chain([5, 9, 11, 40, 7, 7, 30]), root=12)


def test_an_fp32_cache_verifies_bit_identically_too(model, monkeypatch):
    """The exact path keeps its KV cache in fp16 unless `--kv-dtype fp32` asks (the tests above ran fp16): a chain
    and a tree stay bit-identical to single positions over an fp32 cache, whose logits differ from fp16's."""
    assert model.new_cache(8).k[0].dtype == torch.float16
    half = singles(model, context(), [12, 5])
    monkeypatch.setattr(model, "kv_choice", torch.float32)
    assert model.new_cache(8).k[0].dtype == torch.float32
    assert not torch.equal(singles(model, context(), [12, 5]), half)
    check_layout(model, Draft.chain([5, 9, 11, 40, 7, 7, 30]), root=12)
    check_layout(model, trie([(20, 21, 22), (20, 23, 24), (30, 31, 32)], 3), root=17)


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """A tiny bf16 model with head dims of 32 (hidden 128, 4 heads), on the best kernel path: with a bf16 cache it
    attends on AMX tiles where the CPU has them."""
    return load_transformer(save_tiny("qwen2", tmp_path_factory.mktemp("wide"), hidden_size=128), torch.bfloat16)


def test_a_bf16_cache_verifies_bit_identically_too(model, wide, monkeypatch):
    """`--kv-dtype bf16`: on every kernel path (head dim 16: the FMA attention over widened bf16) and with head dims
    of 32 (AMX attention where the CPU has it: bf16 q, p and v), a chain, a tree and a lookahead window stay
    bit-identical to single positions."""
    from specdec.runtime.kernels import attention
    from specdec.runtime.loader import attention_path
    amx = "amx" in attention.isas()  # the default: bf16 where bf16 weights attend on tiles, else fp16
    assert wide.kv_dtype == (torch.bfloat16 if amx else torch.float16) and model.kv_dtype == torch.float16
    assert attention_path(wide) == ("amx, bf16 cache" if amx else f"{attention.isa(32)}, fp16 cache")
    for m in (model, wide):
        monkeypatch.setattr(m, "kv_choice", torch.bfloat16)
        assert m.new_cache(8).k[0].dtype == torch.bfloat16
        check_layout(m, Draft.chain([5, 9, 11, 40, 7, 7, 30]), root=12)
        check_layout(m, trie([(20, 21, 22), (20, 23, 24), (30, 31, 32)], 3), root=17)
        test_lookahead_window_verifies_bit_identically(m)
    assert attention.isa(wide.cfg.head_dim, torch.bfloat16) == attention.isas()[0]


def test_tree_verifies_bit_identically(model):
    g = torch.Generator().manual_seed(1)
    candidates = [tuple(torch.randint(3, VOCAB, (4,), generator=g).tolist()) for _ in range(5)]
    candidates += [candidates[0][:2] + (8, 9), candidates[1][:1] + (10, 11, 12)]  # shared prefixes: a real tree
    draft = trie(candidates, 4)
    assert not draft.is_chain and len(draft) > 12
    check_layout(model, draft, root=17)


def test_lookahead_window_verifies_bit_identically(model):
    window, levels = 4, 3
    g = torch.Generator().manual_seed(2)
    draft = trie([(20, 21, 22), (20, 23, 24), (30, 31, 32)], 3)
    offsets, mask = window_layout(window, levels)
    draft.aux = Aux(torch.randint(3, VOCAB, (window * levels,), generator=g), offsets, mask)
    check_layout(model, draft, root=44)


@pytest.mark.parametrize("exit_layer, shared", [(1, True), (2, True), (1, False), (2, False)])
def test_early_exit_reuse_verifies_bit_identically(model, exit_layer, shared):
    """Drafting on the target's cache (as `decode` does) or on the drafter's own."""
    ctx = context(4)
    tokens = ctx[0].tolist() + [19]
    drafter = EarlyExit(model, exit_layer)
    cache = prefilled(model, ctx)
    c = Context(tokens=tokens, prompt_len=len(tokens), sampling=SamplingParams(), generator=torch.Generator(),
                target_cache=cache if shared else None)
    draft = drafter.propose(c, 6)
    assert drafter.shared == shared
    inputs = torch.tensor([[19] + draft.tokens.tolist()])
    out = drafter.verify_forward(model, cache, inputs)
    assert out is not None and drafter.reused == 1  # the reuse path ran
    seq = inputs[0].tolist()
    for row in range(len(seq)):
        assert torch.equal(out.logits[0, row], singles(model, ctx, seq[:row + 1])), row
