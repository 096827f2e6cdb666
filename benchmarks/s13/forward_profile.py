"""SmolLM2 bf16 at n = 1 and n = 16 after 256 cached tokens: the whole forward, and the exact-attention kernel alone
over the same shapes (30 calls). Run from the repository root: PYTHONPATH=. .venv/bin/python benchmarks/s13/forward_profile.py"""
import statistics, time, sys, torch
from specdec.runtime.loader import load_transformer
from specdec.store import resolve
from specdec.runtime.kernels import attention as A

name = sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m"
model = load_transformer(resolve(name), torch.bfloat16)
cfg = model.cfg
ctx = 256
cache = model.new_cache(ctx + 64)
g = torch.Generator().manual_seed(0)
prompt = torch.randint(0, cfg.vocab_size, (1, ctx), generator=g)
model(prompt, cache, last_only=True)
def tf(n, last_only=False, reps=15):
    toks = torch.randint(0, cfg.vocab_size, (1, n), generator=g)
    ts = []
    for i in range(reps + 2):
        t0 = time.perf_counter(); model(toks, cache, last_only=last_only); dt = time.perf_counter() - t0
        cache.rewind(n)
        if i >= 2: ts.append(dt)
    return statistics.median(ts) * 1e3
H, Hk, D, L = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_layers
def ta(n, reps=15):
    q = torch.randn(1, H, n, D); k = torch.randn(1, Hk, ctx + 64, D); v = torch.randn(1, Hk, ctx + 64, D)
    rows = A.Rows.chain(n, ctx)
    ts = []
    for i in range(reps + 2):
        t0 = time.perf_counter()
        for _ in range(L): A.attend(q, k, v, rows)
        dt = time.perf_counter() - t0
        if i >= 2: ts.append(dt)
    return statistics.median(ts) * 1e3
for rnd in range(2):
    f1, f16, f16l = tf(1), tf(16), tf(16, last_only=True)
    a1, a16 = ta(1), ta(16)
    print(f"forward n=1 {f1:.2f} ms  n=16 {f16:.2f} ({f16/f1:.2f} steps)  n=16 last_only {f16l:.2f}  | attention x{L}: n=1 {a1:.2f}  n=16 {a16:.2f} ms")
