"""The drafter interface: `propose(context, k) -> Draft` and `observe(outcome)`.

A drafter sees only the `Context` (token history, sampling settings, the request's random
generator) and returns a Draft: tokens + parents + optional q (None = deterministic, as for
prompt lookup). It never runs the target (early exit, the target's own first layers, drafts on
`Context.target_cache` beyond the committed slots). `observe` reports how the round went, so pools,
caches and acceptance statistics can update. An empty Draft means "nothing to propose": the
round becomes a plain decoding step.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from specdec.draft import Draft
from specdec.runtime.kv_cache import KVCache
from specdec.sampling import SamplingParams


@dataclass
class Context:
    tokens: list[int]             # prompt + committed tokens (the last one is not yet in the target's cache)
    prompt_len: int
    sampling: SamplingParams
    generator: torch.Generator    # the request's generator (drafters that sample draw from it)
    remaining: int = 0            # tokens the request may still generate
    prefill_cost: float | None = None  # one target prefill token, in target steps, measured (None: no step yet)
    target_cache: KVCache | None = None  # the target's cache (every token but the last): early exit drafts on it
    hidden: torch.Tensor | None = None  # [D] the target's last hidden state (after the final norm) at the last
    #                                     accepted position, from the verify pass, for drafters with wants_hidden
    features: list[torch.Tensor] = field(default_factory=list)  # for drafters with wants_hidden_layers (EAGLE):
    #                                     the outputs of those A target layers, concatenated [m_i, A*D], at the
    features_start: int = 0             # committed positions features_start onwards not yet taken (`take_features`)

    def add_features(self, hidden: dict, layers, index) -> None:
        """Append the features of newly committed positions: hidden[l][0, index] of each layer l, concatenated."""
        self.features.append(torch.cat([hidden[l][0, index] for l in layers], dim=-1))

    def take_features(self) -> tuple[int, torch.Tensor | None]:
        """(position of the first row, the rows [m, A*D]) of the features not yet taken, or (start, None); they
        are taken. Example: a 5-token prompt, then a round accepting 2 drafts: (0, rows for positions 0..3)
        after prefill, then (4, rows for 4..6): the root (position 4) and the two accepted drafts."""
        start = self.features_start
        if not self.features:
            return start, None
        rows = torch.cat(self.features) if len(self.features) > 1 else self.features[0]
        self.features, self.features_start = [], start + len(rows)
        return start, rows


@dataclass
class Outcome:
    draft: Draft
    num_accepted: int
    emitted: list[int]            # accepted draft tokens + the recovered or bonus token
    aux_logits: torch.Tensor | None = None  # target logits at the draft's aux positions [m, V]
    logits: torch.Tensor | None = None  # target logits at the root and the draft's nodes [1+n, V] (Recycling)


def common_prefix(fed: list[int], tokens: list[int]) -> int:
    """Length of the longest common prefix of `fed` and `tokens`, leaving at least the last token to feed.
    Asked every round (`DraftModel.startup`, `sync_prefix`): the usual case, `fed` a prefix of `tokens`,
    is one list comparison; only a rejection walks to the first difference."""
    n = min(len(fed), len(tokens))
    common = n if fed[:n] == tokens[:n] else next(i for i in range(n) if fed[i] != tokens[i])
    return min(common, len(tokens) - 1)


def cache_slots(ctx: Context, k: int) -> int:
    """Slots a drafter's own KV cache needs for the rest of this request: the context, then every token the
    request can still commit, or this round's k drafts when more (decode keeps k <= remaining - 1). The
    context plus the remaining tokens stays constant over a request, so the cache is allocated once.

    Example: a 30-token prompt, max_new_tokens 700, k 600: 730 slots (not 30 + 512)."""
    return len(ctx.tokens) + max(k, ctx.remaining)


def sync_prefix(cache, fed: list[int], tokens: list[int]) -> int:
    """Keep a drafter's own KV cache in step with the committed tokens: rewind `cache` (and `fed`, the
    tokens whose KV it holds) to the longest common prefix with `tokens`, leaving at least the last
    token to feed. Returns that prefix length; the caller feeds `tokens[common:]`."""
    common = common_prefix(fed, tokens)
    cache.rewind(cache.length - common)
    del fed[common:]
    return common


class Drafter:
    """Base class: subclasses implement `propose`; the rest is optional."""

    name = "drafter"
    deterministic = True          # q is None: rejection sampling uses q one-hot on the drafted token
    wants_hidden = False          # True: the loop asks the target for its last hidden state (Context.hidden)
    wants_hidden_layers: tuple[int, ...] = ()  # target layers whose outputs the loop hands over (Context.features)
    cheap = False                 # True: proposing is a lookup, no model runs and nothing is left to undo, so
    #                               a server drafts before it grants and prices the draft it has (`Engine`)

    def propose(self, ctx: Context, k: int) -> Draft:
        raise NotImplementedError

    def room(self, k: int) -> int:
        """The most draft positions one verification forward carries (beyond the root) when drafts are at
        most k deep: the target's cache is sized by it. Default: a chain of k."""
        return k

    def startup(self, ctx: Context) -> float:
        """One-time work this drafter's next proposal would do before drafting, in target prefill tokens
        (a draft model's prefill of the prompt: prompt tokens x its cost per token relative to the target's).
        Adaptive k starts such a drafter only when the predicted saving pays for it. Default 0."""
        return 0.0

    def observe(self, outcome: Outcome) -> None:
        """Feedback after verification (default: nothing)."""

    def reset(self) -> None:
        """Forget per-request state before a new request."""

    def fresh(self) -> "Drafter":
        """A drafter for another request on the same weights and settings, with per-request state of its own
        (a KV cache, a context): `specdec.LLM` hands one to each request, so two streams or threads of one LLM
        never draft on each other's caches. Default: a shallow copy, reset."""
        other = copy.copy(self)
        other.reset()
        return other
