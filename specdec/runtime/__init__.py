"""The target-model runtime: a lean Llama/Qwen2 forward with a static KV cache built for speculation."""

from specdec.runtime.config import ModelConfig
from specdec.runtime.kv_cache import KVCache
from specdec.runtime.model import ForwardOutput, Transformer

__all__ = ["ModelConfig", "KVCache", "Transformer", "ForwardOutput"]
