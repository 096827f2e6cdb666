"""Auto against never at C requests in one process (no HTTP), rounds alternating: tokens/s, and each engine step's
wall time split by what the step did (prefill piece or decode only; the arm auto ran), to see where a mode's
inter-token latency comes from. Greedy, Spec-Bench prompts, prompt lookup, `--max-tokens` new tokens.

    PYTHONPATH=. .venv/bin/python benchmarks/s26/auto_steps.py --model qwen2.5-coder-1.5b --c 16 --rounds 4
"""
import argparse
import statistics
import time
from collections import defaultdict

from specdec.api import LLM
from specdec.bench.prompts import load_prompts
from specdec.serving.engine import Engine, Job
from specdec.decode import Request

ap = argparse.ArgumentParser()
ap.add_argument("--model", default="qwen2.5-coder-1.5b")
ap.add_argument("--dtype", default="q4")
ap.add_argument("--c", type=int, default=16)
ap.add_argument("--rounds", type=int, default=4)
ap.add_argument("--per", type=int, default=32, help="requests a round")
ap.add_argument("--max-tokens", type=int, default=32)
ap.add_argument("--modes", default="auto,never")
args = ap.parse_args()
llm = LLM(args.model, dtype=args.dtype)
ids = [llm.tokenizer.encode(p.turns[0], chat=True) for p in load_prompts("spec-bench")]
curve = llm.cost_curve()
modes = args.modes.split(",")
engines = {m: Engine(llm.model, llm.tokenizer, cost=curve, speculation=m, max_batch=args.c) for m in modes}
rates, steps, itl = defaultdict(list), defaultdict(list), defaultdict(list)
from specdec.serving import engine as engine_module  # noqa: E402

real_forward, seen = engine_module.packed_forward, []


def recording_forward(model, segments, *a, **k):  # the step's positions: (prompt pieces, decode + drafts, requests)
    seen.append((sum(len(s) for s in segments if not s.logits), sum(len(s) for s in segments if s.logits),
                 sum(1 for s in segments if s.logits)))
    return real_forward(model, segments, *a, **k)


engine_module.packed_forward = recording_forward


def run(m, first):
    engine, done, tokens, last, sent = engines[m], [0], [0], {}, 0

    def on_event(e, k=None):
        now = time.perf_counter()
        tokens[0] += len(e.tokens)
        if e.tokens and k in last:
            itl[m].append(now - last[k])
        last[k] = now
        done[0] += e.finish_reason is not None

    t = time.perf_counter()
    while done[0] < args.per:
        while sent < args.per and sent - done[0] < args.c:
            k = sent
            engine.submit(Job(ids[(first + sent) % len(ids)], Request(max_new_tokens=args.max_tokens),
                              method="prompt-lookup", on_event=lambda e, k=k: on_event(e, k)))
            sent += 1
        s, before = time.perf_counter(), len(seen)
        engine.step()
        steps[m].append((time.perf_counter() - s, seen[-1] if len(seen) > before else (0, 0, 0)))
    rates[m].append(tokens[0] / (time.perf_counter() - t))


for r in range(args.rounds):
    for m in modes if r % 2 == 0 else modes[::-1]:
        run(m, r * args.per)
    print(f"round {r}: " + ", ".join(f"{m} {rates[m][-1]:.2f} tok/s" for m in modes), flush=True)
for m in modes:
    st = sorted(d for d, _ in steps[m])
    it = sorted(itl[m])
    print(f"{m}: tokens/s median {statistics.median(rates[m]):.2f}; steps {len(st)}, median {1e3 * st[len(st) // 2]:.1f} ms, "
          f"p90 {1e3 * st[int(.9 * len(st))]:.1f}, p99 {1e3 * st[int(.99 * len(st))]:.1f}; ITL p50 {1e3 * it[len(it) // 2]:.1f} ms, "
          f"p99 {1e3 * it[int(.99 * len(it))]:.1f} ms")
for m in modes:  # steps by kind: decode only, or with a prompt piece
    for kind, pick in (("decode only", lambda f: f[0] == 0 and f[1]), ("with a prompt piece", lambda f: f[0] > 0)):
        sel = [(d, f) for d, f in steps[m] if pick(f)]
        if sel:
            ds = sorted(d for d, _ in sel)
            print(f"{m} {kind}: {len(sel)} steps, median {1e3 * ds[len(ds) // 2]:.1f} ms, p90 {1e3 * ds[int(.9 * len(ds))]:.1f}; "
                  f"mean prompt positions {statistics.mean(f[0] for _, f in sel):.1f}, mean decode positions "
                  f"{statistics.mean(f[1] for _, f in sel):.1f}, mean requests {statistics.mean(f[2] for _, f in sel):.1f}")
for m in modes:
    if m != modes[-1]:
        print(f"{m} / {modes[-1]} tokens/s per round: " + " ".join(f"{a / b:.3f}" for a, b in zip(rates[m], rates[modes[-1]])))
if "auto" in engines and getattr(engines["auto"], "picker", None):
    for b in (1, 2, 4, 8, 16):
        print(f"auto's estimates at {b}: {engines['auto'].picker.estimates(b)}")
