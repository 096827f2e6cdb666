"""Model hyper-parameters, read from a Hugging Face `config.json` (Llama, SmolLM2, Qwen2, Qwen2.5)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from specdec.errors import SpecdecError

SUPPORTED = ("llama", "qwen2")


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2 does, Llama does not)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        model_type = d.get("model_type", "")
        if model_type not in SUPPORTED:
            raise SpecdecError(
                f"unsupported model type {model_type!r}: specdec runs the Llama family ({', '.join(SUPPORTED)})"
            )
        rope = d.get("rope_scaling") or d.get("rope_parameters") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise SpecdecError(f"unsupported rope scaling {rope_type!r}: only plain RoPE is implemented")
        theta = d.get("rope_theta", rope.get("rope_theta", 10000.0))
        heads = d["num_attention_heads"]
        return cls(
            model_type=model_type,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", model_type == "qwen2")),
        )

    @classmethod
    def from_folder(cls, folder: Path) -> "ModelConfig":
        path = Path(folder) / "config.json"
        if not path.exists():
            raise SpecdecError(f"{folder} has no config.json: not a Hugging Face model folder")
        return cls.from_dict(json.loads(path.read_text()))
