# Session 29: one packed forward of SmolLM2 q4 over n = 1, 2, 3, 4, 8 positions at context 300 (median of 200), three
# rounds; output in packed-widths.txt
import time, statistics as st, torch
from specdec.api import LLM
from specdec.serving.batch import Segment, packed_forward
llm = LLM("smollm2-135m", dtype="q4")
m = llm.model
cache = m.new_cache(1024)
ids = list(range(100, 400))
packed_forward(m, [Segment(cache, ids, logits=False)])
base = cache.length
def t(n, reps=200):
    ts = []; tl = []
    for _ in range(reps):
        cache.length = base
        a = time.perf_counter(); packed_forward(m, [Segment(cache, ids[:n])]); ts.append(time.perf_counter() - a)
    return st.median(ts) * 1e3
for rep in range(3):
    print([(n, round(t(n), 3)) for n in (1, 2, 3, 4, 8)])
# head alone
for n in (1, 2, 4):
    xs = torch.randn(1, n, 576)
    ts = []
    for _ in range(200):
        a = time.perf_counter(); m.lm_head(m.norm(xs)); ts.append(time.perf_counter() - a)
    print("head", n, round(st.median(ts) * 1e3, 3))
