"""The OpenAI-compatible HTTP app around the batched engine (FastAPI; `specdec serve` runs it with uvicorn).

    POST /v1/completions        prompt (text or token ids) -> text; "stream": true for server-sent events
    POST /v1/chat/completions   messages -> assistant message (the model's chat template); streaming too
    GET  /v1/models             the one model served
    GET  /health                {"status": "ok", "running": R, "waiting": W}
    GET  /metrics               the lesson's dashboard signals, Prometheus text (specdec.serving.metrics)
    GET  /dashboard             a live page of those signals (static/dashboard.html reads /metrics)

Sampling fields: max_tokens, temperature (OpenAI's default 1; 0 = greedy), top_p, top_k, min_p, seed, stop
(a string or up to 4), n = 1, stream, stream_options.include_usage; every response carries `usage`. Two
extra fields: `speculation` (true/"auto"/"on": the server's method with adaptive k; false/"off": plain
steps; or {"method": "prompt-lookup" | "recycling" | "eagle" | "plain" (default: the server's), "k": 4 | "auto"}) and
`priority` ("interactive", the default, or "batch": served speculation headroom after every interactive
request). An unknown field, a bad value, malformed JSON, text that is not valid Unicode or a prompt that does
not fit the context (code "context_length_exceeded") gets a 400 with an OpenAI-style body {"error": {"message",
"type", "param", "code"}}, an unknown model a 404 (code "model_not_found"). A field the server does not support
is refused unless it has its neutral value, as clients send by default (`NEUTRAL`: e.g. "logprobs": null,
"presence_penalty": 0). The role "developer" is read as "system", as OpenAI does; a message's "name" goes to the
chat template. With an API key, /v1/* needs
"Authorization: Bearer KEY", checked before the body is read. A client that disconnects cancels its request; the
engine frees the slot at its next step. Tokenizing runs off the event loop, so a huge prompt does not stall
other streams, and a text longer than the context could hold in any tokenization is refused before it.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import sys
import threading
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Literal

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.exceptions import HTTPException

from specdec.decode import Request as DecodeRequest
from specdec.errors import SpecdecError
from specdec.options import K_MAX
from specdec.sampling import SamplingParams
from specdec.serving.engine import Engine, Event, Job

DASHBOARD = Path(__file__).with_name("static") / "dashboard.html"
CHAT_MAX_TOKENS = 512  # a chat request without max_tokens: up to this many, within the context
MAX_MESSAGES = 65_536  # each costs a chat template 3+ tokens: more never fit a context, and validating them stalls


# OpenAI fields this server does not support, with the values that ask for nothing (accepted and dropped)
NEUTRAL = {"logprobs": (None, False), "top_logprobs": (None, 0), "echo": (None, False), "best_of": (None, 1),
           "presence_penalty": (None, 0), "frequency_penalty": (None, 0), "logit_bias": (None, {}),
           "suffix": (None, ""), "tools": (None, []), "tool_choice": (None, "none"),
           "response_format": (None, {"type": "text"}), "store": (None, False), "metadata": (None, {}),
           "parallel_tool_calls": (None, True, False)}  # without tools, either says nothing


def _neutral(value, allowed) -> bool:
    """`value` is one of `allowed`, types kept apart (False is not 0) but for numbers (0.0 is 0)."""
    for a in allowed:
        if a is None or isinstance(a, bool) or isinstance(value, bool):
            if value is a:
                return True
        elif isinstance(a, (int, float)) and isinstance(value, (int, float)):
            if value == a:
                return True
        elif type(value) is type(a) and value == a:
            return True
    return False


class Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def null_is_default(cls, data):
        """A field of ours sent as null takes its default, as OpenAI reads null ("temperature": null is 1,
        "speculation": {"k": null} is "auto"); a required one stays, and is refused as the wrong type."""
        if isinstance(data, dict):
            data = {k: v for k, v in data.items() if not (v is None and k in cls.model_fields
                                                            and not cls.model_fields[k].is_required())}
        return data


class Speculation(Body):
    method: str | None = None  # None: the server's --method
    k: Annotated[int, Field(ge=0, le=K_MAX)] | Literal["auto"] = "auto"


class StreamOptions(Body):
    include_usage: bool = False


class Common(Body):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    min_p: float = Field(0.0, ge=0, le=1)
    seed: int | None = Field(None, ge=0, lt=2**64)  # as SamplingParams takes it, refused here with its param
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=1, description="one choice per request")
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    speculation: bool | Literal["auto", "on", "off"] | Speculation = "auto"
    priority: Literal["interactive", "batch"] = "interactive"

    @model_validator(mode="before")
    @classmethod
    def drop_neutral(cls, data):
        """Unsupported fields at their neutral values (`NEUTRAL`) ask for nothing: drop them; any other value
        stays, and is refused as an unknown field."""
        if isinstance(data, dict):
            data = {k: v for k, v in data.items() if not (k in NEUTRAL and _neutral(v, NEUTRAL[k]))}
        return data


class CompletionBody(Common):
    prompt: str | list[int]


class TextPart(Body):
    type: Literal["text"]
    text: str


class Message(Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None  # handed to the chat template (SmolLM2's and Qwen2.5's do not show it)


class ChatBody(Common):
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1)


FIELDS = {name for model in (CompletionBody, ChatBody, Message, TextPart, Speculation, StreamOptions)
          for name in model.model_fields}
HINTS = {"prompt": "a string or a list of token ids", "stop": "a string or a list of up to 4 strings",
         "speculation": 'true, false, "auto", "on", "off" or {"method": ..., "k": ...}',
         "messages": 'a list of {"role": ..., "content": a string or a list of {"type": "text", "text": ...}}'}


class Refused(Exception):
    """A request the server turns away: its status, the field at fault and OpenAI's error code, if any."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.code, self.status = param, code, status


class KeyCheck:
    """ASGI middleware: /v1/* needs "Authorization: Bearer KEY" (the scheme in any case), checked before the body
    is read, so a request without the key gets a 401 whatever it sends."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = given.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                refusal = error(401, "missing or wrong API key: send 'Authorization: Bearer KEY'")
                return await refusal(scope, receive, send)
        await self.app(scope, receive, send)


def error(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    kind = {401: "authentication_error", 404: "not_found_error"}.get(status, "invalid_request_error")
    if status >= 500:
        kind = "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status)


def create_app(engine: Engine, model_name: str, method: str = "prompt-lookup", api_key: str | None = None) -> FastAPI:
    """The app for one engine. The engine's serving thread starts and stops with the app."""

    @asynccontextmanager
    async def lifespan(app):
        stop = threading.Event()
        thread = threading.Thread(target=engine.serve, args=(stop,), name="specdec-engine", daemon=True)
        thread.start()
        yield
        stop.set()
        thread.join(timeout=60)

    app = FastAPI(title="specdec serve", lifespan=lifespan)
    if api_key is not None:
        app.add_middleware(KeyCheck, key=api_key)
    tok, context = engine.tokenizer, engine.model.cfg.max_position_embeddings
    longest = max(map(len, tok.hf.get_vocab()))  # no token spells more characters: a longer text cannot fit

    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc: RequestValidationError):
        # a field of several types fails once per type: the error that got furthest into its value says most
        first = max(exc.errors(), key=lambda e: len(e.get("loc", ())))
        loc = [p for p in first.get("loc", ()) if p != "body"]
        where = [str(p) for i, p in enumerate(loc) if isinstance(p, int) or p in FIELDS  # not the type tags
                 or (i == len(loc) - 1 and first.get("type") == "extra_forbidden")]  # but an unknown name
        param = ".".join(where) or None
        if first.get("type") == "extra_forbidden" and param in NEUTRAL:
            asks = " or ".join(json.dumps(v) for v in NEUTRAL[param])
            return error(400, f"field {param!r} is not supported by this server: leave it out or send {asks}", param)
        if first.get("type") == "extra_forbidden":
            return error(400, f"unknown field {param!r}: see the supported fields in the docs", param)
        if first.get("type") == "json_invalid":
            return error(400, "the body is not valid JSON", None)
        if not where and first.get("type") in ("model_attributes_type", "dict_type"):
            return error(400, "the body must be a JSON object, sent with 'Content-Type: application/json'", None)
        hint = f" ({where[0]} is {HINTS[where[0]]})" if where and where[0] in HINTS else ""
        return error(400, f"{param or 'body'}: {first.get('msg')}{hint}", param)

    @app.exception_handler(HTTPException)
    async def http_error(request, exc: HTTPException):
        if exc.status_code == 400 and exc.detail == "There was an error parsing the body":  # FastAPI's words for a
            return error(400, "the body is not JSON text in UTF-8: send it encoded as UTF-8", None)  # body not UTF-8
        return error(exc.status_code, str(exc.detail))

    def unknown(name: str) -> Refused:
        return Refused(f"model {name!r} is not served here; this server runs {model_name!r}", "model",
                       "model_not_found", 404)

    def text_of(text: str, param: str) -> str:
        """`text`, or Refused: not valid Unicode (a lone surrogate), or longer than any tokenization could fit."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise Refused(f"{param} is not valid Unicode ({e.reason} at character {e.start}, e.g. a lone "
                          "UTF-16 surrogate): send well-formed text", param) from None
        if len(text) > context * longest:
            raise Refused(f"{param} has {len(text)} characters, more than the model's context of {context} tokens "
                          "can hold: shorten it", param, "context_length_exceeded")
        return text

    def job_for(body: Common, prompt_ids: list[int], max_tokens: int, field: str | None, prompt: str) -> Job:
        """The engine's job for a checked body (runs off the event loop, after the prompt is tokenized);
        `field`: the body's name for max_tokens, as an error names it (None: the client sent none, and `max_tokens`
        is the default); `prompt`: the body's name for the prompt."""
        if len(prompt_ids) + max_tokens > context:
            if field is None:  # the client cannot lower a max_tokens it never sent
                room = (f"for the {max_tokens} an answer gets by default" if len(prompt_ids) < context
                        else "for an answer")  # a chat's default shrinks to fit: "the 1 an answer gets" was wrong
                raise Refused(f"the prompt ({len(prompt_ids)} tokens) leaves no room in the model's context of "
                              f"{context} tokens {room}: shorten {prompt}", prompt, "context_length_exceeded")
            raise Refused(f"the prompt ({len(prompt_ids)} tokens) and {field} ({max_tokens}) exceed the model's "
                          f"context of {context} tokens: shorten the prompt or lower {field}", field,
                          "context_length_exceeded")
        spec = body.speculation
        if isinstance(spec, Speculation):
            how = (method if spec.method is None else spec.method, spec.k)  # "" is a bad method, not the default
            if how[0] == "plain" and spec.k not in ("auto", 0):
                raise Refused(f"speculation.k = {spec.k} is read only when drafting, and plain decoding drafts "
                              "nothing: leave k out or name a drafting method", "speculation.k")
        else:
            how = (method, "auto") if spec in (True, "auto", "on") else ("plain", "auto")
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if len(stop) > 4 or any(not s for s in stop):
            raise Refused("stop must be a non-empty string or a list of up to 4 of them", "stop")
        stop = [text_of(s, "stop") for s in stop]
        sampling = SamplingParams(temperature=body.temperature, top_k=body.top_k, top_p=body.top_p,
                                  min_p=body.min_p, seed=body.seed)
        request = DecodeRequest(max_new_tokens=max_tokens, sampling=sampling, stop=tuple(stop))
        return Job(prompt_ids, request, method=how[0], k=how[1], priority=body.priority)

    async def run(request: Request, body: Common, prepare, kind: str):
        """Check the body and tokenize (`prepare(body) -> Job`, in a worker thread), submit, then answer."""
        try:
            if body.model != model_name:
                raise unknown(body.model)
            if body.stream_options is not None and not body.stream:
                raise Refused("stream_options is only allowed when stream is true", "stream_options")
            job = await asyncio.to_thread(prepare, body)
            loop, events = asyncio.get_running_loop(), asyncio.Queue()
            job.on_event = lambda e: loop.call_soon_threadsafe(events.put_nowait, e)
            engine.submit(job)
        except Refused as e:
            return error(e.status, str(e), e.param, e.code)
        except (SpecdecError, ValueError) as e:
            return error(400, str(e), getattr(e, "param", None))
        rid, created = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}", int(time.time())
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(stream(job, events, rid, created, kind, usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        text, last, check = [], None, loop.time() + 0.5
        try:
            while last is None:
                try:
                    e = await asyncio.wait_for(events.get(), timeout=0.5)
                    text.append(e.text)
                    last = e if e.finish_reason else None
                except asyncio.TimeoutError:
                    pass
                if last is None and loop.time() >= check:  # twice a second: is the client still there?
                    if await request.is_disconnected():
                        return Response(status_code=499)
                    check = loop.time() + 0.5
        finally:
            if last is None:  # the client went away: free the slot at the next step
                job.cancel()
        if last.finish_reason == "error":
            return error(500, f"generation failed: {last.error}")
        if last.finish_reason == "cancelled":
            return error(503, "the server is shutting down")
        choice = ({"index": 0, "message": {"role": "assistant", "content": "".join(text)}}
                  if kind == "chat" else {"index": 0, "text": "".join(text), "logprobs": None})
        choice["finish_reason"] = last.finish_reason
        return {"id": rid, "object": "chat.completion" if kind == "chat" else "text_completion",
                "created": created, "model": model_name, "choices": [choice], "usage": usage_of(last)}

    async def stream(job: Job, events: asyncio.Queue, rid: str, created: int, kind: str, include_usage: bool):
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

        def frame(delta: str | None, finish: str | None = None, role: bool = False, usage: dict | None = None):
            if kind == "chat":
                d = {"role": "assistant", "content": ""} if role else ({"content": delta} if delta else {})
                choices = [{"index": 0, "delta": d, "finish_reason": finish}]
            else:
                choices = [{"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}]
            out = {"id": rid, "object": obj, "created": created, "model": model_name,
                   "choices": [] if usage else choices}
            if usage:
                out["usage"] = usage
            return f"data: {json.dumps(out)}\n\n"

        done = False
        try:
            if kind == "chat":
                yield frame(None, role=True)
            while not done:
                e: Event = await events.get()
                done = e.finish_reason is not None
                if e.finish_reason in ("error", "cancelled"):  # cancelled here: the server is shutting down
                    why = f"generation failed: {e.error}" if e.error else "the server is shutting down"
                    yield f"data: {json.dumps({'error': {'message': why, 'type': 'server_error'}})}\n\n"
                    break
                if e.text:
                    yield frame(e.text)
                if done:
                    yield frame(None, e.finish_reason)
                    if include_usage:
                        yield frame(None, usage=usage_of(e))
            yield "data: [DONE]\n\n"
        finally:
            if not done:
                job.cancel()  # the client went away (or the stream broke): free the slot at the next step

    def completion_job(body: CompletionBody) -> Job:
        if isinstance(body.prompt, list):
            ids = body.prompt
            if any(not 0 <= t < engine.model.cfg.vocab_size for t in ids):
                raise Refused("prompt token ids must be in [0, vocab size)", "prompt")
        else:
            ids = tok.encode(text_of(body.prompt, "prompt"), chat=False)
        return job_for(body, ids, body.max_tokens or 16, "max_tokens" if body.max_tokens else None, "prompt")

    def chat_job(body: ChatBody) -> Job:
        if not tok.has_chat_template:
            raise SpecdecError(f"{model_name} has no chat template: use /v1/completions")
        messages = [{"role": "system" if m.role == "developer" else m.role,  # OpenAI's newer name for system
                     "content": text_of(m.content if isinstance(m.content, str) else "".join(p.text for p in m.content),
                                        f"messages.{i}.content"), **({"name": m.name} if m.name else {})}
                    for i, m in enumerate(body.messages)]
        chars = sum(len(m["content"]) for m in messages)
        if len(messages) > context or chars > context * longest:  # before templating and tokenizing it (seconds)
            raise Refused(f"messages: {len(messages)} messages of {chars} characters in all, more than the model's "
                          f"context of {context} tokens can hold: send fewer or shorter ones", "messages",
                          "context_length_exceeded")
        text = tok.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tok.hf.encode(text, add_special_tokens=False)
        if body.max_completion_tokens:  # OpenAI's newer name, ahead of max_tokens
            return job_for(body, ids, body.max_completion_tokens, "max_completion_tokens", "messages")
        if body.max_tokens:
            return job_for(body, ids, body.max_tokens, "max_tokens", "messages")
        return job_for(body, ids, max(1, min(CHAT_MAX_TOKENS, context - len(ids))), None, "messages")

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionBody):
        return await run(request, body, completion_job, "completion")

    @app.post("/v1/chat/completions")
    async def chat(request: Request, body: ChatBody):
        return await run(request, body, chat_job, "chat")

    card = {"id": model_name, "object": "model", "created": 0, "owned_by": "specdec"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        if name != model_name:
            e = unknown(name)
            return error(e.status, str(e), e.param, e.code)
        return card

    @app.get("/health")
    async def health():
        return {"status": "ok", "running": len(engine.running), "waiting": len(engine.waiting)}

    @app.get("/metrics")
    async def metrics():
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/dashboard")
    async def dashboard():
        return FileResponse(DASHBOARD)

    return app


class Server(uvicorn.Server):
    """uvicorn's server for an engine's app. The first Ctrl-C (or SIGTERM) gives in-flight requests `grace`
    seconds, then cancels them in the engine, so each still gets its answer (a 503, or a stream ended by an error
    event and [DONE]) before uvicorn's own deadline (its config's timeout_graceful_shutdown, which should be
    longer), which would cut them off mid-response. A second Ctrl-C cancels them at once (a third is uvicorn's
    force exit)."""

    def __init__(self, config: uvicorn.Config, engine: Engine, grace: float = 5.0):
        super().__init__(config)
        self.engine, self.grace, self.hurried = engine, grace, False

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:  # where it listens: with --port 0, the port the system chose
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            print(f"specdec serve: ready on http://{f'[{host}]' if ':' in host else host}:{port}", file=sys.stderr,
                  flush=True)

    def handle_exit(self, sig, frame) -> None:
        if not self.should_exit:
            timer = threading.Timer(self.grace, self.engine.cancel_all)
            timer.daemon = True  # not waited for when every request ends sooner
            timer.start()
        elif not self.hurried:  # a second Ctrl-C: the grace ends now, and the requests still get their answers
            self.hurried = True  # (uvicorn's force exit cut them off mid-response with a traceback each)
            self.engine.cancel_all()
            return
        super().handle_exit(sig, frame)  # the first, or a third: uvicorn's force exit


def usage_of(e: Event) -> dict:
    return {"prompt_tokens": e.prompt_tokens, "completion_tokens": e.completion_tokens,
            "total_tokens": e.prompt_tokens + e.completion_tokens}
