"""Load in the main thread, decode in another, and decode in the main thread: with specdec.LLM releasing the
pool after loading and after each generation (new) against keeping it (old), alternating in one process."""
import statistics, sys, threading, time
import torch
import specdec.api
from specdec import LLM
from specdec.runtime.threads import release_threads

model, dtype, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
llm = LLM(model, dtype=dtype)
prompt = "def add(a, b):\n    return a + b\n\nExplain this function and write three tests for it."
a = torch.randn(512, 512)

def timed(f):
    t = time.perf_counter(); f(); return time.perf_counter() - t

def gen():
    llm.generate(prompt, max_new_tokens=64)

def in_thread():
    out = []
    th = threading.Thread(target=lambda: out.append(timed(gen))); th.start(); th.join()
    return out[0]

rows = {k: [] for k in ("old: thread after main's pool", "new: thread after release",
                        "old: main, pool kept", "new: main after release")}
gen()
for r in range(n):
    specdec.api.release_threads = lambda: 1      # old behaviour: nothing released
    a @ a                                         # the main thread has run parallel code: its pool exists
    rows["old: thread after main's pool"].append(in_thread())
    gen()
    rows["old: main, pool kept"].append(timed(gen))
    specdec.api.release_threads = release_threads  # new
    gen()                                          # ends with the main thread's pool released
    rows["new: thread after release"].append(in_thread())
    gen()
    rows["new: main after release"].append(timed(gen))
for k, v in rows.items():
    print(f"{k:32s} median {statistics.median(v)*1000:7.1f} ms  [{' '.join('%.0f' % (x*1000) for x in v)}]")
