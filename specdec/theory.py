"""The lesson's arithmetic, one plain function per formula.

Speculative decoding's speed is a function of three numbers (Leviathan et al. 2023, Sec. 3;
Chen et al. 2023): the acceptance rate alpha, the draft length k, and the draft's cost per
token tau as a fraction of one target step. Everything here is closed-form or a short loop
and raises ValueError naming the argument on bad input.

Worked example (the lesson, Ch. 2): alpha = 0.7, k = 4, tau = 0.1 gives
expected_tokens = (1 - 0.7^5) / 0.3 = 2.7731 tokens per round and
speedup = 2.7731 / (1 + 4 * 0.1) = 1.98x; best_k(0.7, 0.1) = 4.

Costs follow the lesson's roofline: a decode step is memory-bound (7 ms for the 7B/A100
example) until a pass holds more than BUDGET = 156 token positions; beyond that it grows in
proportion to the positions (Ch. 0 and 7).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np

BUDGET = 156  # token positions one memory-bound step can verify for free (the lesson, Ch. 0)
STEP_MS = 7.0  # the lesson's memory-bound decode step, 7B target on an A100 (Ch. 0)


# --- validation ---------------------------------------------------------------------------


def _real(x, name: str) -> float:
    if isinstance(x, (bool, str, bytes)):  # float("0.7") would pass: a string is a caller's slip, not a number
        raise ValueError(f"{name} must be a number, got {x!r}")
    try:
        v = float(x)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {x!r}") from None
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {x!r}")
    return v


def _alpha(x, name: str = "alpha") -> float:
    v = _real(x, name)
    if not 0.0 <= v <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {x!r}")
    return v


def _nonneg(x, name: str) -> float:
    v = _real(x, name)
    if v < 0:
        raise ValueError(f"{name} must be >= 0, got {x!r}")
    return v


def _count(x, name: str = "k", minimum: int = 0) -> int:
    if isinstance(x, bool):
        raise ValueError(f"{name} must be an integer, got {x!r}")
    try:
        v = operator.index(x)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {x!r}") from None
    if v < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {v}")
    return v


# --- Chapter 1: overlap ---------------------------------------------------------------------


def _dist(x, name: str) -> np.ndarray:
    try:
        a = np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a sequence of probabilities") from None
    if a.ndim != 1 or a.size == 0:
        raise ValueError(f"{name} must be a non-empty 1-D distribution, got shape {a.shape}")
    if not np.all(np.isfinite(a)) or np.any(a < 0) or abs(a.sum() - 1.0) > 1e-6:
        raise ValueError(f"{name} must be a distribution: finite, non-negative, summing to 1")
    return a


def overlap(p, q) -> float:
    """alpha = sum_x min(p(x), q(x)): the probability that one drafted token is accepted.

    Ch. 1: p = (0.5, 0.3, 0.2), q = (0.4, 0.4, 0.2) -> 0.4 + 0.3 + 0.2 = 0.9."""
    pa, qa = _dist(p, "p"), _dist(q, "q")
    if pa.shape != qa.shape:
        raise ValueError(f"p and q must cover the same vocabulary, got {pa.size} and {qa.size}")
    return float(np.minimum(pa, qa).sum())


def acceptance_rate(p, q) -> float:
    """The same alpha computed the other way: sum_x q(x) * min(1, p(x)/q(x)), the per-token
    acceptance probability weighted by how often the draft proposes each token (Ch. 1:
    0.4 * 1 + 0.4 * 0.75 + 0.2 * 1 = 0.9)."""
    pa, qa = _dist(p, "p"), _dist(q, "q")
    if pa.shape != qa.shape:
        raise ValueError(f"p and q must cover the same vocabulary, got {pa.size} and {qa.size}")
    mask = qa > 0
    return float((qa[mask] * np.minimum(1.0, pa[mask] / qa[mask])).sum())


# --- Chapter 2: expected tokens and speedup -------------------------------------------------


def expected_tokens(alpha, k) -> float:
    """E[tokens per round] = 1 + alpha + ... + alpha^k = (1 - alpha^(k+1)) / (1 - alpha).

    Ch. 2: alpha = 0.7, k = 4 -> 2.7731; k = 0 -> 1 (plain decoding)."""
    a, k = _alpha(alpha), _count(k)
    if a == 1.0:
        return float(k + 1)
    if a == 0.0:
        return 1.0
    return -math.expm1((k + 1) * math.log(a)) / (1.0 - a)


def speedup(alpha, k, tau) -> float:
    """Wall-clock speedup over plain decoding: E[tokens] / (1 + k * tau).

    Ch. 2: (0.7, 4, 0.1) -> 1.98x; (0.15, 8, 0.1) -> 0.65x, slower than plain decoding."""
    k, t = _count(k), _nonneg(tau, "tau")
    return expected_tokens(alpha, k) / (1.0 + k * t)


CostCurve = Callable[[int], float] | Mapping[int, float]


def verify_cost(cost: CostCurve, positions: int) -> float:
    """Look up the measured cost of one target pass over `positions` positions."""
    if callable(cost):
        v = cost(positions)
    elif isinstance(cost, Mapping):
        if positions not in cost:
            raise ValueError(f"cost has no entry for {positions} positions (has {sorted(cost)})")
        v = cost[positions]
    else:
        raise ValueError("cost must be a callable n -> time or a dict {n: time}")
    v = _real(v, f"cost({positions})")
    if v <= 0:
        raise ValueError(f"cost({positions}) must be > 0, got {v}")
    return v


def speedup_with_cost_curve(alpha, k, tau, cost: CostCurve) -> float:
    """Speedup with a measured verify-cost curve instead of a flat step:
    E[tokens] * cost(1) / (k * tau * cost(1) + cost(k + 1)).

    cost maps a number of positions in one target pass to its time (any unit; tau is a
    fraction of the 1-position step). A flat curve gives speedup(); roofline_cost(B) adds the
    batch occupancy of Ch. 7."""
    k, t = _count(k), _nonneg(tau, "tau")
    e = expected_tokens(alpha, k)
    step = verify_cost(cost, 1)
    return e * step / (k * t * step + verify_cost(cost, k + 1))


def step_time_factor(positions, budget=BUDGET) -> float:
    """How much longer than a memory-bound step one pass over `positions` takes: flat at 1 up
    to the budget, then in proportion to the demand (Ch. 7: "it grows roughly in proportion
    to how far total demand exceeds the 156 line")."""
    n, b = _nonneg(positions, "positions"), _real(budget, "budget")
    if b <= 0:
        raise ValueError(f"budget must be > 0, got {budget!r}")
    return max(1.0, n / b)


def roofline_cost(occupancy=0, budget=BUDGET) -> Callable[[int], float]:
    """A cost curve for speedup_with_cost_curve: one speculating request's pass over n positions
    in a batch already holding `occupancy` other positions, relative to a free step."""
    b0 = _nonneg(occupancy, "occupancy")
    _real(budget, "budget")
    return lambda n: step_time_factor(b0 + n, budget)


def best_k(alpha, tau, k_max: int = 32, cost: CostCurve | None = None) -> int:
    """The k in [0, k_max] with the highest speedup (ties: the smaller k; 0 = don't speculate).
    Free drafts (tau = 0, no cost curve) with alpha > 0: every token more adds alpha^(k+1), so k_max (the
    gains fall below float precision near k = 80 for alpha = 0.7, which a comparison would call a tie).

    Ch. 2: best_k(0.7, 0.1) = 4 ("The peak sits right around k=4"); best_k(0.5, 0.1) = 2."""
    a, t, kmax = _alpha(alpha), _nonneg(tau, "tau"), _count(k_max, "k_max")
    if cost is None and t == 0 and a > 0:
        return kmax
    if cost is None:
        scores = [speedup(a, k, t) for k in range(kmax + 1)]
    else:
        scores = [speedup_with_cost_curve(a, k, t, cost) for k in range(kmax + 1)]
    best = max(scores)
    return next(k for k, s in enumerate(scores) if s >= best - 1e-12)


def break_even_alpha(k, tau) -> float | None:
    """The alpha at which speculating k tokens at draft cost tau exactly matches plain decoding
    (speedup = 1, i.e. E[tokens] = 1 + k * tau). Below it speculation is slower. Returns 0.0
    when k = 0 or tau = 0 (never slower), None when no alpha breaks even (tau > 1).

    Ch. 2: k = 8, tau = 0.1 breaks even near alpha = 0.44, so alpha = 0.15 loses (0.65x)."""
    k, t = _count(k), _nonneg(tau, "tau")
    target = 1.0 + k * t
    if k == 0 or t == 0:
        return 0.0
    if target > k + 1:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if expected_tokens(mid, k) < target:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-15:
            break
    return hi


def tokens_per_round_distribution(alpha, k) -> list[float]:
    """P(a round emits n tokens) for n = 1 .. k+1: alpha^(n-1) * (1 - alpha) for n <= k (the
    n-th draft is rejected), alpha^k for n = k+1 (all accepted, plus the bonus).

    Ch. 2, alpha = 0.7, k = 4: [0.3, 0.21, 0.147, 0.1029, 0.2401]."""
    a, k = _alpha(alpha), _count(k)
    return [a ** (n - 1) * (1 - a) for n in range(1, k + 1)] + [a**k]


def full_burst_probability(alpha, k) -> float:
    """P(a round emits all k+1 tokens) = alpha^k. Ch. 2: 0.7^4 = 0.2401."""
    a, k = _alpha(alpha), _count(k)
    return a**k


@dataclass(frozen=True)
class Misestimate:
    k: int  # the k that was deployed
    realized_speedup: float  # what that k achieves at the true alpha
    best_k: int  # the k the true alpha calls for
    best_speedup: float
    lost_fraction: float  # 1 - realized / best


def misestimate_cost(alpha_actual, tau, *, k=None, alpha_assumed=None, k_max: int = 32) -> Misestimate:
    """The cost of tuning k against the wrong alpha: deploy k (or best_k(alpha_assumed, tau))
    while traffic runs at alpha_actual.

    Ch. 2: k = 6 at a real alpha of 0.5 gives 1.24x, against 1.458x with that alpha's own k = 2."""
    if (k is None) == (alpha_assumed is None):
        raise ValueError("give exactly one of k or alpha_assumed")
    t = _nonneg(tau, "tau")
    chosen = best_k(alpha_assumed, t, k_max) if k is None else _count(k)
    realized = speedup(alpha_actual, chosen, t)
    kb = best_k(alpha_actual, t, max(k_max, chosen))
    sb = speedup(alpha_actual, kb, t)
    return Misestimate(chosen, realized, kb, sb, 1.0 - realized / sb)


# --- Chapter 3: where tau comes from ------------------------------------------------------------


def tau_from_params(draft_params, target_params) -> float:
    """Memory-bound steps cost in proportion to the weights read: tau = draft / target size.
    Ch. 2: a 700M draft for a 7B target -> 0.1; Ch. 5: EAGLE's 0.24B -> 0.034."""
    d, t = _nonneg(draft_params, "draft_params"), _real(target_params, "target_params")
    if t <= 0:
        raise ValueError(f"target_params must be > 0, got {target_params!r}")
    return d / t


def early_exit_tau(exit_layer, num_layers) -> float:
    """Self-speculative drafting reads the first exit_layer of num_layers: tau = the fraction.
    Ch. 3: exiting after layer 8 of 32 -> 0.25."""
    n = _count(num_layers, "num_layers", 1)
    e = _count(exit_layer, "exit_layer")
    if e > n:
        raise ValueError(f"exit_layer must be <= num_layers ({n}), got {e}")
    return e / n


def hybrid_tau(shares: Sequence[float], taus: Sequence[float]) -> float:
    """The effective tau of falling back between draft sources: sum(share_i * tau_i).
    Ch. 3: 0.7 * 0.002 + 0.3 * 0.10 = 0.031."""
    if len(shares) != len(taus) or not shares:
        raise ValueError("shares and taus must be non-empty and the same length")
    s = [_alpha(x, "shares") for x in shares]
    if abs(sum(s) - 1.0) > 1e-9:
        raise ValueError(f"shares must sum to 1, got {sum(s)}")
    return sum(si * _nonneg(ti, "taus") for si, ti in zip(s, taus))


# --- Chapters 4 and 5: trees and heads -------------------------------------------------------------


def dense_tree_nodes(s, depth) -> int:
    """Nodes of a dense tree with s candidates per head and `depth` heads: sum_{i=1..depth} s^i.
    Ch. 4: s = 4, depth = 4 -> 340 (over the 156 budget); s = 3 -> 120; s = 2, depth = 2 -> 6."""
    s, d = _count(s, "s"), _count(depth, "depth")
    return sum(s**i for i in range(1, d + 1))


def best_of_s(alpha, s) -> float:
    """P(at least one of s independent candidates matches): 1 - (1 - alpha)^s.
    Ch. 4: 1 - (1 - 0.4)^2 = 0.64. An approximation: real siblings are correlated."""
    a, s = _alpha(alpha), _count(s, "s", 1)
    return 1.0 - (1.0 - a) ** s


def tree_expected_tokens(level_survival: Iterable[float]) -> float:
    """E[tokens] when level i survives with probability level_survival[i] given the levels
    above: 1 + s1 + s1*s2 + ... A chain is [alpha] * k. Ch. 4: [0.64, 0.5] -> 1.96 against the
    chain [0.4, 0.4] -> 1.56."""
    total, reach = 1.0, 1.0
    for i, a in enumerate(level_survival):
        reach *= _alpha(a, f"level_survival[{i}]")
        total += reach
    return total


def medusa_head_params(hidden, heads) -> int:
    """Medusa heads are one d x d residual layer each, reusing the frozen unembedding:
    heads * d^2. Ch. 4: 4 heads at d = 4096 -> 67.1M parameters, 134 MB in fp16."""
    d, h = _count(hidden, "hidden", 1), _count(heads, "heads")
    return h * d * d


def transformer_layer_params(hidden) -> int:
    """One transformer layer: about 12 d^2 (4 d^2 attention + 8 d^2 MLP). Ch. 5: d = 4096 ->
    201M, close to EAGLE's reported 0.24B draft."""
    d = _count(hidden, "hidden", 1)
    return 12 * d * d


# --- Chapter 6: Jacobi iteration -------------------------------------------------------------------


def jacobi_tokens_per_pass(confirmed_per_pass: Sequence[int]) -> float:
    """Tokens confirmed per target pass (= the speedup, each pass costing one step).
    Ch. 6: a window of 8 confirmed 3 + 3 + 2 over three passes -> 8/3 = 2.67."""
    counts = [_count(c, "confirmed_per_pass", 1) for c in confirmed_per_pass]
    if not counts:
        raise ValueError("confirmed_per_pass must not be empty")
    return sum(counts) / len(counts)


def jacobi_expected_passes(cold_passes, pool_hit_rate=0.0, pool_passes=None) -> float:
    """Average passes to fill a window when a fraction of windows is seeded from the n-gram
    pool: hit * pool_passes + (1 - hit) * cold_passes.
    Ch. 6: 0.4 * 2 + 0.6 * 4 = 3.2 passes (4 without the pool)."""
    cold = _real(cold_passes, "cold_passes")
    if cold < 1:
        raise ValueError(f"cold_passes must be >= 1, got {cold_passes!r}")
    hit = _alpha(pool_hit_rate, "pool_hit_rate")
    warm = cold if pool_passes is None else _real(pool_passes, "pool_passes")
    if warm < 1:
        raise ValueError(f"pool_passes must be >= 1, got {pool_passes!r}")
    return hit * warm + (1.0 - hit) * cold


def jacobi_speedup(window, passes) -> float:
    """window / passes: never below 1 because each pass confirms at least one token
    (Ch. 6: the worst case, W passes for W tokens, is exactly plain decoding)."""
    w = _count(window, "window", 1)
    n = _real(passes, "passes")
    if not 1 <= n <= w:
        raise ValueError(f"passes must be in [1, window = {w}], got {passes!r}")
    return w / n


def jacobi_solve(updates: Sequence[Callable[[list[float]], float]], x0: Sequence[float], rounds: int) -> list[list[float]]:
    """Jacobi iteration: every unknown updated at once from the previous round's values.
    Returns the values after each round. Ch. 6's x = (6 - y)/2, y = (7 - x)/3 from (0, 0):
    round 1 (3, 2.333), round 2 (1.833, 1.333)."""
    x = [float(v) for v in x0]
    history = []
    for _ in range(_count(rounds, "rounds")):
        x = [f(x) for f in updates]
        history.append(x)
    return history


def gauss_seidel_solve(updates: Sequence[Callable[[list[float]], float]], x0: Sequence[float], rounds: int) -> list[list[float]]:
    """Gauss-Seidel: unknowns updated in order, each using the freshest values (like plain
    decoding). Ch. 6: x = 3, then y = (7 - 3)/3 = 1.333."""
    x = [float(v) for v in x0]
    history = []
    for _ in range(_count(rounds, "rounds")):
        for i, f in enumerate(updates):
            x[i] = f(x)
        history.append(list(x))
    return history


# --- Chapter 7: the shared budget -------------------------------------------------------------------


def headroom(budget=BUDGET, occupancy=0) -> float:
    """Positions left for speculation: budget - B (negative when already over budget).
    Ch. 7: 156 - 140 = 16; 156 - 20 = 136; 156 - 120 = 36."""
    b = _real(budget, "budget")
    if b <= 0:
        raise ValueError(f"budget must be > 0, got {budget!r}")
    return b - _nonneg(occupancy, "occupancy")


def speculation_cost(k) -> int:
    """Budget units one request spends verifying k drafts: k + 1 positions (Ch. 7: k=4 -> 5)."""
    return _count(k) + 1


def requests_that_fit(headroom_units, k) -> int:
    """How many requests can speculate k tokens inside the headroom: floor(headroom / (k+1)).
    Ch. 7: 136 / 5 -> 27 at B = 20."""
    h = _real(headroom_units, "headroom")
    return max(0, math.floor(h / speculation_cost(k) + 1e-12))


def total_demand(occupancy, speculating, k) -> float:
    """Budget units in one step: B + (requests speculating) * (k + 1), the lesson's accounting.
    Ch. 7: 140 + 1 * 5 = 145 fits; 140 + 30 * 5 = 290 is far past the 156 line."""
    b = _nonneg(occupancy, "occupancy")
    n = _count(speculating, "speculating")
    return b + n * speculation_cost(k)


@dataclass(frozen=True)
class Session:
    name: str
    k: int  # the draft length it asks for
    interactive: bool = True  # interactive sessions come before batch jobs
    priority: float = 0.0  # higher first, within the same class


def allocate_headroom(sessions: Sequence[Session], headroom_units) -> dict[str, int]:
    """Grant speculation by priority instead of splitting it evenly (Ch. 7): interactive
    sessions first, then by priority (stable); each gets its full k if k + 1 units still fit,
    otherwise k = 0 (plain decoding) for this step.

    Ch. 7: B = 120 leaves 36 units; of ten interactive sessions asking k = 4, seven get it
    (35 units) and the other three, and any batch job, drop to 0."""
    left = _real(headroom_units, "headroom")
    order = sorted(range(len(sessions)), key=lambda i: (not sessions[i].interactive, -sessions[i].priority, i))
    granted: dict[str, int] = {}
    for i in order:
        s = sessions[i]
        if s.name in granted:
            raise ValueError(f"sessions has a duplicate name {s.name!r}")
        cost = speculation_cost(s.k)
        if s.k > 0 and cost <= left + 1e-12:
            granted[s.name] = s.k
            left -= cost
        else:
            granted[s.name] = 0
    return {s.name: granted[s.name] for s in sessions}
