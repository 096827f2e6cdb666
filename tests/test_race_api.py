"""The race's HTTP API: every endpoint, good and bad parameters (a 4xx with an "error" line, never a 500),
and the live race on a tiny model (progress, token timings, cancel, one race at a time)."""

import threading
import time

import pytest
from fastapi.testclient import TestClient

from specdec import theory
from specdec.decode import Chunk
from specdec.errors import SpecdecError
from specdec.race.live import LiveRequest, Race
from specdec.race.server import create_app


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from tests.tiny import save_tiny

    return str(save_tiny("llama", tmp_path_factory.mktemp("race")))


@pytest.fixture(scope="module")
def client(folder):
    with TestClient(create_app(folder), raise_server_exceptions=False) as c:
        yield c


def wait(client, race_id, timeout=60.0):
    end = time.time() + timeout
    while time.time() < end:
        d = client.get(f"/api/live/{race_id}").json()
        if d["state"] in ("done", "error", "cancelled"):
            return d
        time.sleep(0.05)
    raise AssertionError(f"race {race_id} did not finish: {d}")


# --- page and config -----------------------------------------------------------------------------

def test_page_and_static_files(client):
    r = client.get("/")
    assert r.status_code == 200 and "The race" in r.text and "/static/app.js" in r.text
    for name in ("app.js", "style.css"):
        assert client.get(f"/static/{name}").status_code == 200
    r = client.get("/nope")
    assert r.status_code == 404 and r.json()["error"]


def test_config(client, folder, monkeypatch):
    import specdec.drafters

    monkeypatch.setattr(specdec.drafters, "METHODS", specdec.drafters.METHODS + ("future-method",))
    d = client.get("/api/config").json()
    assert d["model"] == folder
    assert [p["alpha"] for p in d["presets"]] == [0.82, 0.75, 0.60, 0.50, 0.15]
    assert d["lesson"] == {"budget": 156, "step_ms": 7.0} and d["limits"] == {"k_max": 10, "occupancy_max": 200}
    methods = {m["name"]: m for m in d["methods"]}
    assert "future-method" in methods  # read from specdec.drafters.METHODS at request time
    assert methods["prompt-lookup"]["available"]
    assert not methods["draft"]["available"] and "--draft" in methods["draft"]["note"]


def test_config_reads_the_measured_budget(folder, tmp_path, monkeypatch):
    from specdec.probe import ProbeResult, save

    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    save(ProbeResult(model="m1", dtype="float32", context=256, seconds={1: 0.0123, 2: 0.0125}, relative={1: 1.0, 2: 1.02},
                     budget=8, weight_bytes=1, bandwidth_gbs=1.0, bound_seconds=0.01, threads=2))
    from specdec.race.server import measured_defaults

    m = measured_defaults("m1", None)
    assert m["budget"] == 8 and m["step_ms"] == pytest.approx(12.3) and m["dtype"] == "float32"
    assert measured_defaults("m2", None) is None


# --- the simulation ---------------------------------------------------------------------------------

def test_sim(client):
    body = dict(alpha=0.82, k=4, tau=0.002, occupancy=0, budget=156, step_ms=7, seed=3, horizon_ms=3000)
    d = client.post("/api/sim", json=body).json()
    assert round(d["prediction"]["speedup"], 2) == 3.47
    assert d["prediction"]["distribution"] == pytest.approx(theory.tokens_per_round_distribution(0.82, 4))
    assert d["prediction"]["round_ms"] == pytest.approx(7.056) and d["prediction"]["headroom"] == 156
    v, s = d["vanilla"], d["spec"]
    assert v["end_ms"][0] == pytest.approx(7.0) and set(v["kind"]) == {"p"} and set(s["kind"]) <= {"r", "b"}
    assert v["end_ms"][-1] >= 3000 and s["end_ms"][-1] >= 3000 and d["until_ms"] >= 3000
    assert s["tokens"] == sum(s["accepted"]) + len(s["accepted"])
    assert d["summary"]["measured_speedup"] > 2.5
    assert client.post("/api/sim", json=body).json() == d  # seeded
    more = client.post("/api/sim", json=dict(body, segment=1, start_vanilla_ms=v["end_ms"][-1],
                                             start_spec_ms=s["end_ms"][-1])).json()
    assert more["vanilla"]["end_ms"][0] == pytest.approx(v["end_ms"][-1] + 7.0)
    assert more["spec"]["end_ms"][0] == pytest.approx(s["end_ms"][-1] + 7.056)


def test_sim_past_the_budget(client):
    d = client.post("/api/sim", json=dict(occupancy=200, k=4)).json()["prediction"]
    assert d["vanilla_ms"] == pytest.approx(7 * 201 / 156) and d["verify_stretch"] == pytest.approx(205 / 156)
    assert d["demand"] == 205 and d["headroom"] == -44 and d["speedup"] < d["speedup_free"]


@pytest.mark.parametrize("body, field", [
    (dict(alpha=1.5), "alpha"), (dict(alpha=-0.1), "alpha"), (dict(alpha="high"), "alpha"),
    (dict(k=11), "k"), (dict(k=-1), "k"), (dict(k=4.5), "k"), (dict(k="4"), "k"), (dict(k=True), "k"),
    (dict(tau=2), "tau"), (dict(occupancy=201), "occupancy"), (dict(budget=0), "budget"),
    (dict(step_ms=0), "step_ms"), (dict(step_ms=1e-6), "step_ms"), (dict(seed=-1), "seed"), (dict(seed=None), "seed"), (dict(horizon_ms=0), "horizon_ms"),
    (dict(max_rounds=10**6), "max_rounds"), (dict(speed=3), "speed"), (dict(segment=[1]), "segment"),
])
def test_sim_bad_parameters(client, body, field):
    r = client.post("/api/sim", json=body)
    assert r.status_code == 422
    assert field in r.json()["error"]


@pytest.mark.parametrize("raw", ['{"alpha": NaN}', '{"tau": Infinity}', "{not json", "[1, 2]", '"x"', ""])
def test_sim_malformed_bodies(client, raw):
    r = client.post("/api/sim", content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 422 and r.json()["error"]


# --- widgets ---------------------------------------------------------------------------------------

def test_surface(client):
    d = client.get("/api/surface", params=dict(tau=0.1, k_max=10, steps=10)).json()
    assert d["alphas"][7] == 0.7 and d["ks"] == list(range(11))
    assert d["speedup"][4][7] == pytest.approx(1.98, abs=0.005)  # Ch. 2: alpha 0.7, k 4, tau 0.1
    assert d["best_k"][7] == 4 and d["break_even"][0] == 0.0


def test_rounds(client):
    d = client.get("/api/rounds", params=dict(alpha=0.7, k=4)).json()
    assert d["probability"] == pytest.approx([0.3, 0.21, 0.147, 0.1029, 0.2401])
    assert d["expected"] == pytest.approx(2.7731, abs=1e-4) and d["full_burst"] == pytest.approx(0.2401)


def test_headroom_priority_example(client):
    # Ch. 7: "a server at B=120 has 36 units of headroom ... grants full k=4 speculation to the 7
    # highest-priority interactive sessions (35 units) and drops the remaining 3 interactive sessions
    # and any batch jobs to k=0"
    d = client.get("/api/headroom", params=dict(budget=156, occupancy=120, k=4, interactive=10, batch=2)).json()
    assert d["headroom"] == 36 and d["fit"] == 7 and d["used"] == 35
    granted = [(s["name"], s["granted"]) for s in d["allocation"]]
    assert granted[:7] == [(f"chat-{i}", 4) for i in range(1, 8)]
    assert all(g == 0 for _, g in granted[7:]) and len(granted) == 12
    assert d["curve"][10] == {"occupancy": 20, "headroom": 136, "fit": 27}  # "roughly 136 ÷ 5 ≈ 27"
    over = client.get("/api/headroom", params=dict(occupancy=200)).json()
    assert over["headroom"] == -44 and all(s["granted"] == 0 for s in over["allocation"])


@pytest.mark.parametrize("path, params, field", [
    ("/api/surface", dict(tau="abc"), "tau"), ("/api/surface", dict(tau=-1), "tau"), ("/api/surface", dict(tau="nan"), "tau"),
    ("/api/surface", dict(k_max=0), "k_max"), ("/api/surface", dict(steps=1000), "steps"),
    ("/api/rounds", dict(alpha=2), "alpha"), ("/api/rounds", dict(alpha="inf"), "alpha"), ("/api/rounds", dict(k=-1), "k"),
    ("/api/rounds", dict(k=1.5), "k"), ("/api/headroom", dict(budget=0), "budget"),
    ("/api/headroom", dict(occupancy=999), "occupancy"), ("/api/headroom", dict(interactive="many"), "interactive"),
])
def test_widget_bad_parameters(client, path, params, field):
    r = client.get(path, params=params)
    assert r.status_code == 422 and field in r.json()["error"]


# --- the live race ---------------------------------------------------------------------------------

def test_live_race_on_a_tiny_model(client):
    r = client.post("/api/live", json=dict(prompt="abcabcabcabc", method="prompt-lookup", k=3, max_new_tokens=24))
    assert r.status_code == 202, r.text
    d = wait(client, r.json()["id"])
    assert d["state"] == "done", d
    plain, spec = d["lanes"]["plain"], d["lanes"]["prompt-lookup"]
    for lane in (plain, spec):
        n = lane["result"]["new_tokens"]
        assert 1 <= n <= 24 and len(lane["t"]) == len(lane["kind"]) == len(lane["text"]) == n
        assert lane["t"] == sorted(lane["t"]) and lane["t"][0] > 0
        assert lane["t"][-1] <= lane["result"]["seconds"] + 0.5
        assert {"tokens_per_s", "mean_accepted", "acceptance_rate", "text"} <= set(lane["result"])
    assert set(plain["kind"]) == {"plain"}
    assert set(spec["kind"]) <= {"accepted", "recovered", "bonus", "plain"}
    assert "".join(plain["text"]) == plain["result"]["text"]
    assert spec["result"]["text"] == plain["result"]["text"]  # greedy: speculation changes nothing


@pytest.mark.parametrize("body, status, words", [
    (dict(prompt=""), 422, "prompt"), (dict(prompt="x", k="fast"), 422, "k"), (dict(prompt="x", k=-1), 422, "k"),
    (dict(prompt="x", max_new_tokens=0), 422, "max_new_tokens"), (dict(prompt="x", max_new_tokens="ten"), 422, "max_new_tokens"),
    (dict(prompt="x", temperature=-1), 422, "temperature"), (dict(prompt=3), 422, "prompt"), (dict(), 422, "prompt"),
    (dict(prompt="x", method="telepathy"), 400, "unknown method"), (dict(prompt="x", method="plain"), 400, "plain lane"), (dict(prompt="x", method="draft"), 400, "--draft"),
    (dict(prompt="x", model="no-such-model"), 400, "unknown model"), (dict(prompt="x", model="/no/such/dir"), 400, "no such"),
])
def test_live_bad_requests(client, body, status, words):
    r = client.post("/api/live", json=body)
    assert r.status_code == status, r.text
    assert words in r.json()["error"]


def test_live_unknown_race(client):
    for r in (client.get("/api/live/999"), client.post("/api/live/999/cancel"), client.get("/api/live/abc")):
        assert r.status_code in (404, 422) and r.json()["error"]


class SlowLLM:
    """Stands in for specdec.LLM: one token every 20 ms until cancelled."""

    class tokenizer:
        @staticmethod
        def decode(ids):
            return "".join(chr(97 + i % 26) for i in ids)

    def __init__(self):
        self.started = threading.Event()

    def drafter(self, method):
        return None

    def chunks(self, prompt, max_new_tokens, **kw):
        for i in range(max_new_tokens):
            self.started.set()
            time.sleep(0.02)
            yield Chunk("x", [i], 0, "plain")


def test_live_progress_busy_and_cancel(folder):
    app = create_app(folder)
    slow = SlowLLM()
    app.state.runner.llm = lambda name=None: slow
    with TestClient(app, raise_server_exceptions=False) as c:
        race = c.post("/api/live", json=dict(prompt="x", method="prompt-lookup", max_new_tokens=1000)).json()
        assert slow.started.wait(10)
        time.sleep(0.1)
        d = c.get(f"/api/live/{race['id']}").json()
        assert d["state"] == "running" and d["lane"] == "plain" and 0 < d["tokens"] < 1000 and d["max_new_tokens"] == 1000
        busy = c.post("/api/live", json=dict(prompt="y"))
        assert busy.status_code == 409 and "running" in busy.json()["error"]
        assert c.post(f"/api/live/{race['id']}/cancel").status_code == 200
        d = wait(c, race["id"], timeout=5)
        assert d["state"] == "cancelled" and "lanes" not in d
        assert c.post("/api/live", json=dict(prompt="z", max_new_tokens=2)).status_code == 202  # free again


def test_live_errors_during_the_run_are_reported(folder):
    app = create_app(folder)

    def broken(name=None):
        raise SpecdecError("model file is corrupt")

    app.state.runner.llm = broken
    with TestClient(app, raise_server_exceptions=False) as c:
        race = c.post("/api/live", json=dict(prompt="x")).json()
        d = wait(c, race["id"], timeout=5)
        assert d["state"] == "error" and d["error"] == "model file is corrupt"
        assert d["phase"] == "error"  # the page shows the phase: it kept "loading ..." (or "running plain")


def test_no_model_and_bad_model():
    with TestClient(create_app(None), raise_server_exceptions=False) as c:
        r = c.post("/api/live", json=dict(prompt="x"))
        assert r.status_code == 400 and "--model" in r.json()["error"]
        assert c.get("/api/config").json()["methods"] == []
        assert c.post("/api/sim", json={}).status_code == 200
    with pytest.raises(SpecdecError, match="unknown model"):
        create_app("no-such-model")


def test_cli(capsys, folder):
    from specdec.cli import main

    with pytest.raises(SystemExit) as e:
        main(["race", "--help"])
    assert e.value.code == 0
    help_text = capsys.readouterr().out
    for flag in ("--host", "--port", "--model", "--draft", "--datastore", "Chapter 8"):
        assert flag in help_text
    assert main(["race", "--model", "no-such-model", "--port", "0"]) == 2
    assert main(["race", "--model", folder, "--port", "70000"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("specdec race: error:") for line in err)


# --- start-up checks and model swaps (issue 15) ------------------------------------------------------

def test_a_failed_model_load_keeps_the_loaded_model(folder, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    app = create_app(folder, preload=False)
    runner = app.state.runner
    loaded = runner.llm()
    with TestClient(app, raise_server_exceptions=False) as c:
        r = c.post("/api/live", json=dict(prompt="abcabc", max_new_tokens=4, model=str(broken)))
        assert r.status_code == 202, r.text
        assert wait(c, r.json()["id"])["state"] == "error"
        assert runner._llm is loaded and runner.llm() is loaded  # still there, not reloaded
        r = c.post("/api/live", json=dict(prompt="abcabc", max_new_tokens=4))
        assert wait(c, r.json()["id"])["state"] == "done"


@pytest.mark.parametrize("kwargs, words", [
    (dict(draft="nosuch"), "draft model: unknown model 'nosuch'"),
    (dict(sources="prompt-lookup,nosuch"), "unknown hybrid source 'nosuch'"),
    (dict(exit_layer="x"), "exit layer"), (dict(exit_layer="4"), "1..3"), (dict(exit_layer=0), "exit layer"),
    (dict(datastore="/no/such/datastore"), "--datastore: /no/such/datastore is not a specdec datastore"),
])
def test_bad_settings_refused_at_start_up(folder, kwargs, words):
    with pytest.raises(SpecdecError, match=words):
        create_app(folder, preload=False, **kwargs)


@pytest.mark.parametrize("body, words", [
    ('{"prompt": "  \\n "}', "empty"), ('{"prompt": "a\\udcffb"}', "unicode"),  # JSON may escape a lone surrogate
])
def test_live_prompts_checked_like_generate(client, body, words):
    r = client.post("/api/live", content=body, headers={"content-type": "application/json"})
    assert r.status_code in (400, 422) and words in r.json()["error"], r.text


@pytest.mark.parametrize("argv, words", [
    (["--host", "256.1.1.1"], "256.1.1.1"), (["--draft", "nosuch"], "nosuch"),
    (["--sources", "prompt-lookup,nosuch"], "nosuch"), (["--exit-layer", "9"], "1..3"),
])
def test_cli_start_up_errors_exit_2(folder, capsys, argv, words):
    from specdec.cli import main

    assert main(["race", "--model", folder, "--port", "0"] + argv) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and "\n" not in err and err.startswith("specdec race: error:")


# --- QA session: measured defaults for --dtype auto, following a running race, cancel while loading -----

def test_measured_budget_for_auto_is_the_q4_probe_of_a_4bit_gguf(tmp_path, monkeypatch):
    """`specdec race` (dtype auto) on SmolLM2 runs q4, and `specdec probe` (auto) saves its curve under "q4";
    the page used to look for float32/bfloat16 only, so "measured" never appeared after a probe."""
    import specdec.runtime.loader as loader
    import specdec.store as store
    from specdec.probe import ProbeResult, save
    import specdec.race.server as race_server
    from specdec.race.server import measured_defaults
    from specdec.runtime.kernels import quant

    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    for dtype, step in (("q4", 0.005), ("float32", 0.02), ("bfloat16", 0.01)):
        save(ProbeResult(model="m4", dtype=dtype, context=256, seconds={1: step, 2: step * 1.02},
                         relative={1: 1.0, 2: 1.02}, budget=2, weight_bytes=1, bandwidth_gbs=1.0, bound_seconds=0.001,
                         threads=2))
    monkeypatch.setattr(store, "resolve", lambda name, pull=True: tmp_path)
    monkeypatch.setattr(loader, "gguf_is_q4", lambda folder: True)
    monkeypatch.setattr(quant, "isa", lambda: "vnni512")
    monkeypatch.setattr(race_server, "_AUTO", {})
    m = measured_defaults("m4", None)
    assert m["dtype"] == "q4" and m["step_ms"] == pytest.approx(5.0)
    assert measured_defaults("m4", "fp32")["dtype"] == "float32"  # an explicit --dtype reads its own
    monkeypatch.setattr(loader, "gguf_is_q4", lambda folder: False)  # bf16 or fp32, as this CPU loads it
    monkeypatch.setattr(race_server, "_AUTO", {})  # resolved once per model: forget m4's q4
    assert measured_defaults("m4", None)["dtype"] == str(loader.resolve_dtype(None, tmp_path)).replace("torch.", "")


def test_a_second_page_finds_and_follows_the_running_race(folder):
    """A reload or a second tab got only "race 1 is still running: wait for it or cancel it", with no way to
    see or cancel it: the 409 now names the race and GET /api/live returns the running one."""
    app = create_app(folder)
    slow = SlowLLM()
    app.state.runner.llm = lambda name=None: slow
    with TestClient(app, raise_server_exceptions=False) as c:
        assert c.get("/api/live").json() == {"race": None}
        race = c.post("/api/live", json=dict(prompt="x", max_new_tokens=1000)).json()
        assert slow.started.wait(10)
        current = c.get("/api/live").json()["race"]
        assert current["id"] == race["id"] and current["state"] == "running" and "lanes" not in current
        busy = c.post("/api/live", json=dict(prompt="y"))
        assert busy.status_code == 409 and busy.json()["race_id"] == race["id"]
        c.post(f"/api/live/{race['id']}/cancel")
        assert wait(c, race["id"], timeout=5)["state"] == "cancelled"
        assert c.get("/api/live").json() == {"race": None}


def test_cancel_while_the_model_loads_stops_before_any_lane(folder):
    """Cancel pressed during "loading" / "preparing early-exit" (minutes on a CPU) used to be ignored until
    then, and the plain lane started anyway before the flag was seen."""
    app = create_app(folder, preload=False)
    runner = app.state.runner
    release, loading = threading.Event(), threading.Event()
    slow = SlowLLM()

    def load(name=None):
        loading.set()
        release.wait(10)
        return slow

    runner.llm = load
    with TestClient(app, raise_server_exceptions=False) as c:
        race = c.post("/api/live", json=dict(prompt="x", max_new_tokens=5)).json()
        assert loading.wait(10)
        c.post(f"/api/live/{race['id']}/cancel")
        release.set()
        d = wait(c, race["id"], timeout=5)
        assert d["state"] == "cancelled" and not slow.started.is_set()



# --- QA session 9: the mutation audit's survivors, split characters, a frozen clock, IPv6 URLs ---------

def test_config_defaults_are_the_worked_example(client):
    d = client.get("/api/config").json()["defaults"]
    assert d == dict(alpha=0.82, k=4, tau=0.002, occupancy=0, budget=156, step_ms=7.0, seed=0)


@pytest.mark.parametrize("body", [dict(alpha=0), dict(k=0), dict(alpha=1, k=10, tau=1, occupancy=200)])
def test_sim_accepts_the_ends_of_every_range(client, body):
    assert client.post("/api/sim", json=body).status_code == 200


@pytest.mark.parametrize("body, field", [
    (dict(start_spec_ms=-1), "start_spec_ms"), (dict(start_vanilla_ms=-1), "start_vanilla_ms"),
    (dict(segment=-1), "segment"), (dict(max_rounds=0), "max_rounds"), (dict(horizon_ms=1e9), "horizon_ms"),
])
def test_sim_more_bad_parameters(client, body, field):
    r = client.post("/api/sim", json=body)
    assert r.status_code == 422 and field in r.json()["error"]


def test_sim_honours_seed_segment_and_max_rounds(client):
    spec = lambda **kw: client.post("/api/sim", json=dict(alpha=0.6, **kw)).json()["spec"]["accepted"]
    assert spec(seed=1) != spec(seed=2) and spec(segment=1) != spec(segment=2)
    d = client.post("/api/sim", json=dict(max_rounds=5)).json()
    assert len(d["vanilla"]["end_ms"]) == len(d["spec"]["end_ms"]) == 5


def test_sim_runs_from_the_earlier_lane_and_reports_the_shorter(client):
    # the spec lane is 100 ms ahead: both lanes run to 10 + 50 ms, the result reaches the vanilla lane's end
    d = client.post("/api/sim", json=dict(start_vanilla_ms=10, start_spec_ms=110, horizon_ms=50)).json()
    assert d["vanilla"]["end_ms"][-1] == pytest.approx(66.0) and d["spec"]["end_ms"] == []
    assert d["until_ms"] == pytest.approx(66.0)
    d = client.post("/api/sim", json=dict(start_vanilla_ms=0, start_spec_ms=3, horizon_ms=10)).json()
    assert d["vanilla"]["end_ms"] == [7.0, 14.0] and d["spec"]["end_ms"] == [10.056]
    assert d["until_ms"] == pytest.approx(10.056)  # the shorter lane: the page may play up to there


def test_sim_best_k_prices_the_stretch(client):
    # a CPU-sized budget of 8 with B = 4: each extra position costs 1/8 step, so k = 4, not the free curve's 10
    d = client.post("/api/sim", json=dict(alpha=0.82, tau=0.002, budget=8, occupancy=4)).json()["prediction"]
    assert d["best_k"] == theory.best_k(0.82, 0.002, 10, theory.roofline_cost(4, 8)) == 4


def test_widgets_shapes_and_limits(client):
    d = client.get("/api/surface", params=dict(tau=0.002, k_max=5, steps=4)).json()
    assert d["alphas"] == [0, 0.25, 0.5, 0.75, 1] and len(d["break_even"]) == 6 and max(d["best_k"]) == 5
    assert client.get("/api/rounds", params=dict(alpha=0.7, k=4)).json()["tokens"] == [1, 2, 3, 4, 5]
    h = client.get("/api/headroom", params=dict(occupancy=120, k=4, interactive=10, batch=2)).json()
    assert h["demand_if_all"] == 120 + 12 * 5 and h["curve"][-1]["occupancy"] == 200
    assert [s["interactive"] for s in h["allocation"]] == [True] * 10 + [False] * 2


@pytest.mark.parametrize("body, field", [
    (dict(prompt="x", k=True), "k"), (dict(prompt="x", k=65), "k"), (dict(prompt="x", max_new_tokens=1025), "max_new_tokens"),
    (dict(prompt="x", temperature=5.5), "temperature"), (dict(prompt="x", seed=-1), "seed"),
])
def test_live_bad_fields_are_422(client, body, field):
    r = client.post("/api/live", json=body)
    assert r.status_code == 422 and r.json()["error"].startswith(f"{field}: ") and "Value error" not in r.json()["error"]


def test_measured_defaults_dtype_names(tmp_path, monkeypatch):
    from specdec.probe import ProbeResult, save
    from specdec.race.server import measured_defaults

    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    for model, dtype in (("m5", "q8"), ("m5", "float32"), ("/x/M.GGUF", "q4")):
        save(ProbeResult(model=model, dtype=dtype, context=256, seconds={1: 0.012345, 2: 0.0125}, relative={1: 1.0, 2: 1.01},
                         budget=8, weight_bytes=1, bandwidth_gbs=1.0, bound_seconds=0.01, threads=2))
    m = measured_defaults("m5", "q8")
    assert m["dtype"] == "q8" and m["step_ms"] == 12.345
    assert measured_defaults("/x/M.GGUF", None)["dtype"] == "q4"  # a .GGUF is not converted to learn its dtype

    class Loaded:  # the live race's model is loaded as q4, of which there is no probe: no measured numbers
        def loaded_dtype_key(self):
            return "q4"

    assert measured_defaults("m5", None, Loaded()) is None


def test_token_kinds_never_exceed_the_committed_tokens():
    from specdec.race.live import token_kinds

    assert token_kinds(2, 3, "bonus") == ["accepted", "accepted"]  # a round cut short by EOS
    assert token_kinds(3, 2, "recovered") == ["accepted", "accepted", "recovered"]


def test_token_texts_give_a_split_character_to_the_token_that_completes_it():
    """Japanese or emoji output came back as ["\ufffd", "", "", ...]: once a character split over several
    tokens had decoded as U+FFFD, no later token's text started with it, so every later token got ""."""
    from specdec.race.live import token_texts

    class Bytes:  # one token per UTF-8 byte, decoded as a byte-level BPE tokenizer does
        @staticmethod
        def decode(ids):
            return bytes(ids).decode("utf-8", errors="replace")

    ids = list("日本 ok🎉!".encode())
    parts = token_texts(Bytes, ids)
    assert "".join(parts) == "日本 ok🎉!" and len(parts) == len(ids)
    assert parts[:3] == ["", "", "日"] and parts[-2:] == ["🎉", "!"]
    assert token_texts(Bytes, list("é".encode())[:1]) == ["\ufffd"]  # the text ends on a broken byte: kept


def test_the_runner_keeps_the_last_races_only(folder):
    app = create_app(folder, preload=False)
    runner = app.state.runner
    runner.keep, slow = 2, SlowLLM()
    runner.llm = lambda name=None: slow
    for _ in range(4):
        race = runner.start(LiveRequest(prompt="x", max_new_tokens=1))
        race.thread.join(10)
    assert sorted(runner.races) == [3, 4] and runner.races[4].state == "done"


def test_a_value_error_in_a_run_is_its_message(folder):
    app = create_app(folder, preload=False)

    def broken(name=None):
        raise ValueError("prompt is too long for this model")

    app.state.runner.llm = broken
    race = app.state.runner.start(LiveRequest(prompt="x"))
    race.thread.join(10)
    assert race.state == "error" and race.error == "prompt is too long for this model"


def test_cancel_while_loading_skips_preparing_the_method(folder):
    """Preparing early exit measures for minutes: a race cancelled while loading must not start it."""
    app = create_app(folder, preload=False)
    runner = app.state.runner
    prepared = []

    class Prepares(SlowLLM):
        def drafter(self, method):
            prepared.append(method)

    def load(name=None):
        race.cancel.set()  # pressed while the model loads
        return Prepares()

    runner.llm = load
    race = Race(99, LiveRequest(prompt="x"))
    runner._run(race)
    assert race.state == "cancelled" and prepared == []


def test_elapsed_stops_when_the_race_ends(folder):
    """elapsed_s of a finished race kept counting (a race done in 1.3 s said 54 s a minute later)."""
    app = create_app(folder, preload=False)
    runner = app.state.runner
    runner.llm = lambda name=None: SlowLLM()
    race = runner.start(LiveRequest(prompt="x", max_new_tokens=1))
    race.thread.join(10)
    first = race.to_dict()["elapsed_s"]
    time.sleep(0.05)
    assert race.state == "done" and race.to_dict()["elapsed_s"] == first


def test_plain_is_not_offered_as_a_live_method(client):
    plain = next(m for m in client.get("/api/config").json()["methods"] if m["name"] == "plain")
    assert not plain["available"] and "plain lane" in plain["note"]


def test_known_model_names_ignore_case():
    from specdec.race.live import check_model

    check_model("SmolLM2-135M")  # no error: a known model, pulled on first use


def test_cli_port_boundary(folder, capsys):
    from specdec.cli import main

    assert main(["race", "--model", folder, "--port", "65536"]) == 2
    assert "65536" in capsys.readouterr().err


@pytest.mark.parametrize("host, shown", [
    ("0.0.0.0", "http://127.0.0.1:8000/"), ("::", "http://127.0.0.1:8000/"), ("", "http://127.0.0.1:8000/"),
    ("localhost", "http://localhost:8000/"), ("::1", "http://[::1]:8000/"), ("fe80::1%lo", "http://[fe80::1%lo]:8000/"),
])
def test_the_printed_url(host, shown):
    """An IPv6 host was printed as http://::1:8000/, an address no browser opens."""
    from specdec.commands.race import url

    assert url(host, 8000) == shown
