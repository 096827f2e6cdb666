"""`--device cpu|cuda[:N]`: the checks that run everywhere. The model and its KV cache live on the device and
everything else on the host, so a CPU run exercises the same code with the moves being no-ops; the moves
themselves need a GPU (none on the CI machines: the GPU-only test skips with the reason)."""

import pytest
import torch

from specdec.cli import main
from specdec.errors import SpecdecError
from specdec.probe import dtype_key
from specdec.runtime.loader import load_transformer, matmul_path, resolve_device, resolve_dtype
from specdec.runtime.model import Transformer
from tests.tiny import save_tiny

HAS_CUDA = torch.cuda.is_available() and torch.cuda.device_count() > 0


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny("qwen2", tmp_path_factory.mktemp("device"))


def test_device_names():
    assert resolve_device(None) == torch.device("cpu")
    assert resolve_device(" CPU ") == torch.device("cpu")
    for bad in ("tpu", "cpu:1", "cuda:x", "cuda:-1", ""):
        if bad == "":
            continue  # empty means the default
        with pytest.raises(SpecdecError, match="unknown device"):
            resolve_device(bad)


@pytest.mark.skipif(HAS_CUDA, reason="this machine has a CUDA GPU")
def test_cuda_without_a_gpu_is_one_clear_line(capsys):
    with pytest.raises(SpecdecError, match="torch sees no CUDA GPU.*use --device cpu"):
        resolve_device("cuda")
    assert main(["generate", "hi", "--device", "cuda", "--max-new-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert "no CUDA GPU" in err and "Traceback" not in err


def test_quantized_formats_are_cpu_only(folder):
    assert resolve_dtype("auto", folder, "cuda") == torch.bfloat16  # auto never picks a CPU kernel on a GPU
    assert resolve_dtype("fp32", folder, "cuda") == torch.float32
    for fmt in ("q8", "q4"):
        with pytest.raises(SpecdecError, match="CPU kernels only"):
            resolve_dtype(fmt, folder, "cuda")
        with pytest.raises(SpecdecError, match="CPU kernels only"):
            load_transformer(folder, fmt, "cuda")


def test_a_gpu_curve_is_cached_apart_from_the_cpu_one(folder, monkeypatch):
    model = load_transformer(folder, torch.float32, "cpu")
    assert model.device == torch.device("cpu") and dtype_key(model) == "float32"
    monkeypatch.setattr(Transformer, "device", property(lambda self: torch.device("cuda")))
    assert dtype_key(model) == "float32@cuda"
    assert matmul_path(model) == "torch/cuda"


def test_forward_takes_and_returns_host_tensors(folder):
    """On the CPU the moves are no-ops; what the loop relies on is that outputs are host tensors."""
    model = load_transformer(folder, torch.float32, "cpu")
    cache = model.new_cache(16)
    out = model(torch.tensor([[1, 2, 3]]), cache, hidden_layers=(0, -1))
    assert out.logits.device.type == "cpu" and all(h.device.type == "cpu" for h in out.hidden.values())
    assert cache.k[0].device == model.device


@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA GPU on this machine")
def test_greedy_on_the_gpu_matches_the_cpu_in_fp32(folder):
    from specdec.api import LLM

    cpu = LLM(str(folder), dtype="fp32", device="cpu")
    gpu = LLM(str(folder), dtype="fp32", device="cuda")
    ids = [1, 2, 3, 4, 5, 1, 2, 3]
    plain = cpu.generate(ids, max_new_tokens=12).token_ids
    assert gpu.generate(ids, max_new_tokens=12).token_ids == plain  # fp32, a tiny model's clear argmaxes
    for method in ("prompt-lookup", "lookahead", "early-exit"):
        assert gpu.generate(ids, method=method, max_new_tokens=12).token_ids == plain, method
