"""Seed-004 experiment: CPU-scale version of Fig. 1 (error vs rank) plus the full-rank construction check."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from . import plots
from .tables import write_csv
from .rank_heads import TrainConfig, config_dict, divisors, run_sweep
from .rank_model import FullRankHead, nn_target, sample_sphere, token_sq_error

logger = logging.getLogger(__name__)


@dataclass
class RankHeadsConfig:
    """Sweep knobs; defaults are our CPU-scale choices (paper: d=64, r=1..64, layers 1/3/5, w 1/8/64)."""

    base: TrainConfig = field(default_factory=TrainConfig)
    ranks: Sequence[int] | None = None  # None: divisors of d
    layers: Sequence[int] = (1, 3)
    widths: Sequence[int] = (1,)
    seeds: Sequence[int] = (0,)
    lr_by_depth: dict = field(default_factory=dict)  # {layers: lr} overrides base.lr [ours]
    widths_by_depth: dict = field(default_factory=dict)  # {layers: (w, ...)} overrides widths [ours]


def construction_check(d: int, n_values: Sequence[int] = (2, 16, 64), betas: Sequence[float] = (1, 10, 100),
                       batch: int = 512, seed: int = 0) -> list[dict]:
    """MSE of the full-rank single head: exact (0) with hardmax, shrinking with softmax ``beta``."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    with torch.no_grad():
        for target in ("farthest", "nearest"):
            for n in n_values:
                x = sample_sphere(batch, n, d, gen)  # (batch, n, d)
                y = nn_target(x, target)
                row = {"target": target, "N": n,
                       "hardmax": float(token_sq_error(FullRankHead.construct(d, target)(x), y))}
                for beta in betas:
                    head = FullRankHead.construct(d, target, hardmax=False, beta=beta)
                    row[f"softmax beta={beta:g}"] = float(token_sq_error(head(x), y))
                rows.append(row)
    return rows


def run_rank_heads(out_dir: Path, cfg: RankHeadsConfig | None = None, progress: bool = True) -> dict:
    """Train the sweep (grouped by depth so each depth can use its own lr), write CSV/JSON/PNGs."""
    cfg = cfg or RankHeadsConfig()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    rows: list[dict] = []
    for depth in cfg.layers:
        base = replace(cfg.base, lr=cfg.lr_by_depth.get(depth, cfg.base.lr))
        widths = cfg.widths_by_depth.get(depth, cfg.widths)
        for row in run_sweep(base, ranks=cfg.ranks, layers=(depth,), widths=widths,
                             seeds=cfg.seeds, progress=progress):
            row["lr"] = base.lr
            rows.append(row)
    check = construction_check(cfg.base.d)
    with open(out_dir / "rank_heads_runs.json", "w") as fh:
        json.dump(rows, fh, indent=1)
    flat = [{k: v for k, v in row.items() if k != "epoch_losses"} for row in rows]
    write_csv(out_dir / "rank_heads.csv", flat)
    write_csv(out_dir / "rank_heads_construction.csv", check)
    figures = [plots.plot_rank_mse(rows, out_dir / "rank_heads_mse.png"),
               plots.plot_curves(rows, out_dir / "rank_heads_curves.png")]
    return {"config": cfg, "rows": flat, "construction": check, "verdicts": verdicts(flat),
            "figures": [f.name for f in figures], "seconds": round(time.perf_counter() - start, 1)}


def verdicts(rows: Sequence[dict], metric: str = "best_epoch_loss") -> list[dict]:
    """Per (layers, w): is full rank best, and by what factor over the best lower rank?

    With several widths, one more row per depth compares full rank at the smallest ``w`` against
    every lower rank at a larger ``w`` (more heads and more QK parameters).
    """
    out = []
    for key in sorted({(r["layers"], r["w"]) for r in rows}):
        sel = sorted((r for r in rows if (r["layers"], r["w"]) == key), key=lambda r: r["r"])
        full = sel[-1]
        if len(sel) < 2:
            continue
        best_low = min(sel[:-1], key=lambda r: r[metric])
        ratio = best_low[metric] / max(full[metric], 1e-12)
        out.append({"layers": key[0], "w": key[1], "full_rank_r": full["r"],
                    "full_rank_mse": round(full[metric], 4), "best_lower_rank_r": best_low["r"],
                    "best_lower_rank_mse": round(best_low[metric], 4),
                    "ratio_lower_over_full": round(ratio, 2),
                    "full_rank_best": full[metric] < best_low[metric]})
    for depth in sorted({r["layers"] for r in rows}):
        sel = [r for r in rows if r["layers"] == depth]
        if len({r["w"] for r in sel}) < 2:
            continue
        d = max(r["r"] for r in sel)
        full = min((r for r in sel if r["r"] == d), key=lambda r: r["w"])
        lower = [r for r in sel if r["r"] < d and r["w"] > full["w"]]
        if not lower:
            continue
        best_low = min(lower, key=lambda r: r[metric])
        out.append({"layers": depth, "w": f"{full['w']} (full r) vs {best_low['w']} (lower r)",
                    "full_rank_r": d, "full_rank_mse": round(full[metric], 4),
                    "best_lower_rank_r": best_low["r"],
                    "best_lower_rank_mse": round(best_low[metric], 4),
                    "ratio_lower_over_full": round(best_low[metric] / max(full[metric], 1e-12), 2),
                    "full_rank_best": full[metric] < best_low[metric]})
    return out


def describe(cfg: RankHeadsConfig) -> dict:
    """Plain-dict view for the summary."""
    return {"base": config_dict(cfg.base),
            "ranks": list(cfg.ranks) if cfg.ranks is not None else divisors(cfg.base.d),
            "layers": list(cfg.layers), "widths": list(cfg.widths), "seeds": list(cfg.seeds),
            "lr_by_depth": dict(cfg.lr_by_depth), "widths_by_depth": dict(cfg.widths_by_depth)}
