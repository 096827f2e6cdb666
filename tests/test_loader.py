"""A damaged or inconsistent model folder is refused with one line naming the file and what is wrong
(`specdec generate` exits 2, no traceback), never loaded half-right."""

import json
import shutil

import pytest

from specdec.cli import main
from specdec.errors import SpecdecError
from specdec.runtime.loader import load_transformer
from tests.tiny import save_tiny


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return save_tiny("llama", tmp_path_factory.mktemp("pristine"))  # tie_word_embeddings false, own lm_head


@pytest.fixture
def folder(pristine, tmp_path):
    return shutil.copytree(pristine, tmp_path / "model")


def edit_config(folder, **changes):
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key)
        else:
            cfg[key] = value
    path.write_text(json.dumps(cfg))


def truncate_weights(folder):
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:100])


def drop_lm_head(folder):
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(path)
    del tensors["lm_head.weight"]
    save_file(tensors, path, metadata={"format": "pt"})


DAMAGES = {
    "truncated weights": (truncate_weights, "model.safetensors", "truncated"),
    "intermediate_size": (lambda f: edit_config(f, intermediate_size=100), "config.json", "intermediate_size"),
    "missing hidden_size": (lambda f: edit_config(f, hidden_size=None), "config.json", "'hidden_size' is missing"),
    "string size": (lambda f: edit_config(f, num_hidden_layers="3"), "config.json", "positive integer"),
    "malformed config": (lambda f: (f / "config.json").write_text('{"model_type": "llama",'), "config.json",
                         "not a readable JSON"),
    "missing head": (drop_lm_head, "lm_head.weight", "output head is missing"),
    "malformed generation config": (lambda f: (f / "generation_config.json").write_text("{bad"),
                                    "generation_config.json", "not a readable JSON"),
    "malformed store marker": (lambda f: (f / "specdec.json").write_text("[1, 2]"), "specdec.json",
                               "not a readable JSON"),
    "no tokenizer": (lambda f: [p.unlink() for p in f.glob("tokenizer*")], "model", "cannot load the tokenizer"),
}


LOADED = ["truncated weights", "intermediate_size", "missing hidden_size", "string size", "malformed config",
          "missing head"]  # what load_transformer reads; the API reads the rest too (the tokenizer, the marker)


@pytest.mark.parametrize("damage", LOADED)
def test_damaged_folder_is_one_clear_error(folder, damage):
    spoil, names, what = DAMAGES[damage]
    spoil(folder)
    with pytest.raises(SpecdecError) as e:
        load_transformer(folder)
    message = str(e.value)
    assert names in message and what in message and "\n" not in message


@pytest.mark.parametrize("damage", ["truncated weights", "intermediate_size", "missing hidden_size",
                                    "malformed generation config", "malformed store marker", "no tokenizer"])
def test_cli_exits_2_on_a_damaged_folder(folder, damage, capsys):
    DAMAGES[damage][0](folder)
    assert main(["generate", "hi", "--model", str(folder), "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and "\n" not in err and DAMAGES[damage][2] in err


def test_tied_head_without_lm_head_loads(folder):
    drop_lm_head(folder)
    edit_config(folder, tie_word_embeddings=True)
    model = load_transformer(folder)
    assert model.lm_head.weight is model.embed.weight


def test_dtype_by_name_or_a_clear_error(folder):
    """load_transformer takes the CLI's dtype names as well as torch dtypes; an unknown one is one clear error."""
    import torch

    assert load_transformer(folder, "fp32").embed.weight.dtype == torch.float32
    with pytest.raises(SpecdecError, match="unknown dtype 'bf17'"):
        load_transformer(folder, "bf17")


def test_kv_dtype_by_name_or_a_clear_error(folder):
    """The KV cache's dtype (`--kv-dtype`): the activations' for an fp32 model unless asked; fp16 or bf16 on request
    (the torch route widens it for attention); an unknown name is one clear error, before any weight loads, in the
    loader and in the API."""
    import torch

    from specdec.api import LLM
    from specdec.options import OptionError

    assert load_transformer(folder, "fp32").new_cache(8).k[0].dtype == torch.float32
    model = load_transformer(folder, "fp32", kv_dtype="fp16")
    cache = model.new_cache(8)
    assert cache.k[0].dtype == cache.v[0].dtype == torch.float16
    logits = model(torch.tensor([[3, 4, 5]]), cache).logits
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all() and cache.k[0][:, :, :3].abs().sum() > 0
    with pytest.raises(SpecdecError, match="unknown KV-cache dtype 'int8'"):
        load_transformer(folder, "fp32", kv_dtype="int8")
    with pytest.raises(OptionError, match="unknown KV-cache dtype 'fp8'.*auto, fp16, bf16, fp32"):
        LLM(str(folder), dtype="fp32", kv_dtype="fp8", pull=False)
    for bad, match in ((dict(dtype="q3"), "unknown dtype 'q3'"), (dict(device="tpu"), "unknown device 'tpu'")):
        with pytest.raises(OptionError, match=match):  # a ValueError too, and said before the model is looked up
            LLM("no-such-model", pull=False, **bad)
    model = load_transformer(folder, "fp32", kv_dtype="bf16")  # bf16 too, on the torch route
    cache = model.new_cache(8)
    assert cache.k[0].dtype == torch.bfloat16
    assert torch.isfinite(model(torch.tensor([[3, 4, 5]]), cache).logits).all()


@pytest.mark.parametrize("dtype", ["q8", "q4"])
def test_truncated_weights_are_one_clear_error_when_quantized(folder, dtype, tmp_path, monkeypatch, capsys):
    """--dtype q8 / q4 read the folder's weights through their own path (the quantized cache's build, then the norms
    and embedding): a damaged file is the same one line as for fp32, not safetensors' traceback."""
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    truncate_weights(folder)
    with pytest.raises(SpecdecError, match=r"model\.safetensors: unreadable weights .*truncated"):
        load_transformer(folder, dtype)
    assert main(["generate", "hi", "--model", str(folder), "--dtype", dtype, "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and "\n" not in err and "truncated" in err
