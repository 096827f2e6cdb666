"""Prompt lookup's proposal cost, the scan (`lookup_match`) against the n-gram index (`NgramIndex`): each
Spec-Bench dev prompt (SmolLM2's chat template) grows by 64 tokens (70% new random ids, 30% copied from the
context), with a lookup of k = 8 before each. Run from the repository root:
PYTHONPATH=. .venv/bin/python benchmarks/s18/lookup_bench.py"""
import random
import time

from specdec.bench.prompts import load_prompts
from specdec.drafters.prompt_lookup import NgramIndex, lookup_match
from specdec.store import model_dir
from specdec.tokenizer import Tokenizer

tok = Tokenizer(model_dir("smollm2-135m"))
prompts = [tok.encode(p.turns[0], chat=True) for p in load_prompts("spec-bench")]
for name in ("scan", "index"):
    rng, calls, t = random.Random(0), 0, time.perf_counter()
    for p in prompts:
        tokens, index = list(p), NgramIndex()
        for _ in range(64):
            index.match(tokens, 8) if name == "index" else lookup_match(tokens, 8)
            calls += 1
            tokens.append(rng.randrange(49152) if rng.random() < 0.7 else tokens[rng.randrange(len(tokens))])
    print(f"{name}: {(time.perf_counter() - t) / calls * 1e6:.1f} us a lookup "
          f"({len(prompts)} prompts, {sum(map(len, prompts)) / len(prompts):.0f} tokens on average)")
