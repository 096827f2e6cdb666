"""Hybrid drafting: an ordered list of sources, falling back per round (the lesson, Ch. 3).

Each round asks the sources in order and keeps the first non-empty Draft: a cheap source first
(prompt lookup: tau about 0), a costly one only for the rounds where the cheap one has nothing.
The effective tau is the share-weighted mix, `specdec.theory.hybrid_tau` (Ch. 3: 70% lookup
at 0.002 + 30% draft model at 0.10 = 0.031). Verification does not care which source drafted:
q is the proposer's (None for prompt lookup), so the output is exact whatever the mix.

Feedback. `observe` reaches the proposer with the round's real outcome; every other source gets
`Outcome(Draft.empty(), 0, emitted)` with the root's logits row: "you did not draft this round; these
tokens were committed" (so pools and recycling's table learn the text without being credited with someone
else's acceptance). Sources
with their own KV cache (DraftModel, EarlyExit) resync by common prefix on their next propose,
whatever happened in the rounds they sat out.

Per-source k. A source's alpha and tau differ (lookup on code edits: alpha 0.9, tau 0; early exit:
alpha 0.5, tau 0.4), so one adaptive estimate for the mix is wrong for both. `policies` (optional,
one per source, any object with `choose()` and `observe(drafted, accepted)`, e.g.
`specdec.adaptive.AdaptiveK`; for a source with a starting cost, such as a draft model, `choose`
also takes `startup` and `remaining`, see `adaptive.choose_k`) caps each source's k: a source whose policy says 0 is skipped (the
round falls through to the next one), and the outcome updates only the proposer's policy.
`last_source` names the proposer of the latest round (None: nobody proposed) for callers that
key their own statistics by source.

Lookahead as a source (Ch. 6, "combining, not choosing"): its Jacobi window rides along in the
forward of whichever source drafts the round (and alone when nobody does), and its n-gram pool
learns every other source's proposals (`seed`) as well as the committed text.

Example: `Hybrid([PromptLookup(), EarlyExit(model, 8)])` on "fix this function": lookup
proposes while the answer copies the buggy code, early exit drafts the edited lines;
`hybrid.stats()` -> {"prompt-lookup": {"rounds": 31, "drafted": 118, "accepted": 97}, ...}.
"""

from __future__ import annotations

from typing import Callable, Sequence

from specdec.adaptive import choose_k
from specdec.draft import Draft
from specdec.drafters.base import Context, Drafter, Outcome
from specdec.theory import hybrid_tau


class Hybrid(Drafter):
    name = "hybrid"

    def __init__(self, sources: Sequence[Drafter], policies: Sequence | None = None):
        sources = list(sources)
        if not sources:
            raise ValueError("hybrid drafting needs at least one source")
        if policies is not None and len(policies) != len(sources):
            raise ValueError(f"policies must give one policy per source ({len(sources)}), got {len(policies)}")
        self.sources = sources
        self.policies = list(policies) if policies is not None else None
        self.names = _unique([getattr(s, "name", type(s).__name__) for s in sources])
        self.deterministic = all(getattr(s, "deterministic", True) for s in sources)
        self.wants_hidden = any(getattr(s, "wants_hidden", False) for s in sources)  # Medusa as a source
        self.wants_hidden_layers = next((s.wants_hidden_layers for s in sources  # EAGLE as a source
                                         if getattr(s, "wants_hidden_layers", ())), ())
        self.last_source: str | None = None
        self._last: int | None = None
        self._aux_source: int | None = None   # the source whose lookahead window rode along this round
        self.counts = {}
        self.reset_counts()

    def use_policies(self, make: Callable[[Drafter], object]) -> None:
        """Give every source its own k policy, `make(source)` (e.g. AdaptiveK with the source's tau_prior)."""
        self.policies = [make(s) for s in self.sources]

    # --- the interface ----------------------------------------------------------------------------------
    def propose(self, ctx: Context, k: int) -> Draft:
        self._last = self.last_source = self._aux_source = None
        if k <= 0:
            return Draft.empty()
        aux = None
        for i, source in enumerate(self.sources):
            k_i = k if self.policies is None else min(k, choose_k(self.policies[i], source, ctx))
            if k_i <= 0:
                continue
            draft = source.propose(ctx, k_i)
            if draft.depth > k_i:
                raise RuntimeError(f"{self.names[i]} proposed a draft {draft.depth} tokens deep for k = {k_i}")
            if draft.aux is not None and aux is None:  # a lookahead window rides along with whoever drafts
                aux, self._aux_source = draft.aux, i
            if len(draft):
                self._last, self.last_source = i, self.names[i]
                c = self.counts[self.names[i]]
                c["rounds"] += 1
                c["drafted"] += len(draft)
                draft.aux = draft.aux or aux
                for j, other in enumerate(self.sources):  # pools learn from the other sources' proposals
                    if j != i and hasattr(other, "seed"):
                        other.seed(ctx.tokens[-1], draft)
                return draft
        self.counts[None]["rounds"] += 1
        empty = Draft.empty()
        empty.aux = aux
        return empty

    def room(self, k: int) -> int:
        """One source's draft plus another's lookahead window may share a forward: the sum bounds it."""
        return sum(s.room(k) for s in self.sources)

    def observe(self, outcome: Outcome) -> None:
        i = self._last if len(outcome.draft) else None
        if i is not None:
            self.counts[self.names[i]]["accepted"] += outcome.num_accepted
            if self.policies is not None:
                self.policies[i].observe(outcome.draft.depth, outcome.num_accepted)  # a tree's depth
        root = outcome.logits[:1] if outcome.logits is not None else None  # the root's row: any source's
        bystander = Outcome(Draft.empty(), 0, outcome.emitted, logits=root)
        window = Outcome(Draft.empty(), 0, outcome.emitted, outcome.aux_logits, root)
        for j, source in enumerate(self.sources):
            source.observe(outcome if j == i else window if j == self._aux_source else bystander)

    def timing(self, drafted: int, draft_seconds: float, target_seconds: float) -> None:
        """A round's measured times, for the proposer's policy when it measures tau (AdaptiveK.timing)."""
        if self._last is not None and self.policies is not None:
            timing = getattr(self.policies[self._last], "timing", None)
            if timing:
                timing(drafted, draft_seconds, target_seconds)

    def plain_timing(self, seconds: float) -> None:
        """A plain round's measured time, for every source's policy (AdaptiveK.plain_timing)."""
        for policy in self.policies or ():
            if hasattr(policy, "plain_timing"):
                policy.plain_timing(seconds)

    @property
    def stale(self) -> bool:
        """The proposer caught up on many committed tokens this round: its time says nothing about tau."""
        return self._last is not None and getattr(self.sources[self._last], "stale", False)

    def verify_forward(self, model, cache, inputs):
        """The proposer's verification hook (EarlyExit's KV reuse), when it has one; None = plain forward."""
        hook = getattr(self.sources[self._last], "verify_forward", None) if self._last is not None else None
        return hook(model, cache, inputs) if hook else None

    def reset(self) -> None:
        for source in self.sources:
            source.reset()
        self._last = self.last_source = self._aux_source = None
        self.reset_counts()

    # --- reporting --------------------------------------------------------------------------------------
    def reset_counts(self) -> None:
        self.counts = {name: dict(rounds=0, drafted=0, accepted=0) for name in self.names}
        self.counts[None] = dict(rounds=0, drafted=0, accepted=0)  # rounds where no source proposed

    def stats(self) -> dict:
        """Per source since the last reset: rounds it proposed, tokens drafted and accepted, its
        acceptance rate and share of the speculative rounds; key "none" counts the empty rounds."""
        spec = sum(self.counts[n]["rounds"] for n in self.names)
        out = {}
        for name in self.names:
            c = dict(self.counts[name])
            c["acceptance_rate"] = c["accepted"] / c["drafted"] if c["drafted"] else 0.0
            c["share"] = c["rounds"] / spec if spec else 0.0
            out[name] = c
        out["none"] = dict(rounds=self.counts[None]["rounds"])
        return out

    @property
    def tau_prior(self) -> float:
        """Tau of the mix for a single adaptive policy: `theory.hybrid_tau` over the shares of the
        rounds so far (the first source's tau before any round)."""
        taus = [float(getattr(s, "tau_prior", 0.0)) for s in self.sources]
        rounds = [self.counts[n]["rounds"] for n in self.names]
        if not sum(rounds):
            return taus[0]
        return hybrid_tau([r / sum(rounds) for r in rounds], taus)


def _unique(names: list[str]) -> list[str]:
    """Make names distinct: a repeated name gets #2, #3, ..."""
    seen: dict[str, int] = {}
    out = []
    for n in names:
        seen[n] = seen.get(n, 0) + 1
        out.append(n if seen[n] == 1 else f"{n}#{seen[n]}")
    return out


def build_hybrid(sources: Sequence[str], make: Callable[[str], Drafter | None]) -> Hybrid:
    """A Hybrid over named sources, in order (e.g. ["prompt-lookup", "retrieval", "draft"]). `make(name)`
    builds one source (LLM.drafter); each source's own k policy comes later (`Hybrid.use_policies`)."""
    names = [s.strip() for s in (sources.split(",") if isinstance(sources, str) else sources) if s.strip()]
    if not names:
        raise ValueError("hybrid needs at least one source, e.g. --sources prompt-lookup,draft")
    if "hybrid" in names or "plain" in names:
        raise ValueError(f"hybrid sources are drafters (not 'hybrid' or 'plain'), got {', '.join(names)}")
    drafters = [make(n) for n in names]
    if any(d is None for d in drafters):
        raise ValueError(f"a hybrid source made no drafter: {', '.join(names)}")
    return Hybrid(drafters)
