"""Where a server step's time goes with prompts arriving: one in-process engine (no HTTP) kept at C requests in
flight on Spec-Bench prompts (greedy, 64 new tokens, prompt lookup) until N are done, each step timed and sorted
into steps that prefilled a prompt piece beside decoding requests and decode-only steps. The tail of the
inter-token latency is the prefill steps'. Run from the repository root, alone on the machine:

    PYTHONPATH=. .venv/bin/python benchmarks/s22/step_times.py C MODE N      # e.g. 4 always 24
"""
import statistics
import sys
import time

from specdec.api import LLM
from specdec.bench.prompts import load_prompts
from specdec.decode import Request
from specdec.serving import engine as engine_module
from specdec.serving.engine import Engine, Job

C, mode, per = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
llm = LLM("smollm2-135m", dtype="q4")
ids = [llm.tokenizer.encode(p.turns[0], chat=True) for p in load_prompts("spec-bench")]
engine = Engine(llm.model, llm.tokenizer, cost=llm.cost_curve(), speculation=mode, max_batch=C)
steps = []  # [decoding requests, prompt positions, draft positions, seconds]
real = engine_module.packed_forward


def spy(model, segments, layers=()):
    steps.append([sum(1 for s in segments if s.logits), sum(len(s) for s in segments if not s.logits),
                  sum(len(s) - 1 for s in segments if s.logits)])
    return real(model, segments, layers)


engine_module.packed_forward = spy
done, sent = [0], 0


def on_event(e):
    done[0] += e.finish_reason is not None


while done[0] < per:
    while sent < per and sent - done[0] < C:
        engine.submit(Job(ids[sent % len(ids)], Request(max_new_tokens=64), method="prompt-lookup", on_event=on_event))
        sent += 1
    t0, before = time.perf_counter(), len(steps)
    engine.step()
    if len(steps) > before:
        steps[-1].append(time.perf_counter() - t0)


def q(xs, p):
    return sorted(xs)[int(p * (len(xs) - 1))] * 1e3 if xs else float("nan")


beside = [s for s in steps if s[0] and s[1]]
alone = [s[3] for s in steps if s[0] and not s[1]]
print(f"C = {C}, {mode}: {len(steps)} steps; {len(beside)} prefilled beside decoding: "
      f"p50 {q([s[3] for s in beside], .5):.1f} ms, max {q([s[3] for s in beside], 1):.1f}, "
      f"{statistics.fmean(s[1] for s in beside):.1f} prompt and "
      f"{statistics.fmean(s[2] for s in beside):.2f} draft positions on average; "
      f"decode-only p50 {q(alone, .5):.1f} ms, "
      f"p99 {q(alone, .99):.1f}; every decoding step p50 {q([s[3] for s in steps if s[0]], .5):.1f}, "
      f"p99 {q([s[3] for s in steps if s[0]], .99):.1f}")
