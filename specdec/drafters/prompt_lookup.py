"""Prompt lookup decoding (Saxena 2023, "Prompt Lookup Decoding"; vLLM's n-gram proposer).

Find the most recent earlier occurrence of the context's last n tokens (trying n = max_n
down to min_n) and propose the k tokens that followed it. Deterministic (q = None): rejection
sampling treats the draft as q one-hot, so output is unchanged under any sampling settings.

Example: context [5, 6, 7, 8, 5, 6], max_n = 3: the suffix [8, 5, 6] never occurred before,
[5, 6] did at position 0, followed by [7, 8, 5, 6]; with k = 3 the draft is [7, 8, 5].
Code editing repeats the input, so drafts are long and accepted (the lesson's 3.47x).
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


class PromptLookup(Drafter):
    name = "prompt-lookup"
    cheap = True  # a search of the context (`Drafter.cheap`)

    def __init__(self, max_n: int = 4, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"prompt lookup needs 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.max_n, self.min_n = max_n, min_n

    def propose(self, ctx: Context, k: int) -> Draft:
        return Draft.chain(lookup(ctx.tokens, k, self.max_n, self.min_n))
