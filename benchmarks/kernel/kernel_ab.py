"""A/B two versions of the bf16 skinny-GEMM kernel (specdec/runtime/kernels/skinny.c) on a model's shapes.

Both sources are compiled with the package's flags and loaded with ctypes. Random bf16 weights of the
model's shapes are laid out as in a forward (per layer qkv, o, gate_up, down, then the LM head; --layers
copies, so the weights stream from memory as they do in a real forward rather than from cache). For every
n, one sweep calls the kernel on every matrix in forward order, timing each call; A and B alternate sweeps
(A, B, A, B, ...) after one warm-up each, so drift in the machine's bandwidth hits both alike. The table
gives per shape the median over sweeps of its summed time (all layers) in ms, A/B and B/A, then the
model's matmul total. Run from the repository root, under the shared lock:

    git show main:specdec/runtime/kernels/skinny.c > /tmp/skinny_main.c
    .venv/bin/python benchmarks/kernel/kernel_ab.py /tmp/skinny_main.c \\
        specdec/runtime/kernels/skinny.c --model smollm2-135m --n 1,4,8,16,64
    .venv/bin/python benchmarks/kernel/kernel_ab.py specdec/runtime/kernels/skinny.c \
        specdec/runtime/kernels/skinny.c --path avx512bf16 --path-b amx   # two paths of one source
"""

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from specdec.runtime.kernels import CFLAGS, PATHS, _declare, pack_bf16

# (layers, {name: (out, in)}) per model; the LM head is one matrix after the layers
MODELS = {
    "smollm2-135m": (30, {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
                          "lm": (49152, 576)}),
    "qwen2.5-coder-1.5b": (28, {"qkv": (2048, 1536), "o": (1536, 1536), "gate_up": (17920, 1536),
                                "down": (1536, 8960), "lm": (151936, 1536)}),
}


def load(src: str, folder: Path):
    so = folder / (Path(src).stem + f"-{len(list(folder.iterdir()))}.so")
    headers = Path(__file__).resolve().parents[2] / "specdec/runtime/kernels"  # amx.h, scratch.h for a copy elsewhere
    subprocess.run(["gcc", *CFLAGS, f"-I{headers}", src, "-o", str(so)], check=True)
    lib = ctypes.CDLL(str(so))
    _declare(lib)
    return lib


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a", help="kernel source A (the baseline)")
    ap.add_argument("b", help="kernel source B")
    ap.add_argument("--model", default="smollm2-135m", choices=list(MODELS))
    ap.add_argument("--layers", type=int, help="layer copies (default: the model's)")
    ap.add_argument("--n", default="1,4,8,16,64", help="positions per call, comma-separated")
    ap.add_argument("--reps", type=int, default=11)
    ap.add_argument("--path", default="avx512bf16", choices=[p for p in PATHS if p != "torch"])
    ap.add_argument("--path-b", choices=[p for p in PATHS if p != "torch"], help="B's path (default: --path): "
                    "the same source twice with --path avx512bf16 --path-b amx compares two paths")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    ns = [int(v) for v in args.n.split(",")]
    layers, shapes = MODELS[args.model]
    layers = args.layers or layers
    torch.manual_seed(0)
    calls = [(name, (torch.randn(out, inn) * 0.02).to(torch.bfloat16))
             for _ in range(layers) for name, (out, inn) in shapes.items() if name != "lm"]
    calls.append(("lm", (torch.randn(*shapes["lm"]) * 0.02).to(torch.bfloat16)))
    isas = [PATHS[args.path][0], PATHS[args.path_b or args.path][0]]
    # a source whose AVX512-BF16 path takes kernels.pack_bf16's layout (session 17 on) gets its weights packed, and
    # one whose AMX path does (session 20 on)
    packed = [(isa == PATHS["avx512bf16"][0] and "pack_bf16" in Path(src).read_text())
              or (isa == PATHS["amx"][0] and "pack_bf16's layout for ISA_AVX512BF16 and" in Path(src).read_text())
              for isa, src in zip(isas, (args.a, args.b))]
    weights = [[(name, pack_bf16(w) if p else w, *w.shape) for name, w in calls] for p in packed]
    with tempfile.TemporaryDirectory() as tmp:
        libs = [load(args.a, Path(tmp)), load(args.b, Path(tmp))]
        print(f"{args.model}, {layers} layers, {args.path}/{args.path_b or args.path}, {args.threads} threads; per shape: summed ms over "
              f"a forward, median of {args.reps} sweeps, A/B (B/A)")
        rows = {name: [] for name in shapes}
        totals = [[], []]
        for n in ns:
            xs = {inn: torch.randn(n, inn) for _, (_, inn) in shapes.items()}
            ys = {out: torch.empty(n, out) for _, (out, _) in shapes.items()}
            times = [{name: [] for name in shapes} for _ in libs]
            for rep in range(args.reps + 1):
                for i, lib in enumerate(libs):
                    spent = dict.fromkeys(shapes, 0.0)
                    for name, w, out, inn in weights[i]:
                        t = time.perf_counter()
                        lib.skinny_bf16(isas[i], xs[inn].data_ptr(), w.data_ptr(), None, ys[out].data_ptr(), n, inn, out,
                                        args.threads)
                        spent[name] += time.perf_counter() - t
                    if rep:
                        for name in shapes:
                            times[i][name].append(spent[name])
            tot = [0.0, 0.0]
            for name in shapes:
                med = [statistics.median(t[name]) * 1e3 for t in times]
                tot = [tot[0] + med[0], tot[1] + med[1]]
                rows[name].append(f"{med[0]:.2f}/{med[1]:.2f} ({med[1] / med[0]:.2f})")
            totals[0].append(tot[0])
            totals[1].append(tot[1])
        print(f"{'shape':8s} " + " ".join(f"{'n=' + str(n):>22s}" for n in ns))
        for name, cells in rows.items():
            print(f"{name:8s} " + " ".join(f"{c:>22s}" for c in cells))
        print(f"{'model':8s} " + " ".join(f"{f'{a:.2f}/{b:.2f} ({b / a:.2f})':>22s}" for a, b in zip(*totals)))
        for label, t in zip("AB", totals):
            print(f"{label} cost vs n={ns[0]}: " + " ".join(f"n={n} {v / t[0]:.2f}" for n, v in zip(ns, t)))


if __name__ == "__main__":
    main()
