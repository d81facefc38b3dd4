"""Markdown summary (``summary.md``) for the related-seed analyses."""

from __future__ import annotations

import platform
from collections.abc import Sequence
from pathlib import Path

import torch

from .exp_expressivity import config_dict as expr_config
from .exp_rank_heads import describe as rank_config


def table(rows: Sequence[dict], keys: Sequence[str] | None = None) -> str:
    """GitHub markdown table of ``rows`` (floats to 4 significant digits)."""
    if not rows:
        return "_(no rows)_\n"
    keys = list(keys or dict.fromkeys(k for row in rows for k in row))

    def fmt(v: object) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return "–" if v is None else str(v)

    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(fmt(row.get(k)) for k in keys) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _pivot(rows: Sequence[dict], row_key: str, col_key: str, val_key: str) -> list[dict]:
    out: dict = {}
    for r in rows:
        out.setdefault(r[row_key], {row_key: r[row_key]})[f"{col_key}={r[col_key]}"] = r[val_key]
    return list(out.values())


def expressivity_section(res: dict) -> str:
    cfg = expr_config(res["config"])
    rows, fits = res["rows"], res["fits"]
    n_log = sum(f["log_like"] for f in fits)
    parts = [
        "## (a) Expressivity of low-dimensional attention (seed 002, Likhosherstov et al. 2106.03764)\n",
        ("**Paper's claim.** Fixed selector weights with d = O(log L) approximate every k-nonzero-bounded, "
        "gamma-variation-bounded pattern by changing only X; empirically d_min fits a log curve in all 12 "
        "setups (Fig. 3).\n"),
        ("**What we ran (all ours, not the paper's):** the paper's equations (5)-(7), its 12 setups and its "
        "d grids were not available, so the construction's formulas (B with offset c = ln(1/eps2) + m, "
        "X1 = sqrt(L/d) B Y, X2 = sqrt(L/d) Y), the conditions' exact form, the margin m "
        f"(`{cfg['margin']}` = our noise-model heuristic), the setups, the L grid {list(cfg['L_grid'])} "
        f"(paper: 512..3072 step 256), d grid step {cfg['d_step']}, {cfg['redraws']} redraws per d "
        f"(paper: Q·L with Q = 1), ratio form `{cfg['ratio_form']}` and sampler order "
        f"`{cfg['column_order']}` are inferred or our own choices. One A per (setup, L), seed {cfg['seed']}.\n"),
        "### d_min (first grid d with a success; paper's definition)\n",
        table(_pivot(rows, "setup", "L", "d_min")),
        ("\n### d_stable (smallest d from which every larger grid d also succeeded; ours, L <= "
        f"{cfg['stable_max_L']})\n"),
        table(_pivot([r for r in rows if r["d_stable"] is not None], "setup", "L", "d_stable")),
        "\n### Fits: least squares d ≈ a ln L + b (fit method [I]) vs d ≈ αL + β\n",
        table(fits, ["setup", "margin_m", "a", "b", "rmse_log", "rmse_linear", "increments", "increment_growth",
                     "d_over_L_at_Lmax", "verdict"]),
        ("\n`increments` are d_min increases per doubling of L (d_min(2L) − d_min(L) on our grid): constant for a "
        "ln L growth, doubling for linear growth. "
        "margin_m is the margin m used (auto: our heuristic, capped at 8). "
        "Verdict rule (ours): log-like when the log fit is at least as good as the linear fit, the last "
        "increment is <= 1.5x the first, and d_min <= L/4 at the largest L.\n"),
    ]
    if res["ablations"]:
        parts += ["\n### Ablations (ours)\n", table(res["ablations"])]
    log_like = [f["setup"] for f in fits if f["log_like"]]
    not_log = [f["setup"] for f in fits if not f["log_like"]]
    parts += [
        "\n![d_min vs L](expressivity_dmin.png)\n\n![A beside M](expressivity_heatmap.png)\n",
        (f"\n**Verdict.** {n_log} of {len(fits)} of our setups look logarithmic over L = "
        f"{min(cfg['L_grid'])}..{max(cfg['L_grid'])} (rule above): "
        f"{'; '.join(log_like) or 'none'}. Not log-like over this range: "
        f"{'; '.join(not_log) or 'none'}. The noise model behind our construction predicts "
        "d_min ≈ D·L/(L + D) with D ∝ k (c + ln gamma)² ln L / ln²(1+eps1) (ratio part) or "
        "∝ (c/m)² ln L (zero part), so a tight setting only shows log growth once L >> D; "
        "that is not a contradiction of the theorem (an O(log L) statement), but it means we "
        "do **not** reproduce the paper's finding that all setups fit a log curve at L = 512..3072, "
        "whose setups and exact construction we lack. d_min <= L always holds here, since d = L "
        "makes the projection exact.\n"),
    ]
    return "\n".join(parts)


def rank_heads_section(res: dict) -> str:
    cfg = rank_config(res["config"])
    b = cfg["base"]
    rows = res["rows"]
    pivot = []
    for key in sorted({(r["layers"], r["w"]) for r in rows}):
        entry = {"layers": key[0], "w": key[1]}
        for r in sorted((r for r in rows if (r["layers"], r["w"]) == key), key=lambda r: r["r"]):
            entry[f"r={r['r']}"] = r["best_epoch_loss"]
        pivot.append(entry)
    full_best = [v for v in res["verdicts"] if v["full_rank_best"]]
    parts = [
        "## (b) Rank vs number of heads (seed 004, Amsel et al. 2407.16153)\n",
        ("**Paper's claim.** One full-rank head represents the nearest-neighbour (farthest-point) target "
        "exactly for every N; low-rank attention needs exponentially many heads; in Fig. 1 (d = 64, "
        "N = 16) one layer succeeds only at r = d, and full rank wins even against low-rank models "
        "with more parameters.\n"),
        (f"**What we ran (CPU scale, ours):** d = {b['d']}, N = {b['n_points']}, target "
        f"`{b['target']}`, ranks {cfg['ranks']}, layers {cfg['layers']}, widths w {cfg['widths']} "
        f"(per depth: {cfg['widths_by_depth'] or 'same'}; H = w·d/r), seeds {cfg['seeds']}, "
        f"{b['steps']} steps of batch {b['batch']} "
        f"(paper: 100k steps of 256), FFN width {b['ffn']} (paper: 2048), lr {b['lr']} with "
        f"per-depth overrides {cfg['lr_by_depth'] or 'none'} (paper: 0.01), warm-up fraction "
        f"{b['warmup_frac']} then cosine to 0, AdamW (0.9, 0.95), no weight decay, post-norm with "
        f"x -> s·x/||x|| (initial s = {b['norm_init'] or 'sqrt(d)'} [I] inside, 1 at the output [I]). "
        "Metric: mean squared Euclidean error per token (= d × MSE); table values are the paper's "
        "statistic, min over epochs (100 steps) of the epoch-mean training loss, min over seeds.\n"),
        ("**Our deviation on depth.** With lr 0.01, our 3-layer models (d = 16, FFN 64, batch 128) "
         "collapsed within a few hundred steps to the constant predictor (loss exactly 1.0: token "
         "representations became identical and the output scale went to 0) at r = 4 and r = 16, and "
         "also with FFN 256, a 20% warm-up or gradient clipping at 1 (r = 16, 500-step probes); at "
         "lr 0.003 they train. Hence the lower per-depth lr above "
         "(ours). The paper trains every depth at lr 0.01, but its 5-layer w = 1 runs also failed.\n"
         if cfg["lr_by_depth"] else ""),
        "### MSE vs rank r (best epoch-mean loss; heads H = w·d/r)\n",
        table(pivot),
        "\n### Full rank against the best lower rank\n",
        table(res["verdicts"]),
        "\n### All runs (final_eval_loss: held-out batch of 2048 sets, ours)\n",
        table(rows, ["layers", "w", "r", "heads", "qk_params_per_layer", "lr", "best_epoch_loss",
                     "final_eval_loss", "qk_angle_deg", "seconds"]),
        ("\nqk_angle_deg: angle between layer 1's score matrix sum_h W_Q,h^T W_K,h and I (ours; the "
        "paper's 'perfect' figure reports ≈ 179.5° for one full-rank layer at w = 1, d = 64).\n"),
        "\n### Construction: one full-rank head, W_Q = I, W_K = ∓I, W_V = W_O = I\n",
        table(res["construction"]),
        ("\nHardmax gives error 0 for every N (the representation claim, checked numerically); softmax "
        "approaches it as beta grows (ours).\n"),
        "\n![MSE vs rank](rank_heads_mse.png)\n\n![training curves](rank_heads_curves.png)\n",
        (f"\n**Verdict.** Full rank (r = d) beats every lower rank in {len(full_best)} of "
         f"{len(res['verdicts'])} comparisons: "
         + "; ".join(f"{v['layers']} layer(s), w {v['w']}: {v['full_rank_mse']:.3g} at r = "
                     f"{v['full_rank_r']} vs {v['best_lower_rank_mse']:.3g} at r = "
                     f"{v['best_lower_rank_r']} ({v['ratio_lower_over_full']}x)"
                     for v in res["verdicts"])
         + ". Only the *shape* of Fig. 1 is compared (a sharp drop at r = d for one layer, a steadier "
         "fall with depth); absolute values are not comparable (d = 16, ~1% of the paper's training "
         "steps, our lr for depth 3), and the curves are still falling at the end of training.\n"),
    ]
    return "\n".join(parts)


def write_summary(path: Path, command: str, expressivity: dict | None, rank_heads: dict | None,
                  wall_seconds: float) -> Path:
    """Write ``summary.md`` with the command, environment, tables, figures and verdicts."""
    parts = [
        "# Related seeds: expressivity (002) and rank vs heads (004)\n",
        ("Generated by `research`. Every choice marked ours or [I] is ours, not the "
        "papers'; see `docs/related.md` for what was read and what was not found.\n"),
        f"**Command:** `{command}`\n",
        (f"**Environment:** Python {platform.python_version()}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} thread(s), CPU only. Wall time {wall_seconds:.0f} s.\n"),
    ]
    if expressivity:
        parts.append(expressivity_section(expressivity) +
                     f"\n_(expressivity wall time {expressivity['seconds']} s)_\n")
    if rank_heads:
        parts.append(rank_heads_section(rank_heads) +
                     f"\n_(rank-heads wall time {rank_heads['seconds']} s)_\n")
    path = Path(path)
    path.write_text("\n".join(parts))
    return path
