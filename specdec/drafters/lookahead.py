"""Lookahead decoding (Fu, Bailis, Stoica, Zhang 2024, "Break the Sequential Dependency of LLM
Inference Using Lookahead Decoding"; the lesson, Chapter 6): the target guesses its own future.

One target forward carries two branches beside the last committed token (the root):

* the **lookahead branch**, a Jacobi window of W columns at N-1 levels (`Aux` positions). Level l,
  column i sits at offset 1+i+l after the root and sees level 0's columns 0..i, then its own column's
  levels 1..l: a sequence of consecutive positions, so each output is the target's next token after
  a guessed trajectory. Every forward, all of the newest level's outputs become a new level at once
  (Jacobi: every guess updated from the previous guesses, never from this round's fresh ones).
  With N-1 levels, column i's trajectory plus its new output is an N-gram: it goes to the pool and
  the oldest level is dropped.
* the **verification branch**: up to G (N-1)-token continuations the pool holds for the root token,
  merged into a tree and verified exactly like any other draft (greedy, or lossless rejection
  sampling with q one-hot on each candidate: the output's distribution is exactly the target's).

The n-gram pool is seeded from the prompt and from every committed (verified) N-gram, and is
bounded (LRU over keys, a few continuations per key). At least one token is committed per forward,
as in plain decoding; the window is skipped near max_new_tokens and cut at a guessed EOS.

Worked example, W = 2, N = 3 (offsets after the root r):

    level 0:  a0 (1)  a1 (2)          a1 sees r a0 a1
    level 1:  b0 (2)  b1 (3)          b1 sees r a0 a1 b1;  b0 sees r a0 b0
    outputs at b0, b1 -> c0, c1;  n-grams (a0 b0 c0), (a1 b1 c1) go to the pool;
    the next window is levels (b, c).

Positions per forward: 1 + W*(N-1) + G*(N-1) at most; `auto_config` fits them to the budget
`specdec probe` measured.
"""

from __future__ import annotations

import random
from collections import OrderedDict

import torch

from specdec.draft import Aux, Draft
from specdec.drafters.base import Context, Drafter, Outcome
from specdec.drafters.prompt_lookup import lookup
from specdec.runtime.kernels.ops import argmax

from specdec.options import LOOKAHEAD_BOUNDS

MAX_WINDOW, MAX_NGRAM, MAX_GUESSES = (LOOKAHEAD_BOUNDS[name][1] for name in ("window", "ngram", "guesses"))

# (W, N, G) in order of preference: the first whose positions fit the budget wins
PRESETS = ((15, 5, 15), (10, 5, 10), (7, 5, 7), (5, 4, 5), (4, 4, 4), (3, 4, 3), (3, 3, 3), (2, 3, 2),
           (2, 3, 1), (1, 3, 1))


def positions(window: int, ngram: int, guesses: int) -> int:
    """Positions one lookahead forward evaluates: W*(N-1) + G*(N-1) + 1 (the issue's count)."""
    return (window + guesses) * (ngram - 1) + 1


def auto_config(budget: int) -> tuple[int, int, int]:
    """(W, N, G) for a measured budget: the most ambitious preset whose positions fit it. Under 5
    positions there is no room for a window: (0, 4, 1), the pool's most recent 3-token candidate
    alone, whose depth adaptive k then sets round by round from the cost curve (a 2-core AVX2 CPU
    has a budget of 2: its forward over 4 positions costs ~1.4 steps)."""
    for w, n, g in PRESETS:
        if positions(w, n, g) <= budget:
            return w, n, g
    return 0, 4, 1


class NgramPool:
    """key token -> up to `per_key` continuations of N-1 tokens, most recent first; at most
    `max_keys` keys, least recently used evicted first."""

    def __init__(self, ngram: int, per_key: int = 8, max_keys: int = 65536):
        if ngram < 2:
            raise ValueError(f"n-grams need N >= 2, got {ngram}")
        self.n, self.per_key, self.max_keys = ngram, per_key, max_keys
        self.table: OrderedDict[int, OrderedDict[tuple, None]] = OrderedDict()

    def add(self, gram) -> None:
        gram = tuple(int(t) for t in gram)
        if len(gram) != self.n:
            raise ValueError(f"pool holds {self.n}-grams, got {len(gram)} tokens")
        key, cont = gram[0], gram[1:]
        conts = self.table.get(key)
        if conts is None:
            conts = self.table[key] = OrderedDict()
            if len(self.table) > self.max_keys:
                self.table.popitem(last=False)
        self.table.move_to_end(key)
        conts[cont] = None
        conts.move_to_end(cont)
        if len(conts) > self.per_key:
            conts.popitem(last=False)

    def add_sequence(self, tokens: list[int], start: int = 0) -> None:
        """Every N-gram of `tokens` that ends after index `start`."""
        for end in range(max(start, self.n - 1) + 1, len(tokens) + 1):
            self.add(tokens[end - self.n:end])

    def get(self, key: int, limit: int) -> list[tuple]:
        conts = self.table.get(int(key))
        return list(reversed(conts))[:limit] if conts else []

    def __len__(self) -> int:
        return sum(len(c) for c in self.table.values())


def trie(candidates: list[tuple], depth: int) -> Draft:
    """Merge candidate chains (each cut to `depth` tokens) into one tree: shared prefixes share nodes."""
    tokens, parents, index = [], [], {}
    for cand in candidates:
        parent, prefix = -1, ()
        for tok in cand[:depth]:
            prefix = prefix + (tok,)
            if prefix not in index:
                index[prefix] = len(tokens)
                tokens.append(tok)
                parents.append(parent)
            parent = index[prefix]
    return Draft(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long))


def window_layout(window: int, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Offsets [levels*W] and mask [levels*W, levels*W] of the lookahead branch, level-major
    (index l*W + i): (l, i) sits at 1+i+l and sees (0, j<=i) and (1..l, i)."""
    m = window * levels
    offsets = torch.tensor([1 + i + l for l in range(levels) for i in range(window)], dtype=torch.long)
    mask = torch.zeros(m, m, dtype=torch.bool)
    for l in range(levels):
        for i in range(window):
            row = l * window + i
            mask[row, :i + 1] = True                      # level 0, columns 0..i
            for up in range(1, l + 1):
                mask[row, up * window + i] = True         # own column, levels 1..l
    return offsets, mask


class Lookahead(Drafter):
    name = "lookahead"

    def __init__(self, window: int = 4, ngram: int = 4, guesses: int = 4, pool: bool = True,
                 eos_ids: tuple[int, ...] = ()):
        if not (0 <= window <= MAX_WINDOW and 2 <= ngram <= MAX_NGRAM and 1 <= guesses <= MAX_GUESSES):
            raise ValueError(f"lookahead needs 0 <= window <= {MAX_WINDOW}, 2 <= ngram <= {MAX_NGRAM} and "
                             f"1 <= guesses <= {MAX_GUESSES}; got {window}, {ngram}, {guesses}")
        self.window, self.ngram, self.guesses, self.use_pool = window, ngram, guesses, pool
        self.eos_ids = set(eos_ids)
        self._layouts: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.reset()

    def reset(self) -> None:
        self.pool = NgramPool(self.ngram)
        self.levels: list[list[int]] = []   # levels[l][i]: the guess at level l, column i
        self.seen = 0                       # context tokens already added to the pool
        self.sent = 0                       # columns sent in the last forward
        self.harvested: list[tuple] = []    # n-grams of the last window update (the no-pool baseline)

    def room(self, k: int) -> int:
        """Positions beyond the root for drafts at most k deep: G candidates of min(k, N-1) tokens, plus the
        window's W*(N-1) when it is sent (k >= N-1, `_columns`)."""
        depth = min(k, self.ngram - 1)
        return self.guesses * depth + (self.window * depth if k >= self.ngram - 1 else 0)

    def propose(self, ctx: Context, k: int) -> Draft:
        tokens = ctx.tokens
        if not self.levels and self.window:
            self._init_window(tokens)
        if self.use_pool:
            self.pool.add_sequence(tokens, self.seen)  # the prompt first, then every committed n-gram
            self.seen = len(tokens)
            candidates = self.pool.get(tokens[-1], self.guesses)
        else:
            candidates = [g[1:] for g in self.harvested if g[0] == tokens[-1]][:self.guesses]
        draft = trie(candidates, min(k, self.ngram - 1))
        cols = self._columns(k)
        self.sent = cols
        if cols:
            offsets, mask = self._layout(cols, len(self.levels))
            draft.aux = Aux(torch.tensor([lvl[i] for lvl in self.levels for i in range(cols)]), offsets, mask)
        return draft

    def observe(self, outcome: Outcome) -> None:
        self.harvested = []
        if outcome.aux_logits is None or not self.sent:
            return
        cols, depth = self.sent, len(self.levels)
        newest = argmax(outcome.aux_logits[(depth - 1) * cols:]).tolist()
        new = newest + self.levels[-1][cols:]   # columns not sent keep their last guess
        if depth < self.ngram - 1:             # still filling the window's levels
            self.levels.append(new)
            return
        self.harvested = [tuple(lvl[i] for lvl in self.levels) + (new[i],) for i in range(cols)]
        if self.use_pool:
            for gram in self.harvested:
                self.pool.add(gram)
        self.levels = self.levels[1:] + [new]

    def seed(self, root: int, draft: Draft) -> None:
        """Learn another source's proposal (Hybrid): each root-to-node chain's n-grams enter the pool."""
        if self.use_pool and len(draft):
            parents, toks = draft.parents.tolist(), draft.tokens.tolist()
            for leaf in set(range(len(toks))) - set(parents):
                chain, node = [], leaf
                while node >= 0:
                    chain.append(toks[node])
                    node = parents[node]
                self.pool.add_sequence([root] + chain[::-1])

    def _init_window(self, tokens: list[int]) -> None:
        """Level 0 from what followed the last token earlier in the prompt, padded with prompt tokens."""
        guess = lookup(tokens, self.window)
        rng = random.Random(len(tokens))
        guess += [rng.choice(tokens) for _ in range(self.window - len(guess))]
        self.levels = [guess]

    def _columns(self, k: int) -> int:
        """Columns to send this round: none near the token limit (k < N-1), none past a guessed EOS."""
        if k < self.ngram - 1 or not self.levels:
            return 0
        cols = self.window
        for i, tok in enumerate(self.levels[-1]):
            if tok in self.eos_ids:
                cols = i + 1
                break
        return cols

    def _layout(self, cols: int, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
        key = (cols, levels)
        if key not in self._layouts:
            self._layouts[key] = window_layout(cols, levels)
        return self._layouts[key]
