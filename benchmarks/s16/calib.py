"""In-process engine (session 16), auto's model arm only (picker off): the predicted E[tokens] - 1 of the granted
asks against the tokens they had accepted. "old": prompt lookup drafting after the grant, as before session 16.
Run from the repository root: PYTHONPATH=. .venv/bin/python benchmarks/s16/calib.py C N [old]"""
import sys, time
from specdec.api import LLM
from specdec.serving import engine as E, scheduler
from specdec.serving.engine import Engine, Job
from specdec.decode import Request
from specdec.bench.prompts import load_prompts
from specdec.drafters.prompt_lookup import PromptLookup


class Old(PromptLookup):
    cheap = False


C, n = int(sys.argv[1]), int(sys.argv[2])
llm = LLM("smollm2-135m", dtype="q4")
ids = [llm.tokenizer.encode(p.turns[0], chat=True) for p in load_prompts("spec-bench")]
eng = Engine(llm.model, llm.tokenizer, cost=llm.cost_curve(), speculation="auto", max_batch=C,
             drafters={"prompt-lookup": Old} if sys.argv[3:] == ["old"] else None)
eng.picker = None  # the model's grants on every step
pred = {}; stats = {"pred": 0.0, "acc": 0, "asks": 0, "k": 0}
orig = scheduler.grant
def grant(asks, *a, **kw):
    g = orig(asks, *a, **kw)
    for x in asks:
        if g[x.name]: pred[x.name] = (x.tokens - 1, g[x.name], x.probe)
    return g
E.scheduler.grant = grant
ov = eng._verify
def verify(slot, k, draft, *a):
    before = len(slot.stopper.ids)
    r = ov(slot, k, draft, *a)
    if k and slot.job.id in pred:
        p, kk, probe = pred.pop(slot.job.id)
        stats["pred"] += p; stats["acc"] += r - 1 if r else 0; stats["asks"] += 1; stats["k"] += kk
        stats.setdefault("probe", 0); stats["probe"] += probe
        stats.setdefault("depth", 0); stats["depth"] += draft.depth
        stats.setdefault("empty", 0); stats["empty"] += draft.depth == 0
        if draft.depth: stats.setdefault("pred_nonempty", 0.0); stats["pred_nonempty"] += p; stats.setdefault("acc_nonempty", 0); stats["acc_nonempty"] += r - 1
    return r
eng._verify = verify
sub = done = 0
def ev(e):
    global done
    if e.finish_reason: done += 1
t = time.perf_counter()
while done < n:
    while sub < n and sub - done < C:
        eng.submit(Job(ids[sub % len(ids)], Request(max_new_tokens=64), method="prompt-lookup", on_event=ev)); sub += 1
    eng.step()
print(C, stats, "realized/predicted", stats["acc"] / max(stats["pred"], 1e-9), "overhead", eng.overhead)
