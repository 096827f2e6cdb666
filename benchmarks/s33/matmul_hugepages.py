"""The matmuls of benchmarks/s33/matmul_order.py before and after copying every packed weight into one
madvise(MADV_HUGEPAGE) buffer (this machine's THP is `madvise` only): does streaming over 4 KB pages cost anything?
Run from the repository root with nothing else running:

    PYTHONPATH=. .venv/bin/python benchmarks/s33/matmul_hugepages.py
"""

import mmap

import torch

from matmul_order import projections, sweep


def main():
    L = projections()
    print("4K pages:  all %.2f ms, layers %.2f ms" % (sweep(L), sweep(L[:-1])))
    fields = [(p, f) for m in L for p in m.parts for f in ("data", "scales", "mins") if getattr(p, f) is not None]
    size = sum(getattr(p, f).numel() * getattr(p, f).element_size() + 64 for p, f in fields)
    buf = mmap.mmap(-1, (size >> 21) + 2 << 21, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf.madvise(mmap.MADV_HUGEPAGE)
    raw, off = torch.frombuffer(buf, dtype=torch.uint8), 0
    for p, f in fields:  # QWeight's tensors replaced in place, so each projection's calls see the copies
        t = getattr(p, f)
        nb = t.numel() * t.element_size()
        dst = raw[off:off + nb].view(t.dtype).view(t.shape)
        dst.copy_(t)
        setattr(p, f, dst)
        off += (nb + 63) // 64 * 64
    print([line.strip() for line in open("/proc/meminfo") if "AnonHuge" in line][0])
    print("huge pages: all %.2f ms, layers %.2f ms" % (sweep(L), sweep(L[:-1])))


if __name__ == "__main__":
    main()
