"""`specdec loadtest` as a client: its --url and --out checks, a server that is not there or dies mid-run."""

from __future__ import annotations

import json
import socket

import pytest

from specdec.errors import SpecdecError
from specdec.serving import loadtest as L


def test_check_loopback_takes_the_printed_base_url_and_refuses_the_rest():
    assert L.check_loopback("http://127.0.0.1:8000") == "http://127.0.0.1:8000"
    assert L.check_loopback("http://127.0.0.1:8000/") == "http://127.0.0.1:8000"
    assert L.check_loopback("http://localhost:8000/v1") == "http://localhost:8000"  # an OpenAI base URL
    assert L.check_loopback("http://127.0.0.1:8000/v1/") == "http://127.0.0.1:8000"
    for bad in ("http://10.0.0.1:8000", "127.0.0.1:8000", "ftp://127.0.0.1:1", "http://127.0.0.1:99999",
                "http://127.0.0.1:8000/v1/chat/completions", "http://127.0.0.1:8000/?x=1"):
        with pytest.raises(SpecdecError, match="loopback only"):
            L.check_loopback(bad)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_key_comes_from_the_environment_as_serve_takes_it(monkeypatch):
    """$SPECDEC_API_KEY keys the servers `--serve` starts (they read it): the load generator sends it too (every
    request of such a run was refused with 401)."""
    from specdec.cli import build_parser

    monkeypatch.setenv("SPECDEC_API_KEY", "s3cret")
    for argv in (["loadtest", "--serve", "auto"], ["serve"]):
        assert build_parser().parse_args(argv).api_key == "s3cret"
    assert build_parser().parse_args(["loadtest", "--serve", "auto", "--api-key", "k"]).api_key == "k"


def test_no_server_is_one_line(tmp_path, capsys):
    from specdec.cli import main

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    assert main(["loadtest", "--url", url, "--concurrency", "1", "--requests", "1", "--out", str(tmp_path / "a")]) == 2
    assert f"no server answers at {url}" in capsys.readouterr().err
    assert main(["loadtest", "--url", url, "--model", "m", "--concurrency", "1", "--requests", "1",
                 "--out", str(tmp_path / "b")]) == 2  # the model named: the first level finds no server
    assert f"no server answers at {url}" in capsys.readouterr().err


def test_a_bad_out_is_refused_before_any_load(tmp_path, capsys, monkeypatch):
    from specdec.cli import main

    afile = tmp_path / "afile"
    afile.write_text("x")

    def no_load(*a, **kw):
        raise AssertionError("a level ran")

    monkeypatch.setattr(L, "run_level", no_load)
    assert main(["loadtest", "--url", "http://127.0.0.1:9", "--model", "m", "--out", str(afile)]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err and afile.read_text() == "x"


@pytest.mark.parametrize("stop", ["server gone", "ctrl-c"])
def test_a_server_that_dies_or_a_ctrl_c_mid_run_keeps_the_levels_before(tmp_path, capsys, monkeypatch, stop):
    """Ctrl-C during a level used to throw away the levels already measured (exit 130, no files)."""
    from specdec.cli import main

    async def level(url, model, prompts, c, requests, *a, **kw):
        if c == 2 and stop == "ctrl-c":
            raise KeyboardInterrupt
        if c == 2:
            raise L.ServerGone(f"the server at {url} stopped answering during the level at concurrency 2")
        run = dict(requests=requests, done=[dict(tokens=8, ttft=0.01, gaps=[0.005] * 7, seconds=0.05)] * requests,
                   errors=[], seconds=0.1 * requests, server=dict.fromkeys(
                       [*L.SERVER_COUNTERS, *(f"arm_{a}" for a in L.ARMS)], 1.0), ratios={})
        return L.pooled(c, [run])

    monkeypatch.setattr(L, "run_level", level)
    out = tmp_path / "lt"
    assert main(["loadtest", "--url", "http://127.0.0.1:9", "--model", "m", "--concurrency", "1,2,4",
                 "--requests", "2", "--out", str(out)]) == (130 if stop == "ctrl-c" else 1)
    err = capsys.readouterr().err
    said = ("interrupted at concurrency 2" if stop == "ctrl-c"
            else "stopped answering during the level at concurrency 2")
    assert said in err and "Traceback" not in err
    levels = json.loads((out / "loadtest.json").read_text())["levels"]
    assert [lv["concurrency"] for lv in levels] == [1] and levels[0]["throughput"] == pytest.approx(80.0)
    md = (out / "loadtest.md").read_text()
    assert "stopped early: " + ("interrupted" if stop == "ctrl-c" else "the server stopped answering") in md


def test_every_request_refused_stops_with_the_servers_reason(tmp_path, capsys, monkeypatch):
    """A wrong --model or --api-key: every request of the first level gets a 4xx; loadtest stops there with the
    server's own message (before: a table of zeros for every level, exit status 0, the reason only in the JSON)."""
    from specdec.cli import main

    said = []

    async def level(url, model, prompts, c, requests, *a, **kw):
        errors = [said[-1]] * requests
        run = dict(requests=requests, done=[], errors=errors, seconds=0.1, ratios={},
                   server=dict.fromkeys([*L.SERVER_COUNTERS, *(f"arm_{a}" for a in L.ARMS)], 0.0))
        return L.pooled(c, [run])

    monkeypatch.setattr(L, "run_level", level)
    said.append('RuntimeError: HTTP 404: {"error": {"message": "model nosuch not found"}}')
    assert main(["loadtest", "--url", "http://127.0.0.1:9", "--model", "nosuch", "--concurrency", "1,2",
                 "--requests", "2", "--out", str(tmp_path / "lt")]) == 2
    err = capsys.readouterr().err
    assert "refused every request at concurrency 1: HTTP 404" in err and "not found" in err
    assert err.rstrip().endswith("(check --model and --api-key)")
    said.append('RuntimeError: HTTP 400: {"error": {"message": "the prompt (371 tokens) and max_tokens (12) exceed '
                "the model's context of 256 tokens\"}}")
    assert main(["loadtest", "--url", "http://127.0.0.1:9", "--model", "m", "--concurrency", "1", "--requests", "2",
                 "--out", str(tmp_path / "lt2")]) == 2  # the prompts do not fit: --model and --api-key are not why
    assert capsys.readouterr().err.rstrip().endswith("(check --prompts and --max-tokens: the prompts must fit the "
                                                     "model's context)")
    for error, hint in (("timeout", "raise --timeout or lower --max-tokens"),
                        ('RuntimeError: HTTP 500: {"error": {"message": "boom"}}', "see the server's log")):
        said.append(error)  # not refused, none completed either: still no measurement, still exit 2
        assert main(["loadtest", "--url", "http://127.0.0.1:9", "--model", "m", "--concurrency", "1", "--requests",
                     "2", "--timeout", "0.001", "--out", str(tmp_path / "lt3")]) == 2
        err = capsys.readouterr().err.rstrip()
        assert "no request completed at concurrency 1" in err and err.endswith(f"({hint})")


def test_one_request_times_chunk_gaps_and_the_time_per_output_token():
    """A stream of chunks "a", "bc", "d" 30 ms apart carrying 4 tokens: ITL gaps of ~30 ms each (one per chunk, as a
    reader waits them) and TPOT ~60 / 3 = 20 ms (first to last text over the tokens after the first)."""
    import asyncio

    import httpx

    async def sse():
        for i, text in enumerate(["a", "bc", "d"]):
            if i:
                await asyncio.sleep(0.03)
            yield f'data: {json.dumps({"choices": [{"delta": {"content": text}}]})}\n\n'.encode()
        yield f'data: {json.dumps({"choices": [], "usage": {"completion_tokens": 4}})}\n\ndata: [DONE]\n\n'.encode()

    async def go():
        transport = httpx.MockTransport(lambda request: httpx.Response(200, content=sse()))
        async with httpx.AsyncClient(transport=transport) as client:
            return await L.one_request(client, "http://127.0.0.1:1", {}, {})

    d = asyncio.run(go())
    assert d["tokens"] == 4 and len(d["gaps"]) == 2 and all(0.025 < g < 0.2 for g in d["gaps"])
    assert d["tpot"] == pytest.approx(sum(d["gaps"]) / 3)
    level = L.pooled(1, [dict(requests=1, done=[d], errors=[], seconds=1.0, ratios={},
                              server=dict.fromkeys([*L.SERVER_COUNTERS, *(f"arm_{a}" for a in L.ARMS)], 0.0))])
    assert level["tpot_p50"] == d["tpot"] and "TPOT p50 ms" in L.markdown([level], "t")


@pytest.mark.parametrize("argv, said", [(["--max-batch", "4"], "--max-batch sets"),
                                        (["--method", "recycling", "--dtype", "q4"], "--dtype, --method set"),
                                        (["--device", "cuda"], "--device sets")])
def test_serve_flags_with_url_are_refused_not_ignored(tmp_path, capsys, argv, said):
    from specdec.cli import main

    assert main(["loadtest", "--url", "http://127.0.0.1:9", *argv, "--out", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err.strip()
    assert said in err and "a running server (--url) keeps its own" in err and "\n" not in err


# --- mutation audit: the level's figures pinned with hand-worked numbers -----------------------------------
def test_percentile_is_the_nearest_rank():
    """The q-quantile is the ceil(q n)-th smallest (round(x + 0.5) rounded half to even: p50 of 2 gave the larger,
    p99 of 100 the largest)."""
    assert L.percentile([], 0.5) is None and L.percentile([7.0], 0.99) == 7.0
    assert L.percentile([2.0, 1.0], 0.5) == 1.0
    assert L.percentile(list(range(1, 7)), 0.5) == 3
    assert L.percentile(list(range(1, 101)), 0.5) == 50 and L.percentile(list(range(1, 101)), 0.99) == 99
    assert L.percentile(list(range(1, 101)), 0.9) == 90 and L.percentile(list(range(1, 11)), 0.99) == 10
    assert L.percentile(list(range(1, 201)), 0.99) == 198 and L.percentile(list(range(1, 101)), 0.07) == 7


def test_pooled_by_hand():
    """Three runs: throughput the median run's, latencies over all requests pooled (ITL on chunk gaps, TTFT on
    first chunks), server counters summed, alpha = accepted / drafted."""
    server = dict.fromkeys([*L.SERVER_COUNTERS, *(f"arm_{a}" for a in L.ARMS)], 0.0)
    gaps = [i / 1000 for i in range(1, 101)] + [1.0]  # 101 gaps: p50 the 51st, p99 the 100th
    runs = [dict(requests=1, done=[dict(tokens=tokens, ttft=ttft, gaps=g, seconds=s)], errors=[], seconds=s, ratios={},
                 server=dict(server, steps=1.0, drafted=4.0, accepted=3.0))
            for tokens, s, ttft, g in [(10, 1.0, 0.3, gaps[:50]), (40, 2.0, 0.1, gaps[50:]), (60, 1.0, 0.2, [])]]
    lv = L.pooled(2, runs)
    assert lv["throughput"] == 20.0 and lv["throughputs"] == [10.0, 20.0, 60.0]  # not 30 (mean) or 27.5 (pooled)
    assert (lv["ttft_p50"], lv["ttft_p99"]) == (0.2, 0.3)
    assert (lv["itl_p50"], lv["itl_p99"]) == (0.051, 0.1)
    assert lv["itl_mean"] == pytest.approx(6.05 / 101)
    assert lv["server"]["steps"] == 3.0 and lv["alpha"] == 0.75 and lv["tokens"] == 110 and lv["completed"] == 3


def test_run_level_against_a_stand_in_server(monkeypatch):
    """TTFT to the first text (a role-only chunk is no text), one ITL gap per text chunk, a request still running
    at the level's timeout is an error, and the server's counters are the level's difference."""
    import asyncio

    import httpx

    metrics = iter([10.0, 15.0])

    async def sse():
        yield f'data: {json.dumps({"choices": [{"delta": {"role": "assistant"}}]})}\n\n'.encode()
        for pause, text in [(0.05, "a"), (0.3, "bc")]:
            await asyncio.sleep(pause)
            yield f'data: {json.dumps({"choices": [{"delta": {"content": text}}]})}\n\n'.encode()
        yield f'data: {json.dumps({"choices": [], "usage": {"completion_tokens": 3}})}\n\ndata: [DONE]\n\n'.encode()

    async def handler(request):
        if request.url.path == "/metrics":
            return httpx.Response(200, text=f"specdec_steps_total {next(metrics)}\n")
        if json.loads(request.content)["messages"][0]["content"] == "stuck":
            await asyncio.sleep(30)
        return httpx.Response(200, content=sse())

    real = httpx.AsyncClient
    monkeypatch.setattr(L.httpx, "AsyncClient", lambda **kw: real(transport=httpx.MockTransport(handler), **kw))
    lv = asyncio.run(L.run_level("http://127.0.0.1:1", "m", ["go", "stuck"], 2, 2, 8, timeout=1.0))
    assert (lv["completed"], lv["errors"], lv["error_samples"]) == (1, 1, ["timeout"])
    d = lv["raw"][0]["done"][0]
    assert 0.04 < d["ttft"] < 0.3 and len(d["gaps"]) == 1 and 0.25 < d["gaps"][0] < 0.9
    assert d["tpot"] == pytest.approx(d["gaps"][0] / 2) and lv["server"]["steps"] == 5.0


@pytest.mark.parametrize("argv, said", [(["--requests", "8", "--waves", "2"], "--waves sizes a level only without"),
                                        (["--requests", "8", "--waves", "4"], "--waves sizes a level only without"),
                                        (["--out", ""], "--out is empty")])
def test_an_unread_waves_or_an_empty_out_is_refused(tmp_path, capsys, monkeypatch, argv, said):
    """--waves beside --requests was ignored (--requests sizes every level), and `--out ''` wrote into the current
    folder: both refused before any load."""
    from specdec.cli import main

    monkeypatch.chdir(tmp_path)
    def no_load(*a, **kw):
        raise AssertionError("a level ran")

    monkeypatch.setattr(L, "run_level", no_load)
    args = ["loadtest", "--url", "http://127.0.0.1:9", "--model", "m", *argv]
    assert main(args + ([] if "--out" in argv else ["--out", str(tmp_path / "a")])) == 2
    assert said in capsys.readouterr().err and not list(tmp_path.iterdir())


def test_serve_refuses_a_mode_named_twice(capsys, monkeypatch):
    """`--serve auto,auto` started two servers of one mode and compared the mode with itself."""
    from specdec.cli import main
    from specdec.commands import loadtest as C

    monkeypatch.setattr(C, "start_server", lambda *a, **kw: pytest.fail("a server started"))
    with pytest.raises(SystemExit) as e:
        main(["loadtest", "--serve", "auto,never,auto"])
    assert e.value.code == 2 and "names a mode twice" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # a level named twice: measured twice, reported as two rows
        main(["loadtest", "--serve", "auto", "--concurrency", "1,2,1"])
    assert e.value.code == 2 and "names a level twice" in capsys.readouterr().err


def test_a_server_that_is_not_specdec_is_one_line(tmp_path, capsys):
    """`--url` at another HTTP server (a static one, another engine without /metrics): a 404 on /metrics read as
    "no server answers" over two lines, an empty or non-JSON model list gave an IndexError traceback or a bare
    JSON error, and an HTML error page was pasted into the message over ten lines."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from specdec.cli import main

    pages = {}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            status, body = pages.get(self.path, (404, "<html>\n<body>\n<h1>Not found</h1>\n</body>\n</html>\n"))
            self.send_response(status)
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, *a):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    cases = [('{"data": [{"id": "x"}]}', "answered HTTP 404 on /metrics, where the load test reads its counters"),
             ('{"data": []}', "/v1/models lists no model"), ("oops", "/v1/models lists no model"),
             ('{"data": [{"id": 5}]}', "/v1/models lists no model"), (None, "/v1/models answered HTTP 404 (<html>")]
    try:
        for i, (models, said) in enumerate(cases):
            pages.clear()
            if models is not None:
                pages["/v1/models"] = (200, models)
            assert main(["loadtest", "--url", url, "--concurrency", "1", "--requests", "1", "--max-tokens", "2",
                         "--out", str(tmp_path / str(i))]) == 2
            err = capsys.readouterr().err
            assert said in err and "is it `specdec serve`?" in err and "no server answers" not in err, err
            assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
        pages.update({"/v1/models": (200, '{"data": [{"id": "x"}]}'), "/metrics": (200, "<html>hi</html>")})
        assert main(["loadtest", "--url", url, "--concurrency", "1", "--requests", "1", "--out",
                     str(tmp_path / "m")]) == 2
        err = capsys.readouterr().err
        assert "answered /metrics with no Prometheus text" in err and len(err.strip().splitlines()) == 1
    finally:
        server.shutdown()


def test_the_ratio_panel_draws_each_mode_in_its_own_colour(tmp_path, monkeypatch):
    """The third panel drew "x always" in the colour panels one and two give never, "x never" in another."""
    import matplotlib.colors as mc

    levels = [dict(concurrency=c, mode=m, throughput=10.0, itl_p99=0.01,
                   paired={o: 1.0 for o in ("always", "never")} if m == "auto" else {},
                   paired_interval={o: (0.9, 1.1) for o in ("always", "never")} if m == "auto" else {},
                   paired_itl_p99={o: 1.0 for o in ("always", "never")} if m == "auto" else {},
                   paired_itl_p99_interval={})
              for c in (1, 2) for m in ("auto", "always", "never")]
    import matplotlib.figure

    drawn = {}
    real = matplotlib.figure.Figure.savefig

    def grab(fig, *a, **kw):
        t, _, r = fig.axes[:3]
        for line in t.get_lines():
            drawn[line.get_label()] = mc.to_hex(line.get_color())
        for container in r.containers:
            label = container.get_label()
            drawn[label] = mc.to_hex(container.lines[0].get_color())
        return real(fig, *a, **kw)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", grab)
    L.plot(levels, tmp_path / "p.png", "t")
    for other in ("always", "never"):
        assert drawn[f"tokens/s × {other}"] == drawn[other] == drawn[f"p99 ITL × {other}"], drawn
    assert drawn["always"] != drawn["never"]
