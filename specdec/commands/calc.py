"""`specdec calc`: the lesson's speedup arithmetic from the command line (specdec.theory).

    specdec calc --alpha 0.7 -k 4 --tau 0.1        # 2.7731 tokens/round, 1.98x, best k 4
    specdec calc --alpha 0.7 -k 4 --tau 0.1 --json
    specdec calc --table alpha                      # speedup across alpha at k=4, tau=0.1
    specdec calc --table k --alpha 0.7              # speedup across k: where the peak sits
"""

from __future__ import annotations

import argparse
import json

from specdec import theory

ALPHAS = [0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95]


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "calc",
        help="expected tokens, speedup, best k and break-even alpha for (alpha, k, tau)",
        description=(
            "Chapter 2's arithmetic: E[tokens] = (1 - alpha^(k+1)) / (1 - alpha) per round and "
            "speedup = E / (1 + k*tau) over plain decoding. Defaults are the lesson's worked "
            "example (alpha=0.7, k=4, tau=0.1)."
        ),
        epilog="Example: specdec calc --alpha 0.15 -k 8 --tau 0.1  (0.65x: slower than plain decoding)",
    )
    p.add_argument("--alpha", type=float, default=None, help="acceptance rate per drafted token, in [0, 1] (default 0.7)")
    p.add_argument("-k", "--k", type=int, default=None, help="tokens drafted per round, >= 0 (default 4)")
    p.add_argument("--tau", type=float, default=0.1,
                   help="draft cost per token as a fraction of one target step, >= 0 (default 0.1)")
    p.add_argument("--k-max", type=int, default=None,
                   help="largest k searched for the best k (default 32; not with --table)")
    p.add_argument("--table", choices=["alpha", "k"],
                   help="print a sweep instead: 'alpha' varies alpha at the given k and tau (no --alpha); "
                        "'k' varies k from 0 to 10 at the given alpha and tau (no -k)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=run)


def summary(alpha: float, k: int, tau: float, k_max: int = 32) -> dict:
    """The numbers `calc` prints, as a dict (keys match --json)."""
    best = theory.best_k(alpha, tau, k_max)
    return {
        "alpha": alpha,
        "k": k,
        "tau": tau,
        "expected_tokens": theory.expected_tokens(alpha, k),
        "speedup": theory.speedup(alpha, k, tau),
        "best_k": best,
        "best_speedup": theory.speedup(alpha, best, tau),
        "best_k_capped": rising(alpha, best, tau),  # the speedup still grows past --k-max: best_k is only its cap
        "break_even_alpha": theory.break_even_alpha(k, tau),
        "full_burst_probability": theory.full_burst_probability(alpha, k),
    }


def rising(alpha: float, k: int, tau: float) -> bool:
    """Whether drafting one more token than k still pays (alpha = 1: always, up to 1/tau; tau = 0: always)."""
    return (tau == 0 and alpha > 0) or theory.speedup(alpha, k + 1, tau) > theory.speedup(alpha, k, tau) + 1e-12


def table_rows(kind: str, alpha: float, k: int, tau: float) -> list[dict]:
    if kind == "alpha":
        return [{"alpha": a, "k": k, "tau": tau, "expected_tokens": theory.expected_tokens(a, k),
                 "speedup": theory.speedup(a, k, tau)} for a in ALPHAS]
    return [{"alpha": alpha, "k": kk, "tau": tau, "expected_tokens": theory.expected_tokens(alpha, kk),
             "round_cost": 1 + kk * tau, "speedup": theory.speedup(alpha, kk, tau)} for kk in range(11)]


def _arg(x: float) -> str:
    """An argument as given: 0.9999999 stays 0.9999999 (`:g` printed alpha=1)."""
    return format(x, ".12g")


def _fixed(x: float, digits: int) -> str:
    """x to `digits` decimals, unless that hides it: a break-even alpha of 0.99999 is not 1.0000, nor a
    speedup of 3.33e-05 0.000."""
    text = f"{x:.{digits}f}"
    if not x or float(text) == x or float(text) not in (0, 1, -1):
        return text
    return f"{x:.{digits}g}" if float(text) == 0 else repr(x)


DEFAULTS = {"alpha": 0.7, "k": 4, "k_max": 32}  # the lesson's worked example; best k searched up to 32
SWEPT = {"alpha": ("alpha", "--alpha"), "k": ("k", "-k")}  # what each --table varies itself


def fill_defaults(args: argparse.Namespace) -> None:
    """Refuse a flag the chosen output does not read, then fill in the defaults: `--table alpha --alpha 0.3`
    sweeps alpha whatever was given, and no table searches a best k (--k-max), so either is an error rather
    than a table printed without it."""
    if args.table:
        for dest, flag in (SWEPT[args.table], ("k_max", "--k-max")):
            if getattr(args, dest) is not None:
                raise ValueError(f"--table {args.table} does not read {flag}"
                                 + (f" (it sweeps {args.table} itself)" if dest == args.table else "")
                                 + f": drop {flag}")
    for dest, value in DEFAULTS.items():
        if getattr(args, dest) is None:
            setattr(args, dest, value)


def run(args: argparse.Namespace) -> int:
    fill_defaults(args)
    # validate everything up front so errors name the argument, whichever output is asked for
    theory.speedup(args.alpha, args.k, args.tau)
    from specdec.options import K_MAX

    if not 0 <= args.k_max <= K_MAX:
        raise ValueError(f"--k-max must be in [0, {K_MAX}], got {args.k_max}")
    if args.table:
        rows = table_rows(args.table, args.alpha, args.k, args.tau)
        if args.json:
            print(json.dumps(rows, indent=2))
            return 0
        if args.table == "alpha":
            print(f"speedup across alpha at k={args.k}, tau={_arg(args.tau)}")
            print(f"{'alpha':>6} {'E[tokens]':>10} {'speedup':>8}")
            for r in rows:
                print(f"{r['alpha']:>6.2f} {r['expected_tokens']:>10.4f} {r['speedup']:>7.3f}x")
        else:
            best = theory.best_k(args.alpha, args.tau, rows[-1]["k"])  # ties: the smaller k, as `calc` picks
            print(f"speedup across k at alpha={_arg(args.alpha)}, tau={_arg(args.tau)}")
            print(f"{'k':>3} {'E[tokens]':>10} {'round cost':>11} {'speedup':>8}")
            for r in rows:
                mark = "" if r["k"] != best else "  <- peak" if not rising(args.alpha, best, args.tau) else \
                    "  <- highest here, still rising past k=10 (specdec calc gives the best k)"
                print(f"{r['k']:>3} {r['expected_tokens']:>10.4f} {r['round_cost']:>10.2f}x "
                      f"{r['speedup']:>7.3f}x{mark}")
        return 0
    s = summary(args.alpha, args.k, args.tau, args.k_max)
    if args.json:
        print(json.dumps(s, indent=2))
        return 0
    be = s["break_even_alpha"]
    be_text = ("none (tau > 1: drafting always costs more than it can save)" if be is None
               else "any (k = 0 drafts nothing: plain decoding)" if args.k == 0 else _fixed(be, 4))
    print(f"alpha={_arg(args.alpha)}  k={args.k}  tau={_arg(args.tau)}")
    burst = f"P(full burst of {args.k + 1} token{'' if args.k == 0 else 's'})"
    if s["best_k_capped"]:
        best = (f">= {s['best_k']}, the --k-max cap: the speedup still rises with k "
                f"({s['best_speedup']:.3f}x at k={s['best_k']})")
    else:
        best = f"{s['best_k']}  ({s['best_speedup']:.3f}x)"
    lines = [("expected tokens per round", f"{s['expected_tokens']:.4f}"),
             ("speedup", f"{_fixed(s['speedup'], 3)}x"),
             (burst, _fixed(s["full_burst_probability"], 4)),
             ("best k for this alpha, tau", best),
             ("break-even alpha at this k", be_text)]
    width = max(len(label) for label, _ in lines)  # a long k widens the label column, never runs into a value
    for label, value in lines:
        print(f"{label:<{width}} {value}")
    return 0
