"""Load a Hugging Face model folder (config.json + *.safetensors) into the lean Transformer.

Hugging Face names map onto fused projections: q_proj|k_proj|v_proj -> qkv, gate_proj|up_proj -> gate_up.

bf16 where the skinny-GEMM kernel is available (`specdec.runtime.kernels`: gcc, AVX2 + FMA, not disabled
by SPECDEC_KERNEL=0): the matmul weights (qkv, o, gate_up, down, LM head) and the embedding table are
kept in bf16 and everything else in fp32, so activations, attention and the KV cache run in fp32 and
the matmuls read half the bytes. Without the kernel, bf16 means every tensor in bf16 (torch's matmul).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from specdec.errors import SpecdecError
from specdec.runtime import kernels
from specdec.runtime.config import ModelConfig
from specdec.runtime.model import Transformer

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}


def cpu_has_bf16_matmul() -> bool:
    """True where the CPU multiplies bf16 natively (AMX or AVX512-BF16); elsewhere bf16 is emulated and slow."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def resolve_dtype(name: str | None) -> torch.dtype:
    """`None`/"auto": bf16 where the CPU has bf16 matmuls or the bf16 skinny-GEMM kernel works, else fp32."""
    if name in (None, "auto"):
        return torch.bfloat16 if cpu_has_bf16_matmul() or kernels.available() else torch.float32
    if name not in DTYPES:
        raise SpecdecError(f"unknown dtype {name!r}: choose auto, fp32 or bf16")
    return DTYPES[name]


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise SpecdecError(f"{folder} has no *.safetensors weights")
    tensors = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as fh:
                for name in fh.keys():
                    tensors[name] = fh.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise SpecdecError(f"{f}: unreadable weights ({e}): the file is damaged or truncated; "
                               "re-download the model") from None
    return tensors


def _check_shapes(folder: Path, model: Transformer, state: dict[str, torch.Tensor]) -> None:
    """Every weight must have the shape config.json implies; else one line naming the first that does not."""
    expected = model.state_dict()
    for name, tensor in state.items():
        want = tuple(expected[name].shape)
        if tuple(tensor.shape) != want:
            raise SpecdecError(f"{folder / 'config.json'} disagrees with the weights: {name} has shape "
                               f"{list(tensor.shape)}, the config implies {list(want)} (check hidden_size, "
                               "intermediate_size, the head counts and vocab_size)")


def uses_kernel(dtype: torch.dtype) -> bool:
    """True when a model loaded in `dtype` runs its matmuls through the bf16 skinny-GEMM kernel."""
    return dtype == torch.bfloat16 and kernels.available()


def load_transformer(folder: str | Path, dtype: torch.dtype = torch.float32) -> Transformer:
    folder = Path(folder)
    cfg = ModelConfig.from_folder(folder)
    hf = _read_tensors(folder)
    mixed = uses_kernel(dtype)          # bf16 matmul weights, fp32 everything else
    other = torch.float32 if mixed else dtype

    def take(name: str, to: torch.dtype = other) -> torch.Tensor:
        try:
            return hf.pop(name).to(to)
        except KeyError:
            raise SpecdecError(f"{folder}: weight {name!r} is missing; the model folder is incomplete") from None

    def matrix(*names: str) -> torch.Tensor:
        parts = [take(x, dtype) for x in names]
        if len({p.shape[1:] for p in parts}) > 1:
            raise SpecdecError(f"{folder}: weights {', '.join(names)} have mismatched shapes "
                               f"{[list(p.shape) for p in parts]}; the model folder is damaged")
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    state = {"embed.weight": take("model.embed_tokens.weight", dtype), "norm.weight": take("model.norm.weight")}
    for i in range(cfg.num_layers):
        p, a, m = f"model.layers.{i}.", f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        state[f"layers.{i}.input_norm.weight"] = take(p + "input_layernorm.weight")
        state[f"layers.{i}.post_norm.weight"] = take(p + "post_attention_layernorm.weight")
        state[f"layers.{i}.qkv.weight"] = matrix(*(a + f"{x}_proj.weight" for x in "qkv"))
        if cfg.attention_bias:
            state[f"layers.{i}.qkv.bias"] = torch.cat([take(a + f"{x}_proj.bias") for x in "qkv"])
        state[f"layers.{i}.o.weight"] = matrix(a + "o_proj.weight")
        state[f"layers.{i}.gate_up.weight"] = matrix(m + "gate_proj.weight", m + "up_proj.weight")
        state[f"layers.{i}.down.weight"] = matrix(m + "down_proj.weight")
    tied = cfg.tie_word_embeddings
    if not tied and "lm_head.weight" not in hf:
        raise SpecdecError(f"{folder}: config.json says tie_word_embeddings is false but there is no "
                           "lm_head.weight: the output head is missing; the model folder is incomplete")
    state["lm_head.weight"] = state["embed.weight"] if tied else matrix("lm_head.weight")

    with torch.device("meta"):
        model = Transformer(cfg)
    _check_shapes(folder, model, state)
    model.load_state_dict(state, assign=True, strict=True)
    if tied:
        model.lm_head.weight = model.embed.weight
    if mixed:
        model.embed.out_dtype = torch.float32
    return model.eval()
