"""A small draft model (Leviathan et al. 2023; Chen et al. 2023: "speculative sampling").

The draft runs autoregressively for k tokens with its own static KV cache, sampling each
token from q = its distribution under the request's own sampling settings (so q and p are
shaped alike and overlap well); in greedy mode it drafts its argmax and q is not needed.
Its cache is kept in step with the committed tokens by longest common prefix: after a
rejection the draft cache is rewound to what both agree on, and only new tokens are fed.

Starting costs. Before its first draft the draft model prefills the prompt itself: about
`tau_prior` (its weights over the target's) times the target's own prefill. `startup` reports that
cost so adaptive k starts the draft model only when the predicted saving over the tokens left pays
for it: a 740-token RAG prompt with 64 tokens to go is decoded plainly (the 0.5B's prefill would
cost 7 s to save about 3), a 250-token bug fix with 128 to go is drafted.

Example: Qwen2.5-Coder-0.5B drafting for Qwen2.5-Coder-1.5B (same tokenizer; the vocabulary
matrices are padded to different sizes, so q is cut to the ids both models share).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from specdec.draft import Draft
from specdec.drafters.base import Context, Drafter, cache_slots, common_prefix, sync_prefix
from specdec.errors import SpecdecError
from specdec.runtime.kernels.ops import argmax
from specdec.runtime.model import Transformer
from specdec.sampling import probs_from_logits, sample


def check_same_tokenizer(target_tok, draft_tok) -> int:
    """The number of token ids the two models share; refuses tokenizers that map text differently."""
    a, b = target_tok.hf.get_vocab(), draft_tok.hf.get_vocab()
    if a != b:
        diff = len(set(a.items()) ^ set(b.items()))
        raise SpecdecError(f"the draft model's tokenizer differs from the target's ({diff} vocabulary entries "
                           "differ): choose a draft model of the same family")
    return len(a)


def check_draft_family(target: str | Path, draft: str) -> None:
    """Refuses a draft model of another family than the target's where both are known models (`store.family`),
    before the draft is pulled (up to gigabytes) or the target's weights load; other pairs are compared by their
    tokenizers (`check_same_tokenizer`) when the draft loads."""
    from specdec.store import KNOWN_MODELS, family

    ours, theirs = family(target), family(draft)
    if ours and theirs and ours != theirs:
        target_name = Path(os.fspath(target)).name  # a known name, or its store folder's
        same = [m.name for m in KNOWN_MODELS.values() if (m.family or m.name) == ours and m.name != target_name]
        raise SpecdecError(f"the draft model {draft!r} ({theirs} tokenizer) cannot draft for the target ({ours} "
                           "tokenizer): choose a draft model of the same family"
                           + (f", e.g. {', '.join(same)}" if same else ""))


class DraftModel(Drafter):
    name = "draft"
    deterministic = False
    prior_alpha = 0.7  # a same-family draft before any round (the lesson: 0.65 for a tuned draft; ours: 0.81 on code)

    def __init__(self, model: Transformer, target_vocab: int, shared_vocab: int, tau_prior: float = 0.3):
        self.model = model
        self.target_vocab = target_vocab
        self.shared = min(shared_vocab, target_vocab, model.cfg.vocab_size)
        self.tau_prior = tau_prior  # its cost per token over the target's (weights over weights)
        self.cache = None
        self.fed: list[int] = []  # tokens whose KV is in self.cache
        self.stale = False

    def reset(self) -> None:
        self.cache = None
        self.fed = []

    def startup(self, ctx: Context) -> float:
        """The tokens it must feed before drafting beyond the usual last one, at its relative cost."""
        return max(0, len(ctx.tokens) - 1 - common_prefix(self.fed, ctx.tokens)) * self.tau_prior

    def _catch_up(self, tokens: list[int], slots: int) -> torch.Tensor:
        """Bring the cache to `tokens[:-1]` plus feed the last token; return logits after it [V].
        `slots`: what the request can use (`cache_slots`); the cache grows when it would not fit."""
        if self.cache is None:
            self.cache = self.model.new_cache(slots)
            self.fed = []
        self.cache.grow(slots)
        new = tokens[sync_prefix(self.cache, self.fed, tokens):]
        self.stale = len(new) > 2  # catching up after plain steps: this round's time is not the draft's tau
        logits = self.model(torch.tensor([new]), self.cache, last_only=True).logits[0, -1]
        self.fed.extend(new)
        return logits

    def propose(self, ctx: Context, k: int) -> Draft:
        logits = self._catch_up(ctx.tokens, cache_slots(ctx, k))
        tokens, qs = [], []
        for i in range(k):
            logits = logits[:self.shared]
            if ctx.sampling.greedy:
                t = int(argmax(logits))
            else:
                q = probs_from_logits(logits, ctx.sampling)
                t = int(sample(q, ctx.generator))
                qs.append(q)
            tokens.append(t)
            if i + 1 < k:
                logits = self.model(torch.tensor([[t]]), self.cache).logits[0, -1]
                self.fed.append(t)
        q = None
        if qs:
            q = torch.zeros(len(qs), self.target_vocab)
            q[:, :self.shared] = torch.stack(qs)
        return Draft.chain(tokens, q)
