"""SmolLM2 bf16 (session 16, #16 lead): forwards over 1 and 16 positions at context 256, timed; with an argument n,
then 12 s of n-position forwards for `perf record`. Run from the repository root:
    PYTHONPATH=. .venv/bin/python benchmarks/s16/fwd_smollm2_bf16.py [n]"""
import sys, time, torch, statistics
from specdec.api import LLM
llm = LLM("smollm2-135m", dtype="bf16"); m = llm.model
cache = m.new_cache(256 + 64)
ctx = torch.randint(0, 1000, (1, 256))
with torch.inference_mode():
    m(ctx, cache)
    def t(n, reps=30):
        x = torch.randint(0, 1000, (1, n)); out = []
        for _ in range(reps):
            a = time.perf_counter(); m(x, cache); out.append(time.perf_counter() - a); cache.rewind(n)
        return statistics.median(out)
    for r in range(3):
        a, b = t(1), t(16)
        print(f"n=1 {a*1e3:.2f} ms  n=16 {b*1e3:.2f} ms  ratio {b/a:.2f}", flush=True)
    if len(sys.argv) > 1:
        n = int(sys.argv[1]); x = torch.randint(0, 1000, (1, n)); end = time.time() + 12
        while time.time() < end:
            m(x, cache); cache.rewind(n)
