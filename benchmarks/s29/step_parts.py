# Session 29: decode-only server steps split into before the forward (grants, drafting), the forward, and after it
# (verification, bookkeeping, streaming): plain against a 1-node recycling draft (k = 1); output in step-parts.txt
import time, statistics as st
from specdec.api import LLM
from specdec.bench.prompts import load_prompts
from specdec.decode import Request
from specdec.drafters.recycling import Recycling
from specdec.serving import engine as E
from specdec.serving.engine import Engine, Job
llm = LLM("smollm2-135m", dtype="q4")
prompts = load_prompts("humanevalfix")[:8]
rec = Recycling(nodes=1)
marks = []
orig_pf = E.packed_forward
def pf(*a, **k):
    marks.append(("f0", time.perf_counter())); o = orig_pf(*a, **k); marks.append(("f1", time.perf_counter())); return o
E.packed_forward = pf
def run(mode, p):
    eng = Engine(llm.model, llm.tokenizer, cost=llm.cost_curve(), speculation=mode, drafters={"recycling": rec.fresh})
    eng.submit(Job(llm.tokenizer.encode(p.turns[0]), Request(max_new_tokens=64), method="recycling", k=1))
    out = []
    while eng.busy:
        marks.clear(); pre = any(not s.decoding for s in eng.running) or eng.waiting
        t0 = time.perf_counter(); eng.step(); t1 = time.perf_counter()
        if not pre and marks:
            f0, f1 = marks[0][1], marks[1][1]
            out.append((f0 - t0, f1 - f0, t1 - f1))
    return out
for m in ("never", "always"): run(m, prompts[0])
for m in ("never", "always", "never", "always"):
    rows = [r for p in prompts for r in run(m, p)]
    print(m, len(rows), "pre %.3f fwd %.3f post %.3f ms" % tuple(1e3 * st.median(r[i] for r in rows) for i in range(3)))
