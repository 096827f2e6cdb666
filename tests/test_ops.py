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
def test_rope_store_gives_torch_bits(B, n, H, Hk, D):
    g = torch.Generator().manual_seed(n)
    qkv = torch.randn(B, n, (H + 2 * Hk) * D, generator=g) * 3
    angles = torch.rand(B, n, D // 2, generator=g) * 100
    cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)[:, None]
    start, S = 3, 16
    mine, ref = KVCache(1, B, Hk, S, D), KVCache(1, B, Hk, S, D)
    q, k, v = qkv.split([H * D, Hk * D, Hk * D], dim=-1)
    want_q = rotate(q.reshape(B, n, H, D).transpose(1, 2), cos, sin)
    ref.write(0, rotate(k.reshape(B, n, Hk, D).transpose(1, 2), cos, sin), v.reshape(B, n, Hk, D).transpose(1, 2), start)
    got_q = ops.rope_store(qkv.clone(), cos, sin, mine, 0, start, H, Hk)
    assert torch.equal(got_q, want_q)
    assert torch.equal(mine.k[0], ref.k[0]) and torch.equal(mine.v[0], ref.v[0])


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
    calls = {"rope_store": 0, "rmsnorm": 0}
    for name in calls:
        real = getattr(ops, name)

        def counted(*a, _real=real, _name=name, **k):
            calls[_name] += 1
            return _real(*a, **k)
        monkeypatch.setattr(ops, name, counted)
    cache = model.new_cache(64)
    tokens = torch.tensor([[3, 17, 5, 9, 11, 2]])
    chain = model(tokens, cache).logits
    layers = model.cfg.num_layers
    assert calls == {"rope_store": layers, "rmsnorm": 2 * layers + 1}
    cache.reset()
    for i in range(tokens.shape[1]):  # one position at a time: the same bits
        assert torch.equal(model(tokens[:, i:i + 1], cache).logits[0, 0], chain[0, i])
