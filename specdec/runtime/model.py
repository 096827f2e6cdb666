"""A lean Llama-family transformer forward, written for speculation (in the spirit of gpt-fast).

One call evaluates n new positions against a static KV cache:

    out = model(tokens,            # [B, n] token ids
                cache,             # KVCache; slots cache.length .. cache.length+n-1 are written
                positions=None,    # [B, n] RoPE positions; default cache.length + arange(n)
                mask=None,         # [B|1, n, cache.length+n] bool, True = may attend; default causal
                hidden_layers=(),  # layer indices whose outputs to return (Medusa/EAGLE read them)
                exit_layer=None,   # run only the first L layers, then norm + LM head (self-speculation)
                last_only=False)   # logits for the last position only (prefill)
    out.logits                     # [B, n, V] float32
    out.hidden[i]                  # [B, n, D] output of layer i (i = -1: after the final norm)

A tree of drafted tokens is one call: the tokens in any order that puts parents first,
positions = depth, and a mask where each node sees the cache and its ancestors.
Projections are fused (q|k|v and gate|up) so a decode step runs few, large matmuls.

q8 / q4 (`--dtype q8|q4`): every projection and the LM head is a QLinear (integer kernels over blocks of 32,
`specdec.runtime.kernels.quant`); the embedding table is bf16, everything else fp32, as below.

bf16 where the skinny-GEMM kernel runs (the loader decides: AMX, AVX512-BF16 or AVX2, `kernels.matmul_path`): the
projection and LM-head weights stay in bf16 and run through the kernel with fp32 activations; norms,
the embedding lookup's output, RoPE and attention are fp32. `model.dtype` is then bf16
(the weights' dtype) and `model.compute_dtype` fp32.
The KV cache (`Transformer.kv_dtype`, `--kv-dtype`) holds fp16 on most exact CPU paths below (llama.cpp's default):
half the bytes a step reads from it (16 SmolLM2 q4 requests at 352 positions read ~260 MB of fp32 keys and values
a step, twice the ~112 MB of weights; with fp16 that step takes 0.86-0.91x the time, at 1024 positions
0.70-0.74x; BENCHMARKS.md, session 19). fp16 widens to fp32 exactly, so attention reads back the rounded keys
and values, and a position's rounding never depends on which forward wrote it. bf16 weights on a CPU with AMX
keep it in bf16 instead and attend on the tiles (`kernels.attention`, "amx": bf16 q, k, softmax weights and v
with fp32 sums, torch's bf16 attention; SmolLM2 at 256 positions, 2-core Xeon: 16 positions 1.18 steps
against 1.31 with fp16, perplexity unchanged; BENCHMARKS.md, session 21). Elsewhere it is the activations' dtype.
Exact models (bf16 on the kernel, q8, q4: `Transformer.row_exact`) attend through the exact-attention kernel
(`specdec.runtime.kernels.attention`): all n rows in one call, each (row, head) over exactly the key slots a
single-position forward at that position sees (the cache, then its ancestors and itself), with an order of
operations that does not depend on n, so every position's logits are bit-identical to plain decoding's.
A tree needs no rewriting of the KV cache: a row's key list names its ancestors' slots. Without the kernel
(no C compiler) the same rows run one torch call each (`attend_rows`, `RowPlan.steps`).
An exact model on the host runs all its layers in one C call per forward (`FusedLayers`): the same kernels in
the same order as `Block.forward`, so the same bits, without Python's dispatch between them (Qwen2.5-Coder-1.5B
q4 decode step ~45 -> ~38 ms, SmolLM2 q4 ~12 -> ~6 ms on a 2-core Zen 4).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import cached_property
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from specdec.runtime import cuda_graphs, kernels
from specdec.runtime.kernels import attention, ops, quant
from specdec.runtime.config import ModelConfig
from specdec.runtime.kv_cache import KVCache


ROW_EXACT_MAX = 32  # without the exact-attention kernel: longest chain attended row by row; longer ones: one call
PREFILL_CHUNK = 256  # prompts are fed in chunks cut at multiples of this position (`prefill_spans`)


def prefill_spans(start: int, end: int, chunk: int = PREFILL_CHUNK) -> list[tuple[int, int]]:
    """Cut positions start..end-1 at multiples of `chunk`: the pieces a prompt is fed in. Decoding one request
    and the batched server cut alike, so every piece is the same attention call and a prompt's KV cache holds
    the same bits however the server shares its steps. Example: (0, 600) -> (0, 256), (256, 512), (512, 600)."""
    cuts = [start] + list(range((start // chunk + 1) * chunk, end, chunk)) + [end]
    return [(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]


@dataclass
class ForwardOutput:
    logits: torch.Tensor                      # [B, n, V] float32 (n = 1 with last_only)
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)


class Linear(nn.Linear):
    """nn.Linear computing W @ x^T in fp32: on CPUs without native bf16 this streams the weight matrix
    once for a few positions (a forward over 4 positions costs about one), where x @ W^T costs ~n times one.
    A bf16 weight with fp32 input runs the bf16 skinny-GEMM kernel on `path` ("amx", "avx512bf16" or "avx2", set by
    `pack` once per model: every forward, decoding and verification alike, takes the same path, so a
    position's output is bit-identical for any n). On a path that takes its own weight layout
    (`kernels.packs`: AVX512-BF16) the weight is repacked once (`pack`)."""

    path: str | None = None  # the kernel's path for bf16 weights (`kernels.matmul_path()` when loaded)

    def pack(self, path: str) -> None:
        """Run every forward on the kernel's `path`; on a path that `packs`, repack the bf16 weight once
        (`kernels.pack_bf16`) in place of the [out, in] matrix, which then reads 4-D, so nothing mistakes it
        for one (`matrix()` gives it back). A weight already packed (a tied table: `Embedding.pack`) stays."""
        self.path = path
        if kernels.packs(path) and self.weight.dtype == torch.bfloat16 and self.weight.dim() == 2:
            self.weight = nn.Parameter(kernels.pack_bf16(self.weight.detach()), requires_grad=False)

    def matrix(self) -> torch.Tensor:
        """The weight as [out, in] (unpacked, a copy, where `pack` replaced it)."""
        return kernels.unpack_bf16(self.weight.detach(), self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.dtype == torch.bfloat16 and x.dtype == torch.float32:
            path = self.path or kernels.matmul_path()
            if self.weight.dim() == 2 and kernels.packs(path):
                self.pack(path)  # a Linear the loader did not pack (Medusa's LM-head rows): once, here
            return kernels.linear_bf16(x, self.weight, self.bias, path=path, out_features=self.out_features)
        if self.weight.dtype != torch.float32:
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(-1, x.shape[-1])
        y = torch.mm(self.weight, flat.t()).t()
        if flat.shape[0] > 1:
            y = y.contiguous()
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], y.shape[-1])


class QLinear(nn.Module):
    """A projection with quantized weights (q8 / q4, `kernels.quant`): y = x @ W^T + bias in fp32, bit-identical
    for any n. The rows may come in parts of different formats (a fused q|k|v whose v the GGUF file holds in
    another type), each written into its columns of one output."""

    def __init__(self, parts: list[quant.QWeight], bias: torch.Tensor | None = None):
        super().__init__()
        self.use = quant.isa()  # the instruction set, fixed for every forward of this model (as Linear.path)
        self.parts = parts
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        self.register_buffer("bias", None if bias is None else bias.float(), persistent=False)
        self.calls, col = [], 0  # (part, its bias slice, its first column): what `quant.matmul_parts` runs
        for p in parts:
            b = None if bias is None else self.bias[col:col + p.out_features].contiguous()
            self.calls.append((p, b, col))
            col += p.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.dtype != torch.float32 or not flat.is_contiguous():
            flat = flat.float().contiguous()
        y = torch.empty(flat.shape[0], self.out_features)
        quant.matmul_parts(y, flat, self.calls, use=self.use)
        return y.view(*x.shape[:-1], self.out_features)


class Embedding(nn.Embedding):
    """nn.Embedding whose lookup is returned in `out_dtype` when set (bf16 table, fp32 activations). A table
    tied to the LM head on a path that `packs` is held once, in the head's layout (`pack`): a lookup then
    gathers a token's row from it (row t: group t // 16, lane t % 16, every pair of inputs)."""

    out_dtype: torch.dtype | None = None

    def pack(self) -> None:
        """Hold the bf16 table in `kernels.pack_bf16`'s layout, for a tied LM head to share."""
        self.weight = nn.Parameter(kernels.pack_bf16(self.weight.detach()), requires_grad=False)

    def table(self) -> torch.Tensor:
        """The table as [vocab, dim] (unpacked, a copy, where `pack` replaced it)."""
        return kernels.unpack_bf16(self.weight.detach(), self.num_embeddings, self.embedding_dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.weight.dim() == 4:
            lo, hi = torch.aminmax(tokens) if tokens.numel() else (0, 0)
            if lo < 0 or hi >= self.num_embeddings:  # a padded row or a negative index would not fail below
                raise IndexError(f"token ids {int(lo)}..{int(hi)} outside the vocabulary 0..{self.num_embeddings - 1}")
            width = self.weight.shape[1] * self.weight.shape[3]  # the padded row: pairs x 2 (-1 fails on no ids)
            x = self.weight[tokens // 16, :, tokens % 16].reshape(*tokens.shape, width)[..., :self.embedding_dim]
        else:
            x = super().forward(tokens)
        return x if self.out_dtype is None or x.dtype == self.out_dtype else x.to(self.out_dtype)


class RMSNorm(nn.Module):
    fused: bool | None = None  # the C kernel (`ops.rmsnorm`) for fp32 CPU inputs: decided at the first such call

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and x.device.type == "cpu" and self.weight.dtype == torch.float32:
            if self.fused is None:
                self.fused = ops.available()
            if self.fused:
                return ops.rmsnorm(x, self.weight, self.eps)  # one C call instead of eight (a fixed per-row order)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE, half-split convention (Hugging Face's rotate_half). x [B, H, n, D]; cos, sin [B, 1, n, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Block(nn.Module):
    kernels: bool | None = None  # the fused-ops and exact-attention libraries are built (`fused`)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        d, h, hk, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = h * hd, hk * hd
        self.input_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.qkv = Linear(d, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o = Linear(h * hd, d, bias=False)
        self.post_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.gate_up = Linear(d, 2 * cfg.intermediate_size, bias=False)
        self.down = Linear(cfg.intermediate_size, d, bias=False)

    def forward(self, x, cos, sin, cache: KVCache, layer: int, start: int, mask, plan: "RowPlan | None" = None):
        B, n, _ = x.shape
        att = self.attend(self.qkv(self.input_norm(x)), cos, sin, cache, layer, start, mask, plan)
        x = x + self.o(att.reshape(B, n, -1))
        return x + self.mlp(self.post_norm(x))

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        """down(silu(gate) * up), silu * up in one C call (`ops.silu_mul`) for fp32 CPU activations when the ops
        library is built, as `ops.forward_layers` computes it: every route through a layer gives the same bits."""
        gu = self.gate_up(x)
        if gu.dtype == torch.float32 and gu.device.type == "cpu" and ops.available():
            return self.down(ops.silu_mul(gu))
        gate, up = gu.chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)

    def fused(self, qkv: torch.Tensor, keys: torch.Tensor) -> bool:
        """Whether an exact forward runs RoPE + cache write (`ops.rope_store`) and attention (`attention.attend`)
        as two C calls: fp32 CPU activations and cache, a head dim the attention kernel takes, and both libraries
        built (asked once per block: a model keeps its path). Same bits as the torch route."""
        if self.kernels is None:
            self.kernels = ops.available() and attention.available()
        return (self.kernels and qkv.dtype == torch.float32 and keys.dtype in attention.FORMATS
                and qkv.device.type == "cpu"
                and qkv.is_contiguous() and keys.is_contiguous() and attention.supports_dims(keys.shape[-1]))

    def heads(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """q [B, H, n, D], k and v [B, H_kv, n, D] from the fused projection [B, n, q|k|v], RoPE on q and k."""
        B, n, _ = qkv.shape
        cfg = self.cfg
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(B, n, cfg.num_heads, cfg.head_dim).transpose(1, 2)
        k = k.view(B, n, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        v = v.view(B, n, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        return rotate(q, cos, sin), rotate(k, cos, sin), v

    def static(self, x, cos, sin, cache: KVCache, layer: int, slots: torch.Tensor, mask: torch.Tensor):
        """`forward` with every shape and address fixed, for a captured CUDA graph (`runtime.cuda_graphs`): k and v
        go to the cache slots `slots` [n] by index, and attention reads the whole cache under `mask` [1, 1, n,
        max_len] (a slot not yet written is masked out)."""
        B, n, _ = x.shape
        q, k, v = self.heads(self.qkv(self.input_norm(x)), cos, sin)
        keys, values = cache.k[layer], cache.v[layer]
        keys.index_copy_(2, slots, k)
        values.index_copy_(2, slots, v)
        att = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                             enable_gqa=self.cfg.num_heads != self.cfg.num_kv_heads)
        x = x + self.o(att.transpose(1, 2).reshape(B, n, -1))
        return x + self.mlp(self.post_norm(x))

    def attend(self, qkv, cos, sin, cache: KVCache, layer: int, start: int, mask, plan: "RowPlan | None"):
        """Attention of n new positions [B, n, H, D] from their fused projection qkv [B, n, q|k|v]: RoPE on q and
        k, k and v written to the cache's slots start.., then attention under `plan` (exact models: each row over
        the keys a single-position forward sees) or `mask`. The batched server calls it per request."""
        n = qkv.shape[1]
        cfg = self.cfg
        if plan is not None and self.fused(qkv, cache.k[layer]):  # RoPE, cache write and attention: two C calls
            q = ops.rope_store(qkv, cos, sin, cache, layer, start, cfg.num_heads, cfg.num_kv_heads)
            return attention.attend(q, cache.k[layer], cache.v[layer], plan.rows)
        q, k, v = self.heads(qkv, cos, sin)
        cache.write(layer, k, v, start)
        if plan is not None:
            return attend_rows(q, k, v, cache, layer, plan, cfg.num_heads != cfg.num_kv_heads).transpose(1, 2)
        keys, values = cache.view(layer, start + n)
        if keys.dtype != q.dtype:  # a cache built in another dtype than the activations
            keys, values = keys.to(q.dtype), values.to(q.dtype)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                              enable_gqa=cfg.num_heads != cfg.num_kv_heads).transpose(1, 2)


class FusedLayers:
    """A decoder's layers as one C call per forward (`ops.forward_layers`): the calls `Block.forward` makes one by
    one from Python (RMSNorm, the projections' kernels, RoPE and the cache write, exact attention, silu * up),
    made in the same order from C, so the same bits for a fraction of the dispatch cost. For exact models on
    the host whose every projection runs a C kernel (quantized parts, or bf16 weights on the skinny kernel).

        FusedLayers.of(model)  # None when some layer cannot run so (then `Block.forward` runs each layer)
    """

    PARTS, PART_WORDS = 3, 7  # as ops.c

    def __init__(self, model: "Transformer"):
        cfg = model.cfg
        self.keep: list[torch.Tensor] = []  # fp32 biases made here, alive as long as the descriptor
        rows = []
        for block in model.layers:
            row = [block.input_norm.weight.data_ptr(), block.post_norm.weight.data_ptr()]
            for proj in (block.qkv, block.o, block.gate_up, block.down):
                parts = self._parts(proj)
                row += [len(parts)] + sum(parts, []) + [0] * (self.PART_WORDS * (self.PARTS - len(parts)))
            rows.append(row)
        self.desc = torch.tensor(rows, dtype=torch.int64)
        q = next((b.qkv.use for b in model.layers if isinstance(b.qkv, QLinear)), None)
        path = next((b.qkv.path for b in model.layers if isinstance(b.qkv, Linear)), None)
        whole = all(qw.in_features % quant.BLOCK == 0 for b in model.layers for proj in (b.qkv, b.o, b.gate_up, b.down)
                    if isinstance(proj, QLinear) for qw, _, _ in proj.calls)
        prefill = quant.prefill_isa() if q and whole else None  # the prefill path takes whole blocks of inputs
        self.isas = [quant.ISAS[q] if q else 0, kernels.PATHS[path][0] if path else 0]  # attend's: per cache dtype
        self.prefill_isa = quant.PREFILL_ISAS[prefill] if prefill else 0
        self.fns = [ops.pointer(quant._load().qgemm) if q else 0,
                    ops.pointer(kernels._load().skinny_bf16) if path else 0, ops.pointer(attention._load().attend_batch)]
        self.dims = [cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size]
        self.eps = cfg.rms_norm_eps

    def _parts(self, proj) -> list[list[int]]:
        if isinstance(proj, QLinear):
            out = []
            for qw, bias, _ in proj.calls:
                fmt, w, sc, mn = qw.pointers
                out.append([0, fmt, w, sc, mn or 0, 0 if bias is None else bias.data_ptr(), qw.out_features])
            return out
        bias = None if proj.bias is None else proj.bias.detach().float().contiguous()
        if bias is not None:
            self.keep.append(bias)
        return [[1, 0, proj.weight.data_ptr(), 0, 0, 0 if bias is None else bias.data_ptr(), proj.out_features]]

    @classmethod
    def of(cls, model: "Transformer") -> "FusedLayers | None":
        """The fused layers of `model`, or None: a model off the host, not `row_exact`, a projection on torch's
        matmul, a kernel library missing, more than PARTS parts, or a head dim the attention kernel lacks."""
        if model.device.type != "cpu" or not model.row_exact or not (ops.available() and attention.available()):
            return None
        if not attention.supports_dims(model.cfg.head_dim):
            return None
        for block in model.layers:
            if any(n.weight.dtype != torch.float32 for n in (block.input_norm, block.post_norm)):
                return None
            for proj in (block.qkv, block.o, block.gate_up, block.down):
                if isinstance(proj, QLinear):
                    if proj.use == "torch" or len(proj.calls) > cls.PARTS:
                        return None
                elif not (isinstance(proj, Linear) and proj.weight.dtype == torch.bfloat16 and proj.path
                          and proj.path != "torch" and proj.weight.is_contiguous()
                          and (proj.weight.dim() == 4 or not kernels.packs(proj.path))):
                    return None
        return cls(model)

    def __call__(self, x: torch.Tensor, segments: list[tuple], layers: int, hidden: dict[int, torch.Tensor]) -> None:
        """Run the first `layers` layers on x [1, N, d] (fp32, contiguous) in place; hidden[i] receives x after
        layer i. segments: (first row, rows, cache, start, RowPlan, cos, sin, prefill) per request whose rows
        these are, in row order, cos and sin [rows, D] contiguous (one request: one segment over all N rows);
        `prefill` marks prompt rows, whose quantized matmuls take `quant.prefill_isa()` where there is one."""
        segs, kv, dtype = [], [], segments[0][2].k[0].dtype
        for row0, n, cache, start, plan, cos, sin, prefill in segments:
            if cache.k[0].dtype != dtype:
                raise ValueError("FusedLayers: every request's KV cache must hold the same dtype")
            r = plan.rows
            segs += [row0, n, start, cache.max_len, r.prefix.data_ptr(), r.offs.data_ptr(), r.extra.data_ptr(),
                     cos.data_ptr(), sin.data_ptr(), int(prefill)]
            kv += cache.pointers()[:2 * layers]
        out = [hidden[i].data_ptr() if i in hidden else 0 for i in range(layers)]
        ops.forward_layers(self.desc, segs, kv, out, x, self.dims + [x.shape[1], layers, len(segments)], self.eps,
                           self.isas + [attention.best_code(self.dims[3], dtype), torch.get_num_threads(),
                                        self.prefill_isa, attention.FORMATS[dtype]], self.fns)


@dataclass
class RowPlan:
    """Which keys each of n query rows attends to, worked out once per forward (not per layer): row i sees the
    cache's first `start` slots, then the new positions paths[i] (its ancestors and itself, ascending; row i of
    a causal chain: 0..i), the keys a single-position forward at that node sees. `attend_rows` runs it."""

    start: int
    n: int
    paths: list[list[int]] | None = None  # None: a causal chain

    @classmethod
    def causal(cls, n: int, start: int) -> "RowPlan":
        return cls(start, n)

    @classmethod
    def from_mask(cls, mask: torch.Tensor, start: int) -> "RowPlan | None":
        """The plan of a mask [1, 1, n, start+n]: each row sees the whole cache and the new positions its mask
        row allows; None when the mask cannot be met so (a cached slot hidden, per-batch masks)."""
        if mask.shape[0] != 1 or not bool(mask[..., :start].all()):
            return None
        return cls(start, mask.shape[2], [[j for j, seen in enumerate(row) if seen]
                                          for row in mask[0, 0, :, start:].tolist()])

    @cached_property
    def rows(self) -> attention.Rows:
        """The key slots per row, for the exact-attention kernel."""
        if self.paths is None:
            return attention.Rows.chain(self.n, self.start)
        return attention.Rows.from_paths(self.paths, self.start)

    @cached_property
    def steps(self) -> tuple[list[tuple[int, int, torch.Tensor | None]], bool]:
        """For the torch fallback: per row (keys, at, moved): it attends to the cache's first start + keys slots,
        after writing the new positions `moved` (a LongTensor, or None) into slots start + at onwards; and
        whether the new positions' own keys must be put back in slots start.. afterwards. A chain's rows need
        no writes; a tree's row rewrites only where its path leaves the one in place (trie order keeps that
        short). Example: root -> a, b; a -> c (paths [[0], [0, 1], [0, 2], [0, 1, 3]]): row b writes b into
        slot start+1; row c writes a and c into slots start+1, start+2."""
        if self.paths is None:
            return [(i + 1, i + 1, None) for i in range(self.n)], False
        placed = list(range(self.n))  # which new position each slot from `start` holds
        rows = []
        for path in self.paths:
            same = next((j for j, (a, b) in enumerate(zip(placed, path)) if a != b), len(path))
            moved = torch.tensor(path[same:]) if same < len(path) else None
            placed[same:len(path)] = path[same:]
            rows.append((len(path), same, moved))
        return rows, placed != list(range(self.n))


def attend_rows(q, k, v, cache: KVCache, layer: int, plan: RowPlan, gqa: bool) -> torch.Tensor:
    """Attention of q [B, H, n, D] where each row sees exactly the keys (`plan`) a single-position forward at
    that node sees, in the same order, so verification is bit-identical to plain decoding. k, v: the new
    positions' keys and values, already written to slots plan.start.. of the cache.

    With the exact-attention kernel (`kernels.attention`): one call, the rows' key lists naming the cache
    slots directly. Without it: one torch call per row over the cache's slots 0..start-1 and the row's
    ancestors and itself written right after them (`RowPlan.steps`), the very call plain decoding makes."""
    keys, values = cache.k[layer], cache.v[layer]
    if attention.available() and attention.supports(q, keys):
        return attention.attend(q, keys, values, plan.rows).transpose(1, 2)
    start, (steps, restore) = plan.start, plan.steps
    out = []
    for i, (seen, at, moved) in enumerate(steps):
        if moved is not None:
            cache.write(layer, k[:, :, moved], v[:, :, moved], start + at)
        key, value = cache.view(layer, start + seen)
        if key.dtype != q.dtype:  # an fp16 cache under fp32 activations
            key, value = key.to(q.dtype), value.to(q.dtype)
        out.append(F.scaled_dot_product_attention(q[:, :, i:i + 1], key, value, enable_gqa=gqa))
    if restore:
        cache.write(layer, k, v, start)
    return torch.cat(out, dim=2)


class Transformer(nn.Module):
    quantized: str | None = None  # "q8" / "q4" when the loader made the projections QLinear

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self._rope_cache: tuple[torch.Tensor, torch.Tensor] | None = None

    @cached_property
    def fused_layers(self) -> FusedLayers | None:
        """The layers as one C call per forward (`FusedLayers`), or None; decided on first use (after loading:
        the projections' kernels and paths are set by then). SPECDEC_FUSED=0 turns it off."""
        return None if os.environ.get("SPECDEC_FUSED", "1") == "0" else FusedLayers.of(self)

    @property
    def dtype(self) -> torch.dtype | str:
        """The weights' dtype (what `--dtype` chose): names probes and measurements. "q8" or "q4" when the
        projections are quantized (QLinear; the embedding table then stays bf16 for lookups)."""
        return self.quantized or self.embed.weight.dtype

    def num_weights(self) -> int:
        """Parameters, counting quantized projections (QLinear) by their weights and biases (tied ones once)."""
        quantized = sum(sum(p.out_features * p.in_features for p in m.parts) + (0 if m.bias is None else m.bias.numel())
                        for m in self.modules() if isinstance(m, QLinear))
        return sum(p.numel() for p in self.parameters()) + quantized

    @property
    def device(self) -> torch.device:
        """Where the weights and the KV cache live (`--device`): the CPU, or a CUDA GPU running torch's own
        kernels. Everything else (the loop, drafts, verification, sampling) runs on the host: `forward` takes
        host tensors and returns host tensors."""
        return self.norm.weight.device

    @property
    def compute_dtype(self) -> torch.dtype:
        """The activations' dtype: fp32 when bf16 weights run through the kernel."""
        return self.norm.weight.dtype

    kv_choice: torch.dtype | None = None  # `--kv-dtype` fp16 / bf16 / fp32; None: `kv_dtype`'s default

    @property
    def kv_dtype(self) -> torch.dtype:
        """The KV cache's dtype: `kv_choice` when set, else for an exact model on the CPU bf16 where bf16 weights
        attend on AMX tiles and fp16 elsewhere (half the cache's bytes; see the module's docstring), else the
        activations' dtype."""
        if self.kv_choice is not None:
            return self.kv_choice
        if self.row_exact and self.device.type == "cpu":
            tiles = self.dtype == torch.bfloat16 and attention.on_tiles(self.cfg.head_dim)
            return torch.bfloat16 if tiles else torch.float16
        return self.compute_dtype

    @property
    def row_exact(self) -> bool:
        """True when bf16 weights run through the kernel, or the projections are quantized (q8/q4): every
        verification forward (a chain, a tree, a lookahead window) then gives bit-identical logits to
        single-position forwards (`attention_plan`), so greedy speculation is exact."""
        return self.dtype in quant.FORMATS or (self.dtype == torch.bfloat16 and self.compute_dtype == torch.float32)

    def prefill(self, tokens: Sequence[int], cache: KVCache, hidden_layers: Sequence[int] = (),
                exit_layer: int | None = None) -> ForwardOutput | None:
        """Feed prompt tokens after the cache's content in `prefill_spans` pieces; the last piece's output
        (logits and the final norm's hidden state, -1, of its last position only; the hidden states of layers
        >= 0 at every fed position), or None when there is nothing to feed."""
        out, start, layers = None, cache.length, []
        for a, b in prefill_spans(start, start + len(tokens)):
            out = self(torch.tensor([list(tokens[a - start:b - start])]), cache, hidden_layers=hidden_layers,
                       exit_layer=exit_layer, last_only=True, prefill=True)
            layers.append(out.hidden)
        if len(layers) > 1:
            out.hidden.update({i: torch.cat([h[i] for h in layers], dim=1) for i in out.hidden if i >= 0})
        return out

    def new_cache(self, max_len: int | None = None, batch: int = 1) -> KVCache:
        max_len = max_len or self.cfg.max_position_embeddings
        if batch == 1 and cuda_graphs.enabled(self):  # pooled, with the graphs captured on it
            return cuda_graphs.new_cache(self, max_len)
        return KVCache(self.cfg.num_layers, batch, self.cfg.num_kv_heads, max_len, self.cfg.head_dim,
                       self.kv_dtype, self.device)

    def attention_plan(self, n: int, start: int, mask: torch.Tensor | None = None):
        """(mask, plan) for n new positions after `start` cached ones; `mask` [B|1, n, start+n] or None (causal).

        fp32 and plain bf16: one attention call under the mask (causal by default). Exact models (`row_exact`):
        a `RowPlan` for `attend_rows`, so every forward (decoding, chains of any length, prefill, any explicit
        mask: trees, lookahead windows) gives each position the logits of single-position forwards bit for bit.
        Without the exact-attention kernel, chains longer than ROW_EXACT_MAX (prefill) keep one masked call."""
        if mask is not None and mask.dim() == 3:
            mask = mask.unsqueeze(1)  # [B, 1, n, S]: one mask for all heads
        if self.row_exact:
            if mask is None and (n <= ROW_EXACT_MAX or attention.available()):
                return None, RowPlan.causal(n, start)
            if mask is not None:
                plan = RowPlan.from_mask(mask, start)
                if plan is not None:
                    return None, plan
        if mask is None and n > 1:
            mask = torch.ones(n, start + n, dtype=torch.bool).tril(diagonal=start)
        return mask, None

    def _rope(self, positions: torch.Tensor | range) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for positions [B, n] -> [B, 1, n, D] in the model dtype (computed in fp32 once). A range of
        positions (the same for every row) gives [1, 1, n, D] views of the table: no gather, two fewer small torch
        calls a forward (each costs tens of microseconds right after a forward; `Draft._check_lists`)."""
        span = isinstance(positions, range)
        need = positions.stop if span else int(positions.max()) + 1
        if self._rope_cache is None or self._rope_cache[0].shape[0] < need:
            size = max(need, self.cfg.max_position_embeddings)
            hd = self.cfg.head_dim
            inv_freq = 1.0 / (self.cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
            freqs = torch.outer(torch.arange(size, dtype=torch.float32), inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)
            dt = self.compute_dtype
            self._rope_cache = (emb.cos().to(self.device, dt), emb.sin().to(self.device, dt))
        cos, sin = self._rope_cache
        if span:
            return cos[positions.start:positions.stop][None, None], sin[positions.start:positions.stop][None, None]
        return cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, cache: KVCache, positions: torch.Tensor | None = None,
                mask: torch.Tensor | None = None, hidden_layers: Sequence[int] = (),
                exit_layer: int | None = None, last_only: bool = False, on_device: bool = False,
                prefill: bool = False) -> ForwardOutput:
        """Logits [B, n, V] fp32 (n = 1 with `last_only`) and the requested hidden states, on the host (on the
        model's device with `on_device`: batched data generation keeps its loop there). `prefill`: the tokens
        are prompt tokens (`prefill`), whose quantized matmuls may take a faster path (`quant.prefill_isa`)."""
        B, n = tokens.shape
        start = cache.length
        if start + n > cache.max_len:
            raise ValueError(f"context overflow: {start + n} positions exceed the cache's {cache.max_len}")
        if positions is None:
            positions = range(start, start + n)
        mask, plan = self.attention_plan(n, start, mask)
        if B == 1 and plan is None and not (prefill or on_device or exit_layer is not None) and cuda_graphs.enabled(self):
            graphed = cuda_graphs.forward(self, tokens, cache, positions, mask, hidden_layers, last_only)
            if graphed is not None:  # a step on a GPU: one replay of a captured graph
                logits, hidden = graphed
                return ForwardOutput(logits.cpu(), {i: h.cpu() for i, h in hidden.items()})
        device = self.device
        on_host = device.type == "cpu"
        if not on_host:  # the caller's host tensors move to the device; the outputs come back below
            tokens = tokens.to(device)
            positions = positions if isinstance(positions, range) else positions.to(device)
            mask = None if mask is None else mask.to(device)
        cos, sin = self._rope(positions)
        x = self.embed(tokens)
        hidden: dict[int, torch.Tensor] = {}
        n_layers = self.cfg.num_layers if exit_layer is None else exit_layer
        if plan is not None and B == 1 and on_host and self.fused_layers is not None and x.dtype == torch.float32:
            x = x.contiguous()
            hidden = {i: torch.empty_like(x) for i in hidden_layers if 0 <= i < n_layers}
            self.fused_layers(x, [(0, n, cache, start, plan, cos, sin, prefill)], n_layers, hidden)
        else:
            for i in range(n_layers):
                x = self.layers[i](x, cos, sin, cache, i, start, mask, plan)
                if i in hidden_layers:
                    hidden[i] = x
        cache.length = start + n
        if last_only:
            x = x[:, -1:]
        x = self.norm(x)
        if -1 in hidden_layers:
            hidden[-1] = x
        logits = self.lm_head(x).float()
        if not on_host and not on_device:
            logits, hidden = logits.cpu(), {i: h.cpu() for i, h in hidden.items()}
        return ForwardOutput(logits, hidden)
