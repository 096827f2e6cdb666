"""Offline race of the server's speculation modes: three engines on one model, the same greedy jobs at
concurrency c (a new job joins as one finishes), no HTTP (the engine alone), modes interleaved and rotated per
repeat. Prints each mode's tokens/s per run and auto's arms.
Usage: python engine_race.py MODEL [DTYPE] [C,C,...] [REQUESTS] [REPEAT] [METHOD] [MODES: auto,always,never,model]"""

import statistics
import sys
import time

from specdec.api import LLM
from specdec.bench.prompts import load_prompts
from specdec.decode import Request
from specdec.serving.engine import Engine, Job

model = sys.argv[1]
dtype = sys.argv[2] if len(sys.argv) > 2 else "auto"
levels = [int(c) for c in (sys.argv[3] if len(sys.argv) > 3 else "1,2,4,8,16").split(",")]
requests = int(sys.argv[4]) if len(sys.argv) > 4 else 32
repeat = int(sys.argv[5]) if len(sys.argv) > 5 else 3
method = sys.argv[6] if len(sys.argv) > 6 else "prompt-lookup"
llm = LLM(model, dtype=dtype)
cost = llm.cost_curve(measure=True)
prompts = [llm.tokenizer.encode(p.turns[0], chat=True) for p in load_prompts("spec-bench")]
drafters = {"recycling": llm.drafter("recycling").fresh}
modes = (sys.argv[7] if len(sys.argv) > 7 else "auto,always,never").split(",")
engines = {m: Engine(llm.model, llm.tokenizer, cost=cost, speculation="auto" if m == "model" else m, max_batch=16,
                     drafters=drafters) for m in modes}
if "model" in engines:  # auto without the measured arms: the cost model's grants alone
    engines["model"].picker = None


def run(engine, c):
    todo, out = list(range(requests)), []

    def submit():
        i = todo.pop(0)
        engine.submit(Job(prompts[i % len(prompts)], Request(max_new_tokens=64), method=method,
                          on_event=lambda e: e.finish_reason and out.append(e.completion_tokens)))

    for _ in range(min(c, len(todo))):
        submit()
    t0 = time.perf_counter()
    while engine.busy:
        n = len(out)
        engine.step()
        for _ in range(len(out) - n):
            if todo:
                submit()
    return sum(out) / (time.perf_counter() - t0)


for c in levels:
    rates = {m: [] for m in engines}
    arms0 = {a: engines["auto"].metrics.arms.labels(a)._value.get() for a in ("model", "never", "always")}
    for r in range(repeat):
        for m in list(engines)[r % len(engines):] + list(engines)[:r % len(engines)]:
            rates[m].append(run(engines[m], c))
    arms = {a: engines["auto"].metrics.arms.labels(a)._value.get() - arms0[a] for a in arms0}
    med = {m: statistics.median(v) for m, v in rates.items()}
    print(f"c={c:2d} " + "  ".join(f"{m} {med[m]:6.1f} ({' '.join(f'{x:.0f}' for x in v)})" for m, v in rates.items())
          + f"  auto/best {med['auto'] / max(med['always'], med['never']):.3f}  arms {arms}", flush=True)
