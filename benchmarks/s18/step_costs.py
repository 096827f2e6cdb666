"""Where a batched step's time goes (session 18): in-process engines (no HTTP) in the three modes, each kept at
C requests on Spec-Bench prompts (SmolLM2 q4), rounds of N requests alternating; per decode-only step near a full
batch: positions, requests speculating, the packed forward's time and the whole step's (the rest is Python:
drafting, granting, verifying, streaming), and one least-squares fit of the forward's time over all modes.
Run from the repository root: PYTHONPATH=. .venv/bin/python benchmarks/s18/step_costs.py C N ROUNDS"""
import sys, time, statistics
import numpy as np
from specdec.api import LLM
from specdec.bench.prompts import load_prompts
from specdec.decode import Request
from specdec.serving import batch as B
from specdec.serving import engine as E
from specdec.serving.engine import Engine, Job
C, n, rounds = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
llm = LLM("smollm2-135m", dtype="q4")
curve = llm.cost_curve()
ids = [llm.tokenizer.encode(p.turns[0], chat=True) for p in load_prompts("spec-bench")]
rows = []
orig = B.packed_forward
def pf(model, segments, layers=()):
    t = time.perf_counter(); out = orig(model, segments, layers); dt = time.perf_counter() - t
    pre = sum(len(s) for s in segments if not s.logits); dec = [len(s) for s in segments if s.logits]
    rows.append((pre, len(dec), sum(dec), sum(1 for x in dec if x > 1), dt)); return out
E.packed_forward = pf
modes = ("never", "auto", "always")
engines = {}
for m in modes:
    engines[m] = Engine(llm.model, llm.tokenizer, cost=curve, speculation=m, max_batch=C); engines[m].picker = None
data = {m: [] for m in modes}; steps = {m: [] for m in modes}
for r in range(rounds):
    for m in modes:
        eng = engines[m]; sub = [0]; done = [0]
        def ev(e): done[0] += e.finish_reason is not None
        rows.clear(); t0 = time.perf_counter(); nsteps = 0
        while done[0] < n:
            while sub[0] < n and sub[0] - done[0] < C:
                eng.submit(Job(ids[(sub[0] + r * n) % len(ids)], Request(max_new_tokens=64), method="prompt-lookup", on_event=ev)); sub[0] += 1
            ts = time.perf_counter(); eng.step(); steps[m].append((rows[-1], time.perf_counter() - ts))
        data[m] += [x for x in rows if x[0] == 0 and x[1] >= C - 2]
for m in modes:
    d = data[m]
    X = np.array([[1, x[2], x[3]] for x in d]); y = np.array([x[4] for x in d]) * 1e3
    st = [s for (x, s) in steps[m] if x[0] == 0 and x[1] >= C - 2]
    print(f"{m}: {len(d)} steps: positions {X[:,1].mean():.1f}, speculating requests {X[:,2].mean():.1f}, forward {np.median(y):.1f} ms, step {np.median(st)*1e3:.1f} ms")
allX = np.array([[1, x[2], x[3]] for m in modes for x in data[m]]); ally = np.array([x[4] for m in modes for x in data[m]]) * 1e3
coef = np.linalg.lstsq(allX, ally, rcond=None)[0]
print(f"fit over all: forward ms = {coef[0]:.1f} + {coef[1]:.2f} x positions + {coef[2]:.2f} x speculating requests")
print("probe curve:", {k: round(curve(k), 2) for k in (1, 8, 16, 24, 32)})
