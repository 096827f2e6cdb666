"""The race's simulator (the lesson's Chapter 8) against the lesson's numbers and specdec.theory."""

import pytest

from specdec import theory
from specdec.race import sim
from specdec.race.sim import PRESETS, RaceParams, race, simulate

LONG = 7.0 * 30000  # 30,000 vanilla steps at 7 ms: thousands of rounds


def params(key: str, **kw) -> RaceParams:
    p = sim.preset(key)
    return RaceParams(alpha=p.alpha, tau=p.tau, **kw)


def test_code_editing_worked_example():
    # Ch. 8: "Set the workload to code editing at low batch occupancy ... matching Chapter 3's 3.47× figure"
    p = params("code-editing", k=4)
    assert p.vanilla_ms() == pytest.approx(7.0)
    assert p.round_ms() == pytest.approx(7.0 * (1 + 4 * 0.002))  # 7.056 ms
    assert round(p.predicted_speedup(), 2) == 3.47
    s = race(p, LONG, segment=3)
    assert s.measured_speedup == pytest.approx(3.47, rel=0.03)


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.key)
def test_long_run_speedup_agrees_with_the_formula(preset):
    p = RaceParams(alpha=preset.alpha, k=4, tau=preset.tau, seed=7)
    s = race(p, LONG)
    assert s.predicted_speedup == pytest.approx(theory.speedup(preset.alpha, 4, preset.tau))
    assert s.measured_speedup == pytest.approx(s.predicted_speedup, rel=0.05)
    assert s.mean_tokens_per_round == pytest.approx(theory.expected_tokens(preset.alpha, 4), rel=0.05)


def test_histogram_follows_the_bursts_distribution():
    # Ch. 2: at alpha = 0.7, k = 4 a round emits 1..5 tokens with [0.3, 0.21, 0.147, 0.1029, 0.2401]
    s = race(RaceParams(alpha=0.7, k=4, tau=0.1, seed=1), LONG)
    want = theory.tokens_per_round_distribution(0.7, 4)
    got = [s.histogram[n] / s.rounds for n in range(1, 6)]
    assert got == pytest.approx(want, abs=0.015)


def test_seeded_determinism():
    p = RaceParams(alpha=0.6, k=5, tau=0.1, seed=42)
    a, b = simulate(p, 2000.0, segment=2), simulate(p, 2000.0, segment=2)
    assert a[1].to_dict() == b[1].to_dict() and a[0].to_dict() == b[0].to_dict()
    other_seed = simulate(RaceParams(alpha=0.6, k=5, tau=0.1, seed=43), 2000.0, segment=2)[1]
    other_segment = simulate(p, 2000.0, segment=3)[1]
    assert other_seed.accepted != a[1].accepted and other_segment.accepted != a[1].accepted


def test_rounds_and_their_kinds():
    vanilla, spec = simulate(RaceParams(alpha=0.5, k=3, tau=0.05), 500.0, start_vanilla_ms=10.0, start_spec_ms=12.0)
    assert vanilla.end_ms[0] == pytest.approx(17.0) and set(vanilla.kind) == {"plain"}
    assert vanilla.tokens == len(vanilla.end_ms)
    for a, kind in zip(spec.accepted, spec.kind):
        assert (kind == "bonus") == (a == 3) and (kind == "recovered") == (a < 3)
    assert spec.last_ms >= 500.0 and spec.end_ms[-2] < 500.0
    assert spec.tokens == sum(spec.accepted) + len(spec.accepted)


def test_k0_is_the_vanilla_lane():
    s = race(RaceParams(alpha=0.9, k=0, tau=0.1), 7.0 * 1000)
    assert s.measured_speedup == pytest.approx(1.0) and s.predicted_speedup == 1.0
    assert s.histogram == {1: s.rounds}


def test_compute_bound_stretch_past_the_budget():
    # Ch. 7: flat while B + k + 1 fits the 156 budget, then "it grows roughly in proportion to how far
    # total demand exceeds the 156 line"; every request in the batch waits longer, plain ones too.
    flat = RaceParams(k=4, tau=0.002, occupancy=151)  # 151 + 5 = 156: still free
    assert flat.round_ms() == pytest.approx(7.056) and flat.vanilla_ms() == 7.0
    over = RaceParams(k=4, tau=0.002, occupancy=200)
    assert over.vanilla_ms() == pytest.approx(7.0 * 201 / 156)
    assert over.round_ms() == pytest.approx(7.0 * (4 * 0.002 * 201 / 156 + 205 / 156))
    assert over.predicted_speedup() == pytest.approx(
        theory.speedup_with_cost_curve(0.82, 4, 0.002, theory.roofline_cost(200, 156)))
    _, spec = simulate(over, 1000.0)
    gaps = [b - a for a, b in zip(spec.end_ms, spec.end_ms[1:])]
    assert gaps == pytest.approx([over.round_ms()] * len(gaps))
    # a measured budget (e.g. 8 positions on a CPU) stretches far sooner
    assert RaceParams(k=4, budget=8, occupancy=3).round_ms() == pytest.approx(7.0 * (0.008 + 1.0))
    assert RaceParams(k=4, budget=8, occupancy=20).round_ms() > 3 * 7.0


def test_pushing_b_past_the_budget_erodes_the_lead():
    # Ch. 8: "Drag batch occupancy up past roughly 150 on any workload and watch the speculative
    # stream's advantage erode"
    for key in ("code-editing", "open-chat"):
        quiet, busy = race(params(key, k=4, occupancy=20), LONG), race(params(key, k=4, occupancy=200), LONG)
        lead_quiet = quiet.spec_tokens - quiet.vanilla_tokens
        lead_busy = busy.spec_tokens - busy.vanilla_tokens
        assert lead_busy < 0.85 * lead_quiet
        assert busy.predicted_speedup < quiet.predicted_speedup
        assert busy.measured_speedup < quiet.measured_speedup
    # right at the line the speculating pass alone crosses it: the ratio itself drops
    assert params("code-editing", k=10, occupancy=155).predicted_speedup() < params("code-editing", k=10).predicted_speedup() * 0.95


def test_open_chat_k_sweep_rises_then_falls():
    # Ch. 8: "Hold the workload fixed on open chat (α=0.60) and sweep k from 1 up to 10 — the speculative
    # stream's lead should grow, then visibly stop growing (and start narrowing again)"
    measured = [race(params("open-chat", k=k, seed=5), 7.0 * 12000).measured_speedup for k in range(sim.K_MAX + 1)]
    peak = max(range(len(measured)), key=measured.__getitem__)
    assert 1 <= peak <= 6
    assert peak == pytest.approx(theory.best_k(0.6, 0.1, sim.K_MAX), abs=1)
    assert measured[0] == pytest.approx(1.0)
    assert measured[peak] > measured[1] > measured[0]
    assert measured[10] < measured[peak] * 0.85


def test_creative_writing_at_k8_loses():
    # Ch. 2 and 8: alpha = 0.15, k = 8, tau = 0.1 -> 0.65x: "sometimes the vanilla stream catches up entirely"
    s = race(params("creative-writing", k=8), LONG)
    assert round(s.predicted_speedup, 2) == 0.65
    assert s.measured_speedup == pytest.approx(0.65, rel=0.05) and s.spec_tokens < s.vanilla_tokens


@pytest.mark.parametrize("kw, name", [
    (dict(alpha=1.5), "alpha"), (dict(alpha=float("nan")), "alpha"), (dict(k=-1), "k"), (dict(k=2.5), "k"),
    (dict(tau=-0.1), "tau"), (dict(occupancy=-1), "occupancy"), (dict(budget=0), "budget"),
    (dict(step_ms=0), "step_ms"), (dict(step_ms=float("inf")), "step_ms"), (dict(seed="x"), "seed"),
])
def test_bad_parameters_name_the_argument(kw, name):
    with pytest.raises(ValueError, match=name):
        RaceParams(**kw)


def test_bad_times_and_presets():
    with pytest.raises(ValueError, match="until_ms"):
        simulate(RaceParams(), float("nan"))
    with pytest.raises(ValueError, match="start_spec_ms"):
        simulate(RaceParams(), 10.0, start_spec_ms=-1)
    with pytest.raises(ValueError, match="code-editing"):
        sim.preset("poetry")
    assert [p.alpha for p in PRESETS] == [0.82, 0.75, 0.60, 0.50, 0.15]


# --- QA session: the mutation audit's survivors -------------------------------------------------------

def test_presets_reproduce_the_lessons_numbers():
    # Ch. 3: prompt lookup 3.47x (code editing) and 3.03x (summarization) at k = 4; retrieval tau 0.007;
    # Ch. 2: the 700M draft model's tau 0.1 (open chat, and creative writing's 0.65x at k = 8)
    speed = {p.key: RaceParams(alpha=p.alpha, k=4, tau=p.tau).predicted_speedup() for p in PRESETS}
    assert round(speed["code-editing"], 2) == 3.47 and round(speed["summarization"], 2) == 3.03
    assert [p.tau for p in PRESETS] == [0.002, 0.002, 0.1, 0.007, 0.1]


def test_defaults_are_the_worked_example():
    assert RaceParams() == RaceParams(alpha=0.82, k=4, tau=0.002, occupancy=0, budget=156, step_ms=7.0, seed=0)


def test_a_boolean_seed_is_refused():
    with pytest.raises(ValueError, match="seed"):
        RaceParams(seed=True)


def test_k0_rounds_are_plain_steps():
    _, spec = simulate(RaceParams(alpha=0.9, k=0), 100.0)
    assert set(spec.kind) == {"plain"} and set(spec.accepted) == {0} and set(spec.drafted) == {0}


def test_every_round_drafts_k():
    _, spec = simulate(RaceParams(alpha=0.5, k=3), 500.0)
    assert spec.drafted == [3] * len(spec.end_ms) and len(set(spec.accepted)) > 1


def test_a_lane_stops_at_the_first_round_ending_at_or_past_until():
    vanilla, spec = simulate(RaceParams(k=4, tau=0.25), 14.0)  # rounds of 7 * 2 = 14 ms
    assert vanilla.end_ms == [7.0, 14.0] and spec.end_ms == [14.0]


def test_max_rounds_caps_both_lanes():
    vanilla, spec = simulate(RaceParams(), 10_000.0, max_rounds=5)
    assert len(vanilla.end_ms) == len(spec.end_ms) == 5


def test_an_empty_lane_ends_where_it_starts():
    vanilla, spec = simulate(RaceParams(), 5.0, start_vanilla_ms=50.0)
    assert vanilla.end_ms == [] and vanilla.last_ms == 50.0 and spec.last_ms == pytest.approx(7.056)
    s = sim.summarize(RaceParams(), vanilla, spec)  # no vanilla tokens yet: no ratio, no division by zero
    assert s.vanilla_tokens == 0 and s.measured_speedup == 0.0
    empty = sim.summarize(RaceParams(), vanilla, sim.Lane(50.0, [], [], [], []))
    assert empty.measured_speedup == 0.0 and empty.mean_tokens_per_round == 0.0


def test_mean_tokens_per_round_is_tokens_over_rounds():
    s = race(RaceParams(alpha=0.6, k=3, seed=2), 200.0)
    assert s.mean_tokens_per_round == s.spec_tokens / s.rounds


def test_race_uses_its_segments_stream():
    p = RaceParams(alpha=0.6, k=5, seed=4)
    assert race(p, 2000.0, segment=1) == race(p, 2000.0, segment=1) != race(p, 2000.0, segment=0)
