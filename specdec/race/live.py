"""The live race (the lesson's Chapter 8, on a real model): plain decoding, then a speculative method,
on the same prompt and sampling settings, one after the other so that neither steals the other's
cores. Every token keeps the wall-clock time (seconds from its run's start, prefill included) at
which its round committed it, so the page can replay both lanes side by side at their real pace.
A speculative token is "accepted" (a draft the target kept), "recovered" (the target's own token at
the first rejection) or "bonus" (the target's extra token after k accepted drafts); plain tokens
are "plain".

Example: prompt lookup on a code-editing prompt commits rounds of 1 to k + 1 tokens, e.g. at
t = 0.210 s "accepted, accepted, bonus", so the method lane fills in bursts while the plain lane
ticks one token per step.

One model is loaded per server (loading takes seconds) and one race runs at a time; a race can be
cancelled between rounds and reports its progress (phase, tokens so far, max).
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field

from specdec.errors import SpecdecError
from specdec.options import GenerationOptions, check_exit_layer, check_prompt, check_setup

RESULT_FIELDS = ("new_tokens", "seconds", "tokens_per_s", "prefill_seconds", "target_forwards", "mean_accepted",
                 "acceptance_rate", "drafted", "accepted", "finish_reason", "text")


class Busy(SpecdecError):
    """A race is already running (the machine has two cores: one race at a time)."""

    def __init__(self, message: str, race_id: int | None = None):
        super().__init__(message)
        self.race_id = race_id


class Cancelled(Exception):
    pass


@dataclass
class LiveRequest:
    prompt: str
    method: str = "prompt-lookup"
    k: int | str = "auto"
    max_new_tokens: int = 64
    temperature: float = 0.0
    seed: int | None = None
    model: str | None = None  # None: the server's model


@dataclass
class LaneTrace:
    method: str
    t: list[float] = field(default_factory=list)      # seconds from the run's start, one per token
    kind: list[str] = field(default_factory=list)     # plain / accepted / recovered / bonus
    ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)     # each token's text (filled in after the run)
    result: dict | None = None

    def to_dict(self) -> dict:
        return dict(method=self.method, t=self.t, kind=self.kind, text=self.text, result=self.result)


@dataclass
class Race:
    id: int
    request: LiveRequest
    state: str = "queued"      # queued, loading, running, done, error, cancelled
    phase: str = ""            # what it is doing, in words
    lane: str = ""             # the lane being run: "plain" or the method
    tokens: int = 0            # tokens of the lane being run
    error: str | None = None
    lanes: dict[str, LaneTrace] = field(default_factory=dict)
    cancel: threading.Event = field(default_factory=threading.Event)
    started: float = field(default_factory=time.time)
    ended: float | None = None  # when it finished (done, error or cancelled): elapsed_s stops there
    thread: threading.Thread | None = field(default=None, repr=False)

    @property
    def finished(self) -> bool:
        return self.state in ("done", "error", "cancelled")

    def to_dict(self, traces: bool = True) -> dict:
        d = dict(id=self.id, state=self.state, phase=self.phase, lane=self.lane, tokens=self.tokens,
                 max_new_tokens=self.request.max_new_tokens, method=self.request.method, error=self.error,
                 elapsed_s=round((self.ended or time.time()) - self.started, 3))
        if traces and self.state == "done":
            d["lanes"] = {name: lane.to_dict() for name, lane in self.lanes.items()}
        return d


def token_kinds(n: int, accepted: int, kind: str) -> list[str]:
    """Kinds of a round's n committed tokens: the first `accepted` are drafts the target kept; the rest
    (at most one) is the round's own token, "plain", "recovered" or "bonus"."""
    a = min(accepted, n)
    return ["accepted"] * a + [kind] * (n - a)


def token_texts(tokenizer, ids: list[int]) -> list[str]:
    """Each token's share of the decoded text (incremental decoding, so multi-byte pieces and leading
    spaces land where the full decode puts them; special tokens such as EOS get ""). A character split
    over several tokens (a kanji, an emoji: U+FFFD until its last byte) goes to the token that completes
    it: "日" as three byte tokens gives ["", "", "日"], not "\ufffd" and then nothing for the rest."""
    out, prev = [], ""
    for i in range(len(ids)):
        text = tokenizer.decode(ids[: i + 1])
        if i < len(ids) - 1:  # a half-decoded character at the end: wait for the token that completes it
            text = text.rstrip("\ufffd")
        if text.startswith(prev):
            out.append(text[len(prev):])
            prev = text
        else:  # a piece that changed earlier text (a partial character completed): keep the whole
            out.append("")
    return out


class LiveRunner:
    """Loads the model once (per name) and runs one race at a time in a background thread."""

    def __init__(self, model: str, *, dtype: str | None = None, draft: str | None = None,
                 datastore: str | None = None, exit_layer: int | str = "auto", sources: str | None = None,
                 keep: int = 8):
        """Checks the settings now (SpecdecError), so that a bad one stops the server at start-up."""
        sources = sources or ("prompt-lookup,draft" if draft else "prompt-lookup,early-exit")
        from specdec.store import local_layers

        check_setup(draft=draft, sources=sources, exit_layer=exit_layer)
        check_model(model)
        if draft is not None:
            try:
                check_model(draft)
            except SpecdecError as e:
                raise SpecdecError(f"draft model: {e}") from None
        check_exit_layer(exit_layer, local_layers(model))
        if datastore is not None:
            from specdec.datastore import Datastore

            try:
                Datastore(datastore)  # memory-mapped: opening it checks the folder, its files and format
            except SpecdecError as e:
                raise SpecdecError(f"--datastore: {e}") from None
        self.model, self.dtype, self.draft, self.datastore = model, dtype, draft, datastore
        self.exit_layer = exit_layer
        self.sources = sources
        self._llm = None
        self._llm_name: str | None = None
        self._lock = threading.Lock()
        self._load_lock = threading.Lock()
        self._preload: threading.Thread | None = None
        self._ids = itertools.count(1)
        self.races: dict[int, Race] = {}
        self.keep = keep

    # --- model and methods -------------------------------------------------------------------
    def llm(self, name: str | None = None):
        """The cached LLM for `name` (default: the server's model); another model replaces it once it has
        loaded (a failed load leaves the old one in place)."""
        from specdec.api import LLM

        name = name or self.model
        with self._load_lock:
            if self._llm is None or self._llm_name != name:
                llm = LLM(name, dtype=self.dtype, draft=self.draft, datastore=self.datastore,
                          exit_layer=self.exit_layer, sources=self.sources)
                self._llm, self._llm_name = llm, name
            return self._llm

    def preload(self) -> None:
        """Load the server's model in the background, so that the first live race starts at once (a
        failure is left for that race to report)."""
        def run():
            try:
                self.llm()
            except Exception:
                pass

        self._preload = threading.Thread(target=run, name="race-preload", daemon=True)
        self._preload.start()

    def methods(self) -> list[dict]:
        """Every method the engine has (read now: new ones appear without changes here), whether this
        server can run it, and why not."""
        from specdec import drafters

        out = []
        for name in drafters.METHODS:
            ok, note = self.availability(name)
            out.append(dict(name=name, available=ok, note=note))
        return out

    def availability(self, method: str) -> tuple[bool, str]:
        if method == "plain":  # start() refuses it: listed as available, a client would be told otherwise
            return False, "the plain lane always runs first: pick a speculative method to race against it"
        if method == "draft" and not self.draft:
            return False, "needs a draft model: start `specdec race --draft NAME` (same tokenizer as the model)"
        if method == "retrieval" and not self.datastore:
            from specdec.datastore import default_dir

            if not default_dir(self.model).is_dir():
                return False, (f"needs a datastore: `specdec datastore build --model {self.model} --from sharegpt`, "
                               "or start `specdec race --datastore DIR`")
        if method == "early-exit" and self.exit_layer == "auto":
            return True, "the first use measures the best exit layer (minutes on a CPU)"
        if method == "hybrid":
            return True, f"sources: {self.sources}"
        if method in ("medusa", "eagle"):
            from specdec.errors import SpecdecError
            from specdec.training.heads import find

            try:
                return True, f"heads: {find(self.model, method)}"
            except SpecdecError as e:
                return False, str(e)
        return True, ""

    # --- races ------------------------------------------------------------------------------------
    def start(self, request: LiveRequest) -> Race:
        GenerationOptions(max_new_tokens=request.max_new_tokens, temperature=request.temperature,
                          seed=request.seed, method=request.method, k=request.k)
        check_prompt(request.prompt)
        if request.method == "plain":
            raise ValueError("pick a speculative method: the plain lane always runs first, to race against it")
        ok, note = self.availability(request.method)
        if not ok:
            raise SpecdecError(f"method {request.method!r} is not available here: {note}")
        if request.model and request.model != self.model:
            check_model(request.model)
        with self._lock:
            running = [r for r in self.races.values() if not r.finished]
            if running:
                raise Busy(f"race {running[0].id} is still running: wait for it or cancel it", running[0].id)
            race = Race(next(self._ids), request)
            self.races[race.id] = race
            for old in sorted(self.races)[:-self.keep]:
                if self.races[old].finished:
                    del self.races[old]
        race.thread = threading.Thread(target=self._run, args=(race,), name=f"race-{race.id}", daemon=True)
        race.thread.start()
        return race

    def shutdown(self, timeout: float = 10.0) -> None:
        """Cancel what runs and wait for it (a decoding thread killed at exit takes the process with it)."""
        for race in list(self.races.values()):
            race.cancel.set()
        threads = [r.thread for r in list(self.races.values())] + [self._preload]
        for thread in threads:
            if thread is not None:
                thread.join(timeout)

    def get(self, race_id: int) -> Race | None:
        return self.races.get(race_id)

    def running(self) -> Race | None:
        """The race that has not finished yet, if any (at most one runs)."""
        with self._lock:
            return next((r for r in self.races.values() if not r.finished), None)

    def loaded_dtype_key(self) -> str | None:
        """The probe-cache name of the loaded server model's dtype ("q4", "bfloat16", ...), None before it loads."""
        llm = self._llm
        if llm is None or self._llm_name != self.model:
            return None
        from specdec.probe import dtype_key

        try:
            return dtype_key(llm.model)
        except AttributeError:
            return None

    def _run(self, race: Race) -> None:
        req = race.request
        try:
            race.state, race.phase = "loading", f"loading {req.model or self.model}"
            llm = self.llm(req.model)
            if race.cancel.is_set():
                raise Cancelled()
            if req.method != "plain":
                race.phase = f"preparing {req.method}"
                llm.drafter(req.method)  # builds and caches slow drafters (early exit measures once)
            if race.cancel.is_set():
                raise Cancelled()
            race.state = "running"
            for lane in ("plain", req.method):
                race.lanes[lane] = self._lane(race, llm, lane)
            race.state, race.phase = "done", "done"
        except Cancelled:
            race.state, race.phase = "cancelled", "cancelled"
        except (SpecdecError, ValueError) as e:
            race.state, race.phase, race.error = "error", "error", str(e)
        except Exception as e:  # a bug: say so on the page rather than hang the poller
            race.state, race.phase, race.error = "error", "error", f"{type(e).__name__}: {e}"
        finally:
            race.ended = time.time()

    def _lane(self, race: Race, llm, method: str) -> LaneTrace:
        req = race.request
        race.lane, race.tokens, race.phase = method, 0, f"running {method}"
        trace = LaneTrace(method)
        t0 = time.perf_counter()
        chunks = llm.chunks(req.prompt, max_new_tokens=req.max_new_tokens, temperature=req.temperature,
                            seed=req.seed, method=method, **({} if method == "plain" else {"k": req.k}))
        try:
            for chunk in chunks:
                now = time.perf_counter() - t0
                n = len(chunk.tokens)
                trace.t.extend([round(now, 6)] * n)
                trace.kind.extend(token_kinds(n, chunk.accepted, chunk.kind))
                trace.ids.extend(chunk.tokens)
                race.tokens = len(trace.ids)
                if chunk.result is not None:
                    trace.result = {f: getattr(chunk.result, f) for f in RESULT_FIELDS}
                if race.cancel.is_set():
                    raise Cancelled()
        finally:
            close = getattr(chunks, "close", None)
            if close:
                close()
        trace.text = token_texts(llm.tokenizer, trace.ids)
        return trace


def check_model(name: str) -> None:
    """Fail fast (SpecdecError) on a model name or path that can never load; a known model that is not
    pulled yet is fine (the race pulls it on first use)."""
    from specdec.store import KNOWN_MODELS, resolve

    if name in KNOWN_MODELS or name.lower() in KNOWN_MODELS:
        return
    if name.lower().endswith(".gguf"):
        from pathlib import Path

        if not Path(name).expanduser().is_file():
            raise SpecdecError(f"no such GGUF file: {name}")
        return
    resolve(name, pull=False)
