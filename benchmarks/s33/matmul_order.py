"""The quantized matmuls of one SmolLM2 forward at one position, called alone in the forward's order (weights
streaming from memory as in a forward) and in other mixes, with 2 and 1 threads: ms and GB/s of packed weights.
Run from the repository root with nothing else running:

    PYTHONPATH=. .venv/bin/python benchmarks/s33/matmul_order.py [q4|q8]
"""

import statistics
import sys
import time

import torch

from specdec.api import LLM
from specdec.runtime.kernels import quant
from specdec.runtime.model import QLinear


def projections(dtype: str = "q4") -> list[QLinear]:
    """SmolLM2's quantized projections in the forward's order: each layer's qkv, o, gate|up, down, then the head."""
    return [m for m in LLM("smollm2-135m", dtype=dtype).model.modules() if isinstance(m, QLinear)]


def sweep(mods, n=1, threads=None, reps=25, steps=5) -> float:
    """Median ms of one pass over `mods` (n positions each)."""
    xs = [torch.randn(n, m.in_features) for m in mods]
    ys = [torch.empty(n, m.out_features) for m in mods]
    ts = []
    for r in range(reps + 1):
        t = time.perf_counter()
        for _ in range(steps):
            for m, x, y in zip(mods, xs, ys):
                quant.matmul_parts(y, x, m.calls, threads=threads, use=m.use)
        if r:
            ts.append((time.perf_counter() - t) / steps * 1e3)
    return statistics.median(ts)


def nbytes(mods) -> int:
    return sum(p.nbytes for m in mods for p in m.parts)


def main():
    L = projections(sys.argv[1] if len(sys.argv) > 1 else "q4")
    for name, mods in [("all, model order", L), ("layers only", L[:-1]), ("head only", L[-1:]),
                       ("o_proj of layer 0 x121 (cached)", [L[1]] * 121),
                       ("gate_up of layer 0 x121 (L2/L3)", [L[2]] * 121)]:
        for th in (2, 1):
            t = sweep(mods, threads=th)
            print(f"{name:36s} threads {th}: {t:.2f} ms, {nbytes(mods) / t / 1e6:.1f} GB/s, "
                  f"{t * 1e3 / len(mods):.1f} us a call")


if __name__ == "__main__":
    main()
