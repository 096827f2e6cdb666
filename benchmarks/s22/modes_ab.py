"""The batched engine's speculation modes in one process (no HTTP), rounds alternating: each mode's engine kept at
C requests in flight on Spec-Bench prompts (greedy, 64 new tokens, prompt lookup) until N requests are done, per
round; the order reverses every round. Modes: auto (with its arm picker, whose own estimates are printed at the
end), always, never, and model:H (the model's grants alone, picker off, with hurdle H; scheduler.grant's default
is 0.2). Run from the repository root, alone on the machine:

    PYTHONPATH=. .venv/bin/python benchmarks/s22/modes_ab.py C ROUNDS N [MODES]
    PYTHONPATH=. .venv/bin/python benchmarks/s22/modes_ab.py 1 6 8 model:0.2,model:0,always,auto,never
"""
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "s18"))
from engine_ab import rate  # noqa: E402

from specdec.api import LLM  # noqa: E402
from specdec.bench.prompts import load_prompts  # noqa: E402
from specdec.serving import scheduler  # noqa: E402
from specdec.serving.engine import Engine  # noqa: E402

C, rounds, per = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
modes = sys.argv[4].split(",") if len(sys.argv) > 4 else ["auto", "always", "never"]
llm = LLM("smollm2-135m", dtype="q4")
ids = [llm.tokenizer.encode(p.turns[0], chat=True) for p in load_prompts("spec-bench")]
curve = llm.cost_curve()
engines, hurdles = {}, {}
for m in modes:
    name, _, h = m.partition(":")
    engines[m] = Engine(llm.model, llm.tokenizer, cost=curve, speculation="auto" if name == "model" else name,
                        max_batch=C)
    if name == "model":
        engines[m].picker, hurdles[m] = None, float(h or 0.2)
real, hurdle = scheduler.grant, [0.2]
scheduler.grant = lambda *a, **k: real(*a, hurdle=hurdle[0], **k)  # the engine calls it through the module
rates = {m: [] for m in modes}
for r in range(rounds):
    for m in modes if r % 2 == 0 else modes[::-1]:
        hurdle[0] = hurdles.get(m, 0.2)
        rates[m].append(rate(engines[m], ids, C, per, r * per))
    print(r, {m: round(v[-1], 1) for m, v in rates.items()}, flush=True)
base = modes[-1]
for m in modes:
    print(f"C={C} {m}: {statistics.median(rates[m]):.1f} tok/s; x {base} "
          f"{statistics.median(a / b for a, b in zip(rates[m], rates[base])):.3f} (median of {rounds} paired rounds)")
picker = engines["auto"].picker if "auto" in engines else None
if picker:
    print("auto's picker:", {picker.span(b): picker.estimates(b) for b in picker.current})
