"""Every worked number in the lesson's prose, reproduced by specdec.theory.

Each assertion quotes the sentence it checks. Where the lesson's own equations are not in the
text (they were images), the quoted prose is what the number must match."""

import math

import pytest

from specdec import theory as t


# --- Chapter 1 --------------------------------------------------------------------------------

P_ABC = (0.5, 0.3, 0.2)
Q_ABC = (0.4, 0.4, 0.2)  # implied: only B is over-drafted and the residual 0.1 falls on A alone


def test_ch1_overlap_both_ways():
    # "Work it out on this chapter's own numbers: ... 90%."
    assert t.overlap(P_ABC, Q_ABC) == pytest.approx(0.9, abs=1e-12)
    # "Check it the other way, directly from the per-token acceptance probabilities weighted by
    #  how often the draft actually proposes each token ... Both routes land on exactly 0.9"
    assert t.acceptance_rate(P_ABC, Q_ABC) == pytest.approx(0.9, abs=1e-12)


def test_ch1_overlap_limits():
    # "Then accept(x) = min(1, p(x)/q(x)) = min(1,1) = 1 ... ∑min(p,q) = ∑p(x) = 1"
    assert t.overlap(P_ABC, P_ABC) == pytest.approx(1.0)
    # "if q and p shared no probability mass at all ... the overlap sum ∑min(p,q) would be exactly 0"
    assert t.overlap((1, 0, 0), (0, 0.5, 0.5)) == 0.0
    assert t.acceptance_rate((1, 0, 0), (0, 0.5, 0.5)) == 0.0


# --- Chapter 2 --------------------------------------------------------------------------------


def test_ch2_expected_tokens_worked_example():
    # "Nearly 2.77 tokens for one round of verification" / "2.7731 tokens/round"
    assert t.expected_tokens(0.7, 4) == pytest.approx(2.7731, abs=1e-12)
    # "not the naive “5 candidates × 70% each ≈ 3.5” a quick guess might suggest"
    assert 5 * 0.7 == pytest.approx(3.5) and t.expected_tokens(0.7, 4) < 3.5


def test_ch2_k0_is_plain_decoding():
    # "Exactly 1 token, matching plain decoding with no speedup"
    assert t.expected_tokens(0.7, 0) == 1.0
    assert t.speedup(0.7, 0, 0.1) == 1.0


def test_ch2_closed_form_matches_series():
    # "The expected number of tokens produced is the sum, over every position the round could
    #  reach, of the probability of reaching it"
    for a in (0.0, 0.15, 0.5, 0.7, 0.99, 1.0):
        for k in range(10):
            assert t.expected_tokens(a, k) == pytest.approx(sum(a**i for i in range(k + 1)), rel=1e-12)


def test_ch2_saturation():
    # "E[tokens] saturates toward 1/(1−α) as k grows large"
    assert t.expected_tokens(0.7, 200) == pytest.approx(1 / 0.3, rel=1e-12)


def test_ch2_speedup_worked_example():
    # "A draft model roughly 10× smaller than the 7B target — 700 million parameters ... has:" τ = 0.1
    assert t.tau_from_params(0.7e9, 7e9) == pytest.approx(0.1)
    # "Just under a 2× wall-clock speedup" / "2.7731 tokens/round and 1.98× speedup"
    assert t.speedup(0.7, 4, 0.1) == pytest.approx(2.7731 / 1.4, rel=1e-12)
    assert round(t.speedup(0.7, 4, 0.1), 2) == 1.98


def test_ch2_alpha_sweep_is_convex():
    # "going from α=0.7 to α=0.9 (a 0.2 improvement) gains nearly as much speedup (0.95×) as
    #  going all the way from 0.3 to 0.7 (a 0.4 improvement, gaining 0.96×)"
    s = {a: round(t.speedup(a, 4, 0.1), 2) for a in (0.3, 0.7, 0.9)}
    assert s == {0.3: 1.02, 0.7: 1.98, 0.9: 2.93}
    # the lesson differences its rounded table: 2.93 - 1.98 = 0.95 and 1.98 - 1.02 = 0.96
    # (unrounded: 0.944 and 0.963)
    assert s[0.9] - s[0.7] == pytest.approx(0.95)
    assert s[0.7] - s[0.3] == pytest.approx(0.96)
    assert t.speedup(0.9, 4, 0.1) - t.speedup(0.7, 4, 0.1) == pytest.approx(0.944, abs=5e-4)


def test_ch2_best_k():
    # "The peak sits right around k=4 for this particular α and τ — k=2 hasn't yet captured
    #  enough of the geometric tail, and by k=8 the linear overhead has grown past"
    assert t.best_k(0.7, 0.1) == 4
    assert t.speedup(0.7, 2, 0.1) < t.speedup(0.7, 4, 0.1) > t.speedup(0.7, 8, 0.1)
    # "the speedup curve rises, peaks, then falls back down — it does not keep climbing forever,
    #  even for a very good draft"
    assert t.best_k(0.9, 0.1, k_max=64) < 64


def test_ch2_negative_speedup():
    # "A speedup of 0.65× means the “speculative” server is actually 35% slower"
    assert round(t.speedup(0.15, 8, 0.1), 2) == 0.65
    # "the server still paid the full 8 × 0.7 ms = 5.6 ms drafting cost on every single round"
    assert 8 * 0.1 * t.STEP_MS == pytest.approx(5.6)
    # the break-even alpha for k = 8, tau = 0.1 sits far above 0.15
    be = t.break_even_alpha(8, 0.1)
    assert t.speedup(be, 8, 0.1) == pytest.approx(1.0, abs=1e-12)
    assert be == pytest.approx(0.4448, abs=1e-4) and be > 0.15


def test_ch2_full_burst():
    # "At α=0.7, k=4, work out the probability of hitting that maximum" (all k accepted: α^k)
    assert t.full_burst_probability(0.7, 4) == pytest.approx(0.2401)
    dist = t.tokens_per_round_distribution(0.7, 4)
    assert dist == pytest.approx([0.3, 0.21, 0.147, 0.1029, 0.2401])
    assert sum(dist) == pytest.approx(1.0)
    # the mean of the distribution is E[tokens]
    assert sum((n + 1) * pr for n, pr in enumerate(dist)) == pytest.approx(2.7731)


def test_ch2_misestimate():
    # "suppose k=6 was chosen assuming α=0.7 ..., but real traffic actually runs at α=0.5"
    # "The mismatched k=6 choice still produces a real, positive speedup (1.24×)"
    m = t.misestimate_cost(0.5, 0.1, k=6)
    assert round(m.realized_speedup, 2) == 1.24
    # "k=2 (this lower α's own better-matched depth) ... E[tokens]=1+0.5+0.25=1.75,
    #  speedup=1.75÷1.2=1.458×"
    assert m.best_k == 2
    assert t.expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert m.best_speedup == pytest.approx(1.75 / 1.2) and round(m.best_speedup, 3) == 1.458
    assert 0 < m.lost_fraction < 0.2
    # tuning against the assumed alpha instead picks that alpha's own best k (4 here)
    assert t.misestimate_cost(0.5, 0.1, alpha_assumed=0.7).k == 4


# --- Chapter 3 --------------------------------------------------------------------------------


def test_ch3_draft_sources():
    # "Recall the 700M-parameter example (τ=0.1) ..., moderate acceptance α=0.6"
    assert round(t.speedup(0.6, 4, 0.1), 2) == 1.65
    # "On a code-editing task ... take α=0.82 as representative: Nearly 3.5×"
    # and Ch. 8: "matching Chapter 3's 3.47× figure closely"
    assert round(t.speedup(0.82, 4, 0.002), 2) == 3.47
    # "Summarization ... runs similarly well at a slightly lower α=0.75"
    assert round(t.speedup(0.75, 4, 0.002), 2) == 3.03
    # "It costs a small similarity lookup plus light reranking, τ≈0.007, ... α=0.5"
    assert round(t.speedup(0.5, 4, 0.007), 2) == 1.88


def test_ch3_self_speculative():
    # "Work out the numbers for a 32-layer version of this lesson's 7B model, early-exiting
    #  after layer 8" — "That τ is more than double Option 1's dedicated 700M model (0.10)"
    tau = t.early_exit_tau(8, 32)
    assert tau == 0.25 and tau > 2 * 0.10
    # "take α=0.55 as representative ... Barely above break-even"
    assert round(t.speedup(0.55, 4, tau), 2) == 1.06


def test_ch3_free_drafting_near_break_even():
    # "with prompt lookup's near-zero τ the speedup there works out closer to break-even rather
    #  than clearly negative"
    assert 1.0 < t.speedup(0.15, 8, 0.002) < 1.2


def test_ch3_hybrid_tau():
    # "the effective τ averages to roughly 0.7×0.002 + 0.3×0.10 ≈ 0.031"
    assert round(t.hybrid_tau([0.7, 0.3], [0.002, 0.10]), 3) == 0.031


# --- Chapter 4 --------------------------------------------------------------------------------


def test_ch4_dense_tree_nodes():
    # "That's 2 + 4 = 6 candidate positions verified in the one pass"
    assert t.dense_tree_nodes(2, 2) == 6
    # "340 is more than double the budget"
    assert t.dense_tree_nodes(4, 4) == 340 and 340 > 2 * t.BUDGET
    # "from K=4,s=3 (120 nodes, still inside budget) to K=4,s=4 (340 nodes, well outside it)"
    assert t.dense_tree_nodes(3, 4) == 120 < t.BUDGET


def test_ch4_tree_survival():
    # "roughly 1−(1−0.4)² = 1−0.36 = 0.64 assuming rough independence"
    assert t.best_of_s(0.4, 2) == pytest.approx(0.64)
    # "say that level's best-of-2 survival probability is 0.5" -> 1 + 0.64 + 0.64 * 0.5
    assert t.tree_expected_tokens([t.best_of_s(0.4, 2), 0.5]) == pytest.approx(1.96)
    # "a single linear chain of depth 2 ...: E[tokens] = 1 + 0.4 + 0.16 = 1.56"
    assert t.tree_expected_tokens([0.4, 0.4]) == pytest.approx(1.56)
    assert t.tree_expected_tokens([0.4] * 2) == pytest.approx(t.expected_tokens(0.4, 2))


def test_ch4_medusa_head_memory():
    # "4,096 × 128,000 ≈ 524 million parameters per head"
    assert round(4096 * 128_000 / 1e6) == 524
    # "134 MB against the target's 14 GB is under 1% additional GPU memory"
    params = t.medusa_head_params(4096, 4)
    assert round(params * 2 / 1e6) == 134
    assert params * 2 / 14e9 < 0.01


def test_ch4_falloff_bottom_two_vs_top():
    # "A representative illustrative spread for the top-4 candidates at one head might run 0.55,
    #  0.22, 0.12, 0.06 — the bottom two candidates together hold under a fifth of the mass the
    #  top one holds alone." NOT reproducible: (0.12 + 0.06) / 0.55 = 0.327, under a third.
    ratio = (0.12 + 0.06) / 0.55
    assert 0.2 < ratio < 1 / 3


# --- Chapter 5 --------------------------------------------------------------------------------


def test_ch5_eagle():
    # "log₂(vocab size) bits ..., around 17 bits for a 100,000-token vocabulary"
    assert round(math.log2(100_000)) == 17
    # "scales roughly as 12 × d² ... That's already close to the ~0.24 billion figure"
    assert round(t.transformer_layer_params(4096) / 1e9, 2) == 0.20
    # "published EAGLE draft models run around 0.24 billion extra parameters against a 7B target"
    tau = t.tau_from_params(0.24e9, 7e9)
    # "EAGLE achieves ... (2.96× at the shared k=4 baseline"
    assert round(t.speedup(0.80, 4, tau), 2) == 2.96
    # "against Chapter 3's token-level draft at α=0.65" / "from a token-level baseline around 1.8×"
    assert round(t.speedup(0.65, 4, 0.1), 1) == 1.8
    # "Apply the conservative end of that range [10–30%]" -> "EAGLE-2's estimated 3.70 tokens/round"
    eagle2 = t.expected_tokens(0.80, 4) * 1.10
    assert round(eagle2, 2) == 3.70
    # "Applying a further conservative improvement of roughly 8% to EAGLE-2's already-derived
    #  3.70 tokens/round" -> "climbing toward 3.5× with EAGLE-3's refinements"
    assert round(eagle2 * 1.08 / (1 + 4 * tau), 1) == 3.5


# --- Chapter 6 --------------------------------------------------------------------------------

UPDATES = [lambda v: (6 - v[1]) / 2, lambda v: (7 - v[0]) / 3]


def test_ch6_jacobi_vs_gauss_seidel():
    # Gauss-Seidel: "solve x first using the current y=0, then immediately use that new x to solve y"
    gs = t.gauss_seidel_solve(UPDATES, [0, 0], 1)
    assert gs[0] == pytest.approx([3.0, 4 / 3])
    # Jacobi round 2: "x = (6−2.333)÷2 = 1.834, y = (7−3.0)÷3 = 1.333"
    jac = t.jacobi_solve(UPDATES, [0, 0], 40)
    assert jac[0] == pytest.approx([3.0, 7 / 3])
    assert jac[1] == pytest.approx([1.8333, 1.3333], abs=1e-3)
    # "Both methods converge toward the same true solution (x≈1.571, y≈1.810)" — NOT
    # reproducible: the fixed point of x = (6-y)/2, y = (7-x)/3 is x = 2.2, y = 1.6.
    assert jac[-1] == pytest.approx([2.2, 1.6], abs=1e-9)
    assert t.gauss_seidel_solve(UPDATES, [0, 0], 40)[-1] == pytest.approx([2.2, 1.6], abs=1e-9)


def test_ch6_window_example():
    # "the first Jacobi pass confirms the first 3 positions ..., the second pass ... confirms
    #  3 more, and the third pass confirms the final 2" — "the same rough 2–3.5× range"
    tpp = t.jacobi_tokens_per_pass([3, 3, 2])
    assert tpp == pytest.approx(8 / 3) and 2 <= tpp <= 3.5
    # "Worst case, W iterations confirm W tokens — exactly W × 7 ms, matching plain
    #  autoregressive decoding exactly"
    assert t.jacobi_speedup(8, 8) == 1.0
    with pytest.raises(ValueError, match="confirmed_per_pass"):
        t.jacobi_tokens_per_pass([3, 0, 5])  # every pass confirms at least one token


def test_ch6_ngram_pool():
    # "suppose 40% of new windows now find a full or partial seed match, cutting their
    #  convergence to 2 passes, while the remaining 60% still take the original 4"
    assert t.jacobi_expected_passes(4, 0.4, 2) == pytest.approx(3.2)
    assert t.jacobi_expected_passes(4) == 4
    assert t.jacobi_speedup(8, 3.2) == pytest.approx(2.5)
    assert t.jacobi_speedup(8, 4) == pytest.approx(2.0)


# --- Chapters 0 and 7 -------------------------------------------------------------------------


def test_ch0_utilization():
    # "0.64% compute utilization" / "99.36% of a resource already being paid for"
    assert round(100 / t.BUDGET, 2) == 0.64
    assert round(100 - 100 / t.BUDGET, 2) == 99.36


def test_ch7_near_saturated():
    # "A server is running B=140 concurrent real decode requests ... Headroom remaining:" 16
    assert t.headroom(156, 140) == 16
    # "verifying k+1=5 candidate positions costs roughly 5 token-equivalents"
    assert t.speculation_cost(4) == 5
    assert t.total_demand(140, 1, 4) == 145 <= t.BUDGET
    # "30 concurrent requests all try to speculate with k=4 ... The step is now solidly
    #  compute-bound" — demand 290, the step stretches ~1.86x
    assert t.total_demand(140, 30, 4) == 290
    assert t.step_time_factor(290) == pytest.approx(290 / 156)
    assert t.step_time_factor(145) == 1.0


def test_ch7_quiet_server():
    # "A server running B=20 real concurrent requests"; "Suppose every one of those 20 requests
    #  speculates at k=4 ... Every one of them speculates for free, with room to spare"
    room = t.headroom(156, 20)
    assert room == 136 and 20 * t.speculation_cost(4) <= room
    # "up to roughly 136 ÷ 5 ≈ 27 requests' worth of k=4 speculation"
    assert t.requests_that_fit(room, 4) == 27


def test_ch7_priority_allocation():
    # "a server at B=120 has 36 units of headroom (156−120). Ten interactive sessions
    #  requesting k=4 (5 units each, 50 units total) exceed that headroom alone; a
    #  fairness-aware scheduler grants full k=4 speculation to the 7 highest-priority
    #  interactive sessions (35 units, just under the 36-unit ceiling) and drops the remaining
    #  3 interactive sessions and any batch jobs to k=0"
    room = t.headroom(156, 120)
    assert room == 36
    sessions = [t.Session(f"chat{i}", 4, True, priority=10 - i) for i in range(10)]
    sessions += [t.Session("nightly-summaries", 4, interactive=False, priority=100)]
    grant = t.allocate_headroom(sessions, room)
    assert [s.name for s in sessions if grant[s.name] == 4] == [f"chat{i}" for i in range(7)]
    assert sum(t.speculation_cost(k) for k in grant.values() if k) == 35
    assert grant["chat7"] == grant["chat8"] == grant["chat9"] == grant["nightly-summaries"] == 0


def test_cost_curve_speedup():
    flat = {n: 1.0 for n in range(1, 40)}
    assert t.speedup_with_cost_curve(0.7, 4, 0.1, flat) == pytest.approx(t.speedup(0.7, 4, 0.1))
    # a measured curve in seconds: only the ratio to the 1-position step matters
    assert t.speedup_with_cost_curve(0.7, 4, 0.1, lambda n: 0.007) == pytest.approx(t.speedup(0.7, 4, 0.1))
    # a pass that costs more per position lowers the speedup and the best k
    steep = lambda n: 1.0 + 0.05 * (n - 1)  # noqa: E731
    assert t.speedup_with_cost_curve(0.7, 4, 0.1, steep) == pytest.approx(2.7731 / (0.4 + 1.2))
    assert t.best_k(0.7, 0.1, cost=steep) < t.best_k(0.7, 0.1)
    # at B = 140, a k = 4 pass (145 positions) is still free; at B = 290-5 it is not
    assert t.speedup_with_cost_curve(0.7, 4, 0.1, t.roofline_cost(140)) == pytest.approx(t.speedup(0.7, 4, 0.1))
    assert t.speedup_with_cost_curve(0.7, 4, 0.1, t.roofline_cost(285)) < t.speedup(0.7, 4, 0.1)
    with pytest.raises(ValueError, match="cost"):
        t.speedup_with_cost_curve(0.7, 4, 0.1, {1: 1.0})


def test_ch7_allocation_boundaries():
    # an exact fit is granted: B = 121 leaves 35 units, exactly seven k = 4 sessions
    sessions = [t.Session(f"chat{i}", 4) for i in range(8)]
    grant = t.allocate_headroom(sessions, t.headroom(156, 121))
    assert [grant[f"chat{i}"] for i in range(8)] == [4] * 7 + [0]
    # equal priority keeps the callers' order (stable): the first seven, not the last seven
    assert t.allocate_headroom(sessions[::-1], 35)["chat0"] == 0
    # a session asking k = 0 decodes plainly and spends nothing: the next one still gets its 5 units
    assert t.allocate_headroom([t.Session("plain", 0), t.Session("spec", 4)], 5) == {"plain": 0, "spec": 4}


def test_ch7_requests_that_fit_rounds_down_and_never_below_zero():
    # "136 ÷ 5 ≈ 27": whole requests only; 19 units hold three k = 4 requests, not 3.8 rounded to 4
    assert t.requests_that_fit(t.headroom(156, 137), 4) == 3
    assert t.requests_that_fit(t.headroom(156, 121), 4) == 7  # 35 units: exactly seven
    # past the budget (B = 170: headroom -14) nobody speculates, rather than "-3 requests"
    assert t.requests_that_fit(t.headroom(156, 170), 4) == 0


def test_best_k_ties_go_to_the_smaller_k():
    # a useless draft that costs nothing: every k gives exactly 1.0x, so don't speculate
    assert t.best_k(0.0, 0.0) == 0
    assert t.best_k(0.0, 0.0, cost=lambda n: 1.0) == 0


def test_misestimate_beyond_k_max():
    # a deployed k above k_max is compared against the best k up to it, so the loss is never negative
    m = t.misestimate_cost(0.99, 0.0, k=40)
    assert m.best_k == 40 and m.lost_fraction == pytest.approx(0.0)


def test_jacobi_pool_defaults_and_gauss_seidel_history():
    # a pool hit rate without a pool pass count saves nothing: every window still takes the cold passes
    assert t.jacobi_expected_passes(4, 0.4) == 4
    # each round of the history is that round's values, not the final ones: x = 3, y = 4/3, then
    # x = (6 - 4/3)/2 = 7/3, y = (7 - 7/3)/3 = 14/9
    gs = t.gauss_seidel_solve(UPDATES, [0, 0], 2)
    assert gs[0] == pytest.approx([3.0, 4 / 3]) and gs[1] == pytest.approx([7 / 3, 14 / 9])


def test_acceptance_rate_skips_tokens_neither_side_proposes():
    # top-k truncation leaves zeros in both p and q: those tokens add nothing (not 0/0)
    assert t.acceptance_rate((0.5, 0.5, 0.0), (0.5, 0.5, 0.0)) == pytest.approx(1.0)
    assert t.acceptance_rate((0.5, 0.3, 0.2, 0.0), (0.4, 0.4, 0.2, 0.0)) == pytest.approx(0.9)


# --- boundaries and bad input ------------------------------------------------------------------


def test_break_even_edges():
    assert t.break_even_alpha(0, 0.1) == 0.0
    assert t.break_even_alpha(4, 0.0) == 0.0
    assert t.break_even_alpha(4, 1.0) == pytest.approx(1.0)
    assert t.break_even_alpha(4, 1.5) is None
    assert t.best_k(0.0, 0.1) == 0  # a useless draft: don't speculate
    assert t.best_k(1.0, 0.0, k_max=10) == 10
    assert t.best_k(0.7, 0.0, k_max=1000) == 1000  # free drafts: every token more adds 0.7^(k+1) > 0


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda: t.expected_tokens(1.5, 4), "alpha"),
        (lambda: t.expected_tokens(-0.1, 4), "alpha"),
        (lambda: t.expected_tokens(float("nan"), 4), "alpha"),
        (lambda: t.expected_tokens("0.7", 4), "alpha must be a number"),
        (lambda: t.expected_tokens(0.5, -1), "k"),
        (lambda: t.expected_tokens(0.5, 2.5), "k"),
        (lambda: t.speedup(0.5, 4, -0.1), "tau"),
        (lambda: t.speedup(0.5, 4, float("inf")), "tau"),
        (lambda: t.best_k(0.5, 0.1, k_max=-1), "k_max"),
        (lambda: t.break_even_alpha(-2, 0.1), "k"),
        (lambda: t.overlap((0.5, 0.6), (0.5, 0.5)), "p"),
        (lambda: t.overlap((0.5, 0.5), (-0.5, 1.5)), "q"),
        (lambda: t.overlap((0.5, 0.5), (0.2, 0.3, 0.5)), "same vocabulary"),
        (lambda: t.headroom(156, -3), "occupancy"),
        (lambda: t.requests_that_fit(36, -1), "k"),
        (lambda: t.dense_tree_nodes(-1, 2), "s"),
        (lambda: t.tree_expected_tokens([0.5, 1.2]), r"level_survival\[1\]"),
        (lambda: t.hybrid_tau([0.7, 0.2], [0.002, 0.1]), "shares"),
        (lambda: t.jacobi_expected_passes(4, 1.4, 2), "pool_hit_rate"),
        (lambda: t.misestimate_cost(0.5, 0.1), "k or alpha_assumed"),
    ],
)
def test_bad_input_names_the_argument(call, name):
    with pytest.raises(ValueError, match=name):
        call()
