"""`specdec probe`: forward cost against the number of positions, the budget, and the bandwidth bound."""

from __future__ import annotations

import json
import sys


def register(sub) -> None:
    from specdec.commands.generate import add_model_args

    p = sub.add_parser("probe", help="measure the verification budget: forward time against positions per pass",
                       description="After a 256-token context, time one forward over n = 1, 2, 4, ..., 64 new "
                                   "positions (median of several runs); report the curve, the budget (largest n "
                                   "within 10%% of n = 1) and the step time against the memory-bandwidth bound. "
                                   "The result is cached per model and dtype for adaptive k and the scheduler, and "
                                   "measured again when the kernel or CPU changes, when it was taken under load, "
                                   "or when its curve is implausible.")
    add_model_args(p)
    p.add_argument("--repeats", type=int, default=5, help="timed runs per size (median; default 5)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    from tqdm import tqdm

    from specdec.probe import SIZES, probe, save
    from specdec.runtime.loader import load_transformer, resolve_dtype
    from specdec.store import resolve

    if args.repeats < 1:
        raise ValueError("--repeats must be at least 1")
    folder = resolve(args.model, pull=True)
    model = load_transformer(folder, resolve_dtype(args.dtype, folder))
    with tqdm(total=len(SIZES), desc="probe", unit="size", file=sys.stderr, disable=args.json) as bar:
        result = probe(model, args.model, repeats=args.repeats, progress=lambda n: bar.update(1))
    path = save(result)
    problem = result.problem()
    if problem:
        print(f"specdec probe: warning: {problem}; adaptive k will not use it and probes again next time",
              file=sys.stderr)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
        return 0
    print(f"model {args.model}, {result.dtype}, {result.threads} threads, context {result.context}")
    print(f"{'n':>4} {'ms':>9} {'x t(1)':>7}")
    for n, s in result.seconds.items():
        print(f"{n:>4} {s * 1e3:>9.2f} {result.relative[n]:>7.2f}")
    print(f"budget: {result.budget} positions per forward within 10% of one")
    print(f"step {result.seconds[1] * 1e3:.1f} ms against a bandwidth bound of {result.bound_seconds * 1e3:.1f} ms "
          f"({result.weight_bytes / 1e6:.0f} MB of weights at {result.bandwidth_gbs:.1f} GB/s measured): "
          f"{result.bound_seconds / result.seconds[1]:.0%} of the bound")
    print(f"saved to {path}")
    return 0
