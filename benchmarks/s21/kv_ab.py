"""A bf16 KV cache (AMX attention on tiles) against the fp16 cache (exact fp32 attention), in one process, the two
alternating within every sweep (session 21, `--kv-dtype bf16`).

    PYTHONPATH=. .venv/bin/python benchmarks/s21/kv_ab.py MODEL [DTYPE] [CONTEXT] [SWEEPS]

After CONTEXT cached positions, one forward over n = 1, 2, 4, 8, 16, 32 new positions, per cache dtype; each sweep
times every size on both caches. Prints, per dtype, the median time of each n and its cost in steps (t(n) / t(1) of
the same sweep, the median over sweeps: the probe's curve), and the median per-sweep ratio bf16 / fp16 per n.
"""
import statistics
import sys
import time

import torch

from specdec.probe import sweep_curve
from specdec.runtime.loader import load_transformer, resolve_dtype
from specdec.store import resolve

SIZES = (1, 2, 4, 8, 16, 32)
KV = {"fp16": torch.float16, "bf16": torch.bfloat16}


def main(name, dtype="bf16", context=256, sweeps=15):
    folder = resolve(name)
    model = load_transformer(folder, resolve_dtype(dtype, folder))
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.cfg.vocab_size, (context,), generator=gen).tolist()
    tokens = {n: torch.randint(0, model.cfg.vocab_size, (1, n), generator=gen) for n in SIZES}
    caches = {}
    for kv, dt in KV.items():
        model.kv_choice = dt
        caches[kv] = model.new_cache(context + max(SIZES))
        model.prefill(prompt, caches[kv])
    times = {kv: {n: [] for n in SIZES} for kv in KV}
    for sweep in range(sweeps + 1):  # the first warms up
        for kv, dt in KV.items():
            model.kv_choice = dt
            for n in SIZES:
                t0 = time.perf_counter()
                model(tokens[n], caches[kv])
                dt_ = time.perf_counter() - t0
                caches[kv].rewind(n)
                if sweep:
                    times[kv][n].append(dt_)
    print(f"{name} {dtype}, context {context}, {sweeps} sweeps, {torch.get_num_threads()} threads")
    print("   n" + "".join(f"  {kv} ms  steps" for kv in KV) + "  bf16/fp16")
    curves = {kv: sweep_curve(times[kv]) for kv in KV}
    for n in SIZES:
        row = "".join(f"  {statistics.median(times[kv][n]) * 1e3:7.2f}  {curves[kv][n]:5.2f}" for kv in KV)
        ratio = statistics.median(b / a for a, b in zip(times["fp16"][n], times["bf16"][n]))
        print(f"{n:4d}{row}  {ratio:9.3f}")


if __name__ == "__main__":
    args = sys.argv[1:]
    main(args[0], *(args[1:2]), *(int(a) for a in args[2:]))
