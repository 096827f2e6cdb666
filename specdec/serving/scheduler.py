"""The occupancy-aware scheduler (the lesson's Chapter 7): before every server step, grant each decoding
request a draft length k so that speculation spends only the idle compute the batch leaves.

Each request asks for the k its own adaptive-k estimator chooses from its measured acceptance alpha and
draft cost tau. Requests are served in priority order, interactive before batch, and within a class the
larger marginal gain per verified position first: (E[tokens](k) - 1) / (k + 1). Each gets its full k or
k = 0 for this step, never a little to all. What "fits" depends on what is known about the step's cost:

- **A budget line** (a number: the lesson's 156, or `--budget N`). A step over B requests already fills
  B positions; a speculating request spends k + 1 units of the headroom budget - B, the lesson's
  accounting (`theory.speculation_cost`), and headroom goes by priority (`theory.allocate_headroom`).
  An ask longer than the whole headroom is first shortened to fit it. A tree drafter's ask counts its
  positions (`Ask.positions`, e.g. recycling's 3 nodes at depth 2 spend 4 units), granted whole or not.
  Worked example (Ch. 7): budget 156, B = 120 -> 36 units; ten interactive requests asking k = 4
  (5 units each): seven get k = 4 (35 units), the other three and every batch job get k = 0.
- **A measured cost curve** (`specdec probe`: the time of one forward over n positions relative to one).
  On a CPU the curve rises gradually instead of breaking at a line, so a request gets its k when the
  step's predicted throughput, tokens over time, rises with it:
      tokens = sum of E_i(k_i) over the decoding requests (1 for a plain step)
      time   = cost(B + prefill + sum k_i) + sum k_i * tau_i + overhead   (in one-position steps)
  `overhead` is the part of a server step that is not the forward and does not grow with k (the engine's
  bookkeeping, each request's verification and streaming: measured, `Engine.overhead`). Leaving it out
  overstates what a drafted position costs: at 4 SmolLM2 requests a step took 8.9 ms of which the forward
  was ~5.6, and a k = 1 ask needed alpha > 0.27 to be granted where always-on speculation paid at 0.27.
  Example: a curve with cost(1) = 1, cost(5) = 1.3, alpha 0.8 (E(4) = 3.36): alone, k = 4 turns one
  token per 1.0 into 3.36 per 1.3: granted. Beside three others at cost(4) = 1.16, it would cost
  cost(8) = 1.54 for 2.36 more tokens: 6.36 / 1.54 = 4.1 against 4 / 1.16 = 3.4: granted. At B = 8
  (cost 1.54) it would cost cost(12) = 2.03: 10.36 / 2.03 = 5.1 against 8 / 1.54 = 5.2: refused.

Modes: auto (the above), always (every ask granted: speculation ignoring the load), never (k = 0).

**Measured, not only modelled** (`ModePicker`, auto with a cost curve). The curve is a single request's
forward; a packed step over B requests also pays per request (attention over each cache, verification,
streaming), so the model can misjudge where speculation stops paying, and on this CPU it did: at 8 and 16
SmolLM2 requests auto made fewer tokens per second than both always and never. So auto keeps, per batch size
(in buckets 1, 2, 3-4, 5-8, ...), the tokens and seconds of its recent steps (less a prefill's share of the
forward, by positions) under three arms: the model's grants ("model"), none ("never") and every ask
("always"). It runs the model's grants unless another arm has measured more than 3% more tokens per second,
and tries the other two in turn one step in `explore` (each first `warmup` times). It converges to the best
of the three at every load, paying the exploration steps.
Example: at B = 8, model 290 tok/s, never 306, always 297 -> never runs, 15 steps of 16.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from specdec import theory

MODES = ("auto", "always", "never")
ARMS = ("model", "never", "always")  # the ways auto may grant a step (`ModePicker`)
PRIORITIES = ("interactive", "batch")


@dataclass(frozen=True)
class Ask:
    name: str
    k: int                      # the draft length this request's estimator wants now
    priority: str = "interactive"
    tokens: float = 1.0         # E[tokens per round] at that k, from the request's measured alphas
    tau: float = 0.0            # its draft cost per token, in one-position steps
    positions: int | None = None  # draft positions it verifies at that k: a tree's nodes (None: k, a chain)

    @property
    def width(self) -> int:
        return self.k if self.positions is None else self.positions

    @property
    def gain(self) -> float:
        """Marginal tokens per verified position: what one unit of the step's room buys from this request."""
        return (self.tokens - 1) / theory.speculation_cost(self.width)


def extend(curve: Callable[[int], float], last: int = 64) -> Callable[[int], float]:
    """A probe curve (measured up to `last` positions) extended in proportion past its last point."""
    return lambda n: curve(n) if n <= last else curve(last) * n / last


def line_of(cost: Callable[[int], float], tolerance: float = 0.10) -> int:
    """The budget line a curve implies, as `specdec probe` reports it: the most positions (up to 64) whose
    forward costs within 10% of one position's."""
    return max(n for n in range(1, 65) if cost(n) <= 1 + tolerance)


def grant(asks: list[Ask], batch: int, prefill: int = 0, mode: str = "auto", budget: float | None = None,
          cost: Callable[[int], float] | None = None, overhead: float = 0.0) -> dict[str, int]:
    """k for every asking request this step. `batch`: B, the requests decoding (asking or not); `prefill`:
    prompt tokens scheduled beside them. Give `budget` (a line) or `cost` (a measured curve, with the step's
    `overhead` in the same units) for auto."""
    if mode not in MODES:
        raise ValueError(f"speculation mode must be one of {', '.join(MODES)}, got {mode!r}")
    for a in asks:
        if a.priority not in PRIORITIES:
            raise ValueError(f"priority must be one of {', '.join(PRIORITIES)}, got {a.priority!r}")
    if mode == "never":
        return {a.name: 0 for a in asks}
    if mode == "always":
        return {a.name: a.k for a in asks}
    order = sorted(asks, key=lambda a: (a.priority != "interactive", -a.gain))
    if budget is not None:
        room = max(theory.headroom(budget, batch + prefill), 0.0)
        cap = max(math.floor(room + 1e-9) - 1, 0)  # the longest draft whose k + 1 units fit at all
        # a chain is shortened to fit; a tree (more positions than its depth) is granted whole or not at all
        units = {a.name: min(a.k, cap) if a.width == a.k else (a.width if a.width <= cap else 0) for a in order}
        sessions = [theory.Session(a.name, units[a.name], a.priority == "interactive", -i) for i, a in enumerate(order)]
        given = theory.allocate_headroom(sessions, room)
        return {a.name: given[a.name] if a.width == a.k or not given[a.name] else a.k for a in asks}
    if cost is None:
        raise ValueError("auto speculation needs a budget or a cost curve")
    positions, tokens, drafting = batch + prefill, float(batch), overhead
    granted = {a.name: 0 for a in asks}
    for a in order:
        before = tokens / (cost(positions) + drafting)
        after = (tokens + a.tokens - 1) / (cost(positions + a.width) + drafting + a.width * a.tau)
        if a.k > 0 and after > before:
            granted[a.name] = a.k
            positions, tokens, drafting = positions + a.width, tokens + a.tokens - 1, drafting + a.width * a.tau
    return granted


class ModePicker:
    """Auto's choice among `ARMS` per batch-size bucket, by measured tokens per second (module docstring)."""

    def __init__(self, explore: int = 16, warmup: int = 2, margin: float = 0.03, weight: float = 0.1):
        self.explore, self.warmup, self.margin, self.weight = explore, warmup, margin, weight
        self.seen: dict[tuple[int, str], list[float]] = {}  # (bucket, arm) -> [steps, tokens, seconds] (running means)
        self.steps: dict[int, int] = {}

    @staticmethod
    def bucket(batch: int) -> int:
        """Batch sizes share measurements in powers of two: 1, 2, 3-4, 5-8, 9-16, ... (the bucket's top)."""
        return 1 << max(batch - 1, 0).bit_length()

    def rate(self, batch: int, arm: str) -> float:
        n, tokens, seconds = self.seen.get((self.bucket(batch), arm), (0, 0.0, 0.0))
        return tokens / seconds if n and seconds > 0 else 0.0

    def choose(self, batch: int) -> str:
        """The arm for a step over `batch` decoding requests: "model" unless another measured more than
        `margin` better (noise between near-equal arms does not flap the choice)."""
        b = self.bucket(batch)
        step = self.steps[b] = self.steps.get(b, 0) + 1
        fresh = [a for a in ARMS if self.seen.get((b, a), (0,))[0] < self.warmup]
        if fresh:
            return fresh[0]
        best = max(ARMS, key=lambda a: self.rate(batch, a))
        if self.rate(batch, best) <= (1 + self.margin) * self.rate(batch, "model"):
            best = "model"
        if step % self.explore == 0:  # try the others in turn
            others = [a for a in ARMS if a != best]
            return others[(step // self.explore) % len(others)]
        return best

    def record(self, batch: int, arm: str, tokens: int, seconds: float) -> None:
        """A finished step's committed tokens and time (less any prefill's share: the caller's)."""
        key = (self.bucket(batch), arm)
        n, t, s = self.seen.get(key, (0, 0.0, 0.0))
        w = max(self.weight, 1.0 / (n + 1))  # plain means while few, then running means
        self.seen[key] = [n + 1, t + w * (tokens - t), s + w * (seconds - s)]
