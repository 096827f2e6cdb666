"""AdaptiveK's arithmetic on hand-worked numbers: the cost curve, the per-position estimates, the choice of k,
starting costs, probes and the timing averages (each number here is worked out in the comment beside it)."""

import math
from types import SimpleNamespace

import pytest

from specdec.adaptive import AdaptiveK, CostCurve, FixedK, choose_k

FLAT = {1: 1.0, 64: 1.0}  # verifying is free: the lesson's idealized budget


def test_cost_curve_interpolates_and_holds_its_ends():
    c = CostCurve({1: 1.0, 4: 1.5, 8: 3.0})
    assert c(0) == c(1) == 1.0
    assert c(2) == pytest.approx(1.0 + 0.5 / 3)  # a third of the way from 1 to 4
    assert c(4) == 1.5 and c(6) == pytest.approx(2.25) and c(8) == 3.0
    assert c(9) == c(100) == 3.0  # past the last point: the last point's cost


def test_the_lessons_worked_speedup():
    """alpha 0.7 at every position, tau 0.1, flat verify: E(4) = 2.77 tokens for 1.4 steps, 1.98x."""
    a = AdaptiveK(k_max=4, cost=CostCurve(FLAT), prior_alpha=0.7, tau=0.1)
    assert a.expected_tokens()[4] == pytest.approx(1 + 0.7 + 0.49 + 0.343 + 0.2401)
    assert a.predicted()[4] == pytest.approx(2.7731 / 1.4)
    assert a.predicted()[0] == 1.0


def test_observe_counts_the_positions_a_round_reached():
    """4 drafted, 1 accepted: positions 1 and 2 were reached (the second rejected), 3 and 4 never were."""
    a = AdaptiveK(k_max=3)
    a.observe(4, 1)
    assert a.tried == [1.0, 1.0, 0.0, 0.0] and a.accepted == [1.0, 0.0, 0.0, 0.0]
    a.observe(2, 2)  # every draft accepted: both positions reached, the older counts decayed by 0.9
    assert a.tried == pytest.approx([1.9, 1.9, 0.0, 0.0]) and a.accepted == pytest.approx([1.9, 1.0, 0.0, 0.0])


def test_the_defaults():
    a = AdaptiveK()
    assert a.alphas() == [0.6] * 8 and (a.tau, a.explore_every, a.probing) == (0.0, 8, False)
    assert (CostCurve()(1), CostCurve()(64), CostCurve()(65)) == (1.0, 4.0, 4.0)


def test_expected_tokens_multiplies_each_positions_own_alpha():
    a = AdaptiveK(k_max=3)  # prior alpha 0.6, weight 2
    a.observe(3, 1)
    a1 = (1 + 2 * 0.6) / (1 + 2)  # 0.733: one reached, one accepted, the prior's weight 2
    a2 = (0 + 2 * a1) / (1 + 2)  # 0.489: reached, rejected; its prior is position 1's estimate
    assert a.alphas() == pytest.approx([a1, a2, a2])  # position 3 never reached: position 2's estimate
    assert a.expected_tokens() == pytest.approx([1, 1 + a1, 1 + a1 + a1 * a2, 1 + a1 + a1 * a2 + a1 * a2 * a2])


def test_choose_takes_the_best_k_from_1_to_k_max():
    assert AdaptiveK(k_max=5, cost=CostCurve(FLAT), prior_alpha=0.9).choose() == 5  # free verify: the longest
    steep = CostCurve({1: 1.0, 2: 1.0, 3: 3.0})  # a second position costs 2 more steps
    assert AdaptiveK(k_max=5, cost=steep, prior_alpha=0.6).choose() == 1  # 1.6x at k = 1, 0.65x at k = 2
    assert AdaptiveK(k_max=5, cost=CostCurve(FLAT), prior_alpha=0.6, tau=0.7).choose() == 0  # 1.6 / 1.7


def test_a_starting_cost_is_paid_only_when_the_tokens_left_repay_it():
    """Predicted 2x at k = 1 saves half a step a token: 10 tokens left repay a startup below 5 steps, not 5."""
    policy = lambda: AdaptiveK(k_max=1, cost=CostCurve(FLAT), prior_alpha=1.0)
    assert policy().predicted() == [1.0, 2.0]
    assert policy().choose(startup=4.9, remaining=10) == 1
    assert policy().choose(startup=5.0, remaining=10) == 0
    assert policy().choose(startup=0.5, remaining=1) == 0  # 0.5 saved, 0.5 paid: not worth it
    assert policy().choose(startup=0.5, remaining=None) == 0  # unknown length: never
    ks = [policy().choose(startup=s, remaining=2) for s in (0.0, -1.0)]
    assert ks == [1, 1]  # no starting cost


def test_probes_wait_and_never_pay_an_unpriced_start():
    a = AdaptiveK(prior_alpha=0.01, cost=CostCurve(FLAT), tau=0.1)
    ks = [a.choose() for _ in range(8 + 16)]
    assert ks == [0] * 7 + [1] + [0] * 15 + [1]  # the wait doubles after each probe: 8, then 16
    unpriced = AdaptiveK(prior_alpha=0.01, cost=CostCurve(FLAT), tau=0.1)
    assert [unpriced.choose(startup=math.inf, remaining=100) for _ in range(200)] == [0] * 200


def test_a_dear_probe_waits_longer():
    """The explore_wait docstring's example on the default curve: a probe costs verify(2) + tau - 1 steps more than a
    plain one, and may spend 5% of the steps waited: tau 0.7 -> 0.748 / 0.05 -> 15 steps, doubling to at most 128."""
    assert [AdaptiveK(tau=0.7, probes=p).explore_wait() for p in range(6)] == [15, 30, 60, 120, 128, 128]
    assert [AdaptiveK(tau=0.002, probes=p).explore_wait() for p in range(6)] == [8, 16, 32, 64, 128, 128]


def test_refused_asks_mark_the_next_ask_a_probe():
    a = AdaptiveK(cost=CostCurve(FLAT), prior_alpha=0.9)
    assert a.probing is False
    for _ in range(a.explore_every - 1):
        a.refused()
    assert a.choose() > 0 and a.probing is False
    a.refused()
    assert a.choose() > 0 and a.probing is True and a.refused_asks == 0
    assert a.choose() > 0 and a.probing is False  # one probe, not one per ask
    a.refused()
    a.observe(2, 1)  # a round that ran: the count starts again
    assert a.refused_asks == 0


def test_timing_takes_the_first_measurements_as_they_are_then_averages():
    a = AdaptiveK(cost=CostCurve({1: 1.0, 3: 1.2, 64: 4.0}))
    a.timing(0, 1.0, 1.0)  # nothing drafted: nothing learned
    assert a.rounds_timed == 0 and a.tau == 0.0
    a.plain_timing(0.010)
    a.plain_timing(0.020)
    assert a.step_s == pytest.approx(0.7 * 0.010 + 0.3 * 0.020)
    a.step_s = 0.010
    a.timing(2, 0.004, 0.015)  # first round: its draft time holds the drafter's prefill, so tau waits
    assert (a.rounds_timed, a.tau_measured, a.tau) == (1, 0, 0.0)
    assert (a.extra_measured, a.extra) == (1, pytest.approx(1.5 - 1.2))
    a.timing(2, 0.002, 0.012)
    assert a.extra == pytest.approx(0.7 * 0.3 + 0.3 * 0.0) and a.extra_measured == 2
    assert a.tau == pytest.approx(0.1) and a.tau_measured == 1  # 1 ms a draft token over a 10 ms step
    a.timing(2, 0.004, 0.012)
    assert a.tau == pytest.approx(0.7 * 0.1 + 0.3 * 0.2) and a.tau_measured == 2
    assert a.verify_cost(1) == 1.0 and a.verify_cost(3) == pytest.approx(1.2 + a.extra)


def test_choose_k_prices_the_drafters_startup_in_target_steps():
    winning = lambda: AdaptiveK(k_max=1, cost=CostCurve(FLAT), prior_alpha=1.0)
    ctx = SimpleNamespace(prefill_cost=0.01, remaining=10)
    unpriced = SimpleNamespace(prefill_cost=None, remaining=10)  # before a plain step has been timed
    assert choose_k(winning(), object(), unpriced) == 1  # a drafter of its own making, with no `startup`
    starts = lambda tokens: SimpleNamespace(startup=lambda ctx: tokens)
    assert choose_k(winning(), starts(0), unpriced) == 1
    assert choose_k(winning(), starts(490), ctx) == 1  # 4.9 steps < 10 x 0.5
    assert choose_k(winning(), starts(500), ctx) == 0
    assert choose_k(winning(), starts(1), unpriced) == 0
    assert choose_k(FixedK(3), starts(10**9), ctx) == 3  # a fixed k is the caller's choice
