"""The EAGLE draft head: one decoder layer that runs on the target's own features (the lesson's Ch. 5).

EAGLE (Li et al. 2024, arXiv 2401.15077) drafts at the feature level: a single transformer layer reads the
target's hidden feature f_t at position t together with the embedding of the token x_{t+1} sampled there,
and predicts what comes next; it then runs on its own output for the following draft steps, so later
guesses know what earlier guesses were. EAGLE-2 (arXiv 2406.16858) only changes how drafts are shaped
(dynamic trees, `specdec.drafters.eagle`). EAGLE-3 (arXiv 2503.01840) fuses low, middle and high target
layers (`fc` over their concatenation), predicts tokens directly (no feature regression) with a reduced
draft vocabulary, and is trained with "training-time test" (unrolled on its own outputs).

Layout (EAGLE-3, exactly the checkpoint names vLLM's and SGLang's `llama_eagle3.py` load; D = hidden
size, A = number of aux layers, Vd = draft vocabulary, V = target vocabulary):

    fc                                   [D, A*D]      no bias: fused = fc(cat(aux features))
    midlayer.input_layernorm             [D]           on the token embedding
    midlayer.hidden_norm                 [D]           on the (fused or own) hidden
    midlayer.self_attn.{q,k,v}_proj      [H*hd | Hk*hd, 2D]   input cat(normed emb, normed hidden)
    midlayer.self_attn.o_proj            [D, H*hd]
    midlayer.post_attention_layernorm    [D]
    midlayer.mlp.{gate,up}_proj          [I, D];  midlayer.mlp.down_proj [D, I]
    norm                                 [D]
    lm_head                              [Vd, D]
    d2t                                  int64 [Vd]    target_id = draft_id + d2t[draft_id]
    t2d                                  bool  [V]     True where a target token is in the draft vocabulary

One step: h = hidden + attn(cat(in_norm(emb), hidden_norm(hidden))); out = h + mlp(post_norm(h)); logits =
lm_head(norm(out)); `out` (before the final norm) is the hidden the next draft step runs on. The token
embedding is the target's (passed in as vectors, not owned here).

Features and positions. `aux_layers` are indices i of target layers whose OUTPUTS (before the final norm,
what `Transformer.forward(hidden_layers=...)` returns as hidden[i]) are fused. The v3 default (1, L//2-1, L-4)
is what vLLM and SGLang capture when a head names no layers: their defaults (2, L//2, L-3) count layer
INPUTS. In config.json SGLang reads `eagle_config.eagle_aux_hidden_state_layer_ids` as layer outputs (it adds
1 itself) and vLLM reads the top-level `eagle_aux_hidden_state_layer_ids` as layer inputs; `to_hf` writes both.
The pair (f_t, x_{t+1}) sits at RoPE position t, as in vLLM's proposer.

Version 1 (EAGLE-1) is this same class with one aux layer (the last, L-1) and the full vocabulary (d2t = 0):
`fc` is then [D, D] and the paper's fc over cat(feature, embedding) becomes fc on the feature plus the
embedding entering the layer through q/k/v; the paper's frozen target LM head is `lm_head` initialised from
the target's (and `norm` from its final norm), which training may keep frozen (`training` records how).

Worked example (a tiny target: D = 64, 3 layers, V = 96; a head with Vd = 32):

    cfg = EagleConfig.for_target(target.cfg, "tiny", fingerprint, version=3, draft_vocab_size=32)
    head = EagleHead(cfg)                                  # aux_layers (1, 0, 0): (1, L//2-1, L-4) clamped
    out = target(tokens, cache, hidden_layers=cfg.aux_layers)
    fused = head.fuse(torch.cat([out.hidden[i] for i in cfg.aux_layers], -1))   # [1, n, 64]
    emb = target.embed(next_tokens)                        # x_{t+1} for each t
    logits, h = head(emb, fused, positions, head.new_cache(512))   # [1, n, 32] fp32, [1, n, 64]
    head.to_target(logits[0, -1].argmax())                 # a target token id
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specdec.errors import SpecdecError
from specdec.runtime.config import ModelConfig
from specdec.runtime.kv_cache import KVCache
from specdec.runtime.kernels import quant
from specdec.runtime.model import Linear, QLinear, RMSNorm, rotate

WEIGHTS, CONFIG = "model.safetensors", "config.json"
ARCHITECTURE = "LlamaForCausalLMEagle3"


def default_aux_layers(version: int, num_layers: int) -> tuple[int, ...]:
    """Target layers (by output) an EAGLE head fuses: v1 the last; v3 low, middle, high as vLLM/SGLang
    capture by default (outputs of layers 1, L//2-1, L-4, clamped into 0..L-1 for tiny targets).
    Example: SmolLM2 (L = 30) -> (1, 14, 26); Qwen2.5-1.5B (L = 28) -> (1, 13, 24)."""
    if version == 1:
        return (num_layers - 1,)
    return tuple(min(max(i, 0), num_layers - 1) for i in (1, num_layers // 2 - 1, num_layers - 4))


def vocab_maps(draft_ids, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) for a draft vocabulary given as target ids (any order; kept ascending, as published heads do).
    Example: draft_ids [7, 3] in a vocab of 10 -> draft ids 0, 1 are tokens 3, 7: d2t [3, 6], t2d True at 3 and 7."""
    ids = torch.as_tensor(draft_ids, dtype=torch.long).unique(sorted=True)
    if len(ids) == 0 or int(ids[0]) < 0 or int(ids[-1]) >= vocab_size:
        raise ValueError(f"draft vocabulary must be non-empty target ids in [0, {vocab_size})")
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(len(ids)), t2d


@dataclass
class EagleConfig:
    """What a head is and which target it belongs to (JSON round-trip with `to_dict`/`from_dict`)."""

    version: int                      # 1 (EAGLE-1 layout: last layer, full vocab) or 3 (fused layers, reduced vocab)
    target_name: str | None
    target_fingerprint: str | None    # `specdec.training.heads.fingerprint` of the target folder (None: unknown)
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int                   # the target's
    draft_vocab_size: int
    aux_layers: tuple[int, ...]
    max_position_embeddings: int = 2048
    training: dict = field(default_factory=dict)  # how it was trained (tokens, steps, validation alpha, ...)

    def __post_init__(self):
        self.aux_layers = tuple(int(i) for i in self.aux_layers)
        if self.version not in (1, 3):
            raise ValueError(f"EAGLE version must be 1 or 3, got {self.version!r}")
        if not self.aux_layers or not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError("an EAGLE head needs at least one aux layer and 1 <= draft_vocab_size <= vocab_size")

    @classmethod
    def for_target(cls, target: ModelConfig, name: str | None, fingerprint: str | None, version: int = 3,
                   draft_vocab_size: int | None = None, aux_layers=None, **extra) -> "EagleConfig":
        """A head shaped like one layer of `target` (its widths, heads, norm eps and RoPE)."""
        return cls(version=version, target_name=name, target_fingerprint=fingerprint,
                   hidden_size=target.hidden_size, num_heads=target.num_heads, num_kv_heads=target.num_kv_heads,
                   head_dim=target.head_dim, intermediate_size=target.intermediate_size,
                   rms_norm_eps=target.rms_norm_eps, rope_theta=target.rope_theta, vocab_size=target.vocab_size,
                   draft_vocab_size=draft_vocab_size or target.vocab_size,
                   aux_layers=aux_layers if aux_layers is not None else default_aux_layers(version, target.num_layers),
                   max_position_embeddings=target.max_position_embeddings, **extra)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["aux_layers"] = list(self.aux_layers)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "EagleConfig":
        return cls(**d)

    def to_hf(self) -> dict:
        """config.json in the layout vLLM's and SGLang's Llama EAGLE-3 loaders read, with this config
        (for specdec) under "specdec"."""
        return {
            "architectures": [ARCHITECTURE], "model_type": "llama", "num_hidden_layers": 1,
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "hidden_act": "silu", "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta, "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size, "draft_vocab_size": self.draft_vocab_size,
            "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "torch_dtype": "float16",
            "eagle_aux_hidden_state_layer_ids": [i + 1 for i in self.aux_layers],   # vLLM: layer inputs
            "eagle_config": {"use_aux_hidden_state": True,
                             "eagle_aux_hidden_state_layer_ids": list(self.aux_layers)},  # SGLang: outputs
            "specdec": {"kind": "eagle", **self.to_dict()},
        }

    @classmethod
    def from_hf(cls, d: dict, source: str = CONFIG) -> "EagleConfig":
        """Read a config.json: ours (its "specdec" block), or a published EAGLE-3 head's (target unknown;
        aux layers from eagle_config (layer outputs), else the top-level ids (layer inputs), else None:
        the caller fills the default for the target)."""
        if d.get("kind") not in (None, "eagle"):  # another kind of specdec heads (Medusa's config.json)
            raise SpecdecError(f"{source}: holds {d['kind']!r} heads, not an EAGLE head: pass a folder written by "
                               "`specdec train eagle` (or a published EAGLE-3 head)")
        if isinstance(d.get("specdec"), dict):
            mine = {k: v for k, v in d["specdec"].items() if k != "kind"}
            return cls.from_dict(mine)
        if d.get("norm_before_residual"):
            raise SpecdecError(f"{source}: heads with norm_before_residual are not supported")
        if int(d.get("num_hidden_layers", 1)) != 1:
            raise SpecdecError(f"{source}: only one-layer EAGLE-3 heads are supported, this has "
                               f"{d.get('num_hidden_layers')}")
        eagle = d.get("eagle_config") or {}
        aux = eagle.get("eagle_aux_hidden_state_layer_ids")
        if not aux and d.get("eagle_aux_hidden_state_layer_ids"):
            aux = [i - 1 for i in d["eagle_aux_hidden_state_layer_ids"]]
        try:
            heads = d["num_attention_heads"]
            return cls(version=3, target_name=None, target_fingerprint=None, hidden_size=d["hidden_size"],
                       num_heads=heads, num_kv_heads=d.get("num_key_value_heads", heads),
                       head_dim=d.get("head_dim") or d["hidden_size"] // heads,
                       intermediate_size=d["intermediate_size"], rms_norm_eps=d.get("rms_norm_eps", 1e-6),
                       rope_theta=float(d.get("rope_theta", 10000.0)), vocab_size=d["vocab_size"],
                       draft_vocab_size=d.get("draft_vocab_size") or d["vocab_size"],
                       aux_layers=aux or (-1, -1, -1),  # placeholder: `resolve_aux` fills the target's default
                       max_position_embeddings=d.get("max_position_embeddings", 2048))
        except KeyError as e:
            raise SpecdecError(f"{source}: not an EAGLE-3 head config (missing {e.args[0]!r})") from None

    def check_target(self, target: ModelConfig, name: str, fingerprint: str | None) -> None:
        """Refuse (one SpecdecError line) a head built for another target."""
        why = None
        if self.hidden_size != target.hidden_size or self.vocab_size != target.vocab_size:
            why = (f"hidden size {self.hidden_size} / vocab {self.vocab_size}, the target has "
                   f"{target.hidden_size} / {target.vocab_size}")
        elif any(not 0 <= i < target.num_layers for i in self.aux_layers):
            why = f"aux layers {list(self.aux_layers)} outside the target's {target.num_layers} layers"
        elif self.target_fingerprint is not None and fingerprint is not None and self.target_fingerprint != fingerprint:
            why = f"fingerprint {self.target_fingerprint}, the target's is {fingerprint}"
        if why:
            raise SpecdecError(f"this EAGLE head was built for {self.target_name or 'another model'!r} ({why}), "
                               f"not for {name!r}: train one with `specdec train eagle --model {name}`")


class Attention(nn.Module):
    """Self-attention with q/k/v over cat(emb, hidden) [.., 2D], RoPE, GQA; keys in a one-layer KVCache."""

    def __init__(self, cfg: EagleConfig):
        super().__init__()
        d, self.h, self.hk, self.hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = Linear(2 * d, self.h * self.hd, bias=False)
        self.k_proj = Linear(2 * d, self.hk * self.hd, bias=False)
        self.v_proj = Linear(2 * d, self.hk * self.hd, bias=False)
        self.o_proj = Linear(self.h * self.hd, d, bias=False)

    def forward(self, x, cos, sin, cache: KVCache | None, mask: torch.Tensor | None) -> torch.Tensor:
        B, n, _ = x.shape
        q = rotate(self.q_proj(x).view(B, n, self.h, self.hd).transpose(1, 2), cos, sin)
        k = rotate(self.k_proj(x).view(B, n, self.hk, self.hd).transpose(1, 2), cos, sin)
        v = self.v_proj(x).view(B, n, self.hk, self.hd).transpose(1, 2)
        start = 0
        if cache is not None:
            start = cache.length
            if start + n > cache.max_len:
                raise ValueError(f"EAGLE head cache overflow: {start + n} positions exceed {cache.max_len}")
            cache.write(0, k, v, start)
            k, v = cache.view(0, start + n)
            cache.length = start + n
        if mask is None and n > 1:
            mask = torch.ones(n, start + n, dtype=torch.bool).tril(diagonal=start)
        elif mask is not None and mask.dim() == 3:
            mask = mask.unsqueeze(1)  # [B, 1, n, S]: one mask for all heads
        att = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask,
                                             enable_gqa=self.h != self.hk)
        return self.o_proj(att.transpose(1, 2).reshape(B, n, -1))


class MLP(nn.Module):
    def __init__(self, cfg: EagleConfig):
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    def __init__(self, cfg: EagleConfig):
        super().__init__()
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(d, eps)
        self.hidden_norm = RMSNorm(d, eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.mlp = MLP(cfg)


class EagleHead(nn.Module):
    """The draft head (see the module docstring). Weights fp32 unless cast; logits always fp32."""

    def __init__(self, cfg: EagleConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.hidden_size
        self.fc = Linear(len(cfg.aux_layers) * d, d, bias=False)
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.lm_head = Linear(d, cfg.draft_vocab_size, bias=False)
        d2t, t2d = vocab_maps(torch.arange(cfg.draft_vocab_size), cfg.vocab_size)
        self.register_buffer("d2t", d2t)
        self.register_buffer("t2d", t2d)
        hd = cfg.head_dim
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
        self.register_buffer("inv_freq", inv, persistent=False)

    def set_vocab(self, draft_ids) -> None:
        """Use the target ids `draft_ids` (len = draft_vocab_size) as the draft vocabulary."""
        d2t, t2d = vocab_maps(draft_ids, self.cfg.vocab_size)
        if len(d2t) != self.cfg.draft_vocab_size:
            raise ValueError(f"{len(d2t)} distinct draft ids for a draft vocabulary of {self.cfg.draft_vocab_size}")
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft vocabulary indices -> target token ids."""
        return draft_ids + self.d2t[draft_ids]

    def fuse(self, feats: torch.Tensor) -> torch.Tensor:
        """cat(aux-layer features) [.., A*D] -> [.., D]."""
        return self.fc(feats.to(self.compute_dtype))

    @property
    def compute_dtype(self) -> torch.dtype:
        """The activations' and cache's dtype: the weights', or fp32 when the projections run through specdec's
        kernels (`use_kernel`: bf16 or quantized weights)."""
        w = getattr(self.fc, "weight", None)
        if w is None or (w.dtype == torch.bfloat16 and self.fc.path not in (None, "torch")):
            return torch.float32
        return w.dtype

    def use_kernel(self, path: str) -> "EagleHead":
        """Run the projections through specdec's CPU kernels with fp32 activations, for drafting: `path` "q8" or
        "q4" quantizes every weight (`kernels.quant`, the target's quantized matmul), a `kernels.matmul_path()`
        keeps it in bf16 for the skinny kernel. A SmolLM2 head forward at 8 positions reads 20 MB in bf16,
        10 MB in q8 (torch's fp32 mm took ~2 ms). Drafts change by the rounding only; the target's verification
        keeps the output exact."""
        if path in quant.FORMATS:
            for owner in list(self.modules()):
                for name, m in list(owner.named_children()):
                    if isinstance(m, Linear):
                        setattr(owner, name, QLinear([quant.from_fp32(m.weight.detach().float(), path)]))
        elif path != "torch":
            for m in self.modules():
                if isinstance(m, Linear):
                    m.weight.data = m.weight.data.to(torch.bfloat16)
                    m.pack(path)
        return self

    def new_cache(self, max_len: int, batch: int = 1) -> KVCache:
        c = self.cfg
        return KVCache(1, batch, c.num_kv_heads, max_len, c.head_dim, self.compute_dtype)

    def forward(self, emb: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                cache: KVCache | None = None, mask: torch.Tensor | None = None):
        """emb [B, n, D] (embeddings of x_{t+1}), hidden [B, n, D] (fused target features, or this head's
        own outputs), positions [B, n] -> (draft logits [B, n, Vd] fp32, out hidden [B, n, D]).

        With `cache`, the n positions are written after its `length` and attend to the cached ones (mask
        [B|1, n, length+n], True = may attend; default causal). Without, they attend among themselves
        (mask [B|1, n, n], default causal): a full-sequence training call, or several unrolled steps laid
        side by side under a mask (training-time test)."""
        dt = self.compute_dtype
        emb, hidden = emb.to(dt), hidden.to(dt)
        freqs = positions[..., None].float() * self.inv_freq
        angles = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)  # [B, 1, n, hd]
        cos, sin = angles.cos().to(dt), angles.sin().to(dt)
        m = self.midlayer
        x = torch.cat([m.input_layernorm(emb), m.hidden_norm(hidden)], dim=-1)
        h = hidden + m.self_attn(x, cos, sin, cache, mask)
        h = h + m.mlp(m.post_attention_layernorm(h))
        return self.lm_head(self.norm(h)).float(), h

    # --- files ----------------------------------------------------------------------------------------

    def save(self, folder: str | Path) -> Path:
        """model.safetensors (float weights in fp16, as heads are trained and shipped: an export of a loaded
        head is the size of the head it read) + config.json (last: its presence means the folder is complete)."""
        from specdec.store import write_safetensors

        folder = Path(folder)
        write_safetensors(folder / WEIGHTS, {k: v.detach().half() if v.is_floating_point() else v.detach()
                                             for k, v in self.state_dict().items()})
        (folder / CONFIG).write_text(json.dumps(self.cfg.to_hf(), indent=2))
        return folder

    @classmethod
    def load(cls, folder: str | Path, num_target_layers: int | None = None) -> "EagleHead":
        """A head from a folder written by `save` or a published EAGLE-3 head (config.json + *.safetensors
        with the names above, any float dtype; loaded as fp32). A published head naming no aux layers gets
        the v3 default for a target of `num_target_layers`."""
        from specdec.store import read_safetensors

        folder = Path(folder)
        try:
            d = json.loads((folder / CONFIG).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise SpecdecError(f"{folder}: no readable {CONFIG} ({e}): pass a folder written by "
                               f"`specdec train eagle` or `specdec export eagle`") from None
        cfg = EagleConfig.from_hf(d, str(folder / CONFIG))
        if min(cfg.aux_layers) < 0:
            if num_target_layers is None:
                raise SpecdecError(f"{folder}: the head names no aux layers; give the target's layer count")
            cfg.aux_layers = default_aux_layers(3, num_target_layers)
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise SpecdecError(f"{folder}: no *.safetensors weights next to {CONFIG}")
        state = {}
        for f in files:
            state.update(read_safetensors(f, "train the head again with `specdec train eagle`, or copy it again"))
        head = cls(cfg)
        if "d2t" not in state:  # a full-vocabulary head may leave the maps out
            if cfg.draft_vocab_size != cfg.vocab_size:
                raise SpecdecError(f"{folder}: a reduced draft vocabulary needs d2t in the weights")
            state["d2t"], state["t2d"] = head.d2t, head.t2d
        state = {k: (v.float() if v.is_floating_point() else v) for k, v in state.items()}
        want = head.state_dict()
        missing = sorted(set(want) - set(state))
        bad = sorted(k for k in set(want) & set(state) if tuple(want[k].shape) != tuple(state[k].shape))
        if missing or bad:
            raise SpecdecError(f"{folder}: not an EAGLE head for this config (missing {missing[:3]}, "
                               f"wrong shape {bad[:3]})")
        head.load_state_dict({k: state[k] for k in want})
        return head.eval()
