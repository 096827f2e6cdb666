"""Load a Hugging Face model folder (config.json + *.safetensors) into the lean Transformer.

Hugging Face names map onto fused projections: q_proj|k_proj|v_proj -> qkv, gate_proj|up_proj -> gate_up.

bf16 where the skinny-GEMM kernel is available (`specdec.runtime.kernels`: gcc, AMX, AVX512-BF16 or AVX2 + FMA, not
disabled by SPECDEC_KERNEL=0 or SPECDEC_MATMUL=torch): the matmul weights (qkv, o, gate_up, down, LM head) and the embedding table are
kept in bf16 and everything else in fp32, so activations, attention and the KV cache run in fp32 and
the matmuls read half the bytes. Without the kernel, bf16 means every tensor in bf16 (torch's matmul).

q8 / q4 (passed as those strings): the projections and LM head come from the quantized cache
(`specdec.store.quantized`, built on first use) as QLinear; the embedding table is bf16, the rest fp32.
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from specdec.errors import SpecdecError
from specdec.runtime import kernels
from specdec.runtime.kernels import quant
from specdec.runtime.config import ModelConfig, read_json
from specdec.runtime.model import Linear, QLinear, Transformer

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}
QUANTIZED = quant.FORMATS  # "q8", "q4": quantized projections (`specdec.store.quantized`), passed as strings
CHOICES = ["auto", "fp32", "bf16", *QUANTIZED]  # what --dtype accepts
KV_DTYPES = {"auto": None, "fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}  # what --kv-dtype accepts


def cpu_has_bf16_matmul() -> bool:
    """True where the CPU multiplies bf16 natively (AMX or AVX512-BF16); elsewhere bf16 is emulated and slow."""
    return bool({"amx_bf16", "avx512_bf16"} & kernels.cpu_flags())


def gguf_is_q4(folder: str | Path | None) -> bool:
    """True when the model folder was converted from a GGUF file whose matrices are mostly 4-bit blocks
    (Q4_K, Q4_1, Q4_0: what `--dtype q4` keeps as they are), from the store's marker."""
    from specdec.store import MARKER

    marker = Path(folder) / MARKER if folder is not None else None
    if marker is None or not marker.is_file():
        return False
    types = read_json(marker).get("gguf_types") or {}
    q4 = sum(types.get(t, 0) for t in ("Q4_K", "Q4_1", "Q4_0"))
    return 2 * q4 > sum(v for t, v in types.items() if t != "F32")  # F32: norms and biases


DEVICES = ("cpu", "cuda")  # what --device accepts ("cuda:N" picks a GPU)


def resolve_device(name: str | None) -> torch.device:
    """`--device`: "cpu" (the default) or "cuda"/"cuda:N", torch's own kernels on a GPU. One clear error when
    the name is unknown or torch sees no such GPU."""
    if isinstance(name, torch.device):
        name = str(name)
    if name is not None and not isinstance(name, str):  # torch reads 0 as cuda:0; say so rather than guess
        raise SpecdecError(f"unknown device {name!r}: choose 'cpu', 'cuda' or 'cuda:N' (a string)")
    name = (name or "cpu").strip().lower()
    kind, colon, index = name.partition(":")  # "cpu:" / "cuda:" (no index) are unknown too, not torch's traceback
    if kind not in DEVICES or (colon and (kind != "cuda" or not index.isdigit())):
        raise SpecdecError(f"unknown device {name!r}: choose cpu, cuda or cuda:N")
    if kind == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise SpecdecError(f"--device {name}: torch sees no CUDA GPU (torch {torch.__version__}, "
                               "built with CUDA: " + ("yes" if torch.version.cuda else "no") + "); use --device cpu")
        if index and int(index) >= count:
            raise SpecdecError(f"--device {name}: torch sees {count} GPU(s), numbered 0..{count - 1}")
    return torch.device(name)


def resolve_dtype(name: str | None, folder: str | Path | None = None,
                  device: torch.device | str = "cpu") -> torch.dtype | str:
    """`None`/"auto": q4 for a model whose GGUF file holds 4-bit blocks, where the integer kernels run (its
    own precision: the blocks load losslessly, so the quality is the file's); else bf16 where the CPU has
    bf16 matmuls or the bf16 skinny-GEMM kernel works, else fp32. Says on stderr when it picks q4.
    "q8" / "q4" are returned as they are (quantized projections). On a GPU: bf16 (auto) or fp32; the
    quantized formats are CPU kernels and are refused there."""
    if torch.device(device).type != "cpu":
        if name in QUANTIZED:
            raise SpecdecError(f"--dtype {name} runs on specdec's CPU kernels only: use --dtype bf16 or fp32 "
                               f"with --device {device}, or --device cpu")
        if name in (None, "auto"):
            return torch.bfloat16
    if name in (None, "auto"):
        if gguf_is_q4(folder) and quant.isa() != "torch":
            print(f"specdec: --dtype auto: q4 (the GGUF's own 4-bit blocks, integer kernels on {quant.isa()})",
                  file=sys.stderr)
            return "q4"
        return torch.bfloat16 if cpu_has_bf16_matmul() or kernels.available() else torch.float32
    if name in QUANTIZED:
        return name
    check_dtype(name)
    return DTYPES[name]


def check_dtype(name: str | None) -> None:
    """A `--dtype` this loader knows (None is "auto"), checked without the model: SpecdecError otherwise."""
    if name is not None and name not in CHOICES:
        raise SpecdecError(f"unknown dtype {name!r}: choose one of {', '.join(CHOICES)}")


def _unreadable(file: Path, e: Exception) -> SpecdecError:
    return SpecdecError(f"{file}: unreadable weights ({e}): the file is damaged or truncated; re-download the model")


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
            raise _unreadable(f, e) from None
    return tensors


def open_weights(folder: Path) -> dict:
    """Weight name -> the open safetensors handle holding it, over every *.safetensors file of `folder` (read lazily:
    the quantized paths take one tensor at a time); a damaged file is one error naming it, as `_read_tensors` says."""
    where = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        try:
            handle = safe_open(str(f), framework="pt")
        except (SafetensorError, OSError) as e:
            raise _unreadable(f, e) from None
        where.update((name, handle) for name in handle.keys())
    return where


def _check_shapes(folder: Path, model: Transformer, state: dict[str, torch.Tensor]) -> None:
    """Every weight must have the shape config.json implies; else one line naming the first that does not."""
    expected = model.state_dict()
    for name, tensor in state.items():
        want = tuple(expected[name].shape)
        if tuple(tensor.shape) != want:
            raise SpecdecError(f"{folder / 'config.json'} disagrees with the weights: {name} has shape "
                               f"{list(tensor.shape)}, the config implies {list(want)} (check hidden_size, "
                               "intermediate_size, the head counts and vocab_size)")


def matmul_path(model: Transformer) -> str:
    """The path a loaded model's matmuls take: "q4/vnni512"-style for quantized projections, the bf16 kernel's
    ("amx", "avx512bf16", "avx2"), or "torch" (fp32, or bf16 in torch)."""
    if model.quantized:
        return f"{model.quantized}/{quant.isa()}"
    if model.device.type != "cpu":
        return f"torch/{model.device.type}"
    return model.lm_head.path or "torch"


def attention_path(model: Transformer) -> str:
    """Attention's path and the KV cache's dtype: "amx, bf16 cache"-style for the exact-attention kernel's
    instruction set (`kernels.attention.isa`), "torch, ..." where torch attends (not an exact model, off the host,
    or without the kernel: then row by row)."""
    from specdec.runtime.kernels import attention

    kv = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}.get(model.kv_dtype, str(model.kv_dtype))
    if model.device.type != "cpu" or not model.row_exact or not attention.available():
        return f"torch, {kv} cache"
    return f"{attention.isa(model.cfg.head_dim, model.kv_dtype)}, {kv} cache"


def prefill_path(model: Transformer) -> str:
    """The path prompt rows' matmuls take (`Transformer.prefill`): "q4/amx"-style where the quantized layers have a
    prefill ISA (`quant.prefill_isa`), else `matmul_path(model)`."""
    fused = model.fused_layers if model.quantized and model.device.type == "cpu" else None
    isa = next((name for name, code in quant.PREFILL_ISAS.items() if fused is not None and code == fused.prefill_isa),
               None)
    return f"{model.quantized}/{isa}" if isa else matmul_path(model)


def load_transformer(folder: str | Path, dtype: torch.dtype | str = torch.float32,
                     device: torch.device | str = "cpu", kv_dtype: str = "auto") -> Transformer:
    """The model in `folder` with weights in `dtype` (a torch dtype, or a name `resolve_dtype` takes: "bf16",
    "q4", "auto", ...) on `device` (`resolve_device`): on a GPU every weight is `dtype` and torch's kernels run it;
    on the CPU bf16 matmul weights take the kernel's path. `kv_dtype` (`KV_DTYPES`): the KV cache's element type,
    "auto" = `Transformer.kv_dtype`'s default (fp16 on the exact CPU paths, bf16 for bf16 weights with AMX)."""
    if kv_dtype not in KV_DTYPES:
        raise SpecdecError(f"unknown KV-cache dtype {kv_dtype!r}: choose one of {', '.join(KV_DTYPES)}")
    model = _load(Path(folder), dtype, torch.device(device))
    model.kv_choice = KV_DTYPES[kv_dtype]
    return model


def _load(folder: Path, dtype: torch.dtype | str, device: torch.device) -> Transformer:
    if isinstance(dtype, str) and dtype not in QUANTIZED:
        dtype = resolve_dtype(dtype, folder, device)
    if dtype in QUANTIZED:
        if device.type != "cpu":
            raise SpecdecError(f"--dtype {dtype} runs on specdec's CPU kernels only; use bf16 or fp32 on {device}")
        return _load_quantized(folder, dtype)
    cfg = ModelConfig.from_folder(folder)
    hf = _read_tensors(folder)
    path = kernels.matmul_path() if dtype == torch.bfloat16 and device.type == "cpu" else "torch"
    mixed = path != "torch"             # bf16 matmul weights on the kernel, fp32 everything else
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
    del state  # the model holds the weights now: repacking below frees each matrix as it goes
    if tied and kernels.packs(path):  # the table once, in the head's layout; the embedding gathers from it
        model.embed.pack()
    if tied:
        model.lm_head.weight = model.embed.weight
    if mixed:
        model.embed.out_dtype = torch.float32
        for m in model.modules():
            if isinstance(m, Linear):
                m.pack(path)  # one path for every forward of this model: decoding and verification agree
        if kernels.packs(path):
            _trim_heap()
    return model.to(device).eval()


def _trim_heap() -> None:
    """Hand the heap's freed pages back to the OS: glibc keeps the temporaries of repacking the weights
    otherwise (the 1.5B in bf16 stayed 0.7 GB larger resident). Nothing where there is no glibc."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _load_quantized(folder: Path, fmt: str) -> Transformer:
    """Projections and LM head from the quantized cache (`specdec.store.quantized`, built on first use); the
    embedding table in bf16 (looked up, never multiplied), norms and biases in fp32."""
    from specdec.store import quantized

    cfg = ModelConfig.from_folder(folder)
    weights, _ = quantized.load(folder, fmt)
    where = open_weights(folder)

    def take(name: str, to: torch.dtype = torch.float32) -> torch.Tensor:
        if name not in where:
            raise SpecdecError(f"{folder}: weight {name!r} is missing; the model folder is incomplete")
        return where[name].get_tensor(name).to(to)

    with torch.device("meta"):
        model = Transformer(cfg)
    state = {"embed.weight": take("model.embed_tokens.weight", torch.bfloat16), "norm.weight": take("model.norm.weight")}
    for i, block in enumerate(model.layers):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        state[f"layers.{i}.input_norm.weight"] = take(p + "input_layernorm.weight")
        state[f"layers.{i}.post_norm.weight"] = take(p + "post_attention_layernorm.weight")
        bias = torch.cat([take(a + f"{x}_proj.bias") for x in "qkv"]) if cfg.attention_bias else None
        block.qkv = QLinear(weights[f"layers.{i}.qkv"], bias)
        for name in ("o", "gate_up", "down"):
            setattr(block, name, QLinear(weights[f"layers.{i}.{name}"]))
    model.lm_head = QLinear(weights["lm_head"])
    model.load_state_dict(state, assign=True, strict=True)
    model.embed.out_dtype = torch.float32
    model.quantized = fmt
    return model.eval()
