"""The lesson's Chapter 8 race, simulated: vanilla decoding against speculative decoding.

Two lanes generate the same response. The vanilla lane emits one token per target step. The
speculative lane runs rounds: k drafted tokens, each accepted with probability alpha until the
first rejection (Ch. 2's independence model), so a round emits the accepted drafts plus one token
of the target's own: the recovered token at the first rejection, or the bonus token when all k
were accepted. Times follow the lesson's roofline (Ch. 0 and 7): B other sequences share every
step, and a target pass over n positions costs step * theory.step_time_factor(B + n, budget),
flat up to the budget and growing in proportion to the demand past it. So

    vanilla token = step * cost(1)
    round         = step * (k * tau * cost(1) + cost(k + 1))      cost = theory.roofline_cost(B, budget)

and the long-run speedup the race settles on is theory.speedup_with_cost_curve(alpha, k, tau, cost):
the same function adaptive k uses, not a second copy of the formula.

Worked example (Ch. 3 and 8): code editing with prompt lookup, alpha = 0.82, k = 4, tau = 0.002, B = 0.
A round costs 7 ms * (1 + 4 * 0.002) = 7.056 ms and emits (1 - 0.82^5) / 0.18 = 3.496 tokens on
average, so the speculative lane settles near 3.496 / 1.008 = 3.47x the vanilla lane. At B = 200 on
the 156 budget (Ch. 7) a vanilla step takes 7 * 201/156 = 9.02 ms and a round 7 * (0.008 * 201/156
+ 205/156) = 9.27 ms: both lanes slow down, the ratio drops to 3.40x and the lead in tokens per
second shrinks by a quarter. Each segment of a race draws from its own seeded generator, so the
same seed and the same knob changes replay the same race.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import asdict, dataclass

from specdec import theory

K_MAX = 10  # the race's k control (Ch. 8: "sweep k from 1 up to 10")


@dataclass(frozen=True)
class Preset:
    key: str
    label: str
    alpha: float   # the lesson's representative acceptance rate for the workload
    tau: float     # the draft cost of the source the lesson pairs it with
    source: str    # where the lesson's numbers come from


PRESETS: tuple[Preset, ...] = (
    Preset("code-editing", "Code editing", 0.82, 0.002, "prompt lookup, Ch. 3: 3.47x at k = 4"),
    Preset("summarization", "Summarization", 0.75, 0.002, "prompt lookup, Ch. 3: 3.03x at k = 4"),
    Preset("open-chat", "Open chat", 0.60, 0.1, "a 700M draft model, Ch. 3"),
    Preset("rag", "RAG", 0.50, 0.007, "retrieval drafts, Ch. 3"),
    Preset("creative-writing", "Creative writing", 0.15, 0.1, "Ch. 2's negative example: 0.65x at k = 8"),
)


def preset(key: str) -> Preset:
    for p in PRESETS:
        if p.key == key:
            return p
    raise ValueError(f"unknown workload {key!r}: choose one of {', '.join(p.key for p in PRESETS)}")


@dataclass(frozen=True)
class RaceParams:
    alpha: float = 0.82
    k: int = 4
    tau: float = 0.002
    occupancy: float = 0.0        # B: sequences already in the batch (Ch. 7)
    budget: float = theory.BUDGET  # positions one memory-bound step verifies for free (Ch. 0)
    step_ms: float = theory.STEP_MS
    seed: int = 0

    def __post_init__(self):
        theory.expected_tokens(self.alpha, self.k)   # validates alpha in [0, 1], k >= 0
        theory.speedup(self.alpha, self.k, self.tau)  # validates tau >= 0
        theory.roofline_cost(self.occupancy, self.budget)(1)  # validates B >= 0, budget > 0
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if not (isinstance(self.step_ms, (int, float)) and math.isfinite(self.step_ms) and self.step_ms > 0):
            raise ValueError(f"step_ms must be a finite number > 0, got {self.step_ms!r}")

    def cost(self):
        return theory.roofline_cost(self.occupancy, self.budget)

    def vanilla_ms(self) -> float:
        """One plain decode step, stretched once B + 1 positions pass the budget."""
        return self.step_ms * self.cost()(1)

    def round_ms(self) -> float:
        """One speculative round: k drafts at tau of a step each, plus one pass over k + 1 positions."""
        cost = self.cost()
        return self.step_ms * (self.k * self.tau * cost(1) + cost(self.k + 1))

    def predicted_speedup(self) -> float:
        return theory.speedup_with_cost_curve(self.alpha, self.k, self.tau, self.cost())


@dataclass
class Lane:
    """Rounds in order: when each ended, how many drafts it had, how many were accepted, and the kind
    of its last token ("plain" for a vanilla step, "recovered" or "bonus"). Tokens = accepted + 1."""
    start_ms: float
    end_ms: list[float]
    drafted: list[int]
    accepted: list[int]
    kind: list[str]

    @property
    def tokens(self) -> int:
        return sum(self.accepted) + len(self.accepted)

    @property
    def last_ms(self) -> float:
        return self.end_ms[-1] if self.end_ms else self.start_ms

    def to_dict(self) -> dict:
        return asdict(self)


def draw_round(rng: random.Random, alpha: float, k: int) -> tuple[int, str]:
    """One verification round: (accepted drafts, kind of the target's own token)."""
    if k == 0:
        return 0, "plain"
    for i in range(k):
        if rng.random() >= alpha:
            return i, "recovered"
    return k, "bonus"


def segment_rng(seed: int, segment: int) -> random.Random:
    """Each segment (the race between two knob changes) has its own reproducible stream."""
    return random.Random(f"specdec-race:{seed}:{segment}")


def simulate(params: RaceParams, until_ms: float, *, start_vanilla_ms: float = 0.0, start_spec_ms: float = 0.0,
             segment: int = 0, max_rounds: int = 20000) -> tuple[Lane, Lane]:
    """Both lanes from their start times until their last round ends at or past `until_ms` (at most
    `max_rounds` rounds each). Returns (vanilla, speculative)."""
    for name, v in (("until_ms", until_ms), ("start_vanilla_ms", start_vanilla_ms), ("start_spec_ms", start_spec_ms)):
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
            raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
    rng = segment_rng(params.seed, segment)
    step, rnd = params.vanilla_ms(), params.round_ms()
    vanilla = Lane(start_vanilla_ms, [], [], [], [])
    t = start_vanilla_ms
    while t < until_ms and len(vanilla.end_ms) < max_rounds:
        t += step
        vanilla.end_ms.append(t)
        vanilla.drafted.append(0)
        vanilla.accepted.append(0)
        vanilla.kind.append("plain")
    spec = Lane(start_spec_ms, [], [], [], [])
    t = start_spec_ms
    while t < until_ms and len(spec.end_ms) < max_rounds:
        accepted, kind = draw_round(rng, params.alpha, params.k)
        t += rnd
        spec.end_ms.append(t)
        spec.drafted.append(params.k)
        spec.accepted.append(accepted)
        spec.kind.append(kind)
    return vanilla, spec


@dataclass(frozen=True)
class Summary:
    vanilla_tokens: int
    spec_tokens: int
    rounds: int
    measured_speedup: float       # tokens per ms of the speculative lane over the vanilla lane's
    predicted_speedup: float
    mean_tokens_per_round: float
    expected_tokens_per_round: float
    histogram: dict[int, int]     # tokens in a round -> rounds


def summarize(params: RaceParams, vanilla: Lane, spec: Lane) -> Summary:
    def rate(lane: Lane) -> float:
        span = lane.last_ms - lane.start_ms
        return lane.tokens / span if span > 0 else 0.0

    hist = Counter(a + 1 for a in spec.accepted)
    rv = rate(vanilla)
    return Summary(
        vanilla_tokens=vanilla.tokens, spec_tokens=spec.tokens, rounds=len(spec.accepted),
        measured_speedup=rate(spec) / rv if rv else 0.0,
        predicted_speedup=params.predicted_speedup(),
        mean_tokens_per_round=spec.tokens / len(spec.accepted) if spec.accepted else 0.0,
        expected_tokens_per_round=theory.expected_tokens(params.alpha, params.k),
        histogram={n: hist.get(n, 0) for n in range(1, params.k + 2)},
    )


def race(params: RaceParams, duration_ms: float, segment: int = 0, max_rounds: int = 10**6) -> Summary:
    """A whole race with fixed knobs, summarized (what the page shows once it has settled)."""
    return summarize(params, *simulate(params, duration_ms, segment=segment, max_rounds=max_rounds))
