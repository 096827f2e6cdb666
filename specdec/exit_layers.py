"""Choosing the early-exit layer L by measuring, not guessing (`specdec exit-layers` prints it).

For each candidate L: the acceptance alpha of `EarlyExit(L)` drafts (greedy, a few prompts), the
draft cost tau = t(one token through L layers + norm + head) / t(one full step) (median of
interleaved runs), the speedup the lesson's formula predicts from them, and the tokens per
second actually measured against plain decoding (runs interleaved prompt by prompt). The best L
(largest predicted speedup at the k measured, with the measured verify cost) is cached per
model and dtype under `specdec.store.home()/exit_layers/`, where `--exit-layer auto` finds it.

    alpha = accepted / reached            per-position acceptance (a draft position is reached when
                                          every earlier one was accepted): the alpha of Ch. 2
    predicted = E(alpha, k) / (verify(k+1) + k tau)     verify(k+1): measured, 1.0 = one step

Example (SmolLM2-135M, fp32, 30 layers, one thread; 2 Spec-Bench + 2 HumanEvalFix prompts x 128
tokens, k = 4): an early exit keeps the tied 49k-row LM head, a fifth of a step, so tau is well
above the lesson's L/N, and a model not trained with an early-exit loss rarely agrees with itself:

    L      4     8     11    15    19    22
    alpha  0.02  0.04  0.04  0.12  0.15  0.23
    tau    0.24  0.37  0.48  0.59  0.71  0.82       (L/N: 0.13 ... 0.73)
    pred   0.41x 0.35x 0.30x 0.29x 0.27x 0.27x      measured 0.53x 0.42x 0.36x 0.40x 0.34x 0.32x

No L wins there; the report says so, and adaptive k then keeps to plain steps.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch

from specdec.probe import dtype_key

DEFAULT_PROMPTS = (
    "Explain in a few sentences why the sky is blue.",
    "Write a Python function that checks whether a string is a palindrome, with a docstring and two examples.",
    "Summarize the plot of Romeo and Juliet in one paragraph.",
)


@dataclass
class ExitLayerRow:
    exit_layer: int
    alpha: float              # accepted / reached draft positions
    acceptance_rate: float    # accepted / drafted
    mean_accepted: float      # tokens per target forward
    tau: float                # micro-benchmark: one L-layer draft step / one full step
    tau_loop: float           # in the loop: draft seconds per drafted token / plain seconds per token
    predicted: float          # theory.speedup(alpha, k, tau): the lesson's formula, flat verify cost
    predicted_measured: float  # E(alpha, k) / (verify(k+1) + k tau) with the measured verify(k+1)
    best_k: int               # theory.best_k(alpha, tau) (flat verify cost)
    tokens_per_s: float
    speedup: float            # measured tokens/s over plain decoding's, same prompts, interleaved
    reused: int = 0           # verification forwards that reused the draft's layer-<L KV


@dataclass
class ExitLayerReport:
    model: str
    dtype: str
    num_layers: int
    k: int
    max_new_tokens: int
    prompts: int
    threads: int
    reuse: bool
    verify_cost: float        # t(forward over k+1 positions) / t(one position)
    plain_tokens_per_s: float
    rows: list[ExitLayerRow] = field(default_factory=list)
    best: int = 0

    def row(self, exit_layer: int) -> ExitLayerRow | None:
        return next((r for r in self.rows if r.exit_layer == exit_layer), None)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ExitLayerReport":
        d = dict(d)
        d["rows"] = [ExitLayerRow(**r) for r in d.get("rows", [])]
        return cls(**d)


def default_layers(num_layers: int) -> list[int]:
    """Candidate exits: 1/8, 1/4, ..., 3/4 of the depth."""
    return sorted({max(1, round(num_layers * f / 8)) for f in range(1, 7)} - {num_layers})


def measure_costs(model, layers: Sequence[int], verify_positions: int, context: int = 128,
                  repeats: int = 7) -> tuple[dict[int, float], float]:
    """({L: t(1 token, L layers + norm + head) / t(1 token, all layers)}, t(verify_positions) / t(1)):
    medians of runs interleaved across the variants, after `context` cached tokens."""
    gen = torch.Generator().manual_seed(0)
    cache = model.new_cache(context + verify_positions)
    model(torch.randint(0, model.cfg.vocab_size, (1, context), generator=gen), cache)
    variants = [("full", None, 1), ("verify", None, verify_positions)] + [(L, L, 1) for L in layers]
    times: dict = {name: [] for name, _, _ in variants}
    for rep in range(repeats + 1):  # the first round warms up
        for name, exit_layer, n in variants:
            tokens = torch.randint(0, model.cfg.vocab_size, (1, n), generator=gen)
            t0 = time.perf_counter()
            model(tokens, cache, exit_layer=exit_layer)
            dt = time.perf_counter() - t0
            cache.rewind(n)
            if rep:
                times[name].append(dt)
    full = statistics.median(times["full"])
    return {L: statistics.median(times[L]) / full for L in layers}, statistics.median(times["verify"]) / full


def _alpha(rounds: list[dict]) -> tuple[int, int, int]:
    """(accepted, drafted, reached) over speculative rounds."""
    acc = sum(r["accepted"] for r in rounds)
    drafted = sum(r["drafted"] for r in rounds)
    reached = sum(min(r["drafted"], r["accepted"] + 1) for r in rounds if r["drafted"])
    return acc, drafted, reached


def check_layers(layers, n_layers: int | None) -> list[int]:
    """The exit layers to measure, sorted: each in 1..n_layers, at least one below n_layers (ValueError); with
    n_layers None (not known before the model loads) only the lower bound is checked."""
    layers = sorted(set(layers))  # [] is an error, not the default
    top = n_layers if n_layers is not None else float("inf")
    if not layers or any(not 1 <= L <= top for L in layers) or layers[0] == top:
        span = f"1..{n_layers}, at least one below {n_layers}" if n_layers is not None else "1 or more"
        raise ValueError(f"exit layers must be in {span} (exiting after the last layer drafts with the target "
                         f"itself: a reference row, never the best), got {layers}")
    return layers


def measure_exit_layers(llm, prompts: Sequence[str | Sequence[int]] = DEFAULT_PROMPTS,
                        layers: Sequence[int] | None = None, k: int = 4, max_new_tokens: int = 64,
                        reuse: bool = True, repeats: int = 7,
                        progress: Callable[[str], None] | None = None) -> ExitLayerReport:
    """Measure alpha, tau, predicted and measured speedup of EarlyExit(L) for each L (greedy, FixedK(k)).
    `llm`: a `specdec.LLM` (model, tokenizer, name, dtype). Prompts are text (chat template when the
    model has one) or token ids."""
    from specdec import theory
    from specdec.adaptive import FixedK
    from specdec.decode import Request, decode
    from specdec.drafters.early_exit import EarlyExit

    model, tok = llm.model, llm.tokenizer
    n_layers = model.cfg.num_layers
    layers = check_layers(default_layers(n_layers) if layers is None else layers, n_layers)
    if k < 1 or max_new_tokens < 2:
        raise ValueError("k must be >= 1 and max_new_tokens >= 2")
    if not prompts:
        raise ValueError("no prompts to measure on")
    say = progress or (lambda s: None)
    say("costs: timing one draft step per exit layer against a full step")
    tau, verify_cost = measure_costs(model, layers, k + 1, repeats=repeats)
    # never below the layer fraction: timed under load, an L-layer step can read a twentieth of a full one
    tau = {L: max(t, theory.early_exit_tau(L, n_layers)) for L, t in tau.items()}
    ids = [tok.encode(p) if isinstance(p, str) else list(p) for p in prompts]
    request = Request(max_new_tokens=max_new_tokens)
    runs: dict = {name: [] for name in ["plain", *layers]}
    reused = dict.fromkeys(layers, 0)
    drafters = {L: EarlyExit(model, L, reuse=reuse) for L in layers}
    say("warm-up: one short untimed run per variant")  # the first timed run would pay for first-touch costs
    for name in ["plain", *layers]:
        drafter = None if name == "plain" else drafters[name]
        list(decode(model, tok, ids[0], Request(max_new_tokens=min(8, max_new_tokens)), drafter,
                    FixedK(k) if drafter else None))
        if drafter:
            drafter.reset()
    for i, prompt in enumerate(ids):
        order = ["plain", *layers]
        order = order[i % len(order):] + order[:i % len(order)]  # rotate: no variant always runs first
        for name in order:
            say(f"prompt {i + 1}/{len(ids)}: {'plain' if name == 'plain' else f'exit layer {name}'}")
            drafter = None if name == "plain" else drafters[name]
            before = drafter.reused if drafter else 0
            result = list(decode(model, tok, prompt, request, drafter, FixedK(k) if drafter else None))[-1].result
            runs[name].append(result)
            if drafter:
                reused[name] += drafter.reused - before
            if drafter:
                drafter.reset()  # free the draft cache between prompts
    plain = runs["plain"]
    plain_tps = sum(r.new_tokens for r in plain) / sum(r.seconds for r in plain)
    plain_step = sum(r.target_seconds for r in plain) / max(sum(r.target_forwards for r in plain), 1)
    report = ExitLayerReport(model=llm.name, dtype=dtype_key(model), num_layers=n_layers,
                             k=k, max_new_tokens=max_new_tokens, prompts=len(ids), threads=torch.get_num_threads(),
                             reuse=reuse, verify_cost=verify_cost, plain_tokens_per_s=plain_tps)
    for L in layers:
        rs = runs[L]
        rounds = [x for r in rs for x in r.rounds if x["drafted"]]
        acc, drafted, reached = _alpha(rounds)
        alpha = acc / reached if reached else 0.0
        tps = sum(r.new_tokens for r in rs) / sum(r.seconds for r in rs)
        draft_s = sum(x["draft_s"] for x in rounds)
        e = theory.expected_tokens(alpha, k)
        report.rows.append(ExitLayerRow(
            exit_layer=L, alpha=alpha, acceptance_rate=acc / drafted if drafted else 0.0,
            mean_accepted=sum(r.new_tokens for r in rs) / max(sum(r.target_forwards for r in rs), 1),
            tau=tau[L], tau_loop=(draft_s / drafted) / plain_step if drafted else 0.0,
            predicted=theory.speedup(alpha, k, tau[L]), predicted_measured=e / (verify_cost + k * tau[L]),
            best_k=theory.best_k(alpha, tau[L]), tokens_per_s=tps, speedup=tps / plain_tps, reused=reused[L]))
    report.best = best_row(report.rows, n_layers).exit_layer
    return report


def best_row(rows: Sequence[ExitLayerRow], num_layers: int) -> ExitLayerRow:
    """The row of the largest measured-verify prediction below the last layer (the whole model as its own draft is
    a reference row), the shallower layer of a tie (the cheaper draft)."""
    return max((r for r in rows if r.exit_layer < num_layers), key=lambda r: (r.predicted_measured, -r.exit_layer))


# --- the cache behind `--exit-layer auto` ---------------------------------------------------------------


def save(report: ExitLayerReport) -> Path:
    from specdec.store import measurement_path, write_json

    return write_json(measurement_path("exit_layers", report.model, report.dtype), report.to_dict())


def load_cached(name: str, dtype: str) -> ExitLayerReport | None:
    from specdec.store import measurement_path

    path = measurement_path("exit_layers", name, dtype)
    if not path.exists():
        return None
    try:
        return ExitLayerReport.from_dict(json.loads(path.read_text()))
    except (ValueError, TypeError, KeyError):
        return None  # an older or damaged file: measure again


def cached_report(llm) -> ExitLayerReport | None:
    return load_cached(llm.name, dtype_key(llm.model))


def best_exit_layer(llm, measure: bool = True, progress: Callable[[str], None] | None = None,
                    **kwargs) -> tuple[int, ExitLayerReport]:
    """The measured best exit layer for this model and dtype, and the report it comes from: the cached
    measurement, else (measure=True) a quick one (the default prompts; kwargs go to measure_exit_layers),
    saved for next time."""
    report = cached_report(llm)
    if report is None:
        if not measure:
            raise LookupError(f"no exit-layer measurement cached for {llm.name}: run `specdec exit-layers "
                              f"--model {llm.name}`")
        kwargs.setdefault("max_new_tokens", 48)
        report = measure_exit_layers(llm, progress=progress, **kwargs)
        save(report)
    return report.best, report
