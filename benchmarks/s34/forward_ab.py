"""One code version's q4 forward times and decoding speed, for alternating A/B runs of two checkouts (`ab.sh`).

Loads --model at q4 from whichever `specdec` is imported (PYTHONPATH = a checkout; SPECDEC_HOME = a store whose
q4 cache that checkout built), then in sweeps: one forward at n positions after a --context-token prompt, for each
n, and the weights' bytes. Then greedy plain decoding and token recycling through `LLM.generate` on HumanEvalFix
dev prompts. Prints one JSON line. Run with nothing else on the machine:

    bash benchmarks/s34/ab.sh /tmp/base34:/tmp/home34b .:$HOME/.cache/specdec 4 --model smollm2-135m
"""

import argparse
import json
import statistics
import time

import torch

import specdec
from specdec.api import LLM
from specdec.bench.prompts import load_prompts
from specdec.runtime.model import QLinear


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--n", default="1,2,4,8")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--sweeps", type=int, default=20)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    llm = LLM(args.model, dtype="q4")
    model = llm.model
    parts = [p for m in model.modules() if isinstance(m, QLinear) for p in m.parts]
    out = {"code": specdec.__file__, "MB": round(sum(p.nbytes for p in parts) / 1e6, 1)}
    prompt = torch.randint(100, 1000, (1, args.context))
    ns = [int(v) for v in args.n.split(",")]
    cache = model.new_cache(args.context + max(ns) + 8)
    times = {n: [] for n in ns}
    with torch.inference_mode():
        model(prompt, cache)
        for sweep in range(args.sweeps + 1):
            for n in ns:
                ids = torch.randint(100, 1000, (1, n))
                t = time.perf_counter()
                for _ in range(args.steps):
                    model(ids, cache)
                    cache.rewind(n)
                if sweep:
                    times[n].append((time.perf_counter() - t) / args.steps * 1e3)
    out.update({f"forward n={n} ms": round(statistics.median(v), 3) for n, v in times.items()})
    prompts = [p.turns[0] for p in load_prompts("humanevalfix")[:args.prompts]]
    for method in ("plain", "recycling"):
        llm.generate(prompts[0], max_new_tokens=8, method=method)
        t, toks = time.perf_counter(), 0
        for p in prompts:
            toks += llm.generate(p, max_new_tokens=args.tokens, method=method).new_tokens
        out[f"{method} tok/s"] = round(toks / (time.perf_counter() - t), 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
