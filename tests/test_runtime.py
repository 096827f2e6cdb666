"""The lean forward against Hugging Face transformers on the same weights, and the cache's rollbacks."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from specdec.runtime.loader import load_transformer
from tests.tiny import VOCAB


@pytest.fixture(scope="module")
def pair(tiny_folder):
    hf = AutoModelForCausalLM.from_pretrained(tiny_folder, dtype=torch.float32).eval()
    return hf, load_transformer(tiny_folder, torch.float32)


def prompt(n=64, seed=1):
    return torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def test_logits_match_transformers(pair):
    hf, ours = pair
    ids = prompt()
    with torch.no_grad():
        ref = hf(ids).logits
    out = ours(ids, ours.new_cache(128)).logits
    assert out.shape == ref.shape == (1, 64, VOCAB)
    assert (out - ref).abs().max().item() <= 1e-3
    assert ref.std() > 0.1  # the comparison is not between two near-constant tensors


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_without_the_c_kernels_logits_still_match_transformers(pair, tiny_folder, monkeypatch, dtype):
    """SPECDEC_KERNEL=0 (or no C compiler): RMSNorm, silu * up, RoPE and attention run torch's own calls, and
    bf16 weights torch's matmuls (bf16 activations: the route of a CPU without AVX2, ARM included). The logits
    still match transformers' (fp32: to 1e-3; bf16: to bf16's precision, well inside what a wrong norm or MLP
    would move them)."""
    hf, _ = pair
    monkeypatch.setenv("SPECDEC_KERNEL", "0")
    ours = load_transformer(tiny_folder, dtype)
    ids = prompt()
    with torch.no_grad():
        ref = hf(ids).logits
    cache = ours.new_cache(128)
    out = torch.cat([ours(ids[:, :40], cache).logits, ours(ids[:, 40:], cache).logits], 1)
    assert not ours.norm.fused and not ours.layers[0].kernels and ours.compute_dtype == dtype
    assert (out - ref).abs().max().item() <= (1e-3 if dtype == torch.float32 else 0.1 * ref.abs().max().item())
    assert ref.std() > 0.1


def test_incremental_equals_full(pair):
    _, ours = pair
    ids = prompt()
    full = ours(ids, ours.new_cache(128)).logits
    cache = ours.new_cache(128)
    pieces = [ours(ids[:, :40], cache).logits]
    for i in range(40, 64, 3):  # chunks of 3, then singles
        pieces.append(ours(ids[:, i:i + 3], cache).logits)
    assert cache.length == 64
    assert torch.allclose(torch.cat(pieces, 1), full, atol=1e-4)


def test_rewind_overwrites_rejected_slots(pair):
    _, ours = pair
    ids = prompt(30)
    cache = ours.new_cache(64)
    ours(ids[:, :20], cache)
    ours(torch.randint(0, VOCAB, (1, 6)), cache)  # a rejected draft
    cache.rewind(6)
    out = ours(ids[:, 20:], cache).logits
    ref = ours(ids, ours.new_cache(64)).logits[:, 20:]
    assert torch.allclose(out, ref, atol=1e-4)


def test_tree_mask_and_compact(pair):
    """A tree of two branches in one forward equals running each branch on its own; compacting the
    chosen branch leaves the cache as if only that branch had been run."""
    _, ours = pair
    ctx = prompt(16)
    a, b = [5, 6, 7], [9, 10]  # branch a: depth 1..3; branch b: depth 1..2, both children of the context
    tokens = torch.tensor([a + b])
    parents = [-1, 0, 1, -1, 3]
    positions = torch.tensor([[16, 17, 18, 16, 17]])
    n = len(parents)
    mask = torch.zeros(1, n, 16 + n, dtype=torch.bool)
    mask[..., :16] = True
    for i in range(n):
        j = i
        while j != -1:
            mask[0, i, 16 + j] = True
            j = parents[j]
    cache = ours.new_cache(64)
    ours(ctx, cache)
    tree = ours(tokens, cache, positions=positions, mask=mask).logits
    for branch, rows in ((a, [0, 1, 2]), (b, [3, 4])):
        ref = ours(torch.cat([ctx, torch.tensor([branch])], 1), ours.new_cache(64)).logits[:, 16:]
        assert torch.allclose(tree[:, rows], ref, atol=1e-4)
    cache.compact([3, 4], newest=n)  # keep branch b
    assert cache.length == 18
    nxt = ours(torch.tensor([[11]]), cache).logits
    ref = ours(torch.cat([ctx, torch.tensor([b + [11]])], 1), ours.new_cache(64)).logits[:, -1:]
    assert torch.allclose(nxt, ref, atol=1e-4)


def test_hidden_states_and_early_exit(pair):
    hf, ours = pair
    ids = prompt(12)
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True).hidden_states  # ref[i+1] = output of layer i
    out = ours(ids, ours.new_cache(32), hidden_layers=(0, 1)).hidden
    assert torch.allclose(out[0], ref[1], atol=1e-4) and torch.allclose(out[1], ref[2], atol=1e-4)
    early = ours(ids, ours.new_cache(32), exit_layer=1).logits
    expected = ours.lm_head(ours.norm(out[0]))
    assert torch.allclose(early, expected, atol=1e-4)


def test_batch_rows_are_independent(pair):
    _, ours = pair
    ids = torch.cat([prompt(10, 1), prompt(10, 2)])
    out = ours(ids, ours.new_cache(32, batch=2)).logits
    for row in range(2):
        single = ours(ids[row:row + 1], ours.new_cache(32)).logits
        assert torch.allclose(out[row:row + 1], single, atol=1e-4)


def test_bf16_close_to_fp32(tiny_folder):
    fp32 = load_transformer(tiny_folder, torch.float32)
    bf16 = load_transformer(tiny_folder, torch.bfloat16)
    ids = prompt(16)
    a = fp32(ids, fp32.new_cache(32)).logits
    b = bf16(ids, bf16.new_cache(32)).logits
    assert b.dtype == torch.float32 and (a - b).abs().max() < 0.1 * a.abs().max()


def test_context_overflow_is_an_error(pair):
    _, ours = pair
    cache = ours.new_cache(8)
    with pytest.raises(ValueError, match="context overflow"):
        ours(prompt(9), cache)


def test_cache_argument_checks(pair):
    _, ours = pair
    cache = ours.new_cache(8)
    ours(prompt(4), cache)
    with pytest.raises(ValueError):
        cache.rewind(5)
    with pytest.raises(ValueError):
        cache.compact([0, 7], newest=3)


def test_prefill_spans_cut_at_multiples_of_the_chunk():
    from specdec.runtime.model import prefill_spans

    assert prefill_spans(0, 600) == [(0, 256), (256, 512), (512, 600)]
    assert prefill_spans(100, 300) == [(100, 256), (256, 300)]
    assert prefill_spans(256, 257) == [(256, 257)] and prefill_spans(5, 5) == []


def test_a_prefill_in_pieces_after_cached_tokens_is_one_forward(pair, monkeypatch):
    """`Transformer.prefill` after 10 cached tokens, in pieces of 16 cut at absolute positions (10..16, 16..32,
    32..48, 48..50): the same cache, the last position's logits and final-norm state, and every fed position's
    hidden states of layers 0 and 1 (the pieces' joined), as one forward over all 50 tokens."""
    from specdec.runtime import model as model_module

    _, ours = pair
    monkeypatch.setattr(model_module.prefill_spans, "__defaults__", (16,))
    ids = prompt(50, seed=4)[0].tolist()
    layers = (0, 1, -1)
    whole_cache = ours.new_cache(64)
    whole = ours(torch.tensor([ids]), whole_cache, hidden_layers=layers)
    cache = ours.new_cache(64)
    ours.prefill(ids[:10], cache)
    out = ours.prefill(ids[10:], cache, hidden_layers=layers)
    assert cache.length == 50 and out.logits.shape == (1, 1, VOCAB) and out.hidden[-1].shape[1] == 1
    torch.testing.assert_close(out.logits[0, 0], whole.logits[0, -1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.hidden[-1][0, 0], whole.hidden[-1][0, -1], atol=1e-4, rtol=1e-4)
    for i in (0, 1):
        assert out.hidden[i].shape[1] == 40
        torch.testing.assert_close(out.hidden[i], whole.hidden[i][:, 10:], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(cache.k[0][:, :, :50], whole_cache.k[0][:, :, :50], atol=1e-4, rtol=1e-4)
    assert ours.prefill([], cache) is None and cache.length == 50


def test_release_threads_lets_go_of_the_calling_threads_openmp_workers():
    """A server decodes in its engine thread after loading in the main one: the main thread's OpenMP pool made
    libgomp throttle every worker (more of them than CPUs), 25% slower steps on 2 vCPUs. `release_threads`
    ends the calling thread's pool; parallel code there starts a new one. In a fresh process, where no other
    test's threads come and go."""
    import os
    import subprocess
    import sys

    if (os.cpu_count() or 1) < 2 or not os.path.exists("/proc/self/task"):
        pytest.skip("one CPU (OpenMP keeps no pool of workers) or no /proc")
    script = """
import os, torch
from specdec.runtime.threads import release_threads
torch.set_num_threads(2)
tasks = lambda: len(os.listdir("/proc/self/task"))
a = torch.randn(512, 512)
a @ a  # a parallel region: this thread's pool exists now
before = tasks()
assert release_threads() >= 1
assert tasks() == before - 1, (before, tasks())  # its one worker
assert torch.allclose((a @ a)[0], a[0] @ a, rtol=1e-4, atol=1e-3)  # parallel code still runs (a new pool)
"""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=root))
    assert r.returncode == 0, r.stderr
