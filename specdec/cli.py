"""The `specdec` command. Each subcommand lives in `specdec/commands/<name>.py` and exposes
`register(subparsers)`, which adds its parser and sets `func` to the function that runs it."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from specdec import __version__
from specdec.errors import SpecdecError

COMMANDS = ["models", "pull", "generate", "probe", "quality", "calc", "plot", "bench", "datastore", "exit_layers",
            "race", "serve", "loadtest", "train", "export"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specdec",
        description="Speculative decoding: draft, then verify, without changing what the model says.",
    )
    parser.add_argument("--version", action="version", version=f"specdec {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"specdec.commands.{name}")
        except ModuleNotFoundError as e:  # a command not built yet
            if e.name != f"specdec.commands.{name}":
                raise
            continue
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return args.func(args) or 0
    except (SpecdecError, ValueError) as e:
        print(f"specdec {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`specdec generate ... | head`): stop quietly, as cat does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes
        return 1


if __name__ == "__main__":
    sys.exit(main())
