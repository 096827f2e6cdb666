"""Verification: which drafted tokens the target keeps, plus one token of its own.

One target forward pass gives p [n+1, V]: row 0 is the target's distribution right after
the last committed token (the root), row j+1 its distribution right after draft node j.
A round emits the **accepted** draft tokens followed by one more token: a **recovered**
token at the first rejection, or a **bonus** token when the whole path was accepted.

Modes
-----
exact    Speculative sampling (Leviathan et al. 2023; Chen et al. 2023): accept drafted x
         with probability min(1, p(x)/q(x)); at the first rejection draw the recovered token
         from the residual max(0, p - q), normalized; if all k are accepted draw the bonus
         token from p at position k+1. The emitted tokens are distributed exactly as sampling
         from p. Trees use multi-candidate speculative sampling (SpecInfer, Miao et al. 2024;
         as in EAGLE): siblings are tried in order against the running residual, which stays
         exact when siblings are independent draws from their q rows.
         A deterministic draft (q = None: prompt lookup, recycling, lookahead, Medusa, EAGLE's trees) is
         q one-hot on the drafted token: x is accepted with probability p(x) and the residual is
         p with x removed (distinct siblings: the mass of each in turn). That law is drawn here
         as the target's own sample at each position, the inverse CDF of its row at the
         request's uniform for that position (`sampling.Draws`, stream 0, as plain decoding
         draws it), and the drafted child equal to it is followed, else the sample is the
         recovered token: the same law, and with a seed the same tokens as plain decoding
         whatever k or draft a round had.
greedy   Accept while the draft equals the target's argmax; the extra token is the argmax at
         the first mismatch (or at the bonus position). With a greedy p (one-hot) this gives
         the same tokens as exact mode.
typical  Medusa's typical acceptance (Cai et al. 2024): accept x when
         p(x) > min(epsilon, delta * exp(-H(p))). **Lossy**: the output is no longer
         distributed as p. Opt-in only, never the default. The extra token is drawn from p.

Worked example (the lesson, Ch. 1): p = (0.5, 0.3, 0.2) over A, B, C and a draft
q = (0.4, 0.4, 0.2). A and C are always accepted (min(1, 0.5/0.4) = 1, min(1, 0.2/0.2) = 1),
B with probability 0.3/0.4 = 0.75; the residual max(0, p - q) = (0.1, 0, 0) normalizes to
(1, 0, 0), so a rejected B becomes A. Output: P(A) = 0.4 + 0.4 * 0.25 = 0.5, P(B) = 0.3,
P(C) = 0.2, exactly p; the acceptance rate is sum(min(p, q)) = 0.9.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from specdec.draft import Draft, children, path_to
from specdec.runtime.kernels.ops import argmax  # torch.argmax's indices, faster on CPU logits
from specdec.sampling import Draws, sample

MODES = ("exact", "greedy", "typical")
TYPICAL_EPSILON = 0.09  # Medusa's posterior_threshold
TYPICAL_DELTA = 0.3  # Medusa's posterior_alpha (= sqrt(epsilon))


# --- validation -------------------------------------------------------------------------


def check_distributions(x: torch.Tensor, name: str, *, atol: float = 1e-4) -> None:
    """Raise ValueError naming `name` unless every row of x [..., V] is a distribution:
    non-negative, finite, summing to 1 within atol. Two reductions and one sync: cheap at
    V = 150k."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor of probabilities")
    if x.numel() == 0:
        return
    sums = x.sum(-1, dtype=torch.float64).reshape(-1)
    lowest, worst = torch.stack([x.amin().double(), (sums - 1).abs().max()]).tolist()
    if lowest >= 0 and worst <= atol:  # NaN fails both comparisons, inf fails the second
        return
    if lowest < 0:
        raise ValueError(f"{name} has negative entries (min {lowest:.3g}); rows must be distributions")
    bad = int(((~torch.isfinite(sums)) | ((sums - 1).abs() > atol)).nonzero()[0])
    if not math.isfinite(float(sums[bad])):
        raise ValueError(f"{name} has NaN or infinite entries (row {bad}); rows must be distributions")
    raise ValueError(
        f"{name} row {bad} sums to {float(sums[bad]):.6g}, not 1 (tolerance {atol:g}); "
        f"rows must be distributions"
    )


def _check_chain(p, q, draft_tokens, validate: bool, *, p_name: str = "p") -> torch.Tensor:
    if not isinstance(p, torch.Tensor) or not p.is_floating_point() or p.dim() != 2:
        raise ValueError(f"{p_name} must be a 2-D float tensor [k+1, V]")
    tokens = torch.as_tensor(draft_tokens)
    if tokens.dim() != 1 or (tokens.numel() and tokens.is_floating_point()):
        raise ValueError(f"draft_tokens must be a 1-D integer tensor [k], got shape {tuple(tokens.shape)}")
    tokens = tokens.to(torch.long).cpu()
    k, vocab = tokens.numel(), p.shape[1]
    if p.shape[0] != k + 1:
        raise ValueError(f"{p_name} must have k+1 = {k + 1} rows for {k} draft tokens, got {p.shape[0]}")
    if q is not None:
        if not isinstance(q, torch.Tensor) or not q.is_floating_point() or tuple(q.shape) != (k, vocab):
            shape = tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__
            raise ValueError(f"q must be a float tensor [k, V] = [{k}, {vocab}] or None, got {shape}")
    ids = tokens.tolist()
    if ids and (min(ids) < 0 or max(ids) >= vocab):
        raise ValueError(f"draft_tokens must be token ids in [0, {vocab})")
    if validate:
        check_distributions(p, p_name)
        if q is not None:
            check_distributions(q, "q")
    return tokens


# --- the exact primitive ----------------------------------------------------------------


def acceptance_probability(p_x: float, q_x: float | None = None) -> float:
    """min(1, p(x)/q(x)) for a drafted token x. q_x None (deterministic draft: q one-hot on x)
    gives min(1, p(x)). q(x) = 0 (a token the draft could not have drawn) accepts iff p(x) > 0."""
    p_x = float(p_x)
    if q_x is None:
        return min(1.0, p_x)
    q_x = float(q_x)
    if q_x > 0:
        return min(1.0, p_x / q_x)
    return 1.0 if p_x > 0 else 0.0


def residual_distribution(p_row: torch.Tensor, q_row: torch.Tensor | None, token: int | None = None) -> torch.Tensor:
    """The recovered-token distribution after rejecting `token`: max(0, p - q), normalized.

    q_row None means q is one-hot on `token`: the residual is p with `token` removed. When the
    residual has no mass (p == q up to rounding, so a rejection had probability ~0) p itself is
    returned."""
    if q_row is None:
        if token is None:
            raise ValueError("token is required when q_row is None")
        res = p_row.clone()
        res[token] = 0
    else:
        res = (p_row - q_row.to(p_row.dtype)).clamp(min=0)
    mass = res.sum()
    if not float(mass) > 0:
        return p_row
    return res / mass


def rejection_sample(
    p: torch.Tensor,
    q: torch.Tensor | None,
    draft_tokens: torch.Tensor,
    generator: Draws | torch.Generator | None = None,
    *,
    position: int = 0,
    validate: bool = True,
) -> tuple[int, torch.Tensor]:
    """Verify a drafted chain by speculative sampling; exact for any p and q.

    p [k+1, V] target probabilities, q [k, V] draft probabilities (None: deterministic draft,
    q one-hot on the drafted token), draft_tokens [k]. Returns (num_accepted, tokens) where
    tokens (LongTensor [num_accepted + 1], on the CPU) are the accepted draft tokens followed by
    one recovered token (residual at the first rejection) or one bonus token (from p[k]).
    `generator`: the request's Draws, row j drawing position `position` + j; a torch generator
    (None: torch's global one) seeds fresh Draws per call."""
    tokens = _check_chain(p, q, draft_tokens, validate)
    draws, k = Draws.of(generator), tokens.numel()
    if q is None:  # the target's own draws, kept while the draft matches them (module docstring)
        drawn = sample(p, u=draws.uniforms(position, k + 1)).cpu()
        miss = (drawn[:k] != tokens).nonzero()
        n = int(miss[0]) if miss.numel() else k
        return n, torch.cat([tokens[:n], drawn[n:n + 1]])
    n = 0
    if k:
        rows = torch.arange(k, device=p.device)
        on_dev = tokens.to(p.device)
        p_x, q_x = p[rows, on_dev].tolist(), q[rows, on_dev].tolist()
        while n < k and draws.uniform(position + n, 1) < acceptance_probability(p_x[n], q_x[n]):
            n += 1
    if n < k:
        residual = residual_distribution(p[n], q[n], int(tokens[n]))
        last = sample(residual, u=draws.uniforms(position + n, 1, Draws.RESIDUAL))
    else:
        last = sample(p[k], u=draws.uniforms(position + k, 1))
    return n, torch.cat([tokens[:n], last.cpu().view(1)])


def outcome_distribution(p: torch.Tensor, q: torch.Tensor | None, draft_tokens) -> list[tuple[float, torch.Tensor]]:
    """The exact law of `rejection_sample` for one drafted chain, built from the same pieces:
    entry j (0 <= j <= k) is (P(exactly j accepted), distribution of the token emitted after
    them). Used by the enumeration tests; also handy for computing expected tokens exactly."""
    tokens = _check_chain(p, q, draft_tokens, validate=False)
    k = tokens.numel()
    out, reach = [], 1.0
    for j in range(k):
        x = int(tokens[j])
        a = acceptance_probability(p[j, x], None if q is None else q[j, x])
        out.append((reach * (1.0 - a), residual_distribution(p[j], None if q is None else q[j], int(tokens[j]))))
        reach *= a
    out.append((reach, p[k]))
    return out


# --- greedy and typical -----------------------------------------------------------------


def greedy_verify(p_or_logits: torch.Tensor, draft_tokens: torch.Tensor) -> tuple[int, torch.Tensor]:
    """Accept while draft_tokens[i] == argmax(p_or_logits[i]); then emit the argmax at the
    first mismatch (or at position k, the bonus). Works on probabilities or logits [k+1, V]."""
    ids = _check_chain(p_or_logits, None, draft_tokens, validate=False, p_name="p_or_logits").tolist()
    top = argmax(p_or_logits).tolist()  # [k+1]; compared as lists: few small torch calls after a forward
    n = next((i for i, (x, best) in enumerate(zip(ids, top)) if x != best), len(ids))
    return n, torch.tensor(ids[:n] + top[n:n + 1])


def typical_thresholds(p: torch.Tensor, epsilon: float = TYPICAL_EPSILON, delta: float = TYPICAL_DELTA) -> torch.Tensor:
    """Medusa's per-row threshold min(epsilon, delta * exp(-H(p))), H the entropy in nats."""
    if not (0 < epsilon <= 1) or not (delta > 0 and math.isfinite(delta)):
        raise ValueError(f"typical acceptance needs epsilon in (0, 1] and delta > 0, got {epsilon}, {delta}")
    pd = p.double()
    entropy = -torch.special.xlogy(pd, pd).sum(-1)
    return torch.clamp(delta * torch.exp(-entropy), max=epsilon)


def typical_verify(
    p: torch.Tensor,
    draft_tokens: torch.Tensor,
    generator: Draws | torch.Generator | None = None,
    *,
    epsilon: float = TYPICAL_EPSILON,
    delta: float = TYPICAL_DELTA,
    position: int = 0,
    validate: bool = True,
) -> tuple[int, torch.Tensor]:
    """LOSSY typical acceptance on a chain (Medusa): accept draft i while
    p[i](x_i) > min(epsilon, delta * exp(-H(p[i]))); the extra token is drawn from p at the
    stopping row. Faster than exact verification on flat distributions, but the output is not
    distributed as p. Opt-in only."""
    tokens = _check_chain(p, None, draft_tokens, validate)
    k = tokens.numel()
    n = 0
    if k:
        thr = typical_thresholds(p[:k], epsilon, delta).cpu()
        p_x = p[torch.arange(k, device=p.device), tokens.to(p.device)].double().cpu()
        fail = (~(p_x > thr)).nonzero()
        n = int(fail[0]) if fail.numel() else k
    last = sample(p[n], u=Draws.of(generator).uniforms(position + n, 1)).cpu().view(1)
    return n, torch.cat([tokens[:n], last])


# --- the Draft-level entry point ----------------------------------------------------------


@dataclass
class VerifyResult:
    """One round's outcome: accepted draft tokens + one recovered or bonus token."""

    tokens: torch.Tensor  # [num_accepted + 1] every token emitted this round
    num_accepted: int  # accepted draft tokens (the mean accepted length counts num_accepted + 1)
    accepted: list[bool]  # per draft node: on the accepted path?
    kind: str  # kind of the last token: "recovered" (a draft node was rejected) or "bonus"
    path: list[int] = field(default_factory=list)  # accepted draft nodes, root to leaf

    @property
    def num_emitted(self) -> int:
        return self.num_accepted + 1


def verify(
    draft: Draft,
    p: torch.Tensor,
    generator: Draws | torch.Generator | None = None,
    mode: str = "exact",
    *,
    typical_epsilon: float = TYPICAL_EPSILON,
    typical_delta: float = TYPICAL_DELTA,
    position: int = 0,
    validate: bool = True,
) -> VerifyResult:
    """Verify a Draft (chain or tree) against target probabilities p [len(draft)+1, V].

    mode "exact" (default, lossless), "greedy" (argmax rule; p may then be logits, and is not
    checked as a distribution) or "typical" (Medusa, LOSSY). Row 0 of p is the target at the
    root, row j+1 the target right after draft node j. `generator`: the request's Draws with
    `position` the index of the token row 0 draws (the context's length), so the row after a node d
    levels below the root draws position + d; or a torch generator (None: torch's global one) for
    fresh draws.
    validate=False skips the distribution check of p and q (shapes are always checked)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if not isinstance(draft, Draft):
        raise ValueError("draft must be a specdec.draft.Draft")
    q = draft.q if mode == "exact" else None
    draws = None if mode == "greedy" else Draws.of(generator)
    if draft.is_chain:
        if mode == "exact":
            n, tokens = rejection_sample(p, q, draft.tokens, draws, position=position, validate=validate)
        elif mode == "greedy":
            n, tokens = greedy_verify(p, draft.tokens)
        else:
            n, tokens = typical_verify(p, draft.tokens, draws, epsilon=typical_epsilon,
                                       delta=typical_delta, position=position, validate=validate)
        path = list(range(n))
        kind = "bonus" if n == len(draft) else "recovered"
    else:
        _check_tree(draft, p, validate and mode != "greedy")
        if mode == "typical":
            path, last = _typical_tree(draft, p, draws, position, typical_epsilon, typical_delta)
        else:
            path, last = _walk_tree(draft, p, draws, position, mode)
        n = len(path)
        tokens = torch.cat([draft.tokens[path], last.view(1)])
        kids = children(draft.parents)
        kind = "recovered" if kids[(path[-1] if path else -1) + 1] else "bonus"
    on_path = set(path)
    return VerifyResult(tokens, n, [i in on_path for i in range(len(draft))], kind, path)


def _check_tree(draft: Draft, p: torch.Tensor, validate: bool) -> None:
    n = len(draft)
    if not isinstance(p, torch.Tensor) or not p.is_floating_point() or p.dim() != 2 or p.shape[0] != n + 1:
        shape = tuple(p.shape) if isinstance(p, torch.Tensor) else type(p).__name__
        raise ValueError(f"p must be a float tensor [n+1, V] with n = {n} draft nodes, got {shape}")
    vocab = p.shape[1]
    if n and int(draft.tokens.max()) >= vocab:
        raise ValueError(f"draft tokens must be token ids in [0, {vocab})")
    if draft.q is not None and draft.q.shape[1] != vocab:
        raise ValueError(f"q must have shape [{n}, {vocab}] to match p, got {tuple(draft.q.shape)}")
    if validate:
        check_distributions(p, "p")
        if draft.q is not None:
            check_distributions(draft.q, "q")


def _walk_tree(draft: Draft, p: torch.Tensor, draws: Draws | None, position: int,
               mode: str) -> tuple[list[int], torch.Tensor]:
    """Greedy or exact verification of a tree, one level at a time: the child equal to the target's
    argmax (greedy) or own draw (a deterministic draft), or multi-candidate speculative sampling
    against q (module docstring); the row after a node d levels below the root draws position + d."""
    kids = children(draft.parents)
    tokens = draft.tokens.tolist()
    q = draft.q
    node, path = -1, []
    while True:
        cands, row, at = kids[node + 1], p[node + 1], position + len(path)
        if mode == "greedy" or q is None or not cands:
            top = int(argmax(row)) if mode == "greedy" else int(sample(row, u=draws.uniforms(at, 1)))
            chosen = next((c for c in cands if tokens[c] == top), None)
            if chosen is None:
                return path, torch.tensor([top])
        else:
            chosen, cur = None, row
            for i, c in enumerate(cands):
                x = tokens[c]
                if draws.uniform(at, 1 + i) < acceptance_probability(cur[x], q[c][x]):
                    chosen = c
                    break
                cur = residual_distribution(cur, q[c], x)
            if chosen is None:
                return path, sample(cur, u=draws.uniforms(at, 1, Draws.RESIDUAL)).cpu().view(1)
        path.append(chosen)
        node = chosen


def _typical_tree(draft: Draft, p: torch.Tensor, draws: Draws, position: int, epsilon: float,
                  delta: float) -> tuple[list[int], torch.Tensor]:
    """Typical acceptance on a tree (LOSSY): keep the deepest node whose whole path clears the
    threshold (ties: the lowest index), as Medusa picks its best candidate."""
    parents = draft.parents.tolist()
    thr = typical_thresholds(p, epsilon, delta).cpu()
    probs = p[draft.parents.to(p.device) + 1, draft.tokens.to(p.device)].double().cpu()
    ok: list[bool] = []
    depth: list[int] = []
    for i, par in enumerate(parents):
        good = bool(probs[i] > thr[par + 1]) and (par < 0 or ok[par])
        ok.append(good)
        depth.append(0 if par < 0 else depth[par] + 1)
    best = max((i for i in range(len(parents)) if ok[i]), key=lambda i: (depth[i], -i), default=-1)
    path = path_to(draft.parents, best) if best >= 0 else []
    return path, sample(p[best + 1], u=draws.uniforms(position + len(path), 1)).cpu().view(1)
