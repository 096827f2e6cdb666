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
request). An unknown field, a bad value, an unknown model, malformed JSON or a prompt that does not fit the
context gets a 400 with an OpenAI-style body {"error": {"message", "type", "param", "code"}}. With an API
key, /v1/* needs "Authorization: Bearer KEY". A client that disconnects cancels its request; the engine
frees the slot at its next step.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import threading
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Literal

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException

from specdec.decode import Request as DecodeRequest
from specdec.errors import SpecdecError
from specdec.sampling import SamplingParams
from specdec.serving.engine import Engine, Event, Job

DASHBOARD = Path(__file__).with_name("static") / "dashboard.html"
CHAT_MAX_TOKENS = 512  # a chat request without max_tokens: up to this many, within the context


class Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class Speculation(Body):
    method: str | None = None  # None: the server's --method
    k: int | Literal["auto"] = "auto"


class StreamOptions(Body):
    include_usage: bool = False


class Common(Body):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    min_p: float = Field(0.0, ge=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=1, description="one choice per request")
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    speculation: bool | Literal["auto", "on", "off"] | Speculation = "auto"
    priority: Literal["interactive", "batch"] = "interactive"


class CompletionBody(Common):
    prompt: str | list[int]


class TextPart(Body):
    type: Literal["text"]
    text: str


class Message(Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None


class ChatBody(Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


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
    tok = engine.tokenizer

    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc: RequestValidationError):
        first = exc.errors()[0]
        where = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(where) or None
        if first.get("type") == "extra_forbidden":
            return error(400, f"unknown field {param!r}: see the supported fields in the docs", param)
        if first.get("type") == "json_invalid":
            return error(400, "the body is not valid JSON", None)
        return error(400, f"{param or 'body'}: {first.get('msg')}", param)

    @app.exception_handler(HTTPException)
    async def http_error(request, exc: HTTPException):
        return error(exc.status_code, str(exc.detail))

    def authorized(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise HTTPException(401, "missing or wrong API key: send 'Authorization: Bearer KEY'")

    def job_for(body: Common, prompt_ids: list[int], max_tokens: int) -> Job:
        if body.model != model_name:
            raise SpecdecError(f"model {body.model!r} is not served here; this server runs {model_name!r}")
        spec = body.speculation
        if isinstance(spec, Speculation):
            how = (spec.method or method, spec.k)
        else:
            how = (method, "auto") if spec in (True, "auto", "on") else ("plain", "auto")
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if len(stop) > 4 or any(not s for s in stop):
            raise SpecdecError("stop must be a non-empty string or a list of up to 4 of them")
        sampling = SamplingParams(temperature=body.temperature, top_k=body.top_k, top_p=body.top_p,
                                  min_p=body.min_p, seed=body.seed)
        request = DecodeRequest(max_new_tokens=max_tokens, sampling=sampling, stop=tuple(stop))
        return Job(prompt_ids, request, method=how[0], k=how[1], priority=body.priority)

    async def run(request: Request, body: Common, job: Job, kind: str):
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        job.on_event = lambda e: loop.call_soon_threadsafe(events.put_nowait, e)
        try:
            engine.submit(job)
        except (SpecdecError, ValueError) as e:
            return error(400, str(e))
        rid, created = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}", int(time.time())
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(stream(job, events, rid, created, kind, usage), media_type="text/event-stream")
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
                if e.finish_reason == "error":
                    yield f"data: {json.dumps({'error': {'message': f'generation failed: {e.error}', 'type': 'server_error'}})}\n\n"
                    break
                if e.text:
                    yield frame(e.text)
                if done and e.finish_reason != "cancelled":
                    yield frame(None, e.finish_reason)
                    if include_usage:
                        yield frame(None, usage=usage_of(e))
            yield "data: [DONE]\n\n"
        finally:
            if not done:
                job.cancel()  # the client went away (or the stream broke): free the slot at the next step

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def completions(request: Request, body: CompletionBody):
        try:
            ids = body.prompt if isinstance(body.prompt, list) else tok.encode(body.prompt, chat=False)
            if any(not 0 <= t < engine.model.cfg.vocab_size for t in ids):
                raise SpecdecError("prompt token ids must be in [0, vocab size)")
            job = job_for(body, ids, body.max_tokens or 16)
        except (SpecdecError, ValueError) as e:
            return error(400, str(e))
        return await run(request, body, job, "completion")

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat(request: Request, body: ChatBody):
        try:
            if not tok.has_chat_template:
                raise SpecdecError(f"{model_name} has no chat template: use /v1/completions")
            messages = [{"role": m.role, "content": m.content if isinstance(m.content, str)
                         else "".join(p.text for p in m.content)} for m in body.messages]
            text = tok.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            ids = tok.hf.encode(text, add_special_tokens=False)
            limit = engine.model.cfg.max_position_embeddings - len(ids)
            job = job_for(body, ids, body.max_completion_tokens or body.max_tokens or max(1, min(CHAT_MAX_TOKENS, limit)))
        except (SpecdecError, ValueError) as e:
            return error(400, str(e))
        return await run(request, body, job, "chat")

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "specdec"}]}

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


def usage_of(e: Event) -> dict:
    return {"prompt_tokens": e.prompt_tokens, "completion_tokens": e.completion_tokens,
            "total_tokens": e.prompt_tokens + e.completion_tokens}
