"""Benchmark reports: per method x category summary, a Markdown table, results.json and a bar chart.

Per method and category (and "all"):
- tok/s median: median over generations of new tokens / seconds; tok/s total: sum tokens / sum seconds;
- x plain: our plain decoding's total seconds / this method's total seconds on the same prompts
  (the speedup; > 1 is faster); x plain (median): the median over prompt turns of the per-turn
  ratio (robust to one slow turn on a shared machine); x hf-plain: total time against
  transformers' plain generate; x llama.cpp: tokens/s against llama.cpp's plain decoding of the same GGUF
  (tokens/s, not time: the engines' activations differ, so near-ties end their answers at other tokens);
- accepted/fwd: new tokens / target forwards (mean accepted length, bonus included; 1.0 for plain);
- alpha: accepted / drafted draft tokens;
- = plain: "ok" when every generation's token ids equal plain's (greedy: every method; sampling with a seed:
  the methods whose drafts are deterministic, as `sampling.Draws` makes them), else the count of mismatches.

    rows = summarize(records)                 # list of dicts
    print(markdown_table(rows))
    write_outputs("out/", records, rows, meta)  # results.md, results.json, speedup.png
"""

from __future__ import annotations

import json
import os
import platform
import statistics
from datetime import datetime, timezone
from pathlib import Path
from typing import Sequence

from specdec.bench.prompts import ALL  # the row over every category
OUTSIDE = ("hf-", "llamacpp-")  # other engines' runners


def _ordered(values) -> list:
    return list(dict.fromkeys(values))


def _key(r: dict) -> tuple:
    return r["category"], r.get("id"), r.get("turn")


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def summarize(records: Sequence[dict], methods: Sequence[str] | None = None) -> list[dict]:
    """One row per category x method (categories in order of appearance, then "all")."""
    methods = list(methods) if methods else _ordered(r["method"] for r in records)
    cats = _ordered(r["category"] for r in records)
    rows = []
    for cat in cats + ([ALL] if len(cats) > 1 else []):
        in_cat = [r for r in records if cat == ALL or r["category"] == cat]
        totals = {m: sum(r["seconds"] for r in in_cat if r["method"] == m) for m in methods}
        rates = {m: sum(r["new_tokens"] for r in in_cat if r["method"] == m) / totals[m]
                 for m in methods if totals[m] > 0}  # tokens/s: the fair ratio against another engine
        plain_s = {_key(r): r["seconds"] for r in in_cat if r["method"] == "plain"}
        for m in methods:
            rs = [r for r in in_cat if r["method"] == m]
            if not rs:
                continue
            tokens = sum(r["new_tokens"] for r in rs)
            seconds = sum(r["seconds"] for r in rs)
            fwd = [r["target_forwards"] for r in rs]
            drafted = [r["drafted"] for r in rs]
            mism = [r["mismatch"] for r in rs if r.get("mismatch")]
            rows.append(dict(
                category=cat, method=m, generations=len(rs), new_tokens=tokens, seconds=seconds,
                tokens_per_s_median=statistics.median(r["tokens_per_s"] for r in rs),
                tokens_per_s_total=tokens / seconds if seconds > 0 else 0.0,
                speedup_vs_plain=totals["plain"] / seconds if "plain" in totals and seconds > 0 else None,
                speedup_vs_plain_median=_median([plain_s[_key(r)] / r["seconds"] for r in rs
                                                 if _key(r) in plain_s and r["seconds"] > 0]),
                speedup_vs_hf_plain=(totals["hf-plain"] / seconds
                                     if "hf-plain" in totals and totals["hf-plain"] > 0 and seconds > 0 else None),
                speedup_vs_llamacpp_plain=(tokens / seconds / rates["llamacpp-plain"]
                                           if rates.get("llamacpp-plain") and seconds > 0 else None),
                mean_accepted=tokens / sum(fwd) if all(f for f in fwd) else None,
                acceptance_rate=(sum(r["accepted"] for r in rs) / sum(drafted)
                                 if all(d is not None for d in drafted) and sum(drafted) else None),
                mismatches=len(mism), checked=all(r.get("checked", True) for r in rs), near_ties=sum(bool(x.get("near_tie")) for x in mism),
            ))
    return rows


def _f(x, fmt: str, none: str = "–") -> str:
    return none if x is None else format(x, fmt)


def _x(x) -> str:
    return "–" if x is None else f"{x:.2f}×"


def greedy_cell(row: dict, checked: bool) -> str:
    if not checked or not row.get("checked", True):
        return "–"
    if row["method"] == "plain":
        return "ref"
    if not row["mismatches"]:
        return "ok"
    nt = f" ({row['near_ties']} near-tie)" if row["near_ties"] else ""
    return f"**{row['mismatches']} MISMATCH**{nt}"


def markdown_table(rows: Sequence[dict], checked: bool = True) -> str:
    """`checked`: the run held methods to plain's tokens (greedy, or sampling with a seed)."""
    head = ["category", "method", "gens", "tokens", "tok/s median", "tok/s total", "× plain", "× plain (median)",
            "× hf-plain", "× llama.cpp", "accepted/fwd", "α", "tokens = plain"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * 2 + ["--:"] * (len(head) - 3) + [":-:"]) + "|"]
    for r in rows:
        cells = [r["category"], r["method"], str(r["generations"]), str(r["new_tokens"]),
                 _f(r["tokens_per_s_median"], ".1f"), _f(r["tokens_per_s_total"], ".1f"),
                 _x(r["speedup_vs_plain"]),
                 _x(r.get("speedup_vs_plain_median")),
                 _x(r["speedup_vs_hf_plain"]), _x(r.get("speedup_vs_llamacpp_plain")),
                 _f(r["mean_accepted"], ".2f"), _f(r["acceptance_rate"], ".2f"), greedy_cell(r, checked)]
        if r["category"] == ALL:
            cells[:2] = [f"**{cells[0]}**", f"**{cells[1]}**"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


MATMUL_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16", "amx_int8")


def cpu_flags() -> list[str]:
    """The CPU features that decide which matmul paths run (and so every figure): AVX2, AVX512, VNNI, BF16, AMX."""
    from specdec.runtime.kernels import cpu_flags as flags

    have = flags()
    return [f for f in MATMUL_FLAGS if f in have]


def machine_info() -> dict:
    import torch
    import transformers

    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return dict(cpu=cpu_model(), cpu_flags=cpu_flags(), cpu_count=os.cpu_count(), torch_threads=torch.get_num_threads(),
                torch=torch.__version__, transformers=transformers.__version__, python=platform.python_version(),
                platform=platform.platform(), load_avg=[round(x, 2) for x in load] if load else None)


def _count(n: int, noun: str) -> str:
    """'1 prompt', '3 prompts'."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def plot_speedup(rows: Sequence[dict], path: str | Path, title: str = "") -> Path:
    """Grouped bars: speedup over our plain decoding, per category (x) and method (bars)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cats = _ordered(r["category"] for r in rows)
    methods = [m for m in _ordered(r["method"] for r in rows) if m != "plain"] or ["plain"]
    width = 0.8 / len(methods)
    fig, ax = plt.subplots(figsize=(min(14.0, max(6.0, 0.3 * len(cats) * len(methods) + 2)), 5.0))
    for j, m in enumerate(methods):
        xs, ys = [], []
        for i, c in enumerate(cats):
            r = next((r for r in rows if r["category"] == c and r["method"] == m), None)
            if r and r["speedup_vs_plain"] is not None:
                xs.append(i - 0.4 + width * (j + 0.5))
                ys.append(r["speedup_vs_plain"])
        ax.bar(xs, ys, width, label=m, hatch="//" if m.startswith(OUTSIDE) else None,
                      edgecolor="white" if m.startswith(OUTSIDE) else None)
        for x, y in zip(xs, ys):
            ax.text(x, y, f"{y:.2f}", ha="center", va="bottom", fontsize=7)
    ax.axhline(1.0, color="black", lw=0.8, ls="--", label="our plain")
    ax.set_xticks(range(len(cats)))
    ax.set_xticklabels(cats, rotation=30 if len(cats) > 4 else 0, ha="right" if len(cats) > 4 else "center")
    ax.set_ylabel("speedup over our plain decoding (×)")
    ax.set_title(title or "specdec bench")
    ax.legend(fontsize=8, ncol=min(len(methods) + 1, 4))
    ax.set_ylim(0, max([r["speedup_vs_plain"] or 0 for r in rows] + [1.2]) * 1.15)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def results_markdown(rows: Sequence[dict], meta: dict) -> str:
    m, s = meta["machine"], meta["settings"]
    greedy = s["temperature"] <= 0
    lines = [
        f"# specdec bench: {meta['model']}" + (f" (draft {meta['draft']})" if meta.get("draft") else ""),
        "",
        "```",
        meta["command"],
        "```",
        "",
        f"- date: {meta['date']}",
        f"- machine: {m['cpu']} ({' '.join(m.get('cpu_flags') or ['no AVX2'])}), {m['cpu_count']} CPUs, "
        f"torch threads {m['torch_threads']}" + (f", GPU {m['gpu']}" if m.get("gpu") else "") + "; "
        f"torch {m['torch']}, transformers {m['transformers']}, Python {m['python']}"
        + (f"; load average at the end {m['load_avg'][0]:.1f} / {m['load_avg'][1]:.1f} / {m['load_avg'][2]:.1f} "
           "(1 / 5 / 15 min)" if m.get("load_avg") else "")
        + (f"; memory read bandwidth {m['memory_gbs'][0]:.0f} GB/s before the run, {m['memory_gbs'][1]:.0f} after "
           "(it drifts on shared hosts: compare methods within one run)" if m.get("memory_gbs") else ""),
        f"- dtype: {meta['dtype']}" + (f", matmul path {meta['matmul']}" if meta.get("matmul") else "")
        + (f", attention {meta['attention']}" if meta.get("attention") else "") + f"; prompts: {meta['prompts']} ({_count(meta['n_prompts'], 'prompt')}, "
        f"{_count(meta['n_turns'], 'turn')}, limit {s['limit'] or 'none'} per category)",
        f"- decoding: " + ("greedy" if greedy else f"temperature {s['temperature']}, top-p {s['top_p']}, "
                                                   f"top-k {s.get('top_k', 0)}, min-p {s.get('min_p', 0.0)}, seed {s['seed']}")
        + f", max new tokens {s['max_new_tokens']}, k {s['k']}",
        "- speedups are ratios of total wall time (prefill included) on the same prompts; '× plain (median)' "
        "is the median of per-turn ratios; every method had one untimed warm-up and methods ran interleaved "
        "per prompt",
        "",
        markdown_table(rows, greedy or s["seed"] is not None),
        "",
    ]
    mism = meta.get("mismatches") or []
    if mism:
        lines += ["## Mismatches with plain decoding", ""] + [f"- {x}" for x in mism] + [""]
    return "\n".join(lines)


OUTPUTS = ("results.md", "results.json", "speedup.png")


def check_out(out: str | Path, names: Sequence[str] = OUTPUTS) -> Path:
    """Fail now, not after a long run, when `out` cannot take its result files `names`: it must be a folder
    (or a path where one can be made) that takes a file, and none of `names` in it may be a folder. Leaves
    nothing behind: a folder made to test the path is removed again (the results make it)."""
    from specdec.errors import SpecdecError

    if not str(out).strip():  # Path("") is the current folder: never a silent default
        raise SpecdecError("--out is empty: name a folder")
    out = Path(out).expanduser()
    if out.exists() and not out.is_dir():
        raise SpecdecError(f"--out {out} is a file, not a folder: choose a folder for {', '.join(names)}")
    for name in names:
        if (out / name).is_dir():
            raise SpecdecError(f"--out {out}: {out / name} is a folder: choose another --out")
    parent = next((p for p in [out, *out.parents] if p.exists()), Path("."))
    if not parent.is_dir():
        raise SpecdecError(f"--out {out}: {parent} is a file, not a folder: choose another --out")
    made = [p for p in [out, *out.parents] if not p.exists()]  # deepest first
    try:  # what writing the results will do (os.access says yes to root on a read-only mount, or in /proc)
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".specdec-write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise SpecdecError(f"--out {out}: cannot write there ({e.strerror or e}): choose another --out") from None
    finally:
        for p in made:
            try:
                p.rmdir()
            except OSError:
                break
    return out


def write_outputs(out: str | Path, records: Sequence[dict], rows: Sequence[dict], meta: dict) -> dict[str, Path]:
    out = check_out(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = dict(zip(("md", "json", "png"), (out / name for name in OUTPUTS)))
    paths["md"].write_text(results_markdown(rows, meta), encoding="utf-8")
    paths["json"].write_text(json.dumps(dict(meta=meta, summary=list(rows), records=list(records)), indent=1),
                             encoding="utf-8")
    plot_speedup(rows, paths["png"], title=f"{meta['model']} {meta['dtype']}: speedup over our plain decoding")
    return paths
