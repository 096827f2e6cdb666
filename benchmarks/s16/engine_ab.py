"""In-process engines (no HTTP), one per variant, each kept at C requests in flight, the variants alternating in
rounds so the machine's phases hit them alike (session 16). Run from the repository root:

    PYTHONPATH=. .venv/bin/python benchmarks/s16/engine_ab.py MODEL C ROUNDS N [VARIANTS]

VARIANTS (default auto,always,never): a server mode, or the model's grants alone (no arm picker): "model",
"model-after" (prompt lookup drafting after the grant, as before session 16), "model-whole" (a chain granted
all or none, as before session 16). Prints each round's tokens/s, then medians and the paired ratios."""
import dataclasses
import statistics
import sys
import time

from specdec.api import LLM
from specdec.bench.prompts import load_prompts
from specdec.decode import Request
from specdec.drafters.prompt_lookup import PromptLookup
from specdec.serving import scheduler
from specdec.serving.engine import Engine, Job


class DraftsAfterTheGrant(PromptLookup):
    cheap = False


name, C, rounds, per = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
variants = sys.argv[5].split(",") if len(sys.argv) > 5 else ["auto", "always", "never"]
llm = LLM(name, dtype="q4")
ids = [llm.tokenizer.encode(p.turns[0], chat=True) for p in load_prompts("spec-bench")]
running = [""]
real = scheduler.grant
scheduler.grant = lambda asks, *a, **kw: real(
    [dataclasses.replace(x, shorter=()) for x in asks] if running[0] == "model-whole" else asks, *a, **kw)


def engine(v: str) -> Engine:
    e = Engine(llm.model, llm.tokenizer, cost=llm.cost_curve(), speculation=v.split("-")[0].replace("model", "auto"),
               max_batch=C, drafters={"prompt-lookup": DraftsAfterTheGrant} if v == "model-after" else None)
    if v.startswith("model"):
        e.picker = None
    return e


engines = {v: engine(v) for v in variants}
submitted = dict.fromkeys(variants, 0)


def run(v: str, n: int) -> float:
    running[0], eng, done, tokens = v, engines[v], [0], [0]

    def on_event(e):
        tokens[0] += len(e.tokens)
        done[0] += e.finish_reason is not None

    sent, t = 0, time.perf_counter()
    while done[0] < n:
        while sent < n and sent - done[0] < C:
            eng.submit(Job(ids[submitted[v] % len(ids)], Request(max_new_tokens=64), method="prompt-lookup",
                           on_event=on_event))
            submitted[v] += 1
            sent += 1
        eng.step()
    return tokens[0] / (time.perf_counter() - t)


rates = {v: [] for v in variants}
for r in range(rounds):
    for v in variants[r % len(variants):] + variants[:r % len(variants)]:
        rates[v].append(run(v, per))
    print(r, {v: round(rates[v][-1], 1) for v in variants}, flush=True)
for v in variants:
    print(v, "median", round(statistics.median(rates[v]), 1),
          {o: round(statistics.median(a / b for a, b in zip(rates[v], rates[o])), 3) for o in variants if o != v})
    if engines[v].picker:
        print("  picker", engines[v].picker.current)
    print("  drafted, accepted", engines[v].metrics.totals)
