"""Figures (PNG, matplotlib Agg): the only module of the package that imports matplotlib.

matplotlib comes with the ``[analysis]`` extra. Without it every ``plot_*`` logs one warning naming the extra and
returns None instead of a path: ``analyze``, ``derive`` and ``convert`` still write every number, reports list only
the figures that exist.
"""

from __future__ import annotations

import functools
import logging
import math
import os
from collections.abc import Sequence

import torch

from ..pattern import AttentionPattern

try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:  # figures are optional: the numbers never need them
    matplotlib = plt = None

logger = logging.getLogger(__name__)
MISSING = ("figures skipped: matplotlib is not installed (pip install 'hf-partial-attention[analysis]' "
           "or pip install matplotlib)")
_warned = False


def _figure(plot):
    """``plot`` returns its PNG's path, or None (one warning) where matplotlib is missing."""

    @functools.wraps(plot)
    def wrapper(*args, **kwargs):
        global _warned
        if plt is None:
            if not _warned:
                logger.warning(MISSING)
                _warned = True
            return None
        return plot(*args, **kwargs)

    return wrapper

__all__ = [
    "pattern_mask",
    "plot_layer_projection",
    "plot_overlap",
    "plot_images",
    "plot_per_query_spectra",
    "plot_energy_comparison",
    "plot_patterns",
    "plot_error_curves",
    "plot_baselines",
    "plot_length_histogram",
]

_DPI = 110


def pattern_mask(pattern: AttentionPattern) -> torch.Tensor:
    """``(n, n)`` bool: True where the score (query i, key j) is computed exactly (Fig. 8)."""
    n = pattern.seq_len
    if pattern.scope == "whole":
        mask = torch.zeros(n * n, dtype=torch.bool).scatter_(0, pattern.indices, True)  # (n²,)
        return mask.reshape(n, n)
    return torch.zeros(n, n, dtype=torch.bool).scatter_(-1, pattern.indices, True)  # (n, n)


def _save(fig, path) -> str | None:
    os.makedirs(os.path.dirname(os.fspath(path)) or ".", exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=_DPI)
    plt.close(fig)
    return os.fspath(path)


def _grid(count: int, cols: int) -> tuple[int, int]:
    cols = min(cols, count)
    return math.ceil(count / cols), cols


@_figure
def plot_layer_projection(global_curve: torch.Tensor, layers: Sequence, path, title: str = "") -> str | None:
    """Fig. 3: per layer, its own cumulative spectrum and its energy on the global top-k eigenspace."""
    rows, cols = _grid(len(layers), 3)
    fig, axes = plt.subplots(rows, cols, figsize=(3.3 * cols, 2.6 * rows), squeeze=False)
    ks = torch.arange(1, len(global_curve) + 1)
    for ax, lp in zip(axes.flat, layers):
        ax.plot(ks, lp.own.numpy(), label="own eigenvectors")
        ax.plot(ks, lp.on_global.numpy(), "--", label="global eigenvectors")
        ax.set_title(f"layer {lp.layer}", fontsize=9)
        ax.set_xscale("log")
        ax.set_ylim(0, 1.01)
        ax.set_xlabel("k")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(layers):]:
        ax.axis("off")
    axes.flat[0].set_ylabel("fraction of Tr C^l")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(title or "Per-layer covariance projected on the global top-k eigenspace", fontsize=10)
    return _save(fig, path)


@_figure
def plot_overlap(curves: dict[str, torch.Tensor], path, title: str = "") -> str | None:
    """Fig. 4: energy of one covariance captured by another's top-k eigenspace, beside its own spectrum."""
    fig, ax = plt.subplots(figsize=(4.5, 3.3))
    for label, curve in curves.items():
        ax.plot(torch.arange(1, len(curve) + 1).numpy(), curve.numpy(), label=label)
    ax.set_xscale("log")
    ax.set_ylim(0, 1.01)
    ax.set_xlabel("k")
    ax.set_ylabel("fraction of total variance")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title(title, fontsize=9)
    return _save(fig, path)


@_figure
def plot_images(images: torch.Tensor, path, titles: Sequence[str] | None = None, title: str = "",
                cols: int = 4, cmap: str = "RdBu_r") -> str | None:
    """A row of n×n images (eigenvectors, Fig. 5 and 7), symmetric colour scale around 0."""
    count = images.shape[0]
    rows, cols = _grid(count, cols)
    fig, axes = plt.subplots(rows, cols, figsize=(2.4 * cols, 2.4 * rows + 0.3), squeeze=False)
    for i, ax in enumerate(axes.flat):
        if i >= count:
            ax.axis("off")
            continue
        img = images[i].numpy()
        lim = float(abs(img).max()) or 1.0
        ax.imshow(img, cmap=cmap, vmin=-lim, vmax=lim, interpolation="nearest")
        ax.set_xticks([])
        ax.set_yticks([])
        if titles is not None:
            ax.set_title(titles[i], fontsize=8)
    fig.suptitle(title, fontsize=10)
    return _save(fig, path)


@_figure
def plot_per_query_spectra(eigenvalues: torch.Tensor, share: torch.Tensor, path, rows=None) -> str | None:
    """Fig. 6: (a) eigenvalues of Q^i for a few rows; (b) the top eigenvalue's share of Tr Q^i per row."""
    n = eigenvalues.shape[0]
    rows = rows if rows is not None else sorted({0, 1, n // 4, n // 2, n - 2, n - 1})
    fig, (a, b) = plt.subplots(1, 2, figsize=(8.5, 3.2))
    for i in rows:
        vals = eigenvalues[i] / eigenvalues[i].sum().clamp_min(1e-300)
        a.plot(torch.arange(1, n + 1).numpy(), vals.numpy(), label=f"row {i}")
    a.set_yscale("log")
    a.set_xscale("log")
    a.set_xlabel("eigenvalue index")
    a.set_ylabel("λ_j / Tr Q^i")
    a.legend(fontsize=7)
    a.grid(alpha=0.3)
    b.plot(torch.arange(n).numpy(), share.numpy(), ".-", ms=3)
    b.set_xlabel("query position i")
    b.set_ylabel("λ_1 / Tr Q^i")
    b.set_ylim(0, 1.01)
    b.grid(alpha=0.3)
    fig.suptitle("Per-query spectra", fontsize=10)
    return _save(fig, path)


@_figure
def plot_energy_comparison(curves: dict[str, torch.Tensor], path, title: str = "") -> str | None:
    """Cumulative energy curves against the number of eigenvalues (global vs pooled per-query)."""
    return plot_overlap(curves, path, title or "Cumulative energy")


@_figure
def plot_patterns(masks: Sequence[tuple[str, torch.Tensor]], path, title: str = "") -> str | None:
    """Fig. 8: the exactly computed (query, key) pairs of several patterns as black-on-white images."""
    rows, cols = _grid(len(masks), 4)
    fig, axes = plt.subplots(rows, cols, figsize=(2.5 * cols, 2.6 * rows + 0.3), squeeze=False)
    for ax, (label, mask) in zip(axes.flat, masks):
        ax.imshow(mask.numpy(), cmap="Greys", interpolation="nearest", vmin=0, vmax=1)
        ax.set_title(label, fontsize=8)
        ax.set_xlabel("key", fontsize=7)
        ax.set_ylabel("query", fontsize=7)
        ax.tick_params(labelsize=6)
    for ax in list(axes.flat)[len(masks):]:
        ax.axis("off")
    fig.suptitle(title or "Greedy P (black: computed exactly)", fontsize=10)
    return _save(fig, path)


@_figure
def plot_error_curves(curves: Sequence[dict], path) -> str | None:
    """Fig. 9: normalised error vs k̄ (with eigenvector references) and vs relative cost."""
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.4))
    for curve in curves:
        label = f"{curve['scope']} (n={curve['seq_len']})"
        line = a.plot(curve["k_bar"], curve["greedy"], "o-", ms=3, label=f"greedy, {label}")[0]
        a.plot(curve["k_bar"], curve["eigen"], ":", color=line.get_color(), label=f"eigenvectors, {label}")
        if "relative_cost" in curve:
            b.plot(curve["relative_cost"], curve["greedy"], "o-", ms=3, color=line.get_color(), label=label)
    a.set_xscale("log")
    a.set_xlabel("k̄ (exact scores per matrix)")
    a.set_ylabel("normalised error ε / Tr C_a")
    a.legend(fontsize=6)
    a.grid(alpha=0.3)
    b.set_xlabel("cost / dense QKᵀ cost")
    b.set_ylabel("normalised error")
    b.axvline(1.0, color="grey", lw=0.8)
    b.legend(fontsize=6)
    b.grid(alpha=0.3)
    return _save(fig, path)


@_figure
def plot_baselines(series: dict[str, list[tuple[float, float]]], path, title: str = "") -> str | None:
    """Measured held-out normalised error against relative cost, one line per method."""
    fig, ax = plt.subplots(figsize=(5.2, 3.6))
    for name, points in series.items():
        points = sorted(points)
        ax.plot([p[0] for p in points], [p[1] for p in points], "o-", ms=3, label=name)
    ax.set_yscale("log")
    ax.set_xlabel("cost / dense QKᵀ cost")
    ax.set_ylabel("held-out normalised error")
    ax.axvline(1.0, color="grey", lw=0.8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title(title, fontsize=9)
    return _save(fig, path)


@_figure
def plot_length_histogram(fit: Sequence[int], heldout: Sequence[int], buckets: Sequence[int], path,
                          title: str = "") -> str | None:
    """Histogram of input lengths in tokens (fit and held-out inputs), the bucket lengths as vertical lines."""
    fig, ax = plt.subplots(figsize=(5.2, 3.2))
    top = max([*fit, *heldout, *buckets, 1])
    bins = range(1, top + 2)
    ax.hist([list(fit), list(heldout)], bins=bins, stacked=True, label=["fit", "held out"])
    for b in buckets:
        ax.axvline(b + 0.5, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("input length T (tokens)")
    ax.set_ylabel("inputs")
    ax.legend(fontsize=7)
    ax.set_title(title, fontsize=9)
    return _save(fig, path)
