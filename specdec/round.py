"""The pieces of one speculation round that `decode()` (one request) and the batched server engine
(`specdec.serving.engine`, many requests per forward) share: where the round's positions go, how the
cache keeps the accepted ones, how committed tokens end generation, and the feedback to drafter and
policy. The forward itself is the caller's: one request's `model(...)` or the server's packed forward.

    offsets, local = layout(draft)              # None, None for a chain: default positions, causal
    ... one forward over [last] + draft.tokens + aux, giving logits ...
    result = verify(draft, p, generator, mode)
    settle(cache, draft, result)                # rewind (chain) or compact (tree / aux)
    committed, done = commit(stopper, result.tokens.tolist())
    feedback(drafter, policy, draft, result, emitted, logits, draft_s, target_s)
"""

from __future__ import annotations

import torch

from specdec.draft import Draft, forward_layout
from specdec.drafters.base import Outcome
from specdec.runtime.kv_cache import KVCache
from specdec.verify import VerifyResult


def aux_len(draft: Draft) -> int:
    return len(draft.aux) if draft.aux is not None else 0


def layout(draft: Draft) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Position offsets [1+n+m] after the root's and the mask [1+n+m, 1+n+m] among the round's new
    positions; (None, None) for a chain without aux positions (default positions, causal mask)."""
    if draft.is_chain and not aux_len(draft):
        return None, None
    return forward_layout(draft)


def settle(cache: KVCache, draft: Draft, result: VerifyResult) -> None:
    """Keep the KV of the root and the accepted path, drop the rest of the round's positions."""
    n, m = len(draft), aux_len(draft)
    if draft.is_chain and not m:
        cache.rewind(n - result.num_accepted)
    else:
        cache.compact([0] + [i + 1 for i in result.path], newest=1 + n + m)


def commit(stopper, emitted: list[int]) -> tuple[list[int], bool]:
    """Push the round's tokens one at a time; returns the tokens committed and whether generation ended."""
    committed = []
    for token in emitted:
        committed.append(token)
        if stopper.push(token):
            return committed, True
    return committed, False


def feedback(drafter, policy, draft: Draft, result: VerifyResult, emitted: list[int],
             logits: torch.Tensor, draft_s: float, target_s: float) -> None:
    """Tell the drafter how the round went (`logits`: the round's rows [1+n+m, V], root, nodes, aux); the
    policy learns alpha (and tau from the round's times)."""
    n = len(draft)
    aux_logits = logits[1 + n:] if aux_len(draft) else None
    drafter.observe(Outcome(draft, result.num_accepted, emitted, aux_logits, logits[:1 + n]))
    if n:
        policy.observe(draft.depth, result.num_accepted)  # a tree's depth (a chain's length)
        for measured in (policy, drafter):  # tau from this round's times (Hybrid: its proposer's policy)
            if hasattr(measured, "timing") and not getattr(drafter, "stale", False):
                measured.timing(n, draft_s, target_s)
