"""torch.argmax against ops.argmax (greedy verification's) on rows of logits of SmolLM2's and the 1.5B's
vocabularies. Run from the repository root: PYTHONPATH=. .venv/bin/python benchmarks/s18/argmax_bench.py"""
import time

import torch

from specdec.runtime.kernels import ops

for rows, vocab in ((1, 49152), (5, 49152), (1, 151936), (5, 151936)):
    x = torch.randn(rows, vocab)
    spent = []
    for f in (lambda: x.argmax(-1), lambda: ops.argmax(x)):
        for _ in range(100):
            f()
        t = time.perf_counter()
        for _ in range(2000):
            f()
        spent.append((time.perf_counter() - t) / 2000 * 1e6)
    print(f"{rows} x {vocab}: torch.argmax {spent[0]:.1f} us, ops.argmax {spent[1]:.1f} us")
