"""Exact attention for n query rows in one call (`attention.c`): each row's output is, bit for bit, what a
call for that row alone gives, so a verification forward's logits equal single-position forwards'.

What it does. `attend(q, keys, values, rows)` computes softmax(q·Kᵀ/√D)·V for q [B, H, n, D] against one
layer's KV cache [B, Hk, S, D] (GQA: query head h reads KV head h // (H / Hk)), where row i attends to the
key slots `rows` names: the cache's first `prefix[i]` slots, then a few more (a tree node's ancestors and
itself among the new positions). The result is [B, n, H, D].

Why. Greedy speculation is exact only when a position's logits do not depend on how many positions share
the forward. The matmul kernels guarantee that per output; one torch attention call over n rows does not
(its blocking depends on n), and one call per row costs a Python round trip per row and layer. The C
routine fixes every (row, head)'s order of operations (see `attention.c`) and runs all of them in one call
on torch's thread count.

Worked example. A tree root -> a, b; a -> c after 5 cached positions (new positions 0..3 in slots 5..8,
paths [[0], [0, 1], [0, 2], [0, 1, 3]]): `Rows.from_paths(paths, 5)` gives prefix [6, 7, 6, 7] and extras
[], [], [7], [8]: c walks slots 0..6 then 8, the keys (cache, root, a, c) its single-position forward sees.

Instruction sets: AVX512F (16 lanes; head dims that are multiples of 16) where the CPU has it, else AVX2 + FMA
(`isa`); a machine always takes the same path, the paths give different bits. The cache may hold fp32, fp16 or
bf16 (the model's `kv_dtype`): fp16 and bf16 are widened exactly as they are loaded, so they give an fp32 cache's
bits for the same values, in half the bytes. A bf16 cache on a CPU with AMX attends on tiles instead ("amx"):
q, k, the softmax weights p and v in bf16 with fp32 sums, as torch's bf16 attention computes, and still in an
order that does not depend on n (`attention.c`, "AMX"). The library is built on first
use like the other kernels (`kernels.open_library`); without it, or with `SPECDEC_KERNEL=0`, `available()`
is False and the model attends row by row through torch instead.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.runtime import kernels


SOURCE = Path(__file__).with_name("attention.c")
CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]
MAX_HEAD_DIM = 256  # DMAX in attention.c
ISAS = {"amx": 3, "avx512": 2, "avx2": 1}  # best first: AMX (bf16 caches), AVX512F, AVX2 + FMA
FORMATS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # the cache dtypes `attend` takes



@dataclass
class Rows:
    """The key slots each of n query rows sees: slots 0..prefix[i]-1, then extra[offs[i]:offs[i+1]] (ascending)."""

    prefix: torch.Tensor  # [n] int64
    offs: torch.Tensor    # [n + 1] int64
    extra: torch.Tensor   # [offs[-1]] int64 (at least one element, so it has an address)

    @property
    def n(self) -> int:
        return self.prefix.shape[0]

    @classmethod
    def chain(cls, n: int, start: int) -> "Rows":
        """A causal chain of n new positions after `start` cached ones: row i sees slots 0..start+i."""
        return cls(torch.arange(start + 1, start + n + 1), torch.zeros(n + 1, dtype=torch.long),
                   torch.zeros(1, dtype=torch.long))

    @classmethod
    def from_paths(cls, paths: list[list[int]], start: int) -> "Rows":
        """paths[i]: the new positions (0-based, ascending) row i sees after the cache; the leading run
        0, 1, 2, ... of a path is part of its prefix, the rest are extra slots."""
        prefix, offs, extra = [], [0], []
        for path in paths:
            run = next((j for j, p in enumerate(path) if p != j), len(path))
            prefix.append(start + run)
            extra.extend(start + p for p in path[run:])
            offs.append(len(extra))
        return cls(torch.tensor(prefix), torch.tensor(offs), torch.tensor(extra or [0]))


def _declare(lib) -> None:
    lib.attend.restype = ctypes.c_int
    lib.attend.argtypes = ([ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 6
                           + [ctypes.c_int64] * 6 + [ctypes.c_int] * 3)
    lib.attend_supported.restype = ctypes.c_int
    lib.attend_supported.argtypes = [ctypes.c_int]
    if not lib.attend_supported(ISAS["avx2"]):
        raise RuntimeError("the CPU lacks AVX2, FMA or F16C")


_kernel = kernels.Library(SOURCE, CFLAGS, _declare, "the exact-attention kernel is unavailable; attending row by row",
                          needs_avx2=True)


def _load():
    return _kernel.get()


def available() -> bool:
    """True when the kernel is enabled (`SPECDEC_KERNEL`) and built (compiling it on first call); never raises."""
    return kernels.enabled() and _load() is not None


def reason() -> str:
    """Why the kernel is unavailable ("" when it is available or untried)."""
    return "disabled by SPECDEC_KERNEL=0" if not kernels.enabled() else _kernel.reason


def isas() -> list[str]:
    """The instruction sets this CPU runs the kernel on, best first ([] without the kernel)."""
    lib = _load() if kernels.enabled() else None
    return [name for name, code in ISAS.items() if lib is not None and lib.attend_supported(code)]


def isa(head_dim: int, kv_dtype: torch.dtype = torch.float32) -> str:
    """The instruction set `attend` uses for this head dim and cache dtype: amx for a bf16 cache when the CPU has
    it and 32 divides head_dim, else avx512 when the CPU has it and 16 divides head_dim, else avx2."""
    return next(name for name in isas() if (name != "amx" or (kv_dtype == torch.bfloat16 and head_dim % 32 == 0))
                and (name != "avx512" or head_dim % 16 == 0))


def on_tiles(head_dim: int) -> bool:
    """Whether a bf16 cache with this head dim attends on AMX tiles here (the kernel built, the CPU has AMX)."""
    return available() and head_dim % 32 == 0 and "amx" in isas()


def supports_dims(head_dim: int) -> bool:
    """Whether `attend` takes this head dim (a multiple of 8 up to 256)."""
    return head_dim % 8 == 0 and head_dim <= MAX_HEAD_DIM


def supports(q: torch.Tensor, keys: torch.Tensor) -> bool:
    """Whether `attend` takes these shapes and dtypes (fp32 q, an fp32, fp16 or bf16 cache, head dim a multiple of 8
    up to 256, GQA groups)."""
    d = q.shape[-1]
    return (q.dtype == torch.float32 and keys.dtype in FORMATS and supports_dims(d)
            and keys.shape[-1] == d
            and q.shape[0] == keys.shape[0] and q.shape[1] % keys.shape[1] == 0 and keys.is_contiguous())


_best: dict[tuple, int] = {}  # (head dim, cache dtype) -> ISAS code, once per process (a machine takes one path)


def best_code(head_dim: int, kv_dtype: torch.dtype) -> int:
    """`ISAS[isa(head_dim, kv_dtype)]`, worked out once per process."""
    key = (head_dim, kv_dtype)
    return _best.get(key) or _best.setdefault(key, ISAS[isa(head_dim, kv_dtype)])


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, rows: Rows,
           threads: int | None = None, use: str | None = None) -> torch.Tensor:
    """Attention of q [B, H, n, D] (fp32) over the slots `rows` names in keys, values [B, Hk, S, D] (both fp32,
    fp16 or bf16, contiguous): [B, n, H, D] fp32. `use`: an instruction set from `isas()` (default: `isa(D, dtype)`,
    the best). Call only when `available()` and `supports(q, keys)`."""
    B, H, n, D = q.shape
    if values.dtype != keys.dtype or values.shape != keys.shape:
        raise ValueError(f"attend: keys {keys.dtype} {tuple(keys.shape)} and values {values.dtype} "
                         f"{tuple(values.shape)} must match")
    code = ISAS[use] if use else best_code(D, keys.dtype)
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty(B, n, H, D)
    rc = (_kernel.lib if _kernel.state else _load()).attend(q.data_ptr(), q.stride(0), q.stride(1), q.stride(2), keys.data_ptr(), values.data_ptr(),
                     out.data_ptr(), rows.prefix.data_ptr(), rows.offs.data_ptr(), rows.extra.data_ptr(),
                     B, n, H, keys.shape[1], keys.shape[2], D, code, FORMATS[keys.dtype],
                     threads or torch.get_num_threads())
    if rc == 2:
        raise MemoryError("attend: out of memory")
    if rc:
        raise ValueError(f"attend: head dim {D}, heads {H}/{keys.shape[1]}, {use} or a {keys.dtype} cache not supported here")
    return out
