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
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")
    with pytest.raises(SpecdecError, match="unknown device 0"):  # torch reads 0 as cuda:0: it loaded on the CPU
        resolve_device(0)
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


def test_probe_takes_the_device_flag(folder, capsys):
    assert main(["probe", "--model", str(folder), "--device", "tpu"]) == 2
    assert "unknown device 'tpu'" in capsys.readouterr().err


def test_probe_loads_the_model_on_its_device(folder, monkeypatch):
    """`probe --device cuda` measures the model there: loaded on the GPU, in bf16 by default."""
    from specdec.runtime import loader

    seen = []
    monkeypatch.setattr(loader, "resolve_device", lambda name: torch.device("cuda", 0))  # as with a GPU

    def load(folder, dtype, device="cpu", kv_dtype="auto"):
        seen.append((dtype, torch.device(device)))
        raise SpecdecError("stop before loading")

    monkeypatch.setattr(loader, "load_transformer", load)
    assert main(["probe", "--model", str(folder), "--device", "cuda"]) == 2
    assert seen == [(torch.bfloat16, torch.device("cuda", 0))]


def save_heads(folder, out):
    """Random Medusa heads and a random EAGLE-3 head for the tiny target in `folder`, saved where `--heads` reads
    them: {"medusa": dir, "eagle": dir}."""
    from specdec.drafters.eagle_head import EagleConfig, EagleHead
    from specdec.training import heads

    target = load_transformer(folder)
    d, v, k = target.cfg.hidden_size, target.cfg.vocab_size, 3
    g = torch.Generator().manual_seed(0)
    tensors = {"weight": torch.randn(k, d, d, generator=g) * 0.05, "bias": torch.randn(k, d, generator=g) * 0.3,
               "vocab": torch.arange(v)}
    heads.save(out / "medusa", tensors, {"kind": "medusa", "target": {"name": str(folder), "fingerprint":
               heads.fingerprint(folder)}, "heads": k, "hidden_size": d,
               "val_accuracy": {"after_hits": [[0.5, 0.2, 0.1]] * k}})
    torch.manual_seed(0)
    head = EagleHead(EagleConfig.for_target(target.cfg, str(folder), heads.fingerprint(folder), draft_vocab_size=64))
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.copy_(torch.empty_like(p).uniform_(0.8, 1.2) if "norm" in name else torch.randn_like(p) * 0.2)
    head.set_vocab(torch.randperm(v)[:64])
    head.save(out / "eagle")
    return {"medusa": out / "medusa", "eagle": out / "eagle"}


@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA GPU on this machine")
def test_every_method_on_the_gpu_matches_the_cpu_in_fp32(folder, tmp_path):
    """Every drafter with the target on the GPU (Medusa's and EAGLE's heads on the host, fed host copies of the
    LM-head rows and the embedding): greedy tokens equal plain decoding's on the CPU (fp32, a tiny model's clear
    argmaxes)."""
    from specdec.api import LLM

    draft = save_tiny("qwen2", tmp_path / "draft", seed=1)
    heads = save_heads(folder, tmp_path)
    cpu = LLM(str(folder), dtype="fp32", device="cpu")
    ids = [1, 2, 3, 4, 5, 1, 2, 3]
    plain = cpu.generate(ids, max_new_tokens=12).token_ids
    gpu = LLM(str(folder), dtype="fp32", device="cuda", draft=str(draft), sources="prompt-lookup,draft")
    assert gpu.generate(ids, max_new_tokens=12).token_ids == plain
    for method in ("prompt-lookup", "lookahead", "early-exit", "recycling", "draft", "hybrid"):
        assert gpu.generate(ids, method=method, max_new_tokens=12).token_ids == plain, method
    for method, where in heads.items():
        for tree in ("chain", "auto"):
            llm = LLM(str(folder), dtype="fp32", device="cuda", heads=str(where), tree=tree)
            assert llm.generate(ids, method=method, max_new_tokens=12).token_ids == plain, (method, tree)
    bf16 = LLM(str(folder), dtype="bf16", device="cuda", heads=str(heads["eagle"]))
    assert len(bf16.generate(ids, method="eagle", max_new_tokens=12).token_ids) == 12  # runs; bits may differ


@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA GPU on this machine")
def test_probe_and_bench_on_the_gpu(folder, tmp_path, capsys):
    import json

    assert main(["probe", "--model", str(folder), "--dtype", "fp32", "--device", "cuda", "--repeats", "1",
                 "--json"]) == 0
    probe = json.loads(capsys.readouterr().out)
    assert probe["dtype"] == "float32@cuda" and probe["matmul"] == "torch/cuda" and probe["gpu"]
    assert probe["paths"] == {} and probe["bandwidth_gbs"] > 0
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "category": "chat", "turns": ["Say hi."]}) + "\n")
    assert main(["bench", "--model", str(folder), "--dtype", "fp32", "--device", "cuda", "--methods",
                 "prompt-lookup", "--prompts", str(prompts), "--max-new-tokens", "8", "--compare-hf", "--no-progress",
                 "--out", str(tmp_path / "b")]) == 0
    result = json.loads((tmp_path / "b" / "results.json").read_text())
    assert result["meta"]["machine"]["gpu"] and result["meta"]["mismatches"] == []
    assert {r["method"] for r in result["records"]} >= {"plain", "prompt-lookup", "hf-plain", "hf-prompt-lookup"}


@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA GPU on this machine")
def test_heads_trained_on_the_gpu_draft_on_it(folder, tmp_path):
    """`specdec train medusa|eagle --device cuda` (the target's pass over the corpus on the GPU, EAGLE's
    self-distilled answers and training too), then those heads drafting for the target on the GPU: plain's tokens."""
    import json

    from specdec.api import LLM

    data = tmp_path / "c.jsonl"
    data.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"count {i} {i + 1}"}]})
                              for i in range(40)))
    common = ["--model", str(folder), "--device", "cuda", "--data", str(data), "--tokens", "2000", "--epochs", "2",
              "--max-len", "60", "--quiet"]
    assert main(["train", "medusa", *common, "--heads", "2", "--out", str(tmp_path / "m")]) == 0
    assert main(["train", "eagle", *common, "--regenerate", "--draft-vocab", "30", "--batch-tokens", "256",
                 "--out", str(tmp_path / "e")]) == 0
    ids = [1, 2, 3, 4, 5, 1, 2, 3]
    plain = LLM(str(folder), dtype="fp32").generate(ids, max_new_tokens=12).token_ids
    for method, where in (("medusa", "m"), ("eagle", "e")):
        gpu = LLM(str(folder), dtype="fp32", device="cuda", heads=str(tmp_path / where))
        assert gpu.generate(ids, method=method, max_new_tokens=12).token_ids == plain, method


@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA GPU on this machine")
def test_cuda_graphs_replay_what_the_eager_forward_computes(folder, monkeypatch):
    """Steps of 1 to 5 positions with rejections between them (rewinds): each replayed graph's logits and hidden
    states equal the eager forward's (fp32); graphs were captured, and a new request's cache replays them."""
    model = load_transformer(folder, torch.float32, "cuda")
    monkeypatch.setenv("SPECDEC_CUDA_GRAPHS", "0")
    eager = model.new_cache(64)
    monkeypatch.setenv("SPECDEC_CUDA_GRAPHS", "1")
    graphed = model.new_cache(64)
    for cache in (eager, graphed):
        model.prefill([1, 5, 9, 13], cache)
    g = torch.Generator().manual_seed(0)
    for n in (1, 3, 1, 5, 2, 1, 4):
        tokens = torch.randint(3, 96, (1, n), generator=g)
        monkeypatch.setenv("SPECDEC_CUDA_GRAPHS", "0")
        want = model(tokens, eager, hidden_layers=(0, -1))
        monkeypatch.setenv("SPECDEC_CUDA_GRAPHS", "1")
        got = model(tokens, graphed, hidden_layers=(0, -1))
        torch.testing.assert_close(got.logits, want.logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got.hidden[-1], want.hidden[-1], rtol=1e-4, atol=1e-4)
        for cache in (eager, graphed):
            cache.rewind(n // 2)
    assert graphed.graphs and all(gr.graph is not None for gr in graphed.graphs.values())
    captured = graphed.graphs
    del graphed, cache  # the loop variable held it too
    again = model.new_cache(64)
    assert again.graphs is captured and again.length == 0


@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA GPU on this machine")
@pytest.mark.parametrize("mode", ["always", "never"])
def test_the_server_engine_on_the_gpu_matches_the_cpu_in_fp32(folder, tmp_path, mode):
    """`specdec serve --device cuda`: requests joining and leaving a batch on the GPU (packed eager steps, and a lone
    request's steps replaying CUDA graphs), drafting with prompt lookup, recycling and EAGLE, each give plain decoding's
    greedy tokens from the CPU (fp32)."""
    from specdec.api import LLM
    from specdec.decode import Request
    from specdec.serving.engine import Engine, Job

    heads = save_heads(folder, tmp_path)
    cpu = LLM(str(folder), dtype="fp32", device="cpu")
    prompts = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 8, 9, 7, 8, 9, 7], [5] * 12, [11, 12, 13, 14, 15, 16, 11, 12, 13]]
    plain = [cpu.generate(ids, max_new_tokens=16).token_ids for ids in prompts]
    gpu = LLM(str(folder), dtype="fp32", device="cuda", heads=str(heads["eagle"]))
    engine = Engine(gpu.model, gpu.tokenizer, budget=8, speculation=mode, max_batch=3, prefill_chunk=5,
                    drafters={"recycling": gpu.drafter("recycling").fresh, "eagle": gpu.drafter("eagle").fresh})
    methods = ["prompt-lookup", "recycling", "eagle", "plain"]
    jobs = [Job(ids, Request(max_new_tokens=16), method=m, k=3) for ids, m in zip(prompts, methods)]
    out = {j.id: [] for j in jobs}
    for j in jobs:
        j.on_event = lambda e, got=out[j.id]: got.extend(e.tokens)
    pending, steps = list(jobs), 0
    while pending or engine.busy:
        if pending and steps % 3 == 0:
            engine.submit(pending.pop(0))
        engine.step()
        steps += 1
    assert [out[j.id] for j in jobs] == plain
