"""A/B two versions of one kernel source inside a model's whole forward: the layers' matmuls (skinny.c for bf16
weights, qgemm.c for q4/q8) or exact attention (attention.c), at n positions after a `--context`-token prompt.

The model runs its layers in one C call (`FusedLayers`), which calls each kernel through a function pointer; a
second FusedLayers points it at the other source's library, and the two alternate in sweeps of forwards in one
process, so the machine's slow minutes hit both alike. The LM head stays on the package's kernel. Prints the
median forward time of each and the median of the per-sweep ratios B / A. The two sources must give the same
bits (checked on the logits). Run from the repository root:

    git show HEAD~1:specdec/runtime/kernels/skinny.c > /tmp/skinny_old.c
    PYTHONPATH=. .venv/bin/python benchmarks/kernel/step_ab.py skinny /tmp/skinny_old.c \\
        specdec/runtime/kernels/skinny.c --model smollm2-135m --dtype bf16 --n 1,16
"""

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from specdec.api import LLM
from specdec.runtime import kernels
from specdec.runtime.kernels import attention, ops, quant

KERNELS = {  # name: (module with SOURCE, CFLAGS, _declare; the FusedLayers pointer slot; the entry point)
    "qgemm": (quant, 0, "qgemm"),
    "skinny": (kernels, 1, "skinny_bf16"),
    "attention": (attention, 2, "attend_batch"),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kernel", choices=list(KERNELS))
    ap.add_argument("a", help="source A (the baseline)")
    ap.add_argument("b", help="source B")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="q4")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--n", default="1,16", help="positions per forward, comma-separated")
    ap.add_argument("--sweeps", type=int, default=16)
    ap.add_argument("--steps", type=int, default=20, help="forwards per sweep")
    args = ap.parse_args()
    module, slot, entry = KERNELS[args.kernel]
    model = LLM(args.model, dtype=args.dtype).model
    fused, tmp = [], Path(tempfile.mkdtemp())
    for header in module.SOURCE.parent.glob("*.h"):  # the headers the sources include
        shutil.copy(header, tmp)
    for i, src in enumerate((args.a, args.b)):
        shutil.copy(src, tmp / f"{args.kernel}_{i}.c")
        lib = kernels.Library(tmp / f"{args.kernel}_{i}.c", module.CFLAGS, module._declare, "unavailable").get()
        fl = type(model.fused_layers)(model)
        fl.fns[slot] = ops.pointer(getattr(lib, entry))
        fused.append(fl)
    ns = [int(v) for v in args.n.split(",")]
    cache = model.new_cache(args.context + max(ns))
    print(f"{args.model} {args.dtype}, {args.kernel}, context {args.context}, {torch.get_num_threads()} threads")
    with torch.inference_mode():
        model(torch.randint(0, 1000, (1, args.context)), cache)
        for n in ns:
            x = torch.randint(0, 1000, (1, n))
            times, logits = [[], []], []
            for sweep in range(args.sweeps + 1):  # the first warms up and checks the bits
                for i, fl in enumerate(fused):
                    model.__dict__["fused_layers"] = fl
                    t = []
                    for _ in range(1 if sweep == 0 else args.steps):
                        a = time.perf_counter()
                        out = model(x, cache)
                        t.append(time.perf_counter() - a)
                        cache.rewind(n)
                    if sweep == 0:
                        logits.append(out.logits)
                    else:
                        times[i].append(statistics.median(t))
            assert torch.equal(*logits), f"the two sources give different logits at n = {n}"
            a, b = (statistics.median(t) * 1e3 for t in times)
            ratio = statistics.median(tb / ta for ta, tb in zip(*times))
            print(f"n = {n:3d}: A {a:.2f} ms, B {b:.2f} ms; B / A {ratio:.3f} (median of {args.sweeps} sweeps' ratios; "
                  f"same logits)")


if __name__ == "__main__":
    main()
