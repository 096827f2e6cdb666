"""The packed forward: one target pass over the new positions of every request in a server step.

Continuous batching (Orca, Yu et al. 2022; vLLM) puts each running request's new positions side by
side in one row of tokens: its last committed token plus its drafts (a chain or a tree), or a chunk of
a prompt being prefilled. Every matmul (q|k|v, o, gate|up, down, the LM head) runs over all packed
positions at once, so the weights are read once per step for the whole batch; attention runs per
request, over that request's own KV cache with its own mask, so requests never see each other.

    segments = [Segment(cache_a, [t_last, d1, d2]),                    # a chain: causal
                Segment(cache_b, [t_last, d1, d2, d3], offsets, local),  # a tree: its own mask
                Segment(cache_c, prompt[0:64], logits=False)]            # a prefill chunk
    logits = packed_forward(model, segments)   # [3, V], [4, V], None; each cache advanced by its n

The layer loop is `specdec.runtime.model.Block.forward` with attention (`Block.attend`) run per segment, the
same modules and weights, so a segment's logits equal a single-request forward over the same positions up
to the matmuls' summation order (test_serving checks this at fp32), and bit for bit on exact models.

On a GPU the weights and caches live there and the rest on the host, as `Transformer.forward` keeps them: the
inputs move to the device and the logits and features come back. A step with one request and nothing to
prefill runs that request's own forward, which replays a CUDA graph (`runtime.cuda_graphs`), the server's
usual step at low load; wider steps run eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.runtime.kv_cache import KVCache
from specdec.runtime.model import Transformer


@dataclass
class Segment:
    cache: KVCache                      # this request's own cache; slots cache.length.. are written
    tokens: list[int]                   # the new positions' token ids
    offsets: torch.Tensor | None = None  # [n] positions after cache.length (None: 0..n-1)
    local: torch.Tensor | None = None   # [n, n] bool mask among the new positions (None: causal)
    logits: bool = True                 # False: a prefill chunk, no LM head
    features: bool = False              # True: `hidden` gets the new positions' outputs of the asked layers
    hidden: torch.Tensor | None = None  # [n, len(layers) * D], set by `packed_forward` (EAGLE's features)

    def __len__(self) -> int:
        return len(self.tokens)


def _mask(s: Segment, start: int) -> torch.Tensor | None:
    """The segment's attention mask over its cache and new positions [1, n, start + n] (None: causal)."""
    if s.local is None:
        return None
    mask = torch.ones(1, len(s), start + len(s), dtype=torch.bool)
    mask[0, :, start:] = s.local
    return mask


def _plan(model: Transformer, s: Segment, start: int):
    """(mask, RowPlan) for one segment, as the model's own forward picks them (`Transformer.attention_plan`):
    exact models attend row by row as the model's forward does, so each segment stays bit-identical
    to plain decoding. The mask is on the model's device."""
    mask, plan = model.attention_plan(len(s), start, _mask(s, start))
    return (mask if mask is None else mask.to(model.device)), plan


def on_a_gpu(model: Transformer) -> bool:
    return model.device.type != "cpu"


def _own_forward(model: Transformer, s: Segment, layers: tuple[int, ...]) -> list[torch.Tensor]:
    """One segment through the model's own forward (on a GPU: a CUDA graph's replay)."""
    start = s.cache.length
    positions = None if s.offsets is None else (start + s.offsets)[None]
    out = model(torch.tensor([s.tokens]), s.cache, positions, _mask(s, start), hidden_layers=layers if s.features else ())
    if s.features and layers:
        s.hidden = torch.cat([out.hidden[i][0] for i in layers], dim=-1)
    return [out.logits[0]]


@torch.inference_mode()
def packed_forward(model: Transformer, segments: list[Segment],
                   layers: tuple[int, ...] = ()) -> list[torch.Tensor | None]:
    """Run one forward over all segments; returns each segment's logits [n, V] (None when not asked)
    and advances each segment's cache by its n. A segment with `features` gets in `hidden` the outputs of
    decoder `layers` at its positions, concatenated in that order (what `Transformer.forward` returns as
    `hidden[l]`): the features an EAGLE drafter reads."""
    starts = [s.cache.length for s in segments]
    for s, start in zip(segments, starts):
        if not len(s):
            raise ValueError("a segment needs at least one token")
        if start + len(s) > s.cache.max_len:
            raise ValueError(f"context overflow: {start + len(s)} positions exceed the cache's {s.cache.max_len}")
    if len(segments) == 1 and segments[0].logits and on_a_gpu(model):
        return _own_forward(model, segments[0], layers)
    device = model.device
    ropes = [model._rope(range(start, start + len(s)) if s.offsets is None else (start + s.offsets.to(device))[None])
             for s, start in zip(segments, starts)]
    bounds, end = [], 0
    for s in segments:
        bounds.append((end, end + len(s)))
        end += len(s)
    x = model.embed(torch.tensor([[t for s in segments for t in s.tokens]], device=device))  # [1, N, D]
    plans = [_plan(model, s, start) for s, start in zip(segments, starts)]
    wanted = set(layers) if any(s.features for s in segments) else set()
    kept: dict[int, torch.Tensor] = {}
    fused = model.fused_layers is not None and all(plan is not None for _, plan in plans) and x.dtype == torch.float32
    if fused:  # the layers in one C call (`FusedLayers`), each segment attending over its own cache: the same bits
        x = x.contiguous()
        after = {i: torch.empty_like(x) for i in wanted}
        model.fused_layers(x, [(a, b - a, s.cache, start, plan, cos, sin, not s.logits) for s, start, (a, b), (cos, sin),
                               (_, plan) in zip(segments, starts, bounds, ropes, plans)], model.cfg.num_layers, after)
        kept = {i: h[0] for i, h in after.items()}
    for layer, block in enumerate(() if fused else model.layers):
        qkv = block.qkv(block.input_norm(x))
        outs = [block.attend(qkv[:, a:b].contiguous(), cos, sin, s.cache, layer, start, mask, plan).reshape(1, b - a, -1)
                for s, start, (a, b), (cos, sin), (mask, plan) in zip(segments, starts, bounds, ropes, plans)]
        x = x + block.o(torch.cat(outs, dim=1))
        x = x + block.mlp(block.post_norm(x))
        if layer in wanted:
            kept[layer] = x[0]
    for s, start, (a, b) in zip(segments, starts, bounds):
        s.cache.length = start + len(s)
        if s.features and kept:
            s.hidden = torch.cat([kept[i][a:b] for i in layers], dim=-1).cpu()
    rows = [i for s, (a, b) in zip(segments, bounds) if s.logits for i in range(a, b)]
    if not rows:
        return [None] * len(segments)
    logits = model.lm_head(model.norm(x[:, rows])).float()[0].cpu()
    out, at = [], 0
    for s in segments:
        if s.logits:
            out.append(logits[at:at + len(s)])
            at += len(s)
        else:
            out.append(None)
    return out
