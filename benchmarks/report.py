"""Markdown rendering of benchmark results, with the performance targets checked against the numbers."""

from __future__ import annotations


def _ratio(rows, n, k, mode, case):
    for r in rows:
        if (r["n"], r["k"], r["mode"], r["case"]) == (n, k, mode, case):
            return r["ratio"]
    return None


def _target_rows(result: dict) -> list[tuple[str, float | None, str, bool | None]]:
    att = result["attention"]
    n0 = att[0]["n"] if att else None
    ks = sorted({r["k"] for r in att if r["n"] == n0})
    k_mid = 32 if 32 in ks else (ks[len(ks) // 2] if ks else None)
    k_low = 16 if 16 in ks else (ks[0] if ks else None)
    best = lambda k, mode: min((v for v in (_ratio(att, n0, k, mode, f"fused/{f}") for f in ("columns", "blocks")) if v is not None), default=None)  # noqa: E731
    rows = [
        (f"structured pattern, forward, k={k_mid}", best(k_mid, "forward"), "<= 0.85", None),
        (f"structured pattern, forward, k={k_low}", best(k_low, "forward"), "<= 0.75", None),
        (f"structured pattern, forward+backward, k={k_mid}", best(k_mid, "forward+backward"), "<= 1.0", None),
        (f"per-query pattern, forward, k={k_mid}", _ratio(att, n0, k_mid, "forward", "fused/per_query"), "<= 1.0", None),
        (f"per-query pattern, forward+backward, k={k_mid}", _ratio(att, n0, k_mid, "forward+backward", "fused/per_query"), "<= 1.3", None),
    ]
    default_rows = [r["ratio"] for r in att if r["implementation"] == "fused"]
    rows.append(("slowest default (fused) configuration, any k, n, mode", max(default_rows, default=None), "<= 1.5", None))
    for r in result["model"]:
        rows.append((f"whole model, {r['mode']}", r["ratio"], "<= 1.0" if r["mode"] == "training step" else "< 1.0", None))
    checked = []
    for name, value, target, _ in rows:
        op, bound = target.split()
        ok = None if value is None else (value <= float(bound) if op == "<=" else value < float(bound))
        checked.append((name, value, target, ok))
    return checked


def markdown(result: dict) -> str:
    m = result["machine"]
    lines = ["# Partial vs dense attention: wall-clock on this machine", "",
             f"Command: `{result['command']}`  ", f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']} "
             f"({m['torch_threads']} threads), Python {m['python']}.  ",
             "Ratios are partial / dense eager attention at the same shapes, measured side by side in one process "
             "(cases interleaved, medians). `mac_ratio` = multiply-adds of the whole attention forward, "
             "(k·d + (n−k)·k + n·d) / (2·n·d) (fused: n·k for the [I|R] product).", "",
             "## Targets", "", "| target | measured | goal | met |", "|---|---|---|---|"]
    for name, value, target, ok in _target_rows(result):
        shown = "n/a" if value is None else f"{value:.2f}x"
        lines.append(f"| {name} | {shown} | {target} | {'n/a' if ok is None else ('yes' if ok else 'no')} |")
    lines += ["", "## Attention function (q, k, v given; B·H·n·d inputs)", "",
              "| n | B | k | mode | case | ms | ratio | mac_ratio | saved for backward (MiB) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in result["attention"]:
        lines.append(f"| {r['n']} | {r['b']} | {r['k']} | {r['mode']} | {r['case']} | {r['ms']:.2f} | {r['ratio']:.2f} | "
                     f"{r['mac_ratio']:.2f} | {r['saved_MiB']:.1f} |")
    lines += ["", "## Where the time goes (forward, in units of one dense QKᵀ)", ""]
    for shape, steps in result["breakdown"].items():
        lines.append(f"- {shape}: " + ", ".join(f"{name} {value:.2f}" for name, value in steps.items()))
    lines += ["", "## Peers: self-attention modules with their projections (hidden states in, context out)", "",
              "| n | B | k | module | ms | ratio to BERT eager |", "|---|---|---|---|---|---|"]
    for r in result["peers"]:
        lines.append(f"| {r['n']} | {r['b']} | {r['k']} | {r['case']} | {r['ms']:.2f} | {r['ratio']:.2f} |")
    lines += ["", "## Whole model (MLM, per-query pattern, common R, all layers but the last partial)", "",
              "| mode | layers | hidden | B | n | k | BERT s | PartialBert s | ratio |", "|---|---|---|---|---|---|---|---|---|"]
    for r in result["model"]:
        lines.append(f"| {r['mode']} | {r['layers']} | {r['hidden']} | {r['b']} | {r['n']} | {r['k']} | "
                     f"{r['bert_s']:.3f} | {r['partial_s']:.3f} | {r['ratio']:.2f} |")
    return "\n".join(lines) + "\n"
