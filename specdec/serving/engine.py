"""The batched engine: continuous batching with per-request speculation inside a shared budget.

Every step, for all running requests at once:

    admit waiting jobs into free slots, interactive first (a slot: its own KV cache, drafter, adaptive k, stopper)
    prefill: the next piece of each new prompt, at most `prefill_chunk` tokens per step in all. An exact model
             (`row_exact`, with the exact-attention kernel) gives every position the same bits however a
             prompt is cut, so its pieces are cut to fit: beside B decoding requests a step takes only the
             prompt positions that keep it within `prefill_stall` decode-only steps by the measured cost
             curve (`prefill_room`, less the positions of the step's drafts; the whole chunk when nobody
             decodes), so a new prompt delays the others' next tokens by a bounded amount, not by a whole
             chunk's forward, speculating or not. Otherwise pieces are cut as
             decode() cuts them (`prefill_spans`, so the KV cache holds the same bits), whole while they fit,
             at least one
    grant:   each decoding request's k from the scheduler (its own alpha and tau, B, priority, and the
             budget line or the measured cost curve). A cheap drafter (prompt lookup, recycling) has drafted
             already, so it asks for the draft it has (its depth and positions), and not at all without one
    draft:   each granted request proposes up to its k tokens (EAGLE: a head per server, a head cache per
             request, fed the target's features from the prefill pieces and each verify)
    forward: ONE packed target pass over every request's positions (`serving.batch.packed_forward`)
    verify:  per request, exactly as `decode()` does (`specdec.round`): verify, rewind or compact its
             own cache, commit tokens through its stopper, feed back alpha and tau; emit the new text

Requests join and leave between steps; a cancelled job (client gone) is dropped at the next step.
Greedy output of every request equals its single-request `decode()` output (test_serving).

    engine = Engine(model, tokenizer, budget=8)              # a budget line; or cost=CostCurve(...) measured
    engine.submit(Job(prompt_ids, Request(max_new_tokens=32), method="prompt-lookup", on_event=print))
    while engine.busy:
        engine.step()
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from specdec import round as rnd
from specdec.adaptive import AdaptiveK, CostCurve, FixedK, choose_k
from specdec.decode import Request, Stopper, check_context, target_probs
from specdec.draft import Draft
from specdec.drafters.base import Context, Drafter
from specdec.drafters.prompt_lookup import PromptLookup
from specdec.errors import SpecdecError
from specdec.options import K_MAX
from specdec.runtime.kernels import attention
from specdec.runtime.model import Transformer, prefill_spans
from specdec.sampling import Draws, make_generator
from specdec.serving import scheduler
from specdec.serving.batch import Segment, packed_forward
from specdec.serving.metrics import Metrics
from specdec.tokenizer import Tokenizer
from specdec.verify import verify

METHODS = ("plain", "prompt-lookup", "recycling", "eagle")  # what a server may draft with (eagle: where it has a head)
_ids = itertools.count(1)


@dataclass
class Event:
    """What a job's `on_event` receives: new text after each round, then one final event."""

    text: str
    tokens: list[int]
    finish_reason: str | None = None  # "stop", "length", "cancelled" or "error" on the final event
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None


@dataclass(eq=False)  # a job is itself: compared by identity
class Job:
    prompt_ids: list[int]
    request: Request
    method: str = "plain"
    k: int | str = "auto"
    priority: str = "interactive"
    on_event: Callable[[Event], None] = lambda event: None
    id: str = field(default_factory=lambda: f"job-{next(_ids)}")
    cancelled: bool = False
    submitted: float = field(default_factory=time.perf_counter)

    def cancel(self) -> None:
        """Drop this job at the engine's next step (a client that went away)."""
        self.cancelled = True


class Slot:
    """One running request: its cache, round state and drafter."""

    def __init__(self, engine: "Engine", job: Job):
        self.job = job
        self.drafter = engine.new_drafter(job.method)
        self.policy = engine.new_policy(job, self.drafter) if self.drafter else None
        self.features = tuple(getattr(self.drafter, "wants_hidden_layers", ()))  # EAGLE: the target's layers
        n = len(job.prompt_ids)
        deepest = min(getattr(self.policy, "k_max", getattr(self.policy, "k", 0)), job.request.max_new_tokens - 1)
        room = self.drafter.room(deepest) if self.drafter else 0
        self.cache = engine.model.new_cache(n + job.request.max_new_tokens + room + 1)
        self.gen = make_generator(job.request.sampling.seed)  # the drafters' samples
        self.draws = Draws.seeded(job.request.sampling.seed)   # the target's: by position, as decode() draws them
        self.ctx = Context(tokens=list(job.prompt_ids), prompt_len=n, sampling=job.request.sampling,
                           generator=self.gen)
        self.stopper = Stopper(engine.tokenizer, job.request)
        self.prefilled = 0          # prompt tokens in the cache (all but the last are prefilled)
        self.last_emit: float | None = None

    @property
    def decoding(self) -> bool:
        return self.prefilled >= len(self.job.prompt_ids) - 1


OVERHEAD_WEIGHT = 0.1  # running-average weight of each step's measured overhead (`Engine.overhead`)
PREFILL_STALL = 4.0    # a step prefilling beside decoding requests costs at most this many decode-only steps


def check_stall(x: float) -> None:
    """`prefill_stall` is 0 (off) or at least one decode-only step (a NaN is neither)."""
    if not (x == 0 or x >= 1):
        raise SpecdecError(f"--prefill-stall must be 0 (off) or at least 1 decode-only step, got {x}")


class Engine:
    def __init__(self, model: Transformer, tokenizer: Tokenizer, budget: float | None = None,
                 cost: CostCurve | None = None, speculation: str = "auto", max_batch: int = 8,
                 prefill_chunk: int = 128, metrics: Metrics | None = None,
                 drafters: dict[str, Callable[[], Drafter]] | None = None, prefill_stall: float = PREFILL_STALL):
        """`budget`: the lesson's budget line in positions; None: the measured `cost` curve decides what
        pays (`specdec.serving.scheduler`). `cost` also prices each request's own adaptive k. `drafters`:
        more methods than prompt lookup, each a factory of one request's drafter (e.g. "eagle":
        `Eagle.fresh` of a built one)."""
        if speculation not in scheduler.MODES:
            raise SpecdecError(f"--speculation must be one of {', '.join(scheduler.MODES)}, got {speculation!r}")
        if max_batch < 1 or prefill_chunk < 1 or (budget is not None and not budget > 0):
            raise SpecdecError("max batch, prefill chunk and budget must be positive")
        check_stall(prefill_stall)
        self.model, self.tokenizer = model, tokenizer
        self.sources: dict[str, Callable[[], Drafter]] = {"prompt-lookup": PromptLookup, **(drafters or {})}
        unknown = set(self.sources) - set(METHODS)
        if unknown:
            raise SpecdecError(f"the server cannot draft with {', '.join(sorted(unknown))}")
        self.budget, self.cost = budget, cost or CostCurve()
        self.line = budget if budget is not None else scheduler.line_of(self.cost)  # for "steps past the budget"
        self.curve = scheduler.extend(self.cost)  # the cost of any number of positions, in one-position forwards
        self.speculation, self.max_batch, self.prefill_chunk = speculation, max_batch, prefill_chunk
        self.prefill_stall = prefill_stall
        self.cut_anywhere = model.row_exact and attention.available()  # prompts cut anywhere, same bits
        self.overhead = 0.0  # a step's time beyond its forward, in one-position forwards (running average)
        self.picker = scheduler.ModePicker(line=self.line) if speculation == "auto" and budget is None else None
        self.arm = "model"  # the picker's arm for the current step
        self.metrics = metrics or Metrics()
        self.metrics.budget.set(self.line)  # the dashboard shows the budget before the first step
        self.waiting: deque[Job] = deque()
        self.running: list[Slot] = []
        self.lock = threading.Lock()
        self.wake = threading.Event()

    # --- requests ------------------------------------------------------------------------------
    @property
    def methods(self) -> tuple[str, ...]:
        return ("plain", *self.sources)

    def new_drafter(self, method: str) -> Drafter | None:
        if method == "plain":
            return None
        if method not in self.sources:
            raise SpecdecError(f"this server drafts with one of {', '.join(self.methods)}, not {method!r}")
        return self.sources[method]()

    def new_policy(self, job: Job, drafter: Drafter):
        """A request's k policy. Adaptive k starts from the alpha this server has realized for its drafter and
        priority class (the dashboard's signal), not from an optimistic prior: a new request on a workload
        where speculation loses does not ask for k until its own rounds say otherwise. A tree drafter's
        positions at each depth (`nodes`) price its rounds."""
        if job.k != "auto":
            return FixedK(job.k)
        alpha = self.metrics.realized_alpha(drafter.name, job.priority)
        tree = dict(nodes=drafter.nodes, k_max=drafter.k_max) if hasattr(drafter, "nodes") else {}
        return AdaptiveK(cost=self.cost, **tree) if alpha is None else AdaptiveK(cost=self.cost, prior_alpha=alpha, **tree)

    def check(self, job: Job) -> None:
        """Raise SpecdecError (a 400 for the HTTP app) when a job cannot run."""
        if not job.prompt_ids:
            raise SpecdecError("the prompt is empty", "prompt")
        check_context(self.model, len(job.prompt_ids), job.request.max_new_tokens)
        if job.method not in self.methods:
            raise SpecdecError(f"speculation method must be one of {', '.join(self.methods)}, got {job.method!r}"
                               + (" (this server has no EAGLE head for its model)" if job.method in METHODS else ""),
                               "speculation.method")
        if job.priority not in scheduler.PRIORITIES:
            raise SpecdecError(f"priority must be one of {', '.join(scheduler.PRIORITIES)}, got {job.priority!r}",
                               "priority")
        if job.k != "auto" and (isinstance(job.k, bool) or not isinstance(job.k, int) or not 0 <= job.k <= K_MAX):
            raise SpecdecError(f"speculation k must be an integer in [0, {K_MAX}] or 'auto', got {job.k!r}",
                               "speculation.k")

    def submit(self, job: Job) -> None:
        self.check(job)
        with self.lock:
            self.waiting.append(job)
        self.wake.set()

    @property
    def busy(self) -> bool:
        return bool(self.running or self.waiting)

    # --- one step ------------------------------------------------------------------------------
    def step(self) -> None:
        """Admit, prefill, grant, draft, one packed forward, verify. Does nothing when idle."""
        self._drop_cancelled()
        with self.lock:  # free slots go to interactive jobs first, then in arrival order
            order = sorted(self.waiting, key=lambda j: j.priority != "interactive")
            admitted = order[:max(self.max_batch - len(self.running), 0)]
            self.waiting = deque(j for j in self.waiting if j not in admitted)
        for job in admitted:
            try:
                self.running.append(Slot(self, job))
            except Exception as e:  # e.g. no memory for its cache: this job fails, the others go on
                self._emit(job, Event("", [], "error", len(job.prompt_ids), error=f"{type(e).__name__}: {e}"))
                self.metrics.finished("error")
        self.metrics.queue(len(self.waiting))
        if not self.running:
            return
        try:
            self._step()
        except Exception as e:  # a failed step ends its requests with an error, never the server
            for slot in self.running:
                self._finish(slot, "error", error=f"{type(e).__name__}: {e}")
            self.running = []

    def _drop_cancelled(self) -> None:
        for slot in [s for s in self.running if s.job.cancelled]:
            self._finish(slot, "cancelled")
        self.running = [s for s in self.running if not s.job.cancelled]
        with self.lock:
            gone = [j for j in self.waiting if j.cancelled]
            self.waiting = deque(j for j in self.waiting if not j.cancelled)
        for job in gone:
            self._emit(job, Event("", [], "cancelled", len(job.prompt_ids)))
            self.metrics.finished("cancelled")

    def _step(self) -> None:
        t0 = time.perf_counter()
        decoding = [s for s in self.running if s.decoding]
        room = self.prefill_room(len(decoding))
        prefills, planned = self._pieces(room)
        grants, drafted = self._grants(decoding, planned)
        rounds, segments = [], []
        for slot in decoding:
            k, draft = grants.get(slot.job.id, 0), drafted.get(slot.job.id)
            if k == 0:
                draft = Draft.empty()
            elif draft is None:
                draft = slot.drafter.propose(slot.ctx, k)
            elif draft.depth > k:  # a chain cut to the prefix that fits or pays (a tree is granted whole or not)
                draft = Draft.chain(draft.tokens[:k], None if draft.q is None else draft.q[:k])
            if draft.depth > k:
                raise RuntimeError(f"{slot.drafter.name} proposed a draft {draft.depth} tokens deep for k = {k}")
            offsets, local = rnd.layout(draft)
            extra = draft.aux.tokens.tolist() if rnd.aux_len(draft) else []
            segments.append(Segment(slot.cache, [slot.ctx.tokens[-1]] + draft.tokens.tolist() + extra, offsets, local,
                                    features=bool(slot.features)))
            rounds.append((slot, k, draft))
        if decoding and self.prefill_stall and self.cut_anywhere:  # the stall bounds the whole step: the drafts
            room = max(room - sum(len(s) - 1 for s in segments), 1)  # take their positions of it first
            if room < planned:
                prefills, _ = self._pieces(room)
        segments = [Segment(slot.cache, slot.job.prompt_ids[slot.prefilled:end], logits=False,
                            features=bool(slot.features)) for slot, end in prefills] + segments
        td = time.perf_counter()
        layers = next((s.features for s in self.running if s.features), ())  # one model, one head: the same layers
        logits = packed_forward(self.model, segments, layers)[len(prefills):]
        tv = time.perf_counter()
        for (slot, end), seg in zip(prefills, segments):
            slot.prefilled = end
            if seg.hidden is not None:  # the prompt positions' features (all but the last: the first root)
                slot.ctx.features.append(seg.hidden)
        committed = sum(self._verify(slot, k, draft, lg, seg.hidden, td - t0, tv - td)
                        for (slot, k, draft), lg, seg in zip(rounds, logits, segments[len(prefills):]))
        self.running = [s for s in self.running if s.stopper.finish_reason is None]
        positions, seconds = sum(len(s) for s in segments), time.perf_counter() - t0
        if self.picker is not None and decoding and not prefills:  # a step that also prefilled is not the arm's
            explored = self.arm != self.picker.current[self.picker.bucket(len(decoding))]
            self.picker.record(len(decoding), self.arm, committed, seconds)
            if explored:  # only an exploring step's sample (and what it proves) moves the estimates
                self.metrics.arm_ratios(self.picker.span(len(decoding)), *self.picker.estimates(len(decoding)))
        if tv > td:  # the step beyond its forward, in units of one-position forwards (cost(positions) = tv - td)
            extra = (seconds - (tv - td)) / (tv - td) * self.curve(positions)
            self.overhead += OVERHEAD_WEIGHT * (extra - self.overhead)
        self.metrics.step(batch=len(decoding), positions=positions, budget=self.line, tokens=committed,
                          seconds=seconds)

    def _pieces(self, room: int) -> tuple[list[tuple[Slot, int]], int]:
        """The prompt pieces a step prefills within `room` positions, oldest request first (module docstring):
        [(slot, end of its piece)], and their positions in all."""
        pieces, left = [], room
        for slot in self.running:
            if not slot.decoding and left > 0:
                end = prefill_spans(slot.prefilled, len(slot.job.prompt_ids) - 1)[0][1]
                if self.cut_anywhere:
                    end = min(end, slot.prefilled + left)
                elif end - slot.prefilled > left and pieces:
                    break
                pieces.append((slot, end))
                left -= end - slot.prefilled
        return pieces, room - left

    def prefill_room(self, batch: int) -> int:
        """Prompt positions a step may prefill beside `batch` decoding requests: the whole `prefill_chunk` when
        none decodes (or with `prefill_stall` 0, or a model whose prompts are cut only in whole pieces), else the
        most m (at least 1) with curve(batch + m) <= prefill_stall * curve(batch). Example: SmolLM2 q4 on a Zen 4
        (curve 1.0, 1.23, 1.5, 2.4 at 1, 4, 8, 16 positions), 4 requests decoding, stall 2: 2 x 1.23 = 2.46
        allows 12 more positions (16 in all), where a 128-position chunk costs ~16 steps. Measured there
        (BENCHMARKS.md, session 15, plain batching at 8 clients): p99 inter-token latency 125-129 ms with the
        whole chunk, 37-46 with stall 2 (tokens/s 10% lower), 52 with stall 4, the default (tokens/s as high)."""
        if not batch or not self.prefill_stall or not self.cut_anywhere:
            return self.prefill_chunk
        rooms = self.__dict__.setdefault("_rooms", {})  # the curve is fixed: once per batch size, not every step
        if batch not in rooms:
            limit, m = self.prefill_stall * self.curve(batch), 1
            while m < self.prefill_chunk and self.curve(batch + m + 1) <= limit:
                m += 1
            rooms[batch] = m
        return rooms[batch]

    def _grants(self, decoding: list[Slot], prefill: int) -> tuple[dict[str, int], dict[str, Draft]]:
        """Each asking request's k this step, and the drafts already made. A cheap drafter (`Drafter.cheap`:
        prompt lookup, recycling) drafts before the grant, so the ask is the draft it has: its depth, its
        positions, its expected tokens at that depth; a request with nothing to draft does not ask. Asking
        for k and finding no match was 43% of the model's grants at 8 SmolLM2 requests on Spec-Bench
        (session 16): room set aside for positions nobody filled, and tokens predicted that could not come."""
        mode = self.speculation
        if self.picker is not None and decoding:
            self.arm = self.picker.choose(len(decoding), prefill=prefill > 0)
            self.metrics.arm(self.arm)
            mode = "auto" if self.arm == "model" else self.arm
        asks, drafted = [], {}
        for slot in decoding:
            if slot.drafter is None or mode == "never":
                continue
            slot.ctx.remaining = slot.job.request.max_new_tokens - len(slot.stopper.ids)
            k = min(choose_k(slot.policy, slot.drafter, slot.ctx), slot.ctx.remaining - 1)
            positions = slot.policy.positions(k) if hasattr(slot.policy, "positions") else k
            if k > 0 and slot.drafter.cheap:
                draft = drafted[slot.job.id] = slot.drafter.propose(slot.ctx, k)
                k, positions = draft.depth, len(draft)
            if k > 0:  # a fixed k has no estimate: counted as all accepted, free to draft, all or none
                expected = slot.policy.expected_tokens()[:k + 1] if hasattr(slot.policy, "expected_tokens") else ()
                chain = positions == k and getattr(slot.policy, "nodes", None) is None
                asks.append(scheduler.Ask(slot.job.id, k, slot.job.priority, expected[k] if expected else k + 1.0,
                                          getattr(slot.policy, "tau", 0.0), positions,
                                          getattr(slot.policy, "probing", False), tuple(expected) if chain else ()))
        grants = scheduler.grant(asks, len(decoding), prefill, mode, self.budget, self.curve, self.overhead)
        for a in asks:
            self.metrics.granted(a.priority, grants[a.name])
        asked = {a.name for a in asks}
        for slot in decoding:  # an ask run plain: the request's alphas learn nothing from this round
            if slot.job.id in asked and not grants[slot.job.id] and hasattr(slot.policy, "refused"):
                slot.policy.refused()
        return grants, drafted

    def _verify(self, slot: Slot, k: int, draft: Draft, logits: torch.Tensor, hidden: torch.Tensor | None,
                draft_s: float, target_s: float) -> int:
        """One request's half of the round after the shared forward; returns the tokens it committed.
        `hidden`: the round's features (EAGLE), of which the root's and the accepted path's are kept."""
        sampling, n = slot.job.request.sampling, len(draft)
        result = verify(draft, target_probs(logits[:1 + n], sampling), slot.draws,
                        "greedy" if sampling.greedy else "exact", position=len(slot.ctx.tokens), validate=False)
        if hidden is not None:
            slot.ctx.features.append(hidden[[0] + [i + 1 for i in result.path]])
        rnd.settle(slot.cache, draft, result)
        emitted = result.tokens.tolist()
        committed, done = rnd.commit(slot.stopper, emitted)
        slot.ctx.tokens.extend(emitted)
        if slot.drafter:
            rnd.feedback(slot.drafter, slot.policy, draft, result, emitted, logits, draft_s, target_s)
            if n:  # by depth, as decode() counts: a tree's siblings are alternatives for one position
                self.metrics.acceptance(slot.drafter.name, slot.job.priority, draft.depth, result.num_accepted)
        now = time.perf_counter()
        if slot.last_emit is None:
            self.metrics.first_token(now - slot.job.submitted)
        else:
            self.metrics.inter_token(now - slot.last_emit, speculating=k > 0)
        slot.last_emit = now
        if done:
            self._finish(slot, slot.stopper.finish_reason, committed)
        else:
            self._emit(slot.job, Event(slot.stopper.new_text(), committed))
        return len(committed)

    def _finish(self, slot: Slot, reason: str, tokens: list[int] = (), error: str | None = None) -> None:
        text = slot.stopper.new_text() if reason in ("stop", "length") else ""
        self._emit(slot.job, Event(text, list(tokens), reason, len(slot.job.prompt_ids), len(slot.stopper.ids), error))
        self.metrics.finished(reason)

    @staticmethod
    def _emit(job: Job, event: Event) -> None:
        """Hand an event to the job's listener; a listener that fails (its client is gone) cancels the job."""
        try:
            job.on_event(event)
        except Exception:  # noqa: BLE001 - whatever the listener raises, the engine keeps serving the others
            job.cancel()

    # --- the serving thread ---------------------------------------------------------------------
    def serve(self, stop: threading.Event) -> None:
        """Step while there is work, sleep while idle (B reads 0 then), until `stop` is set; then cancel what
        is left."""
        while not stop.is_set():
            self.wake.clear()
            if self.busy:
                self.step()
            else:
                self.metrics.batch.set(0)
                self.wake.wait(0.1)
        self.cancel_all()
        self._drop_cancelled()

    def cancel_all(self) -> None:
        """Cancel every waiting and running job (any thread): each ends with a "cancelled" event at the next
        step (`specdec serve` on Ctrl-C, once the in-flight requests' grace is over)."""
        with self.lock:
            jobs = list(self.waiting) + [slot.job for slot in self.running]
        for job in jobs:
            job.cancel()
        self.wake.set()
