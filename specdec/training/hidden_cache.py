"""The frozen target's hidden states over a corpus, computed once and cached memory-mapped on disk.

Every head trained from a target (Medusa, EAGLE) learns from the same thing: for each corpus position t,
the target's hidden features at t and the token the target itself predicts next, argmax LM(h_t). One
pass of the target over the corpus fills four arrays (`.npy` files, opened with `np.load(mmap_mode="r")`):

    hidden  [N, D] float16   h_t, the final norm's output (what the LM head reads; Medusa), or
    features [N, k·D] float16  with `layers=(i1, ..., ik)`: the outputs of those decoder layers (before
                             the final norm), concatenated in that order (EAGLE: k = 3 low, middle and
                             high layers for EAGLE-3, k = 1 the last layer for EAGLE-1)
    labels  [N]    int32     argmax of the target's logits at t (its prediction for token t + 1)
    tokens  [N]    int32     the corpus token at t
    doc     [N]    int32     document index (heads never learn across a document boundary)

`meta.json` is written last: a folder without it is an interrupted build, which the next build of the
same settings continues (`progress.json`). The folder
name is a hash of the target's fingerprint and the corpus settings (the layers included when given; a
cache without them keeps its old name), so a second training run (more
epochs, other heads) costs no target passes. Example: SmolLM2-135M (D = 576) over 100k tokens is
115 MB of hidden states.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np
import torch

INTS = ("labels", "tokens", "doc")


@dataclass
class HiddenCache:
    folder: Path
    meta: dict
    labels: np.ndarray
    tokens: np.ndarray
    doc: np.ndarray
    hidden: np.ndarray | None = None    # [N, D], a cache built without layers
    features: np.ndarray | None = None  # [N, k·D], a cache built with layers=meta["layers"]

    @classmethod
    def open(cls, folder: str | Path) -> "HiddenCache":
        folder = Path(folder)
        meta = json.loads((folder / "meta.json").read_text())
        n = meta["tokens"]
        data = {a: np.load(folder / f"{a}.npy", mmap_mode="r")[:n] for a in arrays(meta.get("layers"))}
        return cls(folder, meta, **data)

    def __len__(self) -> int:
        return int(self.meta["tokens"])


def arrays(layers) -> tuple[str, ...]:
    """The arrays of a cache built with these layers (None: Medusa's last hidden state)."""
    return ("features" if layers else "hidden",) + INTS


def cache_dir(root: Path, settings: dict) -> Path:
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    return root / key


def cached_documents(folder: str | Path) -> int:
    """How many documents an interrupted build in `folder` has cached (0: none, or the cache is complete), so a
    caller whose documents are costly to make (`--regenerate`'s answers) can skip making them again."""
    folder = Path(folder)
    if (folder / "meta.json").exists() or not (folder / "progress.json").exists():
        return 0
    return int(json.loads((folder / "progress.json").read_text())["documents"])


def build(model, docs: Iterable[list[int]], folder: str | Path, max_tokens: int, settings: dict,
          progress: bool = True, save_every: float = 30.0, layers: tuple[int, ...] | None = None,
          batch: int = 1) -> HiddenCache:
    """Run the target over the token documents (fresh cache each forward) until `max_tokens`
    positions are cached; reuse the folder when a complete cache with these settings is there.
    `layers`: cache those decoder layers' outputs as `features` instead of the final hidden state
    (the caller puts them in `settings`, which names the folder). An
    interrupted build continues where its last `progress.json` (written every `save_every` seconds) left
    it: the documents come in the same order, so the first ones done are skipped (they may come as None).
    `batch` documents share one forward (a GPU's gain; on a CPU one document a forward is as fast per token)."""
    from tqdm import tqdm

    folder = Path(folder)
    names = arrays(layers)
    if (folder / "meta.json").exists():
        return HiddenCache.open(folder)
    done = folder / "progress.json"
    n = ndocs = 0
    if done.exists():
        n, ndocs = (json.loads(done.read_text())[k] for k in ("tokens", "documents"))
        out = {a: np.load(folder / f"{a}.npy", mmap_mode="r+") for a in names}
    else:
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        width = model.cfg.hidden_size * (len(layers) if layers else 1)
        out = {names[0]: np.lib.format.open_memmap(folder / f"{names[0]}.npy", "w+", np.float16, (max_tokens, width))}
        for a in INTS:
            out[a] = np.lib.format.open_memmap(folder / f"{a}.npy", "w+", np.int32, (max_tokens,))

    def save(path: Path, info: dict) -> None:
        for a in out.values():
            a.flush()
        tmp = path.with_suffix(".tmp")  # atomic: Ctrl-C mid-write never leaves a half-written progress/meta file
        tmp.write_text(json.dumps(info, indent=2))
        tmp.replace(path)

    bar = tqdm(total=max_tokens, initial=n, unit="tok", unit_scale=True, desc="target hidden states",
               disable=not progress)
    last = time.monotonic()

    def run(group: list[list[int]]) -> None:
        """One forward over `group` (right-padded: causal attention keeps padding out of the real rows)."""
        nonlocal n, ndocs
        width = max(len(ids) for ids in group)
        tokens = torch.tensor([ids + [0] * (width - len(ids)) for ids in group])
        fwd = model(tokens, model.new_cache(width, batch=len(group)), hidden_layers=layers or (-1,), on_device=True)
        feats = torch.cat([fwd.hidden[i] for i in layers], -1) if layers else fwd.hidden[-1]
        feats, labels = feats.to(torch.float16).cpu().numpy(), fwd.logits.argmax(-1).cpu().numpy()
        for b, ids in enumerate(group):
            m = len(ids)
            out[names[0]][n:n + m] = feats[b, :m]
            out["labels"][n:n + m] = labels[b, :m]
            out["tokens"][n:n + m] = ids
            out["doc"][n:n + m] = ndocs
            n, ndocs = n + m, ndocs + 1
            bar.update(m)

    with torch.inference_mode():
        group, planned = [], n
        for i, ids in enumerate(docs):
            if i < ndocs:
                continue  # cached by an earlier, interrupted build
            if max_tokens - planned < 3:
                break
            ids = list(ids[:max_tokens - planned])
            group.append(ids)
            planned += len(ids)
            if len(group) == batch:
                run(group)
                group = []
                if time.monotonic() - last > save_every:
                    save(done, {"tokens": n, "documents": ndocs})
                    last = time.monotonic()
        if group:
            run(group)
    bar.close()
    meta = {**settings, "tokens": n, "documents": ndocs, "hidden_size": out[names[0]].shape[1] // len(layers or (1,))}
    save(folder / "meta.json", {**meta, "layers": list(layers)} if layers else meta)
    done.unlink(missing_ok=True)
    return HiddenCache.open(folder)
