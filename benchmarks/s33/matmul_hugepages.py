"""The same matmuls (benchmarks/s33/matmul_order.py) before and after copying every packed weight into one
madvise(MADV_HUGEPAGE) buffer (this machine's THP is `madvise` only): does the 4 KB page stream cost anything?
Run from the repository root with nothing else running: `PYTHONPATH=. .venv/bin/python benchmarks/s33/matmul_hugepages.py`.
"""
import mmap, statistics, time, torch, dataclasses
from specdec.api import LLM
from specdec.runtime.model import QLinear
from specdec.runtime.kernels import quant
llm = LLM("smollm2-135m", dtype="q4"); model = llm.model
L = [m for m in model.modules() if isinstance(m, QLinear)]
def sweep(mods, n=1, threads=2, reps=25, steps=5):
    xs = [torch.randn(n, m.in_features) for m in mods]; ys = [torch.empty(n, m.out_features) for m in mods]
    ts = []
    for r in range(reps + 1):
        t = time.perf_counter()
        for _ in range(steps):
            for m, x, y in zip(mods, xs, ys): quant.matmul_parts(y, x, m.calls, threads=threads, use=m.use)
        if r: ts.append((time.perf_counter() - t) / steps * 1e3)
    return statistics.median(ts)
print("4K pages:  all %.2f ms, layers %.2f ms" % (sweep(L), sweep(L[:-1])))
tensors = [(m, i, f) for m in L for i, p in enumerate(m.parts) for f in ("data", "scales", "mins") if getattr(p, f) is not None]
total = sum(getattr(m.parts[i], f).numel() * getattr(m.parts[i], f).element_size() for m, i, f in tensors)
size = (total + len(tensors) * 4096 + (2 << 20)) // (2 << 20) * (2 << 20) + (2 << 20)
buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
buf.madvise(mmap.MADV_HUGEPAGE)
raw = torch.frombuffer(buf, dtype=torch.uint8)
off = 0
for m, i, f in tensors:
    t = getattr(m.parts[i], f)
    nb = t.numel() * t.element_size()
    dst = raw[off:off + nb].view(t.dtype).view(t.shape)
    dst.copy_(t)
    m.parts[i] = dataclasses.replace(m.parts[i], **{f: dst}) if dataclasses.is_dataclass(m.parts[i]) else m.parts[i]
    if not dataclasses.is_dataclass(m.parts[i]): setattr(m.parts[i], f, dst)
    off += (nb + 63) // 64 * 64
for m in L:
    m.calls = [(m.parts[j], b, c) for j, (_, b, c) in enumerate(m.calls)]
print("AnonHugePages:", [l for l in open("/proc/meminfo") if "AnonHuge" in l][0].strip())
res = [sweep(L), sweep(L[:-1])]
print("huge pages: all %.2f ms, layers %.2f ms" % tuple(res))
