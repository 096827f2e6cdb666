"""`specdec serve`: an OpenAI-compatible server whose batched engine speculates only within the measured
idle budget (the lesson's Chapter 7; specdec.serving)."""

from __future__ import annotations

import os
import sys

from specdec.commands.generate import add_model_args


def register(sub) -> None:
    p = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API, batched",
                       description="Serve /v1/completions, /v1/chat/completions (streaming and not), /v1/models, "
                                   "/health, /metrics and /dashboard. Requests share each target forward (continuous batching); "
                                   "before every step the scheduler grants each request a draft length from its own "
                                   "measured acceptance, only as far as the idle compute the batch leaves pays for it "
                                   "(--budget), interactive requests first. Ctrl-C stops it (in-flight requests get "
                                   "--grace seconds to finish, then are cancelled: a 503, or a stream ended by an error "
                                   "event and [DONE]).")
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = any free port)")
    p.add_argument("--speculation", default="auto", choices=["auto", "always", "never"],
                   help="auto (default): speculate only where it pays at the current load, by priority; always: every "
                        "request drafts its adaptive k whatever the load; never: plain batched decoding")
    p.add_argument("--method", default="prompt-lookup", choices=["prompt-lookup", "recycling", "eagle", "plain"],
                   help="drafter for requests that speculate (default prompt-lookup; a request's "
                        "`speculation` field may choose another). recycling: token recycling, one table of the "
                        "model's top candidates shared by every request, trees sized by the probe's budget. "
                        "eagle: the model's EAGLE head (shipped for "
                        "smollm2-135m, else `specdec train eagle` or --heads), loaded once, a head cache per "
                        "request; offered to requests whenever the model has a head")
    p.add_argument("--heads", default=None, metavar="DIR",
                   help="EAGLE head folder (default: the one trained or shipped for --model)")
    p.add_argument("--max-batch", type=int, default=8, help="requests running at once; more wait (default 8)")
    p.add_argument("--budget", default="auto", metavar="N|auto",
                   help="what speculation may spend: auto (default) = the forward-cost curve `specdec probe` "
                        "measured for this model and dtype (measured once if missing): a request gets its k "
                        "when the tokens it adds per time it adds beat the step's own predicted rate by 20%%; N = "
                        "the lesson's budget line: "
                        "B + the speculating requests' k + 1 stay within N positions")
    p.add_argument("--prefill-chunk", type=int, default=128, metavar="N",
                   help="prompt tokens prefilled per step beside decoding, all new requests together (default "
                        "128). Exact models (q8, q4, bf16 on the kernel) cut a prompt anywhere, with the same bits; "
                        "others in whole pieces cut at multiples of 256 positions as single-request decoding cuts "
                        "them, at least one piece per step")
    p.add_argument("--prefill-stall", type=float, default=4.0, metavar="X",
                   help="exact models: a step that prefills beside decoding requests takes only the prompt "
                        "positions that keep it within X decode-only steps by the measured cost curve (at least "
                        "one position; the whole --prefill-chunk when no request decodes), so a new prompt delays "
                        "the streams of the others by a bounded amount (default 4; 0 = off: the whole chunk "
                        "every step)")
    p.add_argument("--grace", type=float, default=5.0, metavar="SECONDS",
                   help="after Ctrl-C (or SIGTERM), how long in-flight requests may run before they are cancelled "
                        "(default 5; a second Ctrl-C cancels them at once)")
    p.add_argument("--api-key", default=os.environ.get("SPECDEC_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $SPECDEC_API_KEY, else none)")
    p.set_defaults(func=run)


def budget_arg(value: str) -> float | None:
    """None for auto (the measured curve decides), else a positive number of positions."""
    from specdec.errors import SpecdecError

    if value == "auto":
        return None
    try:
        budget = float(value)
    except ValueError:
        budget = 0.0
    if not budget > 0 or budget == float("inf"):
        raise SpecdecError(f"--budget must be 'auto' or a positive number of positions, got {value!r}")
    return budget


def run(args) -> int:
    import uvicorn

    from specdec.api import LLM
    from specdec.commands import listen
    from specdec.errors import SpecdecError
    from specdec.runtime.threads import release_threads
    from specdec.serving.app import Server, create_app
    from specdec.serving.engine import Engine, check_stall

    if args.max_batch < 1 or args.prefill_chunk < 1:
        raise SpecdecError("--max-batch and --prefill-chunk must be at least 1")
    check_stall(args.prefill_stall)  # before the model loads
    if not 0 <= args.grace < float("inf"):
        raise SpecdecError(f"--grace must be a number of seconds >= 0, got {args.grace}")
    if args.api_key is not None and not args.api_key.strip():  # "" would turn the key off without a word
        raise SpecdecError("--api-key is empty (or SPECDEC_API_KEY is): give a key, or leave both unset to serve without one")
    if args.api_key is not None and args.api_key != args.api_key.strip():  # clients' tokens are read stripped
        raise SpecdecError("--api-key (or SPECDEC_API_KEY) starts or ends with whitespace, which no client's "
                           "'Authorization: Bearer KEY' can match: give the key without it")
    if not 0 <= args.port <= 65535:
        raise SpecdecError(f"--port must be in [0, 65535], got {args.port}")
    if args.speculation == "always" and args.method == "plain":
        raise SpecdecError("--speculation always with --method plain: requests would not draft unless they ask; "
                           "name a drafter (--method prompt-lookup|recycling|eagle), or serve --speculation never")
    budget = budget_arg(args.budget)
    sock = listen(args.host, args.port)  # a busy port or a bad host: one line, before the model loads
    llm = LLM(args.model, dtype=args.dtype, device=args.device, kv_dtype=args.kv_dtype, heads=args.heads)
    from specdec.drafters.recycling import Recycling

    # token recycling: one table for the server, a context per request; its tree sized by the budget
    recycling = llm.drafter("recycling") if budget is None else Recycling(nodes=max(2, int(budget) - 1))
    drafters = {"recycling": recycling.fresh}
    try:
        drafters["eagle"] = llm.drafter("eagle").fresh  # one head for the server, a head cache per request
    except SpecdecError:
        if args.method == "eagle" or args.heads:
            raise
    engine = Engine(llm.model, llm.tokenizer, budget=budget, cost=llm.cost_curve(measure=budget is None),
                    speculation=args.speculation, max_batch=args.max_batch, prefill_chunk=args.prefill_chunk,
                    drafters=drafters, prefill_stall=args.prefill_stall)
    app = create_app(engine, args.model, method=args.method, api_key=args.api_key)
    spend = "the measured cost curve" if budget is None else f"a budget of {budget:g} positions"
    print(f"specdec serve: {args.model} (speculation {args.speculation} within "
          f"{spend}, method {args.method}; methods {', '.join(engine.methods)}; max batch {args.max_batch}"
          + (", API key required" if args.api_key else "") + "); Ctrl-C stops", file=sys.stderr)

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                            timeout_graceful_shutdown=args.grace + 5)
    release_threads()  # the model ran in this thread (loading, the cost curve): its OpenMP pool would slow the engine's
    try:
        Server(config, engine, args.grace).run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it handled, once it has shut down (as uvicorn.run)
        pass
    return 0
