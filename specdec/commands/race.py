"""`specdec race`: the lesson's Chapter 8 race as a local web page (simulated and live)."""

from __future__ import annotations

import argparse


def register(sub) -> None:
    from specdec.commands.generate import DTYPES

    p = sub.add_parser(
        "race", help="a live side-by-side race of vanilla and speculative decoding in the browser",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Start a local web server with the lesson's Chapter 8 race and print its URL.\n\n"
                    "Simulated race: workload presets (code editing 0.82, summarization 0.75, open chat 0.60,\n"
                    "RAG 0.50, creative writing 0.15), alpha, k (0-10), draft cost tau, batch occupancy B\n"
                    "(0-200), the budget (156, or the one `specdec probe` measured here) and the step time\n"
                    "(7 ms, or measured), a seed, play/pause/reset; live readouts against the formula.\n"
                    "Live race: plain decoding, then a speculative method, on --model, replayed side by\n"
                    "side at their real pace. Widgets: the speedup surface, tokens per round, headroom.",
        epilog="example: specdec race --model smollm2-135m --port 8000   (then open the printed URL)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = any free port)")
    p.add_argument("--model", default="smollm2-135m",
                   help="model for the live race, loaded in the background at startup: a known name (see "
                        "`specdec models`; pulled if needed), a Hugging Face folder or a .gguf file (default: smollm2-135m)")
    p.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="compute dtype of the live race (default auto)")
    p.add_argument("--draft", default=None, metavar="NAME",
                   help="draft model for the live race's method 'draft' (same tokenizer as --model)")
    p.add_argument("--datastore", default=None, metavar="DIR",
                   help="datastore for method 'retrieval' (default: the model's ShareGPT datastore, if built)")
    p.add_argument("--exit-layer", default="auto", metavar="L",
                   help="exit layer for method 'early-exit', or 'auto' (default: measured on first use)")
    p.add_argument("--sources", default=None, metavar="A,B",
                   help="ordered drafters for method 'hybrid' (default prompt-lookup,draft with --draft, "
                        "else prompt-lookup,early-exit)")
    p.set_defaults(func=run)


def run(args) -> int:
    import uvicorn

    from specdec.commands import listen
    from specdec.race.server import create_app

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    sock = listen(args.host, args.port)  # a busy port or a bad host: one line, before the model loads
    app = create_app(args.model, dtype=None if args.dtype == "auto" else args.dtype, draft=args.draft,
                     datastore=args.datastore, exit_layer=args.exit_layer, sources=args.sources)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning")
    server = uvicorn.Server(config)
    _announce(server, args.host)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it handled once it has shut down: a normal stop (as serve)
        pass
    return 0


def _announce(server, host: str) -> None:
    """Print the URL once the socket is bound (so --port 0 prints the real port)."""
    startup = server.startup

    async def startup_then_print(sockets=None):
        await startup(sockets=sockets)
        if server.started:
            port = server.servers[0].sockets[0].getsockname()[1] if server.servers else server.config.port
            print(f"specdec race: open {url(host, port)}  (Ctrl-C to stop)", flush=True)

    server.startup = startup_then_print


def url(host: str, port: int) -> str:
    """The page's address: a wildcard host shown as 127.0.0.1, an IPv6 one in brackets (RFC 3986:
    http://[::1]:8000/, not http://::1:8000/, which no browser opens)."""
    shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    if ":" in shown:
        shown = f"[{shown}]"
    return f"http://{shown}:{port}/"
