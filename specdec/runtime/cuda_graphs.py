"""CUDA graphs for a target on a GPU: each forward of a decode or verification step replays one captured graph.

A SmolLM2-135M step on an H200 launches about 970 kernels, and the host spends 14 ms launching them for 1.9 ms of
GPU work (BENCHMARKS.md, session 31): on a GPU a small model's step is bound by Python and launches, not by its
weights. A CUDA graph records the step's kernels once and replays them with one launch, as gpt-fast and vLLM do.
A graph fixes every shape and address, so the captured forward (`Block.static`) differs from the eager one in
three ways:
- its width is a bucket (`WIDTHS`): n positions run as the next width up, the extra rows padding (they write KV
  slots past the new length, which nothing attends to and the next step overwrites, and their outputs are cut);
- k and v go to the cache by index (`index_copy_` at slots start .. start+w-1), not by a slice at a Python int;
- attention reads the whole cache under a [w, max_len] mask built on the host each step (the cached slots, then
  the causal or tree mask of the new ones; a padding row sees its own slot).
Graphs belong to one KV cache (they hold its addresses) and are kept on it, captured on first use of each
(width, hidden layers) pair; one-row caches come from a pool (`new_cache`), so the next request replays the graphs
the last one captured. Prefill, early exit's partial forwards and batches of several rows run eagerly.

Example: a 3-node tree after 40 cached positions runs as width 4: tokens [t0, t1, t2, pad], slots 40..43,
mask rows 0..2 = slots 0..39 plus the tree's ancestors, row 3 = slot 43 alone; logits rows 0..2 come back.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
from typing import Sequence

import torch

from specdec.runtime.kv_cache import KVCache

WIDTHS = (1, 2, 4, 8, 16, 32, 64)  # captured widths; a wider forward runs eagerly


def enabled(model) -> bool:
    """Graphs for a model on a CUDA GPU, unless SPECDEC_CUDA_GRAPHS=0."""
    return model.device.type == "cuda" and os.environ.get("SPECDEC_CUDA_GRAPHS", "1") != "0"


def width(n: int) -> int | None:
    """The captured width a forward over n positions runs as (None: wider than any)."""
    return next((w for w in WIDTHS if w >= n), None)


class Inputs:
    """The fixed buffers a captured forward reads: tokens [1, w], RoPE positions [w], KV slots [w], mask."""

    def __init__(self, w: int, max_len: int, device):
        self.tokens = torch.zeros(1, w, dtype=torch.long, device=device)
        self.positions = torch.zeros(w, dtype=torch.long, device=device)
        self.slots = torch.zeros(w, dtype=torch.long, device=device)
        self.mask = torch.zeros(1, 1, w, max_len, dtype=torch.bool, device=device)

    def fill(self, tokens: torch.Tensor, start: int, positions, mask: torch.Tensor | None) -> None:
        """This step's n tokens after `start` cached slots, padded to the width: one host-to-device copy each.
        `positions`: RoPE positions [1, n] or a range; `mask`: the eager forward's, [n, start+n] or
        [1, 1, n, start+n] (`attention_plan`), or None (causal: every slot up to a row's own)."""
        w, max_len, n = self.tokens.shape[1], self.mask.shape[-1], tokens.shape[1]
        pad = torch.arange(start, start + w)
        tok = torch.zeros(1, w, dtype=torch.long)
        tok[:, :n] = tokens
        pos = pad.clone()
        pos[:n] = torch.as_tensor(positions if isinstance(positions, range) else positions[0])
        m = torch.zeros(w, max_len, dtype=torch.bool)
        m[:n, :start + n] = (torch.ones(n, start + n, dtype=torch.bool).tril(diagonal=start) if mask is None
                             else mask.reshape(n, start + n))
        m[torch.arange(n, w), pad[n:]] = True
        self.tokens.copy_(tok)
        self.positions.copy_(pos)
        self.slots.copy_(pad)
        self.mask.copy_(m[None, None])


def static_forward(model, x: Inputs, cache, hidden_layers: Sequence[int]):
    """The forward a graph captures: logits [1, w, V] fp32 and the hidden states of `hidden_layers`."""
    cos, sin = model._rope_cache
    cos, sin = cos[x.positions][None, None], sin[x.positions][None, None]
    h = model.embed(x.tokens)
    hidden = {}
    for i, block in enumerate(model.layers):
        h = block.static(h, cos, sin, cache, i, x.slots, x.mask)
        if i in hidden_layers:
            hidden[i] = h
    h = model.norm(h)
    if -1 in hidden_layers:
        hidden[-1] = h
    return model.lm_head(h).float(), hidden


class Graph:
    """One captured forward of a cache at one width: its input buffers, its graph, its output tensors. With
    `capture` False (the CPU, tests) the same buffers run `static_forward` eagerly each time. It keeps no
    reference to its cache (the cache keeps it), so a cache nobody holds can go back to the pool (`new_cache`)."""

    def __init__(self, model, w: int, max_len: int, hidden_layers: tuple[int, ...], capture: bool):
        self.model, self.hidden_layers = model, hidden_layers
        self.inputs = Inputs(w, max_len, model.device)
        self.graph, self.out = None, None
        self.capture = capture

    def run(self, cache):
        if not self.capture:
            return static_forward(self.model, self.inputs, cache, self.hidden_layers)
        if self.graph is None:  # warm up on a side stream (cuBLAS, the allocator), then capture
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                static_forward(self.model, self.inputs, cache, self.hidden_layers)
            torch.cuda.current_stream().wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with no_collection():
                with torch.cuda.graph(self.graph, pool=pool(cache)):
                    self.out = static_forward(self.model, self.inputs, cache, self.hidden_layers)
        self.graph.replay()
        return self.out


@contextlib.contextmanager
def no_collection():
    """Python's garbage collector off while a graph captures: torch no longer collects before a capture, so a collection
    during one may free a dead cycle holding another cache's CUDA graph, and destroying a graph invalidates the
    capture ("operation not permitted when stream is capturing"; session 32's H200, after a test's LLMs died)."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def pool(cache):
    """The memory pool the graphs of one cache share: a graph's outputs are read right after its replay, before
    any other graph of the cache replays, so their intermediates may share memory."""
    if getattr(cache, "graph_pool", None) is None:
        cache.graph_pool = torch.cuda.graph_pool_handle()
    return cache.graph_pool


CACHE_ROUND = 1024  # pooled caches' lengths are multiples of this


def new_cache(model, max_len: int) -> KVCache:
    """A one-row KV cache for a model on a GPU, from the model's pool: one of at least `max_len` slots (rounded up to
    `CACHE_ROUND`) that nobody holds any more, emptied, with the graphs captured on it (so a new request replays
    them instead of capturing again), else a new one, pooled. "Nobody holds it": only the pool refers to it
    (CPython's reference count), so a cache in use is never handed out twice."""
    size = -(-max_len // CACHE_ROUND) * CACHE_ROUND
    caches = model.__dict__.setdefault("cache_pool", [])
    caches[:] = [c for c in caches if c.max_len % CACHE_ROUND == 0 or sys.getrefcount(c) > 3]  # grown, then let go
    for i in range(len(caches)):
        if caches[i].max_len == size and sys.getrefcount(caches[i]) == 2:  # the list's reference and the call's
            caches[i].reset()
            return caches[i]
    cfg = model.cfg
    caches.append(KVCache(cfg.num_layers, 1, cfg.num_kv_heads, size, cfg.head_dim, model.kv_dtype, model.device))
    return caches[-1]


def forward(model, tokens: torch.Tensor, cache, positions, mask: torch.Tensor | None, hidden_layers: Sequence[int],
            last_only: bool):
    """`Transformer.forward` for one row of host inputs through a graph: (logits, hidden) on the model's device,
    cut to the n positions (the last with `last_only`), and cache.length advanced; None when this forward cannot
    (wider than `WIDTHS`, past the cache's end, a cache in another dtype than the activations), and nothing was
    done. On the CPU (tests) the same buffers run eagerly."""
    n, start = tokens.shape[1], cache.length
    w = width(n)
    if w is None or start + w > cache.max_len or cache.k[0].dtype != model.compute_dtype:
        return None
    model._rope(range(cache.max_len))  # the RoPE table covers every slot before a capture reads it
    graphs = cache.__dict__.setdefault("graphs", {})
    key = (w, tuple(sorted(hidden_layers)), cache.k[0].data_ptr())  # `grow` moves the tensors: capture again
    graph = graphs.get(key)
    if graph is None:
        for old in [k for k in graphs if k[2] != key[2]]:  # graphs of the tensors before a `grow`
            del graphs[old]
        graph = graphs[key] = Graph(model, w, cache.max_len, key[1], capture=model.device.type == "cuda")
    graph.inputs.fill(tokens, start, positions, mask)
    logits, hidden = graph.run(cache)
    cache.length = start + n
    rows = slice(n - 1, n) if last_only else slice(0, n)
    return logits[:, rows], {i: h[:, :n] for i, h in hidden.items()}
