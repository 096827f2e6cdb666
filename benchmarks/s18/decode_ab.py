"""Session 18's Python-side changes, before and after, in one process: greedy decoding of SmolLM2 with each
method, the old and new code alternating per prompt (so the machine's slow minutes hit both alike).

"old": prompt lookup and recycling scan the context for every proposal (`lookup_match`), greedy verification
takes torch's argmax, the fused layers ask every cache tensor for its address each forward. "new": the n-gram
index (`NgramIndex`), `ops.argmax`, `KVCache.pointers`. Both must give the same tokens (checked). Which goes
first alternates per prompt, and recycling starts every run from an empty table (the LLM's table, shared by
its requests, would otherwise carry what the first run learned on the same prompt into the second). Prints per
method the median tokens/s of each and the median of the per-prompt ratios new / old. Run from the repository
root: PYTHONPATH=. .venv/bin/python benchmarks/s18/decode_ab.py --dtype q4 --prompts humanevalfix --limit 5
"""

import argparse
import statistics
import time

from specdec import verify
from specdec.api import LLM
from specdec.bench.prompts import load_prompts
from specdec.drafters import prompt_lookup, recycling
from specdec.runtime.kv_cache import KVCache


class ScanIndex(prompt_lookup.NgramIndex):
    def match(self, tokens, k):
        return prompt_lookup.lookup_match(tokens, k, self.max_n, self.min_n)


NEW = (prompt_lookup.NgramIndex, verify.argmax, KVCache.pointers)
OLD = (ScanIndex, lambda x: x.argmax(-1),
       lambda self: [t.data_ptr() for pair in zip(self.k, self.v) for t in pair])


def use(code):
    prompt_lookup.NgramIndex = recycling.NgramIndex = code[0]
    verify.argmax, KVCache.pointers = code[1], code[2]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="q4")
    ap.add_argument("--prompts", default="humanevalfix")
    ap.add_argument("--limit", type=int, default=5)
    ap.add_argument("--methods", default="plain,prompt-lookup,recycling")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args()
    llm = LLM(args.model, dtype=args.dtype)
    prompts = [t for p in load_prompts(args.prompts)[:args.limit] for t in p.turns[:1]]
    print(f"{args.model} {args.dtype}, {args.prompts} x{len(prompts)}, {args.max_new_tokens} new tokens, greedy")
    for method in args.methods.split(","):
        rates = {"old": [], "new": []}
        llm.generate(prompts[0], max_new_tokens=8, method=method)  # warm-up
        for i, p in enumerate(prompts):
            ids = {}
            for name, code in (("old", OLD), ("new", NEW))[::1 if i % 2 == 0 else -1]:
                use(code)
                llm._recycling = None  # an empty table, built with this code's index
                t = time.perf_counter()
                r = llm.generate(p, max_new_tokens=args.max_new_tokens, method=method)
                rates[name].append(len(r.token_ids) / (time.perf_counter() - t))
                ids[name] = r.token_ids
            assert ids["old"] == ids["new"], f"{method}: old and new code differ"
        use(NEW)
        ratio = statistics.median(n / o for n, o in zip(rates["new"], rates["old"]))
        print(f"{method:14s} old {statistics.median(rates['old']):6.1f} tok/s, new {statistics.median(rates['new']):6.1f}; "
              f"new / old {ratio:.3f} (median of {len(prompts)} prompts; same tokens)")


if __name__ == "__main__":
    main()
