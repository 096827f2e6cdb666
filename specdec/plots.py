"""Pictures of the lesson's arithmetic (specdec.theory), drawn with matplotlib's Agg canvas.

    plot_surface(path, tau)     speedup over (alpha, k) for one tau, with the break-even
                                contour (speedup = 1) and the best k for each alpha (Ch. 2)
    plot_rounds(path, alpha, k) the distribution of tokens per round and its mean (Ch. 2:
                                alpha = 0.7, k = 4 -> mean 2.7731, full burst 0.2401)
    plot_budget(path, k)        headroom = 156 - B against batch occupancy B, and how many
                                requests can speculate k tokens inside it (Ch. 7)

No pyplot, no global backend switch: each function builds its own Figure and writes a file.
"""

from __future__ import annotations

import os

import numpy as np

from specdec import theory

_FORMATS = (".png", ".svg", ".pdf")


def _figure(width: float = 8.0, height: float = 5.0):
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=110, layout="constrained")


def _save(fig, path: str | os.PathLike) -> str:
    path = os.fspath(path)
    if not path.lower().endswith(_FORMATS):
        raise ValueError(f"--out must end in one of {', '.join(_FORMATS)}, got {path!r}")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ValueError(f"--out directory does not exist: {parent}")
    if os.path.isdir(path):
        raise ValueError(f"--out is a directory: {path}")
    try:
        fig.savefig(path)
    except OSError as e:
        raise ValueError(f"cannot write --out {path}: {e.strerror or e}") from None
    return path


def plot_surface(path, tau: float = 0.1, k_max: int = 12) -> str:
    """Heat map of speedup(alpha, k, tau) for alpha in [0, 1] and k in 0..k_max."""
    from matplotlib.colors import TwoSlopeNorm

    theory.speedup(0.5, 1, tau)  # validates tau
    if not 2 <= k_max <= 64:  # the break-even contour needs two rows of k >= 1
        raise ValueError(f"--k-max must be in [2, 64], got {k_max}")
    alphas = np.linspace(0.0, 1.0, 201)
    ks = np.arange(k_max + 1)
    z = np.array([[theory.speedup(a, int(k), tau) for a in alphas] for k in ks])
    fig = _figure()
    ax = fig.add_subplot()
    norm = TwoSlopeNorm(vmin=min(z.min(), 0.99), vcenter=1.0, vmax=max(z.max(), 1.01))
    mesh = ax.pcolormesh(alphas, ks, z, cmap="RdBu", norm=norm, shading="nearest")
    bar = fig.colorbar(mesh, ax=ax, label="speedup over plain decoding (x)")
    bar.set_ticks([t for t in (0.25, 0.5, 0.75, 1, 1.5, 2, 3, 4, 5, 6, 8) if norm.vmin <= t <= norm.vmax])
    # k = 0 is exactly 1x everywhere: leave it out of the break-even contour
    ax.contour(alphas, ks[1:], z[1:], levels=[1.0], colors="black", linewidths=1.5)
    best = [theory.best_k(a, tau, k_max) for a in alphas]
    ax.step(alphas, best, where="mid", color="gold", linewidth=2, label="best k for each alpha")
    ax.plot([], [], color="black", label="break-even (speedup = 1)")
    for a, k in [(0.7, 4), (0.15, 8), (0.5, 6), (0.5, 2)]:
        if k <= k_max:
            ax.plot(a, k, "o", color="black", markersize=4)
            ax.annotate(f"{theory.speedup(a, k, tau):.2f}x", (a, k), textcoords="offset points",
                        xytext=(5, 4), fontsize=8)
    ax.set_xlabel("acceptance rate alpha")
    ax.set_ylabel("draft length k")
    ax.set_title(f"Speedup = E[tokens] / (1 + k tau), tau = {tau:g}")
    ax.legend(loc="upper left", fontsize=8, framealpha=0.9)
    return _save(fig, path)


ROUNDS_K_MAX = 64  # one labelled bar per outcome: past this the chart is unreadable (and slow to draw)


def plot_rounds(path, alpha: float = 0.7, k: int = 4) -> str:
    """Bar chart of P(n tokens in a round), n = 1..k+1, with the mean marked."""
    theory.expected_tokens(alpha, k)  # validates alpha and k
    if k > ROUNDS_K_MAX:
        raise ValueError(f"k must be in [0, {ROUNDS_K_MAX}] for 'rounds' (one bar per outcome), got {k}")
    probs = theory.tokens_per_round_distribution(alpha, k)
    mean = theory.expected_tokens(alpha, k)
    n = np.arange(1, k + 2)
    fig = _figure(7.0, 4.5)
    ax = fig.add_subplot()
    colors = ["tab:blue"] * k + ["tab:green"]
    bars = ax.bar(n, probs, color=colors)
    for b, pr in zip(bars, probs):
        ax.annotate(f"{pr:.3f}", (b.get_x() + b.get_width() / 2, pr), textcoords="offset points",
                    xytext=(0, 3), ha="center", fontsize=8)
    ax.axvline(mean, color="black", linestyle="--", label=f"mean {mean:.4f} tokens/round")
    from matplotlib.patches import Patch

    handles, labels = ax.get_legend_handles_labels()
    handles.append(Patch(color="tab:green"))
    labels.append(f"full burst: all {k} accepted + bonus ({probs[-1]:.4f})" if k
                  else "k = 0: every round is one plain step (no drafts, no bonus)")
    ax.set_xticks(n)
    ax.set_xlabel("tokens emitted in one round")
    ax.set_ylabel("probability")
    shape = "bursty, not metronomic" if 0 < alpha < 1 and k > 0 else "the same every round"  # alpha 0 or 1: no spread
    ax.set_title(f"Tokens per round at alpha = {alpha:g}, k = {k}: {shape}")
    ax.legend(handles, labels, fontsize=8)
    return _save(fig, path)


def plot_budget(path, k: int = 4, budget: float = theory.BUDGET, max_occupancy: int = 200) -> str:
    """Headroom (budget - B) against occupancy B, and requests that can speculate k in it."""
    theory.speculation_cost(k)
    if max_occupancy < 1:
        raise ValueError(f"max_occupancy must be >= 1, got {max_occupancy}")
    occ = np.arange(0, max_occupancy + 1)
    room = np.array([theory.headroom(budget, b) for b in occ])
    fit = np.array([theory.requests_that_fit(h, k) for h in room])
    fig = _figure()
    ax = fig.add_subplot()
    ax.plot(occ, room, color="tab:blue", label="headroom = budget - B (positions)")
    ax.axhline(0, color="gray", linewidth=0.8)
    if budget < max_occupancy:  # past the budget: the region exists only where the axis reaches it
        ax.axvspan(budget, max_occupancy, color="tab:red", alpha=0.12, label="over budget: compute-bound")
    ax.set_xlim(0, max_occupancy)
    ax.set_xlabel("batch occupancy B (concurrent decode requests)")
    ax.set_ylabel("headroom (token positions)", color="tab:blue")
    ax2 = ax.twinx()
    ax2.step(occ, fit, where="post", color="tab:orange", label=f"requests that can speculate k={k}")
    ax2.set_ylabel(f"requests speculating k={k} ({k + 1} positions each)", color="tab:orange")
    lo, hi = ax.get_ylim()
    ax2.set_ylim(lo / (k + 1), hi / (k + 1))  # same zero as the headroom axis: the steps track it
    for b in (20, 120, 140):
        if b <= max_occupancy:
            f = theory.requests_that_fit(theory.headroom(budget, b), k)
            ax2.plot(b, f, "o", color="tab:orange")
            ax2.annotate(f"B={b}: {f} fit", (b, f), textcoords="offset points", xytext=(6, 6), fontsize=8)
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="upper right", fontsize=8)
    ax.set_title(f"The idle-compute budget ({budget:g} positions) shared with real traffic")
    return _save(fig, path)
