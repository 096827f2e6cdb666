"""A/B two versions of the exact-attention kernel (specdec/runtime/kernels/attention.c) inside a model's whole
decoding step (session 17: splitting a KV head's query heads across threads, before and after).

The model runs its layers in one C call (`FusedLayers`), which calls attention through a function pointer; a
second FusedLayers points it at the other source's library, and the two alternate in sweeps of one-position
forwards after a `--context`-token prompt, in one process (so the machine's slow minutes hit both alike).
Prints the median forward time of each and the median of the per-sweep ratios B / A. The two sources must give
the same bits (the script checks the logits). Run from the repository root:

    git show 031c3ae:specdec/runtime/kernels/attention.c > /tmp/attention_old.c
    PYTHONPATH=. .venv/bin/python benchmarks/s17/attention_ab.py /tmp/attention_old.c \\
        specdec/runtime/kernels/attention.c --model smollm2-135m --dtype q4 --context 256
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
from specdec.runtime.kernels import attention, ops


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a", help="attention.c A (the baseline)")
    ap.add_argument("b", help="attention.c B")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="q4")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--sweeps", type=int, default=16)
    ap.add_argument("--steps", type=int, default=20, help="forwards per sweep")
    args = ap.parse_args()
    model = LLM(args.model, dtype=args.dtype).model
    fused, tmp = [], Path(tempfile.mkdtemp())
    shutil.copy(attention.SOURCE.with_name("vexp.h"), tmp)  # the header the sources include
    for i, src in enumerate((args.a, args.b)):
        shutil.copy(src, tmp / f"attention_{i}.c")
        lib = kernels.Library(tmp / f"attention_{i}.c", attention.CFLAGS, attention._declare, "unavailable").get()
        fl = type(model.fused_layers)(model)
        fl.fns[2] = ops.pointer(lib.attend_batch)
        fused.append(fl)
    cache = model.new_cache(args.context + 8)
    x = torch.randint(0, 1000, (1, 1))
    times, logits = [[], []], []
    with torch.inference_mode():
        model(torch.randint(0, 1000, (1, args.context)), cache)
        for sweep in range(args.sweeps):
            for i, fl in enumerate(fused):
                model.__dict__["fused_layers"] = fl
                if sweep == 0:
                    logits.append(model(x, cache).logits)
                    cache.rewind(1)
                t = []
                for _ in range(args.steps):
                    a = time.perf_counter()
                    model(x, cache)
                    t.append(time.perf_counter() - a)
                    cache.rewind(1)
                times[i].append(statistics.median(t))
    assert torch.equal(*logits), "the two sources give different logits"
    a, b = (statistics.median(t) * 1e3 for t in times)
    ratio = statistics.median(tb / ta for ta, tb in zip(*times))
    print(f"{args.model} {args.dtype}, context {args.context}, {torch.get_num_threads()} threads: one-position forward "
          f"A {a:.2f} ms, B {b:.2f} ms; B / A {ratio:.3f} (median of {args.sweeps} sweeps' ratios; same logits)")


if __name__ == "__main__":
    main()
