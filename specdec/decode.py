"""THE decoding loop, for one request, as a generator of text chunks (DESIGN.md, "one loop"):

    draft  = drafter.propose(context, k)          # a Draft: tokens, parents, q (None = deterministic)
    logits = target([last] + draft.tokens)         # ONE target pass over all candidate positions
    result = verify(draft, p(logits))              # accepted tokens + one recovered or bonus token
    cache.rewind(rejected)                         # rollback is bookkeeping
    drafter.observe(...); policy.observe(...)       # feedback: pools, adaptive k, acceptance stats

Plain decoding is the same loop with no drafter (k = 0): one token per target forward.
A draft may carry aux positions (lookahead's Jacobi window, `Draft.aux`): they ride in the same
forward under `forward_layout`'s mask, their logits go back to the drafter, their KV is dropped.
Every committed token passes through `Stopper`, one at a time, so EOS, stop strings and the
token limit inside an accepted block end generation at exactly the token plain decoding would.

    for chunk in decode(model, tokenizer, prompt_ids, Request(max_new_tokens=32), drafter, AdaptiveK()):
        print(chunk.text, end="")          # streamed text
    chunk.result                           # on the last chunk: a Result (text, speed, counters)
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Iterator

import torch

from specdec.adaptive import FixedK, choose_k
from specdec.draft import Draft
from specdec.drafters.base import Context, Drafter
from specdec.errors import SpecdecError
from specdec.round import commit, feedback, layout, settle
from specdec.runtime.model import Transformer
from specdec.sampling import Draws, SamplingParams, make_generator, probs_from_logits
from specdec.tokenizer import Tokenizer
from specdec.verify import TYPICAL_DELTA, TYPICAL_EPSILON, verify


@dataclass(frozen=True)
class Request:
    max_new_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    acceptance: str = "exact"   # sampling verification: "exact" (lossless) or "typical" (Medusa's, LOSSY)
    posterior_threshold: float = TYPICAL_EPSILON  # typical acceptance's epsilon
    posterior_alpha: float = TYPICAL_DELTA        # typical acceptance's delta

    def __post_init__(self):
        if self.acceptance not in ("exact", "typical"):
            raise ValueError(f"acceptance must be 'exact' or 'typical', got {self.acceptance!r}")
        n = self.max_new_tokens
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        e, d = self.posterior_threshold, self.posterior_alpha
        if not (_real(e) and 0 < e <= 1) or not (_real(d) and 0 < d < math.inf):
            raise ValueError(f"typical acceptance needs posterior_threshold (epsilon) in (0, 1] and posterior_alpha "
                             f"(delta) > 0, got {e!r}, {d!r}")


def _real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass
class Result:
    """One request's outcome. Acceptance is counted by depth, so chains and trees read alike: a round
    drafting a tree of 9 nodes, 3 deep, whose verified path keeps 2 tokens adds 9 to `drafted`, 2 to
    `accepted` and 3 to the drafted depth; `acceptance_rate` = accepted / drafted depth (2/3 here) and
    `accepted_per_position[i]` is the share of rounds reaching depth i+1 whose token there was accepted.
    These are the verifier's counts, what the drafter earned: a stop string or EOS that ends the text inside
    an accepted block drops its tail from the text and `new_tokens` but not from `accepted` (so `accepted` can
    exceed `new_tokens`, e.g. 4 accepted, 1 of them kept, 3 new tokens); each Chunk's `accepted` counts
    only its committed tokens."""

    text: str
    prompt_tokens: int
    new_tokens: int
    seconds: float
    tokens_per_s: float
    target_forwards: int
    mean_accepted: float        # new tokens per target forward (1.0 for plain decoding)
    finish_reason: str          # "stop" (EOS or a stop string) or "length"
    prefill_seconds: float
    acceptance_rate: float      # accepted / drafted depth (0 when nothing was drafted); chains: accepted / drafted
    accepted_per_position: list[float]  # P(the draft's depth-i token accepted | depth i reached), i = 1, 2, ...
    drafted: int                # draft tokens verified (a tree counts every node)
    accepted: int               # draft tokens accepted (one path: at most the draft's depth per round)
    draft_seconds: float
    target_seconds: float
    rounds: list[dict] = field(repr=False, default_factory=list)  # per round: drafted, depth, accepted, kind, seconds
    token_ids: list[int] = field(repr=False, default_factory=list)
    distribution_exact: bool = True  # False under typical acceptance with sampling and a drafter: not distributed as p

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Chunk:
    text: str                   # newly committed text (may be empty)
    tokens: list[int]           # tokens committed by this round
    accepted: int = 0           # how many of them were accepted draft tokens (the rest: recovered/bonus)
    kind: str = "plain"         # the round's last token: "plain" (no draft), "recovered" or "bonus"
    result: Result | None = None  # set on the final chunk only


DETOKENIZE_WINDOW = 4  # tokens decoded before the new ones, for context (`Stopper._decoded`)


class Stopper:
    """Commits tokens one by one and decides when generation ends: EOS (not part of the text),
    a stop string (the text is cut before it), or max_new_tokens.

    Its text is the tokenizer's decode of the tokens so far, kept up to date without decoding all of them
    at every token (a whole decode costs ~0.4 us a token: 3 ms a token at 8000 tokens; `_decoded`)."""

    def __init__(self, tokenizer: Tokenizer, request: Request):
        self.tok, self.request = tokenizer, request
        self.ids: list[int] = []
        self.text = ""
        self.emitted = 0
        self.finish_reason: str | None = None
        self.holdback = max((len(s) for s in request.stop), default=1) - 1
        self.cleans_up = getattr(tokenizer, "cleans_up_spaces", False)
        self._at, self._head, self._context = 0, "", ""  # ids[:_at] decode to _head (whole characters)
        self._whole = False  # the increments once missed a whole decode: decode everything from then on

    def _decoded(self) -> str:
        """decode(ids) from the tokens after `_at` only (vLLM's incremental detokenization): decode them with
        DETOKENIZE_WINDOW tokens before them and drop the text those give alone (a tokenizer may drop a
        leading space, or cut a character, at the start of what it decodes). `_at` moves up whenever the text
        ends on a whole character. At every power-of-two length the result is checked against a whole decode;
        a tokenizer whose pieces do not add up is then decoded whole. Example (byte tokens, "aé" then "b"):
        ids [a, é0, é1] decode to "aé" (_at = 3); pushing b decodes [a, é0, é1, b] = "aéb" minus "aé" = "b"."""
        ids, n = self.ids, len(self.ids)
        if self._whole:
            return self.tok.decode(ids)
        window = self.tok.decode(ids[max(0, self._at - DETOKENIZE_WINDOW):])
        text = self._head + window[len(self._context):] if window.startswith(self._context) else None
        if text is None or n & (n - 1) == 0:
            whole = self.tok.decode(ids)
            self._whole, text = text != whole, whole
        if not text.endswith("\ufffd"):
            self._at, self._head = n, text
            self._context = self.tok.decode(ids[max(0, n - DETOKENIZE_WINDOW):])
        return text

    def push(self, token: int) -> bool:
        """Commit one token; True when generation is finished."""
        if self.finish_reason:
            raise RuntimeError("push after finish")
        self.ids.append(token)
        eos = token in self.tok.eos_ids
        final = eos or len(self.ids) >= self.request.max_new_tokens
        if final:  # a whole decode once: the final text is exactly the tokenizer's
            self.text = self.tok.decode(self.ids[:-1] if eos else self.ids)  # EOS is not part of the text
        else:
            self.text = self._decoded()
        # U+FFFD at the end may be a character still half-decoded: until the text is final, stop strings
        # see only its complete characters (so a stop string containing U+FFFD matches only a real one)
        seen = self.text if final else self.text.rstrip("\ufffd")
        # several stop strings may complete at one token: cut before the earliest, whatever their order
        hits = [at for s in self.request.stop if (at := seen.find(s, max(0, self.emitted - len(s)))) >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.finish_reason = "stop"
            return True
        if final:
            self.finish_reason = "stop" if eos else "length"
        return final

    def _settled(self) -> int:
        """Length of the text's start no later token changes: its complete characters, less, for a tokenizer
        that cleans up spaces (transformers' " ." -> ".", " n't" -> "n't": a pattern of at most 4 characters
        whose first, a space, goes), from a space among the last 3 characters on ("I '" + "m" -> "I'm")."""
        text = self.text.rstrip("\ufffd")
        space = text.find(" ", max(0, len(text) - 3)) if self.cleans_up else -1
        return space if space >= 0 else len(text)

    def new_text(self) -> str:
        """Text that is safe to show now: not a possible stop-string prefix, not a partial UTF-8 character.
        The holdback counts from the last complete character: a half-decoded one (U+FFFD for now) holds back
        nothing. Example: stop "🌟🌟", text "🌟" + U+FFFD (the second star's first byte): nothing is shown,
        since the star may start the stop string."""
        end = len(self.text) if self.finish_reason else self._settled() - self.holdback
        if end <= self.emitted:
            return ""
        out, self.emitted = self.text[self.emitted:end], end
        return out


def check_context(model: Transformer, prompt_len: int, max_new_tokens: int) -> None:
    limit = model.cfg.max_position_embeddings
    if prompt_len + max_new_tokens > limit:
        raise SpecdecError(
            f"prompt ({prompt_len} tokens) + max new tokens ({max_new_tokens}) exceed the model's context "
            f"of {limit} tokens: shorten the prompt or lower max_new_tokens (--max-new-tokens)")


def target_probs(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """Rows of p the verifier needs; greedy verification reads argmaxes, so logits serve as they are."""
    return logits if sampling.greedy else probs_from_logits(logits, sampling)


def decode(model: Transformer, tokenizer: Tokenizer, prompt_ids: list[int], request: Request,
           drafter: Drafter | None = None, policy=None) -> Iterator[Chunk]:
    """Generate for one request. `drafter` None is plain decoding; `policy` chooses k each round
    (`specdec.adaptive.AdaptiveK`, or `FixedK(k)`; default FixedK(4) when a drafter is given).
    An empty prompt or one that leaves no room for max_new_tokens raises here, before the first chunk."""
    if not prompt_ids:
        raise SpecdecError("the prompt is empty")
    check_context(model, len(prompt_ids), request.max_new_tokens)
    return _rounds(model, tokenizer, prompt_ids, request, drafter, policy)


def _rounds(model: Transformer, tokenizer: Tokenizer, prompt_ids: list[int], request: Request,
            drafter: Drafter | None, policy) -> Iterator[Chunk]:
    sampling = request.sampling
    policy = policy or FixedK(4 if drafter else 0)
    mode = "greedy" if sampling.greedy else request.acceptance
    typical = dict(typical_epsilon=request.posterior_threshold, typical_delta=request.posterior_alpha)
    feature_layers = tuple(getattr(drafter, "wants_hidden_layers", ()))  # EAGLE reads Context.features
    hidden_layers = ((-1,) if getattr(drafter, "wants_hidden", False) else ()) + feature_layers  # Medusa: .hidden
    gen, draws = make_generator(sampling.seed), Draws.seeded(sampling.seed)  # drafters' samples; the target's
    stopper = Stopper(tokenizer, request)
    if drafter:
        drafter.reset()
    # drafts are never deeper than the tokens left (k <= remaining - 1): a huge k costs no memory
    k_most = min(getattr(policy, "k_max", getattr(policy, "k", 0)), request.max_new_tokens - 1)
    room = drafter.room(k_most) if drafter else 0
    t0 = time.perf_counter()
    cache = model.new_cache(len(prompt_ids) + request.max_new_tokens + room + 1)
    pre = model.prefill(prompt_ids[:-1], cache, hidden_layers)
    prefill = time.perf_counter() - t0
    ctx = Context(tokens=list(prompt_ids), prompt_len=len(prompt_ids), sampling=sampling, generator=gen,
                  target_cache=cache, hidden=pre.hidden[-1][0, -1] if pre is not None and -1 in hidden_layers else None)
    if feature_layers and pre is not None:  # every prompt position but the last (the first round's root)
        ctx.add_features(pre.hidden, feature_layers, slice(None))
    forwards, draft_s, target_s, rounds = 0, 0.0, 0.0, []
    done = False
    while not done:
        ctx.remaining = request.max_new_tokens - len(stopper.ids)
        k = min(choose_k(policy, drafter, ctx), ctx.remaining - 1) if drafter else 0
        td = time.perf_counter()
        draft = drafter.propose(ctx, k) if k > 0 else Draft.empty()
        if draft.depth > max(k, 0):
            raise RuntimeError(f"{drafter.name} proposed a draft {draft.depth} tokens deep for k = {k}")
        tv = time.perf_counter()
        n, m = len(draft), len(draft.aux) if draft.aux is not None else 0
        extra = draft.aux.tokens.tolist() if m else []
        inputs = torch.tensor([[ctx.tokens[-1]] + draft.tokens.tolist() + extra])
        positions = mask = None
        offsets, local = layout(draft)
        simple = offsets is None  # a chain alone: default positions and causal mask
        if not simple:  # a tree and/or aux positions: each sees the cache, the root and what its layout allows
            start = cache.length
            positions = (start + offsets)[None]
            mask = torch.ones(1, 1 + n + m, start + 1 + n + m, dtype=torch.bool)
            mask[0, :, start:] = local
        out = None
        if n and simple and hasattr(drafter, "verify_forward") and not feature_layers:  # LayerSkip: reuse draft work
            out = drafter.verify_forward(model, cache, inputs)
        out = out or model(inputs, cache, positions=positions, mask=mask, hidden_layers=hidden_layers)
        logits = out.logits[0]  # [1+n+m, V]
        forwards += 1
        result = verify(draft, target_probs(logits[:1 + n], sampling), draws, mode, position=len(ctx.tokens),
                        validate=False, **typical)
        if hidden_layers:  # the last accepted position's hidden state: the next round drafts from it
            last = out.hidden.get(-1)
            ctx.hidden = None if last is None else last[0, result.path[-1] + 1 if result.path else 0]
        if feature_layers:  # the committed positions' features: the root's and the accepted path's
            ctx.add_features(out.hidden, feature_layers, [0] + [i + 1 for i in result.path])
        settle(cache, draft, result)
        t1 = time.perf_counter()
        draft_s += tv - td
        target_s += t1 - tv
        emitted = result.tokens.tolist()
        committed, done = commit(stopper, emitted)
        ctx.tokens.extend(emitted)
        if drafter:
            feedback(drafter, policy, draft, result, emitted, logits, tv - td, t1 - tv)
        if not n and not m and len(prompt_ids) > 1:  # a plain step prices prefill work in steps (Drafter.startup)
            ctx.prefill_cost = prefill / (len(prompt_ids) - 1) / (t1 - tv)
        if drafter and not n and not m:  # the step verify rounds and draft time are priced in (plain_timing)
            for measured in (policy, drafter):
                if hasattr(measured, "plain_timing"):
                    measured.plain_timing(t1 - tv)
        rounds.append(dict(drafted=n, depth=draft.depth, accepted=result.num_accepted, kind=result.kind if n else "plain",
                           committed=len(committed), draft_s=tv - td, target_s=t1 - tv, t=t1 - t0))
        accepted_here = min(result.num_accepted, len(committed))
        kind = result.kind if n else "plain"
        if not done:
            yield Chunk(stopper.new_text(), committed, accepted_here, kind)
    seconds = time.perf_counter() - t0
    final = summarize(stopper, len(prompt_ids), seconds, prefill, forwards, draft_s, target_s, rounds)
    final.distribution_exact = not (mode == "typical" and drafter is not None)  # plain decoding: no draft to loosen
    yield Chunk(stopper.new_text(), committed, accepted_here, kind, final)


def summarize(stopper: Stopper, prompt_len: int, seconds: float, prefill: float, forwards: int,
              draft_s: float, target_s: float, rounds: list[dict]) -> Result:
    n = len(stopper.ids)
    drafted = sum(r["drafted"] for r in rounds)
    depth = sum(r["depth"] for r in rounds)
    accepted = sum(r["accepted"] for r in rounds)
    per_pos = []  # by depth: a tree's siblings are alternatives for one position, not positions of their own
    for i in range(max((r["depth"] for r in rounds), default=0)):
        reached = [r for r in rounds if r["depth"] > i and r["accepted"] >= i]
        per_pos.append(sum(r["accepted"] > i for r in reached) / len(reached) if reached else 0.0)
    return Result(text=stopper.text, prompt_tokens=prompt_len, new_tokens=n, seconds=seconds,
                  tokens_per_s=n / seconds, target_forwards=forwards, mean_accepted=n / max(forwards, 1),
                  finish_reason=stopper.finish_reason, prefill_seconds=prefill,
                  acceptance_rate=accepted / depth if depth else 0.0, accepted_per_position=per_pos,
                  drafted=drafted, accepted=accepted, draft_seconds=draft_s, target_seconds=target_s,
                  rounds=rounds, token_ids=stopper.ids)
