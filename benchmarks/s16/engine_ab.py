"""In-process engines (no HTTP), one per mode, kept at C requests in flight; modes alternate in rounds
(session 16). Run from the repository root: PYTHONPATH=. .venv/bin/python benchmarks/s16/engine_ab.py MODEL C ROUNDS N
usage: engine_ab.py MODEL C rounds requests_per_round [modes]"""
import sys, time, statistics
from specdec.api import LLM
from specdec.serving.engine import Engine, Job
from specdec.decode import Request
from specdec.bench.prompts import load_prompts
name, C, rounds, per = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
modes = sys.argv[5].split(",") if len(sys.argv) > 5 else ["auto", "always", "never"]
llm = LLM(name, dtype="q4")
prompts = [p.turns[0] for p in load_prompts("spec-bench")]
ids = [llm.tokenizer.encode(p, chat=True) for p in prompts]
engines = {m: Engine(llm.model, llm.tokenizer, cost=llm.cost_curve(), speculation=m, max_batch=C) for m in modes}
nxt = {m: 0 for m in modes}
def run(m, n):
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
    order = modes[r % len(modes):] + modes[:r % len(modes)]
    for m in order:
        rates[m].append(run(m, per))
    print(r, {m: round(rates[m][-1], 1) for m in modes}, flush=True)
for m in modes:
    print(m, "median", round(statistics.median(rates[m]), 1), {o: round(statistics.median(a / b for a, b in zip(rates[m], rates[o])), 3) for o in modes if o != m})
if "auto" in engines and engines["auto"].picker:
    p = engines["auto"].picker; print("picker current", p.current, "steps", p.steps)
