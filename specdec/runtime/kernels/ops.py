"""RMSNorm and RoPE + KV-cache write as one C call each (`ops.c`), for the exact CPU path of a decoder block;
the argmax of logits rows (greedy verification), their top k (token recycling's table) and inverse-CDF sampling of
probability rows.

Why: between its matmuls a decoder block runs ~35 small torch operations (two RMSNorms, the split of q|k|v,
RoPE on q and k, the cache write) whose dispatch costs ~3 ms of a 28 ms q4 step of Qwen2.5-Coder-1.5B; here
they cost a few microseconds a layer. `rope_store` gives torch's bits (the same products and sums, each
rounded once); `rmsnorm` sums squares in its own fixed order, the same for every row whatever n is.

Example (a block's attention input, n new positions after `start` cached ones, q|k|v fused):

    q = ops.rope_store(qkv, cos, sin, cache, layer, start, heads, kv_heads)  # [B, H, n, D] view of qkv
    # k and v of the n positions now sit in cache slots start .. start + n - 1, rotated like q

Used when `available()` (the library built; AVX2 + FMA; `SPECDEC_KERNEL` not 0) on fp32 CPU tensors; the
model falls back to torch otherwise.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from specdec.runtime import kernels
from specdec.runtime.kernels.attention import FORMATS  # KV-cache dtype -> format code, as ops.c takes it too

SOURCE = Path(__file__).with_name("ops.c")
CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-shared", "-fPIC"]


def _declare(lib) -> None:
    lib.rmsnorm.restype = None
    lib.rmsnorm.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                            ctypes.c_int64, ctypes.c_int64, ctypes.c_float]
    lib.rope_store.restype = ctypes.c_int
    lib.rope_store.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 7 + [ctypes.c_int]
    lib.silu_mul.restype = None
    lib.silu_mul.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
    lib.argmax_rows.restype = None
    lib.argmax_rows.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_void_p]
    lib.sample_rows.restype = ctypes.c_int
    lib.sample_rows.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 2
    lib.kth_largest.restype = ctypes.c_int
    lib.kth_largest.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 4 + [ctypes.c_void_p]
    lib.topk_rows.restype = ctypes.c_int
    lib.topk_rows.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 4 + [ctypes.c_void_p]
    lib.forward_layers.restype = ctypes.c_int
    lib.forward_layers.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_float] + [ctypes.c_void_p] * 2
    lib.ops_supported.restype = ctypes.c_int
    if not lib.ops_supported():
        raise RuntimeError("the CPU lacks AVX2 or FMA")


_kernel = kernels.Library(SOURCE, CFLAGS, _declare, "the fused RMSNorm/RoPE kernel is unavailable; using torch",
                          needs_avx2=True)


def available() -> bool:
    """True when the library is enabled (`SPECDEC_KERNEL`) and built (compiling it on first call)."""
    return kernels.enabled() and _kernel.get() is not None


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps) over the last dim of an fp32 CPU tensor (any leading shape)."""
    if not x.is_contiguous():
        x = x.contiguous()
    y = torch.empty_like(x)
    d = x.shape[-1]
    _kernel.lib.rmsnorm(x.data_ptr(), d, weight.data_ptr(), y.data_ptr(), d, x.numel() // d, d, eps)
    return y


def rope_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache, layer: int, start: int,
               heads: int, kv_heads: int) -> torch.Tensor:
    """Rotate q in place in qkv [B, n, (heads + 2 kv_heads) D] (fp32, contiguous), write rotated k and v to the
    cache's slots start.. of `layer` (an fp32, fp16 or bf16 cache: rounded to nearest even as `.to()` rounds); returns q
    as a [B, heads, n, D] view. cos, sin: [B, (1,) n, D] contiguous."""
    B, n, width = qkv.shape
    D = width // (heads + 2 * kv_heads)
    keys, values = cache.k[layer], cache.v[layer]
    rc = _kernel.lib.rope_store(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), keys.data_ptr(), values.data_ptr(),
                                B, n, heads, kv_heads, D, keys.shape[2], start, FORMATS[keys.dtype])
    if rc:
        raise ValueError(f"rope_store: head dim {D} not supported")
    return qkv.view(B, n, heads + 2 * kv_heads, D)[:, :, :heads].transpose(1, 2)


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for a fused gate|up projection's output gu [..., 2 I] (fp32 CPU): [..., I]."""
    if not gu.is_contiguous():
        gu = gu.contiguous()
    I = gu.shape[-1] // 2
    out = torch.empty(*gu.shape[:-1], I)
    _kernel.lib.silu_mul(gu.data_ptr(), out.data_ptr(), gu.numel() // (2 * I) if I else 0, I)
    return out


def argmax(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(-1)`, the same indices (the first maximal one; a NaN counts as maximal), for a 1-D or 2-D tensor:
    through `argmax_rows` for fp32 CPU rows when the library is available (20 us where torch's took 92 for a
    row of SmolLM2's 49152 logits), else torch's. Example: argmax([[1, 3, 3], [nan, 5, 0]]) is [1, 0]."""
    if not (x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() in (1, 2) and x.shape[-1]
            and x.stride(-1) == 1 and available()):
        return x.argmax(-1)
    rows = x.view(1, -1) if x.dim() == 1 else x
    out = torch.empty(rows.shape[0], dtype=torch.long)
    _kernel.lib.argmax_rows(rows.data_ptr(), rows.shape[0], rows.shape[1], rows.stride(0), out.data_ptr())
    return out[0] if x.dim() == 1 else out


def topk_rows(x: torch.Tensor, k: int) -> torch.Tensor:
    """The indices of each row's k largest entries, largest first, [rows, k] (ties to the lower index), for a 2-D
    tensor: `ops.c`'s `topk_rows` for fp32 CPU rows (a NaN never counts), else (or where a row has fewer than k
    entries above -inf) torch's `topk` (whose order among ties is its own).
    Example: topk_rows([[1., 3., 3., 0.]], 2) is [[1, 2]]."""
    if not (x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 2 and 0 < k <= x.shape[-1]
            and x.stride(-1) == 1 and available()):
        return x.topk(k, dim=-1).indices
    out = torch.empty(x.shape[0], k, dtype=torch.long)
    if _kernel.lib.topk_rows(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), k, out.data_ptr()):
        return x.topk(k, dim=-1).indices
    return out


def sample_rows(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor | None:
    """One token per row of fp32 CPU probabilities [rows, V] (unit stride) at the float64 uniforms u [rows]:
    `ops.c`'s `sample_rows` (see there), -1 for a row that is not a distribution; None where the library is
    unavailable or the tensor is not such rows (the caller samples with torch)."""
    if not (probs.dtype == torch.float32 and probs.device.type == "cpu" and probs.dim() == 2 and probs.shape[-1]
            and probs.stride(-1) == 1 and available()):
        return None
    u = u.to(torch.float64).contiguous()
    out = torch.empty(probs.shape[0], dtype=torch.long)
    if _kernel.lib.sample_rows(probs.data_ptr(), probs.shape[0], probs.shape[1], probs.stride(0), u.data_ptr(),
                               out.data_ptr()):
        raise MemoryError("sample_rows: out of memory")
    return out


def kth_largest(x: torch.Tensor, k: int) -> torch.Tensor:
    """The k-th largest value of each row of x [..., V] as [..., 1], duplicates counted: torch.topk's
    values[..., k - 1:], through `ops.c`'s `kth_largest` for fp32 CPU rows (no NaN) when the library is available
    (0.1 ms for 4 rows of 151936 with k = 50, where torch.topk took 2.3), else torch.topk."""
    rows = x.reshape(-1, x.shape[-1]) if x.dim() else x
    if not (x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() and 1 <= k <= x.shape[-1]
            and rows.stride(-1) == 1 and available()):
        return torch.topk(x, k, dim=-1).values[..., -1:]
    out = torch.empty(rows.shape[0], dtype=torch.float32)
    if _kernel.lib.kth_largest(rows.data_ptr(), rows.shape[0], rows.shape[1], rows.stride(0), k, out.data_ptr()):
        raise MemoryError("kth_largest: out of memory")
    return out.view(*x.shape[:-1], 1)


def pointer(f) -> int:
    """The address of a ctypes function (another kernel library's entry point, for `forward_layers`)."""
    return ctypes.cast(f, ctypes.c_void_p).value


def forward_layers(desc: torch.Tensor, segs: list[int], kv: list[int], hidden: list[int], x: torch.Tensor,
                   dims: list[int], eps: float, isas: list[int], fns: list[int]) -> None:
    """Run dims[6] decoder layers on x [1, N, d] in place (see ops.c), as `model.FusedLayers` lays the arguments
    out: desc the layers' weights (int64 [layers, LAYER_WORDS]), segs per segment (first row, rows, cache start,
    cache slots, attention rows' prefix, offs, extra, cos, sin addresses, 1 for prompt rows being prefilled),
    kv per segment and layer the cache's k and v, hidden per layer an output or 0, dims (d, H, Hk, D, I, N,
    layers, segments), isas (qgemm, skinny_bf16, attend, threads, qgemm for prefill rows or 0, the caches'
    format: 0 fp32, 1 fp16, 2 bf16), fns (the first three's addresses)."""
    i64 = ctypes.c_int64
    rc = _kernel.lib.forward_layers(desc.data_ptr(), (i64 * len(segs))(*segs), (i64 * len(kv))(*kv),
                                    (i64 * len(hidden))(*hidden), x.data_ptr(), (i64 * len(dims))(*dims), eps,
                                    (ctypes.c_int * 6)(*isas), (i64 * 3)(*fns))
    if rc:
        raise MemoryError("forward_layers: out of memory") if rc == 2 else RuntimeError(f"forward_layers: a kernel failed ({rc})")
