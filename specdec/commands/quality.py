"""`specdec quality`: perplexity on a held-in text and top-1 agreement with a reference dtype, per dtype."""

from __future__ import annotations

import json

FORMATS = ("q4", "q8", "bf16", "fp32")  # what `specdec quality` scores


def register(sub) -> None:
    from specdec.commands.generate import KV_DTYPES

    p = sub.add_parser("quality", help="perplexity and top-1 agreement of weight formats (q4, q8, bf16, fp32)",
                       description="Score the first --tasks HumanEvalFix dev answers (the fixed function after the "
                                   "bug-fix prompt) in each --dtype: perplexity of the answer tokens, and the "
                                   "fraction of positions whose most likely next token equals the --ref dtype's. "
                                   "Results are saved per model and dtype (`$SPECDEC_HOME/quality/`).")
    p.add_argument("--model", default="smollm2-135m",
                   help="known model name, a Hugging Face folder or a .gguf file (default: smollm2-135m)")
    p.add_argument("--dtype", default="q4,q8", help="comma-separated formats to score: q4, q8, bf16, fp32 "
                                                     "(default q4,q8)")
    p.add_argument("--ref", default="bf16", help="reference dtype for the agreement (default bf16)")
    p.add_argument("--kv-dtype", default="auto", choices=KV_DTYPES,
                   help="the KV cache's dtype for every format scored, the reference's too (default auto: fp16 on "
                        "the CPU's exact paths); results under another than auto are saved as DTYPE+kv-KV")
    p.add_argument("--tasks", type=int, default=8, help="HumanEvalFix dev tasks to score (default 8)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    from specdec.errors import SpecdecError
    from specdec.quality import measure
    from specdec.runtime.loader import load_transformer, resolve_dtype
    from specdec.store import measurement_path, resolve, write_json

    if args.tasks < 1:
        raise SpecdecError("--tasks must be at least 1")
    names = list(dict.fromkeys(d.strip() for d in args.dtype.split(",") if d.strip()))  # q4,q4: scored once
    for d in names + [args.ref]:  # named formats only: auto is whichever this machine would load
        if d not in FORMATS:
            raise SpecdecError(f"specdec quality scores named formats, not {d!r}: give --dtype and --ref from "
                               f"{', '.join(FORMATS)}")
    if not names:
        raise SpecdecError(f"--dtype names no format ({args.dtype!r}): give one or more of q4, q8, bf16, fp32, "
                           "comma-separated")
    from specdec.quality import resolve_prompts

    available = len(resolve_prompts("humanevalfix").read_text().splitlines())
    tasks = min(args.tasks, available)  # --tasks past the set scores all of it: say how many it was
    dtypes = [resolve_dtype(d) for d in names]
    load = lambda folder, dtype: load_transformer(folder, dtype, kv_dtype=args.kv_dtype)  # noqa: E731
    results = measure(args.model, resolve(args.model, pull=True), dtypes, resolve_dtype(args.ref), tasks, load)
    kv = "" if args.kv_dtype == "auto" else f"+kv-{args.kv_dtype}"
    for r in results:
        write_json(measurement_path("quality", r.model, r.dtype + kv), r.to_dict())
    if args.json:
        print(json.dumps([r.to_dict() for r in results], indent=2))
        return 0
    every = f" (all there are; --tasks {args.tasks} asked for more)" if args.tasks > available else ""
    print(f"model {args.model}: {results[0].tokens} answer tokens of {tasks} HumanEvalFix dev tasks{every}, "
          f"KV cache {args.kv_dtype}")
    print(f"{'dtype':>5} {'perplexity':>11} {'top-1 vs ' + results[0].dtype:>14}")
    for r in results:
        print(f"{r.dtype:>5} {r.perplexity:>11.4f} {r.agreement:>14.2%}")
    return 0
