"""`specdec loadtest`: bounded load against `specdec serve` on this machine (specdec.serving.loadtest), or
against servers it starts itself, one per speculation mode, with the modes interleaved per level."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time

WAVES = 4  # --waves' default: requests per level, in multiples of its concurrency


def levels_arg(value: str) -> list[int]:
    try:
        levels = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        levels = []
    if not levels or any(not 1 <= c <= 256 for c in levels):
        raise argparse.ArgumentTypeError(f"concurrency must be a list like 1,2,4,8 of integers in [1, 256], got {value!r}")
    if len(set(levels)) < len(levels):
        raise argparse.ArgumentTypeError(f"--concurrency names a level twice in {value!r}: name each once "
                                         "(--repeat runs every level again)")
    return levels


def modes_arg(value: str) -> list[str]:
    modes = [v.strip() for v in value.split(",") if v.strip()]
    if not modes or any(m not in ("auto", "always", "never") for m in modes):
        raise argparse.ArgumentTypeError(f"--serve takes modes from auto,always,never, got {value!r}")
    if len(set(modes)) < len(modes):  # two servers of one mode: each level run twice, compared with itself
        raise argparse.ArgumentTypeError(f"--serve names a mode twice in {value!r}: name each once "
                                         "(--repeat runs every level again)")
    return modes


SERVE_FLAGS = (("--dtype", "dtype", "auto"), ("--kv-dtype", "kv_dtype", "auto"), ("--device", "device", "cpu"),
               ("--budget", "budget", "auto"), ("--max-batch", "max_batch", 16), ("--method", "method", "prompt-lookup"))


def register(sub) -> None:
    from specdec.commands.generate import DTYPES, KV_DTYPES

    p = sub.add_parser("loadtest", help="measure a local `specdec serve` under concurrent streaming load",
                       description="For each concurrency level, send --requests streaming chat requests (greedy) with "
                                   "at most that many in flight, and report throughput, time to first token, p50/p99 "
                                   "inter-token latency and errors, as Markdown, JSON and a plot. Loopback only; each level "
                                   "is bounded by --requests and --timeout. With --serve, start one server per "
                                   "speculation mode (each on a free port) and interleave the modes at every level.")
    p.add_argument("--url", default=None, help="a running server, e.g. http://127.0.0.1:8000 (what `specdec serve` prints when ready), "
                        "or its /v1 base URL (loopback only)")
    p.add_argument("--serve", type=modes_arg, default=None, metavar="MODES",
                   help="instead of --url: start `specdec serve --speculation MODE` for each of these modes "
                        "(e.g. auto,always,never) with --model, --dtype, --kv-dtype, --device, --budget, --max-batch and --method")
    p.add_argument("--model", default=None,
                   help="model name to request (default: the server's; with --serve: the model to serve, "
                        "default smollm2-135m)")
    p.add_argument("--dtype", default="auto", choices=DTYPES, help="with --serve: the weights' dtype (default auto)")
    p.add_argument("--kv-dtype", default="auto", choices=KV_DTYPES,
                   help="with --serve: the KV cache's dtype (default auto)")
    p.add_argument("--device", default="cpu", metavar="cpu|cuda[:N]",
                   help="with --serve: the servers' --device (default cpu)")
    p.add_argument("--budget", default="auto", help="with --serve: the servers' --budget (default auto: the probe's)")
    p.add_argument("--max-batch", type=int, default=16, help="with --serve: the servers' --max-batch (default 16)")
    p.add_argument("--method", default="prompt-lookup", choices=["prompt-lookup", "recycling", "eagle"],
                   help="with --serve: the servers' --method, the drafter of speculating requests (default prompt-lookup)")
    p.add_argument("--concurrency", type=levels_arg, default=[1, 2, 4, 8], metavar="C,C,...",
                   help="concurrency levels (default 1,2,4,8)")
    p.add_argument("--requests", type=int, default=None, metavar="N",
                   help="requests per level (default: 4 x the level's concurrency, at least 16). With N no more than "
                        "the concurrency every request starts at once and the level times its slowest request, not "
                        "the server's throughput at that load: speculation then gains only where it speeds up the "
                        "slowest one")
    p.add_argument("--waves", type=int, default=None, metavar="W",
                   help="without --requests: W x the level's concurrency requests (at least 4 W; default 4). Shorter "
                        "levels leave time for more --repeat runs, which the paired comparison of modes needs more")
    p.add_argument("--repeat", type=int, default=1, metavar="R",
                   help="run every level R times per server, the servers' order rotated each time, and report the "
                        "median run's throughput with latencies pooled over the runs, and each mode's paired ratio "
                        "to the others (default 1; the machine's speed drifts, so a comparison of modes wants 3 or "
                        "more, and from 6 the table gives the paired ratio's 95%% interval)")
    p.add_argument("--prompts", default="spec-bench",
                   help="spec-bench (default), humanevalfix, or a jsonl file in either format (first turns are used)")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens per request (default 64)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per level; later requests are errors (default 300)")
    p.add_argument("--api-key", default=os.environ.get("SPECDEC_API_KEY"),
                   help="bearer token, if the server requires one (default: $SPECDEC_API_KEY, which servers started "
                        "by --serve read too)")
    p.add_argument("--out", default="out/loadtest",
                   help="folder for loadtest.md, loadtest.json and loadtest.png (default out/loadtest; checked "
                        "before any load runs; a server that stops answering mid-run leaves the levels before it there)")
    p.set_defaults(func=run)


def paired(mode: str, runs: dict[str, list[dict]], measure: str = "throughput") -> dict[str, list[float]]:
    """`mode`'s throughput (or `measure` "itl_p99": its p99 inter-token latency) over each other mode's, one ratio
    per pair of runs made one after the other (the r-th run of each): the machine's speed drifts by a third over
    minutes, and a pair shares its phase, where latencies pooled over runs mostly say which mode met the slow
    phases. A level reports their median and, from 6 runs, the median's 95% interval (`median_interval`)."""
    from specdec.serving.loadtest import percentile

    def value(run):
        if measure == "throughput":
            return sum(d["tokens"] for d in run["done"]) / run["seconds"]
        return percentile([g for d in run["done"] for g in d["gaps"]], 0.99) or float("nan")

    return {other: [value(a) / value(b) if value(b) else float("nan") for a, b in zip(runs[mode], theirs)]
            for other, theirs in runs.items() if other != mode}


def compared(ratios: dict[str, list[float]]) -> tuple[dict[str, float], dict[str, tuple[float, float]]]:
    """Paired ratios per other mode -> their medians, and the intervals of those medians (where there are any).
    The median of an even count is the geometric mean of the middle two, so a ratio read the other way round is
    its reciprocal (auto 1.05x never <-> never 0.95x auto)."""
    import math

    from specdec.serving.loadtest import median_interval

    def median(r):
        s = sorted(r)
        return s[len(s) // 2] if len(s) % 2 else math.sqrt(s[len(s) // 2 - 1] * s[len(s) // 2])

    intervals = {m: median_interval(r) for m, r in ratios.items()}
    return ({m: median(r) for m, r in ratios.items()},
            {m: i for m, i in intervals.items() if i is not None})


def requests_at(requests: int | None, concurrency: int, waves: int = WAVES) -> int:
    """Requests at a level: --requests, or `waves` times the concurrency and at least 4 x `waves` (4: 16 up to 4
    clients, 64 at 16; 2: 8 up to 4 clients, 32 at 16)."""
    return requests or waves * max(concurrency, 4)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, mode: str) -> tuple[subprocess.Popen, str]:
    """`specdec serve` for one mode on a free port; returns once /health answers."""
    import httpx

    from specdec.errors import SpecdecError

    port = free_port()
    cmd = [sys.executable, "-m", "specdec.cli", "serve", "--model", args.model, "--dtype", args.dtype,
           "--kv-dtype", args.kv_dtype, "--device", args.device, "--port", str(port), "--speculation", mode, "--budget", str(args.budget), "--max-batch", str(args.max_batch),
           "--method", args.method]
    proc = subprocess.Popen(cmd)
    url, end = f"http://127.0.0.1:{port}", time.time() + 900
    try:
        while time.time() < end:
            if proc.poll() is not None:
                raise SpecdecError(f"`{' '.join(cmd[2:])}` exited with status {proc.returncode}")
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    return proc, url
            except httpx.TransportError:
                time.sleep(0.5)
        raise SpecdecError(f"`{' '.join(cmd[2:])}` did not answer /health within 15 minutes")
    except BaseException:  # Ctrl-C while it loads, too: never leave a server running behind us
        stop_server(proc)
        raise


def stop_server(proc: subprocess.Popen) -> None:
    """SIGINT (the server's graceful stop), then a kill after 30 s."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run(args) -> int:
    import httpx

    from specdec.bench.prompts import load_prompts
    from specdec.bench.report import check_out
    from specdec.errors import SpecdecError
    from specdec.serving.loadtest import ServerGone, check_loopback, markdown, plot, pooled, run_level, unreachable

    if args.requests is not None and args.waves is not None:  # --requests sizes every level: --waves would be unread
        raise SpecdecError("--waves sizes a level only without --requests: give one of them")
    args.waves = WAVES if args.waves is None else args.waves
    if ((args.requests is not None and args.requests < 1) or args.waves < 1 or args.max_tokens < 1 or args.repeat < 1
            or not args.timeout > 0):
        raise SpecdecError("--requests, --waves, --max-tokens, --repeat and --timeout must be positive")
    if (args.url is None) == (args.serve is None):
        raise SpecdecError("give either --url (a running server) or --serve MODES (servers started here)")
    if args.url is not None:  # the servers' own flags mean nothing to a running server: refused, not ignored
        given = [flag for flag, dest, default in SERVE_FLAGS if getattr(args, dest) != default]
        if given:
            raise SpecdecError(f"{', '.join(given)} set{'s' * (len(given) == 1)} what --serve starts; a running "
                               "server (--url) keeps its own: drop it, or use --serve")
    url = check_loopback(args.url) if args.url is not None else None
    out = check_out(args.out, ("loadtest.md", "loadtest.json", "loadtest.png"))  # the str: Path("") would be "."
    prompts = [p.turns[0] for p in load_prompts(args.prompts)]
    if not prompts:
        raise SpecdecError(f"{args.prompts}: no prompts")
    servers: list[tuple[str, subprocess.Popen | None, str]] = []
    levels, gone = [], None
    try:
        if args.serve:
            args.model = args.model or "smollm2-135m"
            for mode in args.serve:  # one at a time: the first may measure the budget for the others
                proc, url = start_server(args, mode)
                servers.append((mode, proc, url))
        else:
            headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
            if args.model is None:
                try:
                    r = httpx.get(url + "/v1/models", headers=headers, timeout=10)
                except httpx.HTTPError as e:
                    raise unreachable(url, e) from None
                if r.status_code != 200:
                    said = " ".join(r.text.split())[:200]  # one line, whatever the page
                    raise SpecdecError(f"{url}/v1/models answered HTTP {r.status_code} ({said}): "
                                       + ("check --api-key" if r.status_code == 401 else "is it `specdec serve`?"))
                try:
                    args.model = r.json()["data"][0]["id"]
                    if not isinstance(args.model, str):
                        raise TypeError
                except (ValueError, LookupError, TypeError):
                    raise SpecdecError(f"{url}/v1/models lists no model: is it `specdec serve`? (or name one "
                                       "with --model)") from None
            servers.append(("-", None, url))
        for c in args.concurrency:
            runs: dict[str, list[dict]] = {mode: [] for mode, _, _ in servers}
            try:
                for r in range(args.repeat):  # modes interleaved at every level, none always first
                    for mode, _, url in servers[r % len(servers):] + servers[:r % len(servers)]:
                        lv = asyncio.run(run_level(url, args.model, prompts, c,
                                                   requests_at(args.requests, c, args.waves),
                                                   args.max_tokens, args.timeout, args.api_key))
                        runs[mode] += lv["raw"]
                        print(f"{mode} c={c}: {lv['throughput']:.2f} tokens/s, {lv['errors']} errors"
                              + (f" ({'; '.join(lv['error_samples'])})" if lv["errors"] else ""), file=sys.stderr)
                        if not lv["completed"]:  # a table of zeros is no measurement: say why, exit 2
                            said = (lv["error_samples"] or ["no answer"])[0].removeprefix("RuntimeError: ")
                            if said.startswith("HTTP 4"):
                                hint = ("--prompts and --max-tokens: the prompts must fit the model's context"
                                        if "context" in said else "--model and --api-key")
                                raise SpecdecError(f"the server refused every request at concurrency {c}: {said} "
                                                   f"(check {hint})")
                            hint = ("raise --timeout or lower --max-tokens" if "timeout" in said.lower()
                                    else "see the server's log")
                            raise SpecdecError(f"no request completed at concurrency {c}: {said} ({hint})")
            except (ServerGone, KeyboardInterrupt) as e:  # keep the levels measured before it, and say so
                gone = e
                break
            for mode, mine in runs.items():
                rates, rates_in = compared(paired(mode, runs))
                tails, tails_in = compared(paired(mode, runs, "itl_p99"))
                levels.append(dict(pooled(c, mine), mode=mode, paired=rates, paired_interval=rates_in,
                                   paired_itl_p99=tails, paired_itl_p99_interval=tails_in))
    finally:
        for _, proc, _ in servers:
            if proc is not None:
                stop_server(proc)
    if gone is not None and not levels:
        raise gone
    for lv in levels:
        del lv["raw"]
    per_level = (f"{args.requests} requests" if args.requests
                 else f"{args.waves} x concurrency requests (at least {4 * args.waves})")
    title = (f"Load test: {args.model}, {args.prompts}, {per_level} per level"
             + (f" x {args.repeat} runs (median)" if args.repeat > 1 else "") + f", max_tokens {args.max_tokens}"
             + (f", drafter {args.method}" if args.serve else ""))
    interrupted = isinstance(gone, KeyboardInterrupt)
    if gone is not None:
        title += (f" (stopped early: {'interrupted' if interrupted else 'the server stopped answering'} "
                  f"at concurrency {c})")
    text = markdown(levels, title)
    out.mkdir(parents=True, exist_ok=True)
    (out / "loadtest.md").write_text(text)
    (out / "loadtest.json").write_text(json.dumps(dict(model=args.model, prompts=args.prompts, levels=levels), indent=2))
    plot(levels, out / "loadtest.png", title)
    print(text)
    print(f"wrote {out / 'loadtest.md'}, {out / 'loadtest.json'} and {out / 'loadtest.png'}", file=sys.stderr)
    if interrupted:  # Ctrl-C, as the CLI answers it elsewhere: 130
        print(f"specdec loadtest: interrupted at concurrency {c}; the levels before it are in {out}", file=sys.stderr)
        return 130
    if gone is not None:
        print(f"specdec loadtest: error: {gone}; the levels before it are in {out}", file=sys.stderr)
        return 1
    return 0
