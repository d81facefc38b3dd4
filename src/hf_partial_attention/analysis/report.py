"""``report.md`` from ``results.json``: tables of every number the analysis produced, and its figures."""

from __future__ import annotations

import os
from collections.abc import Sequence

__all__ = ["render_report", "write_report", "markdown_table"]


def _fmt(value) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e4):
            return f"{value:.2e}"
        return f"{value:.4f}"
    return str(value)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence]) -> str:
    lines = ["| " + " | ".join(str(h) for h in header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _figures(figures: dict, base: str) -> list[str]:
    return [f"![{name}]({os.path.relpath(path, base)})" for name, path in figures.items() if path]


def _spectra(name: str, s: dict, base: str) -> list[str]:
    out = [f"## Spectra: {name}", "",
           f"Model `{s.get('model', '')}`, n = {s['seq_len']}, {s.get('num_sequences')} windows "
           f"({s.get('count')} score matrices: windows × layers × heads), scopes {s.get('scopes')}, "
           f"granularity {s.get('granularity')!r}, "
           f"covariance {'centred' if s.get('centered', True) else 'second moment'}; "
           f"Tr C_a = {_fmt(s['total_variance'])}. Took {s.get('seconds')} s.", ""]
    if "top_eigenvalue_share" in s:
        shares = s["top_eigenvalue_share"]
        out += ["Top eigenvalue's share of each row's variance, λ₁(Q^i)/Tr Q^i (Fig. 6):", "",
                markdown_table(["row i", *shares.keys(), "mean over rows 1..n−2"],
                               [["share", *shares.values(), s["top_eigenvalue_share_inner_mean"]]]), ""]
        e = s["per_query_energy"]
        out += ["Energy captured by the top-k eigenvectors of every row (k̄ = n·k), Σ_i Σ_{j≤k} λ_j(Q^i) / Tr C_a:", "",
                markdown_table(["k", *e.keys()], [["energy", *e.values()]]), ""]
    if "global_energy" in s:
        g = s["global_energy"]
        rows = [["global C_a", *g.values()]]
        if "pooled_per_query_energy" in s:
            rows.append(["per-query eigenvalues pooled", *[s["pooled_per_query_energy"].get(k) for k in g]])
        out += ["Cumulative energy of the top eigenvalues (number of eigenvalues k):", "",
                markdown_table(["k", *g.keys()], rows), ""]
    if "layer_projection" in s:
        lp = s["layer_projection"]
        keys = [k for k in lp[0] if k != "layer"]
        out += ["Per-layer covariance C^l: energy of its own top-k eigenvectors vs of the global C_a's (Fig. 3):", "",
                markdown_table(["layer", *keys], [[r["layer"], *[r[k] for k in keys]] for r in lp]), ""]
    if "overlap" in s:
        o = s["overlap"]
        out += [f"Dataset overlap (Fig. 4): energy of {o['b']} captured by the top-k eigenvectors of {o['a']}:", "",
                markdown_table(["k", *o["b_on_a"].keys()],
                               [[f"{o['b']} on {o['a']} eigenvectors", *o["b_on_a"].values()],
                                [f"{o['b']} own eigenvectors", *o["b_own"].values()]]), ""]
    return out + _figures(s.get("figures", {}), base) + [""]


def _derive_layers(name: str, d: dict, base: str) -> list[str]:
    """A ``derive --granularity layer`` section: per k, each layer's held-out error and the set's, beside the pooled
    pattern's at the same k."""
    group = d.get("granularity", "layer")
    out = [f"## Patterns per {group}: {name}", "",
           f"P and R fitted on each {group}'s own covariance at n = {d['seq_len']} (layers {d['layers']}), at the same "
           f"k (cost) as one pooled P and R. Errors are normalised by the held-out variance pooled over {group}s "
           f"({d.get('heldout_windows', 'no')} held-out windows). Took {d.get('seconds')} s.", ""]
    rows = [[p["k"], p["predicted"], p.get("heldout"), p.get("predicted_pooled_pattern"),
             p.get("heldout_pooled_pattern"), os.path.relpath(p["path"], base)] for p in d["patterns"]]
    out += [markdown_table(["k", f"predicted, per {group}", f"held-out, per {group}", "predicted, pooled P",
                            "held-out, pooled P", "file"], rows), ""]
    for p in d["patterns"]:
        if "heldout_per_group" in p:
            out += [f"k = {p['k']}, held-out error of each {group}'s own P and R (over its own variance; "
                    f"{'layer' if group == 'layer' else 'layer.head'}):", "",
                    markdown_table([group, "predicted", "held-out"],
                                   [[g, p["predicted_per_group"][g], e] for g, e in p["heldout_per_group"].items()]),
                    ""]
    return out


def _derive(name: str, d: dict, base: str) -> list[str]:
    n, dh = d["seq_len"], d.get("head_dim")
    out = [f"## Patterns: {name}", "",
           f"Greedy P and optimal R (eq. 7) at n = {n}; predicted error = Tr of the Schur complement (eq. 8) / Tr C_a. "
           f"Patterns saved under `patterns/`. Took {d.get('seconds')} s.", ""]
    curve = {c["scope"]: c for c in d["curves"]}
    rows = []
    for p in d["patterns"]:  # every pattern of the section, earlier derives' included (their k may be off the curve)
        c = curve.get(d["scope"], {})
        idx = c.get("k", []).index(p["k"]) if p["k"] in c.get("k", []) else None
        cost = p.get("relative_cost", None if idx is None else c.get("relative_cost", [None] * 99)[idx])
        rows.append([p["k"], p["k_bar"], cost, p["predicted"], p.get("heldout"),
                     None if idx is None else c["eigen"][idx], os.path.relpath(p["path"], base)])
    out += [markdown_table(["k", "k̄", f"cost / dense (d_h={dh})", "predicted normalised error", "held-out",
                            "eigenvector reference", "file"], rows), ""]
    for c in d["curves"]:
        out += [f"Fig. 9 data, {c['scope']} setting (n = {c['seq_len']}):", "",
                markdown_table(["k̄", *c["k_bar"]],
                               [["greedy", *c["greedy"]], ["eigenvectors", *c["eigen"]],
                                *([["cost / dense", *c["relative_cost"]]] if "relative_cost" in c else [])]),
                ""]
    if "heldout" in d:
        h = d["heldout"]
        out += [f"### Held-out reconstruction error (n = {n})", "",
                f"{h['windows']} held-out windows (documents not used for fitting), {h['score_matrices']} score "
                f"matrices. Normalised error = mean squared error / Tr of the held-out covariance "
                f"({_fmt(h['total_variance'])}; fitting data: {_fmt(h['train_total_variance'])}). "
                "'mod shift' = error modulo a per-row constant (softmax ignores it) / the variance left after "
                "removing each row's mean. Predicted = from the fitting covariance.", ""]
        ks = sorted({m["k"] for m in h["methods"]})
        for k in ks:
            rows = [[m["method"], m["param"], m["relative_cost"], m["predicted"], m["heldout"], m["heldout_shift"]]
                    for m in h["methods"] if m["k"] == k]
            budget = "k" if h.get("scope", "per_query") == "per_query" else "k̄"
            out += [f"**Budget {budget} = {k}** ({h.get('scope', 'per_query')} cost {_fmt(rows[0][2])} of dense at "
                    f"d_h = {dh}):", "",
                    markdown_table(["method", "parameter", "cost / dense", "predicted", "held-out",
                                    "held-out mod shift"], rows), ""]
    return out + _figures(d.get("figures", {}), base) + [""]


def _demo(d: dict) -> list[str]:
    out = ["## Conversion and sentence embeddings", "",
           f"Checkpoint `{os.path.basename(os.path.normpath(d['convert']['checkpoint']))}/` "
           "(PartialBert, per-query pattern " + (
               f"k = {d['convert']['k']}" if not d["convert"].get("layers_k") else
               "P and R per head, k per partial layer and bucket "
               + ", ".join(str(row) for row in d["convert"]["layers_k"])) + ", "
           f"n = {d['convert']['seq_len']}, partial layers {d['convert']['partial_layers']}, last layer exact) "
           f"reloaded with `AutoModel` as `{d['convert'].get('reloaded_class')}` "
           f"(max |Δ| vs the in-memory model {_fmt(d['convert'].get('reload_max_abs_diff'))}).", "",
           "Cosine between mean-pooled sentence embeddings of the converted model (no retraining) and of the "
           "original model, on held-out text:", ""]
    rows = [[r["model"], r["inputs"], r["mean"], r["median"], r["p05"], r["min"], r["count"]] for r in d["embeddings"]]
    out += [markdown_table(["model", "inputs", "mean cos", "median", "5th pct", "min", "texts"], rows), ""]
    if "reference_cosine" in d:
        out += [f"For scale: mean cosine between embeddings of *different* held-out texts under the original model: "
                f"{_fmt(d['reference_cosine'])}.", ""]
    return out


def _lengths(results: dict, base: str) -> list[str]:
    """Length buckets: the inputs of each bucket and, per k, each bucket's cost and errors at real positions."""
    a, d = results.get("analyze_lengths"), results.get("derive_lengths")
    out = ["## Length buckets: P and R fitted on real inputs", ""]
    if a:
        out += [f"Model `{a.get('model', '')}`, {a['fit_inputs']} fit inputs ({a['kind']}) from {a['fit_documents']} "
                f"documents, {a['heldout_inputs']} held-out inputs from {a['heldout_documents']} other documents; "
                f"buckets {a['lengths']} (an input of T tokens runs the smallest b >= T); "
                f"{a.get('at_longest_bucket', 0)} inputs reach the longest bucket (longer ones are truncated to it). "
                f"Took {a.get('seconds')} s.", "",
                markdown_table(["bucket b", "fit inputs", "held-out inputs", "median T", "T range"],
                               [[r["length"], r["fit_inputs"], r["heldout_inputs"], r["median_length"],
                                 f"{r['min_length']}–{r['max_length']}"] for r in a["buckets"]]), ""]
        for s in a.get("skipped", []):
            instead = f"bucket {s['used_instead']}" if s["used_instead"] else "no bucket (none is longer)"
            out += [f"- Bucket {s['length']}: no fit input, skipped; inputs of its lengths run {instead}."]
        warned = [r["length"] for r in a["buckets"] if r.get("fit_warning")]
        if warned:
            out += [f"- Buckets {warned} are fitted on fewer inputs than they have positions: their predicted error is "
                    "optimistic."]
        out += [""] + _figures(a.get("figures", {}), base) + [""]
    if d:
        dh = d.get("head_dim")
        out += [f"Greedy P (family {d.get('family')}, objective {d.get('objective')}) and optimal R per bucket; "
                "buckets with k_b >= b run exactly. Held-out errors at real positions only (rows and keys < T, keys "
                ">= T zero as the model runs), / the held-out variance there. Zero fill: the fixed-window pattern of "
                "n applied to the T-token input; conditional: R_i(T) = C_US C_SS⁻¹ (S = P_i ∩ [0, T), "
                "U = [0, T) \\ P_i) from the n-window covariance or the bucket's own. "
                f"Took {d.get('seconds')} s.", ""]
        for key, entry in d["ks"].items():
            rows = [[r["length"], r.get("k", min(int(key), r["length"])),
                     "exact" if r["exact"] else r.get("relative_cost"), r["fit_inputs"],
                     r.get("heldout_inputs"), r.get("predicted"), r.get("heldout"), r.get("zero_fill_n"),
                     r.get("conditional_n"), r.get("conditional_bucket")] for r in entry["buckets"]]
            out += [f"**k = {key}** (`{os.path.relpath(entry['path'], base)}`):", "",
                    markdown_table(["bucket b", "k_b", f"cost / dense at b (d_h={dh})", "fit inputs", "held-out inputs",
                                    "predicted", "held-out", "zero fill of n", "conditional (n cov.)",
                                    "conditional (bucket cov.)"], rows), ""]
    return out


def render_report(results: dict, base: str = ".") -> str:
    """Markdown for every section present in ``results`` (as written by the workflow steps)."""
    out = ["# Eigen analysis of attention scores and reconstruction from partial computation", ""]
    if "summary" in results:
        out += results["summary"] + [""]
    for name, section in results.items():
        if (name.startswith("analyze") or name.startswith("spectra")) and not name.endswith("_lengths"):
            out += _spectra(name, section, base)
    for name, section in results.items():
        if name.startswith("derive") and name.endswith(("_layer", "_head")):
            out += _derive_layers(name, section, base)
        elif name.startswith("derive") and not name.endswith("_lengths"):
            out += _derive(name, section, base)
    if "analyze_lengths" in results or "derive_lengths" in results:
        out += _lengths(results, base)
    if "demo" in results:
        out += _demo(results["demo"])
    if "notes" in results:
        out += ["## Notes", ""] + [f"- {line}" for line in results["notes"]] + [""]
    return "\n".join(out)


def write_report(results: dict, path: str) -> str:
    base = os.path.dirname(os.path.abspath(path))
    with open(path, "w") as f:
        f.write(render_report(results, base))
    return path
