"""Auto's arm picker over time in one process (no HTTP): an auto engine kept at C requests in flight on Spec-Bench
prompts (greedy, 64 new tokens, prompt lookup) for N requests a round; after each round, per batch bucket, the arm
it runs, how often it explores, and its estimates; every switch as it happens. Run from the repository root, alone:

    PYTHONPATH=. .venv/bin/python benchmarks/s23/picker_trace.py C ROUNDS N
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "s18"))
from engine_ab import rate  # noqa: E402

from specdec.api import LLM  # noqa: E402
from specdec.bench.prompts import load_prompts  # noqa: E402
from specdec.serving.engine import Engine  # noqa: E402

C, rounds, per = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
llm = LLM("smollm2-135m", dtype="q4")
ids = [llm.tokenizer.encode(p.turns[0], chat=True) for p in load_prompts("spec-bench")]
engine = Engine(llm.model, llm.tokenizer, cost=llm.cost_curve(), speculation="auto", max_batch=C)
picker, switch = engine.picker, engine.picker._switch


def traced(b, arm):
    print(f"  step {picker.steps.get(b)} of bucket {b}: {picker.current.get(b)} -> {arm}", flush=True)
    switch(b, arm)


picker._switch = traced
for r in range(rounds):
    tps = rate(engine, ids, C, per, r * per)
    print(r, f"{tps:.1f} tok/s", {picker.span(b): (picker.steps[b], picker.every.get(b, picker.explore),
                                                 picker.estimates(b)) for b in sorted(picker.current)}, flush=True)
