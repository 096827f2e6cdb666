"""`specdec exit-layers`: measure alpha and tau per early-exit layer and cache the best one
(the measurement itself lives in `specdec.exit_layers`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from specdec.errors import SpecdecError
from specdec.exit_layers import DEFAULT_PROMPTS, check_layers, measure_exit_layers, save


# --- the command ----------------------------------------------------------------------------------------


def read_prompts(path: str, limit: int | None) -> list[str]:
    """Prompts from a file: Spec-Bench jsonl (first turn), HumanEvalFix jsonl (instruction + buggy code),
    jsonl with "prompt" or "text", or plain text (one prompt per line)."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise SpecdecError(f"{p} is a folder, not a prompts file" if p.is_dir() else f"no such prompts file: {p}")
    out = []
    try:
        text_lines = p.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise SpecdecError(f"{p}: not UTF-8 text (byte {e.start}): give a text or jsonl prompts file") from None
    for i, line in enumerate(text_lines, 1):
        if not line.strip():
            continue
        if p.suffix == ".jsonl":
            try:
                d = json.loads(line)
            except json.JSONDecodeError as e:
                raise SpecdecError(f"{p}:{i}: not valid JSON ({e.msg})") from None
            text = record_text(d, f"{p}:{i}")
        else:
            text = line
        out.append(text)
        if limit and len(out) >= limit:
            break
    if not out:
        raise SpecdecError(f"{p}: no prompts")
    return out


def record_text(d, where: str) -> str:
    """The prompt of one jsonl record (Spec-Bench's first turn, HumanEvalFix's instruction + buggy code, or its
    "prompt" or "text"); a record of another shape, or whose prompt is not a non-empty string, is an error naming
    `where` (file:line). Example: {"turns": []} or "some text" (a JSON string, not an object) are refused."""
    if not isinstance(d, dict):
        raise SpecdecError(f"{where}: not a JSON object")
    need = "a non-empty string"
    if "turns" in d:
        text = d["turns"][0] if isinstance(d["turns"], list) and d["turns"] else None
        need = "a non-empty string in turns[0]"
    elif "buggy_solution" in d:
        need += " (a HumanEvalFix record needs an instruction too)"
        parts = (d.get("instruction"), d.get("declaration", ""), d["buggy_solution"])
        text = parts[0] + "\n\n" + parts[1] + parts[2] if all(isinstance(x, str) for x in parts) else None
    elif "prompt" in d or "text" in d:
        text = d.get("prompt") or d.get("text")
    else:
        raise SpecdecError(f"{where}: no turns, buggy_solution, prompt or text field")
    if not isinstance(text, str) or not text.strip():
        raise SpecdecError(f"{where}: the prompt is not {need}")
    return text


def register(sub) -> None:
    from specdec.commands.generate import add_model_args

    p = sub.add_parser("exit-layers", help="measure alpha and tau per early-exit layer and pick the best",
                       description="For each candidate exit layer L, measure the acceptance alpha of early-exit "
                                   "drafts (greedy) and the draft cost tau (one L-layer step over one full step), "
                                   "print the speedup the lesson's formula predicts and the measured tokens/s "
                                   "against plain decoding, and cache the best L for --exit-layer auto.")
    add_model_args(p)
    p.add_argument("--layers", default=None, help="comma-separated exit layers (default: 1/8 .. 3/4 of the depth)")
    p.add_argument("--k", type=int, default=4, help="draft length while measuring (default 4)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens per prompt (default 64)")
    p.add_argument("--prompts", action="append", default=[], metavar="FILE",
                   help="prompts file (Spec-Bench or HumanEvalFix jsonl, or text lines); repeatable "
                        "(default: three built-in prompts)")
    p.add_argument("--limit", type=int, default=3,
                   help="prompts per file, or of the built-in ones (default 3, all three built-in)")
    p.add_argument("--no-reuse", dest="reuse", action="store_false",
                   help="verify with the plain forward (no LayerSkip KV reuse)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    from specdec.api import LLM
    from specdec.store import local_layers

    layers = None
    if args.layers is not None:
        try:
            layers = [int(x) for x in args.layers.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"--layers must be comma-separated integers, got {args.layers!r}") from None
        if not layers:  # `--layers ,` named none: not the default set measured in its place
            raise ValueError(f"--layers names no exit layer ({args.layers!r}): give one or more, comma-separated")
    if args.limit < 1:
        raise ValueError(f"--limit must be at least 1, got {args.limit}")
    if args.k < 1 or args.max_new_tokens < 2:  # before the model loads
        raise ValueError(f"--k must be at least 1 and --max-new-tokens at least 2, got {args.k} and "
                         f"{args.max_new_tokens}")
    if layers is not None:  # before the model loads (its layer count read from its folder when it is on disk)
        check_layers(layers, local_layers(args.model))
    prompts = [t for f in args.prompts for t in read_prompts(f, args.limit)] or list(DEFAULT_PROMPTS)[:args.limit]
    llm = LLM(args.model, dtype=args.dtype, device=args.device, kv_dtype=args.kv_dtype)
    say = None if args.json else (lambda s: print(f"  {s}", file=sys.stderr, flush=True))
    report = measure_exit_layers(llm, prompts, layers, k=args.k, max_new_tokens=args.max_new_tokens,
                                 reuse=args.reuse, progress=say)
    path = save(report)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
        return 0
    print(f"model {report.model}, {report.dtype}, {report.num_layers} layers, {report.threads} threads; "
          f"{report.prompts} prompts x {report.max_new_tokens} tokens, greedy, k = {report.k}, "
          f"KV reuse {'on' if report.reuse else 'off'}")
    print(f"plain: {report.plain_tokens_per_s:.1f} tokens/s; verify({report.k + 1}) = {report.verify_cost:.2f} steps")
    print(f"{'L':>3} {'alpha':>6} {'tau':>5} {'tau@loop':>8} {'tok/fwd':>7} {'pred':>6} {'pred@v':>6} "
          f"{'best k':>6} {'tok/s':>6} {'meas':>6}")
    for r in report.rows:
        mark = "  <- best" if r.exit_layer == report.best else ""
        print(f"{r.exit_layer:>3} {r.alpha:>6.3f} {r.tau:>5.2f} {r.tau_loop:>8.2f} {r.mean_accepted:>7.2f} "
              f"{r.predicted:>5.2f}x {r.predicted_measured:>5.2f}x {r.best_k:>6} {r.tokens_per_s:>6.1f} "
              f"{r.speedup:>5.2f}x{mark}")
    print("pred = theory.speedup(alpha, k, tau); pred@v = E(alpha, k) / (verify(k+1) + k tau); "
          "meas = tokens/s over plain's")
    best = report.row(report.best)
    if best.predicted_measured < 1:
        print(f"no exit layer is predicted to beat plain decoding on this machine (best: L = {report.best}, "
              f"{best.predicted_measured:.2f}x); adaptive k will mostly choose k = 0")
    print(f"best exit layer: {report.best} (saved to {path}; --exit-layer auto uses it)")
    return 0
