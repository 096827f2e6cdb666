"""Offline replay of token recycling's choices (session 10): how many tokens a forward would accept with each
key, tree size and lookup order, on the target's own greedy outputs, without timing anything.

Step 1 decodes N HumanEvalFix dev prompts greedily with the 1.5B in q4 and keeps the target's top 8 tokens at
every position (one forward over prompt + answer: q4 logits are the same for any number of positions). Step 2
replays rounds over those answers: a draft tree is built as `specdec.drafters.recycling` builds it (rank
paths over a table of top candidates, prompt lookup's chain merged in), a round accepts the longest drafted
path that matches the answer plus one token, and the table learns the rows of the accepted path (the real
drafter also learns the rejected nodes' rows: the replay slightly understates it). The table is kept across
prompts, as the drafter keeps it across requests.

    .venv/bin/python benchmarks/s10/recycling_replay.py 20
"""

from __future__ import annotations

import sys

import torch

from specdec.drafters.prompt_lookup import lookup_match

PATHS = [(0,), (0, 0), (1,), (0, 0, 0), (2,), (0, 1), (1, 0), (0, 0, 0, 0), (3,), (0, 2), (1, 1), (2, 0),
         (0, 0, 1), (0, 1, 0), (1, 0, 0)]
BREADTH_FIRST = [(0,), (1,), (2,), (3,), (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (0, 0, 0), (0, 0, 1),
                 (0, 1, 0), (1, 0, 0), (0, 0, 0, 0)]


def answers(n: int) -> list[tuple[list[int], list[int], torch.Tensor]]:
    from specdec.api import LLM
    from specdec.bench.prompts import load_prompts
    from specdec.bench.runner import chat_ids

    llm = LLM("qwen2.5-coder-1.5b", dtype="q4")
    out = []
    for p in load_prompts("humanevalfix")[:n]:
        ids = chat_ids(llm.tokenizer, [{"role": "user", "content": p.turns[0]}])
        new = llm.generate(ids, max_new_tokens=128).token_ids
        seq, cache = ids + new, llm.model.new_cache(len(ids) + len(new))
        rows = [llm.model(torch.tensor([seq[a:a + 256]]), cache).logits[0].topk(8, dim=-1).indices
                for a in range(0, len(seq), 256)]
        out.append((ids, new, torch.cat(rows).tolist()))
        print(f"{p.id}: {len(ids)} prompt tokens, {len(new)} new", file=sys.stderr)
    return out


def replay(data, nodes: int, paths=PATHS, pair_key=True, lookup_order="strong", chain_only=False) -> float:
    """Tokens per forward. lookup_order: 'strong' (a 2+-token match first, a 1-token match last: the drafter's),
    'first' (any match first), 'none' (recycled candidates only)."""
    table, forwards, tokens = {}, 0, 0

    def store(seq, j, row):
        table[seq[j]] = row
        if pair_key and j > 0:
            table[(seq[j - 1], seq[j])] = row

    def cands(ctx):
        hit = table.get(tuple(ctx[-2:])) if pair_key else None
        return hit if hit is not None else table.get(ctx[-1])

    for ids, new, top in data:
        seq, t = ids + new, len(ids) + 1
        store(seq, len(ids) - 1, top[len(ids) - 1])
        while t < len(seq):
            ctx = seq[:t]
            chain, n = lookup_match(ctx, 3) if lookup_order != "none" else ([], 0)
            by, rec = {(): ()}, []
            for r in ([] if chain_only else paths):
                parent = by.get(r[:-1])
                c = None if parent is None else cands(ctx + list(parent))
                if c is not None:
                    by[r] = parent + (c[r[-1]],)
                    rec.append(by[r])
            lk = [tuple(chain[:i + 1]) for i in range(len(chain))]
            order = lk + rec if lookup_order == "first" or n >= 2 else rec + lk
            tree = []
            for p in order:
                if p not in tree and (len(p) == 1 or p[:-1] in tree):
                    tree.append(p)
            tree = tree[:nodes]
            best = max([len(p) for p in tree if tuple(seq[t:t + len(p)]) == p] + [0])
            for j in range(t - 1, min(t + best, len(top))):
                store(seq, j, top[j])
            step = min(best + 1, len(seq) - t)
            forwards, tokens, t = forwards + 1, tokens + step, t + step
    return tokens / forwards


if __name__ == "__main__":
    data = answers(int(sys.argv[1]) if len(sys.argv) > 1 else 20)
    print("tokens per forward (draft nodes: 1 2 3 4 5 8)")
    sizes = (1, 2, 3, 4, 5, 8)
    rows = {
        "prompt lookup alone (a chain of up to 3)": dict(chain_only=True, lookup_order="first"),
        "recycling, last token as key, no lookup": dict(pair_key=False, lookup_order="none"),
        "recycling, last pair as key, no lookup": dict(lookup_order="none"),
        "recycling + lookup, any match first": dict(lookup_order="first"),
        "recycling + lookup, breadth-first paths": dict(paths=BREADTH_FIRST),
        "recycling + lookup (the drafter)": dict(),
    }
    for name, kw in rows.items():
        print(f"{name:44s}", " ".join(f"{replay(data, n, **kw):.3f}" for n in sizes))
