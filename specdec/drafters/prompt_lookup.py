"""Prompt lookup decoding (Saxena 2023, "Prompt Lookup Decoding"; vLLM's n-gram proposer).

Find the most recent earlier occurrence of the context's last n tokens (trying n = max_n
down to min_n) and propose the k tokens that followed it. Deterministic (q = None): rejection
sampling treats the draft as q one-hot, so output is unchanged under any sampling settings.

Example: context [5, 6, 7, 8, 5, 6], max_n = 3: the suffix [8, 5, 6] never occurred before,
[5, 6] did at position 0, followed by [7, 8, 5, 6]; with k = 3 the draft is [7, 8, 5].
Code editing repeats the input, so drafts are long and accepted (the lesson's 3.47x).

The drafter keeps an index of the context's n-grams (`NgramIndex`), updated with each committed token, so a
proposal is a few dictionary probes rather than a scan of the context: on SmolLM2 at 16 server requests the scans
took ~2 ms of a 26 ms step (session 18).
"""

from __future__ import annotations

from specdec.draft import Draft
from specdec.drafters.base import Context, Drafter


def lookup(tokens: list[int], k: int, max_n: int = 4, min_n: int = 1) -> list[int]:
    """Continuation (up to k tokens) of the most recent earlier match of the longest suffix n-gram."""
    return lookup_match(tokens, k, max_n, min_n)[0]


def lookup_match(tokens: list[int], k: int, max_n: int = 4, min_n: int = 1) -> tuple[list[int], int]:
    """`lookup`'s continuation and the length n of the suffix that matched (0: none)."""
    if k <= 0:
        return [], 0
    L = len(tokens)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = tokens[L - n:]
        # scan backwards for the most recent match that is not the suffix itself
        for start in range(L - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k], n
    return [], 0


class NgramIndex:
    """`lookup_match` on a growing token list without scanning it: for each n in min_n..max_n, the latest start
    of every n-gram that ends before the last token. Each lookup first indexes the tokens added since the last
    one (max_n - min_n + 1 dictionary writes a token), then probes the suffixes longest first. The answers are
    `lookup_match`'s. The list is taken to grow only (a Context's tokens do); another list, or one shorter than at
    the last lookup, starts a new index.

    Example: tokens [5, 6, 7, 8, 5, 6]: the 2-grams ending before the last token are (5, 6) at 0, (6, 7) at 1,
    (7, 8) at 2, (8, 5) at 3; the suffix (5, 6) is found at 0, so k = 3 gives [7, 8, 5], n = 2."""

    def __init__(self, max_n: int = 4, min_n: int = 1):
        self.max_n, self.min_n = max_n, min_n
        self.tokens: list[int] | None = None
        self.upto = 0  # the n-grams ending before tokens[upto] are indexed
        self.starts: dict[int, dict[tuple[int, ...], int]] = {}

    def match(self, tokens: list[int], k: int) -> tuple[list[int], int]:
        L = len(tokens)
        if tokens is not self.tokens or L < self.upto + 1:
            self.tokens, self.upto = tokens, 0
            self.starts = {n: {} for n in range(self.min_n, self.max_n + 1)}
        for end in range(self.upto, L - 1):  # an n-gram ending at `end` starts at end - n + 1
            for n, starts in self.starts.items():
                if end + 1 >= n:
                    starts[tuple(tokens[end + 1 - n:end + 1])] = end + 1 - n
        self.upto = max(self.upto, L - 1)
        if k <= 0:
            return [], 0
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            start = self.starts[n].get(tuple(tokens[L - n:]))
            if start is not None:
                return tokens[start + n:start + n + k], n
        return [], 0


class PromptLookup(Drafter):
    name = "prompt-lookup"
    cheap = True  # a search of the context (`Drafter.cheap`)

    def __init__(self, max_n: int = 4, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"prompt lookup needs 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.max_n, self.min_n = max_n, min_n
        self.index = NgramIndex(max_n, min_n)

    def propose(self, ctx: Context, k: int) -> Draft:
        return Draft.chain(self.index.match(ctx.tokens, k)[0])
