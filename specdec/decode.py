"""THE decoding loop, for one request, as a generator of text chunks.

Plain decoding is the loop with no drafter: each target forward yields one token. Every
committed token passes through `Stopper`, one at a time, so EOS, stop strings and the
token limit end generation at exactly the same token whichever way tokens were produced.

    for chunk in decode(model, tokenizer, prompt_ids, Request(max_new_tokens=32)):
        print(chunk.text, end="")          # streamed text
    chunk.result                           # on the last chunk: a Result (text, speed, counters)
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Iterator

import torch

from specdec.errors import SpecdecError
from specdec.runtime.model import Transformer
from specdec.sampling import SamplingParams, make_generator, probs_from_logits, sample
from specdec.tokenizer import Tokenizer


@dataclass(frozen=True)
class Request:
    max_new_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()

    def __post_init__(self):
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")


@dataclass
class Result:
    text: str
    prompt_tokens: int
    new_tokens: int
    seconds: float
    tokens_per_s: float
    target_forwards: int
    mean_accepted: float        # new tokens per target forward (1.0 for plain decoding)
    finish_reason: str          # "stop" (EOS or a stop string) or "length"
    prefill_seconds: float
    token_ids: list[int] = field(repr=False, default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Chunk:
    text: str                   # newly committed text (may be empty)
    tokens: list[int]           # tokens committed by this step
    result: Result | None = None  # set on the final chunk only


class Stopper:
    """Commits tokens one by one and decides when generation ends: EOS (not part of the text),
    a stop string (the text is cut before it), or max_new_tokens."""

    def __init__(self, tokenizer: Tokenizer, request: Request):
        self.tok, self.request = tokenizer, request
        self.ids: list[int] = []
        self.text = ""
        self.emitted = 0
        self.finish_reason: str | None = None
        self.holdback = max((len(s) for s in request.stop), default=1) - 1

    def push(self, token: int) -> bool:
        """Commit one token; True when generation is finished."""
        if self.finish_reason:
            raise RuntimeError("push after finish")
        if token in self.tok.eos_ids:
            self.ids.append(token)
            self.finish_reason = "stop"
            return True
        self.ids.append(token)
        self.text = self.tok.decode(self.ids)
        for s in self.request.stop:
            at = self.text.find(s, max(0, self.emitted - len(s)))
            if at >= 0:
                self.text = self.text[:at]
                self.finish_reason = "stop"
                return True
        if len(self.ids) >= self.request.max_new_tokens:
            self.finish_reason = "length"
        return self.finish_reason is not None

    def new_text(self) -> str:
        """Text that is safe to show now: not a possible stop-string prefix, not a partial UTF-8 character."""
        end = len(self.text) if self.finish_reason else len(self.text) - self.holdback
        while end > self.emitted and self.text[end - 1] == "\ufffd" and not self.finish_reason:
            end -= 1
        if end <= self.emitted:
            return ""
        out, self.emitted = self.text[self.emitted:end], end
        return out


def check_context(model: Transformer, prompt_len: int, max_new_tokens: int) -> None:
    limit = model.cfg.max_position_embeddings
    if prompt_len + max_new_tokens > limit:
        raise SpecdecError(
            f"prompt ({prompt_len} tokens) + max new tokens ({max_new_tokens}) exceed the model's context "
            f"of {limit} tokens: shorten the prompt or lower --max-new-tokens")


def next_token(logits: torch.Tensor, sampling: SamplingParams, gen: torch.Generator) -> int:
    """One token from the last row of logits [V]: argmax when greedy, else a draw from p."""
    if sampling.greedy:
        return int(logits.argmax())
    return int(sample(probs_from_logits(logits, sampling), gen))


def decode(model: Transformer, tokenizer: Tokenizer, prompt_ids: list[int], request: Request) -> Iterator[Chunk]:
    """Plain decoding: prefill, then one target forward per token."""
    if not prompt_ids:
        raise SpecdecError("the prompt is empty")
    check_context(model, len(prompt_ids), request.max_new_tokens)
    gen = make_generator(request.sampling.seed)
    stopper = Stopper(tokenizer, request)
    t0 = time.perf_counter()
    cache = model.new_cache(len(prompt_ids) + request.max_new_tokens + 1)
    logits = model(torch.tensor([prompt_ids]), cache, last_only=True).logits[0, -1]
    prefill = time.perf_counter() - t0
    forwards = 1
    while True:
        token = next_token(logits, request.sampling, gen)
        done = stopper.push(token)
        if done:
            break
        yield Chunk(stopper.new_text(), [token])
        logits = model(torch.tensor([[token]]), cache).logits[0, -1]
        forwards += 1
    seconds = time.perf_counter() - t0
    n = len(stopper.ids)
    result = Result(text=stopper.text, prompt_tokens=len(prompt_ids), new_tokens=n, seconds=seconds,
                    tokens_per_s=n / seconds, target_forwards=forwards, mean_accepted=n / forwards,
                    finish_reason=stopper.finish_reason, prefill_seconds=prefill, token_ids=stopper.ids)
    yield Chunk(stopper.new_text(), [token], result)
