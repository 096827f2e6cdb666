"""The frozen target's hidden states over a corpus, computed once and cached memory-mapped on disk.

Every head trained from a target (Medusa now, EAGLE later) learns from the same thing: for each corpus
position t, the target's last hidden state h_t (the final norm's output, what the LM head reads) and
the token the target itself predicts next, argmax LM(h_t). One pass of the target over the corpus
fills four arrays (`.npy` files, opened with `np.load(mmap_mode="r")`):

    hidden  [N, D] float16   h_t
    labels  [N]    int32     argmax of the target's logits at t (its prediction for token t + 1)
    tokens  [N]    int32     the corpus token at t
    doc     [N]    int32     document index (heads never learn across a document boundary)

`meta.json` is written last: a folder without it is an interrupted build, which the next build of the
same settings continues (`progress.json`). The folder
name is a hash of the target's fingerprint and the corpus settings, so a second training run (more
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

ARRAYS = ("hidden", "labels", "tokens", "doc")


@dataclass
class HiddenCache:
    folder: Path
    meta: dict
    hidden: np.ndarray
    labels: np.ndarray
    tokens: np.ndarray
    doc: np.ndarray

    @classmethod
    def open(cls, folder: str | Path) -> "HiddenCache":
        folder = Path(folder)
        meta = json.loads((folder / "meta.json").read_text())
        n = meta["tokens"]
        arrays = {a: np.load(folder / f"{a}.npy", mmap_mode="r")[:n] for a in ARRAYS}
        return cls(folder, meta, **arrays)

    def __len__(self) -> int:
        return int(self.meta["tokens"])


def cache_dir(root: Path, settings: dict) -> Path:
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    return root / key


def build(model, docs: Iterable[list[int]], folder: str | Path, max_tokens: int, settings: dict,
          progress: bool = True, save_every: float = 30.0) -> HiddenCache:
    """Run the target over the token documents (each one forward, fresh cache) until `max_tokens`
    positions are cached; reuse the folder when a complete cache with these settings is there. An
    interrupted build continues where its last `progress.json` (written every `save_every` seconds) left
    it: the documents come in the same order, so the first ones done are skipped."""
    from tqdm import tqdm

    folder = Path(folder)
    if (folder / "meta.json").exists():
        return HiddenCache.open(folder)
    done = folder / "progress.json"
    n = ndocs = 0
    if done.exists():
        n, ndocs = (json.loads(done.read_text())[k] for k in ("tokens", "documents"))
        out = {a: np.load(folder / f"{a}.npy", mmap_mode="r+") for a in ARRAYS}
    else:
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        d = model.cfg.hidden_size
        out = {"hidden": np.lib.format.open_memmap(folder / "hidden.npy", "w+", np.float16, (max_tokens, d))}
        for a in ARRAYS[1:]:
            out[a] = np.lib.format.open_memmap(folder / f"{a}.npy", "w+", np.int32, (max_tokens,))

    def save(path: Path, info: dict) -> None:
        for a in out.values():
            a.flush()
        path.write_text(json.dumps(info, indent=2))

    bar = tqdm(total=max_tokens, initial=n, unit="tok", unit_scale=True, desc="target hidden states",
               disable=not progress)
    last = time.monotonic()
    with torch.inference_mode():
        for i, ids in enumerate(docs):
            if i < ndocs:
                continue  # cached by an earlier, interrupted build
            if max_tokens - n < 3:
                break
            ids = ids[:max_tokens - n]
            fwd = model(torch.tensor([ids]), model.new_cache(len(ids)), hidden_layers=(-1,))
            m = len(ids)
            out["hidden"][n:n + m] = fwd.hidden[-1][0].to(torch.float16).numpy()
            out["labels"][n:n + m] = fwd.logits[0].argmax(-1).numpy()
            out["tokens"][n:n + m] = ids
            out["doc"][n:n + m] = ndocs
            n, ndocs = n + m, ndocs + 1
            bar.update(m)
            if time.monotonic() - last > save_every:
                save(done, {"tokens": n, "documents": ndocs})
                last = time.monotonic()
    bar.close()
    save(folder / "meta.json", {**settings, "tokens": n, "documents": ndocs, "hidden_size": out["hidden"].shape[1]})
    done.unlink(missing_ok=True)
    return HiddenCache.open(folder)
