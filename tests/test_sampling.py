"""specdec.sampling: logits -> p with temperature, top-k, top-p, min-p; seeded sampling."""

import math

import pytest
import torch

from specdec.sampling import Draws, SamplingParams, make_generator, probs_from_logits, sample

LOG4 = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()


def test_greedy_is_one_hot_on_argmax_lowest_index_on_ties():
    p = probs_from_logits(torch.tensor([[1.0, 3.0, 3.0, 2.0], [0.0, 0.0, 0.0, 0.0]]), SamplingParams())
    assert p.dtype == torch.float32
    assert p.tolist() == [[0, 1, 0, 0], [1, 0, 0, 0]]
    assert SamplingParams().greedy and not SamplingParams(temperature=0.5).greedy


def test_temperature():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    for t in (0.5, 1.0, 2.0):
        expected = torch.softmax(logits / t, -1)
        assert torch.allclose(probs_from_logits(logits, SamplingParams(temperature=t)), expected, atol=1e-7)


def test_top_k():
    p = probs_from_logits(LOG4, SamplingParams(temperature=1.0, top_k=2))
    assert torch.allclose(p, torch.tensor([0.625, 0.375, 0, 0]), atol=1e-6)
    # top_k >= V is a no-op
    assert torch.allclose(probs_from_logits(LOG4, SamplingParams(1.0, top_k=10)), LOG4.exp(), atol=1e-6)
    # ties at the edge are kept
    tied = probs_from_logits(torch.tensor([1.0, 0.0, 0.0, -1.0]), SamplingParams(1.0, top_k=2))
    assert (tied > 0).tolist() == [True, True, True, False]


def test_top_p_is_the_smallest_nucleus():
    # module docstring: top_p = 0.75 keeps {0, 1} (0.5 < 0.75 <= 0.8)
    p = probs_from_logits(LOG4, SamplingParams(temperature=1.0, top_p=0.75))
    assert torch.allclose(p, torch.tensor([0.625, 0.375, 0, 0]), atol=1e-6)
    p = probs_from_logits(LOG4, SamplingParams(temperature=1.0, top_p=0.85))
    assert (p > 0).tolist() == [True, True, True, False]
    # a tiny top_p still keeps the top token
    p = probs_from_logits(LOG4, SamplingParams(temperature=1.0, top_p=1e-9))
    assert p.tolist() == [1, 0, 0, 0]


@pytest.mark.parametrize("scale, least, most", [(0.1, 1025, 3000), (2.5, 65, 1024), (6.0, 1, 64)])
def test_top_p_nucleus_of_any_width_is_the_full_sorts(scale, least, most):
    """The nucleus is looked for in the top 64, then 1024, then the full sort: each width gives the full sort's."""
    torch.manual_seed(0)
    logits = torch.randn(3, 3000) * scale
    p = probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=0.9))
    ref = torch.softmax(logits, -1)
    for row, r in zip(p, ref):
        s, _ = torch.sort(r, descending=True)
        n = int(((s.double().cumsum(0) - s.double()) < 0.9).sum())
        assert least <= n <= most and int((row > 0).sum()) == n


def test_min_p():
    # min_p = 0.2 drops only the 0.05 token (0.05 < 0.2 * 0.5)
    p = probs_from_logits(LOG4, SamplingParams(temperature=1.0, min_p=0.2))
    assert torch.allclose(p, torch.tensor([0.5, 0.3, 0.15, 0]) / 0.95, atol=1e-6)
    # min_p = 1 keeps only the maximum
    assert probs_from_logits(LOG4, SamplingParams(1.0, min_p=1.0)).tolist() == [1, 0, 0, 0]


def test_order_temperature_topk_topp_minp():
    logits = torch.tensor([3.0, 2.5, 2.0, 1.0, 0.0, -1.0])
    params = SamplingParams(temperature=0.7, top_k=4, top_p=0.8, min_p=0.3)
    # by hand, in the documented order
    x = logits / 0.7
    x[4:] = -math.inf  # top-k 4
    pr = torch.softmax(x, -1)
    cum = pr.cumsum(0) - pr
    x[cum >= 0.8] = -math.inf  # nucleus
    pr = torch.softmax(x, -1)
    x[pr < 0.3 * pr.max()] = -math.inf  # min-p
    assert torch.allclose(probs_from_logits(logits, params), torch.softmax(x, -1), atol=1e-6)
    # min-p acts on the nucleus renormalized after top-k: two tokens survive all four filters
    p = probs_from_logits(logits, params)
    assert (p > 0).tolist() == [True, True, False, False, False, False]


def test_vectorized_dtype_and_rows_sum_to_one():
    torch.manual_seed(1)
    logits = torch.randn(2, 3, 50, dtype=torch.bfloat16)
    params = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, min_p=0.05)
    p = probs_from_logits(logits, params)
    assert p.shape == (2, 3, 50) and p.dtype == torch.float32
    assert torch.allclose(p.sum(-1), torch.ones(2, 3), atol=1e-6)
    for i in range(2):
        for j in range(3):
            assert torch.allclose(p[i, j], probs_from_logits(logits[i, j], params), atol=1e-7)


def test_invalid_logits():
    with pytest.raises(ValueError, match="logits"):
        probs_from_logits(torch.tensor([1, 2, 3]), SamplingParams(1.0))
    with pytest.raises(ValueError, match="logits"):
        probs_from_logits(torch.tensor([float("nan"), 1.0]), SamplingParams())
    with pytest.raises(ValueError, match="logits"):
        probs_from_logits(torch.full((3,), -math.inf), SamplingParams(1.0))


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": float("nan")}, "top_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.1}, "min_p"),
        ({"seed": 1.5}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"seed": -1}, "seed"),
    ],
)
def test_params_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("t", [1e-40, 1e-30, 5e-324, 1e-6])
def test_tiny_temperature_is_the_greedy_limit(t):
    logits = torch.tensor([[30.0, -5.0, 29.9, 1.0], [2.0, 7.0, 7.0, -1e30], [-50.0, 50.0, 0.0, 3.0]])
    p = probs_from_logits(logits, SamplingParams(temperature=t))
    assert torch.isfinite(p).all()
    assert torch.equal(p, torch.tensor([[1.0, 0, 0, 0], [0, 0.5, 0.5, 0], [0, 1.0, 0, 0]]))  # ties share


def test_seed_range():
    for seed in (0, 2**64 - 1):
        SamplingParams(seed=seed)
        make_generator(seed)
    with pytest.raises(ValueError, match="2\\*\\*64-1"):
        make_generator(2**64)


def test_same_seed_same_tokens():
    probs = torch.softmax(torch.randn(4, 1000), -1)
    a = [sample(probs, g) for g in [make_generator(7)] for _ in range(5)]
    b = [sample(probs, g) for g in [make_generator(7)] for _ in range(5)]
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    c = torch.stack([sample(probs, make_generator(8)) for _ in range(3)])
    assert c.dtype == torch.long and c.shape == (3, 4)
    assert isinstance(make_generator(None), torch.Generator)


def test_sample_law_and_zero_mass_tokens():
    g = make_generator(0)
    p = torch.tensor([0.1, 0.0, 0.6, 0.3, 0.0])
    n = 40_000
    counts = torch.bincount(sample(p.expand(n, 5), g), minlength=5).double() / n
    assert counts[1] == 0 and counts[4] == 0
    sigma = (p * (1 - p) / n).sqrt().double()
    assert ((counts - p.double()).abs() <= 5 * sigma + 1e-12).all()
    # unnormalized rows are fine; one-hot rows are deterministic
    assert sample(torch.tensor([[0.0, 2.0, 0.0]]), g).tolist() == [1]


def test_sample_rejects_invalid_rows():
    g = make_generator(0)
    for bad in (torch.tensor([0.5, -0.1, 0.6]), torch.zeros(3), torch.tensor([float("nan"), 1.0])):
        with pytest.raises(ValueError, match="probs"):
            sample(bad, g)


def test_the_c_sampler_draws_what_torchs_inverse_cdf_draws():
    """`ops.sample_rows` (fp32 CPU rows) and the torch route (here forced by float64 rows) draw the same token at
    the same uniform, up to float64 rounding at a boundary (never met in these draws): zero-mass tokens, rows
    that do not sum to 1, vocabularies off the block size, u at 0 and just below 1."""
    from specdec.runtime.kernels import ops

    if not ops.available():
        pytest.skip("the ops library is unavailable (no C compiler, no AVX2, or SPECDEC_KERNEL=0)")
    gen = torch.Generator().manual_seed(0)
    for vocab in (1, 7, 64, 65, 1000, 49152):
        p = torch.softmax(torch.randn(40, vocab, generator=gen) * 3, -1)
        p[p < 1e-4] = 0  # zero-mass tokens, mass off 1
        p[:, 0] = 0.0 if vocab > 1 else 1.0
        u = torch.rand(40, generator=gen, dtype=torch.float64)
        u[0], u[1] = 0.0, 1 - 2 ** -53
        c = sample(p, u=u)
        assert torch.equal(c, sample(p.double(), u=u)), vocab
        assert bool((p.gather(1, c[:, None]) > 0).all())
    assert sample(torch.tensor([0.0, 0.0, 3.0, 0.0]), u=torch.tensor([0.999999])).tolist() == 2
    with pytest.raises(ValueError, match="one uniform per row"):  # not a read past the end of u
        sample(torch.rand(2, 5), u=torch.rand(1, dtype=torch.float64))
    with pytest.raises(ValueError, match="probs"):
        sample(torch.tensor([[0.5, float("inf")]]), u=torch.tensor([0.5]))


def test_the_c_sampler_at_exact_cumulative_boundaries():
    """Found by mutating ops.c. A uniform landing exactly on a cumulative sum draws the next token (the first whose
    cumulative mass exceeds u x total), also where that sum is a whole block's (64 tokens); and where float64
    rounding leaves the token-by-token scan of a block short of the target its block's sum passed, the last token
    with mass wins, never a zero-mass one after it."""
    from specdec.runtime.kernels import ops

    if not ops.available():
        pytest.skip("the ops library is unavailable (no C compiler, no AVX2, or SPECDEC_KERNEL=0)")
    f64 = lambda *u: torch.tensor(u, dtype=torch.float64)
    p = torch.tensor([[0.25, 0.25, 0.5]]).expand(4, 3)
    assert ops.sample_rows(p, f64(0.0, 0.25, 0.5, 0.75)).tolist() == [0, 1, 2, 2]
    assert ops.sample_rows(torch.full((2, 128), 1 / 128), f64(0.5, 0.5 - 2 ** -40)).tolist() == [64, 63]
    # the block's sum pairs 2^-53 + 2^-53 first (1 + 2^-52); the scan adds them to 1 one at a time (stays 1)
    for n in (8, 70):
        p = torch.zeros(1, n)
        p[0, 0], p[0, 2], p[0, 3] = 1.0, 2.0 ** -53, 2.0 ** -53
        assert ops.sample_rows(p, f64(1 - 2 ** -53)).tolist() == [3], n


def test_top_k_threshold_counts_the_last_column():
    """The k-th largest where the largest values sit in the last columns (the heap's scalar tail, found by
    mutating ops.c), for row lengths around whole octets."""
    from specdec.runtime.kernels import ops

    if not ops.available():
        pytest.skip("the ops library is unavailable (no C compiler, no AVX2, or SPECDEC_KERNEL=0)")
    for vocab in range(1, 26):
        x = torch.arange(vocab, dtype=torch.float32).repeat(2, 1)
        x[1] = x[1].flip(0)  # largest first, for contrast
        for k in range(1, vocab + 1):
            assert ops.kth_largest(x, k).tolist() == [[vocab - k], [vocab - k]], (vocab, k)


def test_top_ks_threshold_in_c_is_torchs():
    """`ops.kth_largest` gives torch.topk's k-th value, duplicates counted (ties at the edge), any k."""
    from specdec.runtime.kernels import ops

    if not ops.available():
        pytest.skip("the ops library is unavailable (no C compiler, no AVX2, or SPECDEC_KERNEL=0)")
    gen = torch.Generator().manual_seed(1)
    for vocab, k in [(1, 1), (9, 3), (64, 64), (1000, 50), (49152, 1), (49152, 50), (151936, 400)]:
        x = torch.randn(3, vocab, generator=gen).round(decimals=1)  # many ties
        x[0, : vocab // 2] = -math.inf
        assert torch.equal(ops.kth_largest(x, k), torch.topk(x, k, dim=-1).values[:, -1:]), (vocab, k)


def test_filters_edge_cases():
    """Found by mutating sampling.py: min-p compares probabilities at the request's temperature; top-k of
    V - 1 still filters; top-p keeps the smallest set that reaches it, not one more on an exact tie."""
    # T = 2: p = (0.506, 0.307, 0.186), floor 0.3 x 0.506 = 0.152 keeps all three (at T = 1 token 2 would go)
    p = probs_from_logits(torch.tensor([2.0, 1.0, 0.0]), SamplingParams(temperature=2.0, min_p=0.3))
    assert bool((p > 0).all())
    p = probs_from_logits(torch.tensor([3.0, 2.0, 1.0, 0.0]), SamplingParams(temperature=1.0, top_k=3))
    assert (p > 0).tolist() == [True, True, True, False]
    # p = (0.5, 0.25, 0.25) exactly: the top token alone reaches top-p 0.5
    p = probs_from_logits(torch.tensor([0.0, -math.log(2), -math.log(2)]), SamplingParams(temperature=1.0, top_p=0.5))
    assert p.tolist() == [1.0, 0.0, 0.0]


def test_draws_streams_never_alias():
    """Every (position, stream) pair a round may read is its own number: were u(t, 1) = u(t + 1, 0), a bonus
    token would reuse an accept test's uniform, known to lie below its acceptance probability."""
    draws = Draws(7)
    u = [draws.uniform(t, s) for t in range(64) for s in (0, 1, 2, 3, Draws.RESIDUAL)]
    assert len(set(u)) == len(u)


# --- edges found by a second mutation pass over sampling.py ---------------------------------------


def test_params_refuse_booleans_and_strings_and_are_frozen():
    """True is not a temperature; params are frozen (and hashable), so what __post_init__ validated stays valid."""
    import dataclasses

    for kwargs in ({"temperature": True}, {"temperature": "0.5"}, {"top_p": True}, {"min_p": False}):
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            SamplingParams(**kwargs)
    params = SamplingParams(temperature=0.7, top_k=5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.temperature = -1.0
    assert hash(params) == hash(SamplingParams(temperature=0.7, top_k=5))


def test_logits_of_any_leading_shape_and_a_vocabulary_of_one():
    """A 0-dim tensor or an empty vocabulary is refused by name; a vocabulary of one gives p = 1; greedy works on
    [V] and [2, 2, V] as on [rows, V]."""
    for params in (SamplingParams(), SamplingParams(temperature=1.0)):
        for bad in (torch.tensor(1.0), torch.zeros(2, 0)):
            with pytest.raises(ValueError, match="vocabulary"):
                probs_from_logits(bad, params)
        assert probs_from_logits(torch.tensor([[0.3], [-2.0]]), params).tolist() == [[1.0], [1.0]]
    assert probs_from_logits(torch.tensor([1.0, 3.0, 2.0]), SamplingParams()).tolist() == [0, 1, 0]
    x = torch.tensor([[[1.0, 3.0, 2.0], [5.0, 0.0, 5.0]], [[0.0, 0.0, 1.0], [2.0, 1.0, 0.0]]])
    assert probs_from_logits(x, SamplingParams()).tolist() == [[[0, 1, 0], [1, 0, 0]], [[0, 0, 1], [1, 0, 0]]]


def test_top_k_of_one_filters_and_top_p_of_one_is_off(monkeypatch):
    """top_k = 1 keeps the top token (with its ties). top_p = 1 computes no nucleus: a token whose mass is lost in
    the cumulative sum (1 + 2e-22 rounds to 1 in float64) keeps its probability."""
    assert probs_from_logits(LOG4, SamplingParams(1.0, top_k=1)).tolist() == [1, 0, 0, 0]
    assert probs_from_logits(torch.tensor([2.0, 0.0, 2.0]), SamplingParams(1.0, top_k=1)).tolist() == [0.5, 0, 0.5]
    p = probs_from_logits(torch.tensor([0.0, -50.0]), SamplingParams(1.0))
    assert p[1] == pytest.approx(math.exp(-50), rel=1e-5)
    from specdec import sampling

    def boom(*a, **k):
        raise AssertionError("computed a nucleus at top_p = 1")

    monkeypatch.setattr(sampling, "_nucleus", boom)  # (patching torch.sort, which nothing calls, could not fail)
    logits = torch.randn(5, 150_000)
    for params in (SamplingParams(1.0), SamplingParams(0.8, top_k=50), SamplingParams(0.8, min_p=0.1), SamplingParams(),
                   SamplingParams(1.0, top_k=10, min_p=0.1)):
        assert probs_from_logits(logits, params).shape == (5, 150_000)


def test_splitmix64_reference_values_and_draw_layout():
    """`_mix` is SplitMix64's output function: from state 0 the reference generator (Steele, Lea and Flood 2014;
    Vigna's splitmix64.c) gives e220a8397b1dcdaf, 6e789e6aa1b965f4, 06c45d188009454f. Pinned, with the documented
    layout u = mix(mix(mix(seed) + position) + stream) >> 11 / 2^53, so that a seed keeps its tokens across
    versions. uniform's stream defaults to 0 (plain sampling's), and uniforms(start, n) are positions start ..
    start + n - 1."""
    from specdec.sampling import _mix

    gamma, mask = 0x9E3779B97F4A7C15, 2**64 - 1
    assert [_mix(i * gamma & mask) for i in range(3)] == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]
    draws = Draws(7)
    for position, stream in [(0, 0), (12, 0), (12, 3), (5, Draws.RESIDUAL)]:
        z = _mix((_mix((_mix(7) + position) & mask) + stream) & mask)
        assert draws.uniform(position, stream) == (z >> 11) * 2.0**-53
    assert draws.uniform(12) == draws.uniform(12, 0)
    assert draws.uniforms(5, 3).tolist() == [draws.uniform(5), draws.uniform(6), draws.uniform(7)]
    assert draws.uniforms(5, 2, 4).tolist() == [draws.uniform(5, 4), draws.uniform(6, 4)]


def test_the_torch_route_checks_rows_and_ends_on_the_last_token_with_mass():
    """Rows the C sampler does not take (float64 here; also CUDA): every row is checked, not only the extremes
    (a zero row or an inf among good rows, a negative entry in a row of positive mass, NaN), non-tensors and
    integer or 0-dim tensors are refused. Where u x total rounds up to total (a subnormal total at u just below
    1), the last token with mass is drawn, never a zero-mass token after it, for any leading shape."""
    f64 = lambda rows: torch.tensor(rows, dtype=torch.float64)  # noqa: E731
    u2 = torch.tensor([0.5, 0.5], dtype=torch.float64)
    for bad in ([[0.5, 0.5], [0.0, 0.0]], [[0.5, 0.5], [math.inf, 0.0]], [[0.6, -0.1], [0.5, 0.5]],
                [[math.nan, 1.0], [0.5, 0.5]]):
        with pytest.raises(ValueError, match="probs"):
            sample(f64(bad), u=u2)
    for bad in ([0.5, 0.5], torch.tensor([1, 2]), torch.tensor(0.5)):
        with pytest.raises(ValueError, match="probs"):
            sample(bad, make_generator(0))
    top = torch.tensor([1 - 2**-53], dtype=torch.float64)
    tiny = f64([0.0, 1e-310, 1e-310, 0.0])  # total 2e-310, subnormal: u x total == total
    assert int(sample(tiny, u=top)) == 2
    assert sample(tiny.expand(2, 4), u=top.expand(2)).tolist() == [2, 2]
    assert sample(tiny.expand(2, 1, 4), u=top.expand(2)).tolist() == [[2], [2]]
    assert int(sample(tiny, u=f64([0.25]))) == 1 and int(sample(tiny, u=f64([0.75]))) == 2


@pytest.mark.parametrize("scale, widths", [(6.0, [64]), (2.5, [64, 1024]), (0.1, [64, 1024, 3000])])
def test_top_p_widens_its_window_only_as_far_as_the_nucleus_needs(monkeypatch, scale, widths):
    """The cost side of the window search (the output is checked against the full sort above): the top 64 first,
    then 16 times wider, stopping at the first window whose mass reaches top_p, the full sort only for a nucleus
    wider than 1024 (same logits as the nucleus-width test: nuclei of <= 64, 65..1024 and > 1024 tokens)."""
    torch.manual_seed(0)
    logits = torch.randn(3, 3000) * scale
    asked, topk = [], torch.topk

    def spy(x, k, *a, **kw):
        asked.append(k)
        return topk(x, k, *a, **kw)

    monkeypatch.setattr(torch, "topk", spy)
    probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=0.9))
    assert asked == widths
