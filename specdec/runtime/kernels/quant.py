"""Quantized weights and their matmul: `y = x @ W^T` with W in blocks of 32, x and y in fp32.

Formats (per output row, per block of 32 inputs; every scale as the GGUF file holds it, so nothing from a file
rounds):
  q8:  w = d * q,      q an int8 in -127..127, d fp16 (GGUF Q8_0);
  q4:  w = s * q - m,  q in 0..15, s and m fp16 (GGUF Q4_1). Q4_1 (w = d*q + mn) and Q4_0 (w = d*(q - 8))
       map to it directly;
  q4k: GGUF Q4_K as it is: super-blocks of 256 = 8 blocks of 32 with w = (d*sc)*q - dmin*mn, sc and mn
       6-bit integers per block (stored as bytes), d and dmin per super-block (the same weights as q4 with
       s = d*sc, m = dmin*mn, exact in fp32);
  q6k: GGUF Q6_K as it is: super-blocks of 256 = 16 sub-blocks of 16 with w = (d*sc)*(q - 32), q in
       0..63, sc an int8 per sub-block, d per super-block.
Bytes per weight: q8 1.0625, q4 0.625 (the files' own), q4k 0.5938 (the file's 0.5625), q6k 0.8281 (the
file's 0.8203). q8 and q4 keep each block's scales beside its bytes, one stream a matrix: a SmolLM2 q4 step
moves 96.4 MB instead of 111.5 with fp32 scales in streams of their own, and its forward takes 0.83-0.86x as
long (BENCHMARKS.md, session 34).
The `--dtype` names are q8 and q4 (FORMATS); a q4 model holds q4k, q6k, q4 and q8 parts as its GGUF has
them (`specdec.store.quantized`).

The matmul quantizes each row of x to int8 with one scale per block of 32 for q8 and q4 (GGUF Q8_0
activations) or per super-block of 256 for q4k and q6k (llama.cpp's Q8_K): the scale depends only on that
row. It takes exact integer dot products, per block (q8, q4) or summed over the super-block with the
integer sub-block scales (q4k, q6k: one float step per 256 inputs), and applies the float scales in one
fixed order (`qgemm.c` gives the worked-out order and the integer bounds). So every output is the same
sequence of float operations whatever n is: a forward over n positions is bit-identical to n
single-position forwards, and the instruction set (AVX512-VNNI `vpdpbusd`, AVX2 `vpmaddubsw` +
`vpmaddwd`, or the torch code below) does not change a single bit either.

Worked example, Qwen2.5-Coder-1.5B from its Q4_K_M file: the 1.31 G layer weights are Q4_K (q4k, 0.594
bytes) except half the down and v projections (Q6_K: q6k, 0.828 bytes), and the LM head is Q6_K (233 M
weights: 193 MB): about 1.02 GB a step against the file's 1.1 GB (it also holds the embedding table)
and 3.1 GB in bf16.

Dispatch: the best ISA the CPU has (`SPECDEC_QKERNEL=vnni512|avx2|torch` forces one: tests compare
them). Prompt rows may take another path (`prefill_isa`: AMX tiles on bf16-dequantized weights, where the CPU
has AMX-BF16), the same for every prompt row whatever the chunk, so every method sees the same KV cache. The C
library is built on first use like the bf16 kernel (`specdec.runtime.kernels`); without it the torch code runs
(one warning), slower but with the same bits.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch

from specdec.runtime import kernels


FORMATS = ("q8", "q4")  # the --dtype names
PARTS = ("q8", "q4", "q4k", "q6k")  # the formats a matrix may be held in
BLOCK = 32   # inputs per block (one scale)
SUPER = 256  # inputs per super-block (q4k, q6k)
GROUP = 16   # outputs per group in the packed layout (one 512-bit register of int32 lanes)
CHUNK = {"q8": 544, "q4": 320, "q4k": 2304, "q6k": 3328}  # bytes a group and (super-)block: qgemm.c chunk_bytes
SOURCE = Path(__file__).with_name("qgemm.c")
CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]
_FMT = {"q8": 8, "q4": 4, "q4k": 41, "q6k": 6}
ISAS = {"vnni512": 2, "avx2": 1}  # best first
PREFILL_ISAS = {"amx": 3}  # prompt processing only: weights dequantized to bf16 per unit, AMX tiles (`prefill_isa`)

_isa: tuple[str, str] | None = None  # (SPECDEC_QKERNEL, the ISA it gives), remembered


@dataclass
class QWeight:
    """One quantized matrix [out, in] in the kernel's packed layout (see qgemm.c)."""

    fmt: str
    out_features: int
    in_features: int
    data: torch.Tensor            # uint8 [groups, blocks, 544 (q8: bytes, d) or 320 (q4: nibbles, s, m)] or
                                  # [groups, super-blocks, 2304 (q4k: nibbles, sc, mn) or 3328 (q6k: low
                                  # nibbles, high 2 bits, sc)]
    scales: torch.Tensor | None   # q4k, q6k: fp32 [groups, super-blocks, 16], d; None (q8, q4: in data)
    mins: torch.Tensor | None     # q4k: fp32, as scales, dmin; None (q8, q4, q6k)

    @cached_property
    def pointers(self) -> tuple[int, int, int, int]:
        """(format code, data, scales, mins addresses; 0 for none) for qgemm: the tensors never move once packed."""
        side = (0 if t is None else t.data_ptr() for t in (self.scales, self.mins))
        return (_FMT[self.fmt], self.data.data_ptr(), *side)

    def well_formed(self) -> bool:
        """Whether the tensors have the shapes and dtypes the kernel reads for this format and size (a cache of
        another layout, or damaged, is not: the kernel would read past them)."""
        groups, nb = -(-self.out_features // GROUP), -(-self.in_features // BLOCK)
        per = SUPER // BLOCK if self.fmt in ("q4k", "q6k") else 1  # blocks a chunk
        side = [(self.scales, per > 1), (self.mins, self.fmt == "q4k")]
        return (self.data.dtype == torch.uint8 and tuple(self.data.shape) == (groups, nb // per, CHUNK[self.fmt])
                and nb % per == 0 and all((t is not None) == want and (t is None or (
                    t.dtype == torch.float32 and tuple(t.shape) == (groups, nb // per, GROUP))) for t, want in side))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.scales, self.mins) if t is not None)


# --- quantizing and packing ----------------------------------------------------------------------
#
# Row-major blocks, per format (what `quantize` and the GGUF readers give, `pack` takes, `unpack` returns):
#   q8: (q int8 [out, blocks, 32], d [out, blocks], None)     q4: (q uint8 0..15, s, m), s and m [out, blocks]
#       (d, s, m fp32 holding fp16 values: `pack` rounds them to fp16)
#   q4k: (q uint8 0..15 [out, blocks, 32], d [out, supers], sc uint8 [out, blocks], dmin [out, supers],
#         mn uint8 [out, blocks])
#   q6k: (q uint8 0..63 [out, blocks, 32], d [out, supers], sc int8 [out, 2 * blocks])  (one per 16 inputs)

def _blocks(w: torch.Tensor) -> torch.Tensor:
    """[out, in] -> [out, blocks, 32] fp32, the last block zero-padded."""
    out_f, in_f = w.shape
    pad = -in_f % BLOCK
    w = w.float()
    if pad:
        w = torch.nn.functional.pad(w, (0, pad))
    return w.reshape(out_f, -1, BLOCK)


def quantize(w: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Row-major blocks (q [out, blocks, 32], scales [out, blocks], mins or None) of the fp32 matrix w, the
    scales rounded to fp16 first (as llama.cpp's quantize does), so q is taken against the scales kept.
    q8: d = fp16(amax / 127), q = round(w / d). q4: min and max per block, s = fp16((max - min) / 15),
    m = fp16(-min), q = round((w + m) / s). E.g. a block 0.0, 0.1 .. 3.1: q4 s = fp16(3.1 / 15) = 0.206665, m = 0,
    q = 0, 0, 1, 1, 2, 2 .. 15; q8 d = fp16(3.1 / 127) = 0.024414, and 3.1 gives q = 127."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}: choose one of {', '.join(FORMATS)}")
    b = _blocks(w)
    fp16 = lambda t: _fp16_exact(t, "weights").float()
    if fmt == "q8":
        d = fp16(b.abs().amax(-1) / 127)
        inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        return torch.round(b * inv[..., None]).clamp(-127, 127).to(torch.int8), d, None
    lo, hi = b.amin(-1), b.amax(-1)
    s, m = fp16((hi - lo) / 15), fp16(-lo)
    inv = torch.where(s > 0, 1 / s, torch.zeros_like(s))
    q = torch.round((b + m[..., None]) * inv[..., None]).clamp(0, 15).to(torch.uint8)
    return q, s, m


def _fp16_exact(t: torch.Tensor, what: str) -> torch.Tensor:
    """t rounded to fp16 (q8's and q4's scales), or a clear error where a value is beyond fp16's range."""
    h = t.half()
    if not torch.isfinite(h).all():
        raise ValueError(f"{what} beyond fp16's range (a block scale or min above 65504) cannot be held in q8 or "
                         "q4 blocks: use --dtype bf16 or fp32")
    return h


def _nibbles(q: torch.Tensor, groups: int) -> torch.Tensor:
    """q 0..15 [groups * 16, blocks, 32] -> q4's bytes [groups, blocks, 256] (see qgemm.c)."""
    n = q.reshape(groups, GROUP, q.shape[1], 4, 2, 4).permute(0, 2, 3, 1, 4, 5)  # [g, nb, c, k, lo/hi, e]
    return (n[..., 0, :] | (n[..., 1, :] << 4)).reshape(groups, q.shape[1], -1)


def _from_nibbles(data: torch.Tensor) -> torch.Tensor:
    """q4's bytes [groups, blocks, 256] -> q int32 [groups * 16, blocks, 32]."""
    groups, nb, _ = data.shape
    d = data.reshape(groups, nb, 4, GROUP, 4).to(torch.int32)
    q = torch.stack([d & 15, d >> 4], dim=4).permute(0, 3, 1, 2, 4, 5)  # [g, k, nb, c, lo/hi, e]
    return q.reshape(-1, nb, BLOCK)


def pack(fmt: str, *blocks, in_features: int) -> QWeight:
    """Row-major blocks (as `quantize` or the GGUF readers give them) -> the kernel's packed layout."""
    if fmt not in PARTS:
        raise ValueError(f"unknown weight format {fmt!r}: choose one of {', '.join(PARTS)}")
    out_f, nb = blocks[0].shape[:2]
    pad = -out_f % GROUP
    blocks = [None if t is None else torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad else t for t in blocks]
    groups = (out_f + pad) // GROUP
    # a per-row tensor [rows, m] -> [groups, m // per, per * 16]: lanes last, `per` consecutive columns together
    lanes = lambda t, per=1: t.reshape(groups, GROUP, -1, per).permute(0, 2, 3, 1).reshape(groups, -1, per * GROUP)
    if fmt in ("q8", "q4"):  # each block's bytes, then its scales (and mins) in fp16, one lane an output
        q, scales, mins = blocks
        if fmt == "q8":
            u = (q.to(torch.int16) + 128).to(torch.uint8)              # [out, nb, 32] -> [g, nb, t, k, e]
            data = [u.reshape(groups, GROUP, nb, 8, 4).permute(0, 2, 3, 1, 4).reshape(groups, nb, -1)]
        else:
            data = [_nibbles(q, groups)]
        data += [_fp16_exact(lanes(t), "scales").contiguous().view(torch.uint8)
                 for t in (scales, mins) if t is not None]
        return QWeight(fmt, out_f, in_features, torch.cat(data, -1).contiguous(), None, None)
    if nb * BLOCK % SUPER:
        raise ValueError(f"{fmt} holds whole super-blocks: {nb * BLOCK} inputs are not a multiple of {SUPER}")
    supers = nb * BLOCK // SUPER
    per_super = lambda t: t.reshape(groups, supers, -1)
    if fmt == "q4k":
        q, d, sc, dmin, mn = blocks
        data = torch.cat([per_super(_nibbles(q, groups)), lanes(sc, 8), lanes(mn, 8)], -1)
        return QWeight(fmt, out_f, in_features, data.contiguous(), lanes(d).float().contiguous(),
                       lanes(dmin).float().contiguous())
    q, d, sc = blocks
    hi = (q >> 4).reshape(groups, GROUP, nb, 2, 4, 4).permute(0, 2, 3, 1, 5, 4)  # [g, nb, p, k, e, j]
    hi = (hi << torch.tensor([0, 2, 4, 6], dtype=torch.uint8)).sum(-1, dtype=torch.uint8)
    data = torch.cat([per_super(_nibbles(q & 15, groups)), per_super(hi), lanes(sc.view(torch.uint8), 16)], -1)
    return QWeight(fmt, out_f, in_features, data.contiguous(), lanes(d).float().contiguous(), None)


def unpack(qw: QWeight) -> tuple:
    """The packed layout -> row-major blocks (q int32; the rest as `pack` takes them, trimmed to out rows)."""
    groups, nb = qw.data.shape[0], -(-qw.in_features // BLOCK)
    rows = lambda t, per=1: t.reshape(groups, -1, per, GROUP).permute(0, 3, 1, 2).reshape(groups * GROUP, -1)[
        :qw.out_features]
    fp16 = lambda t: rows(t.contiguous().view(torch.float16).float())
    if qw.fmt == "q8":
        q = qw.data[..., :512].reshape(groups, nb, 8, GROUP, 4).permute(0, 3, 1, 2, 4).to(torch.int32) - 128
        return q.reshape(-1, nb, BLOCK)[:qw.out_features], fp16(qw.data[..., 512:]), None
    if qw.fmt == "q4":
        return (_from_nibbles(qw.data[..., :256])[:qw.out_features], fp16(qw.data[..., 256:288]),
                fp16(qw.data[..., 288:]))
    nib = _from_nibbles(qw.data[..., :2048].reshape(groups, nb, 256))[:qw.out_features]
    if qw.fmt == "q4k":
        k = qw.data[..., 2048:]
        return nib, rows(qw.scales), rows(k[..., :128], 8), rows(qw.mins), rows(k[..., 128:], 8)
    h = qw.data[..., 2048:3072].reshape(groups, nb, 2, GROUP, 4).to(torch.int32)  # [g, nb, p, k, e]
    h = (h[..., None] >> torch.tensor([0, 2, 4, 6])) & 3                          # [g, nb, p, k, e, j]
    h = h.permute(0, 3, 1, 2, 5, 4).reshape(-1, nb, BLOCK)[:qw.out_features]
    return nib | (h << 4), rows(qw.scales), rows(qw.data[..., 3072:], 16).view(torch.int8)


def _as_q4(qw: QWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(q, s, m) per block of 32 of a q8, q4 or q4k matrix (q4k: s = d*sc, m = dmin*mn, exact in fp32)."""
    if qw.fmt != "q4k":
        return unpack(qw)
    q, d, sc, dmin, mn = unpack(qw)
    per = lambda t: t.repeat_interleave(SUPER // BLOCK, 1)
    return q, per(d) * sc.float(), per(dmin) * mn.float()


def dequantize(qw: QWeight) -> torch.Tensor:
    """The fp32 matrix [out, in] the quantized weights stand for (as gguf computes it for Q4_K and Q6_K)."""
    if qw.fmt == "q6k":
        q, d, sc = unpack(qw)
        s = d.repeat_interleave(SUPER // 16, 1) * sc.float()  # [out, sub-blocks of 16]
        w = s[..., None] * (q.reshape(qw.out_features, -1, 16) - 32).float()
    else:
        q, s, m = _as_q4(qw)
        w = q.float() * s[..., None]
        if m is not None:
            w = w - m[..., None]
    return w.reshape(qw.out_features, -1)[:, :qw.in_features]


def from_fp32(w: torch.Tensor, fmt: str) -> QWeight:
    """Quantize and pack an fp32 (or bf16) matrix (q8 or q4)."""
    return pack(fmt, *quantize(w, fmt), in_features=w.shape[1])


# --- the matmul ------------------------------------------------------------------------------------

def quantize_rows(x: torch.Tensor, span: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Activations [n, in] -> (qx int32 [n, blocks, 32], dx [n, in / span], sums int32 [n, blocks, 2]), as qgemm.c:
    one scale dx = amax / 127 per `span` inputs of a row (BLOCK for q8 and q4, SUPER for q4k and q6k), qx =
    round(x / dx) (ties to even), and the sums of qx over each half block."""
    b = _blocks(x).reshape(x.shape[0], -1, span)
    amax = b.abs().amax(-1)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    qx = torch.round(b * inv[..., None]).clamp(-127, 127).to(torch.int32).reshape(x.shape[0], -1, BLOCK)
    return qx, amax / 127.0, qx.reshape(*qx.shape[:2], 2, 16).sum(-1, dtype=torch.int32)


def reference(x: torch.Tensor, qw: QWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The torch path: x [n, in] fp32 -> y [n, out], the same float operations in the same order as qgemm.c.
    Every integer below is exact: fp32 matmuls whose products and partial sums stay below 2^24, then int32."""
    n = x.shape[0]
    acc = torch.zeros(n, qw.out_features)
    if qw.fmt in ("q4k", "q6k"):
        qx, dx, sums = quantize_rows(x, SUPER)
        if qw.fmt == "q4k":  # blocks of 32: sc for the products, mn for the sums of qx
            q, d, sc, dmin, mn = unpack(qw)
            sums, coef = sums.sum(-1, dtype=torch.int32), mn
        else:  # sub-blocks of 16: sc for both (q - 32)
            q, d, sc = unpack(qw)
            q, qx, sums, coef = q.reshape(q.shape[0], -1, 16), qx.reshape(n, -1, 16), sums.reshape(n, -1), sc
        per, sc = q.shape[1] // d.shape[1], sc.to(torch.int32)  # (sub-)blocks per super-block
        for s in range(d.shape[1]):
            j = slice(s * per, (s + 1) * per)
            isup = torch.zeros(n, qw.out_features, dtype=torch.int32)
            for b in range(j.start, j.stop):
                isup += sc[:, b] * (qx[:, b].float() @ q[:, b].float().t()).to(torch.int32)
            isum = (sums[:, j].float() @ coef[:, j].float().t()).to(torch.int32)
            dxs = d[:, s] * dx[:, s, None]
            if qw.fmt == "q4k":
                acc = acc + dxs * isup.float()
                acc = acc - (dmin[:, s] * dx[:, s, None]) * isum.float()
            else:
                acc = acc + dxs * (isup - 32 * isum).float()
    else:
        qx, dx, sums = quantize_rows(x)
        q, s, m = unpack(qw)
        dxs = dx * sums.sum(-1, dtype=torch.int32).float()
        for b in range(q.shape[1]):
            isum = qx[:, b].float() @ q[:, b].float().t()  # exact: 32 products of at most 127 * 127 < 2^24
            acc = acc + (s[:, b] * dx[:, b, None]) * isum
            if m is not None:
                acc = acc - m[:, b] * dxs[:, b, None]
    return acc if bias is None else acc + bias.float()


def isa() -> str:
    """The instruction set the matmul runs on: vnni512, avx2, or torch (forced by SPECDEC_QKERNEL).
    Asked once per matmul, so the answer is remembered for the setting and library it came from."""
    global _isa
    env = (os.environ.get("SPECDEC_QKERNEL"), os.environ.get("SPECDEC_KERNEL"))
    if _kernel.state and _isa is not None and _isa[0] == env:
        return _isa[1]
    forced = (env[0] or "").strip().lower()
    if forced == "torch" or not kernels.enabled():
        return "torch"
    lib = _load()
    if lib is None:
        return "torch"
    found = next((name for name, code in ISAS.items() if forced in ("", name) and lib.qgemm_supported(code)), "torch")
    _isa = (env, found)
    return found


def prefill_isa() -> str | None:
    """The ISA prompt rows' matmuls take when it is not the decoding one (`isa()`), or None: "amx" on CPUs with
    AMX-BF16 (weights dequantized to bf16 per unit of 32 outputs, then tile multiplies: several times the integer
    kernel's rate from a few dozen rows on). Prompt processing is verified against nothing, so it may round
    differently, as long as every prompt row takes the same path whatever the chunk (qgemm.c). None when
    SPECDEC_QKERNEL forces an ISA (tests comparing ISAs bit for bit) or SPECDEC_QPREFILL=0."""
    if os.environ.get("SPECDEC_QKERNEL") or os.environ.get("SPECDEC_QPREFILL", "").strip() == "0" or isa() == "torch":
        return None
    lib = _load()
    return next((name for name, code in PREFILL_ISAS.items() if lib.qgemm_supported(code)), None)


def _declare(lib) -> None:
    lib.qgemm.restype = ctypes.c_int
    lib.qgemm.argtypes = [ctypes.c_int, ctypes.c_int] + [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 4 + [ctypes.c_int]
    lib.qgemm_supported.restype = ctypes.c_int
    lib.qgemm_supported.argtypes = [ctypes.c_int]
    if not lib.qgemm_supported(ISAS["avx2"]):
        raise RuntimeError("the CPU lacks AVX2 or F16C")


_kernel = kernels.Library(SOURCE, CFLAGS, _declare, "the quantized-matmul kernel is unavailable; using the torch path")


def _load():
    return _kernel.get()


def reason() -> str:
    """Why the C kernel is not used ("" when it is, or untried)."""
    return _kernel.reason


def matmul_parts(y: torch.Tensor, x: torch.Tensor, parts, threads: int | None = None, use: str | None = None) -> None:
    """y[:, col : col + out] = x @ W^T + bias for each (qw, bias, col) of `parts` (a QLinear's row parts, each
    writing its own columns), x [n, in] fp32 contiguous, y [n, >= cols] fp32 contiguous, bias fp32 contiguous
    or None. One C call a part, with the constant arguments worked out once (`QWeight.pointers`): a decode
    step makes ~200 of these calls, so their Python overhead counts."""
    use = use or isa()
    n = x.shape[0]
    if not n:
        return
    if use == "torch" or _load() is None:
        for qw, bias, col in parts:
            y[:, col:col + qw.out_features] = reference(x, qw, bias)
        return
    lib, code, threads = _kernel.lib, ISAS.get(use) or PREFILL_ISAS[use], threads or torch.get_num_threads()
    xp, yp, ldy = x.data_ptr(), y.data_ptr(), y.shape[1]
    for qw, bias, col in parts:
        fmt, w, s, m = qw.pointers
        rc = lib.qgemm(fmt, code, xp, w, s, m, None if bias is None else bias.data_ptr(), yp + 4 * col, ldy, n,
                       qw.in_features, qw.out_features, threads)
        if rc:
            raise MemoryError("qgemm: out of memory") if rc == 2 else RuntimeError(f"qgemm: {use} is not supported here")


def matmul(x: torch.Tensor, qw: QWeight, bias: torch.Tensor | None = None, threads: int | None = None,
           use: str | None = None) -> torch.Tensor:
    """y = x @ W^T + bias for x fp32 [..., in]."""
    if x.shape[-1] != qw.in_features:
        raise ValueError(f"quantized matmul: x has {x.shape[-1]} features, weight expects {qw.in_features}")
    flat = x.reshape(-1, qw.in_features).float().contiguous()
    y = torch.empty(flat.shape[0], qw.out_features)
    matmul_parts(y, flat, [(qw, None if bias is None else bias.float().contiguous(), 0)], threads, use)
    return y.reshape(*x.shape[:-1], qw.out_features)
