"""A cached probe is trusted only when it can be right: same kernel sources and CPU, measured on a quiet
machine, and a plausible curve (issue 15, item 19: a cached t(2) = 0.027 s against t(1) = 0.054 s steered
adaptive k and lookahead)."""

import json
import os
import subprocess
import sys
import shutil
import time

import pytest
import torch

from specdec import probe as probe_mod
from specdec.adaptive import CostCurve
from specdec.probe import ProbeResult, load_cached, machine_key, save
from specdec.runtime import kernels
from specdec.runtime.loader import load_transformer
from specdec.store import measurement_path


def result(seconds, **kw):
    relative = {n: s / seconds[1] for n, s in seconds.items()}
    return ProbeResult(model="m", dtype="float32", context=256, seconds=seconds, relative=relative, budget=2,
                       weight_bytes=1, bandwidth_gbs=1.0, bound_seconds=0.01, threads=2, **kw)


GOOD = {1: 0.054, 2: 0.055, 4: 0.06, 8: 0.07}
OUTER_HOME = os.environ.get("SPECDEC_HOME")  # before the autouse `home` below replaces it


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    monkeypatch.setattr(probe_mod.OtherLoad, "share", lambda self: 0.01)


def test_a_plausible_quiet_probe_is_reused():
    save(result(GOOD))
    cached = load_cached("m", "float32")
    assert cached is not None and cached.problem() is None and CostCurve.from_probe(cached)(8) == pytest.approx(0.07 / 0.054)


@pytest.mark.parametrize("seconds, why", [({1: 0.054, 2: 0.027}, "t(2)"), ({1: 0.05, 2: 0.06, 8: 0.04}, "t(8)")])
def test_an_implausible_curve_is_measured_again_and_not_used(seconds, why):
    bad = result(seconds)
    assert why in bad.implausible() and CostCurve.from_probe(bad).points == CostCurve().points
    save(bad)
    assert load_cached("m", "float32") is None
    assert result({1: 0.054, 2: 0.05, 4: 0.06}).implausible() is None  # within noise


def test_a_probe_under_load_is_measured_again():
    save(result(GOOD, load=0.6))
    assert load_cached("m", "float32") is None


def test_other_load_counts_other_processes_not_this_one(monkeypatch):
    monkeypatch.undo()  # the real measurement
    if probe_mod._busy_seconds() is None:
        pytest.skip("no /proc/stat")
    mine = probe_mod.OtherLoad()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 0.6:  # this process busy: not other work
        pass
    mine = mine.share()
    others = probe_mod.OtherLoad()
    spin = [subprocess.Popen([sys.executable, "-c", "import time\nt=time.time()\nwhile time.time()-t<0.8: pass"])
            for _ in range(os.cpu_count() or 1)]
    for p in spin:
        p.wait()
    assert others.share() > mine + 0.3  # every CPU busy with other processes, against this one busy


def test_another_kernel_or_cpu_or_an_old_file_is_measured_again(tmp_path, monkeypatch):
    save(result(GOOD, machine="another machine"))
    assert load_cached("m", "float32") is None
    path = save(result(GOOD))
    d = json.loads(path.read_text())
    del d["machine"]  # cached before the key existed
    path.write_text(json.dumps(d))
    assert load_cached("m", "float32") is None
    copy = shutil.copytree(kernels.SOURCE.parent, tmp_path / "kernels")
    before = machine_key()
    monkeypatch.setattr(kernels, "__file__", str(copy / "__init__.py"))
    assert machine_key() == before
    (copy / "skinny.c").write_text((copy / "skinny.c").read_text() + "\n/* v3 */\n")
    assert machine_key() != before
    changed = machine_key()
    monkeypatch.setenv("SPECDEC_MATMUL", "avx2")  # a forced path: another curve
    assert machine_key() != changed


def test_probe_records_the_load_and_retries_an_implausible_curve(tiny_folder, monkeypatch):
    model = load_transformer(tiny_folder, torch.float32)
    monkeypatch.setattr(probe_mod.OtherLoad, "share", lambda self: 0.7)
    busy = probe_mod.probe(model, "m", context=8, sizes=(1, 2), repeats=1)
    assert busy.load == 0.7 and "other work used 70%" in busy.problem()
    made = iter([result({1: 0.054, 2: 0.027}), result(GOOD)])
    monkeypatch.setattr(probe_mod, "measure", lambda *a, **k: next(made))
    assert probe_mod.probe(model, "m").seconds == GOOD
    assert measurement_path("probe", "m", "float32").parent.exists() is False  # probing does not save


def test_a_probe_measures_the_models_own_device(tiny_folder, monkeypatch):
    """The bandwidth of the model's device's memory, one timed sum after the warm-up being enough; a model on a
    GPU has no CPU matmul paths to compare and is named by its GPU."""
    from types import SimpleNamespace

    assert probe_mod.measure_bandwidth(megabytes=1, repeats=1) > 0
    model = load_transformer(tiny_folder, torch.float32)
    seen = []
    monkeypatch.setattr(probe_mod, "measure_bandwidth", lambda *a, **k: seen.append(k.get("device")) or 1.0)
    assert probe_mod.measure(model, "m", context=8, sizes=(1, 2), repeats=1).gpu == ""
    assert seen == [model.device]
    gpu = SimpleNamespace(quantized=None, dtype=torch.bfloat16, device=torch.device("cuda", 0))
    assert probe_mod.other_paths(gpu) == []
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H200")
    assert probe_mod.gpu_name(gpu.device) == "NVIDIA H200" and probe_mod.gpu_name(model.device) == ""


def test_probe_paths_runs_each_path_on_a_copy_loaded_for_it(tmp_path, monkeypatch):
    """Measuring the kernel's other ISA loads the model for that path (the AVX512-BF16 path lays the weights out
    its own way), fused layers included (they once kept the model's own path: the avx2 column was avx512);
    the model itself keeps its path."""
    from tests.tiny import save_tiny

    if kernels.unavailable("avx512bf16") or kernels.unavailable("avx2"):
        pytest.skip("needs both bf16 kernel paths")
    monkeypatch.setenv("SPECDEC_MATMUL", "avx512bf16")
    folder = save_tiny("qwen2", tmp_path)
    model = load_transformer(folder, torch.bfloat16)
    assert model.fused_layers.isas[1] == kernels.PATHS["avx512bf16"][0]
    seen = []
    monkeypatch.setattr(probe_mod, "other_paths", lambda m: ["avx2"])
    monkeypatch.setattr(probe_mod, "probe", lambda m, *a, **k: seen.append(m.fused_layers.isas[1]) or result(GOOD))
    assert list(probe_mod.probe_paths(model, folder)) == ["avx2"]
    assert seen == [kernels.PATHS["avx2"][0]] and model.fused_layers.isas[1] == kernels.PATHS["avx512bf16"][0]


def test_the_curve_is_the_median_of_each_sweeps_ratios():
    """A slow minute slows a whole sweep: t(n) / t(1) within each sweep keeps the curve, where the medians of
    the raw times put t(1) above t(2) when the slow sweeps are t(1)'s."""
    times = {1: [1.0, 3.0, 3.0, 1.0], 2: [1.1, 3.3, 1.1, 1.1], 4: [1.5, 4.5, 4.5, 1.5]}
    assert probe_mod.sweep_curve(times) == {1: 1.0, 2: pytest.approx(1.1), 4: pytest.approx(1.5)}
    raw = {n: sorted(t)[1:3] for n, t in times.items()}  # the raw medians' middle pair
    assert sum(raw[2]) / 2 < sum(raw[1]) / 2  # what measuring size by size risked


def test_a_gpu_probe_times_the_queued_work_not_only_its_launch(tiny_folder, monkeypatch):
    """On a GPU a forward returns once its kernels are queued; the probe waits for them inside each timing.
    Here the 'GPU' runs n positions in 20 ms x n, done only when the host synchronizes: the curve must say so
    (without the wait every t(n) reads as the host's launch time, and t(2) could even take t(1)'s work)."""
    model = load_transformer(tiny_folder, torch.float32)
    queued = []

    class OnGPU:
        device = torch.device("cuda", 0)

        def __getattr__(self, name):
            return getattr(model, name)

        def __call__(self, tokens, cache):
            queued.append(tokens.shape[1])
            return model(tokens, cache)

        def prefill(self, prompt, cache):
            queued.append(1)
            return model.prefill(prompt, cache)

    def synchronize(device):
        time.sleep(0.02 * sum(queued))
        queued.clear()

    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "a GPU")
    monkeypatch.setattr(probe_mod, "measure_bandwidth", lambda *a, **k: 1.0)
    r = probe_mod.measure(OnGPU(), "m", context=8, sizes=(1, 2, 4), repeats=2)
    assert r.gpu == "a GPU"
    assert 1.7 < r.relative[2] < 2.3 and 3.4 < r.relative[4] < 4.6, r.relative
    assert r.budget == 1


# --- mutation audit: the probe's figures pinned with hand-worked numbers -----------------------------------
def test_budget_is_the_largest_n_within_ten_percent_and_the_sweeps_time_after_the_warm_up(tiny_folder, monkeypatch):
    """budget = the largest n with relative[n] <= 1.1 (1.1 itself in; past a bump too); the warm-up sweep is not
    timed; seconds are medians; prefill tokens/s and the bandwidth bound are the right way up."""
    model = load_transformer(tiny_folder, torch.float32)
    calls = []

    class Slow:  # n = 1's warm-up and first timed forward take 0.2 s more
        device = model.device

        def __getattr__(self, name):
            return getattr(model, name)

        def __call__(self, tokens, cache):
            calls.append(tokens.shape[1])
            if tokens.shape[1] == 1 and calls.count(1) <= 2:
                time.sleep(0.2)
            return model(tokens, cache)

    seen = []
    curves = iter([{1: 1.0, 2: 1.05, 4: 1.1, 8: 1.5}, {1: 1.0, 2: 1.3, 4: 1.05, 8: 1.5}])
    monkeypatch.setattr(probe_mod, "sweep_curve", lambda times: seen.append(times) or next(curves))
    monkeypatch.setattr(probe_mod, "measure_bandwidth", lambda *a, **k: 2.0)
    r = probe_mod.measure(Slow(), "m", context=8, sizes=(1, 2, 4, 8), repeats=3)
    assert r.budget == 4 and all(len(t) == 3 for t in seen[0].values())
    assert r.seconds[1] < 0.05 and r.prefill_tokens_per_s > 1  # median of (0.2 s, x, x): the mean would be over 0.067
    assert r.bound_seconds == pytest.approx(r.weight_bytes / 2e9)
    assert probe_mod.measure(model, "m", context=8, sizes=(1, 2, 4, 8), repeats=1).budget == 4


def test_implausible_against_the_slowest_smaller_size_and_load_at_the_limit():
    """t(8) is held against the slowest t(m) before it, not the one just before; a load of exactly LOAD_LIMIT is
    trusted ("more than LOAD_LIMIT" is measured again)."""
    assert "t(8)" in result({1: 0.05, 2: 0.06, 4: 0.05, 8: 0.045}).implausible()
    assert result(GOOD, load=probe_mod.LOAD_LIMIT).problem() is None


def test_machine_key_follows_the_cpus_flags(monkeypatch):
    """The CPU's flags line is in the key (another ISA, another curve); other cpuinfo lines are not."""
    from pathlib import Path

    real = Path.read_text
    cpu = ["processor\t: 0\nmodel name\t: X\ncpu MHz\t: 1000\nflags\t\t: avx2 fma\n"]
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: cpu[0] if str(self) == "/proc/cpuinfo" else real(self, *a, **k))
    before = machine_key()
    cpu[0] = cpu[0].replace("1000", "2000")
    assert machine_key() == before
    cpu[0] = cpu[0].replace("fma", "fma avx512f")
    assert machine_key() != before


def test_weight_bytes_per_step_by_hand(tmp_path, monkeypatch):
    """Tiny model (vocab 96, hidden 64, mlp 128, 3 layers, 2 of 4 heads for k/v): 116,736 projection weights (the
    96 x 64 head among them), 448 norm weights; the embedding table is never read in full (tied: it is the head);
    q8/q4 count their packed bytes (1 / 0.5 byte a weight, an fp16 scale (and min) per 32)."""
    from tests.tiny import save_tiny

    if OUTER_HOME:  # q8/q4 run the kernels: the home other test files build them in (a fresh one compiles: seconds)
        monkeypatch.setenv("SPECDEC_HOME", OUTER_HOME)
    llama, qwen = save_tiny("llama", tmp_path / "l"), save_tiny("qwen2", tmp_path / "q")
    wb = lambda folder, dtype: probe_mod.weight_bytes_per_step(load_transformer(folder, dtype))  # noqa: E731
    assert wb(llama, torch.float32) == (116_736 + 448) * 4                # untied: the head, not the table
    assert wb(qwen, torch.float32) == (116_736 + 448 + 3 * 128) * 4       # tied: the table once, as the head (+ qkv biases)
    assert wb(llama, "q8") == 116_736 * (1 + 2 / 32) + 448 * 4
    assert wb(llama, "q4") == 116_736 * (0.5 + 4 / 32) + 448 * 4
