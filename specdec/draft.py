"""A draft is data: candidate tokens, their parents, and (optionally) the draft distribution q.

Every drafting technique in the lesson produces the same thing for the verifier: a set of
candidate tokens arranged as a tree rooted at the last committed token. A chain (draft
model, prompt lookup) is the tree where every node's parent is the node before it; a Medusa
or EAGLE-2 tree has several children per node; lookahead's n-gram guesses are short chains.

    tokens  [n]     the candidate token ids, in topological order (a parent before its children)
    parents [n]     index of each node's parent; -1 means "child of the root" (the last
                    committed token). A chain has parents = [-1, 0, 1, ..., n-2].
    q       [n, V]  the distribution each node's token was drawn from (row i is the draft's
                    distribution at node i's position), or None for a deterministic proposal
                    (prompt lookup, lookahead, greedy top-s heads): the verifier then treats q
                    as one-hot on the drafted token.

Masks and positions are derived from `parents` by the pure functions below, following
Medusa's `generate_medusa_buffers` (Cai et al. 2024). Worked example, the lesson's K=2, s=2
tree (Chapter 4): root -> b1, b2; b1 -> b1c1, b1c2; b2 -> b2c1, b2c2 is

    parents = [-1, -1, 0, 0, 1, 1]        # b1, b2, b1c1, b1c2, b2c1, b2c2
    depths(parents)            -> [0, 0, 1, 1, 1, 1]
    position_offsets(parents)  -> [1, 1, 2, 2, 2, 2]   # positions after the root's
    tree_attention_mask(parents)[2] -> b1c1 sees b1 and itself, never b2 or b2's children
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


def _as_long_1d(x, name: str) -> torch.Tensor:
    t = torch.as_tensor(x)
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if t.numel() and (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool):
        raise ValueError(f"{name} must hold integers, got dtype {t.dtype}")
    return t.to(torch.long)


def check_parents(parents) -> torch.Tensor:
    """Validate a parents vector and return it as a LongTensor [n].

    Each entry must be -1 (a child of the root) or the index of an earlier node, so nodes are
    in topological order and the structure is a forest hanging off the root."""
    par = _as_long_1d(parents, "parents")
    if par.numel():
        idx = torch.arange(par.numel())
        bad = (par < -1) | (par >= idx)
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            raise ValueError(
                f"parents[{i}] = {int(par[i])}: each parent must be -1 (the root) "
                f"or the index of an earlier node (< {i})"
            )
    return par


@dataclass
class Aux:
    """Positions that ride along in the verification forward without being candidates: lookahead
    decoding's Jacobi window (Fu et al. 2024). Each sees the committed context, the root and the aux
    positions `mask` allows; no draft node sees them and they see no draft node. Their logits go back
    to the drafter (`Outcome.aux_logits`) and their KV is dropped after the round.

    tokens [m] long, offsets [m] positions after the root's (>= 1), mask [m, m] bool."""

    tokens: torch.Tensor
    offsets: torch.Tensor
    mask: torch.Tensor

    def __post_init__(self) -> None:
        self.tokens = _as_long_1d(self.tokens, "aux tokens")
        self.offsets = _as_long_1d(self.offsets, "aux offsets")
        m = self.tokens.numel()
        if self.offsets.numel() != m or tuple(self.mask.shape) != (m, m) or self.mask.dtype != torch.bool:
            raise ValueError(f"aux needs offsets [m] and a bool mask [m, m] for m = {m} tokens")
        if m and int(self.offsets.min()) < 1:
            raise ValueError("aux offsets must be >= 1 (positions after the root)")

    def __len__(self) -> int:
        return int(self.tokens.numel())


@dataclass
class Draft:
    """Candidates proposed for one verification round (see the module docstring)."""

    tokens: torch.Tensor  # [n] long
    parents: torch.Tensor  # [n] long, -1 = root
    q: torch.Tensor | None = None  # [n, V] draft probabilities, or None (deterministic draft)
    aux: Aux | None = None  # extra non-candidate positions in the same forward (lookahead's window)

    def __post_init__(self) -> None:
        self._chain: bool | None = None  # `is_chain`, once asked (a round asks 4 times a request)
        lists = [self.tokens, self.parents]
        if all(type(xs) is list and all(type(x) is int for x in xs) for xs in lists):
            self._check_lists(*lists)
            self.tokens, self.parents = (torch.tensor(xs, dtype=torch.long) for xs in lists)
        else:
            self.tokens = _as_long_1d(self.tokens, "tokens")
            self.parents = check_parents(self.parents)
            if self.parents.numel() != self.tokens.numel():
                raise ValueError(
                    f"parents has {self.parents.numel()} entries but tokens has {self.tokens.numel()}"
                )
            if self.tokens.numel() and int(self.tokens.min()) < 0:
                raise ValueError("tokens must be non-negative token ids")
        if self.q is not None:
            if not isinstance(self.q, torch.Tensor) or not self.q.is_floating_point():
                raise ValueError("q must be a floating-point tensor [n, V] or None")
            if self.q.dim() != 2 or self.q.shape[0] != self.tokens.numel():
                raise ValueError(
                    f"q must have shape [n, V] with n = {self.tokens.numel()}, "
                    f"got {tuple(self.q.shape)}"
                )

    def _check_lists(self, tokens: list[int], parents: list[int]) -> None:
        """The checks above on lists of ints (what the cheap drafters build) in Python, and whether they form a
        chain: a server step runs right after a forward has pushed the weights through the caches, where every
        small torch call costs tens of microseconds (the checks on tensors took 0.19 ms there, SmolLM2 q4 on a
        Zen 4; BENCHMARKS.md, session 30)."""
        for i, parent in enumerate(parents):
            if not -1 <= parent < i:
                raise ValueError(f"parents[{i}] = {parent}: each parent must be -1 (the root) or the index of an "
                                 f"earlier node (< {i})")
        if len(parents) != len(tokens):
            raise ValueError(f"parents has {len(parents)} entries but tokens has {len(tokens)}")
        if tokens and min(tokens) < 0:
            raise ValueError("tokens must be non-negative token ids")
        self._chain = all(parent == i - 1 for i, parent in enumerate(parents))

    @classmethod
    def chain(cls, tokens: Sequence[int] | torch.Tensor, q: torch.Tensor | None = None) -> "Draft":
        """A linear draft: node i's parent is node i-1 (the first node hangs off the root)."""
        if type(tokens) is list:
            return cls(tokens, list(range(-1, len(tokens) - 1)), q)
        t = _as_long_1d(tokens, "tokens")
        draft = cls(t, torch.arange(t.numel()) - 1, q)
        draft._chain = True
        return draft

    @classmethod
    def empty(cls) -> "Draft":
        """No candidates: verification degenerates to plain decoding (one token from p)."""
        return cls([], [])

    def __len__(self) -> int:
        return int(self.tokens.numel())

    @property
    def depth(self) -> int:
        """Tokens on the longest root-to-leaf path (= len for a chain): what k bounds."""
        if self.is_chain:  # the common case, checked every round: no depth walk
            return len(self)
        return int(depths(self.parents).max()) + 1

    @property
    def is_chain(self) -> bool:
        if self._chain is None:
            self._chain = bool(torch.equal(self.parents, torch.arange(len(self)) - 1))
        return self._chain


def depths(parents) -> torch.Tensor:
    """Depth of each node, 0 for children of the root: LongTensor [n]."""
    par = check_parents(parents)
    depth = torch.zeros_like(par)
    cur = par.clone()
    while bool((cur >= 0).any()):
        live = cur >= 0
        depth += live.long()
        cur = torch.where(live, par[cur.clamp(min=0)], cur)
    return depth


def position_offsets(parents) -> torch.Tensor:
    """Position of each node relative to the root (the last committed token): depth + 1."""
    return depths(parents) + 1


def tree_attention_mask(parents) -> torch.Tensor:
    """Bool [n, n]: mask[i, j] is True when node j is node i itself or one of its ancestors.

    Combined with full attention to the committed prefix, this keeps every branch's
    hypothetical continuation separate (the lesson's b1c1 never sees b2)."""
    par = check_parents(parents)
    n = par.numel()
    mask = torch.eye(n, dtype=torch.bool)
    rows = torch.arange(n)
    cur = par.clone()
    while bool((cur >= 0).any()):
        live = cur >= 0
        mask[rows[live], cur[live]] = True
        cur = torch.where(live, par[cur.clamp(min=0)], cur)
    return mask


def forward_layout(draft: Draft) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions (offsets from the root's) and the attention mask among the new positions of one
    verification forward: the root, then the draft nodes, then the aux positions.

    Returns offsets [1+n+m] and mask [1+n+m, 1+n+m] (True = may attend); every new position
    also sees the whole committed cache. A chain gives offsets 0..n and a causal mask."""
    n, aux = len(draft), draft.aux
    m = len(aux) if aux is not None else 0
    offsets = torch.zeros(1 + n + m, dtype=torch.long)
    offsets[1:1 + n] = position_offsets(draft.parents)
    mask = torch.zeros(1 + n + m, 1 + n + m, dtype=torch.bool)
    mask[:, 0] = True
    mask[1:1 + n, 1:1 + n] = tree_attention_mask(draft.parents)
    if m:
        offsets[1 + n:] = aux.offsets
        mask[1 + n:, 1 + n:] = aux.mask
    return offsets, mask


def children(parents) -> list[list[int]]:
    """children(parents)[j + 1] lists the children of node j; index 0 lists the root's."""
    par = check_parents(parents)
    out: list[list[int]] = [[] for _ in range(par.numel() + 1)]
    for i, p in enumerate(par.tolist()):
        out[p + 1].append(i)
    return out


def path_to(parents, node: int) -> list[int]:
    """Node indices from the root's child down to `node` (inclusive)."""
    par = check_parents(parents).tolist()
    if not 0 <= node < len(par):
        raise ValueError(f"node {node} is not in a draft of {len(par)} nodes")
    path = []
    while node >= 0:
        path.append(node)
        node = par[node]
    return path[::-1]
