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
torch.searchsorted). A request's uniforms are `Draws`: each a fixed function of the request's
seed, the position of the token it draws and a stream number, not of how many were drawn before.
So plain decoding samples position t as the inverse CDF of p_t at u(t), and verification of a
deterministic draft (`specdec.verify`) draws the same u(t): the same seed gives the same tokens
with or without speculation, whatever k a round was granted and whatever was drafted.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from specdec.runtime.kernels import ops

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
    top = x.amax(-1, keepdim=True)  # NaN where a row has one: a finite top leaves every row a distribution
    if not bool(torch.isfinite(top).all()):  # (the filters below keep each row's top token)
        raise ValueError("logits give no valid distribution (NaN, +inf, or a row that is all -inf)")
    x = (x - top) / t
    vocab = x.shape[-1]
    if 0 < params.top_k < vocab:
        kth = ops.kth_largest(x, params.top_k)  # [..., 1]
        x = x.masked_fill(x < kth, -math.inf)
    if params.top_p < 1.0:
        x = _nucleus(x, params.top_p)
    if params.min_p > 0.0:
        probs = torch.softmax(x, dim=-1)
        floor = probs.amax(-1, keepdim=True) * params.min_p
        x = x.masked_fill(probs < floor, -math.inf)
    return torch.softmax(x, dim=-1)


_MASK = (1 << 64) - 1


def _mix(z: int) -> int:
    """SplitMix64's finalizer (Steele, Lea and Flood 2014): a bijection on 64-bit integers that spreads
    every input bit over the output."""
    z = (z + 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


class Draws:
    """A request's uniforms on [0, 1), one per (position, stream), a fixed function of the seed (counter-based,
    as Philox or JAX's keys): u = mix(mix(mix(seed) + position) + stream), its top 53 bits. Stream 0 is the
    target's own draw at a position (plain sampling's, and the one a deterministic draft is checked against);
    rejection sampling's accept tests and residual draws take other streams.

    Example: Draws(7).uniform(12) is the same number in every run, in plain decoding and in a speculative
    round whose root sits at position 10 and whose third row draws position 12."""

    RESIDUAL = 1 << 20  # the stream of a residual draw (accept tests take 1 + the sibling's index)

    def __init__(self, seed: int):
        self.key = _mix(seed & _MASK)

    @classmethod
    def of(cls, source: "Draws | torch.Generator | None") -> "Draws":
        """`source` itself, or fresh draws seeded from a torch generator (None: torch's global one), one 64-bit
        draw from it per call, so successive calls are independent."""
        if isinstance(source, Draws):
            return source
        bits = torch.randint(-(1 << 63), (1 << 63) - 1, (), generator=source, dtype=torch.int64)
        return cls(int(bits) & _MASK)

    @classmethod
    def seeded(cls, seed: int | None) -> "Draws":
        """A request's draws: from its seed, or (None) from a fresh random one."""
        return cls(seed if seed is not None else int.from_bytes(os.urandom(8), "little"))

    def uniform(self, position: int, stream: int = 0) -> float:
        return (_mix((_mix((self.key + position) & _MASK) + stream) & _MASK) >> 11) * 2.0 ** -53

    def uniforms(self, start: int, count: int, stream: int = 0) -> torch.Tensor:
        """[count] float64: positions start .. start + count - 1."""
        return torch.tensor([self.uniform(start + i, stream) for i in range(count)], dtype=torch.float64)


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


def sample(probs: torch.Tensor, generator: torch.Generator | None = None,
           u: torch.Tensor | None = None) -> torch.Tensor:
    """Draw one token per row: probs [..., V] -> LongTensor [...], on probs' device.

    Inverse-CDF sampling: one uniform per row (`u` [...] float64 when given, else from `generator`,
    None: torch's global generator), located in the row's float64 cumulative mass: for fp32 rows on the
    CPU by `ops.sample_rows` (0.1 ms a row of 151936 where torch took 1.25), else in torch's cumulative
    sums with torch.searchsorted (~25x faster than torch.multinomial at V = 150k). Exact up to float64
    rounding. Rows need not be normalized but must be non-negative with positive, finite mass."""
    if not isinstance(probs, torch.Tensor) or not probs.is_floating_point() or probs.dim() == 0:
        raise ValueError("probs must be a floating-point tensor [..., V]")
    vocab = probs.shape[-1]
    if vocab == 0:
        raise ValueError("probs must have a non-empty vocabulary dimension")
    rows = probs.reshape(-1, vocab)
    if u is None:
        u = torch.rand(rows.shape[0], generator=generator, dtype=torch.float64)
    elif u.numel() != rows.shape[0]:
        raise ValueError(f"u must hold one uniform per row of probs ({rows.shape[0]}), got {u.numel()}")
    drawn = ops.sample_rows(rows, u.reshape(-1))
    if drawn is not None:
        if bool((drawn < 0).any()):
            raise ValueError("probs is not a valid distribution: entries must be finite and >= 0 "
                             "with positive mass in every row")
        return drawn.view(probs.shape[:-1])
    cdf = probs.double().cumsum(-1)  # [..., V]
    total = cdf[..., -1:]  # [..., 1]
    lowest, smallest, largest = torch.stack([probs.amin().double(), total.min(), total.max()]).tolist()
    if not (lowest >= 0 and smallest > 0 and math.isfinite(largest)):
        raise ValueError("probs is not a valid distribution: entries must be finite and >= 0 "
                         "with positive mass in every row")
    u = u.reshape(total.shape)
    # first index whose cumulative mass exceeds u * total: zero-probability tokens never win
    idx = torch.searchsorted(cdf, u.to(cdf.device) * total, right=True).squeeze(-1)
    if bool((idx >= vocab).any()):  # u * total rounded up to total: take the last positive token
        last = (probs > 0).long().cumsum(-1).argmax(-1)
        idx = torch.where(idx >= vocab, last, idx)
    return idx


def _nucleus(x: torch.Tensor, top_p: float) -> torch.Tensor:
    """Mask all but the smallest set of tokens whose probability reaches top_p (plus any
    tokens tied with the last one kept). Looks at the top 64 first, widening 16 times while the
    nucleus is wider, up to the full sort: the 1.5B's nuclei at top-p 0.95 and T 1 held 2 tokens
    (median) and 29 at most over 97 positions of an answer, and torch's top 64 of 151936 takes
    0.27 ms where its top 1024 takes 0.71."""
    probs = torch.softmax(x, dim=-1)
    vocab = probs.shape[-1]
    width = min(vocab, 64)
    while True:
        top = torch.topk(probs, width, dim=-1, sorted=True).values  # [..., width]
        cum = top.double().cumsum(-1)
        if width == vocab or bool((cum[..., -1] >= top_p).all()):
            break
        width = min(vocab, 16 * width)
    keep = (cum - top.double()) < top_p  # mass before each sorted token; the top one is always kept
    n_keep = keep.sum(-1, keepdim=True)  # [..., 1]
    threshold = top.gather(-1, n_keep - 1)  # probability of the last token kept
    return x.masked_fill(probs < threshold, -math.inf)
