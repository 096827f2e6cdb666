"""Convert a GGUF file into a plain Hugging Face model folder, once.

The folder holds `config.json`, `model.safetensors` (float32, dequantized exactly), the tokenizer
files (`tokenizer.json`, `tokenizer_config.json` with the chat template) and
`generation_config.json`. Config and tokenizer come from transformers' GGUF support; the weights
are dequantized here with gguf-py, one tensor at a time, and streamed into the safetensors file,
so memory stays at about one tensor (plus the memory-mapped GGUF) even for big models.
"""

from __future__ import annotations

import json
import re
import shutil
import struct
import tempfile
import warnings
from pathlib import Path

import numpy as np

from specdec.errors import SpecdecError

SUPPORTED_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}

# GGUF tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N.")
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Tensors llama.cpp stores that are not parameters of the Hugging Face model (derived from config).
_SKIP = {"rope_freqs.weight"}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face parameter name for a GGUF tensor name (None: not a model parameter)."""
    if gguf_name in _SKIP:
        return None
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    m = _BLOCK_RE.match(gguf_name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"
    raise SpecdecError(f"unexpected tensor {gguf_name!r} in the GGUF file: this converter knows llama and qwen2 models only")


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's row permutation of Q/K projections (convert_hf_to_gguf.py `permute`).

    llama.cpp reorders the rows of each head from HF's half-split rotary layout to interleaved
    pairs; this puts them back. Works for weights (rows x cols) and biases (rows)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_gguf(gguf_path: Path):
    """Open a GGUF file with gguf-py, turning parse failures into a clear error."""
    import gguf

    try:
        return gguf.GGUFReader(str(gguf_path))
    except Exception as e:  # gguf raises ValueError, struct.error, IndexError... on bad files
        raise SpecdecError(f"{gguf_path} is not a valid GGUF file ({type(e).__name__}: {e})") from e


def field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    try:
        return f.contents()
    except Exception:
        return default


def _safetensors_header(entries: list[tuple[str, tuple[int, ...]]], metadata: dict[str, str]) -> bytes:
    header: dict = {"__metadata__": metadata}
    offset = 0
    for name, shape in entries:
        nbytes = 4 * int(np.prod(shape, dtype=np.int64))
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # keep the data 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


def _missing(names: set[str], n_layer: int) -> list[str]:
    """The Hugging Face weights a llama / qwen2 model of `n_layer` layers needs that `names` lacks (biases and the
    output head are optional: qwen2 files have biases, tied models no head)."""
    need = ["model.norm.weight"] + [f"model.layers.{i}.{hf}.weight"
                                    for i in range(n_layer) for hf in _BLOCK_NAMES.values()]
    return [n for n in need if n not in names]


def _write_weights(reader, arch: str, n_head: int, n_head_kv: int, path: Path, progress: bool) -> dict:
    """Dequantize every tensor to float32 and stream them into one safetensors file."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    from tqdm import tqdm

    plan = []  # (hf name, tensor, numpy shape)
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            continue
        shape = tuple(int(d) for d in reversed([int(x) for x in t.shape]))  # GGUF lists dims innermost first
        plan.append((name, t, shape))
    names = [p[0] for p in plan]
    if len(set(names)) != len(names):
        raise SpecdecError("the GGUF file has duplicate tensors")
    if "model.embed_tokens.weight" not in names:
        raise SpecdecError("the GGUF file has no token embedding (token_embd.weight)")
    n_layer = int(field(reader, f"{arch}.block_count", 0) or 0)
    missing = _missing(set(names), n_layer)
    if missing:
        raise SpecdecError(f"the GGUF file is incomplete: {len(missing)} weight(s) a {arch} model of {n_layer} layers "
                           f"needs are missing, the first {missing[0]}")
    plan.sort(key=lambda p: p[0])
    header = _safetensors_header([(n, s) for n, _, s in plan], {"format": "pt"})
    types: dict[str, int] = {}
    with open(path, "wb") as out, tqdm(
        total=len(plan), desc="converting", unit="tensor", disable=not progress, leave=True
    ) as bar:
        out.write(header)
        for name, t, shape in plan:
            qtype = GGMLQuantizationType(int(t.tensor_type))
            types[qtype.name] = types.get(qtype.name, 0) + 1
            try:
                w = dequantize(t.data, qtype)
            except NotImplementedError as e:
                raise SpecdecError(f"cannot dequantize {t.name}: {e}") from e
            w = np.asarray(w, dtype=np.float32).reshape(shape)
            if arch == "llama" and (".attn_q." in t.name or ".attn_k." in t.name):
                w = unpermute_qk(w, n_head if ".attn_q." in t.name else n_head_kv)
            out.write(np.ascontiguousarray(w, dtype="<f4").tobytes())
            bar.update(1)
    return {"tensors": len(plan), "gguf_types": types}


def _gguf_source_dir(gguf_path: Path, scratch: Path) -> tuple[str, str]:
    """transformers loads GGUF as (folder, file name); give it a folder holding only that file."""
    d = scratch / "src"
    d.mkdir()
    link = d / "model.gguf"
    try:
        link.symlink_to(gguf_path.resolve())
    except OSError:
        shutil.copyfile(gguf_path, link)
    return str(d), link.name


def _token_id(tokenizer, token: str) -> int | None:
    tid = tokenizer.convert_tokens_to_ids(token)
    return tid if isinstance(tid, int) and tid != tokenizer.unk_token_id else None


def convert_gguf(gguf_path: Path, out_dir: Path, progress: bool = True) -> dict:
    """Convert `gguf_path` into a Hugging Face model folder at `out_dir` (created; must not exist).

    Returns a small summary (architecture, tensor counts, GGUF model name). On failure nothing is
    left at `out_dir`. Callers wanting atomic publication should convert into a temporary folder
    and rename it (the store does)."""
    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    if not gguf_path.is_file():
        raise SpecdecError(f"no such GGUF file: {gguf_path}")
    if out_dir.exists():
        raise SpecdecError(f"{out_dir} already exists; remove it or choose another folder")
    reader = read_gguf(gguf_path)
    arch = str(field(reader, "general.architecture", ""))
    if arch not in SUPPORTED_ARCHITECTURES:
        raise SpecdecError(
            f"{gguf_path.name}: architecture {arch or '(none)'!r} is not supported; "
            f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
        )
    n_head = int(field(reader, f"{arch}.attention.head_count", 0))
    n_head_kv = int(field(reader, f"{arch}.attention.head_count_kv", n_head))
    if n_head <= 0:
        raise SpecdecError(f"{gguf_path.name}: missing {arch}.attention.head_count")
    if field(reader, "tokenizer.ggml.tokens") is None:
        raise SpecdecError(f"{gguf_path.name}: the GGUF file has no tokenizer (tokenizer.ggml.tokens)")
    gguf_name = field(reader, "general.name")
    tensor_names = {t.name for t in reader.tensors}
    tied = "output.weight" not in tensor_names

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    out_dir.mkdir()
    try:
        with tempfile.TemporaryDirectory(prefix=".gguf-src-", dir=out_dir.parent) as scratch:
            src, fname = _gguf_source_dir(gguf_path, Path(scratch))
            summary = _write_weights(reader, arch, n_head, n_head_kv, out_dir / "model.safetensors", progress)
            del reader
            _write_config_and_tokenizer(src, fname, arch, tied, out_dir, progress, gguf_path.name)
        summary.update(architecture=arch, gguf_name=gguf_name, tied_embeddings=tied)
        return summary
    except BaseException:
        shutil.rmtree(out_dir, ignore_errors=True)
        raise


def _write_config_and_tokenizer(src: str, fname: str, arch: str, tied: bool, out_dir: Path, progress: bool,
                                name: str) -> None:
    """config.json, the tokenizer files and generation_config.json from transformers' reading of the GGUF
    (`fname` in `src`); `name`: the file as the user knows it, for errors."""
    from tqdm import tqdm
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with tqdm(total=2, desc="config+tokenizer", unit="step", disable=not progress) as bar, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:  # a malformed or unusual file fails deep inside transformers (KeyError, TypeError...)
                config = AutoConfig.from_pretrained(src, gguf_file=fname)
                bar.update(1)
                tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=fname)
                bar.update(1)
            except Exception as e:  # noqa: BLE001
                raise SpecdecError(f"{name}: transformers cannot read the GGUF's config or tokenizer "
                                   f"({type(e).__name__}: {' '.join(str(e).split())})") from e
    finally:
        hf_logging.set_verbosity(verbosity)

    # config.json: a plain float32 checkpoint, no trace of the GGUF quantization
    for attr in ("quantization_config", "_model_name_or_path"):
        if hasattr(config, attr):
            try:
                delattr(config, attr)
            except AttributeError:
                pass
    config.architectures = [SUPPORTED_ARCHITECTURES[arch]]
    config.tie_word_embeddings = tied
    config.dtype = "float32"
    config.save_pretrained(out_dir)
    cfg_path = out_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("quantization_config", None)
    cfg.pop("_model_name_or_path", None)
    cfg.pop("_name_or_path", None)
    cfg["torch_dtype"] = "float32"  # transformers 4.x spelling; 5.x reads "dtype"
    cfg["dtype"] = "float32"
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")

    # tokenizer files; the chat template also goes into tokenizer_config.json
    tokenizer.save_pretrained(out_dir)
    tc_path = out_dir / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    for k in ("is_local", "local_files_only", "name_or_path"):
        tc.pop(k, None)
    if tc.get("tokenizer_class") == "TokenizersBackend":  # transformers 5's generic class; 4.x knows this name
        tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    template = getattr(tokenizer, "chat_template", None)
    if template:
        tc["chat_template"] = template
    tc_path.write_text(json.dumps(tc, indent=2, ensure_ascii=False) + "\n")

    # generation_config.json: stop on the GGUF's end tokens
    eos = [config.eos_token_id] if isinstance(config.eos_token_id, int) else list(config.eos_token_id or [])
    if arch == "qwen2":  # upstream Qwen2.5 instruct models also stop on <|endoftext|>
        tid = _token_id(tokenizer, "<|endoftext|>")
        if tid is not None and tid not in eos:
            eos.append(tid)
    gen = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=eos[0] if len(eos) == 1 else eos,
        pad_token_id=getattr(config, "pad_token_id", None),
    )
    gen.save_pretrained(out_dir)
