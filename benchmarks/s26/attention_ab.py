"""Exact attention's kernel alone, two sources A / B in one process, calls alternating: n query rows of a chain after
`--start` cached positions (fp16 cache, the exact CPU paths' default), on the AVX512 path, 2 threads. Medians of
`--reps` calls, microseconds a layer, and B / A; both sources' outputs must be equal. Run from the repository root:

    git show HEAD~1:specdec/runtime/kernels/attention.c > /tmp/attention_old.c
    PYTHONPATH=. .venv/bin/python benchmarks/s26/attention_ab.py /tmp/attention_old.c \\
        specdec/runtime/kernels/attention.c --heads 9,3,64
"""
import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from specdec.runtime import kernels
from specdec.runtime.kernels import attention

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("a")
ap.add_argument("b")
ap.add_argument("--heads", default="9,3,64", help="query heads, KV heads, head dim (SmolLM2: 9,3,64; the 1.5B: 12,2,128)")
ap.add_argument("--start", type=int, default=256)
ap.add_argument("--n", default="1,4,8,16")
ap.add_argument("--reps", type=int, default=300)
ap.add_argument("--threads", type=int, default=2)
args = ap.parse_args()
H, Hk, D = (int(v) for v in args.heads.split(","))
tmp = Path(tempfile.mkdtemp())
for header in attention.SOURCE.parent.glob("*.h"):
    shutil.copy(header, tmp)
libs = []
for i, src in enumerate((args.a, args.b)):
    shutil.copy(src, tmp / f"attention_{i}.c")
    libs.append(kernels.Library(tmp / f"attention_{i}.c", attention.CFLAGS, attention._declare, "unavailable").get())
print(f"heads {H}/{Hk} of {D}, {args.start} cached positions, fp16 cache, avx512, {args.threads} threads; "
      f"median of {args.reps} calls, us a layer")
for n in (int(v) for v in args.n.split(",")):
    q = torch.randn(1, n, H, D).transpose(1, 2)
    k, v = (torch.randn(1, Hk, args.start + n, D).half() for _ in range(2))
    rows = attention.Rows.chain(n, args.start)
    outs, times = [torch.empty(1, n, H, D) for _ in libs], [[] for _ in libs]
    for rep in range(args.reps + 20):
        for i, lib in enumerate(libs):
            t = time.perf_counter()
            lib.attend(q.data_ptr(), q.stride(0), q.stride(1), q.stride(2), k.data_ptr(), v.data_ptr(), outs[i].data_ptr(),
                       rows.prefix.data_ptr(), rows.offs.data_ptr(), rows.extra.data_ptr(), 1, n, H, Hk, k.shape[2], D,
                       attention.ISAS["avx512"], 1, args.threads)
            if rep >= 20:
                times[i].append(time.perf_counter() - t)
    assert torch.equal(outs[0], outs[1]), n
    a, b = (statistics.median(t) * 1e6 for t in times)
    print(f"n = {n:2d}: A {a:6.1f}  B {b:6.1f}  B / A {b / a:.2f}")
