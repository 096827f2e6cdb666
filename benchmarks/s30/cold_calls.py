# Session 30: small calls timed right after a SmolLM2 q4 forward against warm (median of 300); output in cold-calls.txt
import time, statistics as st, torch
from specdec.api import LLM
from specdec.serving.batch import Segment, packed_forward
from specdec.draft import Draft
from specdec.runtime.kernels import ops
llm = LLM("smollm2-135m", dtype="q4"); m = llm.model
cache = m.new_cache(1024); ids = list(range(100, 400))
packed_forward(m, [Segment(cache, ids, logits=False)]); base = cache.length
x = torch.randn(2, 49152)
def after(f, n=300, fwd=True):
    ts = []
    for _ in range(n):
        if fwd:
            cache.length = base; packed_forward(m, [Segment(cache, ids[:1])])
        a = time.perf_counter(); f(); ts.append(time.perf_counter() - a)
    return round(st.median(ts) * 1e6, 1)
for name, f in [("Draft from tensors", lambda: Draft(torch.tensor([5]), torch.tensor([-1]))),
                ("Draft from lists", lambda: Draft([5], [-1])), ("topk", lambda: x.topk(4, dim=-1).indices.tolist()),
                ("ops.topk_rows", lambda: ops.topk_rows(x, 4).tolist()),
                ("tensor", lambda: torch.tensor([1, 2])), ("py", lambda: sum(range(200)))]:
    print(name, "after fwd", after(f), "warm", after(f, fwd=False))
