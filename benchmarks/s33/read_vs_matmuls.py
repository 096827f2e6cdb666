"""A plain read of 1 GiB (torch sum, 2 threads) and the SmolLM2 q4 forward's matmuls in its order
(benchmarks/s33/matmul_order.py), alternating, so that the machine's bandwidth phases hit both: GB/s of each and
their ratio, per round. Run from the repository root with nothing else running:

    PYTHONPATH=. .venv/bin/python benchmarks/s33/read_vs_matmuls.py
"""

import statistics
import time

import torch

from matmul_order import nbytes, projections, sweep


def read_gbs(x: torch.Tensor, repeats: int = 5) -> float:
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        float(x.sum())
        ts.append(time.perf_counter() - t)
    return x.numel() * 4 / statistics.median(ts) / 1e9


def main():
    L = projections()
    x = torch.ones(2**28, dtype=torch.float32)
    read_gbs(x, 2)
    for r in range(6):
        read = read_gbs(x)
        mm = nbytes(L) / sweep(L, reps=15) / 1e6
        print(f"round {r}: read {read:.1f} GB/s, the forward's matmuls {mm:.1f} GB/s ({mm / read:.0%} of the read)")


if __name__ == "__main__":
    main()
