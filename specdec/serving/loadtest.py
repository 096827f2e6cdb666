"""A bounded load generator for `specdec serve` (loopback only): per concurrency level, N streaming chat
requests with at most C in flight, each timed from the client's side.

    level = await run_level(url, model, prompts, concurrency=4, requests=16, max_tokens=64, timeout=300)
    level["throughput"], level["ttft_p50"], level["itl_p50"], level["itl_p99"], level["errors"]

Throughput is completion tokens (the server's `usage`) over the level's wall time (`pooled`: the median of
repeated runs; `specdec loadtest --repeat` also gives each mode's paired ratio to the others, runs made one
after the other compared, since the machine's speed drifts, for throughput and for p99 ITL, with the median's
95% interval from 6 runs: `median_interval`). Time to first token
(TTFT): request sent to the first non-empty text. Inter-token latency (ITL): the gaps between a
response's successive text chunks, all responses of the level pooled (a speculative round that commits
three tokens arrives as one chunk, so its gap is what a reader waits; vLLM's benchmark counts it so).
Time per output token (TPOT): per response, first to last text over its tokens after the first (vLLM's
TPOT), the median over responses: the pace a reader sees, where speculation's bursts count as the tokens
they bring (a stream whose chunks come every 6 ms with 1.6 tokens each: ITL 6 ms, TPOT 3.75 ms). A request that fails, or is still
running when the level's time is up, counts as an error. The server's /metrics, read before and after
each level, add its side: steps, drafted and accepted tokens (so alpha), steps past the budget line, and an
auto server's own measure of its arms at the level's batch size (`scheduler.ModePicker.estimates`).
"""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import time
from urllib.parse import urlparse

import httpx

from specdec.errors import SpecdecError
from specdec.serving.scheduler import ARMS, ModePicker  # auto's arms, counted as "arm_<name>" steps

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def check_loopback(url: str) -> str:
    """The base URL (no trailing slash), refusing any host but this machine's loopback. A trailing `/v1` (the
    OpenAI base URL a client is given) is dropped; any other path, a query or a bad port is refused.
    Example: "http://127.0.0.1:8000/v1/" -> "http://127.0.0.1:8000"."""
    usage = f"--url must be http://127.0.0.1:PORT or http://localhost:PORT (loopback only), got {url!r}"
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or parsed.hostname not in LOOPBACK:
        raise SpecdecError(usage)
    try:
        port = parsed.port
    except ValueError:
        port = 0
    if port == 0:
        raise SpecdecError(f"{usage}: the port must be an integer from 1 to 65535")
    path = parsed.path.rstrip("/")
    if path not in ("", "/v1") or parsed.query or parsed.fragment or parsed.params:
        raise SpecdecError(f"{usage}: give the server's address without a path (/v1 is added per request)")
    return parsed._replace(path="").geturl()


def unreachable(url: str, e: Exception) -> SpecdecError:
    """The one-line error for a server that does not answer (none started, a wrong port, or it died)."""
    return SpecdecError(f"no server answers at {url} ({type(e).__name__}: {str(e) or 'no response'}): start one with "
                        "`specdec serve --model NAME`, or check --url")


def percentile(xs: list[float], q: float) -> float | None:
    """The q-quantile (0..1) by nearest rank, the ceil(q n)-th smallest; None for no data. (round(q n + 0.5) rounds
    half to even: it took the next rank whenever q n was an odd integer, p50 of 2 the larger, p99 of 100 the largest.)"""
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(round(q * len(s), 9)) - 1))]  # round: 0.07 x 100 = 7.000000000000001


def median_interval(xs: list[float], confidence: float = 0.95) -> tuple[float, float] | None:
    """A distribution-free interval for the median of `xs` (paired ratios of runs): the l-th smallest and the l-th
    largest, l the largest rank whose interval covers the median with at least `confidence` (each run falls
    above or below it at even odds, so the count below is Binomial(n, 1/2)). None with too few runs (at 95%:
    fewer than 6; 6 runs give their smallest and largest, 97%). Example: 15 runs: the 4th smallest to the 4th
    largest (96.5%); 20 runs: the 6th to the 15th (95.9%)."""
    n, s, below, l = len(xs), sorted(xs), 0.0, 0
    while True:  # below: P(fewer than l + 1 runs under the median)
        below += math.comb(n, l) / 2 ** n
        if 1 - 2 * below < confidence or l + 1 > n - l:
            break
        l += 1
    return (s[l - 1], s[n - l]) if l else None


class ServerGone(SpecdecError):
    """The server does not answer at a level's start or stopped during it (the levels measured before it are
    still good)."""


async def one_request(client: httpx.AsyncClient, url: str, body: dict, headers: dict) -> dict:
    t0 = time.perf_counter()
    arrivals, usage = [], None
    async with client.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            d = json.loads(line[6:])
            if "error" in d:
                raise RuntimeError(d["error"]["message"])
            if d.get("usage"):
                usage = d["usage"]
            if d.get("choices") and d["choices"][0]["delta"].get("content"):
                arrivals.append(time.perf_counter())
    if usage is None:
        raise RuntimeError("the stream ended without usage")
    tokens = usage["completion_tokens"]
    return dict(tokens=tokens, ttft=arrivals[0] - t0 if arrivals else None,
                gaps=[b - a for a, b in zip(arrivals, arrivals[1:])], seconds=time.perf_counter() - t0,
                tpot=(arrivals[-1] - arrivals[0]) / (tokens - 1) if arrivals and tokens > 1 else None)


async def run_level(url: str, model: str, prompts: list[str], concurrency: int, requests: int,
                    max_tokens: int, timeout: float, api_key: str | None = None, extra: dict | None = None) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    gate = asyncio.Semaphore(concurrency)
    done: list[dict] = []
    errors: list[str] = []

    async def worker(i: int, client: httpx.AsyncClient):
        body = {"model": model, "messages": [{"role": "user", "content": prompts[i % len(prompts)]}],
                "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}, **(extra or {})}
        async with gate:
            try:
                done.append(await one_request(client, url, body, headers))
            except Exception as e:  # noqa: BLE001 - every failure is one error of the level
                errors.append(f"{type(e).__name__}: {e}")

    try:
        before, _ = await server_counters(url)
    except httpx.HTTPError as e:  # none there, or it died after the last level: the levels before it stand
        raise ServerGone(str(unreachable(url, e))) from None
    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout)) as client:
        tasks = [asyncio.create_task(worker(i, client)) for i in range(requests)]
        _, late = await asyncio.wait(tasks, timeout=timeout)
        for t in late:
            t.cancel()
        if late:
            await asyncio.wait(late)
            errors.extend(["timeout"] * len(late))
    wall = time.perf_counter() - t0
    try:
        after, ratios = await server_counters(url)
    except httpx.HTTPError as e:  # it died during the level: its requests are errors, its counters are gone
        raise ServerGone(f"the server at {url} stopped answering during the level at concurrency {concurrency} "
                         f"({len(done)} of {requests} requests completed; {type(e).__name__}: {str(e) or 'no response'})"
                         ) from None
    run = dict(requests=requests, done=done, errors=errors, seconds=wall,
               server={k: after[k] - before[k] for k in after}, ratios=ratios.get(ModePicker.span(concurrency), {}))
    return pooled(concurrency, [run])


def pooled(concurrency: int, runs: list[dict]) -> dict:
    """One row from one or more runs of a level (`--repeat`): throughput is the median run's (the machine's
    speed drifts between runs), latencies are percentiles over every run's requests pooled, counts are sums.
    Each run's throughput stays in `throughputs`; `raw` keeps what pooling needs. `ratios`: an auto server's
    own paired estimates at the level's batch size after its last run (`server_counters`)."""
    done = [d for r in runs for d in r["done"]]
    errors = [e for r in runs for e in r["errors"]]
    gaps = [g for d in done for g in d["gaps"]]
    ttfts = [d["ttft"] for d in done if d["ttft"] is not None]
    tpots = [d["tpot"] for d in done if d.get("tpot") is not None]
    rates = [sum(d["tokens"] for d in r["done"]) / r["seconds"] for r in runs]
    server = {k: sum(r["server"][k] for r in runs) for k in runs[0]["server"]}
    return dict(concurrency=concurrency, requests=sum(r["requests"] for r in runs), completed=len(done),
                errors=len(errors), error_samples=sorted(set(errors))[:3], seconds=sum(r["seconds"] for r in runs),
                tokens=sum(d["tokens"] for d in done), throughput=statistics.median(rates), throughputs=rates,
                ttft_p50=percentile(ttfts, 0.5), ttft_p99=percentile(ttfts, 0.99),
                itl_p50=percentile(gaps, 0.5), itl_p99=percentile(gaps, 0.99),
                itl_mean=statistics.fmean(gaps) if gaps else None, tpot_p50=percentile(tpots, 0.5),
                tpot_p99=percentile(tpots, 0.99), server=server,
                alpha=server["accepted"] / server["drafted"] if server["drafted"] else None,
                ratios=runs[-1].get("ratios", {}), raw=runs)


SERVER_COUNTERS = {"steps": "specdec_steps_total", "over_budget": "specdec_steps_over_budget_total",
                   "drafted": "specdec_drafted_tokens_total", "accepted": "specdec_accepted_tokens_total"}


async def server_counters(url: str) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """The server's own view (its /metrics), summed over labels: steps, steps past the budget, drafted and
    accepted tokens; and auto's steps per arm. A level's difference says whether and how much it speculated.
    Second: auto's measured arm ratios per batch bucket ({"3-4": {"model": 1.0, "never": 0.97}}; `ModePicker`)."""
    from prometheus_client.parser import text_string_to_metric_families

    async with httpx.AsyncClient(timeout=10) as client:
        r = await client.get(url + "/metrics")
    if r.status_code != 200:  # a server answered, but not as `specdec serve` does: not "no server answers"
        raise SpecdecError(f"the server at {url} answered HTTP {r.status_code} on /metrics, where the load test reads "
                           "its counters: is it `specdec serve`?")
    text = r.text
    totals = dict.fromkeys([*SERVER_COUNTERS, *(f"arm_{a}" for a in ARMS)], 0.0)
    ratios: dict[str, dict[str, float]] = {}
    names = {v: k for k, v in SERVER_COUNTERS.items()}
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError:
        raise SpecdecError(f"the server at {url} answered /metrics with no Prometheus text: is it `specdec serve`?"
                           ) from None
    for family in families:
        for sample in family.samples:
            if sample.name in names:
                totals[names[sample.name]] += sample.value
            elif sample.name == "specdec_auto_arm_steps_total":
                totals[f"arm_{sample.labels['arm']}"] += sample.value
            elif sample.name == "specdec_auto_arm_ratio":
                ratios.setdefault(sample.labels["batch"], {})[sample.labels["arm"]] = sample.value
    return totals, ratios


def ratio(r: float, mode: str, interval: tuple[float, float] | None = None) -> str:
    """A paired ratio for the table: "1.06× never (1.03–1.09)", in bold when its interval leaves out 1 (a
    difference this machine told apart)."""
    if interval is None:
        return f"{r:.2f}× {mode}"
    text = f"{r:.2f}× {mode} ({interval[0]:.2f}–{interval[1]:.2f})"
    return f"**{text}**" if interval[0] > 1 or interval[1] < 1 else text


def markdown(levels: list[dict], title: str) -> str:
    ms = lambda x: "–" if x is None else f"{1000 * x:.0f}"  # noqa: E731
    rows = [f"## {title}", "",
            "| mode | concurrency | completed | errors | tokens/s | TTFT p50 ms | ITL p50 ms | ITL p99 ms | TPOT p50 ms "
            "| × the other modes (paired; 95% interval, bold: 1 outside it) | ITL p99 × the others (paired) | drafted per step | α | steps past budget "
            "| auto's arms (model/never/always) | auto's own measure at this B |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---:|---:|---:|---|---|"]
    for lv in levels:
        sv, steps = lv["server"], max(lv["server"]["steps"], 1)
        alpha = "–" if lv["alpha"] is None else f"{lv['alpha']:.2f}"
        versus, tails = (", ".join(ratio(r, m, lv.get(f"{key}_interval", {}).get(m))
                                   for m, r in lv.get(key, {}).items()) or "–"
                         for key in ("paired", "paired_itl_p99"))
        arm_steps = [sv.get(f"arm_{a}", 0) for a in ARMS]
        arms = "/".join(f"{100 * n / sum(arm_steps):.0f}" for n in arm_steps) + "%" if sum(arm_steps) else "–"
        own = lv.get("ratios", {})
        runs_on = next((a for a, r in own.items() if r == 1.0), None)
        others = ", ".join(f"{a} {r:.2f}×" for a, r in own.items() if a != runs_on)
        measured = f"runs {runs_on}" + (f"; {others}" if others else "") if runs_on else "–"
        rows.append(f"| {lv.get('mode', '-')} | {lv['concurrency']} | {lv['completed']}/{lv['requests']} | "
                    f"{lv['errors']} | {lv['throughput']:.2f} | {ms(lv['ttft_p50'])} | {ms(lv['itl_p50'])} | "
                    f"{ms(lv['itl_p99'])} | {ms(lv.get('tpot_p50'))} | {versus} | {tails} | {sv['drafted'] / steps:.2f} | {alpha} | "
                    f"{sv['over_budget'] / steps:.0%} | {arms} | {measured} |")
    return "\n".join(rows) + "\n" + outside(levels)


def outside(levels: list[dict]) -> str:
    """How many of the table's paired intervals leave out 1, against what chance gives: with no difference anywhere,
    one 95% interval in 20 leaves out 1, so a lone bold cell in a large table is weak evidence. Each pair of modes
    counts once per level and measure (a × b and b × a are one comparison). Example: 30 comparisons, 2 outside ->
    "2 of 30 paired intervals leave out 1 (about 1.5 would by chance alone)." "" without intervals."""
    pairs = {(lv["concurrency"], key, frozenset((lv.get("mode"), m))): i
             for lv in levels for key in ("paired_interval", "paired_itl_p99_interval")
             for m, i in lv.get(key, {}).items() if i is not None}
    if not pairs:
        return ""
    out = sum(lo > 1 or hi < 1 for lo, hi in pairs.values())
    return f"\n{out} of {len(pairs)} paired intervals leave out 1 (about {len(pairs) / 20:.1f} would by chance alone).\n"


def plot(levels: list[dict], path, title: str) -> str:
    """Throughput and p99 inter-token latency against concurrency, one line per speculation mode; with an auto
    server beside others, a third panel: auto's paired ratios to each of them, with their 95% intervals."""
    from specdec.plots import _figure, _save

    autos = [lv for lv in levels if lv.get("mode") == "auto" and lv.get("paired")]
    fig = _figure(15 if autos else 10, 4.2)
    axes = fig.subplots(1, 3 if autos else 2)
    ax_t, ax_l = axes[:2]
    colour = {mode: f"C{i}" for i, mode in enumerate(dict.fromkeys(lv.get("mode", "-") for lv in levels))}
    for mode in colour:  # one colour a mode in every panel
        mine = [lv for lv in levels if lv.get("mode", "-") == mode]
        xs = [lv["concurrency"] for lv in mine]
        ax_t.plot(xs, [lv["throughput"] for lv in mine], marker="o", label=mode, color=colour[mode])
        ax_l.plot(xs, [1000 * (lv["itl_p99"] or float("nan")) for lv in mine], marker="o", label=mode,
                  color=colour[mode])
    ticks = sorted({lv["concurrency"] for lv in levels})
    panels = [(ax_t, "throughput (tokens/s)", "speculation"), (ax_l, "p99 inter-token latency (ms)", "speculation")]
    if autos:
        ax_r = axes[2]
        for i, other in enumerate(dict.fromkeys(m for lv in autos for m in lv["paired"])):
            for key, style, what in (("paired", "o-", "tokens/s"), ("paired_itl_p99", "s--", "p99 ITL")):
                mine = [lv for lv in autos if other in lv[key]]
                xs = [lv["concurrency"] * 1.06 ** (2 * i + (key != "paired")) for lv in mine]  # side by side
                ys = [lv[key][other] for lv in mine]
                span = [lv.get(f"{key}_interval", {}).get(other, (y, y)) for lv, y in zip(mine, ys)]
                ax_r.errorbar(xs, ys, yerr=[[y - lo for y, (lo, _) in zip(ys, span)],
                                            [hi - y for y, (_, hi) in zip(ys, span)]],
                              fmt=style, color=colour[other], capsize=3, label=f"{what} × {other}")
        ax_r.axhline(1.0, color="black", linewidth=0.8)
        panels.append((ax_r, "auto ÷ the other mode (paired, 95% interval)", None))
    for ax, what, legend in panels:
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("concurrent streaming clients")
        ax.set_ylabel(what)
        ax.grid(alpha=0.3)
        ax.legend(title=legend, fontsize=8)
    fig.suptitle(title, fontsize=10)
    return _save(fig, path)
