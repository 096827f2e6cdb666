# Session 30 (AMD Zen 4): the engine's step and LLM.generate's speed with one code version (whichever `specdec` is
# imported: run with PYTHONPATH set to a checkout); `step_ab.sh` alternates two versions. One SmolLM2 q4 request,
# HumanEvalFix dev, 64 tokens: the server engine's decode steps (plain, recycling 1 node k 1, 2 nodes k auto) and
# the single-request API (plain, recycling). Prints one JSON line.
import json, statistics as st, sys, time
import specdec
from specdec.api import LLM
from specdec.bench.prompts import load_prompts
from specdec.decode import Request
from specdec.drafters.recycling import Recycling
from specdec.serving.engine import Engine, Job
llm = LLM("smollm2-135m", dtype="q4")
prompts = load_prompts("humanevalfix")[:8]
cfgs = [("never", 1, "auto"), ("always", 1, 1), ("always", 2, "auto")]
recs = {n: Recycling(nodes=n) for n in (1, 2)}
def engine_run(mode, nodes, k, p):
    eng = Engine(llm.model, llm.tokenizer, cost=llm.cost_curve(), speculation=mode, drafters={"recycling": recs[nodes].fresh})
    toks, steps = [], []
    eng.submit(Job(llm.tokenizer.encode(p.turns[0]), Request(max_new_tokens=64), method="recycling", k=k,
                   on_event=lambda e: toks.extend(e.tokens)))
    t0, first = time.perf_counter(), True
    while eng.busy:
        t = time.perf_counter(); eng.step(); d = time.perf_counter() - t
        if not first: steps.append(d)
        first = False
    return time.perf_counter() - t0, len(toks), steps
def api_run(method, p):
    t = time.perf_counter(); r = llm.generate(p.turns[0], max_new_tokens=64, method=method)
    return time.perf_counter() - t, r.new_tokens
for c in cfgs: engine_run(*c, prompts[0])
for m in ("plain", "recycling"): api_run(m, prompts[0])
res, api = {c: [] for c in cfgs}, {m: [] for m in ("plain", "recycling")}
for p in prompts:
    for c in cfgs: res[c].append(engine_run(*c, p))
    for m in api: api[m].append(api_run(m, p))
out = {"code": specdec.__file__}
for c, rs in res.items():
    steps = [s for r in rs for s in r[2]]
    out["engine %s %s %s" % c] = {"tok/s": round(sum(r[1] for r in rs) / sum(r[0] for r in rs), 1),
                                  "step p50 ms": round(1e3 * st.median(steps), 3)}
for m, rs in api.items():
    out["api " + m] = {"tok/s": round(sum(r[1] for r in rs) / sum(r[0] for r in rs), 1)}
print(json.dumps(out))
