import ctypes, subprocess, sys, time, torch
sys.path.insert(0, "benchmarks/kernel")
from specdec.runtime.kernels import quant as Q
from qgemm_parts import parts
srcs = sys.argv[1:]
libs = []
for i, s in enumerate(srcs):
    so = f"/tmp/qgemm-incache-{i}.so"; subprocess.run(["gcc", *Q.CFLAGS, s, "-o", so], check=True)
    lib = ctypes.CDLL(so); Q._declare(lib); libs.append(lib)
g = parts("qwen2.5-coder-1.5b")
for key in [k for k in g if k[1] in (17920, 8960*0+1536) and k[2] == 1536][:2] + [k for k in g if k[0]=="q6k" and k[2]==8960]:
    fmt, _, inn = key; qw = g[key][0]; out = int(__import__("os").environ.get("OUT", 512))
    for n in (1, 2, 4, 8, 16):
        x = torch.randn(n, inn); y = torch.empty(n, out)
        res = []
        for lib in libs:
            ts = []
            for rep in range(30):
                t = time.perf_counter()
                for _ in range(20):
                    lib.qgemm(Q._FMT[fmt], Q.ISAS["vnni512"], x.data_ptr(), *qw.pointers[1:], None, y.data_ptr(), out, n, inn, out, 1)
                ts.append((time.perf_counter() - t) / 20)
            m = min(ts); res.append(f"{m*1e6:8.1f}us {out*inn*n/m/1e9:6.1f}GMAC/s")
        print(fmt, out, inn, n, " | ".join(res), flush=True)
