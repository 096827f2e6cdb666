"""In-process A/B (session 16): the model's grants with a chain's longest paying prefix (`Ask.shorter`, "prefix")
against all or none ("whole"), and never. Run from the repository root:
PYTHONPATH=. .venv/bin/python benchmarks/s16/engine_ab3.py C ROUNDS N"""
import dataclasses, sys, time, statistics
from specdec.api import LLM
from specdec.serving import scheduler
from specdec.serving.engine import Engine, Job
from specdec.decode import Request
from specdec.bench.prompts import load_prompts
C, rounds, per = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
llm = LLM("smollm2-135m", dtype="q4")
ids = [llm.tokenizer.encode(p.turns[0], chat=True) for p in load_prompts("spec-bench")]
whole = [False]
real = scheduler.grant
scheduler.grant = lambda asks, *a, **kw: real([dataclasses.replace(x, shorter=()) for x in asks] if whole[0] else asks, *a, **kw)
def mk(mode):
    e = Engine(llm.model, llm.tokenizer, cost=llm.cost_curve(), speculation=mode, max_batch=C)
    e.picker = None
    return e
engines = {"prefix": mk("auto"), "whole": mk("auto"), "never": mk("never")}
modes = list(engines); nxt = dict.fromkeys(modes, 0)
def run(m, n):
    whole[0] = m == "whole"
    eng = engines[m]; done = [0]; toks = [0]
    def ev(e):
        toks[0] += len(e.tokens)
        if e.finish_reason: done[0] += 1
    sub = 0; t = time.perf_counter()
    while done[0] < n:
        while sub < n and sub - done[0] < C:
            eng.submit(Job(ids[nxt[m] % len(ids)], Request(max_new_tokens=64), method="prompt-lookup", on_event=ev))
            nxt[m] += 1; sub += 1
        eng.step()
    return toks[0] / (time.perf_counter() - t)
rates = {m: [] for m in modes}
for r in range(rounds):
    for m in modes[r % 3:] + modes[:r % 3]:
        rates[m].append(run(m, per))
    print(r, {m: round(rates[m][-1], 1) for m in modes}, flush=True)
for m in modes:
    print(m, "median", round(statistics.median(rates[m]), 1), {o: round(statistics.median(a / b for a, b in zip(rates[m], rates[o])), 3) for o in modes if o != m})
for m in ("prefix", "whole"):
    print(m, "drafted/accepted", engines[m].metrics.totals)
