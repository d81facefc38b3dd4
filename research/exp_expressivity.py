"""Seed-002 experiment: d_min vs L over several (k, gamma, eps1, eps2) setups, fits, ablations, figures.

All setups, grids, margins and redraw counts here are ours: the paper's Fig. 3 setups and d grids
were not available (docs/related.md A5, [NF]).  Outputs go to ``out_dir``; :func:`summarise` writes markdown.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm.auto import tqdm

from . import plots
from .tables import write_csv
from .conditions import _check_eps, _check_int
from .expressivity import (
    construct_attention,
    default_d_grid,
    draw_seed,
    find_d_min,
    fit_linear,
    fit_log,
    redraws_from_q,
    sample_sparse_target,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Setup:
    """One (k, gamma, eps1, eps2) setting, run for every grid L <= ``L_max``."""

    k: int
    gamma: float
    eps1: float
    eps2: float
    L_max: int = 2048

    @property
    def label(self) -> str:
        return f"k={self.k} gamma={self.gamma:g} eps1={self.eps1:g} eps2={self.eps2:g}"

    def validate(self) -> Setup:
        """Check the values early (before any run); returns ``self``."""
        _check_int("k", self.k, 1)
        _check_int("L_max", self.L_max, 2)
        if not self.gamma >= 1:
            raise ValueError(f"gamma={self.gamma!r} is invalid: pass a variation bound >= 1")
        _check_eps(self.eps1, self.eps2)
        return self

    @classmethod
    def parse(cls, text: str) -> Setup:
        """Parse ``"k,gamma,eps1,eps2[,L_max]"``."""
        parts = text.split(",")
        if len(parts) not in (4, 5):
            raise ValueError(f"setup={text!r} is invalid: write k,gamma,eps1,eps2[,L_max]")
        try:
            k, gamma, eps1, eps2 = int(parts[0]), float(parts[1]), float(parts[2]), float(parts[3])
            L_max = int(parts[4]) if len(parts) == 5 else 2048
        except ValueError as exc:
            raise ValueError(f"setup={text!r} is invalid: {exc}; write e.g. 2,2,1,0.1,1024") from exc
        return cls(k, gamma, eps1, eps2, L_max)


DEFAULT_SETUPS = (Setup(1, 1.0, 1.0, 0.1), Setup(2, 2.0, 3.0, 0.2), Setup(2, 2.0, 0.5, 0.5),
                  Setup(2, 2.0, 1.0, 0.1, 1024), Setup(4, 2.0, 2.0, 0.2, 1024))
DEFAULT_L_GRID = (128, 256, 512, 1024, 2048)


@dataclass
class ExpressivityConfig:
    """Knobs of the experiment; every default is ours ([I]/[ours] in the summary)."""

    setups: Sequence[Setup] = DEFAULT_SETUPS
    L_grid: Sequence[int] = DEFAULT_L_GRID
    d_step: int = 8
    redraws: int = 5
    margin: float | str = "auto"
    ratio_form: str = "log"
    column_order: str = "per_pass"
    stable_max_L: int = 512  # scan past d_min (d_stable) only up to this L: cost
    seed: int = 0
    ablations: bool = True
    heatmap_L: int = 128


def _dmin_row(setup: Setup, L: int, cfg: ExpressivityConfig, **overrides) -> dict:
    opts = {"margin": cfg.margin, "ratio_form": cfg.ratio_form, "column_order": cfg.column_order,
                "redraws": cfg.redraws}
    opts.update(overrides)
    redraws = opts.pop("redraws")
    start = time.perf_counter()
    res = find_d_min(L, setup.k, setup.gamma, setup.eps1, setup.eps2,
                     default_d_grid(L, cfg.d_step), redraws, cfg.seed,
                     scan_all=L <= cfg.stable_max_L, **opts)
    used = {d: n for d, ok, n in res.trials if ok}
    return {"setup": setup.label, "k": setup.k, "gamma": setup.gamma, "eps1": setup.eps1,
            "eps2": setup.eps2, "L": L, "d_min": res.d_min, "d_stable": res.d_stable,
            "d_min_over_L": None if res.d_min is None else round(res.d_min / L, 4),
            "margin": round(res.offset - math.log(1 / setup.eps2), 3),
            "draws_at_d_min": used.get(res.d_min), "redraws": redraws,
            "seconds": round(time.perf_counter() - start, 2), **{k: str(v) for k, v in overrides.items()}}


def verdict(Ls: Sequence[int], ds: Sequence[int]) -> dict:
    """Fits and our (heuristic) verdict on whether d_min grows like log L over this L range."""
    a, b, rmse_log = fit_log(Ls, ds)
    _, _, rmse_lin = fit_linear(Ls, ds)
    # d_min increase per doubling of L (exactly d(2L) - d(L) on a doubling grid)
    inc = [round((d2 - d1) / math.log2(L2 / L1), 1)
           for (L1, d1), (L2, d2) in itertools.pairwise(zip(Ls, ds, strict=True))]
    growth = inc[-1] / inc[0] if len(inc) >= 2 and inc[0] > 0 else float("nan")
    frac = ds[-1] / Ls[-1]
    log_like = rmse_log <= rmse_lin and (math.isnan(growth) or growth <= 1.5) and frac <= 0.25
    text = ("consistent with a ln L + b (steps per doubling roughly constant, d << L)" if log_like
            else "faster than log L over this range (steps per doubling grow and/or d_min is a "
                 "large fraction of L)")
    return {"a": round(a, 2), "b": round(b, 2), "rmse_log": round(rmse_log, 2),
            "rmse_linear": round(rmse_lin, 2), "increments": inc,
            "increment_growth": None if math.isnan(growth) else round(growth, 2),
            "d_over_L_at_Lmax": round(frac, 3), "log_like": log_like, "verdict": text}


def run_expressivity(out_dir: Path, cfg: ExpressivityConfig | None = None) -> dict:
    """Run the main sweep, the ablations and the heatmap; write CSVs and PNGs; return the results."""
    cfg = cfg or ExpressivityConfig()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    jobs = [(s, L) for s in cfg.setups for L in cfg.L_grid if L <= s.L_max]
    rows = [_dmin_row(s, L, cfg) for s, L in tqdm(jobs, desc="expressivity d_min")]
    fits, curves = [], []
    for s in cfg.setups:
        sel = [r for r in rows if r["setup"] == s.label and r["d_min"] is not None]
        if len(sel) < 2:
            continue
        v = verdict([r["L"] for r in sel], [r["d_min"] for r in sel])
        margins = [r["margin"] for r in sel]
        fits.append({"setup": s.label, "margin_m": f"{min(margins):g}-{max(margins):g}", **v})
        curves.append({"label": s.label, "L": [r["L"] for r in sel],
                       "d_min": [r["d_min"] for r in sel], "fit": (v["a"], v["b"])})
    write_csv(out_dir / "expressivity_dmin.csv", rows)
    write_csv(out_dir / "expressivity_fits.csv", fits)
    figures = [plots.plot_dmin(curves, out_dir / "expressivity_dmin.png")]
    ablations = _ablations(cfg) if cfg.ablations and cfg.setups else []
    if ablations:
        write_csv(out_dir / "expressivity_ablations.csv", ablations)
    figures.append(_heatmap(cfg, out_dir))
    return {"config": cfg, "rows": rows, "fits": fits, "ablations": ablations,
            "figures": [str(f.name) for f in figures],
            "seconds": round(time.perf_counter() - start, 1)}


def _ablations(cfg: ExpressivityConfig) -> list[dict]:
    """Our sensitivity checks on setup 2 (or the first): margin, ratio form, sampler order, Q."""
    s = cfg.setups[1] if len(cfg.setups) > 1 else cfg.setups[0]
    small = [L for L in cfg.L_grid if L <= min(512, s.L_max)]
    jobs = [("margin=1.0 (fixed)", L, {"margin": 1.0}) for L in cfg.L_grid if L <= min(1024, s.L_max)]
    jobs += [("ratio_form=multiplicative", L, {"ratio_form": "multiplicative"}) for L in small]
    jobs += [("column_order=per_row", L, {"column_order": "per_row"}) for L in small]
    L_q = small[min(1, len(small) - 1)] if small else cfg.L_grid[0]
    for q in (0.004, 0.02, 0.1, 1.0):
        jobs.append((f"Q={q:g} (redraws=ceil(Q L))", L_q, {"redraws": redraws_from_q(q, L_q)}))
    rows = []
    for name, L, over in tqdm(jobs, desc="expressivity ablations"):
        row = _dmin_row(s, L, cfg, **over)
        rows.append({"ablation": name, **{k: row[k] for k in
                     ("setup", "L", "d_min", "d_stable", "margin", "redraws", "seconds")}})
    return rows


def _heatmap(cfg: ExpressivityConfig, out_dir: Path) -> Path:
    s = cfg.setups[1] if len(cfg.setups) > 1 else cfg.setups[0]
    L = cfg.heatmap_L
    A = sample_sparse_target(L, s.k, s.gamma, cfg.seed, column_order=cfg.column_order)
    res = find_d_min(L, s.k, s.gamma, s.eps1, s.eps2, default_d_grid(L, cfg.d_step), cfg.redraws,
                     cfg.seed, margin=cfg.margin, A=A)
    d = res.d_min or L
    t = next((n - 1 for dd, ok, n in res.trials if ok), 0)
    con = construct_attention(A, d, draw_seed(cfg.seed, L, d, t), eps1=s.eps1, eps2=s.eps2,
                              margin=cfg.margin)
    title = f"{s.label}, L={L}, d=d_min={d} (draw {t}); construction and margin are ours"
    return plots.plot_heatmaps(A, con.M, title, out_dir / "expressivity_heatmap.png")


def config_dict(cfg: ExpressivityConfig) -> dict:
    """Plain-dict view for the summary."""
    out = asdict(cfg)
    out["setups"] = [s.label + f" (L<={s.L_max})" for s in cfg.setups]
    return out
