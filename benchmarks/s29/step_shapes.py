# Session 29 (AMD Zen 4): one SmolLM2 q4 request in the server engine, in process, recycling trees of 1-3 nodes and k 1, 2 or auto
# against plain steps (HumanEvalFix dev, 64 tokens, 10 prompts x 2, interleaved); output in step-shapes.txt
import time, statistics as st
from specdec.api import LLM
from specdec.bench.prompts import load_prompts
from specdec.decode import Request
from specdec.drafters.recycling import Recycling
from specdec.serving.engine import Engine, Job
llm = LLM("smollm2-135m", dtype="q4")
prompts = load_prompts("humanevalfix")[:10]
cfgs = [("never", None, "auto"), ("always", 3, "auto"), ("always", 3, 2), ("always", 2, 2), ("always", 2, 1), ("always", 1, 1)]
recs = {n: Recycling(nodes=n) for n in (1, 2, 3)}
def run(mode, nodes, k, p):
    rec = recs[nodes or 3]
    eng = Engine(llm.model, llm.tokenizer, cost=llm.cost_curve(), speculation=mode, drafters={"recycling": rec.fresh})
    ids = llm.tokenizer.encode(p.turns[0])
    toks = []
    eng.submit(Job(ids, Request(max_new_tokens=64), method="recycling", k=k, on_event=lambda e: toks.extend(e.tokens)))
    steps = []
    t0 = time.perf_counter()
    first = True
    while eng.busy:
        t = time.perf_counter(); eng.step(); d = time.perf_counter() - t
        if not first: steps.append(d)
        first = False
    return time.perf_counter() - t0, len(toks), steps
for p in prompts[:2]:  # warm the tables
    for c in cfgs: run(*c, p)
res = {c: [] for c in cfgs}
for rep in range(2):
  for p in prompts:
    for c in cfgs: res[c].append(run(*c, p))
for c, rs in res.items():
    steps = sorted(s for r in rs for s in r[2]); tok = sum(r[1] for r in rs); wall = sum(r[0] for r in rs)
    q = lambda f: 1e3 * steps[int(f * (len(steps) - 1))]
    print(f"{c}: {tok/wall:.1f} tok/s, tokens/step {tok/len(steps):.2f}, step p50 {q(.5):.2f} p90 {q(.9):.2f} p99 {q(.99):.2f} ms")
