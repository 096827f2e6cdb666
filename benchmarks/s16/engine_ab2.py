"""In-process A/B (session 16): the model's grants with drafting before the grant (new) and after it (old), and
never. Run from the repository root: PYTHONPATH=. .venv/bin/python benchmarks/s16/engine_ab2.py C ROUNDS N"""
import sys, time, statistics
from specdec.api import LLM
from specdec.serving.engine import Engine, Job
from specdec.decode import Request
from specdec.bench.prompts import load_prompts
from specdec.drafters.prompt_lookup import PromptLookup
class Old(PromptLookup):
    cheap = False
C, rounds, per = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
llm = LLM("smollm2-135m", dtype="q4")
ids = [llm.tokenizer.encode(p.turns[0], chat=True) for p in load_prompts("spec-bench")]
def mk(mode, old=False):
    e = Engine(llm.model, llm.tokenizer, cost=llm.cost_curve(), speculation=mode, max_batch=C,
               drafters={"prompt-lookup": Old} if old else None)
    e.picker = None
    return e
engines = {"new": mk("auto"), "old": mk("auto", True), "never": mk("never")}
modes = list(engines); nxt = dict.fromkeys(modes, 0)
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
    for m in modes[r % 3:] + modes[:r % 3]:
        rates[m].append(run(m, per))
    print(r, {m: round(rates[m][-1], 1) for m in modes}, flush=True)
for m in modes:
    print(m, "median", round(statistics.median(rates[m]), 1), {o: round(statistics.median(a / b for a, b in zip(rates[m], rates[o])), 3) for o in modes if o != m})
for m in ("new", "old"):
    print(m, "drafted/accepted", engines[m].metrics.totals)
