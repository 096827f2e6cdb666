"""Quantized weights (q8, q4) and their matmul: `y = x @ W^T` with W in blocks of 32, x and y in fp32.

Formats (one scale per block of 32 inputs of one output row, fp32 so nothing from a GGUF file rounds):
  q8: w = d * q,      q an int8 in -127..127 (GGUF Q8_0 with an fp32 scale);
  q4: w = s * q - m,  q in 0..15 (GGUF Q4_1 with fp32 scale and min). This holds GGUF Q4_K losslessly:
      a Q4_K super-block of 256 is 8 sub-blocks of 32 with w = d*sc*q - dmin*mn, so s = d*sc and
      m = dmin*mn (both exact in fp32: an fp16 times a 6-bit integer). Q4_1 (w = d*q + mn) and Q4_0
      (w = d*(q - 8)) map directly too.
Bytes per weight: q8 1.125, q4 0.75 (Q4_K's own 0.5625 plus the wider scales).

The matmul quantizes each row of x per block of 32 to int8 (GGUF Q8_0 activations: the scale depends
only on that row), takes exact integer dot products per block and applies the block scales in one fixed
order (`qgemm.c` gives the worked-out order). So every output is the same sequence of float operations
whatever n is: a forward over n positions is bit-identical to n single-position forwards, and the
instruction set (AVX512-VNNI `vpdpbusd`, AVX2 `vpmaddubsw` + `vpmaddwd`, or the torch code below) does
not change a single bit either.

Worked example, Qwen2.5-Coder-1.5B from its Q4_K_M file: the 1.31 G layer weights are Q4_K (0.75 bytes
here) except half the down and v projections (Q6_K, kept as q8 at 1.125 bytes), the LM head is Q6_K
(233 M weights as q8: 262 MB): about 1.3 GB a step against 3.1 GB in bf16.

Dispatch: the best ISA the CPU has (`SPECDEC_QKERNEL=vnni512|avx2|torch` forces one: tests compare
them). The C library is built on first use like the bf16 kernel (`specdec.runtime.kernels`); without
it the torch code runs (one warning), slower but with the same bits.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.runtime import kernels

log = logging.getLogger(__name__)

FORMATS = ("q8", "q4")
BLOCK = 32   # inputs per block (one scale)
GROUP = 16   # outputs per group in the packed layout (one 512-bit register of int32 lanes)
SOURCE = Path(__file__).with_name("qgemm.c")
CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]
_FMT = {"q8": 8, "q4": 4}
ISAS = {"vnni512": 2, "avx2": 1}  # best first

_lock = threading.Lock()
_lib = None
_state: bool | None = None
_reason = ""


@dataclass
class QWeight:
    """One quantized matrix [out, in] in the kernel's packed layout (see qgemm.c)."""

    fmt: str
    out_features: int
    in_features: int
    data: torch.Tensor            # uint8 [groups, blocks, 512 (q8) or 256 (q4)]
    scales: torch.Tensor          # fp32 [groups, blocks, 16]
    mins: torch.Tensor | None     # fp32 [groups, blocks, 16] (q4), None (q8)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.scales, self.mins) if t is not None)


# --- quantizing and packing ----------------------------------------------------------------------

def _blocks(w: torch.Tensor) -> torch.Tensor:
    """[out, in] -> [out, blocks, 32] fp32, the last block zero-padded."""
    out_f, in_f = w.shape
    pad = -in_f % BLOCK
    w = w.float()
    if pad:
        w = torch.nn.functional.pad(w, (0, pad))
    return w.reshape(out_f, -1, BLOCK)


def quantize(w: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Row-major blocks (q [out, blocks, 32], scales [out, blocks], mins or None) of the fp32 matrix w.
    q8: d = amax / 127, q = round(w / d). q4: min and max per block, s = (max - min) / 15,
    q = round((w - min) / s), m = -min."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}: choose one of {', '.join(FORMATS)}")
    b = _blocks(w)
    if fmt == "q8":
        d = b.abs().amax(-1) / 127
        inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        return torch.round(b * inv[..., None]).clamp(-127, 127).to(torch.int8), d, None
    lo, hi = b.amin(-1), b.amax(-1)
    s = (hi - lo) / 15
    inv = torch.where(s > 0, 1 / s, torch.zeros_like(s))
    q = torch.round((b - lo[..., None]) * inv[..., None]).clamp(0, 15).to(torch.uint8)
    return q, s, -lo


def pack(fmt: str, q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, in_features: int) -> QWeight:
    """Row-major blocks (as `quantize` returns them) -> the kernel's packed layout."""
    out_f, nb, _ = q.shape
    pad = -out_f % GROUP
    if pad:
        q = torch.cat([q, q.new_zeros(pad, nb, BLOCK)])
        scales = torch.cat([scales, scales.new_zeros(pad, nb)])
        mins = None if mins is None else torch.cat([mins, mins.new_zeros(pad, nb)])
    groups = q.shape[0] // GROUP
    if fmt == "q8":
        u = (q.to(torch.int16) + 128).to(torch.uint8)              # [out, nb, 32] -> [g, k, nb, t, e]
        data = u.reshape(groups, GROUP, nb, 8, 4).permute(0, 2, 3, 1, 4)
    else:
        n = q.reshape(groups, GROUP, nb, 4, 2, 4).permute(0, 2, 3, 1, 4, 5)  # [g, nb, c, k, lo/hi, e]
        data = n[..., 0, :] | (n[..., 1, :] << 4)
    lanes = lambda t: t.reshape(groups, GROUP, nb).transpose(1, 2).contiguous().float()
    return QWeight(fmt, out_f, in_features, data.reshape(groups, nb, -1).contiguous(), lanes(scales),
                   None if mins is None else lanes(mins))


def unpack(qw: QWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The packed layout -> row-major blocks (q int32 [out, blocks, 32], scales, mins or None)."""
    groups, nb, _ = qw.data.shape
    if qw.fmt == "q8":
        q = qw.data.reshape(groups, nb, 8, GROUP, 4).permute(0, 3, 1, 2, 4).to(torch.int32) - 128
    else:
        d = qw.data.reshape(groups, nb, 4, GROUP, 4).to(torch.int32)
        q = torch.stack([d & 15, d >> 4], dim=4).permute(0, 3, 1, 2, 4, 5)  # [g, k, nb, c, lo/hi, e]
    rows = lambda t: t.transpose(1, 2).reshape(-1, nb)[:qw.out_features]
    return (q.reshape(-1, nb, BLOCK)[:qw.out_features], rows(qw.scales),
            None if qw.mins is None else rows(qw.mins))


def dequantize(qw: QWeight) -> torch.Tensor:
    """The fp32 matrix [out, in] the quantized weights stand for."""
    q, s, m = unpack(qw)
    w = q.float() * s[..., None]
    if m is not None:
        w = w - m[..., None]
    return w.reshape(qw.out_features, -1)[:, :qw.in_features]


def from_fp32(w: torch.Tensor, fmt: str) -> QWeight:
    """Quantize and pack an fp32 (or bf16) matrix."""
    return pack(fmt, *quantize(w, fmt), in_features=w.shape[1])


# --- the matmul ------------------------------------------------------------------------------------

def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Activations [n, in] -> (qx int32 [n, blocks, 32], dx [n, blocks], sx int32 [n, blocks]), as qgemm.c."""
    b = _blocks(x)
    amax = b.abs().amax(-1)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    qx = torch.round(b * inv[..., None]).clamp(-127, 127).to(torch.int32)
    return qx, amax / 127.0, qx.sum(-1, dtype=torch.int32)


def reference(x: torch.Tensor, qw: QWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The torch path: x [n, in] fp32 -> y [n, out], the same float operations in the same order as qgemm.c."""
    q, s, m = unpack(qw)
    qx, dx, sx = quantize_rows(x)
    dxs = dx * sx.float()
    acc = torch.zeros(x.shape[0], qw.out_features)
    for b in range(q.shape[1]):
        isum = qx[:, b].float() @ q[:, b].float().t()  # exact: 32 products of at most 127 * 127 < 2^24
        acc = acc + (s[:, b] * dx[:, b, None]) * isum
        if m is not None:
            acc = acc - m[:, b] * dxs[:, b, None]
    return acc if bias is None else acc + bias.float()


def isa() -> str:
    """The instruction set the matmul runs on: vnni512, avx2, or torch (forced by SPECDEC_QKERNEL)."""
    forced = os.environ.get("SPECDEC_QKERNEL", "").strip().lower()
    if forced == "torch" or not kernels.enabled():
        return "torch"
    lib = _load()
    if lib is None:
        return "torch"
    for name, code in ISAS.items():
        if (not forced or forced == name) and lib.qgemm_supported(code):
            return name
    return "torch"


def _declare(lib) -> None:
    lib.qgemm.restype = ctypes.c_int
    lib.qgemm.argtypes = [ctypes.c_int, ctypes.c_int] + [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 4 + [ctypes.c_int]
    lib.qgemm_supported.restype = ctypes.c_int
    lib.qgemm_supported.argtypes = [ctypes.c_int]
    if not lib.qgemm_supported(ISAS["avx2"]):
        raise RuntimeError("the CPU lacks AVX2")


def _load():
    global _lib, _state, _reason
    if _state is not None:
        return _lib
    with _lock:
        if _state is not None:
            return _lib
        try:
            _lib, _state = kernels.open_library(SOURCE, CFLAGS, _declare), True
        except Exception as exc:  # no compiler, failed compile, unsupported CPU, unloadable library
            _lib, _state, _reason = None, False, str(exc)
            log.warning("specdec: the quantized-matmul kernel is unavailable (%s); using the torch path", exc)
        return _lib


def reason() -> str:
    """Why the C kernel is not used ("" when it is, or untried)."""
    return _reason


def matmul_into(y: torch.Tensor, col: int, x: torch.Tensor, qw: QWeight, bias: torch.Tensor | None = None,
                threads: int | None = None, use: str | None = None) -> None:
    """y[:, col : col + out] = x @ W^T + bias, x [n, in] fp32 contiguous, y [n, >= col + out] fp32 contiguous."""
    use = use or isa()
    n = x.shape[0]
    if not n:
        return
    if use == "torch" or _load() is None:
        y[:, col:col + qw.out_features] = reference(x, qw, bias)
        return
    b = None if bias is None else bias.float().contiguous()
    rc = _lib.qgemm(_FMT[qw.fmt], ISAS[use], x.data_ptr(), qw.data.data_ptr(), qw.scales.data_ptr(),
                    None if qw.mins is None else qw.mins.data_ptr(), None if b is None else b.data_ptr(),
                    y.data_ptr() + 4 * col, y.shape[1], n, qw.in_features, qw.out_features,
                    threads or torch.get_num_threads())
    if rc:
        raise MemoryError("qgemm: out of memory") if rc == 2 else RuntimeError(f"qgemm: {use} is not supported here")


def matmul(x: torch.Tensor, qw: QWeight, bias: torch.Tensor | None = None, threads: int | None = None,
           use: str | None = None) -> torch.Tensor:
    """y = x @ W^T + bias for x fp32 [..., in]."""
    if x.shape[-1] != qw.in_features:
        raise ValueError(f"quantized matmul: x has {x.shape[-1]} features, weight expects {qw.in_features}")
    flat = x.reshape(-1, qw.in_features).float().contiguous()
    y = torch.empty(flat.shape[0], qw.out_features)
    matmul_into(y, 0, flat, qw, bias, threads, use)
    return y.reshape(*x.shape[:-1], qw.out_features)
