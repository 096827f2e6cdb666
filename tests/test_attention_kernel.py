"""The exact-attention kernel (`specdec.runtime.kernels.attention`): n query rows in one call give, row for row,
the bits of a call for that row alone over its keys laid out as plain decoding lays them out (the cache, then
its ancestors and itself in consecutive slots), for chains, trees and lookahead-style windows, with and without
GQA, for any thread count, on every instruction set the CPU has; and the values are attention's (close to torch's)."""

import pytest
import torch
import torch.nn.functional as F

from specdec.draft import Draft
from specdec.runtime.kernels import attention
from tests.test_exact_bf16 import check_layout, model  # noqa: F401 (the fixture)

pytestmark = pytest.mark.skipif(not attention.available(), reason="the exact-attention kernel is unavailable")

SHAPES = [(4, 4, 16), (9, 3, 64), (12, 2, 128), (14, 2, 80), (14, 2, 72)]  # (H, Hk, D): no GQA, SmolLM2, Qwen 1.5B,
# D % 64 != 0 (AVX512's partial last chunk), D % 16 != 0 (AVX2 only)
ISAS = attention.isas() if attention.available() else []


def skip_unless_runs(use: str, D: int, kv: str = "bf16") -> None:
    """Skip, saying why, a case this CPU or this path cannot run."""
    if use not in ISAS:
        pytest.skip(f"this CPU lacks the {use} path")
    if use == "avx512" and D % 16:
        pytest.skip("the AVX512 path takes head dims that are multiples of 16")
    if use == "amx" and (D % 32 or kv != "bf16"):
        pytest.skip("the AMX path takes bf16 caches and head dims that are multiples of 32")


def random_paths(n: int, g: torch.Generator, tree: bool) -> list[list[int]]:
    """Row i sees itself and a set of earlier new positions: its ancestors under random parents (tree) or a
    random subset (a lookahead window's rows see such sets)."""
    paths = []
    for i in range(n):
        if tree:
            parent = int(torch.randint(-1, i, (1,), generator=g)) if i else -1
            paths.append((paths[parent] if parent >= 0 else []) + [i])
        else:
            paths.append([j for j in range(i) if torch.rand(1, generator=g) < 0.5] + [i])
    return paths


def single(q_row, k_new, v_new, keys, values, start, path, use):
    """Row alone, as plain decoding sees it: the cache's first `start` slots, then path's keys in consecutive slots."""
    k, v = keys.clone(), values.clone()
    k[:, :, start:start + len(path)] = k_new[:, :, path]
    v[:, :, start:start + len(path)] = v_new[:, :, path]
    return attention.attend(q_row, k, v, attention.Rows.chain(1, start + len(path) - 1), 1, use)[:, 0]


def inputs(H, Hk, D, start, n, seed, B=1):
    g = torch.Generator().manual_seed(seed)
    S = start + n + 8
    keys, values = torch.randn(B, Hk, S, D, generator=g), torch.randn(B, Hk, S, D, generator=g)
    q = torch.randn(B, n, H, D, generator=g).transpose(1, 2)  # [B, H, n, D], not contiguous, as the model's
    return q, keys, values, g


@pytest.mark.parametrize("H, Hk, D", SHAPES)
@pytest.mark.parametrize("layout", ["chain", "tree", "window"])
@pytest.mark.parametrize("threads", [1, 2, 5])
@pytest.mark.parametrize("use", list(attention.ISAS))
@pytest.mark.parametrize("start", [70, 190])
@pytest.mark.parametrize("kv", ["fp32", "fp16", "bf16"])
def test_rows_equal_single_row_calls(H, Hk, D, layout, threads, use, start, kv):
    """The lists cross a 64-key block boundary (after 70 or 190 cached positions), over an fp32, fp16 or bf16
    cache; on AMX (bf16 q, p and cache, fp32 sums) the values are within bf16's rounding of torch's."""
    skip_unless_runs(use, D, kv)
    n = 13
    q, keys, values, g = inputs(H, Hk, D, start, n, seed=H + D)
    if kv != "fp32":
        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[kv]
        keys, values = keys.to(dtype), values.to(dtype)
    paths = [list(range(i + 1)) for i in range(n)] if layout == "chain" else random_paths(n, g, layout == "tree")
    rows = attention.Rows.chain(n, start) if layout == "chain" else attention.Rows.from_paths(paths, start)
    k_new, v_new = keys[:, :, start:start + n].clone(), values[:, :, start:start + n].clone()
    out = attention.attend(q, keys, values, rows, threads, use)
    for i, path in enumerate(paths):
        alone = single(q[:, :, i:i + 1], k_new, v_new, keys, values, start, path, use)
        assert torch.equal(out[:, i], alone), (layout, i)
        # and the values are attention's: torch over the same keys
        slots = list(range(start)) + [start + j for j in path]
        ref = F.scaled_dot_product_attention(q[:, :, i:i + 1], keys[:, :, slots].float(), values[:, :, slots].float(),
                                             enable_gqa=H != Hk)
        tol = 2e-2 if use == "amx" else 1e-5
        torch.testing.assert_close(out[:, i], ref[:, :, 0], rtol=tol, atol=tol)


@pytest.mark.parametrize("H, Hk, D", SHAPES)
@pytest.mark.parametrize("use", ["avx512", "avx2"])
@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16])
def test_a_half_cache_reads_as_its_fp32_widening(H, Hk, D, use, half):
    """An fp16 or bf16 KV cache (`--kv-dtype`) gives, bit for bit, what the same call gives over an fp32 cache
    holding the widened values: the kernel's only change is the load (so every property the fp32 tests show,
    row-for-row exactness included, holds for them). Batches, a tree's extra slots and 13 rows crossing a 64-key
    block exercise the pointer arithmetic of 2-byte keys."""
    skip_unless_runs(use, D)
    start, n = 70, 13
    q, keys, values, g = inputs(H, Hk, D, start, n, seed=H * D, B=2)
    rows = attention.Rows.from_paths(random_paths(n, g, tree=True), start)
    k16, v16 = (keys * 4).to(half), (values * 4).to(half)  # beyond [-1, 1]: rounding at every magnitude
    out = attention.attend(q, k16, v16, rows, 2, use)
    assert out.dtype == torch.float32
    assert torch.equal(out, attention.attend(q, k16.float(), v16.float(), rows, 2, use))
    assert not torch.equal(out, attention.attend(q, keys * 4, values * 4, rows, 2, use))  # the rounding is real


@pytest.mark.parametrize("use", ["avx512", "avx2"])
@pytest.mark.parametrize("D", [64, 72])
def test_all_scores_far_below_zero_keep_their_weights(use, D):
    """Every score near -200: the softmax's max is the row's own, never a padding lane's 0 (a 5-, 13- or 70-key
    list leaves pad lanes in its last octet and 16-lane block); with 0 as the max every exp underflows and the row
    is 0 / 0 (found by mutating attention.c). Equal scores: the output is the mean of the values."""
    skip_unless_runs(use, D)
    g = torch.Generator().manual_seed(D)
    for L in (5, 13, 70):
        keys = torch.ones(1, 1, L + 3, D)
        values = torch.randn(1, 1, L + 3, D, generator=g)
        q = torch.full((1, 1, 1, D), -200.0 * D ** 0.5 / D)  # q . k / sqrt(D) = -200 for every key
        out = attention.attend(q, keys, values, attention.Rows.chain(1, L - 1), 1, use)
        torch.testing.assert_close(out[0, 0, 0], values[0, 0, :L].mean(0), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kv", [torch.float32, torch.bfloat16])
def test_batch_rows_are_their_own(kv):
    """B > 1: each batch element attends over its own cache, bit-identical to its call alone (on AMX for bf16)."""
    q, keys, values, _ = inputs(9, 3, 64, 30, 5, seed=7, B=3)
    keys, values = keys.to(kv), values.to(kv)
    rows = attention.Rows.chain(5, 30)
    out = attention.attend(q, keys, values, rows)
    for b in range(3):
        assert torch.equal(out[b:b + 1], attention.attend(q[b:b + 1], keys[b:b + 1], values[b:b + 1], rows))


def test_the_best_instruction_set_is_taken():
    fma = [i for i in ISAS if i != "amx"]
    assert ISAS[-1] == "avx2" and attention.isa(64) == fma[0] and attention.isa(72) == "avx2"
    assert attention.isa(64, torch.bfloat16) == ISAS[0] and attention.isa(48, torch.bfloat16) == fma[0]


@pytest.mark.parametrize("H, Hk, D", [(9, 3, 64), (12, 2, 128)])
def test_amx_rounds_as_torch_bf16_attention_rounds(H, Hk, D):
    """On AMX the rows are torch's attention over bf16 q, k, v with the softmax weights rounded to bf16 (its bf16
    math): much closer to that than to the fp32 attention over the same bf16 keys."""
    skip_unless_runs("amx", D)
    start, n = 100, 6
    q, keys, values, _ = inputs(H, Hk, D, start, n, seed=3)
    kb, vb = keys.bfloat16(), values.bfloat16()
    rows = attention.Rows.chain(n, start)
    out = attention.attend(q, kb, vb, rows, use="amx")
    qs = (q * D ** -0.5).bfloat16().float()
    G = H // Hk
    for i in range(n):
        k, v = kb[:, :, :start + i + 1].float(), vb[:, :, :start + i + 1].float()
        k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
        p = torch.softmax(qs[:, :, i:i + 1] @ k.transpose(-1, -2), -1)
        s = (qs[:, :, i:i + 1] @ k.transpose(-1, -2))
        e = torch.exp(s - s.amax(-1, keepdim=True)).bfloat16().float()
        ref = (e @ v) / e.sum(-1, keepdim=True)
        torch.testing.assert_close(out[:, i], ref[:, :, 0], rtol=1e-4, atol=1e-4)
        assert (out[:, i] - (p @ v)[:, :, 0]).abs().max() > 1e-4  # the weights' rounding is real


def test_unsupported_shapes_are_refused():
    q, keys, _, _ = inputs(4, 4, 16, 4, 2, seed=1)
    assert attention.supports(q, keys)
    assert not attention.supports(q[..., :12], keys[..., :12])  # head dim not a multiple of 8
    assert not attention.supports(q.double(), keys.double())
    assert attention.supports(q, keys.half()) and attention.supports(q, keys.bfloat16())
    assert not attention.supports(q[:, :3], keys)  # 3 query heads on 4 KV heads
    with pytest.raises(ValueError, match="must match"):
        attention.attend(q, keys.bfloat16(), keys.float(), attention.Rows.chain(2, 2))


def test_long_chain_verifies_bit_identically(model):  # noqa: F811
    """A chain longer than the torch fallback's ROW_EXACT_MAX (32) is exact too: the kernel has no limit."""
    check_layout(model, Draft.chain([(7 * i) % 60 + 3 for i in range(40)]), root=12)


def test_torch_fallback_stays_exact(model, monkeypatch):  # noqa: F811
    """Without the kernel the model attends row by row through torch (`RowPlan.steps`), still bit-identical.
    The module's model has already decided on its C routes (`Block.kernels`, `fused_layers`), so they are turned
    off here too, and the test checks that the row-by-row route really ran (it did not: a mutant of
    `RowPlan.steps` that never tracked which position each slot holds passed)."""
    from specdec.draft import Draft
    from specdec.drafters.lookahead import trie
    from specdec.runtime import model as model_module

    calls = []
    real, real_available = model_module.attend_rows, attention.available
    monkeypatch.setattr(model_module, "attend_rows", lambda *a, **k: calls.append(a[-2]) or real(*a, **k))
    monkeypatch.setattr(attention, "available", lambda: False)
    monkeypatch.setenv("SPECDEC_FUSED", "0")
    for block in model.layers:
        monkeypatch.setattr(block, "kernels", False)
    model.__dict__.pop("fused_layers", None)
    tree = trie([(5, 6, 7, 8), (5, 9), (5, 6, 10), (11, 12)], 4)
    try:
        check_layout(model, trie([(20, 21, 22), (20, 23, 24), (30, 31, 32)], 3), root=17)
        check_layout(model, Draft.chain([5, 9, 11, 40, 7, 7, 30]), root=12)  # a causal chain: RowPlan.steps' rows
        assert any(plan.paths is None for plan in calls)
        after_rows = check_layout(model, tree, root=3, seed=4)
        monkeypatch.setattr(attention, "available", real_available)  # the rows in one kernel call, from torch's
        kernel = check_layout(model, tree, root=3, seed=4)  # RoPE and cache write (`attend_rows`' first branch)
    finally:
        model.__dict__.pop("fused_layers", None)  # decided again, with the kernels, by the next test
    assert any(plan.paths is not None for plan in calls)  # the tree's rows went through RowPlan.steps
    # each new position's keys and values are back in its own slot after the rows moved them (`steps`' restore).
    # Layer 0's depend on the token and position only (the prompt, prefilled in one masked call here, does not
    # reach them), so the kernel route's cache holds the same bits there.
    new = slice(after_rows.length - len(tree) - 1, after_rows.length)
    assert torch.equal(after_rows.k[0][:, :, new], kernel.k[0][:, :, new])
    assert torch.equal(after_rows.v[0][:, :, new], kernel.v[0][:, :, new])


def test_a_mask_hiding_a_cached_slot_gets_no_row_plan():
    """RowPlan.from_mask: a plan only where every row sees the whole cache (the plan cannot hide a cached slot);
    else None, and the model keeps one masked attention call."""
    from specdec.runtime.model import RowPlan

    mask = torch.ones(1, 1, 3, 5, dtype=torch.bool)
    mask[0, 0, :, 2:] = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    assert RowPlan.from_mask(mask, 2).paths == [[0], [0, 1], [0, 2]]
    assert RowPlan.from_mask(mask.expand(2, 1, 3, 5), 2) is None  # per-batch masks
    mask[0, 0, 1, 0] = False  # row 1 may not see cached slot 0
    assert RowPlan.from_mask(mask, 2) is None
