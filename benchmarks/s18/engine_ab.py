"""Session 18's Python-side changes in the batched engine, before and after (`decode_ab.OLD` / `NEW`), in one
process: one in-process engine (no HTTP) kept at C requests in flight on Spec-Bench prompts, rounds of N
requests alternating old and new code. Mode `auto` runs the model's grants (the arm picker off), as
session 16's engine_ab.py. Run from the repository root:

    PYTHONPATH=. .venv/bin/python benchmarks/s18/engine_ab.py C ROUNDS N [MODE]
"""
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from decode_ab import NEW, OLD, use  # noqa: E402

from specdec.api import LLM  # noqa: E402
from specdec.bench.prompts import load_prompts  # noqa: E402
from specdec.decode import Request  # noqa: E402
from specdec.serving.engine import Engine, Job  # noqa: E402


def rate(engine: Engine, ids: list[list[int]], C: int, per: int, first: int) -> float:
    """Tokens/s of `engine` kept at C requests in flight until `per` requests (prompts ids[first..], greedy, 64
    new tokens, prompt lookup) are done. Also used by benchmarks/s19/kv_ab.py."""
    done, tokens, sent = [0], [0], 0

    def on_event(e):
        tokens[0] += len(e.tokens)
        done[0] += e.finish_reason is not None

    t = time.perf_counter()
    while done[0] < per:
        while sent < per and sent - done[0] < C:
            engine.submit(Job(ids[(first + sent) % len(ids)], Request(max_new_tokens=64), method="prompt-lookup",
                              on_event=on_event))
            sent += 1
        engine.step()
    return tokens[0] / (time.perf_counter() - t)


def main():
    C, rounds, per = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    mode = sys.argv[4] if len(sys.argv) > 4 else "auto"
    llm = LLM("smollm2-135m", dtype="q4")
    ids = [llm.tokenizer.encode(p.turns[0], chat=True) for p in load_prompts("spec-bench")]
    engine = Engine(llm.model, llm.tokenizer, cost=llm.cost_curve(), speculation=mode, max_batch=C)
    engine.picker = None
    rates = {"old": [], "new": []}
    for r in range(rounds):
        for name, code in ((("old", OLD), ("new", NEW)) if r % 2 == 0 else (("new", NEW), ("old", OLD))):
            use(code)
            rates[name].append(rate(engine, ids, C, per, r * per))
        print(r, {k: round(v[-1], 1) for k, v in rates.items()}, flush=True)
    print(f"C = {C}, {mode}: old {statistics.median(rates['old']):.1f} tok/s, new {statistics.median(rates['new']):.1f}; "
          f"new / old {statistics.median(n / o for n, o in zip(rates['new'], rates['old'])):.3f} (median of {rounds} rounds)")


if __name__ == "__main__":
    main()
