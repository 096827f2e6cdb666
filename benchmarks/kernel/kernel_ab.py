"""A/B two versions of the bf16 skinny-GEMM kernel (specdec/runtime/kernels/skinny.c) side by side.

Both sources are compiled with the package's flags and loaded with ctypes; for every weight shape of
Qwen2.5-Coder-1.5B and every n, the two run interleaved (A, B, A, B, ...) after one warm-up each, so
machine drift hits both alike; the table gives medians in ms, B/A, and the model's matmul total
(28 layers + LM head). Run from the repository root:

    git show eb06efc:specdec/runtime/kernels/skinny.c > /tmp/skinny_old.c
    .venv/bin/python benchmarks/kernel/kernel_ab.py /tmp/skinny_old.c specdec/runtime/kernels/skinny.c \
        --n 1,2,3,4,5,8,16,64 --reps 11
"""

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from specdec.runtime.kernels import CFLAGS

SHAPES = {"qkv": (2048, 1536), "o": (1536, 1536), "gate_up": (17920, 1536), "down": (1536, 8960),
          "lm": (151936, 1536)}  # (out, in); each layer's four, 28 layers, then the LM head once
LAYERS = 28


def load(src: str, folder: Path):
    so = folder / (Path(src).stem + f"-{len(list(folder.iterdir()))}.so")
    subprocess.run(["gcc", *CFLAGS, src, "-o", str(so)], check=True)
    lib = ctypes.CDLL(str(so))
    lib.skinny_bf16.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    return lib


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a", help="kernel source A (the baseline)")
    ap.add_argument("b", help="kernel source B")
    ap.add_argument("--n", default="1,2,3,4,8,16,64", help="positions per call, comma-separated")
    ap.add_argument("--reps", type=int, default=11)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    ns = [int(v) for v in args.n.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        libs = [load(args.a, Path(tmp)), load(args.b, Path(tmp))]
        torch.manual_seed(0)
        total = [{n: 0.0 for n in ns} for _ in libs]
        print(f"{'shape':8s} " + " ".join(f"{'n=' + str(n) + ' A/B ms (B/A)':>24s}" for n in ns))
        for name, (out, inn) in SHAPES.items():
            w = (torch.randn(out, inn) * 0.02).to(torch.bfloat16)
            cells = []
            for n in ns:
                x = torch.randn(n, inn)
                ys = [torch.empty(n, out) for _ in libs]
                times = [[] for _ in libs]
                for rep in range(args.reps + 1):
                    for i, lib in enumerate(libs):
                        t = time.perf_counter()
                        lib.skinny_bf16(x.data_ptr(), w.data_ptr(), None, ys[i].data_ptr(), n, inn, out, args.threads)
                        if rep:
                            times[i].append(time.perf_counter() - t)
                med = [statistics.median(t) for t in times]
                for i in range(len(libs)):
                    total[i][n] += med[i] * (1 if name == "lm" else LAYERS)
                cells.append(f"{med[0] * 1e3:.2f}/{med[1] * 1e3:.2f} ({med[1] / med[0]:.2f})")
            print(f"{name:8s} " + " ".join(f"{c:>24s}" for c in cells), flush=True)
        print(f"{'model':8s} " + " ".join(f"{f'{total[0][n] * 1e3:.0f}/{total[1][n] * 1e3:.0f} ({total[1][n] / total[0][n]:.2f})':>24s}" for n in ns))
        for label, t in zip("AB", total):
            print(f"{label} cost vs n=1: " + " ".join(f"n={n} {t[n] / t[ns[0]]:.2f}" for n in ns))


if __name__ == "__main__":
    main()
