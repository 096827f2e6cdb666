"""Retrieval drafting (He et al. 2024, "REST: Retrieval-Based Speculative Decoding"; the lesson's
Chapter 3, option 3).

Where prompt lookup searches the prompt, REST searches a datastore of other text (ShareGPT's
answers, a code base) tokenized with the target's tokenizer and indexed by a suffix array
(`specdec.datastore`). Each round: find the longest suffix of the context (max_n down to min_n
tokens) that occurs in the datastore, then propose what most often followed it there:

    chain (default)  the most frequent next token among the matches, narrow the matches to
                     those continuing with it, repeat up to k tokens
    tree             REST's trie: the k most frequent continuation prefixes as a tree
                     (a child is never more frequent than its parent), verified in one pass

Deterministic (q = None): rejection sampling treats the draft as q one-hot, so the output is
exactly the target's under any sampling settings; the datastore only changes the speed.

Example (smollm2-135m, 16M ShareGPT tokens): the context "I hope this email finds you well.
I am writing to" matches 12 tokens deep, 14 times; the greedy chain for k = 8 is " express my
interest in working with you on". A context found nowhere (not even 2 tokens) drafts nothing
and the round is a plain step.

    drafter = Retrieval("~/.cache/specdec/datastores/sharegpt-smollm2-135m", tokenizer)
"""

from __future__ import annotations

from pathlib import Path

from specdec.datastore import Datastore, default_dir, open_datastore
from specdec.draft import Draft
from specdec.drafters.base import Context, Drafter
from specdec.errors import SpecdecError


class Retrieval(Drafter):
    name = "retrieval"

    def __init__(self, datastore: str | Path | Datastore, tokenizer, *, model: str | None = None,
                 max_n: int = 16, min_n: int = 2, max_matches: int = 5000, tree: bool = False,
                 branch: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"retrieval needs 1 <= min_n <= max_n, got {min_n}, {max_n}")
        if max_matches < 1:
            raise ValueError(f"max_matches must be positive, got {max_matches}")
        if isinstance(datastore, Datastore):
            self.ds = datastore
            self.ds.check_tokenizer(tokenizer, model)
        else:
            self.ds = open_datastore(datastore, tokenizer, model)
        self.max_n, self.min_n = max_n, min_n
        self.max_matches, self.tree, self.branch = max_matches, tree, branch
        if tree:
            self.name = "retrieval-tree"

    def propose(self, ctx: Context, k: int) -> Draft:
        if self.tree:
            tokens, parents = self.ds.tree(ctx.tokens, k, self.max_n, self.min_n, self.max_matches, self.branch)
            return Draft(tokens, parents) if tokens else Draft.empty()
        return Draft.chain(self.ds.chain(ctx.tokens, k, self.max_n, self.min_n, self.max_matches))


def build(llm, datastore: str | None = None, **options) -> Retrieval:
    """The Retrieval drafter for `llm` (a specdec.LLM): `datastore` is a folder, or None for the
    model's default ShareGPT datastore (`specdec datastore build --model NAME --from sharegpt`)."""
    if datastore is None:
        folder = default_dir(llm.name)
        if not folder.is_dir():
            raise SpecdecError(
                f"method 'retrieval' needs a datastore and there is none for {llm.name} at {folder}: build it "
                f"with `specdec datastore build --model {llm.name} --from sharegpt` (about 2 minutes), "
                "or pass --datastore DIR")
    else:
        folder = Path(datastore).expanduser()
    return Retrieval(folder, llm.tokenizer, model=llm.name, **options)
