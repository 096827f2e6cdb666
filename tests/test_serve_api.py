"""`specdec serve` over HTTP: the official openai client against a live server on a random port (chat and
completions, streaming and not), concurrent streaming clients whose outputs equal their single-request
greedy outputs, SSE framing, bad requests -> 400 with an OpenAI-style error, the API key, a vanishing
client frees its slot, /metrics names, and Ctrl-C exits cleanly."""

import json
import queue
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
import uvicorn

from specdec.decode import Request, decode
from specdec.drafters.prompt_lookup import PromptLookup
from specdec.runtime.loader import load_transformer
from specdec.serving.app import create_app
from specdec.serving.engine import Engine
from specdec.tokenizer import Tokenizer
from tests.tiny import save_tiny

PROMPTS = ["abcabcabcabc abc", "hello hello hello", "x", "the cat sat on the mat; the cat sat", "0123456789" * 5,
           "aaaa", "xyz xyz", "Speculate, then verify."]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = save_tiny("llama", tmp_path_factory.mktemp("serve"))
    return str(folder), load_transformer(folder, torch.float32), Tokenizer(folder)


class Live:
    """A uvicorn server in a thread, on a free port of 127.0.0.1."""

    def __init__(self, app):
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    def close(self):
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture(scope="module")
def live(tiny):
    folder, model, tok = tiny
    engine = Engine(model, tok, budget=6, max_batch=4, prefill_chunk=16)
    server = Live(create_app(engine, folder))
    server.engine = engine
    yield server
    server.close()


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0)


def greedy(tiny, ids, max_new):
    _, model, tok = tiny
    return list(decode(model, tok, ids, Request(max_new_tokens=max_new), PromptLookup()))[-1].result


def test_completions_streaming_and_not(tiny, client):
    folder, _, tok = tiny
    ref = greedy(tiny, tok.encode(PROMPTS[0], chat=False), 24)
    r = client.completions.create(model=folder, prompt=PROMPTS[0], max_tokens=24, temperature=0)
    assert r.choices[0].text == ref.text and r.choices[0].finish_reason == ref.finish_reason
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (ref.prompt_tokens, ref.new_tokens)
    parts = list(client.completions.create(model=folder, prompt=PROMPTS[0], max_tokens=24, temperature=0,
                                           stream=True, stream_options={"include_usage": True}))
    assert "".join(p.choices[0].text for p in parts if p.choices) == ref.text
    assert parts[-1].usage.completion_tokens == ref.new_tokens
    r = client.completions.create(model=folder, prompt=PROMPTS[1], max_tokens=5, temperature=0,
                                  extra_body={"speculation": {"method": "prompt-lookup", "k": 3}, "priority": "batch"})
    assert r.choices[0].text == greedy(tiny, tok.encode(PROMPTS[1], chat=False), 5).text


def test_chat_streaming_and_not(tiny, client):
    folder, _, tok = tiny
    ref = greedy(tiny, tok.encode(PROMPTS[3], chat=True), 20)
    messages = [{"role": "user", "content": PROMPTS[3]}]
    r = client.chat.completions.create(model=folder, messages=messages, max_tokens=20, temperature=0)
    assert r.choices[0].message.content == ref.text and r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == ref.new_tokens and r.usage.prompt_tokens == ref.prompt_tokens
    parts = list(client.chat.completions.create(model=folder, messages=messages, max_tokens=20, temperature=0,
                                                stream=True))
    assert parts[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in parts) == ref.text
    assert parts[-1].choices[0].finish_reason == ref.finish_reason
    assert [m.id for m in client.models.list().data] == [folder]


def test_concurrent_streaming_clients_equal_their_greedy_outputs(tiny, client, live):
    folder, _, tok = tiny
    refs = [greedy(tiny, tok.encode(p, chat=False), 40).text for p in PROMPTS]

    def one(i):
        s = client.completions.create(model=folder, prompt=PROMPTS[i % len(PROMPTS)], max_tokens=40,
                                      temperature=0, stream=True)
        return "".join(p.choices[0].text for p in s)

    with ThreadPoolExecutor(16) as pool:
        outs = list(pool.map(one, range(16)))
    assert outs == [refs[i % len(PROMPTS)] for i in range(16)]
    assert httpx.get(live.url + "/health").json() == {"status": "ok", "running": 0, "waiting": 0}


def test_sse_framing(tiny, live):
    folder, _, _ = tiny
    body = {"model": folder, "prompt": "abc", "max_tokens": 6, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", live.url + "/v1/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    frames = raw.split("\n\n")
    assert frames[-1] == "" and frames[-2] == "data: [DONE]"
    events = [json.loads(f.removeprefix("data: ")) for f in frames[:-2]]
    assert all(f.startswith("data: ") for f in frames[:-1])
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] <= 6
    assert events[-2]["choices"][0]["finish_reason"] in ("stop", "length")
    assert all(e["object"] == "text_completion" and e["id"] == events[0]["id"] for e in events)


@pytest.mark.parametrize("change, words", [
    ({"max_tokens": 1000}, "context"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"logit_bias": {"5": 1}}, "field 'logit_bias' is not supported"),
    ({"store": True}, "field 'store' is not supported"),  # false (and metadata null) ask for nothing
    ({"frobnicate": 1}, "unknown field 'frobnicate'"),
    ({"frobnicate": None}, "unknown field 'frobnicate'"),  # null takes the default of our fields only
    ({"speculation": {"method": "plain", "x": 1}}, "unknown field 'speculation.x'"),
    ({"speculation": {"k": "4"}}, "speculation.k: Input should be a valid integer"),  # not "speculation.bool"
    ({"speculation": {"k": -1}}, "speculation.k: Input should be greater than or equal to 0"),
    ({"speculation": {"k": 1001}}, "speculation.k: Input should be less than or equal to 1000"),
    ({"prompt": ["a", "b"]}, "prompt is a string or a list of token ids"),
    ({"n": 2}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"speculation": {"method": "draft"}}, "method"),
    ({"speculation": {"method": ""}}, "method"),  # not the server's method by default: it was served as that
    ({"speculation": {"method": "plain", "k": 4}}, "drafts nothing"),  # k would be ignored without a word
    ({"speculation": {"method": "eagle"}}, "no EAGLE head"),  # the tiny model has none: a 400, not an error event
    ({"priority": "vip"}, "priority"),
    ({"prompt": [999999]}, "token ids"),
    ({"prompt": [96]}, "token ids"),  # the tiny vocabulary's size: the first id outside it
    ({"temperature": 2.5}, "temperature"),
    ({"min_p": 1.5}, "min_p"),
    ({"prompt": "a\ud800b"}, "not valid Unicode"),  # a lone surrogate (JSON allows the escape)
    ({"stop": "\udfff"}, "not valid Unicode"),
    ({"prompt": "ab" * 10**6}, "more than the model's context"),  # refused before tokenizing
    ({"stream_options": {"include_usage": True}}, "only allowed when stream is true"),
    ({"logprobs": 2}, "leave it out or send null or false"),  # an unsupported field at its neutral value only
    ({"presence_penalty": 0.5}, "field 'presence_penalty' is not supported"),
    ({"seed": -1}, "seed"),
    ({"prompt": None}, "prompt"),  # a required field sent as null: refused as the wrong type, not "missing"
    ({"seed": 2**64}, "seed"),
])
def test_bad_requests_get_400(tiny, live, change, words):
    folder, _, _ = tiny
    body = {"model": folder, "prompt": "abc", "max_tokens": 4, **change}
    r = httpx.post(live.url + "/v1/completions", content=json.dumps(body),  # ASCII: lone surrogates as escapes
                   headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert words in err["message"] and err["type"] == "invalid_request_error"
    assert err["param"], "a refusal names the field it is about"


def test_a_prompt_too_long_for_the_default_answer_blames_the_prompt(tiny, live, monkeypatch):
    """No max_tokens sent: the refusal names the prompt or messages (it named a max_tokens the client never sent).
    Messages too many or too long in all for the context are refused before the chat template renders them (600,000
    messages of "hi" took 17 s of templating and tokenizing, and their validation stalled every stream)."""
    from specdec.serving.app import MAX_MESSAGES

    folder = tiny[0]  # context 256 tokens; no token spells more than 5 characters
    for path, body, param in [("/v1/completions", {"prompt": "ab " * 250}, "prompt"),
                              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "ab " * 250}]},
                               "messages")]:
        err = httpx.post(live.url + path, json={"model": folder, **body}).json()["error"]
        assert (err["code"], err["param"]) == ("context_length_exceeded", param), err
        assert f"shorten {param}" in err["message"] and "max_tokens" not in err["message"]
        if param == "messages":  # a chat's default answer shrinks to what fits: it said "for the 1 an answer gets"
            assert "tokens for an answer: shorten messages" in err["message"], err
    monkeypatch.setattr(tiny[2].hf, "apply_chat_template", lambda *a, **k: pytest.fail("templated"))
    for messages in ([{"role": "user", "content": "a"}] * 257, [{"role": "user", "content": "abc" * 200}] * 3):
        r = httpx.post(live.url + "/v1/chat/completions", json={"model": folder, "messages": messages})
        err = r.json()["error"]
        assert r.status_code == 400 and (err["code"], err["param"]) == ("context_length_exceeded", "messages"), err
    r = httpx.post(live.url + "/v1/chat/completions",
                   json={"model": folder, "messages": [{"role": "user", "content": "a"}] * (MAX_MESSAGES + 1)})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_openai_error_codes_and_neutral_fields(tiny, client, live):
    folder = tiny[0]
    r = httpx.post(live.url + "/v1/completions", json={"model": "gpt-4", "prompt": "abc"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(live.url + "/v1/completions", json={"model": folder, "prompt": "abc", "max_tokens": 10**6})
    err = r.json()["error"]
    assert r.status_code == 400 and (err["code"], err["param"]) == ("context_length_exceeded", "max_tokens")
    assert "max_tokens" in err["message"] and "--" not in err["message"]
    r = httpx.post(live.url + "/v1/chat/completions", json={"model": folder, "max_completion_tokens": 10**6,
                                                            "messages": [{"role": "user", "content": "abc"}]})
    err = r.json()["error"]  # the field the client sent, under its own name
    assert r.status_code == 400 and (err["code"], err["param"]) == ("context_length_exceeded", "max_completion_tokens")
    assert "max_completion_tokens (1000000)" in err["message"]
    r = httpx.post(live.url + "/v1/completions", content=json.dumps({"model": folder, "prompt": "abc"}))
    assert r.status_code == 400 and "Content-Type: application/json" in r.json()["error"]["message"]
    neutral = dict(logprobs=None, echo=False, presence_penalty=0, frequency_penalty=0.0, logit_bias={}, best_of=1,
                   store=False, metadata=None, parallel_tool_calls=True)
    plain = client.completions.create(model=folder, prompt="abc", max_tokens=4, temperature=0)
    assert client.completions.create(model=folder, prompt="abc", max_tokens=4, temperature=0,
                                     extra_body=neutral).choices[0].text == plain.choices[0].text
    nulls = dict(speculation=None, priority=None, top_p=None, top_k=None, min_p=None, seed=None, stop=None)
    assert client.completions.create(model=folder, prompt="abc", max_tokens=4, temperature=0,
                                     extra_body=nulls).choices[0].text == plain.choices[0].text  # null: the default
    assert client.completions.create(model=folder, prompt="abc", max_tokens=4, temperature=0, extra_body=dict(
        speculation={"k": None, "method": None})).choices[0].text == plain.choices[0].text  # nested nulls too
    r = httpx.post(live.url + "/v1/completions", json={"model": folder, "prompt": "abc", "max_tokens": 2,
                                                       "seed": 2**64 - 1})
    assert r.status_code == 200, r.text  # the largest seed SamplingParams takes
    assert client.models.retrieve(folder).id == folder
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_chat_reads_developer_as_system_and_takes_names(tiny, live):
    folder, _, tok = tiny
    usage = {}
    for role in ("system", "developer"):
        body = {"model": folder, "max_tokens": 2, "temperature": 0,
                "messages": [{"role": role, "content": "Be brief."}, {"role": "user", "content": "hi"}]}
        usage[role] = httpx.post(live.url + "/v1/chat/completions", json=body).json()["usage"]["prompt_tokens"]
    assert usage["developer"] == usage["system"]
    body["messages"][1]["name"] = "bob"  # OpenAI's field: to the chat template
    assert httpx.post(live.url + "/v1/chat/completions", json=body).status_code == 200


def test_malformed_json_and_unknown_paths(live):
    r = httpx.post(live.url + "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(live.url + "/v1/completions", content=b'{"model": "m", "prompt": "\xff\xfe"}',
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "UTF-8" in r.json()["error"]["message"]  # was "an error parsing the body"
    r = httpx.post(live.url + "/v1/chat/completions", json={"model": "m", "messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert httpx.get(live.url + "/v1/nope").status_code == 404


def test_openai_client_sees_400_as_bad_request(tiny, client):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=tiny[0], prompt="a", temperature=-1)


def test_metrics_names_documented_in_readme(tiny, client, live):
    client.completions.create(model=tiny[0], prompt=PROMPTS[0], max_tokens=10, temperature=0)
    text = httpx.get(live.url + "/metrics").text
    readme = open(os.path.join(os.path.dirname(__file__), "..", "README.md")).read()
    names = ["specdec_batch_size", "specdec_queue_length", "specdec_budget_positions", "specdec_steps_total",
             "specdec_steps_over_budget_total", "specdec_step_positions", "specdec_tokens_per_step",
             "specdec_drafted_tokens_total", "specdec_accepted_tokens_total", "specdec_realized_alpha",
             "specdec_position_drafted_total", "specdec_position_accepted_total", "specdec_k_granted",
             "specdec_inter_token_seconds", "specdec_time_to_first_token_seconds", "specdec_requests_total",
             "specdec_auto_arm_steps", "specdec_auto_arm_ratio"]
    for name in names:
        assert name in text and name in readme, name
    assert 'specdec_requests_total{finish="length"}' in text or 'specdec_requests_total{finish="stop"}' in text
    end = time.time() + 5
    while "specdec_batch_size 0.0" not in text and time.time() < end:  # idle: B is 0, not the last step's
        time.sleep(0.05)
        text = httpx.get(live.url + "/metrics").text
    assert "specdec_batch_size 0.0" in text


class SlowEngine(Engine):
    def step(self):
        time.sleep(0.02)
        super().step()


def test_api_key_and_disconnect_frees_the_slot(tiny):
    folder, model, tok = tiny
    engine = SlowEngine(model, tok, budget=6, max_batch=1)
    server = Live(create_app(engine, folder, api_key="s3cret"))
    try:
        body = {"model": folder, "prompt": "abc", "max_tokens": 200, "temperature": 0, "stream": True}
        r = httpx.post(server.url + "/v1/completions", json=body)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert httpx.get(server.url + "/health").status_code == 200  # health needs no key
        r = httpx.post(server.url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 401  # the key is checked before the body is read
        assert httpx.get(server.url + "/v1/models", headers={"Authorization": "bearer s3cret"}).status_code == 200
        assert httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer s3cre"}).status_code == 401
        auth = {"Authorization": "Bearer s3cret"}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=auth) as r:
            next(r.iter_lines())
            assert engine.running
        end = time.time() + 10
        while engine.running and time.time() < end:
            time.sleep(0.05)
        assert not engine.running
        assert 'specdec_requests_total{finish="cancelled"} 1.0' in httpx.get(server.url + "/metrics").text
        with pytest.raises(httpx.ReadTimeout):  # a non-streaming client that gives up
            httpx.post(server.url + "/v1/completions", json={**body, "stream": False}, headers=auth, timeout=1.0)
        end = time.time() + 10
        while engine.running and time.time() < end:
            time.sleep(0.05)
        assert 'specdec_requests_total{finish="cancelled"} 2.0' in httpx.get(server.url + "/metrics").text
        # a slow client does not stall the next one
        good = openai.OpenAI(base_url=server.url + "/v1", api_key="s3cret", max_retries=0)
        assert good.completions.create(model=folder, prompt="abc", max_tokens=3, temperature=0).usage.completion_tokens
    finally:
        server.close()


def _shut_down_with_requests_in_flight(tiny, max_batch: int, grace: float, signals: int):
    """A live Server over a slow engine with one stream and one more plain request in flight, then `signals` Ctrl-Cs:
    (the stream's frames, the plain request's response, seconds from the first Ctrl-C to the server's end)."""
    from specdec.serving.app import Server

    folder, model, tok = tiny
    engine = SlowEngine(model, tok, budget=6, max_batch=max_batch)
    config = uvicorn.Config(create_app(engine, folder), host="127.0.0.1", port=0, log_level="warning",
                            timeout_graceful_shutdown=60)
    server = Server(config, engine, grace=grace)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}/v1/completions"
    body = {"model": folder, "prompt": "abc", "max_tokens": 200, "temperature": 0, "speculation": False}
    answers = {}
    waiting = threading.Thread(target=lambda: answers.update(plain=httpx.post(url, json=body, timeout=30)))
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=30) as r:
        lines = r.iter_lines()
        next(lines)
        waiting.start()
        while len(engine.running) + len(engine.waiting) < 2:
            time.sleep(0.01)
        start = time.time()
        for _ in range(signals):
            server.handle_exit(signal.SIGINT, None)
        frames = [line for line in lines if line]
    waiting.join(timeout=30)
    thread.join(timeout=30)
    assert not thread.is_alive()
    return frames, answers["plain"], time.time() - start


def _answered_shutting_down(frames, plain) -> bool:
    last = json.loads(frames[-2].removeprefix("data: "))
    return (frames[-1] == "data: [DONE]" and "shutting down" in last["error"]["message"]
            and plain.status_code == 503 and "shutting down" in plain.json()["error"]["message"])


def test_ctrl_c_answers_the_requests_in_flight(tiny):
    """After Ctrl-C the requests still running get `grace` seconds, then an answer: a 503 for a waiting client, an
    error event and [DONE] for a stream (uvicorn's own deadline would cut both off mid-response)."""
    frames, plain, _ = _shut_down_with_requests_in_flight(tiny, max_batch=4, grace=0.3, signals=1)
    assert _answered_shutting_down(frames, plain)


def test_a_second_ctrl_c_answers_the_requests_in_flight_at_once(tiny):
    """A second Ctrl-C ends the grace: the requests in flight get their answers now (uvicorn's force exit cut them
    off: a 500 for a waiting client, a stream without [DONE], and a traceback each on stderr)."""
    frames, plain, seconds = _shut_down_with_requests_in_flight(tiny, max_batch=1, grace=60, signals=2)
    assert seconds < 20 and _answered_shutting_down(frames, plain)  # not the 60 s grace


@pytest.mark.parametrize("command, args, stream, marker, page", [
    ("serve", ["--budget", "4"], "stderr", "ready on ", "/health"),
    ("race", [], "stdout", "open ", "/"),
])
def test_ctrl_c_exits_cleanly(tiny, command, args, stream, marker, page):
    """--port 0 takes a free port and says which (it printed http://127.0.0.1:0); Ctrl-C exits with 0, for the race
    page's server as for `serve` (it exited 130 and printed "interrupted")."""
    folder = tiny[0]
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.Popen([sys.executable, "-m", "specdec.cli", command, "--model", folder, "--dtype", "fp32",
                             "--port", "0", *args], env=env, text=True,
                            stdout=subprocess.PIPE if stream == "stdout" else subprocess.DEVNULL,
                            stderr=subprocess.PIPE if stream == "stderr" else subprocess.DEVNULL)
    lines = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in getattr(proc, stream)], daemon=True).start()
    try:
        ready, end = "", time.time() + 60
        while marker not in ready:
            try:
                ready = lines.get(timeout=max(end - time.time(), 0.01))
            except queue.Empty:
                pytest.fail(f"no {marker!r} line within 60 s")
        url = ready.split(marker)[1].split()[0].rstrip("/")
        assert url.startswith("http://127.0.0.1:") and not url.endswith(":0")
        assert httpx.get(url + page).status_code == 200
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()


@pytest.mark.parametrize("command", ["serve", "race"])
def test_a_busy_port_is_one_line_before_the_model_loads(tiny, command, capsys, monkeypatch):
    """A port in use: status 2 and one line naming --host and --port, before the model loads (serve loaded the model,
    then uvicorn exited 3)."""
    import socket

    from specdec import api
    from specdec.cli import main
    from specdec.race import server as race_server

    def no_load(*a, **kw):
        raise AssertionError("the model loaded")

    monkeypatch.setattr(api.LLM, "__init__", no_load)
    monkeypatch.setattr(race_server, "create_app", no_load)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main([command, "--model", tiny[0], "--dtype", "fp32", "--port", str(port)]) == 2
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


def test_loadtest_against_a_live_server(tiny, live, tmp_path):
    from specdec.cli import main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"category": "t", "question_id": i, "turns": [p]})
                                 for i, p in enumerate(PROMPTS)) + "\n")
    live.engine.metrics.arm_ratios("3-4", "never", {"always": (0.85, 40)})  # as an auto server's picker reports
    assert main(["loadtest", "--url", live.url, "--concurrency", "1,3", "--requests", "5", "--prompts", str(prompts),
                 "--max-tokens", "8", "--out", str(tmp_path / "lt")]) == 0
    d = json.loads((tmp_path / "lt" / "loadtest.json").read_text())
    assert d["model"] == tiny[0] and [lv["concurrency"] for lv in d["levels"]] == [1, 3]
    for lv in d["levels"]:
        assert lv["errors"] == 0 and lv["completed"] == 5 and lv["tokens"] > 0 and lv["ttft_p50"] > 0
    table = (tmp_path / "lt" / "loadtest.md").read_text()
    assert "| - | 3 | 5/5 | 0 |" in table and table.count("| runs never; always 0.85× |") == 1  # at 3, not at 1
    assert d["levels"][1]["ratios"] == {"never": 1.0, "always": 0.85} and d["levels"][0]["ratios"] == {}
    assert all(lv["server"]["steps"] > 0 and lv["server"]["drafted"] >= 0 for lv in d["levels"])
    assert (tmp_path / "lt" / "loadtest.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["loadtest", "--url", "http://10.0.0.1:8000", "--prompts", str(prompts)]) == 2  # loopback only


def test_median_interval_takes_the_binomial_ranks():
    """The interval of a median from n paired runs: the l-th smallest to the l-th largest, l the largest rank that
    covers the median with 95% (the count below it is Binomial(n, 1/2)): the textbook ranks at 6, 9, 15 and 20."""
    import random
    from math import comb

    from specdec.serving.loadtest import median_interval

    assert median_interval([1.0] * 5) is None  # 5 runs cover it with 94% at best: no 95% interval
    for n, l in ((6, 1), (9, 2), (15, 4), (17, 5), (20, 6)):
        xs = [i / 10 for i in range(1, n + 1)]
        random.Random(n).shuffle(xs)
        assert median_interval(xs) == (l / 10, (n + 1 - l) / 10)
        cover = lambda r: 1 - 2 * sum(comb(n, i) for i in range(r)) / 2 ** n  # noqa: E731
        assert cover(l) >= 0.95 > cover(l + 1)


def test_the_table_counts_intervals_that_leave_out_one():
    """Each pair of modes is one comparison per level and measure, whichever way round; the count is held against
    the one in 20 that chance gives."""
    from specdec.serving.loadtest import markdown, outside

    def level(mode, c, paired):
        return dict(mode=mode, concurrency=c, completed=1, requests=1, errors=0, throughput=1.0, ttft_p50=None,
                    itl_p50=None, itl_p99=None, alpha=None, server=dict(steps=1, drafted=0, over_budget=0),
                    paired={m: 1.0 for m in paired}, paired_interval=paired,
                    paired_itl_p99={m: 1.0 for m in paired}, paired_itl_p99_interval=paired)

    levels = [level("auto", 1, {"never": (1.02, 1.3)}), level("never", 1, {"auto": (0.77, 0.98)}),
              level("auto", 2, {"never": (0.9, 1.1)}), level("never", 2, {"auto": (0.91, 1.11)})]
    assert outside(levels) == "\n2 of 4 paired intervals leave out 1 (about 0.2 would by chance alone).\n"
    assert markdown(levels, "t").endswith(outside(levels)) and outside([level("auto", 1, {})]) == ""


def test_loadtest_starts_its_own_servers(tiny, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"turns": ["abcabc"]}) + "\n")
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-m", "specdec.cli", "loadtest", "--serve", "never,auto", "--model", tiny[0],
                          "--dtype", "fp32", "--budget", "4", "--concurrency", "2", "--requests", "2",
                          "--prompts", str(prompts), "--max-tokens", "4", "--repeat", "6", "--out", str(tmp_path / "lt")],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    order = [line.split(" c=")[0] for line in out.stderr.splitlines() if " c=2: " in line]
    assert order == ["never", "auto", "auto", "never"] * 3  # interleaved, the first rotated
    levels = json.loads((tmp_path / "lt" / "loadtest.json").read_text())["levels"]
    assert [(lv["mode"], lv["errors"], lv["completed"], lv["requests"]) for lv in levels] == [("never", 0, 12, 12),
                                                                                             ("auto", 0, 12, 12)]
    assert levels[0]["server"]["drafted"] == 0 and levels[0]["alpha"] is None  # never speculates
    never, auto = levels
    assert len(never["throughputs"]) == 6 and never["throughput"] == statistics.median(never["throughputs"])
    assert never["paired"]["auto"] * auto["paired"]["never"] == pytest.approx(1.0)  # one median ratio, both ways
    assert never["paired_itl_p99"]["auto"] * auto["paired_itl_p99"]["never"] == pytest.approx(1.0)
    (lo, hi), (lo2, hi2) = never["paired_interval"]["auto"], auto["paired_interval"]["never"]
    assert lo <= never["paired"]["auto"] <= hi and (lo * hi2, hi * lo2) == pytest.approx((1.0, 1.0))  # 6 runs: all
    assert f"× auto ({lo:.2f}–{hi:.2f})" in (tmp_path / "lt" / "loadtest.md").read_text() and "raw" not in never


def test_dashboard_page_in_a_browser(tiny, client, live, tmp_path):
    """The live page reads /metrics in headless chromium: cards, realized alpha and latency split filled in."""
    from tests.test_race_browser import CHROMIUM_ARGS, chromium  # skips with SPECDEC_SKIP_BROWSER=1

    from playwright.sync_api import sync_playwright

    for p in PROMPTS[:3]:
        client.completions.create(model=tiny[0], prompt=p, max_tokens=12, temperature=0)
    live.engine.metrics.arm_ratios("5-8", "model", {"never": (1.07, 30), "always": (0.8, 12)})
    errors = []
    with sync_playwright() as pw:
        ctx = pw.chromium.launch_persistent_context(str(tmp_path / "profile"), executable_path=chromium(),
                                                    headless=True, args=CHROMIUM_ARGS)
        try:
            page = ctx.new_page()
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("console", lambda m: m.type == "error" and errors.append(m.text))  # e.g. a missing favicon's 404
            page.goto(live.url + "/dashboard")
            page.wait_for_function("document.getElementById('status').textContent.startsWith('updated')",
                                   timeout=20_000)
            cards = page.inner_text("#cards")
            assert "budget (positions)\n6" in cards and "steps past the budget" in cards
            assert "prompt-lookup" in page.inner_text("#alpha") and "not speculating" in page.inner_text("#latency")
            assert "5-8\tmodel\t1.00\t1.07\t0.80" in page.inner_text("#arms")  # auto's own measure per B
        finally:
            ctx.close()
    assert not errors


@pytest.mark.parametrize("argv, words", [(["--budget", "lots"], "--budget"), (["--budget", "0"], "--budget"),
                                         (["--port", "70000"], "--port"), (["--max-batch", "0"], "--max-batch"),
                                         (["--api-key", ""], "--api-key is empty"),
                                         (["--api-key", "KEY "], "starts or ends with whitespace"),
                                         (["--speculation", "always", "--method", "plain"], "name a drafter")])
def test_serve_refuses_bad_flags_in_one_line(argv, words, capsys):
    from specdec.cli import main

    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and err.startswith("specdec serve: error:") and "\n" not in err


def test_serve_method_eagle_without_a_head_is_refused_in_one_line(tiny, capsys, monkeypatch, tmp_path):
    """`specdec serve --method eagle` on a model with no EAGLE head stops before serving, saying how to get one."""
    from specdec.cli import main

    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    assert main(["serve", "--model", tiny[0], "--dtype", "fp32", "--budget", "4", "--method", "eagle"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("specdec serve: error:") and "specdec train eagle" in err


# --- fields, usage and validation (found by mutating app.py) ---


def _post(live, tiny, **change):
    body = {"model": tiny[0], "prompt": "abc", "max_tokens": 4, "temperature": 0, **change}
    return httpx.post(live.url + "/v1/completions", json=body, timeout=60)


def test_usage_totals_prompt_and_completion(tiny, live):
    u = _post(live, tiny).json()["usage"]
    assert u["prompt_tokens"] > 0 and u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]


def test_a_stream_without_include_usage_sends_no_usage_frame(tiny, live):
    raw = _post(live, tiny, stream=True).text
    frames = [f.removeprefix("data: ") for f in raw.split("\n\n") if f and f != "data: [DONE]"]
    assert frames and all("usage" not in json.loads(f) for f in frames)


def test_a_request_that_exactly_fills_the_context_is_served(tiny, live):
    context = tiny[1].cfg.max_position_embeddings
    r = _post(live, tiny, prompt=[5, 6, 7, 8], max_tokens=context - 4, speculation=False, stop="\n")
    assert r.status_code == 200, r.text


def test_a_fixed_k_the_api_allows_is_served(tiny, live):
    """k up to 1000 passes the body's check, so the engine must take it too (it refused k > 32: a 400 saying [0, 32])."""
    ids = tiny[2].encode(PROMPTS[0], chat=False)
    for k in (33, 1000):
        r = _post(live, tiny, prompt=PROMPTS[0], max_tokens=12, speculation={"method": "prompt-lookup", "k": k})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == greedy(tiny, ids, 12).text


def test_speculation_on_drafts_with_the_servers_method(tiny, live, monkeypatch):
    methods, real = [], Engine.submit
    monkeypatch.setattr(Engine, "submit", lambda self, job: methods.append(job.method) or real(self, job))
    assert _post(live, tiny, speculation="on").status_code == 200
    assert methods == ["prompt-lookup"]
