"""Session 14: at B = 1 (one request at a time, SmolLM2 q4, 16 Spec-Bench prompts), how often the model's grants
refuse an ask that always would run. `PYTHONPATH=. .venv/bin/python benchmarks/s14/b1_grants.py`"""
import sys
from collections import Counter
from specdec.api import LLM
from specdec.bench.prompts import load_prompts
from specdec.decode import Request
from specdec.serving import scheduler
from specdec.serving.engine import Engine, Job
llm = LLM("smollm2-135m", dtype="q4")
prompts = [p.turns[0] for p in load_prompts("spec-bench")][:16]
curve = llm.cost_curve(measure=True)
orig = scheduler.grant
stats = Counter()
def spy(asks, batch, prefill=0, mode="auto", budget=None, cost=None, overhead=0.0, hurdle=0.2):
    g = orig(asks, batch, prefill, mode, budget, cost, overhead, hurdle)
    if mode == "auto":
        for a in asks:
            stats["asks"] += 1
            stats["granted" if g[a.name] else "refused"] += 1; stats["probes"] += a.probe
            if not g[a.name]:
                stats[f"refused k={a.k} tokens<{(a.tokens - 1) // 0.1 * 0.1 + 0.1:.1f}"] += 1
        stats["overhead_sum"] += overhead; stats["calls"] += 1
    return g
scheduler.grant = spy
eng = Engine(llm.model, llm.tokenizer, cost=curve, speculation="auto", max_batch=1)
for p in prompts:
    eng.submit(Job(llm.tokenizer.encode(p, chat=True), Request(max_new_tokens=64), method="prompt-lookup"))
    while eng.busy: eng.step()
print({k: v for k, v in sorted(stats.items())})
print("mean overhead", stats["overhead_sum"] / max(stats["calls"], 1), "curve", [round(curve(n), 2) for n in range(1, 9)])
