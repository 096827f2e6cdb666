"""A/B two versions of the quantized-matmul kernel (specdec/runtime/kernels/qgemm.c) on a real model's parts.

Both sources are compiled with the package's flags and loaded with ctypes; they share the model's packed
weights (the layout must be the same). The model's quantized parts are grouped by format and shape (e.g. q4k
17920 x 1536: the 28 gate_up projections), and for every n one sweep calls the kernel on every matrix of the
group in turn (so the weights stream from memory, as in a forward); A and B alternate sweeps (A, B, A, B, ...)
after one warm-up each. The table gives per group the median sweep in ms for A and B, and B/A. Run from the
repository root, with nothing else running:

    git show main:specdec/runtime/kernels/qgemm.c > /tmp/qgemm_main.c
    .venv/bin/python benchmarks/kernel/qgemm_parts.py /tmp/qgemm_main.c \\
        specdec/runtime/kernels/qgemm.c --model qwen2.5-coder-1.5b --n 1,4,8,64
"""

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from specdec.runtime.kernels import quant as Q


def load(src: str, folder: Path):
    so = folder / f"{Path(src).stem}-{len(list(folder.iterdir()))}.so"
    subprocess.run(["gcc", *Q.CFLAGS, src, "-o", str(so)], check=True)
    lib = ctypes.CDLL(str(so))
    Q._declare(lib)
    return lib


def parts(model: str) -> dict[tuple, list[Q.QWeight]]:
    """The model's quantized matrices by (format, out, in)."""
    from specdec.api import LLM
    from specdec.runtime.model import QLinear

    groups = defaultdict(list)
    for m in LLM(model, dtype="q4").model.modules():
        if isinstance(m, QLinear):
            for p in m.parts:
                groups[(p.fmt, p.out_features, p.in_features)].append(p)
    return groups


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a", help="kernel source A (the baseline)")
    ap.add_argument("b", help="kernel source B")
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--n", default="1,4,8,64", help="positions per call, comma-separated")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--isa", default="vnni512", choices=list(Q.ISAS) + list(Q.PREFILL_ISAS))
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--only", default="q4k,q6k", help="formats to time, comma-separated")
    args = ap.parse_args()
    ns = [int(v) for v in args.n.split(",")]
    groups = {k: v for k, v in parts(args.model).items() if k[0] in args.only.split(",")}
    with tempfile.TemporaryDirectory() as tmp:
        libs = [load(args.a, Path(tmp)), load(args.b, Path(tmp))]
        print(f"{args.threads} threads, {args.isa}; per group: sweep over its matrices, median of {args.reps} ms, A/B (B/A)")
        print(f"{'part':24s} " + " ".join(f"{'n=' + str(n):>20s}" for n in ns))
        total = [defaultdict(float) for _ in libs]
        for (fmt, out, inn), ws in sorted(groups.items(), key=lambda kv: -kv[0][1] * kv[0][2] * len(kv[1])):
            cells = []
            for n in ns:
                x = torch.randn(n, inn)
                ys = [torch.empty(n, out) for _ in libs]
                times = [[] for _ in libs]
                for rep in range(args.reps + 1):
                    for i, lib in enumerate(libs):
                        t = time.perf_counter()
                        for w in ws:
                            lib.qgemm(Q._FMT[fmt], {**Q.ISAS, **Q.PREFILL_ISAS}[args.isa], x.data_ptr(), *w.pointers[1:], None,
                                      ys[i].data_ptr(), out, n, inn, out, args.threads)
                        if rep:
                            times[i].append(time.perf_counter() - t)
                med = [statistics.median(t) * 1e3 for t in times]
                for i in range(len(libs)):
                    total[i][n] += med[i]
                cells.append(f"{med[0]:.1f}/{med[1]:.1f} ({med[1] / med[0]:.2f})")
            name = f"{fmt} {out}x{inn} x{len(ws)}"
            print(f"{name:24s} " + " ".join(f"{c:>20s}" for c in cells), flush=True)
        print(f"{'total':24s} " + " ".join(f"{f'{total[0][n]:.1f}/{total[1][n]:.1f} ({total[1][n] / total[0][n]:.2f})':>20s}" for n in ns))
        for label, t in zip("AB", total):
            print(f"{label} cost vs n={ns[0]}: " + " ".join(f"n={n} {t[n] / t[ns[0]]:.2f}" for n in ns))


if __name__ == "__main__":
    main()
