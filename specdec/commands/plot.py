"""`specdec plot`: draw the lesson's curves to an image file (specdec.plots).

    specdec plot surface --tau 0.1 --out surface.png   # speedup over (alpha, k)
    specdec plot rounds --alpha 0.7 -k 4 --out rounds.png
    specdec plot budget -k 4 --out budget.png          # headroom against occupancy
"""

from __future__ import annotations

import argparse


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "plot",
        help="draw the speedup surface, tokens-per-round distribution, or budget curve",
        description=(
            "Draw one of the lesson's pictures: 'surface' is speedup over (alpha, k) for a tau "
            "(Ch. 2), 'rounds' the distribution of tokens per round for (alpha, k) (Ch. 2), "
            "'budget' the idle-compute headroom against batch occupancy (Ch. 7)."
        ),
        epilog="Example: specdec plot surface --tau 0.1 --out surface.png",
    )
    p.add_argument("what", choices=["surface", "rounds", "budget"], help="which picture to draw")
    p.add_argument("--out", required=True, metavar="FILE.png", help="output image (.png, .svg or .pdf)")
    p.add_argument("--alpha", type=float, default=None, help="acceptance rate for 'rounds' (default 0.7)")
    p.add_argument("-k", "--k", type=int, default=None,
                   help="draft length for 'rounds' (0..64) and 'budget' (default 4)")
    p.add_argument("--tau", type=float, default=None, help="draft cost ratio for 'surface' (default 0.1)")
    p.add_argument("--k-max", type=int, default=None, help="largest k on the 'surface' plot, 2..64 (default 12)")
    p.add_argument("--budget", type=float, default=None,
                   help="token positions one step verifies for free, for 'budget' (default 156)")
    p.set_defaults(func=run)


# a flag: its argparse dest, its default (the parser's is None, so a flag given is told from one left out), and
# the pictures that read it
READ_BY = {
    "--alpha": ("alpha", 0.7, {"rounds"}),
    "-k": ("k", 4, {"rounds", "budget"}),
    "--tau": ("tau", 0.1, {"surface"}),
    "--k-max": ("k_max", 12, {"surface"}),
    "--budget": ("budget", 156, {"budget"}),
}


def check_flags_read(args: argparse.Namespace) -> None:
    """Refuse a flag the chosen picture does not read, so that `plot surface --alpha 0.3` (or `--alpha 0.7`, the
    default spelled out) is an error, not a surface drawn without it; then fill in the defaults."""
    for flag, (dest, default, readers) in READ_BY.items():
        if getattr(args, dest) is None:
            setattr(args, dest, default)
        elif args.what not in readers:
            raise ValueError(f"{flag} is read only by the {' and '.join(sorted(readers))} plot"
                             f"{'s' * (len(readers) > 1)}, not by {args.what}: drop {flag}")


def run(args: argparse.Namespace) -> int:
    from specdec import plots, theory

    check_flags_read(args)
    if args.what == "surface":
        path = plots.plot_surface(args.out, tau=args.tau, k_max=args.k_max)
    elif args.what == "rounds":
        theory.expected_tokens(args.alpha, args.k)
        path = plots.plot_rounds(args.out, alpha=args.alpha, k=args.k)
    else:
        theory.headroom(args.budget, 0)
        path = plots.plot_budget(args.out, k=args.k, budget=args.budget)
    print(f"wrote {path}")
    return 0
