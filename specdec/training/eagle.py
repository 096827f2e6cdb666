"""Train an EAGLE head (`specdec.drafters.eagle_head.EagleHead`) against the frozen target, from the
hidden-state cache built with the head's aux layers (`hidden_cache.build(layers=...)`).

Data. For a cached document of n tokens, row t (0 <= t <= n-2) is one draft position: the head reads the
fused target features at t and the embedding of token t+1 (at RoPE position t, as at inference) and
learns the token the target itself predicts after t+1 (labels[t+1], its argmax: what greedy verification
accepts). The corpus tokens are the inputs, the target's predictions the labels, as the Medusa trainer.

EAGLE-3 objective (`version=3`): direct next-token cross-entropy over the draft vocabulary, with
training-time test (Li et al. 2025, arXiv 2503.01840): the head is unrolled S steps on its own outputs.
Step j (0-based) at row t feeds the head's step-(j-1) output hidden at row t (step 0: the fused target
features) with the embedding of token t+1+j, at position t+j, and is scored against labels[t+1+j]. Its
attention sees what the drafter's KV cache would hold when drafting position t+j from the prefix up to t:
the step-0 keys of rows 0..t (causal) plus the keys of row t at steps 1..j (one "diagonal" key per earlier
step), the mask of EAGLE-3's training code (SafeAILab/EAGLE eagle/traineagle3). Step losses are weighted
0.8^j, as there. A label outside the draft vocabulary is left out of the loss (no drafting can hit it;
it still counts as a miss in the validation α).

EAGLE-1 objective (`version=1`, one aux layer: the last layer's output before the final norm, and the full
vocabulary): the paper's (arXiv 2401.15077) feature regression plus token loss, SmoothL1(out_t, f_{t+1}) +
0.1 · CE, with U(-0.1, 0.1) noise on the input features. `fc` is held at the identity and `norm`/`lm_head`
at the target's final norm and LM head (frozen), so the head's output hidden is a predicted target
feature, which is what its next step reads (unrolled steps, if any, regress f_{t+1+j}).

Validation α per draft position (`evaluate`), on the held-out last `val_fraction` of the documents: α_j =
P(the head's top-1 at depth j is the target's token | depths < j all right), measured where the corpus
follows the target's own greedy path up to that depth (so the unrolled inputs are exactly what greedy
drafting would feed). The chain's expected tokens per target pass is 1 + α_0 + α_0·α_1 + ....
Example (the head shipped for SmolLM2-135M, BENCHMARKS.md): 240k ShareGPT tokens, 5 epochs, S = 4, an
8192-token draft vocabulary (98.2% of the target's predictions): α = 0.37 / 0.43 / 0.47 / 0.61 at depths
0-3, 1 + 0.37 + 0.37·0.43 + ... = 1.68 tokens per pass for a greedy chain (1.87 with a 32-node tree).

Checkpoints (`checkpoint.pt`: head, optimizer, epoch, batch, step, α history) are written every
`checkpoint_every` steps, at each evaluation and on Ctrl-C, atomically; `resume=True` continues exactly
(the batch order is a function of the seed and the epoch).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from specdec.drafters.eagle_head import EagleConfig, EagleHead
from specdec.errors import SpecdecError
from specdec.runtime.model import rotate
from specdec.training.hidden_cache import HiddenCache
from specdec.training.medusa import CHECKPOINT, StepBoundary, check_resumable, load_checkpoint, save_checkpoint

STEP_DECAY = 0.8      # EAGLE-3's weight of unrolled step j: 0.8^j
V1_CE_WEIGHT = 0.1    # EAGLE-1: regression + 0.1 · cross-entropy
V1_NOISE = 0.1        # EAGLE-1: U(-0.1, 0.1) on the input features


@dataclass
class TrainSettings:
    version: int = 3
    epochs: int = 1
    ttt_steps: int = 3
    draft_vocab: int = 8192
    batch_tokens: int = 2048
    lr: float = 5e-4
    warmup: int = 20
    clip: float = 0.5
    bf16: bool = True           # bf16 autocast for the head's matmuls (2x faster on CPUs with AVX512-BF16)
    val_fraction: float = 0.05
    eval_depth: int = 6
    evals: int = 4              # validation α this many times over the run (the α-vs-tokens curve)
    checkpoint_every: int = 50
    seed: int = 0


def draft_vocabulary(labels: np.ndarray, size: int) -> tuple[np.ndarray, float]:
    """The `size` tokens the target predicts most often (ascending ids) and the share of `labels` they cover.
    Example: labels [5, 5, 9, 2, 5, 9], size 2 -> ([5, 9], 5/6)."""
    counts = np.bincount(labels)
    top = np.argsort(-counts, kind="stable")[:min(size, int((counts > 0).sum()))]
    return np.sort(top), float(counts[top].sum() / max(len(labels), 1))


def coverage_table(labels: np.ndarray, sizes=(4096, 8192, 16384, 32768)) -> dict[int, float]:
    """Share of the target's predictions each draft-vocabulary size covers (to choose --draft-vocab)."""
    return {n: round(draft_vocabulary(labels, n)[1], 4) for n in sizes}


class Documents:
    """The cache cut into documents, split into train and held-out (the last `val_fraction`)."""

    def __init__(self, cache: HiddenCache, val_fraction: float):
        doc = np.asarray(cache.doc)
        bounds = np.flatnonzero(np.diff(doc)) + 1
        starts, ends = np.r_[0, bounds], np.r_[bounds, len(doc)]
        keep = ends - starts >= 3
        self.spans = list(zip(starts[keep].tolist(), ends[keep].tolist()))
        if len(self.spans) < 2:
            raise SpecdecError("the corpus is too small: need at least two documents of 3+ tokens")
        n_val = max(1, round(len(self.spans) * val_fraction))
        self.train, self.val = self.spans[:-n_val], self.spans[-n_val:]

    @staticmethod
    def batches(spans, batch_tokens: int, seed: int | None) -> list[list[tuple[int, int]]]:
        """Documents grouped into batches of about `batch_tokens` (shuffled when `seed` is given)."""
        order = list(spans)
        if seed is not None:
            order = [order[i] for i in np.random.default_rng(seed).permutation(len(order))]
        out, cur, size = [], [], 0
        for s in order:
            if cur and size + (s[1] - s[0]) > batch_tokens:
                out.append(cur)
                cur, size = [], 0
            cur.append(s)
            size += s[1] - s[0]
        return out + [cur] if cur else out


class Batch:
    """Padded rows of a batch of documents: rows t = 0 .. n-2 of each, `steps` unrolled steps.

    feats [B, T, A·D]; tokens [S, B, T] (token t+1+j, 0 past the end); labels [S, B, T] target ids
    (labels[t+1+j], -1 past the end); on_path [S, B, T] (the corpus token after it is the target's
    greedy one, so the input of step j+1 is what greedy drafting feeds); feat_next [S, B, T, A·D] (v1:
    f_{t+1+j}, else None)."""

    def __init__(self, cache: HiddenCache, spans, steps: int, with_next: bool = False):
        T = max(e - s for s, e in spans) - 1
        B, S = len(spans), steps
        width = cache.features.shape[1]
        self.feats = torch.zeros(B, T, width)
        self.tokens = torch.zeros(S, B, T, dtype=torch.long)
        self.labels = torch.full((S, B, T), -1, dtype=torch.long)
        self.on_path = torch.zeros(S + 1, B, T, dtype=torch.bool)
        self.feat_next = torch.zeros(S, B, T, width) if with_next else None
        for b, (s, e) in enumerate(spans):
            n = e - s
            self.feats[b, :n - 1] = torch.from_numpy(np.asarray(cache.features[s:e - 1], dtype=np.float32))
            tok = torch.from_numpy(np.asarray(cache.tokens[s:e], dtype=np.int64))
            lab = torch.from_numpy(np.asarray(cache.labels[s:e], dtype=np.int64))
            agree = lab[:-1] == tok[1:]  # agree[i]: token i+1 is the target's greedy token after i
            for j in range(S + 1):
                m = n - 1 - j  # rows t with t+1+j <= n-1
                if m <= 0:
                    break
                self.on_path[j, b, :m] = agree[j:j + m]
                if j == S:
                    break
                self.tokens[j, b, :m] = tok[1 + j:1 + j + m]
                self.labels[j, b, :m] = lab[1 + j:1 + j + m]
                if with_next:
                    self.feat_next[j, b, :m] = torch.from_numpy(
                        np.asarray(cache.features[s + 1 + j:s + 1 + j + m], dtype=np.float32))
        self.positions = torch.arange(T).expand(B, T)

    def to(self, device: torch.device) -> "Batch":
        """This batch's tensors on `device` (training on a GPU)."""
        for k, v in vars(self).items():
            if isinstance(v, torch.Tensor):
                setattr(self, k, v.to(device, non_blocking=True))
        return self


def unroll(head: EagleHead, fused: torch.Tensor, embs: list[torch.Tensor], positions: torch.Tensor):
    """Run the head len(embs) steps on its own outputs, the training-time-test attention (module
    docstring). fused [B, T, D] (step-0 hidden), embs[j] [B, T, D] (embedding of token t+1+j), positions
    [B, T]. Yields (logits [B, T, Vd] fp32, out hidden [B, T, D]) per step. Step 0 is exactly
    `head(embs[0], fused, positions)`; step j at row t is what the drafter computes for draft position t+j
    after a prefix of rows 0..t (tests/test_eagle_training.py checks both)."""
    m, a = head.midlayer, head.midlayer.self_attn
    B, T, _ = fused.shape
    rep, scale = a.h // a.hk, 1.0 / math.sqrt(a.hd)
    causal = torch.ones(T, T, dtype=torch.bool, device=fused.device).tril()
    keys, values = [], []
    hidden = fused
    for j, emb in enumerate(embs):
        freqs = (positions + j)[..., None].float() * head.inv_freq
        angles = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)
        cos, sin = angles.cos(), angles.sin()
        x = torch.cat([m.input_layernorm(emb), m.hidden_norm(hidden)], dim=-1)
        q = rotate(a.q_proj(x).view(B, T, a.h, a.hd).transpose(1, 2), cos, sin)
        k = rotate(a.k_proj(x).view(B, T, a.hk, a.hd).transpose(1, 2), cos, sin)
        v = a.v_proj(x).view(B, T, a.hk, a.hd).transpose(1, 2)
        keys.append(k.repeat_interleave(rep, dim=1))
        values.append(v.repeat_interleave(rep, dim=1))
        scores = (q @ keys[0].transpose(2, 3)) * scale
        scores = scores.masked_fill(~causal, float("-inf"))
        diag = [(q * keys[i]).sum(-1, keepdim=True) * scale for i in range(1, j + 1)]
        p = torch.softmax(torch.cat([scores, *diag], dim=-1), dim=-1)
        att = p[..., :T] @ values[0]
        for i in range(1, j + 1):
            att = att + p[..., T + i - 1:T + i] * values[i]
        h = hidden + a.o_proj(att.transpose(1, 2).reshape(B, T, -1))
        h = h + m.mlp(m.post_attention_layernorm(h))
        yield head.lm_head(head.norm(h)).float(), h
        hidden = h


class Trainer:
    """One head, its frozen target rows (embedding table) and the cache; `loss` and `evaluate`."""

    def __init__(self, head: EagleHead, embed: torch.Tensor, cache: HiddenCache, s: TrainSettings,
                 device: torch.device = torch.device("cpu")):
        self.head, self.embed, self.cache, self.s, self.device = head, embed, cache, s, device
        self.t2d_index = torch.where(head.t2d, torch.cumsum(head.t2d.long(), 0) - 1, -1)  # target -> draft id

    def draft_targets(self, labels: torch.Tensor) -> torch.Tensor:
        """Target ids -> draft ids, -1 where outside the draft vocabulary or absent (-1)."""
        return torch.where(labels >= 0, self.t2d_index[labels.clamp(min=0)], -1)

    def run(self, batch: Batch, steps: int, noise: bool = False):
        fused = batch.feats
        if noise:
            fused = fused + (torch.rand_like(fused) * 2 - 1) * V1_NOISE
        embs = [self.embed[batch.tokens[j]] for j in range(steps)]
        return unroll(self.head, self.head.fuse(fused), embs, batch.positions)

    def loss(self, batch: Batch) -> tuple[torch.Tensor, list[float]]:
        """The weighted unrolled loss and the per-step top-1 accuracy on the batch's labels."""
        total, acc = 0.0, []
        for j, (logits, h) in enumerate(self.run(batch, self.s.ttt_steps, noise=self.s.version == 1)):
            target = self.draft_targets(batch.labels[j])
            valid = target >= 0
            if not valid.any():
                break  # every document of the batch ends before this step
            ce = F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=-1)
            if self.s.version == 1:
                valid = batch.labels[j] >= 0
                step = F.smooth_l1_loss(h[valid], batch.feat_next[j][valid]) + V1_CE_WEIGHT * ce
            else:
                step = ce
            total = total + STEP_DECAY ** j * step
            acc.append(float((logits.argmax(-1) == target)[valid].float().mean()))
        return total, acc

    def autocast(self):
        """bf16 autocast for the head's matmuls on the training device (unless `bf16` is off)."""
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.s.bf16)

    @torch.no_grad()
    def evaluate(self, spans) -> dict:
        """Validation α per draft position (module docstring) over `spans`, to depth `eval_depth`."""
        depth = self.s.eval_depth
        reached, hit = np.zeros(depth), np.zeros(depth)
        for group in Documents.batches(spans, self.s.batch_tokens, None):
            batch = Batch(self.cache, group, depth).to(self.device)
            alive = batch.on_path[0] & (batch.labels[0] >= 0)  # token t+1 = the target's bonus token
            with self.autocast():
                for j, (logits, _) in enumerate(self.run(batch, depth)):
                    alive &= batch.labels[j] >= 0
                    right = self.head.to_target(logits.argmax(-1)) == batch.labels[j]
                    reached[j] += int(alive.sum())
                    hit[j] += int((alive & right).sum())
                    alive &= right & batch.on_path[j + 1]
        alpha = (hit / np.maximum(reached, 1)).tolist()
        return {"alpha": [round(a, 4) for a in alpha], "reached": reached.astype(int).tolist(),
                "chain_tokens_per_pass": round(1 + float(np.cumprod(alpha).sum()), 3)}


def new_head(target, name: str, fingerprint: str, s: TrainSettings, aux_layers, vocab: np.ndarray) -> EagleHead:
    """A head for `target` initialised as training starts: `lm_head` from the target's LM-head rows of the
    draft vocabulary and `fc` passing the last aux layer's features through (the midlayer starts as a
    residual update of the target's top features; on SmolLM2 this trains faster than a random `fc`, and
    `norm` at ones faster than at the target's final norm: 0.22 vs 0.18 step-0 accuracy after 40 steps).
    v1: fc = identity, `norm` the target's final norm, `lm_head` the target's rows: all three frozen."""
    cfg = EagleConfig.for_target(target.cfg, name, fingerprint, version=s.version, draft_vocab_size=len(vocab),
                                 aux_layers=aux_layers)
    torch.manual_seed(s.seed)
    head = EagleHead(cfg)
    head.set_vocab(torch.from_numpy(vocab))
    with torch.no_grad():
        head.lm_head.weight.copy_(target.lm_head.matrix().float().cpu()[torch.from_numpy(vocab)])
        if s.version == 1:
            head.norm.weight.copy_(target.norm.weight.detach().float().cpu())
        d = cfg.hidden_size
        head.fc.weight.zero_()
        head.fc.weight[:, -d:].copy_(torch.eye(d))
    if s.version == 1:
        for p in (head.fc.weight, head.norm.weight, head.lm_head.weight):
            p.requires_grad_(False)
    return head


def train(cache: HiddenCache, target, name: str, fingerprint: str, s: TrainSettings, out: str | Path,
          resume: bool = False, progress: bool = True, device: str | torch.device = "cpu") -> EagleHead:
    """Train a head from `cache` (built with the head's aux layers) for the frozen `target`
    (`specdec.runtime.model.Transformer`: its embedding, final norm and LM head are read) on `device`.
    Returns the head (fp32, on the CPU) with `cfg.training` filled: settings, steps, seconds, vocabulary
    coverage, α history."""
    from tqdm import tqdm

    if cache.features is None:
        raise SpecdecError("this hidden cache holds no layer features: build it with the head's aux layers")
    if s.version not in (1, 3):
        raise SpecdecError(f"--version must be 1 or 3, not {s.version}")
    out = Path(out)
    ckpt_path = out / CHECKPOINT
    docs = Documents(cache, s.val_fraction)  # a corpus too small is refused before --out is made
    out.mkdir(parents=True, exist_ok=True)
    train_labels = np.concatenate([np.asarray(cache.labels[a:b]) for a, b in docs.train])
    vocab_size = target.cfg.vocab_size
    vocab, coverage = draft_vocabulary(train_labels, vocab_size if s.version == 1 else s.draft_vocab)
    if s.version == 1:
        vocab, coverage = np.arange(vocab_size), 1.0  # EAGLE-1 drafts over the target's whole vocabulary
    aux = tuple(cache.meta["layers"])
    device = torch.device(device)
    head = new_head(target, name, fingerprint, s, aux, vocab).to(device)
    trainer = Trainer(head, target.embed.table().to(device, torch.float32), cache, s, device)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=s.lr, weight_decay=0.0)
    total = sum(len(docs.batches(docs.train, s.batch_tokens, s.seed + e)) for e in range(s.epochs))  # shuffles differ
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / s.warmup)
                                              * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(k / total, 1)))))
    state = dict(epoch=0, batch=0, step=0, tokens=0, seconds=0.0, loss=None, acc=None, history=[])
    if resume and ckpt_path.exists():
        ck = load_checkpoint(ckpt_path, "eagle", map_location=device)
        check_resumable(ckpt_path, ck, asdict(s), cache.meta)
        head.load_state_dict(ck["head"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        state = ck["state"]
    elif resume:
        raise SpecdecError(f"--resume: no checkpoint in {out}")
    eval_steps = sorted({max(1, round(total * (i + 1) / s.evals)) for i in range(s.evals)})

    def checkpoint():
        save_checkpoint(ckpt_path, dict(head=head.state_dict(), opt=opt.state_dict(), sched=sched.state_dict(),
                                         state=state, settings=asdict(s), cache=cache.meta))

    bar = tqdm(total=total, initial=state["step"], unit="step", desc=f"training eagle-{s.version} head",
               disable=not progress)
    t0 = time.perf_counter() - state["seconds"]
    with StepBoundary(checkpoint) as boundary:  # Ctrl-C: held to the step's end, then a checkpoint
        try:
            while state["epoch"] < s.epochs:
                groups = docs.batches(docs.train, s.batch_tokens, s.seed + state["epoch"])
                while state["batch"] < len(groups):
                    group = groups[state["batch"]]
                    batch = Batch(cache, group, s.ttt_steps, with_next=s.version == 1).to(device)
                    with trainer.autocast():
                        loss, acc = trainer.loss(batch)
                    opt.zero_grad()
                    loss.backward()
                    torch.nn.utils.clip_grad_norm_(params, s.clip)
                    opt.step()
                    sched.step()
                    state.update(batch=state["batch"] + 1, step=state["step"] + 1, loss=loss.item(), acc=acc,
                                 tokens=state["tokens"] + sum(e - s_ for s_, e in group),
                                 seconds=time.perf_counter() - t0)
                    bar.update(1)
                    post = {"loss": f"{state['loss']:.3f}", "acc": "/".join(f"{x:.2f}" for x in acc)}
                    if state["history"]:
                        post["val_alpha"] = "/".join(f"{x:.2f}" for x in state["history"][-1]["alpha"][:4])
                    bar.set_postfix(post)
                    if state["step"] in eval_steps:
                        head.eval()
                        state["history"].append({"step": state["step"], "tokens_seen": state["tokens"],
                                                 **trainer.evaluate(docs.val)})
                        head.train()
                        checkpoint()
                    elif state["step"] % s.checkpoint_every == 0:
                        checkpoint()
                    boundary.at_boundary()
                state.update(epoch=state["epoch"] + 1, batch=0)
                checkpoint()
                boundary.at_boundary()
        finally:
            bar.close()
    if not state["history"] or state["history"][-1]["step"] != state["step"]:
        state["history"].append({"step": state["step"], "tokens_seen": state["tokens"], **trainer.evaluate(docs.val)})
    head.cfg.training = {
        **asdict(s), "draft_vocab": len(vocab),  # what it drafts over: EAGLE-1's whole vocabulary, not the setting
        "objective": ("direct next-token CE, training-time test" if s.version == 3
                      else "SmoothL1 feature regression + 0.1 CE, frozen norm/lm_head, fc = I"),
        "steps": state["step"], "seconds": round(state["seconds"], 1), "tokens": len(cache),
        "documents": cache.meta["documents"], "train_documents": len(docs.train),
        "val_documents": len(docs.val), "draft_vocab_coverage": round(coverage, 4),
        "coverage_by_size": coverage_table(train_labels), "final_loss": state["loss"],
        "val": state["history"][-1], "history": state["history"], "device": str(device)}
    return head.cpu().eval()
