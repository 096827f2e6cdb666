"""Where a one-position q4 forward's time goes: the whole forward against its matmuls alone, in model order.

One process, SmolLM2 (or --model) q4 after a --context-token prompt: sweeps alternate (A) one whole decode forward
(`model(...)` at n positions, the fused C layers and the LM head) and (B) the same forward's quantized matmuls alone,
called in the forward's order through `quant.matmul_parts` on inputs of the right shapes (so the weights stream
from memory as in the forward). Prints medians and what is left (norms, RoPE, attention, adds, dispatch).
Also the weights' bytes and the bandwidth a step at that time would need. Run from the repository root with nothing
else running:

    PYTHONPATH=. .venv/bin/python benchmarks/s33/step_budget.py --model smollm2-135m --n 1,2
"""

import argparse
import statistics
import time

import torch

from specdec.api import LLM
from specdec.runtime.model import QLinear
from specdec.runtime.kernels import quant


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--n", default="1,2")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--sweeps", type=int, default=30)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    llm = LLM(args.model, dtype="q4")
    model = llm.model
    linears = [m for m in model.modules() if isinstance(m, QLinear)]  # registration order: layers', then the head
    wbytes = sum(p.nbytes for m in linears for p in m.parts)
    print(f"{args.model} q4: {len(linears)} quantized projections, {wbytes / 1e6:.1f} MB of packed weights and scales; "
          f"threads {torch.get_num_threads()}, isa {quant.isa()}")
    prompt = torch.randint(100, 1000, (1, args.context))
    for n in [int(v) for v in args.n.split(",")]:
        cache = model.new_cache(args.context + n + 8)
        with torch.inference_mode():
            model(prompt, cache)
            ids = torch.randint(100, 1000, (1, n))
            xs = [torch.randn(n, m.in_features) for m in linears]
            ys = [torch.empty(n, m.out_features) for m in linears]

            def whole():
                model(ids, cache)
                cache.rewind(n)

            def matmuls():
                for m, x, y in zip(linears, xs, ys):
                    quant.matmul_parts(y, x, m.calls, use=m.use)

            a, b = [], []
            for sweep in range(args.sweeps + 1):
                for f, out in ((whole, a), (matmuls, b)):
                    t = time.perf_counter()
                    for _ in range(args.steps):
                        f()
                    if sweep:
                        out.append((time.perf_counter() - t) / args.steps * 1e3)
        ta, tb = statistics.median(a), statistics.median(b)
        print(f"n = {n}: whole forward {ta:.2f} ms, its matmuls alone {tb:.2f} ms ({tb / ta:.0%}), the rest {ta - tb:.2f} ms; "
              f"weights at {wbytes / tb / 1e6:.1f} GB/s in the matmuls")


if __name__ == "__main__":
    main()
