"""The lesson's dashboard signals (Ch. 7, "What to actually put on a dashboard") as Prometheus metrics.

Each app owns its registry (served at /metrics). Names, documented in README.md's `specdec serve`:

    specdec_batch_size                      gauge: B, requests decoding in the last step (0 while idle)
    specdec_queue_length                    gauge: jobs waiting for a slot
    specdec_budget_positions                gauge: the budget (positions one forward verifies for ~ the cost of one)
    specdec_steps_total                     counter: server steps
    specdec_steps_over_budget_total         counter: steps whose forward held more positions than the budget
    specdec_step_positions                  histogram: positions per forward (B + drafts + prefill)
    specdec_tokens_per_step                 histogram: tokens committed per step, all requests together
    specdec_drafted_tokens_total            counter{drafter, priority}: drafted tokens verified, by depth (a tree's
                                            siblings are alternatives for one position: decode()'s `Result`)
    specdec_accepted_tokens_total           counter{drafter, priority}: of them accepted
    specdec_realized_alpha                  gauge{drafter, priority}: accepted / drafted so far
    specdec_position_drafted_total          counter{position}: rounds that reached draft position i (1-based)
    specdec_position_accepted_total         counter{position}: ... and accepted it (per-position acceptance)
    specdec_k_granted                       histogram{priority}: k the scheduler granted per request-step asked
    specdec_auto_arm_steps_total            counter{arm}: auto's steps by how they were granted (model, never, always)
    specdec_auto_arm_ratio                  gauge{batch, arm}: auto's measured tokens/s of each arm relative to the
                                            arm it runs at that batch size ("1", "2", "3-4", "5-8", ...; the running
                                            arm reads 1), from steps paired in time (`scheduler.ModePicker.estimates`)
    specdec_inter_token_seconds             histogram{speculating}: time between a request's rounds
    specdec_time_to_first_token_seconds     histogram: submit to first committed token
    specdec_requests_total                  counter{finish}: finished requests by finish reason
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from specdec.serving.scheduler import ARMS

LATENCY = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.batch = Gauge("specdec_batch_size", "Requests decoding in the last step (B)", registry=r)
        self.waiting = Gauge("specdec_queue_length", "Jobs waiting for a slot", registry=r)
        self.budget = Gauge("specdec_budget_positions", "Positions one forward verifies for about the cost of one",
                            registry=r)
        self.steps = Counter("specdec_steps", "Server steps", registry=r)
        self.over = Counter("specdec_steps_over_budget", "Steps whose forward held more positions than the budget",
                            registry=r)
        self.positions = Histogram("specdec_step_positions", "Positions per packed forward", registry=r,
                                   buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))
        self.tokens = Histogram("specdec_tokens_per_step", "Tokens committed per step", registry=r,
                                buckets=(1, 2, 4, 8, 16, 32, 64))
        labels = ("drafter", "priority")
        self.drafted = Counter("specdec_drafted_tokens", "Drafted tokens verified", labels, registry=r)
        self.accepted = Counter("specdec_accepted_tokens", "Drafted tokens accepted", labels, registry=r)
        self.alpha = Gauge("specdec_realized_alpha", "Accepted / drafted so far", labels, registry=r)
        self.pos_drafted = Counter("specdec_position_drafted", "Rounds that reached draft position i", ("position",),
                                   registry=r)
        self.pos_accepted = Counter("specdec_position_accepted", "Rounds that accepted draft position i",
                                    ("position",), registry=r)
        self.k = Histogram("specdec_k_granted", "k granted per asking request and step", ("priority",), registry=r,
                           buckets=(0, 1, 2, 3, 4, 6, 8, 16))
        self.arms = Counter("specdec_auto_arm_steps", "Auto's steps by arm (model, never, always)", ("arm",),
                            registry=r)
        self.arm_ratio = Gauge("specdec_auto_arm_ratio", "Auto's measured tokens/s of an arm relative to the arm "
                               "it runs at that batch size (paired steps)", ("batch", "arm"), registry=r)
        self.itl = Histogram("specdec_inter_token_seconds", "Time between a request's rounds", ("speculating",),
                             registry=r, buckets=LATENCY)
        self.ttft = Histogram("specdec_time_to_first_token_seconds", "Submit to first committed token", registry=r,
                              buckets=LATENCY + (10.0, 30.0))
        self.requests = Counter("specdec_requests", "Finished requests", ("finish",), registry=r)
        self.totals: dict[tuple[str, str], list[int]] = {}  # (drafter, priority) -> [drafted, accepted]

    def step(self, batch: int, positions: int, budget: float, tokens: int, seconds: float) -> None:
        self.batch.set(batch)
        self.budget.set(budget)
        self.steps.inc()
        if positions > budget:
            self.over.inc()
        self.positions.observe(positions)
        self.tokens.observe(tokens)

    def queue(self, n: int) -> None:
        self.waiting.set(n)

    def granted(self, priority: str, k: int) -> None:
        self.k.labels(priority).observe(k)

    def arm(self, arm: str) -> None:
        self.arms.labels(arm).inc()

    def arm_ratios(self, batch: str, current: str, ratios: dict[str, tuple[float, int]]) -> None:
        """One batch bucket's estimates (`ModePicker.estimates`): the running arm at 1, arms not yet measured
        left out."""
        for arm in ARMS:
            if arm == current or arm in ratios:
                self.arm_ratio.labels(batch, arm).set(1.0 if arm == current else ratios[arm][0])
            else:
                try:
                    self.arm_ratio.remove(batch, arm)
                except KeyError:
                    pass

    def acceptance(self, drafter: str, priority: str, drafted: int, accepted: int) -> None:
        """One verified round: `drafted` its depth (a tree's nodes are alternatives, not positions), `accepted`
        the tokens its verified path kept."""
        self.drafted.labels(drafter, priority).inc(drafted)
        self.accepted.labels(drafter, priority).inc(accepted)
        totals = self.totals.setdefault((drafter, priority), [0, 0])
        totals[0] += drafted
        totals[1] += accepted
        self.alpha.labels(drafter, priority).set(totals[1] / totals[0])
        for i in range(min(drafted, accepted + 1)):  # positions reached
            self.pos_drafted.labels(str(i + 1)).inc()
            if i < accepted:
                self.pos_accepted.labels(str(i + 1)).inc()

    def realized_alpha(self, drafter: str, priority: str, least: int = 32) -> float | None:
        """alpha this server has realized for a drafter and priority class (accepted / drafted), once at least
        `least` tokens were drafted; None before."""
        drafted, accepted = self.totals.get((drafter, priority), (0, 0))
        return accepted / drafted if drafted >= least else None

    def inter_token(self, seconds: float, speculating: bool) -> None:
        self.itl.labels("true" if speculating else "false").observe(seconds)

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def finished(self, reason: str) -> None:
        self.requests.labels(reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
