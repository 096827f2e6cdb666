"""Trained heads on disk: `heads.safetensors` + `config.json`, tied to one target by a fingerprint.

A heads folder (Medusa now, EAGLE later) holds the tensors and a small JSON config naming the kind,
the target (name and fingerprint), the shape and how it was trained. Loading checks the fingerprint
against the model in use and refuses heads made for another target with one clear line.

Where `--method medusa` looks (first found): `--heads DIR`; the store,
`~/.cache/specdec/heads/<model>/medusa/` (what `specdec train medusa` writes); heads shipped inside the
package, `specdec/heads/<model>/medusa/` (smollm2-135m).

The fingerprint is sha256 over the model folder's config.json and, for each weight file, its size and
64 KiB from its middle: cheap, independent of the dtype the weights are loaded in, different for
another checkpoint of the same architecture.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from specdec.errors import SpecdecError

WEIGHTS, CONFIG = "heads.safetensors", "config.json"
FORMAT = 1
SHIPPED = Path(__file__).resolve().parent.parent / "heads"


def fingerprint(folder: str | Path, legacy: bool = False) -> str:
    """A target's identity for the heads trained on it: its config (less the transformers version that wrote it,
    which changes when the model is converted again under a newer transformers) and a slice of each weights file.
    legacy: the config's bytes as written, version included (heads trained before session 26 carry that one)."""
    folder = Path(folder)
    h = hashlib.sha256()
    config = folder / "config.json"
    if config.exists():
        if legacy:
            h.update(config.read_bytes())
        else:
            fields = json.loads(config.read_text())
            fields.pop("transformers_version", None)
            h.update(json.dumps(fields, sort_keys=True).encode())
    for f in sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.gguf")):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with f.open("rb") as fh:
            fh.seek(size // 2)
            h.update(fh.read(65536))
    return h.hexdigest()[:16]


def target_fingerprint(folder: str | Path, claimed: str | None) -> str:
    """The fingerprint to hold a head's `claimed` one against: the legacy one when that is what it claims (hashed
    only when the current one does not match, so a current head reads the weights' slices once)."""
    current = fingerprint(folder)
    if claimed == current:
        return current
    legacy = fingerprint(folder, legacy=True)
    return legacy if claimed == legacy else current


def _safe(model: str) -> str:
    return "".join(c if c.isalnum() or c in "-._" else "_" for c in Path(model).name)


def store_dir(model: str, kind: str) -> Path:
    """Where `specdec train KIND --model NAME` writes by default."""
    from specdec.store import home

    return home() / "heads" / _safe(model) / kind


def find(model: str, kind: str, given: str | Path | None = None) -> Path:
    """The heads folder for `model`: `given`, else the store's, else the package's shipped heads."""
    if given is not None:
        folder = Path(given).expanduser()
        if not (folder / CONFIG).exists():
            raise SpecdecError(f"{folder}: no {CONFIG} here: pass a folder written by `specdec train {kind}`")
        return folder
    for folder in (store_dir(model, kind), SHIPPED / _safe(model) / kind):
        if (folder / CONFIG).exists():
            return folder
    raise SpecdecError(f"no {kind} heads for {model}: train them with `specdec train {kind} --model {model}` "
                       f"or pass --heads DIR")


def save(folder: str | Path, tensors: dict[str, torch.Tensor], config: dict) -> Path:
    """Write the tensors and the config (config last: its presence means the folder is complete)."""
    from specdec.store import write_safetensors

    folder = Path(folder)
    write_safetensors(folder / WEIGHTS, tensors)
    tmp = folder / (CONFIG + ".tmp")
    tmp.write_text(json.dumps({"format": FORMAT, **config}, indent=2))
    os.replace(tmp, folder / CONFIG)
    return folder


def kind_of(config: dict) -> str | None:
    """The kind of heads a config.json describes: ours name it ("medusa"; "eagle" in its "specdec" block), a
    published EAGLE-3 head names its architecture; None for anything else (a model's own config.json)."""
    there = config.get("kind") or (config.get("specdec") or {}).get("kind")
    if there is None and "LlamaForCausalLMEagle3" in (config.get("architectures") or []):
        there = "eagle"
    return there


def load(folder: str | Path, kind: str, target_folder: str | Path, target_name: str) -> tuple[dict, dict]:
    """(tensors, config) of a heads folder, after checking it was made for this target."""
    from specdec.store import read_safetensors

    folder = Path(folder)
    again = f"train them again with `specdec train {kind}`, or copy the folder again"
    try:
        config = json.loads((folder / CONFIG).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise SpecdecError(f"{folder / CONFIG}: damaged or unreadable ({e}): {again}") from None
    if config.get("kind") != kind:
        there = kind_of(config)
        what = f"{there!r} heads" if there else "no specdec heads (its config.json names no kind)"
        raise SpecdecError(f"{folder} holds {what}, not {kind!r}: pass a folder written by `specdec train {kind}`")
    target = config.get("target", {})
    if target.get("fingerprint") != target_fingerprint(target_folder, target.get("fingerprint")):
        raise SpecdecError(
            f"{folder}: these {kind} heads were trained for {target.get('name')!r} (fingerprint "
            f"{target.get('fingerprint')}), not for {target_name!r}: train heads for it with "
            f"`specdec train {kind} --model {target_name}`")
    return read_safetensors(folder / WEIGHTS, again), config
