"""The fused block operations (`specdec.runtime.kernels.ops`): RoPE + cache write gives torch's bits, RMSNorm
gives each row the same bits whatever rows share the call (and RMSNorm's values), and an exact model's forward
takes them (so the speed they buy is real) while staying bit-identical across n."""

import pytest
import torch

from specdec.runtime.kernels import ops
from specdec.runtime.kv_cache import KVCache
from specdec.runtime.model import rotate
from tests.test_exact_bf16 import model  # noqa: F401 (the fixture)

pytestmark = pytest.mark.skipif(not ops.available(), reason="the fused-ops kernel is unavailable")


@pytest.mark.parametrize("B,n,H,Hk,D", [(1, 1, 12, 2, 128), (2, 5, 4, 4, 16), (1, 7, 9, 3, 64)])
@pytest.mark.parametrize("kv", [torch.float32, torch.float16, torch.bfloat16])
def test_rope_store_gives_torch_bits(B, n, H, Hk, D, kv):
    """q rotated in place, k rotated and v copied into the cache: torch's bits; into an fp16 or bf16 cache, rounded
    as torch's assignment into such a tensor rounds (to nearest, ties to even)."""
    g = torch.Generator().manual_seed(n)
    qkv = torch.randn(B, n, (H + 2 * Hk) * D, generator=g) * 3
    angles = torch.rand(B, n, D // 2, generator=g) * 100
    cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)[:, None]
    start, S = 3, 16
    mine, ref = KVCache(1, B, Hk, S, D, dtype=kv), KVCache(1, B, Hk, S, D, dtype=kv)
    q, k, v = qkv.split([H * D, Hk * D, Hk * D], dim=-1)
    want_q = rotate(q.reshape(B, n, H, D).transpose(1, 2), cos, sin)
    ref.write(0, rotate(k.reshape(B, n, Hk, D).transpose(1, 2), cos, sin), v.reshape(B, n, Hk, D).transpose(1, 2), start)
    got_q = ops.rope_store(qkv.clone(), cos, sin, mine, 0, start, H, Hk)
    assert torch.equal(got_q, want_q)
    assert torch.equal(mine.k[0], ref.k[0]) and torch.equal(mine.v[0], ref.v[0])
    assert mine.k[0][:, :, start:start + n].abs().sum() > 0  # written


@pytest.mark.parametrize("kv", [torch.float16, torch.bfloat16])
def test_rope_store_rounds_ties_to_even_and_keeps_nan(kv):
    """Values exactly halfway between two fp16 / bf16 numbers go to the even one, as torch's `.to()` rounds them,
    and a NaN stays a NaN (found by mutating ops.c: round-half-up and plain truncation of bf16 passed)."""
    ulp = 2.0 ** (-10 if kv == torch.float16 else -7)  # the step just above 1
    ties = torch.tensor([1 + ulp / 2, 1 + 3 * ulp / 2, -(1 + ulp / 2), -(1 + 3 * ulp / 2), 2 + ulp, 3 + 3 * ulp,
                         0.0, float("nan")])  # -> 1, 1 + 2 ulp, -1, -(1 + 2 ulp), 2, 3 + 4 ulp (even mantissas)
    D, H, Hk = 8, 1, 1
    qkv = torch.zeros(1, 1, (H + 2 * Hk) * D)
    qkv[0, 0, 2 * D:] = ties  # v: copied without rotation
    cos, sin = torch.ones(1, 1, 1, D), torch.zeros(1, 1, 1, D)
    cache = KVCache(1, 1, Hk, 4, D, dtype=kv)
    ops.rope_store(qkv, cos, sin, cache, 0, 2, H, Hk)
    got, want = cache.v[0][0, 0, 2], ties.to(kv)
    assert torch.equal(got[:7].view(torch.int16), want[:7].view(torch.int16)), (got, want)
    assert bool(got[7].isnan())  # (torch's own NaN bits differ between its conversion routes)
    assert got[:6].tolist() == [1.0, 1 + 2 * ulp, -1.0, -(1 + 2 * ulp), 2.0, 3 + 4 * ulp]


@pytest.mark.parametrize("d", [8, 13])
def test_rmsnorm_adds_eps_to_the_mean_square(d):
    """eps is added to mean(x^2), not to the sum of squares: x = 1e-3 everywhere, eps = 3e-6 gives
    1e-3 / sqrt(1e-6 + 3e-6) = 0.5 (with eps inside the sum, 1e-3 / sqrt(1e-6 + 3e-6 / d) instead)."""
    x = torch.full((2, d), 1e-3)
    torch.testing.assert_close(ops.rmsnorm(x, torch.ones(d), 3e-6), torch.full((2, d), 0.5), rtol=1e-5, atol=0)


@pytest.mark.parametrize("d", [576, 1536, 13])  # SmolLM2, Qwen 1.5B, a tail that is not a multiple of 8
def test_rmsnorm_rows_do_not_depend_on_n(d):
    g = torch.Generator().manual_seed(d)
    x, w = torch.randn(9, d, generator=g) * 5, torch.randn(d, generator=g)
    together = ops.rmsnorm(x, w, 1e-6)
    for i in range(9):
        assert torch.equal(ops.rmsnorm(x[i:i + 1], w, 1e-6), together[i:i + 1])
    want = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(together, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(ops.rmsnorm(x.t().contiguous().t(), w, 1e-6), together)  # a strided input


def test_exact_model_takes_the_fused_path(model, monkeypatch):  # noqa: F811
    """An exact bf16 model runs its layers in one C call per forward (`FusedLayers`), bit-identical across n."""
    calls = []
    real = ops.forward_layers
    monkeypatch.setattr(ops, "forward_layers", lambda *a, **k: calls.append(a[5][5]) or real(*a, **k))
    cache = model.new_cache(64)
    tokens = torch.tensor([[3, 17, 5, 9, 11, 2]])
    chain = model(tokens, cache).logits
    assert calls == [6]  # one call, over 6 rows
    cache.reset()
    for i in range(tokens.shape[1]):  # one position at a time: the same bits
        assert torch.equal(model(tokens[:, i:i + 1], cache).logits[0, 0], chain[0, i])


@pytest.mark.parametrize("I", [8960, 1536, 13, 9])  # Qwen 1.5B, SmolLM2, tails that are not a multiple of 8
def test_silu_mul_is_silu_times_up_and_rows_do_not_depend_on_n(I):
    g = torch.Generator().manual_seed(I)
    gu = torch.randn(5, 2 * I, generator=g) * 6
    gu[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -87.5])  # far tails: e^-g over- and underflows
    together = ops.silu_mul(gu)
    for i in range(5):
        assert torch.equal(ops.silu_mul(gu[i:i + 1]), together[i:i + 1])
    want = torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]
    torch.testing.assert_close(together, want, rtol=3e-7, atol=1e-30)


def fused_and_python(model, monkeypatch, tokens, **kw):
    """model(tokens) on a fresh cache through `FusedLayers` and through `Block.forward`: (fused, python)."""
    outs = []
    for fused in ("1", "0"):
        monkeypatch.setenv("SPECDEC_FUSED", fused)
        model.__dict__.pop("fused_layers", None)
        assert (model.fused_layers is not None) == (fused == "1")
        cache = model.new_cache(64)
        model(torch.tensor([[4, 8, 15, 16, 23, 42, 7]]), cache)  # a context in the cache first
        outs.append(model(tokens, cache, **kw))
    model.__dict__.pop("fused_layers", None)
    return outs


def test_fused_layers_give_the_python_route_bits(model, monkeypatch):  # noqa: F811
    """The same bits as `Block.forward` layer by layer: a chain with hidden states, a tree's mask, an early exit."""
    tokens = torch.tensor([[3, 17, 5, 9]])
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    mask = torch.cat([torch.ones(4, 7, dtype=torch.bool), tree], 1)[None]
    for kw in ({"hidden_layers": (0, 1, -1)}, {"mask": mask, "positions": torch.tensor([[7, 8, 8, 9]])},
               {"exit_layer": 1, "hidden_layers": (0,)}):
        fused, python = fused_and_python(model, monkeypatch, tokens, **kw)
        assert torch.equal(fused.logits, python.logits)
        assert fused.hidden.keys() == python.hidden.keys()
        assert all(torch.equal(fused.hidden[i], python.hidden[i]) for i in fused.hidden)


def test_fused_layers_off_the_exact_path(tmp_path):
    """An fp32 model (torch's matmuls, not row-exact) keeps `Block.forward`."""
    from specdec.runtime.loader import load_transformer
    from tests.tiny import save_tiny

    assert load_transformer(save_tiny("qwen2", tmp_path), torch.float32).fused_layers is None


def test_argmax_gives_torch_indices_ties_nans_and_views():
    """ops.argmax (greedy verification's) against torch.argmax: the first maximal index, a NaN counting as
    maximal, rows of every length (whole octets and tails), all -inf, 1-D rows and strided views."""
    g = torch.Generator().manual_seed(0)
    for trial in range(600):
        n = 49152 if trial % 50 == 0 else int(torch.randint(1, 40, (1,), generator=g))
        x = torch.randint(-2, 3, (int(torch.randint(1, 6, (1,), generator=g)), n), generator=g).float()  # ties
        if trial % 4 == 0:
            x[torch.rand(x.shape, generator=g) < 0.1] = float("nan")
        if trial % 9 == 0:
            x[:] = float("-inf")
        if trial % 7 == 0 and n > 1:
            x = x[:, 1:]  # row stride past the row's length
        assert torch.equal(ops.argmax(x), x.argmax(-1)), x
        assert torch.equal(ops.argmax(x[-1]), x[-1].argmax()), x[-1]


def test_topk_rows_are_the_largest_in_order_ties_to_the_lower_index():
    """ops.topk_rows (token recycling's table) against a stable descending sort: the k largest of each row,
    largest first, equal values in index order, rows of every length (whole octets and tails) and strided
    views; a row with fewer than k entries above -inf (or NaN) gets torch's topk."""
    g = torch.Generator().manual_seed(0)
    for trial in range(600):
        n = 49152 if trial % 50 == 0 else int(torch.randint(1, 40, (1,), generator=g))
        k = int(torch.randint(1, min(n, 6) + 1, (1,), generator=g))
        x = torch.randint(-3, 4, (int(torch.randint(1, 6, (1,), generator=g)), n), generator=g).float()  # ties
        if trial % 3 == 0:
            x = x + torch.rand(x.shape, generator=g)  # distinct values too
        if trial % 7 == 0 and n > 1:
            x = x[:, 1:]
            k = min(k, n - 1)
        want = torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :k]
        assert torch.equal(ops.topk_rows(x, k), want), (x, k)
    x = torch.tensor([[float("-inf"), 2.0, float("nan"), float("-inf")]])
    assert torch.equal(ops.topk_rows(x, 2), x.topk(2).indices)
    assert ops.topk_rows(x, 1).tolist() == [[1]]
