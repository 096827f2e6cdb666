"""The budget probe: the lesson's Chapter 0 measured on the machine at hand.

A decode step is memory-bound: reading the weights dominates, so a forward over n new
positions costs about the same as over one until compute catches up. The probe times one
forward over n = 1, 2, 4, ..., 64 positions after a 256-token context (median of several
runs) and reports

- the cost curve, `relative[n] = t(n) / t(1)` (what adaptive k and the scheduler consume),
- the budget: the largest n whose cost is within 10% of n = 1 (the lesson's 156 on an H100),
- the step time against the bandwidth bound: weight bytes read per step / measured bandwidth.

Example (illustrative): t(1) = 40 ms, t(8) = 43 ms, t(16) = 52 ms -> budget 8.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from specdec.runtime.model import Transformer

SIZES = (1, 2, 3, 4, 6, 8, 16, 32, 64)


@dataclass
class ProbeResult:
    model: str
    dtype: str
    context: int
    seconds: dict[int, float]    # n -> median seconds of one forward over n new positions
    relative: dict[int, float]   # n -> seconds[n] / seconds[1]
    budget: int                  # largest n with relative[n] <= 1 + tolerance
    weight_bytes: int            # bytes of weights read by one decode step
    bandwidth_gbs: float         # measured memory bandwidth, GB/s
    bound_seconds: float         # weight_bytes / bandwidth: the memory-bound step time
    threads: int

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ProbeResult":
        d = dict(d)
        d["seconds"] = {int(k): v for k, v in d["seconds"].items()}
        d["relative"] = {int(k): v for k, v in d["relative"].items()}
        return cls(**d)


def weight_bytes_per_step(model: Transformer) -> int:
    """Bytes a one-token step reads: every weight once, except the embedding table (one row is gathered);
    a tied LM head reads the table in full, so it counts once either way. Quantized projections (q8/q4)
    count their packed bytes, and their LM head is a copy of its own: the table is then never read in full."""
    from specdec.runtime.model import QLinear

    total = sum(p.numel() * p.element_size() for p in model.parameters())  # tied weights listed once
    quantized = [m for m in model.modules() if isinstance(m, QLinear)]
    total += sum(p.nbytes for m in quantized for p in m.parts)
    if quantized or model.lm_head.weight is not model.embed.weight:
        total -= model.embed.weight.numel() * model.embed.weight.element_size()
    return total


def measure_bandwidth(megabytes: int = 512, repeats: int = 5) -> float:
    """Read bandwidth in GB/s: the median time to sum a buffer much larger than the CPU caches."""
    x = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32)
    x.sum()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    return x.numel() * 4 / statistics.median(times) / 1e9


def probe(model: Transformer, name: str = "", context: int = 256, sizes=SIZES, repeats: int = 5,
          tolerance: float = 0.10, progress=None) -> ProbeResult:
    cache = model.new_cache(context + max(sizes))
    gen = torch.Generator().manual_seed(0)
    model(torch.randint(0, model.cfg.vocab_size, (1, context), generator=gen), cache)
    seconds = {}
    for n in sizes:
        tokens = torch.randint(0, model.cfg.vocab_size, (1, n), generator=gen)
        times = []
        for i in range(repeats + 1):  # the first run warms up
            t0 = time.perf_counter()
            model(tokens, cache)
            dt = time.perf_counter() - t0
            cache.rewind(n)
            if i:
                times.append(dt)
        seconds[n] = statistics.median(times)
        if progress:
            progress(n)
    relative = {n: s / seconds[sizes[0]] for n, s in seconds.items()}
    budget = max(n for n in sizes if relative[n] <= 1 + tolerance)
    wbytes = weight_bytes_per_step(model)
    bw = measure_bandwidth()
    return ProbeResult(model=name, dtype=str(model.dtype).replace("torch.", ""), context=context, seconds=seconds,
                       relative=relative, budget=budget, weight_bytes=wbytes, bandwidth_gbs=bw,
                       bound_seconds=wbytes / (bw * 1e9), threads=torch.get_num_threads())


def save(result: ProbeResult) -> Path:
    from specdec.store import measurement_path, write_json

    return write_json(measurement_path("probe", result.model, result.dtype), result.to_dict())


def load_cached(name: str, dtype: str) -> ProbeResult | None:
    from specdec.store import measurement_path

    path = measurement_path("probe", name, dtype)
    return ProbeResult.from_dict(json.loads(path.read_text())) if path.exists() else None
