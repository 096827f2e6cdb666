"""The budget probe: the lesson's Chapter 0 measured on the machine at hand.

A decode step is memory-bound: reading the weights dominates, so a forward over n new
positions costs about the same as over one until compute catches up. The probe times one
forward over n = 1, 2, 4, ..., 64 positions after a 256-token context, in several sweeps over all sizes,
and reports

- the cost curve, `relative[n]`: the median over sweeps of t(n) / t(1) within a sweep (what adaptive k and
  the scheduler consume; a machine whose memory bandwidth flips for minutes at a time then slows a whole
  sweep, not one size: measured size by size, a slow minute once put t(1) above t(2)),
- the budget: the largest n whose cost is within 10% of n = 1 (the lesson's 156 on an H100),
- the step time against the bandwidth bound: weight bytes read per step / measured bandwidth.

Example (illustrative): t(1) = 40 ms, t(8) = 43 ms, t(16) = 52 ms -> budget 8.

It also times a prefill (prompt tokens per second, one `prefill_spans` chunk of `context` tokens) and
records what chose the figures: the CPU's model name and matmul flags, the threads, and the matmul path
the loaded model runs on (`loader.matmul_path`). `probe_paths` measures the same curve on every other
path this CPU has for the model's dtype (bf16: "amx", "avx512bf16", "avx2", "torch"), so one run shows what
each path allows; the runtime keeps the one path it chose for every forward (exactness needs it).

A cached probe steers adaptive k and lookahead's configuration, so a stale one is not trusted
(`problem`): it is measured again when the kernel's source or the CPU (model name, flags) changed
since (`machine_key`), when the machine was busy (other processes used more than LOAD_LIMIT of the
CPUs while it measured: `OtherLoad`, from /proc/stat less this process's own CPU time, so the probe's
own threads do not count against it), or when
the curve is implausible: a forward over more positions cannot be much cheaper than over fewer
(t(2) = 0.027 s against t(1) = 0.054 s was measured under load). `probe` itself retries an
implausible curve; `CostCurve.from_probe` ignores one.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from unittest import mock

import torch

from specdec.runtime import kernels
from specdec.runtime.model import Transformer

SIZES = (1, 2, 3, 4, 6, 8, 16, 32, 64)
NOISE = 0.2        # t(n) may read up to 20% below t(m) for m < n (timing noise); more is implausible
LOAD_LIMIT = 0.25  # share of the CPUs busy with other work above which a probe is taken again
ATTEMPTS = 3       # measurements `probe` makes before keeping an implausible curve


FORCING = ("SPECDEC_KERNEL", "SPECDEC_MATMUL", "SPECDEC_QKERNEL")  # the variables that force a matmul path


def machine_key() -> str:
    """What a probe's timings depend on beyond the model: the kernels' sources, the CPU's model name
    and flags (/proc/cpuinfo), and the variables that force a matmul path (FORCING). A cached probe with
    another key is measured again."""
    h = hashlib.sha256()
    folder = Path(kernels.__file__).parent
    for f in sorted(folder.iterdir()):
        if f.suffix in (".c", ".h", ".py"):
            h.update(f.name.encode() + f.read_bytes())
    try:
        cpu = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
    except OSError:
        cpu = ""
    h.update("".join(line for line in cpu.splitlines(True) if line.startswith(("model name", "flags"))).encode())
    for var in FORCING:  # a path forced for a measurement is another machine as far as the curve goes
        h.update(f"{var}={os.environ.get(var, '')};".encode())
    return h.hexdigest()[:16]


def _busy_seconds() -> float | None:
    """CPU seconds all processes have spent busy since boot (/proc/stat; None where it cannot be read)."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


class OtherLoad:
    """The share of the machine's CPUs that *other* processes kept busy between `__init__` and `share()`:
    (all busy CPU time - this process's CPU time) / (wall time x CPUs), 0 where /proc/stat is missing.
    Example: 2 CPUs, 10 s, 20 busy CPU-seconds of which the probe used 19 -> 0.05 (quiet)."""

    def __init__(self):
        self.wall, self.busy, self.own = time.perf_counter(), _busy_seconds(), sum(os.times()[:2])

    def share(self) -> float:
        busy = _busy_seconds()
        if busy is None or self.busy is None:
            return 0.0
        wall = (time.perf_counter() - self.wall) * (os.cpu_count() or 1)
        other = (busy - self.busy) - (sum(os.times()[:2]) - self.own)
        return max(0.0, other / wall) if wall > 0 else 0.0


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
    machine: str = field(default_factory=machine_key)  # `machine_key()` when measured
    load: float = 0.0            # share of the CPUs other processes kept busy while measuring (OtherLoad)
    matmul: str = ""             # the matmul path the model ran on (`loader.matmul_path`)
    prefill_tokens_per_s: float = 0.0  # one prompt chunk of `context` tokens, fed in one forward (`prefill`)
    prefill_path: str = ""       # the path prompt rows took (`loader.prefill_path`; "" in probes cached before it)
    attention: str = ""          # attention's path and KV-cache dtype (`loader.attention_path`; "" in older probes)
    cpu: str = ""                # the CPU's model name
    cpu_flags: list[str] = field(default_factory=list)  # its flags that choose matmul paths
    gpu: str = ""                # the GPU's name when the model ran on one (`--device cuda`)
    paths: dict[str, dict] = field(default_factory=dict)  # other paths (`probe_paths`): seconds, budget, prefill

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ProbeResult":
        d = dict(d)
        d["seconds"] = {int(k): v for k, v in d["seconds"].items()}
        d["relative"] = {int(k): v for k, v in d["relative"].items()}
        for other in d.get("paths", {}).values():
            for key in ("seconds", "relative"):
                if key in other:
                    other[key] = {int(k): v for k, v in other[key].items()}
        d.setdefault("machine", "")  # probes cached before the key existed: measured again
        return cls(**d)

    def implausible(self) -> str | None:
        """Why the curve cannot be right (None when it can): some t(n) under (1 - NOISE) x t(m), m < n."""
        slowest = (0, 0.0)
        for n in sorted(self.seconds):
            if self.seconds[n] < (1 - NOISE) * slowest[1]:
                return (f"t({n}) = {self.seconds[n]:.4g} s < {1 - NOISE:g} x t({slowest[0]}) = "
                        f"{slowest[1]:.4g} s: a forward over more positions cannot cost much less")
            slowest = max(slowest, (n, self.seconds[n]), key=lambda x: x[1])
        return None

    def problem(self) -> str | None:
        """Why this probe should not be trusted (None when it can): another kernel or CPU, measured
        under load, or an implausible curve."""
        if self.machine != machine_key():
            return "measured with another kernel or CPU"
        if self.load > LOAD_LIMIT:
            return f"measured while other work used {self.load:.0%} of the CPUs (over {LOAD_LIMIT:.0%})"
        return self.implausible()


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


def measure_bandwidth(megabytes: int = 512, repeats: int = 5, device: torch.device | str = "cpu") -> float:
    """Read bandwidth in GB/s of `device`'s memory: the median time to sum a buffer much larger than its caches
    (the CPU's, or a GPU's L2)."""
    x = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32, device=device)
    times = []
    for i in range(repeats + 1):  # the first warms up
        t0 = time.perf_counter()
        float(x.sum())  # the host waits for the result, on a GPU too
        if i:
            times.append(time.perf_counter() - t0)
    return x.numel() * 4 / statistics.median(times) / 1e9


def probe(model: Transformer, name: str = "", context: int = 256, sizes=SIZES, repeats: int = 5,
          tolerance: float = 0.10, progress=None, attempts: int = ATTEMPTS) -> ProbeResult:
    """Measure the curve (`measure`), again up to `attempts` times while it is implausible; the other
    processes' CPU share is recorded with it."""
    for _ in range(attempts):
        result = measure(model, name, context, sizes, repeats, tolerance, progress)
        if result.implausible() is None:
            break
    return result


def dtype_key(model: Transformer) -> str:
    """The name a model's probe is cached under beside its own: its dtype ("bf16", "q4"), with a KV-cache dtype
    chosen by hand ("q4+kv-float32": `--kv-dtype`) and the device when that is not the CPU ("bf16@cuda"), so a
    GPU's curve never stands in for a CPU's."""
    name = str(model.dtype).replace("torch.", "")
    if model.kv_choice is not None:
        name += "+kv-" + str(model.kv_choice).replace("torch.", "")
    return name if model.device.type == "cpu" else f"{name}@{model.device.type}"


def sweep_curve(times: dict[int, list[float]]) -> dict[int, float]:
    """The cost curve from sweeps over the sizes: each size's time over the smallest size's in the same sweep,
    the median over sweeps. Example: sweeps (t(1), t(2)) = (1, 1.1), (3, 3.3), (1, 1.1) -> {1: 1.0, 2: 1.1},
    where the medians of the raw times alone would give t(1) = 1 against t(2) = 1.1 only by luck."""
    one = times[min(times)]
    return {n: statistics.median(a / b for a, b in zip(t, one)) for n, t in times.items()}


def measure(model: Transformer, name: str = "", context: int = 256, sizes=SIZES, repeats: int = 5,
            tolerance: float = 0.10, progress=None) -> ProbeResult:
    from specdec.bench.report import cpu_flags, cpu_model
    from specdec.runtime.loader import attention_path, matmul_path, prefill_path

    load = OtherLoad()
    cache = model.new_cache(context + max(sizes))
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.cfg.vocab_size, (context,), generator=gen).tolist()
    model.prefill(prompt, cache)  # warms up; the second prefill is timed
    cache.rewind(context)
    wait(model.device)
    t0 = time.perf_counter()
    model.prefill(prompt, cache)
    wait(model.device)
    prefill = context / (time.perf_counter() - t0)
    tokens = {n: torch.randint(0, model.cfg.vocab_size, (1, n), generator=gen) for n in sizes}
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for i in range(repeats + 1):  # sweeps over every size (the first warms up): a slow minute hits them all
        for n in sizes:
            t0 = time.perf_counter()
            model(tokens[n], cache)
            wait(model.device)
            dt = time.perf_counter() - t0
            cache.rewind(n)
            if i:
                times[n].append(dt)
            if progress:
                progress(n)
    seconds = {n: statistics.median(t) for n, t in times.items()}
    relative = sweep_curve(times)
    budget = max(n for n in sizes if relative[n] <= 1 + tolerance)
    wbytes = weight_bytes_per_step(model)
    bw = measure_bandwidth(device=model.device)
    return ProbeResult(model=name, dtype=dtype_key(model), context=context, seconds=seconds,
                       relative=relative, budget=budget, weight_bytes=wbytes, bandwidth_gbs=bw,
                       bound_seconds=wbytes / (bw * 1e9), threads=torch.get_num_threads(),
                       load=load.share(), matmul=matmul_path(model), prefill_tokens_per_s=prefill,
                       prefill_path=prefill_path(model), attention=attention_path(model),
                       cpu=cpu_model(), cpu_flags=cpu_flags(), gpu=gpu_name(model.device))


def wait(device: torch.device) -> None:
    """Wait for the work queued on a GPU, so a timing counts it: a forward returns once its kernels are queued
    (a CUDA graph's replay is one launch), and an unsynchronized t(n) would time the host and part of n - 1's
    work (session 32's H200 probe read t(2) = 2.26 t(1) where the step alone was 1.25)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gpu_name(device: torch.device) -> str:
    """The GPU's name for a model on one ("NVIDIA H200"), else ""."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else ""


def other_paths(model: Transformer) -> list[str]:
    """The matmul paths other than the model's own that `probe_paths` measures: for a bf16 model on the CPU, the
    kernel's ISAs this CPU runs and torch; none for other dtypes or a model on a GPU."""
    from specdec.runtime import kernels
    from specdec.runtime.loader import matmul_path

    mine = matmul_path(model)
    if model.dtype != torch.bfloat16 or model.device.type != "cpu":
        return []
    return [p for p in kernels.PATHS if p != mine and (p == "torch" or not kernels.unavailable(p))]


def probe_paths(model: Transformer, folder, name: str = "", repeats: int = 5, progress=None) -> dict[str, dict]:
    """The curve (seconds per n, budget, prefill tokens/s) on every other matmul path this CPU has for a bf16
    model, each on a copy loaded for that path (`SPECDEC_MATMUL`: a path may lay the weights out its own
    way). {} for other dtypes. Example on a Zen 5: a model on "avx512bf16" gets "avx2" and "torch"."""
    from specdec.runtime.loader import load_transformer

    curves = {}
    for path in other_paths(model):
        with mock.patch.dict(os.environ, SPECDEC_MATMUL=path):
            other = load_transformer(folder, torch.bfloat16)
        r = probe(other, name, repeats=repeats, progress=progress)
        del other
        curves[path] = dict(seconds=r.seconds, relative=r.relative, budget=r.budget,
                            prefill_tokens_per_s=r.prefill_tokens_per_s, load=r.load)
    return curves


def save(result: ProbeResult) -> Path:
    from specdec.store import measurement_path, write_json

    return write_json(measurement_path("probe", result.model, result.dtype), result.to_dict())


def load_cached(name: str, dtype: str) -> ProbeResult | None:
    """The cached probe for this model and dtype, or None when there is none or it is not to be trusted
    (`ProbeResult.problem`): the caller probes again."""
    from specdec.store import measurement_path

    path = measurement_path("probe", name, dtype)
    if not path.exists():
        return None
    try:
        result = ProbeResult.from_dict(json.loads(path.read_text()))
    except (ValueError, TypeError, KeyError, AttributeError):
        return None  # a damaged or older file: probe again
    return None if result.problem() else result
