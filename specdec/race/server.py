"""The race's web server (the lesson's Chapter 8): one page and a small JSON API.

    GET  /                       the page (static/index.html, plain JS, no build step)
    GET  /api/config             presets, lesson and measured defaults, the methods and whether each can run
    POST /api/sim                a segment of the simulated race, with the formula's prediction
    GET  /api/surface            speedup over (alpha, k) for a tau (Ch. 2's surface)
    GET  /api/rounds             the distribution of tokens per round for alpha and k (Ch. 2's bursts)
    GET  /api/headroom           headroom against occupancy, and Ch. 7's priority allocation
    POST /api/live               start a live race on the real model (202; 409 while one runs)
    GET  /api/live               the race running now (null when none)
    GET  /api/live/{id}          its state and progress; both lanes' token timings once done
    POST /api/live/{id}/cancel   cancel it

Every number comes from `specdec.theory` and `specdec.race.sim`. Bad parameters get a 4xx whose
JSON has an "error" line (out of range, wrong type, unknown field), never a 500.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.exceptions import HTTPException

from specdec import theory
from specdec.errors import SpecdecError
from specdec.race import sim
from specdec.sampling import SEED_MAX
from specdec.race.live import Busy, LiveRequest, LiveRunner

STATIC = Path(__file__).with_name("static")
OCCUPANCY_MAX = 200  # the race's B control (Ch. 7's examples reach 140; past 156 is the point)


class Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class SimBody(Body):
    alpha: float = Field(0.82, ge=0, le=1, description="acceptance rate of one drafted token")
    k: int = Field(4, ge=0, le=sim.K_MAX, description="drafted tokens per round")
    tau: float = Field(0.002, ge=0, le=1, description="draft cost per token, as a fraction of one step")
    occupancy: float = Field(0, ge=0, le=OCCUPANCY_MAX, description="B: sequences already in the batch")
    budget: float = Field(theory.BUDGET, gt=0, le=1e6, description="positions one step verifies for free")
    step_ms: float = Field(theory.STEP_MS, ge=0.01, le=1e5,  # the page's own minimum: times go out to 0.1 µs
                           description="one memory-bound decode step")
    seed: int = Field(0, ge=0, le=2**53)
    segment: int = Field(0, ge=0, le=10**9, description="which stretch of the race (its own random stream)")
    start_vanilla_ms: float = Field(0, ge=0, le=1e12)
    start_spec_ms: float = Field(0, ge=0, le=1e12)
    horizon_ms: float = Field(2000, gt=0, le=600_000, description="simulate this far past the earlier lane")
    max_rounds: int = Field(4000, ge=1, le=20_000)


class LiveBody(Body):
    prompt: str = Field(min_length=1, max_length=20_000)
    method: str = "prompt-lookup"
    k: Any = Field("auto", description="draft length 0..64, or 'auto'")
    max_new_tokens: int = Field(64, ge=1, le=1024)
    temperature: float = Field(0.0, ge=0, le=5)
    seed: int | None = Field(None, ge=0, le=SEED_MAX)
    model: str | None = Field(None, min_length=1, description="default: the server's model")

    @field_validator("k")
    @classmethod
    def _k(cls, v):
        if v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 64):
            return v
        raise ValueError(f"must be an integer from 0 to 64 or 'auto', got {v!r}")


def measured_defaults(model: str, dtype: str | None, runner: LiveRunner | None = None) -> dict | None:
    """The budget and step time `specdec probe --model MODEL` cached for this machine, if any, for the
    dtype the live race runs: --dtype auto is q4 for a model from a 4-bit GGUF (SmolLM2, the Qwens), so
    the probe to read is the one `specdec probe` (also auto) saves under "q4", not a bf16 or fp32 one."""
    from specdec.probe import load_cached

    names = {"fp32": ["float32"], "bf16": ["bfloat16"], "q8": ["q8"], "q4": ["q4"]}.get(dtype or "auto")
    if names is None:
        names = _auto_dtype_names(model, runner)
    for name in names:
        try:
            probe = load_cached(model, name)
        except (OSError, ValueError, TypeError, KeyError):
            probe = None
        if probe:
            return dict(budget=probe.budget, step_ms=round(probe.seconds[1] * 1e3, 3), dtype=name,
                        source=f"specdec probe --model {model} ({name}, {probe.threads} threads)")
    return None


def _auto_dtype_names(model: str, runner: LiveRunner | None) -> list[str]:
    """What --dtype auto resolves to for `model`, as the probe cache names it: the loaded model's own
    dtype when the live race has loaded it, else the loader's rule (`resolve_dtype`) on the pulled folder."""
    loaded = runner.loaded_dtype_key() if runner else None
    if loaded:
        return [loaded]
    if model.lower().endswith(".gguf"):  # resolving it would convert it (minutes): its probe says its dtype
        return ["q4", "bfloat16", "float32"]
    if model not in _AUTO:  # once per model: resolving says its choice on stderr (and may build a kernel)
        try:
            from specdec.runtime.loader import resolve_dtype
            from specdec.store import resolve

            _AUTO[model] = [str(resolve_dtype(None, resolve(model, pull=False))).replace("torch.", "")]
        except (SpecdecError, OSError, ValueError, KeyError, TypeError):
            return ["bfloat16", "float32"]  # not pulled yet: asked again on the next page load
    return _AUTO[model]


_AUTO: dict[str, list[str]] = {}  # model -> what --dtype auto resolves to, as the probe cache names it


def _message(errors: list[dict]) -> str:
    parts = []
    for e in errors:
        loc = ".".join(str(x) for x in e.get("loc", ()) if x not in ("body", "query", "path"))
        msg = str(e.get("msg")).removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts) or "invalid request"


def create_app(model: str | None = "smollm2-135m", *, dtype: str | None = None, draft: str | None = None,
               datastore: str | None = None, exit_layer: int | str = "auto", sources: str | None = None,
               preload: bool = True) -> FastAPI:
    """The race app. `model` (a known name, a Hugging Face folder or a .gguf file) serves the live
    race, loaded in the background at startup when `preload`; None leaves only the simulation and the
    widgets. Bad settings (an unknown draft model, hybrid source or exit layer) raise SpecdecError now."""
    runner = LiveRunner(model, dtype=dtype, draft=draft, datastore=datastore, exit_layer=exit_layer,
                        sources=sources) if model else None

    @asynccontextmanager
    async def lifespan(app):
        if runner and preload:
            runner.preload()
        yield
        if runner:
            runner.shutdown()

    app = FastAPI(title="specdec race", description=__doc__, lifespan=lifespan)
    app.state.runner = runner

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        detail = [dict(loc=list(e.get("loc", ())), msg=e.get("msg"), type=e.get("type")) for e in exc.errors()]
        return JSONResponse(status_code=422, content=dict(error=_message(detail), detail=detail))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        return JSONResponse(status_code=exc.status_code, content=dict(error=str(exc.detail)))

    @app.exception_handler(Busy)
    async def busy(request: Request, exc: Busy):
        return JSONResponse(status_code=409, content=dict(error=str(exc), race_id=exc.race_id))

    @app.exception_handler(SpecdecError)
    @app.exception_handler(ValueError)
    async def bad(request: Request, exc: Exception):
        return JSONResponse(status_code=400, content=dict(error=str(exc)))

    @app.get("/", include_in_schema=False)
    def index():
        return FileResponse(STATIC / "index.html")

    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.get("/api/config")
    def config():
        return dict(
            model=model,
            presets=[p.__dict__ for p in sim.PRESETS],
            defaults=dict(sim.RaceParams().__dict__),
            lesson=dict(budget=theory.BUDGET, step_ms=theory.STEP_MS),
            measured=measured_defaults(model, dtype, runner) if model else None,
            limits=dict(k_max=sim.K_MAX, occupancy_max=OCCUPANCY_MAX),
            methods=runner.methods() if runner else [],
        )

    @app.post("/api/sim")
    def simulate(body: SimBody):
        p = sim.RaceParams(alpha=body.alpha, k=body.k, tau=body.tau, occupancy=body.occupancy, budget=body.budget,
                           step_ms=body.step_ms, seed=body.seed)
        until = min(body.start_vanilla_ms, body.start_spec_ms) + body.horizon_ms
        vanilla, spec = sim.simulate(p, until, start_vanilla_ms=body.start_vanilla_ms,
                                     start_spec_ms=body.start_spec_ms, segment=body.segment,
                                     max_rounds=body.max_rounds)
        cost = p.cost()
        return dict(
            segment=body.segment,
            until_ms=min(vanilla.last_ms, spec.last_ms),
            vanilla=_lane(vanilla), spec=_lane(spec),
            prediction=dict(
                speedup=p.predicted_speedup(),
                speedup_free=theory.speedup(p.alpha, p.k, p.tau),
                expected_tokens=theory.expected_tokens(p.alpha, p.k),
                distribution=theory.tokens_per_round_distribution(p.alpha, p.k),
                vanilla_ms=p.vanilla_ms(), round_ms=p.round_ms(),
                vanilla_stretch=cost(1), verify_stretch=cost(p.k + 1),
                headroom=theory.headroom(p.budget, p.occupancy), demand=p.occupancy + theory.speculation_cost(p.k),
                best_k=theory.best_k(p.alpha, p.tau, sim.K_MAX, cost),
            ),
            summary=sim.summarize(p, vanilla, spec).__dict__,
        )

    @app.get("/api/surface")
    def surface(tau: float = Query(0.1, ge=0, le=1, allow_inf_nan=False),
                k_max: int = Query(sim.K_MAX, ge=1, le=32),
                steps: int = Query(20, ge=2, le=100, description="alpha from 0 to 1 in this many steps")):
        alphas = [round(i / steps, 6) for i in range(steps + 1)]
        return dict(
            tau=tau, alphas=alphas, ks=list(range(k_max + 1)),
            speedup=[[theory.speedup(a, k, tau) for a in alphas] for k in range(k_max + 1)],
            best_k=[theory.best_k(a, tau, k_max) for a in alphas],
            break_even=[theory.break_even_alpha(k, tau) for k in range(k_max + 1)],
        )

    @app.get("/api/rounds")
    def rounds(alpha: float = Query(0.7, ge=0, le=1, allow_inf_nan=False),
               k: int = Query(4, ge=0, le=32)):
        return dict(alpha=alpha, k=k, tokens=list(range(1, k + 2)),
                    probability=theory.tokens_per_round_distribution(alpha, k),
                    expected=theory.expected_tokens(alpha, k), full_burst=theory.full_burst_probability(alpha, k))

    @app.get("/api/headroom")
    def headroom(budget: float = Query(theory.BUDGET, gt=0, le=1e6, allow_inf_nan=False),
                 k: int = Query(4, ge=0, le=32),
                 occupancy: float = Query(120, ge=0, le=OCCUPANCY_MAX, allow_inf_nan=False),
                 interactive: int = Query(10, ge=0, le=100, description="interactive sessions asking for k"),
                 batch: int = Query(2, ge=0, le=100, description="batch jobs asking for k")):
        room = theory.headroom(budget, occupancy)
        sessions = [theory.Session(f"chat-{i + 1}", k, True, interactive - i) for i in range(interactive)]
        sessions += [theory.Session(f"batch-{i + 1}", k, False, batch - i) for i in range(batch)]
        granted = theory.allocate_headroom(sessions, max(room, 0.0))
        used = sum(theory.speculation_cost(g) for g in granted.values() if g)
        curve = [dict(occupancy=b, headroom=theory.headroom(budget, b),
                      fit=theory.requests_that_fit(theory.headroom(budget, b), k))
                 for b in range(0, OCCUPANCY_MAX + 1, 2)]
        return dict(budget=budget, k=k, occupancy=occupancy, headroom=room,
                    fit=theory.requests_that_fit(room, k), cost_per_request=theory.speculation_cost(k),
                    curve=curve,
                    allocation=[dict(name=s.name, interactive=s.interactive, asked=s.k, granted=granted[s.name])
                                for s in sessions],
                    used=used, demand_if_all=theory.total_demand(occupancy, len(sessions), k))

    def _runner() -> LiveRunner:
        if runner is None:
            raise HTTPException(400, "this server has no model for live races: start `specdec race --model NAME`")
        return runner

    @app.get("/api/live")
    def live_current():
        """The race running now, if any (a reloaded page or a second tab follows it instead of a 409)."""
        race = runner.running() if runner else None
        return dict(race=race.to_dict(traces=False) if race else None)

    @app.post("/api/live", status_code=202)
    def live_start(body: LiveBody):
        race = _runner().start(LiveRequest(**body.model_dump()))
        return race.to_dict()

    def _race(race_id: int):
        race = _runner().get(race_id)
        if race is None:
            raise HTTPException(404, f"no live race {race_id}")
        return race

    @app.get("/api/live/{race_id}")
    def live_status(race_id: int):
        return _race(race_id).to_dict()

    @app.post("/api/live/{race_id}/cancel")
    def live_cancel(race_id: int):
        race = _race(race_id)
        race.cancel.set()
        return race.to_dict(traces=False)

    return app


def _lane(lane: sim.Lane) -> dict:
    return dict(start_ms=lane.start_ms, end_ms=[round(t, 4) for t in lane.end_ms], accepted=lane.accepted,
                kind=[k[0] for k in lane.kind], tokens=lane.tokens)
