"""The occupancy-aware scheduler (the lesson's Chapter 7): before every server step, grant each decoding
request a draft length k so that speculation spends only the idle compute the batch leaves.

Each request asks for the k its own adaptive-k estimator chooses from its measured acceptance alpha and
draft cost tau. Requests are served in priority order, interactive before batch, and within a class the
larger marginal gain per verified position first: (E[tokens](k) - 1) / (k + 1). Each gets its k, or for a
chain the longest k' <= k that still fits or pays, or k = 0 for this step: never a little to all. What "fits"
depends on what is known about the step's cost:

- **A budget line** (a number: the lesson's 156, or `--budget N`). A step over B requests already fills
  B positions; a speculating request spends k + 1 units of the headroom budget - B, the lesson's
  accounting (`theory.speculation_cost`), and headroom goes by priority (`theory.allocate_headroom`).
  An ask longer than the whole headroom is first shortened to fit it. A tree drafter's ask counts its
  positions (`Ask.positions`, e.g. recycling's 3 nodes at depth 2 spend 4 units), granted whole or not.
  Worked example (Ch. 7): budget 156, B = 120 -> 36 units; ten interactive requests asking k = 4
  (5 units each): seven get k = 4 (35 units), the other three and every batch job get k = 0.
- **A measured cost curve** (`specdec probe`: the time of one forward over n positions relative to one).
  On a CPU the curve rises gradually instead of breaking at a line, so a request gets its k when the
  tokens it adds per time it adds beat the step's own tokens per time by `hurdle` (20%):
      tokens = sum of E_i(k_i) over the decoding requests (1 for a plain step)
      time   = cost(B + prefill + sum k_i) + sum k_i * tau_i + overhead   (in one-position steps)
  A chain whose k does not pay is granted the longest k' < k that does (`Ask.shorter`, E at each k'): at two
  SmolLM2 requests (curve 0.99, 1.08, 1.23 at 2, 3, 4 positions) alpha 0.3 pays at k = 1 (0.3 more tokens
  for 0.09 more time) and not at k = 2 (0.39 for 0.24). A tree, or a fixed k, is granted whole or not at all.
  The hurdle is for the estimates: E_i comes from a request's measured alphas, and a grant that pays only
  just by the estimate loses as often as it wins. At 8 and 16 SmolLM2 requests the grants without it made
  5-7% fewer tokens per second than plain steps in every paired run (session 11, BENCHMARKS.md).
  `overhead` is the part of a server step that is not the forward and does not grow with k (the engine's
  bookkeeping, each request's verification and streaming: measured, `Engine.overhead`). Leaving it out
  overstates what a drafted position costs: at 4 SmolLM2 requests a step took 8.9 ms of which the forward
  was ~5.6, and a k = 1 ask needed alpha > 0.27 to be granted where always-on speculation paid at 0.27.
  Example: a curve with cost(1) = 1, cost(5) = 1.3, alpha 0.8 (E(4) = 3.36): alone, k = 4 turns one
  token per 1.0 into 3.36 per 1.3 (2.36 more tokens for 0.3 more time: 7.9 a step against 1.0): granted.
  Beside three others at cost(4) = 1.16, it would cost cost(8) = 1.54 for 2.36 more tokens: 2.36 / 0.38 =
  6.2 against 4 / 1.16 = 3.4: granted. At B = 8 (cost 1.54) it would cost cost(12) = 2.03: 2.36 / 0.49 =
  4.8 against 8 / 1.54 = 5.2: refused.

Modes: auto (the above), always (every ask granted: speculation ignoring the load), never (k = 0).

**Measured, not only modelled** (`ModePicker`, auto with a cost curve). The curve is a single request's forward; a
packed step over B requests also pays per request (attention over each cache, verification, streaming), so the model
can misjudge where speculation stops paying. So auto keeps, per batch size (in buckets 1, 2, 3-4, 5-8, ...), a
current arm among three: the model's grants ("model"), none ("never") and every ask ("always"). A bucket starts on
the model's grants, or on never where its batches fill the budget line the curve implies (`ModePicker`'s `line`).
One step in `explore` (of those without a prompt piece) runs another arm, and its tokens against the tokens the
current arm makes in the same time (its running rate over the steps just before) are one sample of their ratio:
paired in time, so the machine's own drift (its speed moves by a third over minutes) cancels out. An arm takes over
when its samples say it is faster by more than `margin` with two standard errors to spare; a step's tokens are
random (how much of its drafts the target accepts), so a small or unproven difference never flaps the choice. A tie
goes to never: it takes over from an arm that speculates once its samples say it is slower by no more than `margin`
(two standard errors to spare), since at equal throughput its steps are shorter and so is the tail of the
inter-token latency (SmolLM2 q4 on a 2-core Xeon, session 20: at 8 and 16 clients auto stayed on the model's grants
at 0.98 and 0.97x never's throughput with 1.19 and 1.29x its p99 inter-token latency). Going back takes a proof of
more than `margin` the other way, so the two rules cannot flap. Example: at B = 8 the model's grants make 290 tok/s
and never 320: a never step makes 8 tokens in 25 ms, where the model's grants make 7.25; it beats them by 1.02 if 8
- 1.02 x 7.25 = 0.61 > 0 on average. With per-step noise of 15% (sd 1.1 tokens), 16 samples (256 steps) put two
standard errors at 0.55: never takes over. At B = 1 always's tie with the model, or never's deficit, moves nothing.
A proof carries over to the buckets the budget argument covers (`ModePicker`): never proven at 5-8 requests starts
9-16 and beyond on never. Measured (session 14, SmolLM2, 16 clients, BENCHMARKS.md): auto ran never on 85% of its
steps with the proof carried from 8 clients, 60% with each bucket proving on its own."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Callable

from specdec import theory

MODES = ("auto", "always", "never")
ARMS = ("model", "never", "always")  # the ways auto may grant a step (`ModePicker`)
EXPLORES = {"never": ("model",), "model": ("never", "always"), "always": ("model",)}  # an arm's neighbours in how much
# they speculate: the arms explored while it runs (`ModePicker`)
PRIORITIES = ("interactive", "batch")


@dataclass(frozen=True)
class Ask:
    name: str
    k: int                      # the draft length this request's estimator wants now
    priority: str = "interactive"
    tokens: float = 1.0         # E[tokens per round] at that k, from the request's measured alphas
    tau: float = 0.0            # its draft cost per token, in one-position steps
    positions: int | None = None  # draft positions it verifies at that k: a tree's nodes (None: k, a chain)
    probe: bool = False         # its estimate is stale after refusals (`AdaptiveK.refused`): granted on a curve
    shorter: tuple[float, ...] = ()  # a chain's E[tokens] at k' = 0 .. k: on a curve it may be granted a
    #                                  shorter k' (the longest that pays); () for a tree or a fixed k: all or none

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
          cost: Callable[[int], float] | None = None, overhead: float = 0.0, hurdle: float = 0.2) -> dict[str, int]:
    """k for every asking request this step. `batch`: B, the requests decoding (asking or not); `prefill`:
    prompt tokens scheduled beside them. Give `budget` (a line) or `cost` (a measured curve, with the step's
    `overhead` in the same units, and the `hurdle` an ask's added tokens per added time must clear) for auto."""
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
        time = cost(positions) + drafting
        for k in range(a.k, 0, -1) if a.shorter else ([a.k] if a.k > 0 else []):  # the longest that pays
            width, gets = (k, a.shorter[k]) if a.shorter else (a.width, a.tokens)
            more = cost(positions + width) - cost(positions) + width * a.tau  # the time this ask adds
            if a.probe or (gets - 1) * time > (1 + hurdle) * tokens * more:
                granted[a.name] = k
                positions, tokens, drafting = positions + width, tokens + gets - 1, drafting + width * a.tau
                break
    return granted


class ModePicker:
    """Auto's choice among `ARMS` per batch-size bucket, by measured tokens per second paired in time
    (module docstring). `window`: the samples an arm is judged on (at least `least`); `weight`: the current
    arm's running rate, the reference each sample is taken against.

    `line`: the budget line the cost curve implies (`line_of`), the lesson's prior. A step over B requests already
    verifies B positions, so from B = line on every drafted position is past it and speculation costs more than it
    pays by the lesson's arithmetic: a bucket whose smallest batch reaches the line starts on never and explores the
    model's grants at the settled rate (one step in 8 x explore: there a speculating step sets the tail of the
    inter-token latency), which take over only with a proof. Example: line 3 (SmolLM2 q4 on a 2-core Xeon): 1 and 2
    requests start on the model's grants, 3-4 and beyond on never. Measured there (session 23, HTTP, 15 paired
    runs): at 3-4 requests the model's grants made 0.88x never's tokens/s, and starting on them left auto 0.95x
    never (0.90-1.01) with 44% of its steps on them. Bucket 1 always starts on the model's grants (one request's k
    is priced by its own curve).

    A proof carries over between buckets the one way the lesson's budget allows: speculation that loses at B
    requests loses at more (the idle room only shrinks), and speculation that pays at B pays at fewer. So when never
    takes over bucket b, every larger bucket still on the model's grants switches to never, and every one seen later
    starts on it (exploring at the settled rate, as above); when an arm that speculates takes over from never at b,
    the smaller buckets on never go back to the model. A large bucket is rare (a server is full only sometimes), and
    its own proof could take thousands of steps. Each bucket still explores, and its own evidence can switch it
    back.

    Exploring costs: a step on a losing arm is a slower step, and one in eight of them sets the tail of the
    inter-token latency. So a bucket explores only the arms next to its own in how much they speculate (`EXPLORES`:
    never tries the model's grants, always tries them too, the model's grants try both): a server that grants none
    at 16 requests never pays for a step that grants every ask (twice a plain step there, session 20), and an arm
    further off is reached through the one between. Once the explored arms have filled a `window` of samples each
    without proving themselves, a bucket explores half as often (with fresh samples), down to one step in `8 *
    explore` (where a bucket that starts on never starts); a switch brings it back to one in `explore`. Example:
    explore 8, window 64, on the model's grants: after 1024 steps of a settled choice one in 16, after 2048 more one
    in 32, then one in 64; a challenger then needs about 1536 steps for its 12 samples."""

    def __init__(self, explore: int = 8, margin: float = 0.02, window: int = 64, least: int = 12,
                 weight: float = 0.1, z: float = 2.0, line: int | None = None):
        self.explore, self.margin, self.window, self.least, self.weight, self.z = explore, margin, window, least, weight, z
        self.current: dict[int, str] = {}                      # bucket -> the arm that runs
        self.reference: dict[int, list[float]] = {}            # bucket -> the current arm's [tokens, seconds] (running)
        self.samples: dict[tuple[int, str], deque[tuple[float, float]]] = {}  # (bucket, other arm) -> (its tokens,
        #                                           the current arm's tokens in the same time) per step
        self.steps: dict[int, int] = {}
        self.never_above: int | None = None  # buckets larger than this start on never (a proof at this one, or the
        #                                      budget line: see `line`)
        if line is not None:  # buckets whose every batch fills the line start on never (bucket 1 on the model)
            self.never_above = max([1] + [b for b in (1 << i for i in range(12)) if b // 2 + 1 < line])
        self.every: dict[int, int] = {}     # bucket -> one step in this many explores (explore .. 8 * explore)
        self.unproven: dict[int, int] = {}  # bucket -> samples taken since its last switch or slowdown
        self.settled: dict[tuple[int, str], tuple[float, int]] = {}  # (bucket, arm) -> its last full window's estimate

    @staticmethod
    def bucket(batch: int) -> int:
        """Batch sizes share measurements in powers of two: 1, 2, 3-4, 5-8, 9-16, ... (the bucket's top)."""
        return 1 << max(batch - 1, 0).bit_length()

    @classmethod
    def span(cls, batch: int) -> str:
        """The batch sizes sharing `batch`'s bucket, as a label: "1", "2", "3-4", "5-8", "9-16", ..."""
        b = cls.bucket(batch)
        return str(b) if b <= 2 else f"{b // 2 + 1}-{b}"

    def choose(self, batch: int, prefill: bool = False) -> str:
        """The arm for a step over `batch` decoding requests: the bucket's current arm, or one step in
        `explore` (once the current arm has a reference) its neighbours (`EXPLORES`) in turn. A step that also
        prefills (`prefill`) runs the current arm and is not counted: its sample would be left out (`record`),
        and an explored arm there would only lengthen a step that is already among the longest."""
        b = self.bucket(batch)
        if prefill:
            return self._current(b)
        step = self.steps[b] = self.steps.get(b, 0) + 1
        current, every = self._current(b), self.every.get(b, self.explore)
        if step % every or b not in self.reference:
            return current
        others = EXPLORES[current]
        return others[(step // every) % len(others)]

    def record(self, batch: int, arm: str, tokens: int, seconds: float) -> None:
        """A finished step's committed tokens and time (steps that also prefilled are the caller's to leave out)."""
        b = self.bucket(batch)
        current = self._current(b)
        if arm == current:
            ref = self.reference.get(b)
            if ref is None:
                self.reference[b] = [float(tokens), seconds]
            else:
                ref[0] += self.weight * (tokens - ref[0])
                ref[1] += self.weight * (seconds - ref[1])
            return
        ref = self.reference.get(b)
        if ref is None or seconds <= 0 or ref[0] <= 0:
            return
        mine = self.samples.setdefault((b, arm), deque(maxlen=self.window))
        mine.append((tokens, seconds * ref[0] / ref[1]))  # its tokens, and the current arm's in the same time
        if len(mine) >= self.least:
            if self._proven(mine, 1 + self.margin) or (arm == "never" and self._proven(mine, 1 - self.margin)):
                self._switch(b, arm)
                if arm == "never":  # losing at b: larger batches lose too
                    self.never_above = b if self.never_above is None else min(self.never_above, b)
                    for other in [o for o, a in self.current.items() if o > b and a == "model"]:
                        self._switch(other, "never")
                elif current == "never":  # paying at b: smaller batches pay too
                    if self.never_above is not None and self.never_above < b:
                        self.never_above = b
                    for other in [o for o, a in self.current.items() if o < b and a == "never"]:
                        self._switch(other, "model")
                return
        self.unproven[b] = self.unproven.get(b, 0) + 1
        if self.unproven[b] >= len(EXPLORES[current]) * self.window:  # each explored arm a full window, none proven
            self.unproven[b] = 0
            self.every[b] = min(2 * self.every.get(b, self.explore), 8 * self.explore)
            for a in ARMS:  # fresh samples from here: old ones, further apart in time, would outweigh a change
                if (b, a) in self.samples:
                    self.settled[b, a] = self._estimate(self.samples.pop((b, a)))

    def estimates(self, batch: int) -> tuple[str, dict[str, tuple[float, int]]]:
        """What auto has measured at `batch`'s bucket: its current arm, and each other arm's tokens per second
        relative to it, with the samples behind the figure: ("model", {"never": (0.97, 40), ...}). An arm's
        figure is its running window's once that holds `least` samples, else the last full window's (kept
        when a settled bucket starts fresh samples); an arm with neither is left out. Example (SmolLM2 q4 on a
        Zen 4, 5-8 requests, BENCHMARKS.md session 16): ("never", {"model": (0.98, 64), "always": (0.90, 64)}):
        speculating every ask costs 10% of the throughput there. The server's own answer to where speculation
        stops paying, from steps paired in time."""
        b = self.bucket(batch)
        current = self.current.get(b, self._start(b))
        out = {}
        for a in ARMS:
            window = self.samples.get((b, a), ())
            if len(window) >= self.least:
                out[a] = self._estimate(window)
            elif (b, a) in self.settled:
                out[a] = self.settled[b, a]
        return current, out

    @staticmethod
    def _estimate(window) -> tuple[float, int]:
        """An arm's rate relative to the current arm's: its tokens over what the current arm makes in the same
        time (a ratio of sums, not a mean of per-step ratios: see `_proven`)."""
        return sum(t for t, _ in window) / sum(e for _, e in window), len(window)

    def _proven(self, window, factor: float) -> bool:
        """Whether an arm's steps make more than `factor` times the current arm's tokens in the same time, with
        `z` standard errors to spare: the mean of tokens - factor * expected over its samples, above zero.
        Tokens, not a mean of log rates: a speculating step's tokens are bursty (1, or the whole draft), and the
        mean log of a bursty rate is well below the log of its mean (tokens 1 or 4 at 70/30: 1.52 against
        1.90), which tilted every comparison toward the arm that speculates less (before session 22)."""
        d = [t - factor * e for t, e in window]
        mean = sum(d) / len(d)
        sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (len(d) - 1))
        return mean - self.z * sd / math.sqrt(len(d)) > 0

    def _start(self, b: int) -> str:
        return "never" if self.never_above is not None and b > self.never_above else "model"

    def _current(self, b: int) -> str:
        """Bucket b's arm, started on first sight (`_start`); a start on never is already a judgement (the
        budget line, or a proof at fewer requests), so it explores at the settled rate, one step in 8 x explore."""
        if b not in self.current:
            self.current[b] = self._start(b)
            if self.current[b] == "never":
                self.every[b] = 8 * self.explore
        return self.current[b]

    def _switch(self, b: int, arm: str) -> None:
        """Bucket b runs `arm` from now; the comparison starts again against it."""
        self.current[b] = arm
        self.reference.pop(b, None)
        self.every.pop(b, None)
        self.unproven.pop(b, None)
        for a in ARMS:
            self.samples.pop((b, a), None)
            self.settled.pop((b, a), None)
