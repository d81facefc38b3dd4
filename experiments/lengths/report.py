"""The report of `experiments.lengths`: goals, tables per bucket and the figures against T."""

from __future__ import annotations

import os

__all__ = ["render", "plot_against_length", "goal_rows"]

ARMS = ("zero-fill", "buckets", "conditional", "bucket-conditional")


def _rows(result, **match):
    return [r for r in result["rows"] if all(r[key] == value for key, value in match.items())]


def _in_16_63(lengths: list[int], b: int) -> bool:
    """Whether bucket b's inputs (T in (previous bucket, b]) lie within T = 16–64: the goal's range."""
    previous = max([x for x in lengths if x < b], default=0)
    return previous >= 16 and b <= 64


def goal_rows(result: dict, k: int = 16) -> list[dict]:
    """Issue 23's goals at ``k``: per real-input kind and bucket, the buckets arm against its own full windows (1),
    and against zero-fill at T in 16–63, the buckets whose inputs lie in T = 17–64 (2, 3)."""
    window = _rows(result, k=k, arm="buckets", inputs_kind="windows")
    window_cos = window[0]["one_minus_cos"] if window else None
    goals = []
    for r in _rows(result, k=k, arm="buckets"):
        if r["inputs_kind"] == "windows":
            continue
        zero = _rows(result, k=k, arm="zero-fill", inputs_kind=r["inputs_kind"], bucket=r["bucket"])[0]
        goals.append({"inputs_kind": r["inputs_kind"], "bucket": r["bucket"], "one_minus_cos": r["one_minus_cos"],
                      "windows": window_cos, "le_windows": window_cos is not None and r["one_minus_cos"] <= window_cos,
                      "zero_fill": zero["one_minus_cos"],
                      "ratio_to_zero_fill": r["one_minus_cos"] / zero["one_minus_cos"],
                      "spearman": r["spearman"], "in_16_63": _in_16_63(result["lengths"], r["bucket"])})
    return goals


def _f(x, digits=4):
    return "–" if x is None else f"{x:.{digits}f}"


def render(result: dict) -> str:
    lines = ["# Inputs of every length: zero-fill vs length buckets vs conditional R", "",
             f"Command: `{result['command']}` (about {result['total_seconds'] / 60:.0f} min on this machine). Model: "
             f"`{result['model']}`, converted without retraining. Fit: the demo text (pydoc topics), "
             f"{result['fit']['windows']} windows of 128 tokens (zero-fill, conditional) and its sentences and "
             f"paragraphs at their own lengths (buckets {result['lengths']}; inputs per bucket "
             f"{result['fit']['bucket_inputs']}). Held out: prose paragraphs of installed packages' descriptions "
             "(documents the fit never saw), their sentences and adjacent-sentence pairs, and 128-token windows of "
             "them.", "",
             "Columns: 1 − cos = mean over inputs of 1 − cosine of mean-pooled embeddings to the original model's; "
             "Spearman = rank correlation of all pairwise cosine similarities with the original's; hidden = each "
             "layer's relative hidden-state error at real positions (‖h − h₀‖ / ‖h₀‖).", ""]
    if "saving" in result:
        h = result["heldout_lengths"]
        lines += [f"Cost (QKᵀ multiply-adds, `cost.distribution_saving`, d_h = {result['head_dim']}) over the held-out "
                  f"real inputs (median T = {h['median']}, p10–p90 {h['p10']}–{h['p90']}), each against dense "
                  "attention at its own length: " + "; ".join(
                      f"k = {k}: buckets save {100 * v['buckets']:.1f} %, zero-fill {100 * v['zero_fill']:.1f} % "
                      f"(per bucket at T = b: " + ", ".join(f"{b}: {100 * x:.1f} %" for b, x in v["per_bucket"].items())
                      + ")" for k, v in result["saving"].items()) + ". A negative saving: more work than dense.", ""]
    own = result.get("bucket_k") or {}
    if own:
        lines += ["A k of their own (`partial_lengths_k`, `derive --bucket-k`): " + ", ".join(
            f"bucket {b} at k = {v}" for b, v in own.items()) + "; the other buckets (and zero-fill) at each k below.",
            ""]
    for k in result["ks"]:
        goals = goal_rows(result, k)
        at = "".join(f", bucket {b} at k = {v}" for b, v in own.items())
        lines += [f"## Goals at k = {k}{at}", "",
                  "| inputs | bucket | 1 − cos | ≤ full windows' | / zero-fill | ≤ 0.5 × zero-fill (T 16–63) "
                  "| Spearman | ≥ 0.95 (T 16–63) |",
                  "|---|---:|---:|---|---:|---|---:|---|"]
        for g in goals:
            half = ("yes" if g["ratio_to_zero_fill"] <= 0.5 else "no") if g["in_16_63"] else ""
            sp = ("yes" if (g["spearman"] or 0) >= 0.95 else "no") if g["in_16_63"] else ""
            lines.append(f"| {g['inputs_kind']} | {g['bucket']} | {_f(g['one_minus_cos'])} | "
                         f"{'yes' if g['le_windows'] else 'no'} ({_f(g['windows'])}) | "
                         f"{_f(g['ratio_to_zero_fill'], 2)} | {half} | {_f(g['spearman'], 3)} | {sp} |")
        lines += ["", f"## All arms at k = {k}{at}", "",
                  "| inputs | bucket | inputs | median T | arm | 1 − cos | Spearman | hidden, layers 1..L |",
                  "|---|---:|---:|---:|---|---:|---:|---|"]
        for r in sorted(_rows(result, k=k), key=lambda r: (r["inputs_kind"], r["bucket"], ARMS.index(r["arm"]))):
            t = sorted(r["lengths"])[len(r["lengths"]) // 2]
            lines.append(f"| {r['inputs_kind']} | {r['bucket']} | {r['inputs']} | {t} | {r['arm']} | "
                         f"{_f(r['one_minus_cos'])} | {_f(r['spearman'], 3)} | "
                         f"{' '.join(f'{h:.3f}' for h in r['hidden_error'])} |")
        lines += ["", f"### Held-out normalised score error at real positions, k = {k} (derive_lengths)", "",
                  "| bucket | fit inputs | held-out inputs | buckets | zero-fill (n's P, R) | conditional (n) "
                  "| conditional (bucket) | relative cost |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for b in result["score_errors"][str(k)]["buckets"]:
            lines.append(f"| {b['length']} | {b['fit_inputs']} | {b.get('heldout_inputs', '–')} | "
                         f"{'exact' if b['exact'] else _f(b.get('heldout'))} | {_f(b.get('zero_fill_n'))} | "
                         f"{_f(b.get('conditional_n'))} | {_f(b.get('conditional_bucket'))} | "
                         f"{_f(b['relative_cost'], 3)} |")
        lines.append("")
    lines += ["## Figures", ""] + [f"![{name}]({path})" for name, path in result["figures"].items()]
    return "\n".join(lines) + "\n"


def plot_against_length(rows: list[dict], fig_dir: str, width: int = 8) -> dict:
    """1 − cos against the input length T (bins of ``width`` tokens), one panel per k, a line per arm (real inputs
    of every kind together)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = sorted({r["k"] for r in rows})
    fig, axes = plt.subplots(1, len(ks), figsize=(5 * len(ks), 3.6), squeeze=False)
    for ax, k in zip(axes[0], ks):
        for arm in ARMS:
            bins: dict[int, list[float]] = {}
            for r in rows:
                if r["k"] == k and r["arm"] == arm and r["inputs_kind"] != "windows":
                    for t, c in zip(r["lengths"], r["one_minus_cos_each"]):
                        bins.setdefault((t - 1) // width, []).append(c)
            xs = sorted(bins)
            ax.plot([width * x + width / 2 for x in xs], [sum(bins[x]) / len(bins[x]) for x in xs], marker="o",
                    label=arm)
        ax.set(title=f"k = {k}", xlabel="input length T (tokens)", ylabel="mean 1 − cos to the original")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path = os.path.join(fig_dir, "one_minus_cos_vs_length.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return {"1 − cos against T": path}
