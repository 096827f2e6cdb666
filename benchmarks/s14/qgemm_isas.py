"""Session 14: one quantized matrix through qgemm's ISAs (vnni512, the tried amx-int8 path, the bf16-dequant
prefill path "amx"), median of 20 calls per n. Needs `amx_int8_decode.patch` applied (git apply), which adds the
amx-int8 ISA; main has only vnni512 and amx. Run from the repository root, nothing else running:

    .venv/bin/python benchmarks/s14/qgemm_isas.py q4k 8960 1536 1    # format, out, in, threads
"""
import statistics, sys, time, torch, ctypes
from specdec.runtime.kernels import quant as Q
torch.manual_seed(0)
fmt, out, inn = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
threads = int(sys.argv[4]) if len(sys.argv) > 4 else 2
w = torch.randn(out, inn)
if fmt in ("q4k", "q6k"):
    from tests.test_quant import k_weight
    qw = k_weight({"q4k": "Q4_K", "q6k": "Q6_K"}[fmt], out, inn)
else:
    qw = Q.from_fp32(w, fmt)
lib = Q._load()
print(f"{fmt} {out}x{inn} threads={threads}")
for n in (1, 2, 3, 4, 6, 8, 12, 16, 32, 64):
    x = torch.randn(n, inn); y = torch.empty(n, out)
    row = []
    for isa in ("vnni512", "amx-int8", "amx"):
        code = Q.ISAS.get(isa) or Q.PREFILL_ISAS[isa]
        f, W, S, M = qw.pointers
        ts = []
        for rep in range(21):
            t = time.perf_counter()
            lib.qgemm(f, code, x.data_ptr(), W, S, M, None, y.data_ptr(), out, n, inn, out, threads)
            ts.append(time.perf_counter() - t)
        row.append(statistics.median(ts[1:]) * 1e3)
    print(f"n={n:3d} " + "  ".join(f"{v:7.3f}" for v in row), flush=True)
