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
    def from_dict(cls, d: dict, source: str = "config.json") -> "ModelConfig":
        """Read a config dict; `source` names it in errors (one SpecdecError line saying what is wrong)."""
        if not isinstance(d, dict):
            raise SpecdecError(f"{source}: expected a JSON object, got {type(d).__name__}")
        model_type = d.get("model_type", "")
        if model_type not in SUPPORTED:
            raise SpecdecError(
                f"unsupported model type {model_type!r}: specdec runs the Llama family ({', '.join(SUPPORTED)})"
            )
        rope = d.get("rope_scaling") or d.get("rope_parameters") or {}
        if not isinstance(rope, dict):
            raise SpecdecError(f"{source}: 'rope_scaling' must be an object, got {rope!r}")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise SpecdecError(f"unsupported rope scaling {rope_type!r}: only plain RoPE is implemented")
        theta = d.get("rope_theta", rope.get("rope_theta", 10000.0))

        def size(key: str, default=None) -> int:
            value = d[key] if d.get(key) is not None else default
            if value is None:
                raise SpecdecError(f"{source}: required field {key!r} is missing")
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise SpecdecError(f"{source}: {key!r} must be a positive integer, got {value!r}")
            return value

        heads, hidden = size("num_attention_heads"), size("hidden_size")
        for key, value in (("rms_norm_eps", d.get("rms_norm_eps", 1e-6)), ("rope_theta", theta)):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise SpecdecError(f"{source}: {key!r} must be a positive number, got {value!r}")
        return cls(
            model_type=model_type,
            vocab_size=size("vocab_size"),
            hidden_size=hidden,
            intermediate_size=size("intermediate_size"),
            num_layers=size("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=size("num_key_value_heads", heads),
            head_dim=size("head_dim", hidden // heads),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            max_position_embeddings=size("max_position_embeddings", 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", model_type == "qwen2")),
        )

    @classmethod
    def from_folder(cls, folder: Path) -> "ModelConfig":
        path = Path(folder) / "config.json"
        if not path.exists():
            raise SpecdecError(f"{folder} has no config.json: not a Hugging Face model folder")
        return cls.from_dict(read_json(path), str(path))


def read_json(path: Path) -> dict:
    """A model folder's JSON file (config.json, generation_config.json, the store's specdec.json) as a dict, or one
    error naming the file."""
    try:
        d = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SpecdecError(f"{path}: not a readable JSON file ({e}); re-download or fix the model folder") from None
    if not isinstance(d, dict):
        raise SpecdecError(f"{path}: not a readable JSON file (a {type(d).__name__}, not an object); re-download or "
                           "fix the model folder")
    return d
