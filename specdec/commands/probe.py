"""`specdec probe`: forward cost against the number of positions, the budget, and the bandwidth bound."""

from __future__ import annotations

import json
import sys

MAX_REPEATS = 100  # 100 runs of 9 sizes on every path: minutes on a 1.5B target; more buys no steadier median


def register(sub) -> None:
    from specdec.commands.generate import add_model_args

    p = sub.add_parser("probe", help="measure the verification budget: forward time against positions per pass",
                       description="After a 256-token context, time one forward over n = 1, 2, 3, 4, 6, 8, 16, 32 and "
                                   "64 new positions (median of several runs); report the curve, the budget (largest n "
                                   "within 10% of n = 1), the step time against the memory-bandwidth bound and "
                                   "prefill tokens/s, for the matmul path the runtime uses and (bf16) every other "
                                   "one the CPU has (SPECDEC_MATMUL=amx|avx512bf16|avx2|torch forces the runtime's). "
                                   "With --device cuda, the GPU's curve on torch's kernels and its memory's bandwidth. "
                                   "The result is cached per model, dtype and device for adaptive k and the scheduler, and "
                                   "measured again when the kernel or CPU changes, when it was taken under load, "
                                   "or when its curve is implausible.")
    add_model_args(p)
    p.add_argument("--repeats", type=int, default=5,
                   help=f"timed runs per size, 1 to {MAX_REPEATS} (median; default 5)")
    p.add_argument("--paths", choices=["all", "used"], default="all",
                   help="bf16: also measure every other matmul path this CPU has (all, the default: the kernel's "
                        "AVX512-BF16 and AVX2 paths, torch) or only the one the runtime uses (used)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    from tqdm import tqdm

    from specdec.probe import SIZES, other_paths, probe, probe_paths, save
    from specdec.runtime.loader import load_transformer, resolve_device, resolve_dtype
    from specdec.store import resolve

    if not 1 <= args.repeats <= MAX_REPEATS:
        raise ValueError(f"--repeats must be from 1 to {MAX_REPEATS} (the median of 5, the default, is steady)")
    device = resolve_device(args.device)
    folder = resolve(args.model, pull=True)
    model = load_transformer(folder, resolve_dtype(args.dtype, folder, device), device, kv_dtype=args.kv_dtype)
    others = other_paths(model) if args.paths == "all" else []
    forwards = len(SIZES) * (args.repeats + 1) * (1 + len(others))
    with tqdm(total=forwards, desc="probe", unit="forward", file=sys.stderr, disable=args.json) as bar:
        def tick(n):  # an implausible curve is measured again: the bar grows rather than counting past its end
            bar.total = max(bar.total, bar.n + 1)
            bar.update(1)

        result = probe(model, args.model, repeats=args.repeats, progress=tick)
        if others:
            result.paths = probe_paths(model, folder, args.model, repeats=args.repeats, progress=tick)
    path = save(result)
    problem = result.problem()
    if problem:
        print(f"specdec probe: warning: {problem}; adaptive k will not use it and probes again next time",
              file=sys.stderr)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
        return 0
    print(f"model {args.model}, {result.dtype}, {result.threads} threads, context {result.context}")
    print(f"cpu {result.cpu} ({' '.join(result.cpu_flags) or 'no AVX2'})" + (f", gpu {result.gpu}" if result.gpu else "")
          + f"; matmul path {result.matmul} (the runtime's)"
          + (f"; attention {result.attention}" if result.attention else ""))
    curves = {result.matmul: dict(seconds=result.seconds, relative=result.relative, budget=result.budget,
                                  prefill_tokens_per_s=result.prefill_tokens_per_s), **result.paths}
    print(f"{'n':>4} " + " ".join(f"{p + ' ms':>16} {'x t(1)':>7}" for p in curves))
    for n in result.seconds:  # x t(1): the median of each sweep's ratio (a path cached before it: of the medians)
        print(f"{n:>4} " + " ".join(f"{c['seconds'][n] * 1e3:>16.2f} "
                                    f"{c.get('relative', {}).get(n, c['seconds'][n] / c['seconds'][1]):>7.2f}"
                                    for c in curves.values()))
    for p, c in curves.items():
        print(f"{p}: budget {c['budget']} positions per forward within 10% of one; "
              f"prefill {c['prefill_tokens_per_s']:.1f} tokens/s"
              + (f" on {result.prefill_path}" if p == result.matmul and result.prefill_path not in ("", p) else "")
              + (" (used)" if p == result.matmul else ""))
    print(f"step {result.seconds[1] * 1e3:.1f} ms against a bandwidth bound of {result.bound_seconds * 1e3:.1f} ms "
          f"({result.weight_bytes / 1e6:.0f} MB of weights at {result.bandwidth_gbs:.1f} GB/s measured): "
          f"{result.bound_seconds / result.seconds[1]:.0%} of the bound")
    print(f"saved to {path}")
    return 0
