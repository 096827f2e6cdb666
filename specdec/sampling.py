"""Logits -> the target distribution p, and seeded sampling from it.

"Temperature and top-p sampling ... live entirely inside p(x) itself — they reshape the
target's distribution before rejection sampling ever runs, not after" (the lesson, Ch. 1).
So every sampling setting is applied here, to the logits, and the verifier (specdec.verify)
only ever sees the final p. Rejection sampling against that p is exact (Leviathan et al.
2023; Chen et al. 2023), whatever the settings.

Order of application, on each row of logits [..., V]:

    1. temperature   logits / T           (T = 0 means greedy: p is one-hot on the argmax,
                                           ties broken to the lowest index, like torch.argmax;
                                           computed as (logits - max) / T, which cannot overflow,
                                           so any tiny T > 0 gives its limit: p shared equally by
                                           the tokens tied at the top; T below float32's smallest
                                           normal, 1.2e-38, counts as that)
    2. top-k         keep tokens whose logit >= the k-th largest (ties at the edge are kept)
    3. top-p         nucleus: sort the renormalized probabilities, keep the smallest prefix
                     whose cumulative mass reaches top_p (always at least the top token;
                     tokens tied with the last one kept are kept too)
    4. min-p         drop tokens whose probability is below min_p x the largest probability
    5. renormalize   softmax over the survivors, in float32

Worked example: logits log(0.5, 0.3, 0.15, 0.05), T = 1, top_p = 0.75 keeps {0, 1}
(0.5 < 0.75 <= 0.8) and gives p = (0.625, 0.375, 0, 0); min_p = 0.2 instead drops only the
0.05 token (0.05 < 0.2 x 0.5).

Sampling is inverse-CDF (one uniform per row, located in float64 cumulative sums with
torch.searchsorted) driven by an explicit CPU torch.Generator per request, so the same seed
gives the same tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SEED_MAX = 2**64 - 1  # torch.Generator.manual_seed takes 64-bit seeds
TINY = torch.finfo(torch.float32).tiny  # the smallest temperature used as such (float32 would round T to 0)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How a request samples: temperature 0 is greedy; the filters are off at their defaults."""

    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off, must be in (0, 1]
    min_p: float = 0.0  # 0 = off, in [0, 1]
    seed: int | None = None

    def __post_init__(self) -> None:
        t = self.temperature
        if not _is_real(t) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        p = self.top_p
        if not _is_real(p) or not (0.0 < p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {p!r}")
        m = self.min_p
        if not _is_real(m) or not (0.0 <= m <= 1.0):
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {m!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= SEED_MAX):
            raise ValueError(f"seed must be an integer from 0 to 2**64-1 ({SEED_MAX}) or None, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., V] (any float dtype) -> p [..., V] float32 (see the module docstring).

    Greedy -> one-hot on argmax (ties: lowest index, i.e. torch.argmax). Vectorized over the
    leading dims; no sort unless top_p < 1."""
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise ValueError("logits must be a floating-point tensor [..., V]")
    if logits.dim() == 0 or logits.shape[-1] == 0:
        raise ValueError(f"logits must have a non-empty vocabulary dimension, got shape {tuple(logits.shape)}")
    x = logits.float()
    if params.greedy:
        if bool(torch.isnan(x).any()):
            raise ValueError("logits contain NaN")
        return torch.zeros_like(x).scatter_(-1, x.argmax(-1, keepdim=True), 1.0)

    t = max(params.temperature, TINY)  # <= 0 after the shift: no overflow however small T is
    x = (x - x.amax(-1, keepdim=True)) / t
    vocab = x.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]  # [..., 1]
        x = x.masked_fill(x < kth, -math.inf)
    if params.top_p < 1.0:
        x = _nucleus(x, params.top_p)
    if params.min_p > 0.0:
        probs = torch.softmax(x, dim=-1)
        floor = probs.amax(-1, keepdim=True) * params.min_p
        x = x.masked_fill(probs < floor, -math.inf)
    p = torch.softmax(x, dim=-1)
    if not bool(torch.isfinite(p).all()):
        raise ValueError("logits give no valid distribution (NaN, +inf, or a row that is all -inf)")
    return p


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU generator for one request; seed None draws a fresh random seed."""
    g = torch.Generator(device="cpu")
    if seed is None:
        g.seed()
    else:
        if not _is_int(seed) or not 0 <= seed <= SEED_MAX:
            raise ValueError(f"seed must be an integer from 0 to 2**64-1 ({SEED_MAX}) or None, got {seed!r}")
        g.manual_seed(seed)
    return g


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Draw one token per row: probs [..., V] -> LongTensor [...], on probs' device.

    Inverse-CDF sampling: one uniform per row from `generator` (None: torch's global
    generator), located in the row's float64 cumulative sums with torch.searchsorted. Exact up
    to float64 rounding, and ~25x faster than torch.multinomial on a CPU at V = 150k. Rows need
    not be normalized but must be non-negative with positive, finite mass."""
    if not isinstance(probs, torch.Tensor) or not probs.is_floating_point() or probs.dim() == 0:
        raise ValueError("probs must be a floating-point tensor [..., V]")
    vocab = probs.shape[-1]
    if vocab == 0:
        raise ValueError("probs must have a non-empty vocabulary dimension")
    cdf = probs.double().cumsum(-1)  # [..., V]
    total = cdf[..., -1:]  # [..., 1]
    lowest, smallest, largest = torch.stack([probs.amin().double(), total.min(), total.max()]).tolist()
    if not (lowest >= 0 and smallest > 0 and math.isfinite(largest)):
        raise ValueError("probs is not a valid distribution: entries must be finite and >= 0 "
                         "with positive mass in every row")
    u = torch.rand(total.shape, generator=generator, dtype=torch.float64)
    # first index whose cumulative mass exceeds u * total: zero-probability tokens never win
    idx = torch.searchsorted(cdf, u.to(cdf.device) * total, right=True).squeeze(-1)
    if bool((idx >= vocab).any()):  # u * total rounded up to total: take the last positive token
        last = (probs > 0).long().cumsum(-1).argmax(-1)
        idx = torch.where(idx >= vocab, last, idx)
    return idx


def _nucleus(x: torch.Tensor, top_p: float) -> torch.Tensor:
    """Mask all but the smallest set of tokens whose probability reaches top_p (plus any
    tokens tied with the last one kept). Looks at the top 1024 first; sorts fully only when
    the nucleus is wider than that."""
    probs = torch.softmax(x, dim=-1)
    vocab = probs.shape[-1]
    width = min(vocab, 1024)
    while True:
        top = torch.topk(probs, width, dim=-1, sorted=True).values  # [..., width]
        cum = top.double().cumsum(-1)
        if width == vocab or bool((cum[..., -1] >= top_p).all()):
            break
        width = vocab
    keep = (cum - top.double()) < top_p  # mass before each sorted token; the top one is always kept
    n_keep = keep.sum(-1, keepdim=True)  # [..., 1]
    threshold = top.gather(-1, n_keep - 1)  # probability of the last token kept
    return x.masked_fill(probs < threshold, -math.inf)
