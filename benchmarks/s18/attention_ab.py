"""Two versions of the exact-attention kernel (attention.c) alone, alternating sweeps in one process: `layers`
calls of `attend` over random keys and values of one model's attention shape, n query rows after `context`
cached positions. Checks the outputs are the same bits; prints median ms per sweep and the median ratio B / A.
Run from the repository root:

    git show 4e3981f:specdec/runtime/kernels/attention.c > /tmp/attention_old.c
    PYTHONPATH=. .venv/bin/python benchmarks/s18/attention_ab.py /tmp/attention_old.c \\
        specdec/runtime/kernels/attention.c --shape 9,3,64 --isa avx512      # SmolLM2; 12,2,128: the 1.5B
"""

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from specdec.runtime import kernels
from specdec.runtime.kernels import attention as A


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--shape", default="9,3,64", help="query heads, KV heads, head dim")
    ap.add_argument("--isa", default="avx512", choices=list(A.ISAS))
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--n", default="1,4,16")
    ap.add_argument("--sweeps", type=int, default=40)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    shutil.copy(A.SOURCE.with_name("vexp.h"), tmp)
    libs = []
    for i, src in enumerate((args.a, args.b)):
        shutil.copy(src, tmp / f"attention_{i}.c")
        libs.append(kernels.Library(tmp / f"attention_{i}.c", A.CFLAGS, A._declare, "unavailable").get())
    H, Hk, D = map(int, args.shape.split(","))
    S, threads = args.context + 64, torch.get_num_threads()
    ks = [torch.randn(1, Hk, S, D) for _ in range(args.layers)]
    vs = [torch.randn(1, Hk, S, D) for _ in range(args.layers)]
    print(f"heads {H}/{Hk}, head dim {D}, context {args.context}, {args.layers} layers, {args.isa}, {threads} threads")
    for n in map(int, args.n.split(",")):
        q, rows = torch.randn(1, H, n, D), A.Rows.chain(n, args.context)
        outs, times = [torch.empty(1, n, H, D) for _ in libs], [[], []]
        for sweep in range(args.sweeps + 1):
            for i, lib in enumerate(libs):
                t = time.perf_counter()
                for k, v in zip(ks, vs):
                    lib.attend(q.data_ptr(), q.stride(0), q.stride(1), q.stride(2), k.data_ptr(), v.data_ptr(),
                               outs[i].data_ptr(), rows.prefix.data_ptr(), rows.offs.data_ptr(), rows.extra.data_ptr(),
                               1, n, H, Hk, S, D, A.ISAS[args.isa], threads)
                if sweep:
                    times[i].append(time.perf_counter() - t)
        assert torch.equal(*outs), "the two sources give different bits"
        a, b = (statistics.median(t) * 1e3 for t in times)
        print(f"n = {n:2d}: A {a:.3f} ms, B {b:.3f} ms; B / A {statistics.median(y / x for x, y in zip(*times)):.3f} "
              f"(same bits)")


if __name__ == "__main__":
    main()
