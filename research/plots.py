"""Matplotlib figures (Agg backend) for the two related-seed analyses; modest DPI keeps PNGs small."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

DPI = 90


def plot_dmin(curves: Sequence[dict], path: Path) -> Path:
    """d_min vs L per setup with the least-squares fit ``a ln L + b`` and the ``d = L`` ceiling.

    Each curve: ``{"label", "L": [...], "d_min": [...], "fit": (a, b)}``.
    """
    n = len(curves)
    cols = min(3, n)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.3 * rows), squeeze=False)
    for ax, curve in zip(axes.flat, curves):
        L = np.asarray(curve["L"], float)
        d = np.asarray([np.nan if v is None else v for v in curve["d_min"]], float)
        grid = np.geomspace(L.min(), L.max(), 100)
        ax.plot(L, d, "o", color="tab:red", label="empirical $d_{min}$")
        a, b = curve["fit"]
        ax.plot(grid, a * np.log(grid) + b, ":", color="black",
                label=f"fit {a:.0f} ln L {b:+.0f}")
        ax.plot(grid, grid, "-", color="0.7", lw=1, label="d = L (exact)")
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, 1.1 * max(np.nanmax(d), 1))
        ax.set_title(curve["label"], fontsize=9)
        ax.set_xlabel("L")
        ax.set_ylabel("d")
        ax.legend(fontsize=7, loc="upper left")
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.suptitle("Seed 002: smallest d meeting (6)-(7) -- our construction and settings", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def plot_heatmaps(A: np.ndarray, M: np.ndarray, title: str, path: Path) -> Path:
    """Target ``A`` beside the constructed ``M`` (linear) and ``log10 M``."""
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.7))
    im = axes[0].imshow(A, cmap="viridis", interpolation="nearest")
    axes[0].set_title("target A (values 0, 1, gamma)", fontsize=9)
    fig.colorbar(im, ax=axes[0], fraction=0.046)
    im = axes[1].imshow(M, cmap="viridis", interpolation="nearest")
    axes[1].set_title("constructed M = rowsoftmax(X1 X2^T)", fontsize=9)
    fig.colorbar(im, ax=axes[1], fraction=0.046)
    log_m = np.log10(np.maximum(M, 1e-12))
    im = axes[2].imshow(log_m, cmap="magma", interpolation="nearest",
                        vmin=max(-8.0, math.floor(log_m.min())), vmax=0)
    axes[2].set_title("log10 M", fontsize=9)
    fig.colorbar(im, ax=axes[2], fraction=0.046)
    for ax in axes:
        ax.set_xlabel("key j")
        ax.set_ylabel("query i")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def plot_rank_mse(rows: Sequence[dict], path: Path, metric: str = "best_epoch_loss") -> Path:
    """MSE (log axis) vs rank r, one line per (layers, w); one panel per depth as in Fig. 1."""
    depths = sorted({row["layers"] for row in rows})
    fig, axes = plt.subplots(1, len(depths), figsize=(4.3 * len(depths), 3.4), squeeze=False,
                             sharey=True)
    for ax, depth in zip(axes.flat, depths):
        for w in sorted({row["w"] for row in rows if row["layers"] == depth}):
            sel = sorted((row for row in rows if row["layers"] == depth and row["w"] == w),
                         key=lambda row: row["r"])
            d = sel[0]["d"]
            ax.plot([row["r"] for row in sel], [row[metric] for row in sel], "o-",
                    label=f"w={w} (QK params/layer {2 * w}d^2)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(f"rank r per head (d={d}, heads H = w d / r)")
        ax.set_title(f"{depth} layer{'s' if depth > 1 else ''}", fontsize=9)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    axes.flat[0].set_ylabel("MSE (mean squared error per token)")
    fig.suptitle("Seed 004 at CPU scale: farthest-point target, error vs rank", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def plot_curves(rows: Sequence[dict], path: Path) -> Path:
    """Training curves (epoch-mean loss) for every run of the sweep."""
    depths = sorted({row["layers"] for row in rows})
    fig, axes = plt.subplots(1, len(depths), figsize=(4.3 * len(depths), 3.2), squeeze=False,
                             sharey=True)
    for ax, depth in zip(axes.flat, depths):
        for row in sorted((r for r in rows if r["layers"] == depth), key=lambda r: (r["w"], r["r"])):
            ax.plot(np.arange(1, len(row["epoch_losses"]) + 1), row["epoch_losses"],
                    label=f"w={row['w']} r={row['r']}")
        ax.set_yscale("log")
        ax.set_xlabel("epoch")
        ax.set_title(f"{depth} layer{'s' if depth > 1 else ''}", fontsize=9)
        ax.legend(fontsize=6, ncol=2)
    axes.flat[0].set_ylabel("epoch-mean training loss")
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path
