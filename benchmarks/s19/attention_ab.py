"""Two versions of the exact-attention kernel (attention.c) alone, alternating sweeps in one process: `layers`
calls of `attend` over random keys and values of one model's attention shape, n query rows after `context`
cached positions. A source whose `attend` takes a cache format (session 19 on) reads the cache in --kv's
format; an older one (fp32 only) reads the same values widened to fp32. Both must give the same bits (with
--kv fp32 and two such sources: the fp16 support costs the fp32 path nothing; with --kv fp16: the fp16 cache
gives an fp32 cache's bits). Prints median ms per sweep and the median ratio B / A. Run from the repository
root (session 18 ran it on two fp32-only sources: `benchmarks/s18/run.sh`):

    git show a13c6d4:specdec/runtime/kernels/attention.c > /tmp/attention_s18.c
    PYTHONPATH=. .venv/bin/python benchmarks/s19/attention_ab.py /tmp/attention_s18.c \\
        specdec/runtime/kernels/attention.c --shape 9,3,64 --isa avx512 --kv fp16   # SmolLM2; 12,2,128: the 1.5B
"""

import argparse
import ctypes
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from specdec.runtime import kernels
from specdec.runtime.kernels import attention as A


def declare(lib) -> None:
    """The types both `attend` signatures share; its arguments' types are set per source (`main`)."""
    lib.attend.restype = ctypes.c_int


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
    ap.add_argument("--kv", default="fp32", choices=["fp32", "fp16"], help="the cache of sources that take a format")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    shutil.copy(A.SOURCE.with_name("vexp.h"), tmp)
    libs, formats = [], []  # per source: its library, whether its attend takes `half` (isa, half, threads)
    for i, src in enumerate((args.a, args.b)):
        shutil.copy(src, tmp / f"attention_{i}.c")
        formats.append("int isa, int half, int threads" in Path(src).read_text())
        libs.append(kernels.Library(tmp / f"attention_{i}.c", A.CFLAGS, declare, "unavailable").get())
        libs[-1].attend.argtypes = ([ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 6
                                    + [ctypes.c_int64] * 6 + [ctypes.c_int] * (3 if formats[-1] else 2))
    H, Hk, D = map(int, args.shape.split(","))
    S, threads = args.context + 64, torch.get_num_threads()
    half = args.kv == "fp16"
    kb = [torch.randn(1, Hk, S, D).to(torch.float16 if half else torch.float32) for _ in range(args.layers)]
    vb = [torch.randn(1, Hk, S, D).to(kb[0].dtype) for _ in range(args.layers)]
    widened = (list(map(torch.Tensor.float, kb)), list(map(torch.Tensor.float, vb)))
    caches = [(kb, vb) if takes else widened for takes in formats]
    ints = [(A.ISAS[args.isa], int(half), threads) if takes else (A.ISAS[args.isa], threads) for takes in formats]
    print(f"heads {H}/{Hk}, head dim {D}, context {args.context}, {args.layers} layers, {args.isa}, {threads} threads, "
          f"cache {args.kv} (A {'takes' if formats[0] else 'widened'}, B {'takes' if formats[1] else 'widened'})")
    for n in map(int, args.n.split(",")):
        q, rows = torch.randn(1, H, n, D), A.Rows.chain(n, args.context)
        outs, times = [torch.empty(1, n, H, D) for _ in libs], [[], []]
        for sweep in range(args.sweeps + 1):
            for i, lib in enumerate(libs):
                t = time.perf_counter()
                for k, v in zip(*caches[i]):
                    lib.attend(q.data_ptr(), q.stride(0), q.stride(1), q.stride(2), k.data_ptr(), v.data_ptr(),
                               outs[i].data_ptr(), rows.prefix.data_ptr(), rows.offs.data_ptr(), rows.extra.data_ptr(),
                               1, n, H, Hk, S, D, *ints[i])
                if sweep:
                    times[i].append(time.perf_counter() - t)
        assert torch.equal(*outs), "the two sources give different bits"
        a, b = (statistics.median(t) * 1e3 for t in times)
        print(f"n = {n:2d}: A {a:.3f} ms, B {b:.3f} ms; B / A {statistics.median(y / x for x, y in zip(*times)):.3f} "
              f"(same bits)")


if __name__ == "__main__":
    main()
