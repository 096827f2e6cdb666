"""`specdec bench`: tokens/s, speedup, mean accepted length and acceptance rate per method and category.

    specdec bench --model smollm2-135m --methods plain,prompt-lookup --prompts humanevalfix \\
        --limit 5 --max-new-tokens 128 --compare-hf --dtype fp32 --out benchmarks/smollm2-humanevalfix

Prints a Markdown table and writes DIR/results.md, DIR/results.json (every generation and the
summary) and DIR/speedup.png. See specdec/bench/ for the rules (warm-up, interleaving, greedy check).
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path


def register(sub) -> None:
    from specdec.commands.generate import (DEVICE_HELP, DTYPE_HELP, DTYPES, KV_DTYPE_HELP, KV_DTYPES, add_lookahead_args,
                                          add_medusa_args, parse_k)

    p = sub.add_parser(
        "bench", help="benchmark decoding methods on prompt sets (Spec-Bench, HumanEvalFix)",
        description=(
            "Run every prompt through every method, interleaved (each method gets one untimed warm-up, "
            "then for each prompt all methods run back to back), and report per method x category: "
            "tokens/s (median and total), speedup over our plain decoding (ratio of total wall time on the "
            "same prompts; plain is always included), mean accepted length (new tokens per target forward), "
            "acceptance rate alpha, and whether every method's tokens equal plain's (greedy: all of them; sampling "
            "with a seed: those whose drafts are deterministic, which then give plain sampling's tokens). "
            "Multi-turn prompts run turn after turn, each turn's chat holding the earlier questions and plain "
            "decoding's answers. With --compare-hf, transformers' generate runs on the same prompt ids and "
            "weights as hf-plain, hf-assisted (with --draft) and hf-prompt-lookup, and every speedup is also "
            "given against hf-plain."),
        epilog=("Writes DIR/results.md (table, command, date, machine), DIR/results.json (every generation "
                "and the summary) and DIR/speedup.png; prints the table to stdout and a progress bar to "
                "stderr. Example: specdec bench --model smollm2-135m --methods plain,prompt-lookup "
                "--prompts humanevalfix --limit 5 --compare-hf --out benchmarks/smollm2-humanevalfix"),
    )
    p.add_argument("--model", default="smollm2-135m",
                   help="target model: a known name (see `specdec models`), a Hugging Face folder or a .gguf "
                        "file (default: smollm2-135m)")
    p.add_argument("--draft", metavar="NAME", default=None,
                   help="draft model for method 'draft' and for hf-assisted (same tokenizer as the target)")
    p.add_argument("--datastore", metavar="DIR", default=None,
                   help="datastore for method 'retrieval' (default: the model's ShareGPT datastore)")
    p.add_argument("--sources", default="prompt-lookup,draft", metavar="A,B",
                   help="ordered drafters for method 'hybrid' (default prompt-lookup,draft), e.g. prompt-lookup,eagle")
    p.add_argument("--methods", default="plain,prompt-lookup",
                   help="comma-separated methods from specdec.api.METHODS; plain is added when missing "
                        "(default: plain,prompt-lookup). medusa and eagle may name a tree after '@' to race "
                        "trees in one run: eagle@chain,eagle@dynamic,medusa@chain")
    p.add_argument("--prompts", required=True, metavar="FILE.jsonl",
                   help="'spec-bench' (data/spec_bench/dev.jsonl), 'humanevalfix' "
                        "(data/code_edit/humanevalfix_dev.jsonl) or a path to a jsonl file in either format")
    p.add_argument("--categories", default=None, metavar="A,B",
                   help="comma-separated categories to keep (default: all)")
    p.add_argument("--limit", type=int, default=None, metavar="N",
                   help="the first N prompts of each category, in file order (default: all)")
    p.add_argument("--max-new-tokens", type=int, default=128, metavar="N",
                   help="token limit per generation, i.e. per turn (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="0 = greedy, the default (then every method's tokens are checked against plain's; under "
                        "sampling, those of the methods with deterministic drafts)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="nucleus mass in (0, 1] (default 1 = off)")
    p.add_argument("--top-k", type=int, default=0, metavar="K", help="keep the K likeliest tokens (default 0 = off)")
    p.add_argument("--min-p", type=float, default=0.0, metavar="P",
                   help="drop tokens below P x the likeliest one's probability (default 0 = off)")
    p.add_argument("--seed", type=int, default=0, help="random seed for sampling, ours and HF's (default 0)")
    p.add_argument("--dtype", default="auto", choices=DTYPES,
                   help=DTYPE_HELP + "; HF runs the same weights in the same dtype (bf16 for q8/q4)")
    p.add_argument("--kv-dtype", default="auto", choices=KV_DTYPES, help=KV_DTYPE_HELP)
    p.add_argument("--k", type=parse_k, default="auto", metavar="auto|N",
                   help="draft length: auto (adaptive, the default) or a fixed N in 0..1000")
    p.add_argument("--device", default="cpu", metavar="cpu|cuda[:N]", help=DEVICE_HELP + " (--compare-hf runs "
                   "transformers on the same device; --compare-llamacpp runs on cpu only)")
    add_lookahead_args(p, flag="--methods")
    add_medusa_args(p, acceptance=False, flag="--methods")  # benchmarks verify exactly
    p.add_argument("--plain-dtypes", default=None, metavar="D,D",
                   help="also time our plain decoding in these dtypes, each its own loaded model, interleaved "
                        "with the rest (rows plain-D; not checked against plain's tokens: other weights), "
                        "e.g. --dtype q4 --plain-dtypes bf16,q8")
    p.add_argument("--compare-hf", action="store_true",
                   help="also run transformers' generate: hf-plain, hf-assisted (with --draft), hf-prompt-lookup")
    p.add_argument("--compare-llamacpp", action="store_true",
                   help="also run llama.cpp (pip install -e '.[compare]') on the model's own GGUF file, greedy, "
                        "same threads: llamacpp-plain and llamacpp-prompt-lookup (LlamaPromptLookupDecoding); "
                        "every speedup is also given against llamacpp-plain")
    p.add_argument("--llamacpp-gguf", metavar="FILE", default=None,
                   help="the GGUF file llama.cpp loads (default: the file the model was converted from; a known model's packages are fetched again once)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar on stderr")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="folder for results.md, results.json, speedup.png (created if needed; checked before the run)")
    p.set_defaults(func=run)


THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def command_line(args) -> str:
    """The command as typed (thread-count environment variables included), else rebuilt from args."""
    env = [f"{k}={os.environ[k]}" for k in THREAD_ENV if k in os.environ]
    if Path(sys.argv[0]).name == "specdec":
        return shlex.join(env + ["specdec"] + sys.argv[1:])
    parts = env + ["specdec", "bench", "--model", args.model]
    if args.draft:
        parts += ["--draft", args.draft]
    if getattr(args, "datastore", None):
        parts += ["--datastore", args.datastore]
    if getattr(args, "sources", "prompt-lookup,draft") != "prompt-lookup,draft":
        parts += ["--sources", args.sources]
    parts += ["--methods", args.methods, "--prompts", args.prompts]
    if args.categories:
        parts += ["--categories", args.categories]
    if args.limit is not None:
        parts += ["--limit", str(args.limit)]
    parts += ["--max-new-tokens", str(args.max_new_tokens), "--temperature", str(args.temperature),
              "--top-p", str(args.top_p), "--seed", str(args.seed), "--dtype", args.dtype, "--k", str(args.k)]
    if args.top_k or args.min_p:
        parts += ["--top-k", str(args.top_k), "--min-p", str(args.min_p)]
    if args.kv_dtype != "auto":
        parts += ["--kv-dtype", args.kv_dtype]
    if args.device != "cpu":
        parts += ["--device", args.device]
    for flag in ("heads", "tree", "tree_nodes"):
        if getattr(args, flag, None) not in (None, "auto"):
            parts += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
    if getattr(args, "plain_dtypes", None):
        parts += ["--plain-dtypes", args.plain_dtypes]
    if args.compare_hf:
        parts.append("--compare-hf")
    if args.compare_llamacpp:
        parts.append("--compare-llamacpp")
    if args.llamacpp_gguf:
        parts += ["--llamacpp-gguf", args.llamacpp_gguf]
    return shlex.join(parts + ["--out", args.out])


def run(args) -> int:
    from specdec.bench import prompts as P
    from specdec.bench import report, runner
    from specdec.commands.generate import DTYPES, check_flags_read, lookahead_arg
    from specdec.options import GenerationOptions, check_k, check_setup

    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be at least 1, got {args.limit}")
    GenerationOptions(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                      top_k=args.top_k, min_p=args.min_p, seed=args.seed)  # the same checks as generate, before anything loads
    check_k(args.k)
    if args.compare_llamacpp and args.temperature > 0:
        raise ValueError("--compare-llamacpp runs greedy only: drop --temperature")
    if args.llamacpp_gguf is not None and not args.compare_llamacpp:  # read by nothing else: said, not ignored
        raise ValueError("--llamacpp-gguf is llama.cpp's file for --compare-llamacpp: add that, or drop it")
    if args.device != "cpu" and args.compare_llamacpp:
        raise ValueError("--compare-llamacpp runs on the CPU: drop it or use --device cpu")
    methods = runner.parse_methods(args.methods)
    plain_dtypes = [d.strip() for d in (args.plain_dtypes or "").split(",") if d.strip()]
    bad = [d for d in plain_dtypes if d not in DTYPES]
    if bad:
        raise ValueError(f"--plain-dtypes {','.join(bad)}: choose from {', '.join(DTYPES)}")
    for method in methods:
        name, _, tree = method.partition("@")
        check_setup(draft=args.draft, sources=args.sources, lookahead=lookahead_arg(args), method=name,
                    tree=tree or args.tree, tree_nodes=args.tree_nodes, heads=args.heads)
    check_flags_read(args, [m.partition("@")[0] for m in methods], also={"--draft": args.compare_hf})
    report.check_out(args.out)
    cats = [c.strip() for c in args.categories.split(",") if c.strip()] if args.categories else None
    prompts = P.load_prompts(args.prompts, cats, args.limit)

    from specdec.api import LLM
    from specdec.store import resolve

    if args.draft:
        resolve(args.draft, pull=True)  # an unknown draft model fails now, not after loading the target
    llamacpp_gguf = None
    if args.compare_llamacpp:  # llama-cpp-python missing fails now; its GGUF, once fetched, serves q4's build too
        from specdec.bench.llamacpp import gguf_for, require_llama_cpp

        require_llama_cpp()
        llamacpp_gguf = str(gguf_for(resolve(args.model, pull=True), args.llamacpp_gguf))
    from specdec.commands.generate import medusa_kwargs

    llm = LLM(args.model, dtype=args.dtype, device=args.device, kv_dtype=args.kv_dtype, draft=args.draft, datastore=args.datastore,
              sources=args.sources, lookahead=lookahead_arg(args), **medusa_kwargs(args))
    dtype = str(llm.dtype).replace("torch.", "")
    settings = runner.BenchSettings(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                    top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, k=args.k, seed=args.seed)
    runners = runner.our_methods(llm, methods, settings)
    for d in plain_dtypes:
        other = LLM(args.model, dtype=d, device=args.device)
        if other.dtype == llm.dtype:
            raise ValueError(f"--plain-dtypes {d}: that is the benchmark's own dtype ({dtype}); name another")
        runners.append(runner.OurMethod(other, "plain", settings, name=f"plain-{d}", checked=False))
    if args.compare_hf:
        if not args.progress:  # transformers' own bars too ("Loading weights")
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
        runners += runner.hf_methods(llm, settings, args.draft)
    if args.compare_llamacpp:
        from specdec.bench.llamacpp import llamacpp_methods

        runners += llamacpp_methods(llm, settings, llamacpp_gguf)
    mismatches: list[str] = []

    def say(line: str) -> None:
        mismatches.append(line)
        from tqdm import tqdm

        tqdm.write(line, file=sys.stderr)

    from specdec.probe import gpu_name, measure_bandwidth

    before = measure_bandwidth()  # shared hosts' bandwidth drifts: the report says what it was
    records = runner.run_bench(llm, prompts, runners, settings, progress=args.progress, report=say)
    rows = report.summarize(records, [r.name for r in runners])
    from specdec.runtime.loader import attention_path, matmul_path

    machine = dict(report.machine_info(), memory_gbs=[round(before, 1), round(measure_bandwidth(), 1)],
                   gpu=gpu_name(llm.model.device) or None)
    meta = dict(command=command_line(args), date=report.now(), machine=machine, model=args.model,
                draft=args.draft, dtype=dtype, matmul=matmul_path(llm.model), attention=attention_path(llm.model), prompts=str(P.resolve_prompts(args.prompts)),
                n_prompts=len(prompts), n_turns=sum(len(p.turns) for p in prompts),
                methods=[r.name for r in runners],
                settings=dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                              top_k=args.top_k, min_p=args.min_p, seed=args.seed, k=args.k, limit=args.limit, categories=cats,
                              method_kwargs=settings.method_kwargs, hf_prompt_lookup_num_tokens=(
                                  runner.HF_PROMPT_LOOKUP_TOKENS if args.compare_hf else None)),
                mismatches=mismatches)
    paths = report.write_outputs(args.out, records, rows, meta)
    print(report.markdown_table(rows, settings.checks_tokens))
    if mismatches:
        print(f"\n{len(mismatches)} mismatch(es) against plain decoding's tokens (see results.md)", file=sys.stderr)
    print(f"wrote {paths['md']}, {paths['json']}, {paths['png']}", file=sys.stderr)
    return 0
