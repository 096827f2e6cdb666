"""Train Medusa heads against the frozen target, from the hidden-state cache (`hidden_cache`).

For each cached position t of a training document, head i learns the token the target itself predicts
at t + i + 1 (labels[t + i + 1], the target's guess for token t + i + 2), by cross-entropy over the
draft vocabulary through the frozen LM head's rows: the heads learn what verification will accept.
Positions whose label lies beyond the document, or outside the draft vocabulary, are left out of the
loss (and count as misses in the accuracies).

The last `val_fraction` of the documents is held out: per-head top-1 and top-5 accuracy, and acc[i][r]
(head i's rank-r candidate is the label), which calibrates the sparse tree
(`specdec.drafters.medusa.calibrated_paths`). Example (the shipped SmolLM2-135M heads, 100k ShareGPT
tokens, 3 epochs, 15 min on one loaded core): top-1 0.25 / 0.15 / 0.13 / 0.11 for heads 0-3, top-5 0.45 /
0.30 / 0.27 / 0.25.

Checkpoints (`checkpoint.pt`: heads, optimizer, epoch and batch) are written every `checkpoint_every`
steps, at each epoch's end and on Ctrl-C, atomically, so `resume=True` continues an interrupted run
exactly where its last checkpoint left it (the batch order is a function of the seed and the epoch).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from specdec.drafters.medusa import MAX_TREE, MedusaHeads, calibrated_paths, path_probability
from specdec.errors import SpecdecError
from specdec.training.hidden_cache import HiddenCache

RANKS = 8          # candidates per head whose accuracy is measured (the widest tree sibling set)
CHECKPOINT = "checkpoint.pt"
CHECKPOINT_STATE = ("epoch", "batch", "step", "val", "seconds", "loss")


@dataclass
class TrainSettings:
    heads: int = 4
    epochs: int = 2
    batch: int = 256
    lr: float = 1e-3
    draft_vocab: int = 8192
    val_fraction: float = 0.05
    val_max: int = 4096
    checkpoint_every: int = 100
    seed: int = 0


class Examples:
    """Train/validation positions and per-head labels in draft-vocabulary indices (-1 = left out)."""

    def __init__(self, cache: HiddenCache, s: TrainSettings):
        n, k = len(cache), s.heads
        if n == 0:  # no document of 3+ tokens (an empty file, or jsonl rows with none of the fields read)
            raise SpecdecError("the corpus is empty: no document of 3+ tokens (.jsonl rows need \"messages\", "
                               "\"conversations\" or \"text\"): check --data")
        doc, labels = np.asarray(cache.doc), np.asarray(cache.labels)
        ndocs = int(doc[-1]) + 1
        first_val = min(ndocs - 1, math.ceil(ndocs * (1 - s.val_fraction))) if ndocs > 1 else ndocs
        full = np.full((n, k), -1, dtype=np.int64)  # [N, K] target token ids, -1 beyond the document
        for i in range(k):
            j = np.arange(n) + i + 1
            ok = j < n
            ok[ok] &= doc[j[ok]] == doc[:n][ok]
            full[ok, i] = labels[j[ok]]
        train = doc < first_val
        if not train.any():
            raise SpecdecError("the corpus is too small: need at least two documents")
        counts = np.bincount(labels[train], minlength=int(labels.max()) + 1)
        self.vocab = np.argsort(-counts, kind="stable")[:min(s.draft_vocab, int((counts > 0).sum()))]
        remap = np.full(max(int(labels.max()), int(full.max())) + 1, -1, dtype=np.int64)
        remap[self.vocab] = np.arange(len(self.vocab))
        self.full = full
        self.target = np.where(full >= 0, remap[np.maximum(full, 0)], -1)
        self.coverage = float((remap[labels[train]] >= 0).mean())
        usable = (self.target >= 0).any(1)
        self.train = np.nonzero(train & usable)[0]
        val = np.nonzero(~train & (full[:, 0] >= 0))[0]
        if not len(val):  # one document (a single .txt file is one), or held-out documents of one token
            raise SpecdecError("the corpus is too small: need at least two documents of 2+ tokens (the last "
                               f"{s.val_fraction:.0%} of them are held out for validation)")
        rng = np.random.default_rng(s.seed)
        self.val = np.sort(rng.choice(val, min(len(val), s.val_max), replace=False))


def _batch(cache: HiddenCache, idx: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.asarray(cache.hidden[idx], dtype=np.float32))


@torch.no_grad()
def evaluate(heads: MedusaHeads, lm_rows: torch.Tensor, cache: HiddenCache, ex: Examples) -> dict:
    """Per head: top-1, top-5 and by-rank accuracy on the validation positions (labels beyond the
    document are not counted; labels outside the draft vocabulary count as misses), and the by-rank
    accuracy of head i among the positions where heads 0 .. i-1 all had their label within the top
    RANKS ("after_hits"): heads are right together far more often than independence predicts, and a
    tree path is reached only when its earlier heads were right."""
    k = heads.num_heads
    ranks = []  # per batch [B, K]: the label's rank among each head's candidates, RANKS = not there
    valid = []
    for start in range(0, len(ex.val), 1024):
        idx = ex.val[start:start + 1024]
        logits = heads(_batch(cache, idx)) @ lm_rows.t()  # [B, K, Vd]
        top = logits.topk(min(RANKS, logits.shape[-1]), dim=-1).indices.numpy()  # [B, K, R] (R < RANKS: a tiny vocab)
        target = ex.target[idx]  # [B, K]
        hit = (top == target[:, :, None]) & (target[:, :, None] >= 0)
        ranks.append(np.where(hit.any(-1), hit.argmax(-1), RANKS))
        valid.append(ex.full[idx] >= 0)
    rank, valid = np.concatenate(ranks), np.concatenate(valid)
    by_rank, after_hits = [], []
    reached = np.ones(len(rank), dtype=bool)
    for i in range(k):
        counts = np.bincount(rank[valid[:, i], i], minlength=RANKS + 1)[:RANKS]
        by_rank.append((counts / max(valid[:, i].sum(), 1)).tolist())
        sel = valid[:, i] & reached
        counts = np.bincount(rank[sel, i], minlength=RANKS + 1)[:RANKS]
        after_hits.append((counts / max(sel.sum(), 1)).tolist())
        reached &= rank[:, i] < RANKS
    return {"top1": [r[0] for r in by_rank], "top5": [sum(r[:5]) for r in by_rank], "by_rank": by_rank,
            "after_hits": after_hits, "positions": int(valid[:, 0].sum())}


def save_checkpoint(path: Path, state: dict) -> None:
    """Write a training checkpoint atomically (Ctrl-C mid-write leaves the previous one)."""
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


RESUME_FREE = ("epochs", "checkpoint_every")  # what a resumed Medusa run may change: more epochs are fine
KEY = {"medusa": "heads", "eagle": "head"}  # the weights' key in each trainer's checkpoint


def load_checkpoint(path: Path, kind: str, map_location=None) -> dict:
    """The checkpoint `specdec train KIND` left in `path`, or one line when it is damaged (cut short by a full disk
    or a copy) or another trainer's (a Medusa run's --out given to `train eagle --resume`)."""
    import pickle
    import zipfile

    try:
        ck = torch.load(path, weights_only=False, map_location=map_location)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise SpecdecError(f"{path} is damaged or unreadable ({first}): drop --resume to train from the start"
                           ) from None
    there = next((k for k, key in KEY.items() if isinstance(ck, dict) and key in ck), None)
    if there != kind:
        what = f"a {there} training checkpoint" if there else "not a specdec training checkpoint"
        raise SpecdecError(f"{path} is {what}, not {kind}'s: give the --out of the interrupted `specdec train "
                           f"{kind}` run, or drop --resume to start over")
    return ck


class StepBoundary:
    """Ctrl-C (SIGINT) during a training step is held until the step ends: `at_boundary()` then raises
    KeyboardInterrupt, and leaving the block on it calls `save`, so the checkpoint written on Ctrl-C never holds
    weights one optimizer step ahead of its step count (or a half-applied step). A second Ctrl-C raises at once,
    mid-step, and then (as for a KeyboardInterrupt raised anywhere but `at_boundary`) nothing is saved: the last
    periodic checkpoint stays. A Ctrl-C after the last `at_boundary()` saves and raises as the block ends.
    Installed only in the main thread over Python's default handler (elsewhere Ctrl-C reaches no training thread).

        with StepBoundary(checkpoint) as boundary:
            for batch in batches:
                step(batch)
                boundary.at_boundary()"""

    def __init__(self, save=lambda: None):
        self.save = save
        self.pending = self.clean = False  # clean: raised at a step's end, where the state is whole
        self.old = None

    def _handler(self, signum, frame):
        if self.pending:
            raise KeyboardInterrupt
        self.pending = True

    def __enter__(self) -> "StepBoundary":
        import signal
        import threading

        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
            self.old = signal.signal(signal.SIGINT, self._handler)
        return self

    def at_boundary(self) -> None:
        if self.pending:
            self.pending, self.clean = False, True
            raise KeyboardInterrupt

    def __exit__(self, kind, value, traceback) -> None:
        import signal

        if self.old is not None:
            signal.signal(signal.SIGINT, self.old)
            self.old = None
        if kind is None and self.pending:  # Ctrl-C after the last step's end: the block finished whole
            self.save()
            raise KeyboardInterrupt
        if kind is KeyboardInterrupt and self.clean:
            self.save()


def check_resumable(path: Path, ck: dict, settings: dict, meta: dict | None, free=("checkpoint_every",)) -> None:
    """Refuse to resume a checkpoint made with other settings or data (`meta`: the hidden cache's; None: not
    compared), naming what differs; the settings in `free` (how often to checkpoint; Medusa: the number of epochs)
    may change between runs."""
    theirs = ck.get("settings", {})
    differ = [f"{k} {theirs.get(k)} (now {v})" for k, v in settings.items()
              if k not in free and theirs.get(k) != v]
    if meta is not None and ck.get("cache") != meta:
        differ.append("the corpus or its hidden states (--data, --tokens, --max-len, --regenerate)")
    if differ:
        raise SpecdecError(f"{path} was made with other settings or data: {', '.join(differ)}; pass the same ones, "
                           "or drop --resume to start over")


def check_epochs(path: Path, epoch: int, batch_no: int, epochs: int) -> None:
    """A resume may raise --epochs, never cut it below the epochs the checkpoint has (partly) trained: those would
    be kept and the heads' report would name fewer epochs than they had."""
    done = epoch + (batch_no > 0)
    if epochs < done:
        raise SpecdecError(f"--epochs {epochs}: {path} has trained {epoch} epoch(s)"
                           + (f" and {batch_no} step(s) of the next" if batch_no else "")
                           + f"; pass --epochs {done} or more, or drop --resume to start over")


def train(cache: HiddenCache, lm_weight: torch.Tensor, s: TrainSettings, out: str | Path, resume: bool = False,
          progress: bool = True) -> tuple[dict, dict]:
    """Train K heads from the cache; returns (tensors, report) for `specdec.training.heads.save`.
    `lm_weight` [V, D]: the target's frozen LM head."""
    from tqdm import tqdm

    out = Path(out)
    ckpt_path = out / CHECKPOINT
    ex = Examples(cache, s)  # a corpus too small is refused before --out is made (no empty folder left behind)
    out.mkdir(parents=True, exist_ok=True)
    lm_rows = lm_weight.detach().float()[torch.from_numpy(ex.vocab)]  # [Vd, D], frozen
    torch.manual_seed(s.seed)
    heads = MedusaHeads(s.heads, cache.meta["hidden_size"])
    opt = torch.optim.AdamW(heads.parameters(), lr=s.lr, weight_decay=0.0)
    epoch, batch_no, step, val, seconds, last_loss = 0, 0, 0, None, 0.0, None
    if resume and ckpt_path.exists():
        ck = load_checkpoint(ckpt_path, "medusa")
        check_resumable(ckpt_path, ck, asdict(s), cache.meta, free=RESUME_FREE)
        heads.load_state_dict(ck["heads"])
        opt.load_state_dict(ck["opt"])
        epoch, batch_no, step, val, seconds, last_loss = (ck[k] for k in CHECKPOINT_STATE)
        check_epochs(ckpt_path, epoch, batch_no, s.epochs)
    elif resume:
        raise SpecdecError(f"--resume: no checkpoint in {out}")
    per_epoch = math.ceil(len(ex.train) / s.batch)
    target = torch.from_numpy(ex.target)

    def checkpoint():
        save_checkpoint(ckpt_path, dict(heads=heads.state_dict(), opt=opt.state_dict(), epoch=epoch,
                                         batch=batch_no, step=step, val=val, seconds=seconds, loss=last_loss,
                                         settings=asdict(s), cache=cache.meta))

    bar = tqdm(total=per_epoch * s.epochs, initial=step, unit="step", desc="training medusa heads",
               disable=not progress)
    t0 = time.perf_counter() - seconds
    with StepBoundary(checkpoint) as boundary:  # Ctrl-C: held to the step's end, then a checkpoint
        try:
            while epoch < s.epochs:
                order = np.random.default_rng(s.seed + epoch).permutation(ex.train)
                while batch_no < per_epoch:
                    idx = order[batch_no * s.batch:(batch_no + 1) * s.batch]
                    logits = heads(_batch(cache, idx)) @ lm_rows.t()  # [B, K, Vd]
                    loss = F.cross_entropy(logits.flatten(0, 1), target[idx].flatten(), ignore_index=-1)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    batch_no, step, last_loss = batch_no + 1, step + 1, loss.item()
                    seconds = time.perf_counter() - t0
                    bar.update(1)
                    post = {"loss": f"{last_loss:.3f}"}
                    if val:
                        post.update(top1="/".join(f"{a:.2f}" for a in val["top1"]),
                                    top5="/".join(f"{a:.2f}" for a in val["top5"]))
                    bar.set_postfix(post)
                    if step % s.checkpoint_every == 0:
                        checkpoint()
                    boundary.at_boundary()
                epoch, batch_no = epoch + 1, 0
                val = evaluate(heads, lm_rows, cache, ex)
                checkpoint()
                boundary.at_boundary()
        finally:
            bar.close()
    val = evaluate(heads, lm_rows, cache, ex)
    acc = val["after_hits"]
    order = calibrated_paths(acc, MAX_TREE)
    report = {
        "heads": s.heads, "hidden_size": cache.meta["hidden_size"], "draft_vocab": len(ex.vocab),
        "vocab_coverage": ex.coverage, "val_accuracy": val,
        "tree": {"paths": [list(p) for p in order],
                 "probability": [path_probability(acc, p) for p in order]},
        "training": {**asdict(s), "steps": step, "seconds": round(seconds, 1),
                     "train_positions": int(len(ex.train)), "final_loss": last_loss},
    }
    tensors = {"weight": heads.weight.detach().half(), "bias": heads.bias.detach().half(),
               "vocab": torch.from_numpy(ex.vocab.astype(np.int32))}
    return tensors, report
