"""Adaptive k: choose each round's draft length from the lesson's speedup formula (Ch. 2),
with measured inputs instead of assumed ones.

    speedup(k) = E[tokens](k) / cost(k)
    E[tokens](k) = 1 + sum_{i=1..k} prod_{j<=i} alpha_j        (alpha_j: acceptance at draft position j
                                                                 given positions < j were accepted)
    cost(k) = verify(k+1) + k * tau                             (in units of one plain target step)

For a tree drafter (Medusa) k is the tree's depth: the drafter cuts its tree at depth k, alpha_j is
the acceptance at depth j, and cost uses the n = nodes(k) positions that tree verifies, verify(n+1) + n * tau.

alpha_j is a running, decaying per-position estimate for this request and source (acceptance
decays along a draft, so one alpha would overestimate long drafts); tau is the measured draft
cost per token over the measured plain step; verify(n) is the forward-cost curve from
`specdec probe` (1.0 at n = 1) plus what this request's verify rounds measure beyond it once a plain
round has been timed (`plain_first`: decode() times its first round plain): a round's target time
over the plain step, less the curve's verify(n), is the round's `extra` (hidden states an EAGLE head
reads, a stale curve, the loop's own work). Example: SmolLM2 q4 at ~6 ms a step, EAGLE verifying
2 positions in 8 ms where the curve says 1.08 steps: extra ~0.2, and with tau ~0.3 and alpha 0.42
a round yields 1.42 tokens for ~1.6 steps, so k = 0 wins (the curve alone predicted 1.03x). k = 0 (a plain
step) is chosen when speculation is predicted to lose, with an occasional k = 1 probe so a
source that starts to match again is noticed. A probe costs a draft step (tau) and a wider
forward, so the wait before it grows with that cost (`explore_wait`) and doubles after each probe
until speculation is predicted to win again: a source that never matches costs a few probes per
request, not one every 8 steps (early exit at tau 0.7 lost 8% that way).

A drafter with a starting cost (a draft model that must first prefill the prompt, `Drafter.startup`)
is started only when the tokens left times the predicted saving per token, 1 - 1/speedup, pay for
it; until then, and until one plain step has been timed to price it, rounds are plain steps.

Example: alpha = 0.7 at every position, tau = 0.1, flat verify cost: E(4) = 2.77,
cost = 1.4, speedup 1.98 (the lesson's worked numbers); alpha = 0.05 gives k = 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable


EXPLORE_MAX = 128     # the longest wait between two probes of a losing source, in plain steps
EXPLORE_SHARE = 0.05  # the share of its waiting steps a probe may cost


@dataclass
class CostCurve:
    """verify(n): cost of one target forward over n positions relative to n = 1."""

    points: dict[int, float] = field(default_factory=lambda: {1: 1.0, 64: 4.0})

    def __call__(self, n: int) -> float:
        xs = sorted(self.points)
        if n <= xs[0]:
            return self.points[xs[0]]
        for a, b in zip(xs, xs[1:]):
            if n <= b:
                w = (n - a) / (b - a)
                return self.points[a] * (1 - w) + self.points[b] * w
        return self.points[xs[-1]]

    @classmethod
    def from_probe(cls, probe) -> "CostCurve":
        """The probe's curve; the default one when the probe's curve is implausible (`ProbeResult.implausible`)."""
        return cls() if probe.implausible() else cls(dict(probe.relative))


@dataclass
class AdaptiveK:
    k_max: int = 8
    cost: CostCurve = field(default_factory=CostCurve)
    prior_alpha: float = 0.6       # optimistic start: speculation gets a chance to show itself
    prior_weight: float = 2.0
    decay: float = 0.9             # per-observation forgetting, so the estimate follows the text
    explore_every: int = 8         # after this many plain steps, try k = 1 once (then twice as long a wait)
    tau: float = 0.0               # draft cost per token, in target steps (a prior, then measured)
    tau_measured: int = 0
    rounds_timed: int = 0
    accepted: list[float] = field(default_factory=list)
    tried: list[float] = field(default_factory=list)
    plain_streak: int = 0
    probes: int = 0                # probes since speculation last was predicted to win
    nodes: Callable[[int], int] | None = None  # draft positions at depth k (a tree's size); None: k (a chain)
    plain_first: bool = False      # the first round is a plain step, timed: the unit verify rounds are priced in
    step_s: float = 0.0            # a plain round's measured seconds (moving average); 0 until one is timed
    extra: float = 0.0             # a verify round's measured cost beyond verify(n), in plain steps (moving average)
    extra_measured: int = 0
    chosen: int = 0                # rounds chosen so far
    refused_asks: int = 0          # asks in a row a server's scheduler ran plain (`refused`)
    probing: bool = False          # the last choice is a probe the scheduler should grant (`refused`)

    def alphas(self) -> list[float]:
        out, prev = [], self.prior_alpha
        for j in range(self.k_max):
            if j < len(self.tried) and self.tried[j] > 0:
                a = (self.accepted[j] + self.prior_weight * prev) / (self.tried[j] + self.prior_weight)
            else:
                a = prev
            out.append(a)
            prev = a
        return out

    def expected_tokens(self) -> list[float]:
        """E[tokens per round] for k = 0 .. k_max: 1 + sum over i <= k of the product of alpha_1..alpha_i."""
        alphas, e, reach, out = self.alphas(), 1.0, 1.0, [1.0]
        for k in range(1, self.k_max + 1):
            reach *= alphas[k - 1]
            e += reach
            out.append(e)
        return out

    def positions(self, k: int) -> int:
        """Draft positions a round of depth k verifies: k for a chain, the tree's size at depth k (`nodes`)."""
        return self.nodes(k) if self.nodes and k else k

    def predicted(self) -> list[float]:
        """Predicted speedup for k = 0 .. k_max."""
        return [e / (self.verify_cost(self.positions(k) + 1) + self.positions(k) * self.tau) if k else e
                for k, e in enumerate(self.expected_tokens())]

    def verify_cost(self, n: int) -> float:
        """A round verifying n positions, in plain steps: the curve's verify(n), plus the measured extra."""
        return self.cost(n) + (self.extra if n > 1 else 0.0)

    def choose(self, startup: float = 0.0, remaining: int | None = None) -> int:
        """k for the next round. `startup`: a one-time cost in target steps that drafting now would pay
        first; it is paid only when `remaining` tokens at the predicted speedup save more than it."""
        self.chosen += 1
        self.probing = False
        if self.plain_first and self.chosen == 1 and not self.step_s:
            return 0  # time a plain step first (what plain decoding would do anyway)
        pred = self.predicted()
        k = max(range(len(pred)), key=lambda i: (pred[i], -i))
        if k and startup > 0 and (remaining is None or remaining * (1 - 1 / pred[k]) <= startup):
            return 0  # drafting would not repay its starting cost (no probing either: a probe pays it too)
        if k == 0:
            self.plain_streak += 1
            if self.plain_streak >= self.explore_wait() and startup < math.inf:
                self.plain_streak = 0
                self.probes += 1
                return 1
        else:
            self.plain_streak = self.probes = 0
            if self.refused_asks >= self.explore_every:
                self.refused_asks, self.probing = 0, True
        return k

    def refused(self) -> None:
        """A server's scheduler ran this round plain although k > 0 was asked (its estimate did not clear the
        step's bar). A refused request drafts nothing, so its alphas would never move again: after
        `explore_every` refusals in a row its next ask is marked `probing`, which the scheduler grants, so a
        text that turned repetitive is noticed."""
        self.refused_asks += 1

    def explore_wait(self) -> int:
        """Plain steps before the next k = 1 probe: explore_every, or longer when a probe is dear (it costs
        verify(2) + tau - 1 steps more than a plain step, and probing may spend EXPLORE_SHARE of the steps
        waited), doubled after each probe since speculation last won, at most EXPLORE_MAX.
        Example: tau 0.7 -> probes after 15, 30, 60, 120, 128, ... plain steps; tau 0.002 -> 8, 16, ..."""
        dear = math.ceil(max(self.cost(2) + self.tau - 1.0, 0.0) / EXPLORE_SHARE)
        return min(max(self.explore_every, dear) << self.probes, EXPLORE_MAX)

    def timing(self, drafted: int, draft_seconds: float, target_seconds: float, smoothing: float = 0.3) -> None:
        """Update tau from one round's measured times: draft seconds per token over the plain step (measured,
        `plain_timing`; before that, the round's target time divided by the verify-cost curve), and the
        verify round's `extra` over the curve once a plain step is timed."""
        if drafted <= 0:
            return
        self.rounds_timed += 1
        if self.step_s:
            extra = target_seconds / self.step_s - self.cost(drafted + 1)
            self.extra = extra if self.extra_measured == 0 else (1 - smoothing) * self.extra + smoothing * extra
            self.extra_measured += 1
        if self.rounds_timed == 1:  # the first round's draft time includes the drafter's own prefill
            return
        step = self.step_s or target_seconds / self.cost(drafted + 1)
        tau = (draft_seconds / drafted) / step
        self.tau = tau if self.tau_measured == 0 else (1 - smoothing) * self.tau + smoothing * tau
        self.tau_measured += 1

    def plain_timing(self, seconds: float, smoothing: float = 0.3) -> None:
        """A plain round's measured target seconds: the step every other cost is priced in."""
        self.step_s = seconds if not self.step_s else (1 - smoothing) * self.step_s + smoothing * seconds

    def observe(self, drafted: int, accepted: int) -> None:
        """A round drafted `drafted` tokens in a chain and the first `accepted` were kept."""
        self.refused_asks = 0
        while len(self.tried) < drafted:
            self.tried.append(0.0)
            self.accepted.append(0.0)
        for j in range(drafted):
            self.tried[j] *= self.decay
            self.accepted[j] *= self.decay
        for j in range(min(drafted, accepted + 1)):  # positions reached
            self.tried[j] += 1.0
            self.accepted[j] += 1.0 if j < accepted else 0.0


@dataclass
class FixedK:
    k: int

    def choose(self, startup: float = 0.0, remaining: int | None = None) -> int:
        return self.k  # a fixed k is the caller's choice, starting costs included

    def observe(self, drafted: int, accepted: int) -> None:
        pass


def choose_k(policy, drafter, ctx) -> int:
    """The policy's k for this round, with the drafter's starting cost priced in target steps
    (`Drafter.startup` prefill tokens x `ctx.prefill_cost`; unpriced, i.e. infinite, before a plain step)."""
    startup = drafter.startup(ctx) if hasattr(drafter, "startup") else 0.0
    if startup <= 0:
        return policy.choose()
    startup = math.inf if ctx.prefill_cost is None else startup * ctx.prefill_cost
    return policy.choose(startup=startup, remaining=ctx.remaining)
