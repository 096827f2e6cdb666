"""The KV cache in fp16 against fp32 (session 19, `--kv-dtype`), in one process, the two alternating.

    PYTHONPATH=. .venv/bin/python benchmarks/s19/kv_ab.py quality MODEL            # perplexity, top-1 agreement
    PYTHONPATH=. .venv/bin/python benchmarks/s19/kv_ab.py step MODEL 256,1024,2048  # one decoding step per context
    PYTHONPATH=. .venv/bin/python benchmarks/s19/kv_ab.py batch MODEL B CONTEXT K   # one packed server step
    PYTHONPATH=. .venv/bin/python benchmarks/s19/kv_ab.py engine C ROUNDS N MODE    # the batched engine, SmolLM2

quality: the held-in text of `specdec quality` (8 HumanEvalFix dev tasks, the answers scored), q4 weights, the
cache in fp32 (the reference) and fp16. step: a one-position forward after CONTEXT cached positions, medians of
interleaved repeats. batch: the batched server's packed forward over B requests of CONTEXT cached positions,
each verifying K drafted positions after its last token (K = 0: a decode-only step), medians. engine: an in-process engine (no HTTP) kept at C requests on Spec-Bench prompts, rounds of N
requests alternating the cache's dtype (each request's cache is made when it starts); MODE never, always or auto
(the model's grants, the arm picker off). Prints the medians and the median per-round ratio fp16 / fp32.
"""
import math
import statistics
import sys
import time
from pathlib import Path

import torch

from specdec.api import LLM

KV = {"fp32": torch.float32, "fp16": torch.float16}


def quality(name):
    from specdec import quality as Q
    llm = LLM(name, dtype="q4")
    texts = Q.held_in(llm.tokenizer)
    top = {}
    for kv in ("fp32", "fp16"):
        llm.model.kv_choice = KV[kv]
        top[kv], nll, count = Q.score(llm.model, texts)
        agree = sum(int((a == b).sum()) for a, b in zip(top[kv], top["fp32"])) / count
        print(f"{name} q4, KV {kv}: perplexity {math.exp(nll / count):.4f}, top-1 agreement with fp32 KV "
              f"{agree:.4f} ({count} tokens)")


def step(name, contexts):
    llm = LLM(name, dtype="q4")
    model = llm.model
    for ctx in contexts:
        caches = {}
        for kv in KV:
            model.kv_choice = KV[kv]
            caches[kv] = model.new_cache(ctx + 2)
            model(torch.randint(0, 1000, (1, ctx)), caches[kv])
        times = {kv: [] for kv in KV}
        tok = torch.tensor([[42]])
        for r in range(15):
            for kv in (("fp32", "fp16") if r % 2 else ("fp16", "fp32")):
                t = time.perf_counter()
                model(tok, caches[kv])
                times[kv].append(time.perf_counter() - t)
                caches[kv].rewind(1)
        m = {kv: statistics.median(v[3:]) * 1e3 for kv, v in times.items()}
        print(f"{name} q4, context {ctx}: one step fp32 KV {m['fp32']:.2f} ms, fp16 {m['fp16']:.2f} ms, "
              f"fp16 / fp32 {m['fp16'] / m['fp32']:.3f}", flush=True)


def batch(name, B, ctx, k):
    from specdec.serving.batch import Segment, packed_forward
    llm = LLM(name, dtype="q4")
    model = llm.model
    caches = {}
    for kv in KV:
        model.kv_choice = KV[kv]
        caches[kv] = [model.new_cache(ctx + k + 2) for _ in range(B)]
        for i, c in enumerate(caches[kv]):
            model(torch.randint(0, 1000, (1, ctx), generator=torch.Generator().manual_seed(i)), c)
    times = {kv: [] for kv in KV}
    for r in range(21):
        for kv in (("fp32", "fp16") if r % 2 else ("fp16", "fp32")):
            segs = [Segment(c, [42 + j for j in range(k + 1)]) for c in caches[kv]]
            t = time.perf_counter()
            packed_forward(model, segs)
            times[kv].append(time.perf_counter() - t)
            for c in caches[kv]:
                c.rewind(k + 1)
    m = {kv: statistics.median(v[3:]) * 1e3 for kv, v in times.items()}
    print(f"{name} q4, {B} requests x {k + 1} positions after {ctx}: fp32 KV {m['fp32']:.2f} ms, fp16 "
          f"{m['fp16']:.2f} ms, fp16 / fp32 {m['fp16'] / m['fp32']:.3f}", flush=True)


def engine(C, rounds, per, mode):
    sys.path.insert(0, str(Path(__file__).parents[1] / "s18"))
    from engine_ab import rate  # the same loop as session 18's engine A/B

    from specdec.bench.prompts import load_prompts
    from specdec.serving.engine import Engine
    llm = LLM("smollm2-135m", dtype="q4")
    ids = [llm.tokenizer.encode(p.turns[0], chat=True) for p in load_prompts("spec-bench")]
    eng = Engine(llm.model, llm.tokenizer, cost=llm.cost_curve(), speculation=mode, max_batch=C)
    eng.picker = None
    rates = {kv: [] for kv in KV}
    for r in range(rounds):
        for kv in (("fp32", "fp16") if r % 2 == 0 else ("fp16", "fp32")):
            llm.model.kv_choice = KV[kv]
            rates[kv].append(rate(eng, ids, C, per, r * per))
        print(r, {k: round(v[-1], 1) for k, v in rates.items()}, flush=True)
    print(f"C = {C}, {mode}: fp32 KV {statistics.median(rates['fp32']):.1f} tok/s, fp16 "
          f"{statistics.median(rates['fp16']):.1f}; fp16 / fp32 "
          f"{statistics.median(a / b for a, b in zip(rates['fp16'], rates['fp32'])):.3f} (median of {rounds} rounds)")


if __name__ == "__main__":
    what = sys.argv[1]
    if what == "quality":
        quality(sys.argv[2])
    elif what == "step":
        step(sys.argv[2], [int(c) for c in sys.argv[3].split(",")])
    elif what == "batch":
        batch(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
    else:
        engine(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
