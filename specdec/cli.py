"""The `specdec` command. Each subcommand lives in `specdec/commands/<name>.py` and exposes
`register(subparsers)`, which adds its parser and sets `func` to the function that runs it."""

from __future__ import annotations

import argparse
import importlib
import os
import re
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
    parser.commands = sub.choices  # name -> its parser, for `in_cli_words`
    no_abbreviations(parser)
    return parser


def no_abbreviations(parser: argparse.ArgumentParser) -> None:
    """Turn off argparse's prefix matching in `parser` and every subcommand's: `calc --k 8` was read as
    `--k-max 8` (k stayed 4, without a word), and a prefix that means one flag today means another once a
    longer one is added."""
    parser.allow_abbrev = False
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                no_abbreviations(child)


def in_cli_words(message: str, parser: argparse.ArgumentParser) -> str:
    """An error from the Python API in the command's words: a parameter's name (top_p) becomes its option's flag
    (--top-p) where it has an underscore, or where it starts the message followed by "must" or a quoted value.
    Example: "tree_nodes must be an integer >= 1 ..." -> "--tree-nodes must be an integer >= 1 ...";
    "seed must be ..." -> "--seed must be ..."; "stop strings must be ..." stays."""
    flags = {a.dest: max(a.option_strings, key=len) for a in parser._actions if a.option_strings}
    message = re.sub(r"\b[a-z]+(?:_[a-z]+)+\b", lambda m: flags.get(m[0], m[0]), message)
    name, _, rest = message.partition(" ")
    return f"{flags[name]} {rest}" if name in flags and rest.startswith(("must", "'", '"')) else message


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return args.func(args) or 0
    except (SpecdecError, ValueError) as e:
        from specdec.options import OptionError  # the API's own checks name its parameters; others are left as they are

        message = in_cli_words(str(e), parser.commands[args.command]) if isinstance(e, OptionError) else str(e)
        print(f"specdec {args.command}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`specdec generate ... | head`): stop quietly, as cat does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes
        return 1


if __name__ == "__main__":
    sys.exit(main())
