"""The EAGLE head module: checkpoint names and shapes as vLLM's and SGLang's llama_eagle3 loaders read them,
cached steps equal one causal call, d2t/t2d, save/load and published-config round trips, foreign targets."""

import json

import pytest
import torch

from specdec.drafters.eagle_head import EagleConfig, EagleHead, default_aux_layers, vocab_maps
from specdec.errors import SpecdecError
from specdec.runtime.config import ModelConfig

TARGET = ModelConfig(model_type="llama", vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=6,
                     num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                     max_position_embeddings=256, tie_word_embeddings=False, attention_bias=False)


def make_head(seed=0, draft_vocab=32, version=3):
    torch.manual_seed(seed)
    cfg = EagleConfig.for_target(TARGET, "tiny", "abc", version=version,
                                 draft_vocab_size=draft_vocab if version == 3 else None)
    head = EagleHead(cfg)
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.copy_(torch.empty_like(p).uniform_(0.8, 1.2) if "norm" in name else torch.randn_like(p) * 0.1)
    if version == 3:
        head.set_vocab(torch.randperm(TARGET.vocab_size)[:draft_vocab])
    return head.eval()


def test_checkpoint_names_and_shapes_match_the_vllm_and_sglang_loaders():
    # vLLM llama_eagle3.py: fc = ReplicatedLinear(3 * hidden, hidden, bias=False); midlayer.* -> layers.0.*
    # (qkv_proj over 2 * hidden); lm_head = ParallelLMHead(draft_vocab_size, hidden); d2t -> draft_id_to_target_id
    # (long [draft_vocab]); t2d skipped. SGLang llama_eagle3.py: the same names, d2t + arange = hot token ids.
    D, H, Hk, hd, I, V, Vd = 64, 4, 2, 16, 128, 96, 32
    want = {
        "fc.weight": (D, 3 * D),
        "midlayer.input_layernorm.weight": (D,), "midlayer.hidden_norm.weight": (D,),
        "midlayer.self_attn.q_proj.weight": (H * hd, 2 * D), "midlayer.self_attn.k_proj.weight": (Hk * hd, 2 * D),
        "midlayer.self_attn.v_proj.weight": (Hk * hd, 2 * D), "midlayer.self_attn.o_proj.weight": (D, H * hd),
        "midlayer.post_attention_layernorm.weight": (D,),
        "midlayer.mlp.gate_proj.weight": (I, D), "midlayer.mlp.up_proj.weight": (I, D),
        "midlayer.mlp.down_proj.weight": (D, I),
        "norm.weight": (D,), "lm_head.weight": (Vd, D), "d2t": (Vd,), "t2d": (V,),
    }
    state = make_head().state_dict()
    assert {k: tuple(v.shape) for k, v in state.items()} == want
    assert state["d2t"].dtype == torch.int64 and state["t2d"].dtype == torch.bool


def test_cached_steps_equal_one_causal_call():
    head = make_head()
    torch.manual_seed(1)
    emb, hid = torch.randn(1, 7, 64), torch.randn(1, 7, 64)
    pos = torch.arange(7)[None]
    full_logits, full_h = head(emb, hid, pos)  # training's call: no cache
    cache = head.new_cache(16)
    a = head(emb[:, :4], hid[:, :4], pos[:, :4], cache)
    b = head(emb[:, 4:], hid[:, 4:], pos[:, 4:], cache)
    assert cache.length == 7
    torch.testing.assert_close(torch.cat([a[0], b[0]], 1), full_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat([a[1], b[1]], 1), full_h, atol=1e-5, rtol=1e-5)
    cache.rewind(3)  # roll back the last three, redo them one by one: same outputs
    for i in range(4, 7):
        out = head(emb[:, i:i + 1], hid[:, i:i + 1], pos[:, i:i + 1], cache)
        torch.testing.assert_close(out[0][0, 0], full_logits[0, i], atol=1e-5, rtol=1e-5)


def test_vocab_maps_round_trip():
    ids = torch.tensor([50, 3, 95, 7])
    d2t, t2d = vocab_maps(ids, 96)
    assert (torch.arange(4) + d2t).tolist() == [3, 7, 50, 95]
    assert t2d.nonzero().flatten().tolist() == [3, 7, 50, 95]
    head = make_head()
    targets = head.to_target(torch.arange(32))
    assert bool(head.t2d[targets].all()) and int(head.t2d.sum()) == 32 and len(set(targets.tolist())) == 32


def test_save_load_round_trip(tmp_path):
    head = make_head()
    head.save(tmp_path)
    back = EagleHead.load(tmp_path)
    assert back.cfg == head.cfg
    for k, v in head.state_dict().items():  # weights written in fp16, as heads are trained and shipped
        assert torch.equal(v.half().float() if v.is_floating_point() else v, back.state_dict()[k]), k
    back.save(tmp_path / "again")  # an export of a loaded head: the same bytes, not twice the size in fp32
    assert (tmp_path / "again/model.safetensors").read_bytes() == (tmp_path / "model.safetensors").read_bytes()
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 32
    assert config["torch_dtype"] == "float16"  # what the weights are, for loaders that read it
    aux = list(default_aux_layers(3, 6))
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == aux  # SGLang: layer outputs
    assert config["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in aux]  # vLLM: layer inputs


def test_a_truncated_head_is_one_clear_error(tmp_path, capsys):
    """Weights cut short: a SpecdecError naming the file and what to do (the CLI's one line, exit 2), not
    safetensors' traceback; `export eagle --heads` reads through the same load."""
    from specdec.cli import main

    make_head().save(tmp_path / "h")
    weights = tmp_path / "h" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(SpecdecError, match=r"model\.safetensors: damaged or unreadable weights .*specdec train eagle"):
        EagleHead.load(tmp_path / "h")
    assert main(["export", "eagle", "--heads", str(tmp_path / "h"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and "\n" not in err and "model.safetensors: damaged" in err, err


def test_published_config_without_specdec_block(tmp_path):
    head = make_head()
    head.save(tmp_path)
    d = json.loads((tmp_path / "config.json").read_text())
    del d["specdec"]
    (tmp_path / "config.json").write_text(json.dumps(d))
    back = EagleHead.load(tmp_path)
    assert back.cfg.aux_layers == head.cfg.aux_layers and back.cfg.target_fingerprint is None
    del d["eagle_config"]  # vLLM's top-level ids count layer inputs
    (tmp_path / "config.json").write_text(json.dumps(d))
    assert EagleHead.load(tmp_path).cfg.aux_layers == head.cfg.aux_layers


def test_foreign_target_refused():
    cfg = make_head().cfg
    cfg.check_target(TARGET, "tiny", "abc")
    with pytest.raises(SpecdecError, match="built for 'tiny'.*fingerprint"):
        cfg.check_target(TARGET, "other", "xyz")
    wide = ModelConfig(**{**TARGET.__dict__, "hidden_size": 128})
    with pytest.raises(SpecdecError, match="hidden size 64"):
        cfg.check_target(wide, "wide", None)


def test_config_json_round_trip():
    cfg = make_head(version=1).cfg
    assert cfg.aux_layers == (5,) and cfg.draft_vocab_size == 96
    assert EagleConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
