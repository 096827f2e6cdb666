"""Early-exit self-speculation (LayerSkip, Elhoushi et al. 2024; Draft & Verify, Zhang et al. 2024).

The draft is the target, truncated: its first L layers, then its own final norm and LM head
(`Transformer.forward(..., exit_layer=L)`), on the same weight tensors (nothing is copied). It
drafts k tokens autoregressively on the target's own KV cache (LayerSkip's shared cache, given in
`Context.target_cache`): layers < L of the committed tokens are already there, so the draft never
prefills the prompt nor catches up after plain steps; it feeds only the last committed token and
its own drafts, into slots the verification then overwrites. (Without the target's cache, e.g.
called on its own, it keeps a cache of layers < L in step by longest common prefix.) Greedy: each
token is the argmax and q is None. Sampled: q rows are the request's sampling applied to the
early-exit logits, and the tokens are drawn from them with the request's generator.

LayerSkip's reuse. Layers < L see only layers < L of earlier positions, so the draft pass has
already computed, for the positions it fed (the last committed token and drafts 1..k-1), the
very KV and layer-(L-1) outputs the target's verification would compute for layers < L.
`verify_forward` finds those KV slots in the target's cache (copies them there from its own) and runs only layers L..N-1 for
them (`forward_from_layer`); the one position the draft never fed (the last drafted token)
still goes through layers < L. The verification is then the same computation as a plain
forward: in fp32 up to the last bits (chunking changes summation order, as in any speculation);
with bf16 weights on the kernel bit for bit, since it attends as `Transformer.forward` does.

Example: SmolLM2-135M has 30 layers; `EarlyExit(model, 8)` drafts with layers 0..7 + norm +
head. Its tied 49k x 576 LM head is a fifth of a step, so tau(8) measures 0.37, not 8/30; and a
model not trained for early exit agrees with its layer-8 guess about 4% of the time (22 layers:
23%). The choice of L is measured (`specdec exit-layers`), not guessed.
"""

from __future__ import annotations

import torch

from specdec.adaptive import AdaptiveK
from specdec.draft import Draft
from specdec.drafters.base import Context, Drafter, cache_slots, sync_prefix
from specdec.runtime.kernels.ops import argmax
from specdec.runtime.kv_cache import KVCache
from specdec.runtime.model import ROW_EXACT_MAX, ForwardOutput, Transformer
from specdec.sampling import probs_from_logits, sample
from specdec.theory import early_exit_tau


@torch.inference_mode()
def forward_from_layer(model: Transformer, cache: KVCache, hidden: torch.Tensor, rest: torch.Tensor,
                       start_layer: int) -> ForwardOutput:
    """A chain forward that starts at layer `start_layer` for its first positions.

    hidden [B, m, D]: the output of layer start_layer-1 at positions cache.length .. +m-1, whose
    KV for layers < start_layer are already in `cache`; rest [B, r]: token ids of the r positions
    after them, run from the embedding. Writes the KV of every layer it runs, advances
    cache.length by m + r, and returns the logits of all m + r positions, like
    `model(tokens, cache)` would over the same m + r tokens (a causal chain, no tree mask)."""
    m = hidden.shape[1]
    r = rest.shape[1]
    n = m + r
    start = cache.length
    if start + n > cache.max_len:
        raise ValueError(f"context overflow: {start + n} positions exceed the cache's {cache.max_len}")
    device = model.device  # a target on a GPU: host inputs move there, the logits come back (no-ops on the CPU)
    hidden, rest = hidden.to(device), rest.to(device)
    cos, sin = model._rope(range(start, start + n))
    if r:  # the positions the draft never fed: layers < start_layer first
        y = model.embed(rest)
        c, s, (mask, plan) = cos[:, :, m:], sin[:, :, m:], model.attention_plan(r, start + m)
        mask = None if mask is None else mask.to(device)
        for i in range(start_layer):
            y = model.layers[i](y, c, s, cache, i, start + m, mask, plan)
        x = torch.cat([hidden.to(y.dtype), y], dim=1)
    else:
        x = hidden
    mask, plan = model.attention_plan(n, start)  # as Transformer.forward attends (exact models: `attend_rows`)
    mask = None if mask is None else mask.to(device)
    for i in range(start_layer, model.cfg.num_layers):
        x = model.layers[i](x, cos, sin, cache, i, start, mask, plan)
    cache.length = start + n
    return ForwardOutput(model.lm_head(model.norm(x)).float().cpu())


class EarlyExit(Drafter):
    """Drafts with the target's first `exit_layer` layers + final norm + LM head (module docstring)."""

    name = "early-exit"
    deterministic = False

    def __init__(self, target: Transformer, exit_layer: int, max_len: int = 0, reuse: bool = True,
                 tau: float | None = None, alpha: float | None = None):
        n = target.cfg.num_layers
        if not isinstance(exit_layer, int) or isinstance(exit_layer, bool) or not 1 <= exit_layer <= n:
            raise ValueError(f"exit_layer must be an integer in 1..{n} (the model has {n} layers), "
                             f"got {exit_layer!r}")
        self.model = target
        self.exit_layer = exit_layer
        self.max_len = max_len           # the smallest draft cache to allocate (0: what the request can use)
        self.reuse = reuse
        # priors for adaptive k (LLM.policy reads them): a measured tau never below the layer fraction (a
        # micro-benchmark under load can read 0.05 for 11 of 30 layers), a measured alpha, else optimism
        self.tau_prior = max(early_exit_tau(exit_layer, n), tau or 0.0)
        self.prior_alpha = AdaptiveK.prior_alpha if alpha is None else alpha
        self.reused = 0                  # verifications that reused the draft's layer-<L work
        self.reset()

    def reset(self) -> None:
        self.cache: KVCache | None = None
        self.shared = False              # self.cache is a view of the target's (`_catch_up`)
        self.fed: list[int] = []         # tokens whose layer-<L KV is in self.cache
        self._pending = None             # (start, inputs, hidden rows) of the last proposal, for verify_forward

    def _new_cache(self, length: int) -> KVCache:
        cfg = self.model.cfg
        return KVCache(self.exit_layer, 1, cfg.num_kv_heads, length, cfg.head_dim, self.model.kv_dtype)

    def _step(self, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed tokens through layers < L: (logits after the last one [V], its layer-(L-1) output [1, 1, D])."""
        out = self.model(torch.tensor([tokens]), self.cache, exit_layer=self.exit_layer,
                         hidden_layers=(self.exit_layer - 1,), last_only=True)
        self.fed.extend(tokens)
        return out.logits[0, -1], out.hidden[self.exit_layer - 1][:, -1:]

    def _catch_up(self, tokens: list[int], slots: int,
                  target: KVCache | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Bring the cache to tokens[:-1] and feed the last token. With the target's cache (`Context.target_cache`,
        holding tokens[:-1]) the draft shares its layers < L: nothing to prefill or catch up, ever. Else its own
        cache, synced by common prefix (`slots`: what the request can use, `cache_slots`)."""
        if target is not None and target.length == len(tokens) - 1 and target.batch == 1:
            if not self.shared or self.cache.k[0] is not target.k[0]:
                self.cache, self.shared = target.first_layers(self.exit_layer), True
            self.cache.length = len(tokens) - 1
            self.fed = list(tokens[:-1])
            return self._step(tokens[-1:])
        if self.cache is None or self.shared:
            self.cache, self.shared = self._new_cache(max(self.max_len, slots)), False
            self.fed = []
        self.cache.grow(slots)
        new = tokens[sync_prefix(self.cache, self.fed, tokens):]
        if len(new) > ROW_EXACT_MAX:  # a prefill: as the target's (all but the last token), then the last alone
            self.model.prefill(new[:-1], self.cache, exit_layer=self.exit_layer)
            self.fed.extend(new[:-1])
            new = new[-1:]
        return self._step(new)

    def propose(self, ctx: Context, k: int) -> Draft:
        self._pending = None
        if k <= 0:
            return Draft.empty()
        logits, h = self._catch_up(ctx.tokens, cache_slots(ctx, k), ctx.target_cache)
        tokens, qs, hidden = [], [], [h]
        for i in range(k):
            if ctx.sampling.greedy:
                t = int(argmax(logits))
            else:
                q = probs_from_logits(logits, ctx.sampling)  # [V]
                t = int(sample(q, ctx.generator))
                qs.append(q)
            tokens.append(t)
            if i + 1 < k:
                logits, h = self._step([t])
                hidden.append(h)
        self._pending = (len(ctx.tokens) - 1, [ctx.tokens[-1]] + tokens, hidden)
        return Draft.chain(tokens, torch.stack(qs) if qs else None)

    # --- LayerSkip's KV reuse ---------------------------------------------------------------------------
    def verify_forward(self, model: Transformer, cache: KVCache, inputs: torch.Tensor) -> ForwardOutput | None:
        """The target's verification forward over `inputs` ([1, n+1]: the last committed token + this
        round's draft), reusing this drafter's layer-<L work; None when it does not apply (reuse off,
        another model, or inputs/cache that are not the ones the last proposal was made for), in which
        case the caller runs the plain forward. Consumes the proposal either way."""
        pending, self._pending = self._pending, None
        if not self.reuse or pending is None or model is not self.model or inputs.shape[0] != 1:
            return None
        start, expected, hidden = pending
        if cache.length != start or inputs[0].tolist() != expected:
            return None
        m = len(hidden)  # positions start .. start+m-1 were fed to the draft; the last draft token was not
        L = self.exit_layer
        if self.cache is None or self.cache.length < start + m or self.fed[start:start + m] != expected[:m]:
            return None
        for i in range(L if self.cache.k[0] is not cache.k[0] else 0):  # a shared cache holds them already
            cache.k[i][:, :, start:start + m] = self.cache.k[i][:, :, start:start + m]
            cache.v[i][:, :, start:start + m] = self.cache.v[i][:, :, start:start + m]
        self.reused += 1
        return forward_from_layer(model, cache, torch.cat(hidden, dim=1), inputs[:, m:], L)


def build_early_exit(llm, exit_layer: int | str = "auto", progress=None, **kwargs) -> EarlyExit:
    """The EarlyExit drafter for a `specdec.LLM`. exit_layer "auto": the best layer measured by
    `specdec exit-layers` (cached per model and dtype; measured now when missing, which takes minutes on
    a CPU: `progress(str)` hears about it); an integer: that layer. tau_prior and prior_alpha are the
    measured draft cost and acceptance when a measurement covers the layer. kwargs go to EarlyExit
    (max_len, reuse)."""
    from specdec.exit_layers import best_exit_layer, cached_report

    if exit_layer == "auto":
        exit_layer, report = best_exit_layer(llm, progress=progress)
    elif isinstance(exit_layer, str) and exit_layer.isdigit():
        exit_layer, report = int(exit_layer), cached_report(llm)
    else:
        report = cached_report(llm)
    row = report.row(exit_layer) if report else None
    return EarlyExit(llm.model, exit_layer, tau=row.tau if row else None, alpha=row.alpha if row else None,
                     **kwargs)
