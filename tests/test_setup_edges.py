"""What a model's setup must get right at its edges: config.json defaults and bounds, the KV cache's
reset/grow/compact, --dtype auto and --device resolution, the matmul/attention/prefill paths a model reports, and
a draft model's tokenizer and family checks, stale rounds and sampling flag (each written against a mutant of
kv_cache.py, config.py, loader.py or draft_model.py that the rest of the suite let through)."""

import pytest
import torch

from specdec.errors import SpecdecError
from specdec.runtime.config import ModelConfig
from specdec.runtime.kv_cache import KVCache

MINIMAL = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)


# --- config.json: the defaults transformers assumes where a field is absent ---


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_absent_config_fields_take_transformers_defaults(kind):
    cfg = ModelConfig.from_dict(dict(MINIMAL, model_type=kind))
    assert cfg.num_kv_heads == cfg.num_heads == 4  # no GQA field: multi-head attention
    assert cfg.head_dim == 16 and isinstance(cfg.head_dim, int)  # hidden_size // heads
    assert cfg.rms_norm_eps == 1e-6 and cfg.rope_theta == 10000.0 and cfg.max_position_embeddings == 2048
    assert cfg.tie_word_embeddings is False
    assert cfg.attention_bias is (kind == "qwen2")  # Qwen2's q/k/v carry a bias, Llama's do not


def test_rope_theta_is_read_from_rope_parameters():
    """transformers 5 writes rope_theta inside `rope_parameters` (SmolLM2: 1e5, Qwen2.5: 1e6)."""
    d = dict(MINIMAL, model_type="qwen2", rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"})
    assert ModelConfig.from_dict(d).rope_theta == 1e6
    assert ModelConfig.from_dict(dict(d, rope_theta=5e5)).rope_theta == 5e5  # a top-level field wins


@pytest.mark.parametrize("scaling", [{"rope_type": "linear", "factor": 2.0}, {"type": "llama3", "factor": 8.0}])
@pytest.mark.parametrize("key", ["rope_scaling", "rope_parameters"])
def test_scaled_rope_is_refused(scaling, key):
    with pytest.raises(SpecdecError, match="unsupported rope scaling"):
        ModelConfig.from_dict(dict(MINIMAL, model_type="llama", **{key: scaling}))


def test_a_single_kv_head_or_layer_is_valid():
    """Multi-query attention (one KV head) and a one-layer model are real configs: 1 is a positive integer."""
    cfg = ModelConfig.from_dict(dict(MINIMAL, model_type="llama", num_key_value_heads=1, num_hidden_layers=1))
    assert cfg.num_kv_heads == 1 and cfg.num_layers == 1


@pytest.mark.parametrize("field, value", [("num_key_value_heads", 0), ("num_hidden_layers", -2),
                                          ("vocab_size", True), ("hidden_size", 64.0)])
def test_sizes_must_be_positive_integers(field, value):
    with pytest.raises(SpecdecError, match=f"'{field}' must be a positive integer"):
        ModelConfig.from_dict(dict(MINIMAL, model_type="llama", **{field: value}))


@pytest.mark.parametrize("field, value", [("rope_theta", 0), ("rope_theta", -1e4), ("rope_theta", "1e4"),
                                          ("rms_norm_eps", 0.0), ("rms_norm_eps", True), ("rms_norm_eps", "1e-6")])
def test_rope_theta_and_eps_must_be_positive_numbers(field, value):
    with pytest.raises(SpecdecError, match=f"'{field}' must be a positive number"):
        ModelConfig.from_dict(dict(MINIMAL, model_type="llama", **{field: value}))


# --- the KV cache ---


def _numbered(length, layers=1, max_len=8):
    """A cache whose slot i holds i in every layer's k and -i in its v."""
    c = KVCache(layers, 1, 1, max_len, 1)
    for k, v in zip(c.k, c.v):
        k[0, 0, :length, 0] = torch.arange(length, dtype=torch.float32)
        v[0, 0, :length, 0] = -torch.arange(length, dtype=torch.float32)
    c.length = length
    return c


def test_batch_of_a_one_layer_cache():
    """A one-layer model's cache (or an early-exit view of one layer, which `EarlyExit` asks for its batch)."""
    assert KVCache(1, 3, 2, 8, 4).batch == 3
    assert KVCache(4, 2, 2, 8, 4).first_layers(1).batch == 2


def test_reset_empties_the_cache():
    """EAGLE resets its cache between requests: the next forward must write from slot 0."""
    c = _numbered(5)
    c.reset()
    assert c.length == 0
    c.write(0, torch.full((1, 1, 2, 1), 7.0), torch.full((1, 1, 2, 1), 7.0), c.length)
    c.length += 2
    assert c.view(0, c.length)[0].flatten().tolist() == [7.0, 7.0]


def test_grow_to_the_same_size_keeps_the_tensors():
    """A drafter asks for `grow(slots)` every round: a cache already that large keeps its tensors (no copy per round,
    and views of them, such as an early-exit drafter's shared layers, stay valid)."""
    c = _numbered(3, layers=2, max_len=8)
    k, v, ptrs, shared = c.k[1], c.v[1], c.pointers(), c.first_layers(1)
    c.grow(8)
    c.grow(5)
    assert c.k[1] is k and c.v[1] is v and c.pointers() == ptrs and c.max_len == 8
    assert shared.k[0] is c.k[0]


def test_compact_refuses_a_negative_slot_before_valid_ones():
    """keep is ascending: a negative first index is outside the newest slots even when the last is inside."""
    with pytest.raises(ValueError, match="compact"):
        _numbered(5).compact([-1, 1], newest=3)
    c = _numbered(5)
    c.compact([0, 2], newest=3)  # slots 2 and 4 of 5: the kept ones follow slots 0, 1
    assert c.length == 4 and c.k[0][0, 0, :4, 0].tolist() == [0.0, 1.0, 2.0, 4.0]
    assert c.v[0][0, 0, :4, 0].tolist() == [0.0, -1.0, -2.0, -4.0]


def test_model_config_is_immutable_and_hashable():
    """A target and its drafters share one config: nothing may change it under them."""
    import dataclasses

    cfg = ModelConfig.from_dict(dict(MINIMAL, model_type="llama"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.rope_theta = 1.0
    assert hash(cfg) == hash(ModelConfig.from_dict(dict(MINIMAL, model_type="llama")))


# --- a draft model: the same tokenizer, the same family ---


def _tok(vocab):
    from types import SimpleNamespace

    return SimpleNamespace(hf=SimpleNamespace(get_vocab=lambda: dict(vocab)))


def test_same_tokenizer_shares_every_id_and_another_is_refused():
    from specdec.drafters.draft_model import check_same_tokenizer

    vocab = {"<s>": 0, "a": 1, "b": 2, "c": 3}
    assert check_same_tokenizer(_tok(vocab), _tok(vocab)) == 4
    with pytest.raises(SpecdecError, match=r"tokenizer differs from the target's \(2 vocabulary entries differ\)"):
        check_same_tokenizer(_tok(vocab), _tok(dict(vocab, c=4)))


def test_a_draft_of_another_known_family_is_refused_naming_the_right_ones():
    from specdec.drafters.draft_model import check_draft_family

    check_draft_family("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")  # same family
    check_draft_family("qwen2.5-coder-1.5b", "/some/own/folder")  # unknown: compared by tokenizers on load
    check_draft_family("/some/own/folder", "smollm2-135m")
    with pytest.raises(SpecdecError, match=r"\(smollm2 tokenizer\) cannot draft for the target \(qwen2.5 "
                                           r"tokenizer\).*same family, e\.g\. qwen2.5-coder-0.5b$"):
        check_draft_family("qwen2.5-coder-1.5b", "smollm2-135m")
    with pytest.raises(SpecdecError, match=r"same family$"):  # no other smollm2 model to suggest
        check_draft_family("smollm2-135m", "qwen2.5-coder-0.5b")


# --- the loader: --dtype auto, --device cuda:N, a damaged folder ---


def _marker(tmp_path, types, name="m"):
    import json

    from specdec.store import MARKER

    folder = tmp_path / name
    folder.mkdir()
    (folder / MARKER).write_text(json.dumps({"name": "x", "gguf_types": types}))
    return folder


@pytest.mark.parametrize("types, q4", [
    ({"Q4_K": 10, "Q6_K": 8, "F32": 100}, True),    # norms and biases (F32) do not count against the 4-bit blocks
    ({"Q4_0": 3, "Q4_1": 3, "Q8_0": 5}, True),      # every 4-bit block type counts
    ({"Q4_K": 10, "Q6_K": 10, "F32": 50}, False),   # half is not mostly
    ({"Q4_K": 10, "Q6_K": 15}, False),
    ({"Q8_0": 1, "F32": 5}, False),                 # absent types count as none
    ({}, False),
])
def test_gguf_is_q4_when_most_matrices_are_4_bit(tmp_path, types, q4):
    from specdec.runtime.loader import gguf_is_q4

    assert gguf_is_q4(_marker(tmp_path, types)) is q4


def test_gguf_is_q4_without_a_marker(tmp_path):
    from specdec.runtime.loader import gguf_is_q4

    assert gguf_is_q4(None) is False and gguf_is_q4(tmp_path) is False


@pytest.mark.parametrize("bf16_cpu, kernel, want", [(True, True, torch.bfloat16), (True, False, torch.bfloat16),
                                                    (False, True, torch.bfloat16), (False, False, torch.float32)])
def test_auto_dtype_is_bf16_where_either_the_cpu_or_the_kernel_multiplies_it(monkeypatch, bf16_cpu, kernel, want):
    from specdec.runtime import kernels, loader
    from specdec.runtime.kernels import quant

    monkeypatch.setattr(quant, "isa", lambda: "vnni512")  # integer kernels run: still no q4 for a non-GGUF model
    monkeypatch.setattr(loader, "cpu_has_bf16_matmul", lambda: bf16_cpu)
    monkeypatch.setattr(kernels, "available", lambda: kernel)
    assert loader.resolve_dtype("auto") == want and loader.resolve_dtype(None) == want


def test_auto_dtype_picks_q4_only_where_the_integer_kernels_run(tmp_path, monkeypatch, capsys):
    from specdec.runtime import loader
    from specdec.runtime.kernels import quant

    folder = _marker(tmp_path, {"Q4_K": 100, "Q6_K": 20, "F32": 50})
    monkeypatch.setattr(quant, "isa", lambda: "vnni512")
    assert loader.resolve_dtype("auto", folder) == "q4" and "q4" in capsys.readouterr().err
    assert loader.resolve_dtype("fp32", folder) == torch.float32
    monkeypatch.setattr(quant, "isa", lambda: "torch")
    assert loader.resolve_dtype("auto", folder) in (torch.bfloat16, torch.float32)


def test_cuda_device_index_is_checked_against_the_gpus_torch_sees(monkeypatch):
    from specdec.runtime.loader import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda") == torch.device("cuda")
    assert resolve_device("CUDA:1") == torch.device("cuda", 1)
    with pytest.raises(SpecdecError, match=r"--device cuda:2: torch sees 2 GPU\(s\), numbered 0\.\.1$"):
        resolve_device("cuda:2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a driver that sees none
    with pytest.raises(SpecdecError, match="no CUDA GPU"):
        resolve_device("cuda:0")


def test_check_dtype_takes_none_and_every_choice():
    from specdec.runtime.loader import CHOICES, check_dtype

    for name in (None, *CHOICES):
        check_dtype(name)
    with pytest.raises(SpecdecError, match="unknown dtype 'fp8'"):
        check_dtype("fp8")


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    from specdec.runtime.loader import load_transformer
    from tests.tiny import save_tiny

    return load_transformer(save_tiny("llama", tmp_path_factory.mktemp("audit")))


def _ctx(tokens):
    from specdec.drafters.base import Context
    from specdec.sampling import SamplingParams, make_generator

    return Context(list(tokens), len(tokens), SamplingParams(), make_generator(0), remaining=20)


def test_draft_model_is_stale_only_after_plain_steps(tiny_target):
    """A round that follows a fully accepted one feeds 2 tokens (the last draft and the bonus token): its time is the
    draft's own. One plain step more (3 tokens to catch up) is not, so it must not teach the policy tau."""
    from specdec.drafters.draft_model import DraftModel

    vocab = tiny_target.cfg.vocab_size
    d = DraftModel(tiny_target, vocab, vocab)
    tokens = [1, 40, 41, 42, 43, 44]
    drafts = d.propose(_ctx(tokens), 3).tokens.tolist()
    assert d.stale  # the prompt's catch-up
    tokens += drafts + [50]  # all accepted, plus the target's bonus token
    drafts = d.propose(_ctx(tokens), 3).tokens.tolist()
    assert not d.stale
    tokens += drafts + [51, 52]  # all accepted, the bonus token, then one plain step
    d.propose(_ctx(tokens), 3)
    assert d.stale


def test_draft_model_catch_up_asks_for_the_last_row_only(tiny_target):
    """The catch-up over a long prompt needs the logits after its last token only: the LM head is not run over every
    fed row (a 740-token prompt x a 150k vocabulary would be 0.4 GB of logits)."""
    from specdec.drafters.draft_model import DraftModel

    calls = []

    class Spy:
        cfg = tiny_target.cfg

        def new_cache(self, *a, **kw):
            return tiny_target.new_cache(*a, **kw)

        def __call__(self, ids, cache, **kw):
            out = tiny_target(ids, cache, **kw)
            calls.append((ids.shape[1], out.logits.shape[1]))
            return out

    vocab = tiny_target.cfg.vocab_size
    DraftModel(Spy(), vocab, vocab).propose(_ctx([1, 40, 41, 42, 43, 44, 45]), 2)
    assert calls == [(7, 1), (1, 1)]


def test_draft_model_prior_alpha_is_a_probability():
    from specdec.drafters.draft_model import DraftModel

    assert 0 < DraftModel.prior_alpha < 1


def test_fused_projections_of_mismatched_widths_are_one_clear_error(tmp_path):
    """q/k/v (and gate/up) are concatenated into one matrix: a part whose input width differs is a damaged folder,
    said in one line, not torch.cat's traceback."""
    from safetensors.torch import load_file, save_file

    from specdec.runtime.loader import load_transformer
    from tests.tiny import save_tiny

    folder = save_tiny("llama", tmp_path / "m")
    path = folder / "model.safetensors"
    tensors = load_file(path)
    name = "model.layers.1.self_attn.k_proj.weight"
    tensors[name] = tensors[name][:, :60].contiguous()
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(SpecdecError, match=r"k_proj\.weight, .*mismatched shapes \[\[64, 64\], \[32, 60\], \[32, 64\]\]"):
        load_transformer(folder)


def test_an_fp32_model_reports_torch_paths(tiny_target):
    """What `specdec info`/the bench print: an fp32 model is not exact, so torch attends and multiplies, whatever
    kernels the CPU has."""
    from specdec.runtime.loader import attention_path, matmul_path, prefill_path

    assert not tiny_target.row_exact
    assert matmul_path(tiny_target) == prefill_path(tiny_target) == "torch"
    assert attention_path(tiny_target) == "torch, fp32 cache"


@pytest.mark.parametrize("quantized, device, prefill, want", [
    ("q4", "cpu", 3, "q4/amx"),            # AMX tiles for the prompt rows of a quantized model
    ("q4", "cpu", 0, "q4/vnni512"),        # no prefill ISA: the decoding path
    (None, "cpu", 3, "avx512bf16"),        # not quantized: the bf16 kernel's path, whatever the fused layers say
    ("q8", "cuda", 3, "q8/vnni512"),       # (the loader refuses this pair; the report never claims AMX off the host)
])
def test_prefill_path_names_the_amx_prefill_only_where_it_runs(monkeypatch, quantized, device, prefill, want):
    from types import SimpleNamespace

    from specdec.runtime.kernels import quant
    from specdec.runtime.loader import prefill_path

    monkeypatch.setattr(quant, "isa", lambda: "vnni512")
    model = SimpleNamespace(quantized=quantized, device=torch.device(device), lm_head=SimpleNamespace(path="avx512bf16"),
                            fused_layers=SimpleNamespace(prefill_isa=prefill))
    assert prefill_path(model) == want


def test_a_draft_model_samples_its_own_q_so_it_is_not_deterministic(tiny_target):
    """Under seeded sampling the bench holds only deterministic drafters (no q of their own) to plain decoding's
    tokens; a draft model samples from q, so it (and a hybrid holding it) must say it is not deterministic."""
    from specdec.adaptive import AdaptiveK
    from specdec.drafters.base import Context
    from specdec.drafters.draft_model import DraftModel
    from specdec.drafters.hybrid import Hybrid
    from specdec.sampling import SamplingParams, make_generator

    vocab = tiny_target.cfg.vocab_size
    d = DraftModel(tiny_target, vocab, vocab)
    tokens = [1, 40, 41, 42]
    draft = d.propose(Context(tokens, len(tokens), SamplingParams(temperature=1.0), make_generator(0), remaining=9), 3)
    assert draft.q is not None and not d.deterministic
    assert not Hybrid([DraftModel(tiny_target, vocab, vocab)], [AdaptiveK()]).deterministic


@pytest.mark.parametrize("name", ["cpu:", "cuda:", "cuda: 0"])
def test_a_device_with_an_empty_index_is_one_clear_error(monkeypatch, name, capsys):
    """`--device cpu:` was torch's RuntimeError traceback ("Invalid device string"), and `cuda:` one on a GPU host."""
    from specdec.cli import main
    from specdec.runtime.loader import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a GPU host: the name is refused first
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(SpecdecError, match="unknown device"):
        resolve_device(name)
    assert main(["generate", "hi", "--device", name, "--max-new-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert "unknown device" in err and "Traceback" not in err
