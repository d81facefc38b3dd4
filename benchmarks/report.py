"""Markdown rendering of benchmark results, with the goals of issue 11 checked against the numbers."""

from __future__ import annotations

STRUCTURED = ("columns", "blocks", "shared_blocks")
# A case is a rule miss where another kernel beats the kernel `auto` chose by more than this factor.
RULE_MISS_FACTOR = 1.10


def _rows(att, **match):
    return [r for r in att if all(r.get(key) == value for key, value in match.items())]


def _best(att, n, k, mode, patterns):
    """The fastest partial case (any kernel) of these patterns at (n, k, mode), or None."""
    cands = [r for r in att if r["n"] == n and r["k"] == k and r["mode"] == mode and r["pattern"] in patterns]
    return min(cands, key=lambda r: r["ratio"], default=None)


def _model(result, n, mode, name="PartialBert shared"):
    return next((r for r in result["model"] if r["n"] == n and r["mode"] == mode and r["model"] == name), None)


def _range(row: dict, key: str) -> str:
    """``low–high`` of a ratio's rounds, or empty for results written before ranges were recorded."""
    return "" if not row.get(key) else f"{row[key][0]:.2f}–{row[key][1]:.2f}"


def goal_rows(result: dict) -> list[dict]:
    """Each goal: what was measured (the row it comes from), its ratio to eager and to SDPA, and whether it is met.

    The shapes are the issue's (n = 128, k = 16 and n = 512, k = 32 at d = 64); a run at other shapes (--quick)
    reads its first and second attention shapes and their smallest k instead.
    """
    att = result["attention"]
    shapes = sorted({(r["n"], r["d"]) for r in att})
    (n1, _), (n2, _) = shapes[0], shapes[-1]
    k1 = 16 if any(r["n"] == n1 and r["k"] == 16 for r in att) else min(r["k"] for r in att if r["n"] == n1)
    k2 = 32 if any(r["n"] == n2 and r["k"] == 32 for r in att) else min(r["k"] for r in att if r["n"] == n2)
    goals = [
        (f"attention fwd, n={n1}, k={k1}, fastest structured / eager", _best(att, n1, k1, "forward", STRUCTURED),
         "ratio", 0.75),
        (f"attention fwd+bwd, n={n1}, k={k1}, fastest structured / eager",
         _best(att, n1, k1, "forward+backward", STRUCTURED), "ratio", 0.95),
        (f"attention fwd, n={n2}, k={k2}, fastest structured / eager", _best(att, n2, k2, "forward", STRUCTURED),
         "ratio", 0.60),
        (f"attention fwd, n={n2}, k={k2}, fastest structured / SDPA (stretch)",
         _best(att, n2, k2, "forward", STRUCTURED), "sdpa_ratio", 1.0),
        (f"attention fwd, per-query pattern, n={n1}, k={k1} / eager", _best(att, n1, k1, "forward", ("per_query",)),
         "ratio", 1.05),
    ] + model_goals(result)
    auto = [r for r in att if r["auto"] and r["k"] < r["d"]]
    slowest = max(auto, key=lambda r: r["ratio"], default=None)
    goals.append(("slowest configuration `auto` picks, any k < d / eager", slowest, "ratio", 1.2))
    return [goal_row(name, row, key, bound) for name, row, key, bound in goals]


def rule_misses(att: list[dict]) -> list[dict]:
    """The cases (shape, k, mode, pattern) where another timed kernel beat the kernel `auto` chose by more than
    `RULE_MISS_FACTOR`: ``{n, b, k, mode, pattern, auto, auto_ms, fastest, fastest_ms}`` each."""
    groups: dict[tuple, list[dict]] = {}
    for r in att:
        if r["pattern"] != "-":
            groups.setdefault((r["n"], r["b"], r["k"], r["mode"], r["pattern"]), []).append(r)
    misses = []
    for (n, b, k, mode, pattern), rows in groups.items():
        chosen = next((r for r in rows if r["auto"]), None)
        fastest = min(rows, key=lambda r: r["ms"])
        if chosen is not None and fastest["ms"] * RULE_MISS_FACTOR < chosen["ms"]:
            misses.append({"n": n, "b": b, "k": k, "mode": mode, "pattern": pattern, "auto": chosen["implementation"],
                           "auto_ms": chosen["ms"], "fastest": fastest["implementation"], "fastest_ms": fastest["ms"]})
    return misses


def goal_row(name: str, row: dict | None, key: str, bound: float) -> dict:
    """One goal checked against the row it is read from (None where the run has none): the measured ratio
    ``row[key]``, the row's ratios to eager and to SDPA, what was measured (``case``) and `goal_verdict`."""
    what = "n/a" if row is None else (row.get("case") or row.get("model"))
    if row is not None and "mode" in row and "case" in row and name.startswith("slowest"):
        what = f"{row['case']}, {row['mode']}, n={row['n']}, k={row['k']}"
    return {"goal": name, "measured": None if row is None else row[key],
            "eager": None if row is None else row["ratio"], "sdpa": None if row is None else row["sdpa_ratio"],
            "bound": bound, "case": what, **goal_verdict(row, key, bound)}


def model_goals(result: dict) -> list[tuple]:
    """The whole-model goals as (name, row, key, bound), read at the model rows' shapes: the smaller n (issue:
    n = 128, k = 16: inference and training step) and the larger (n = 512, k = 32: inference, and the stretch goal
    against SDPA). `make bench` and `benchmarks/model_study.py` both check these."""
    rows = result["model"]
    if not rows:
        return []
    (n1, k1), (n2, k2) = min((r["n"], r["k"]) for r in rows), max((r["n"], r["k"]) for r in rows)
    return [
        (f"model inference, n={n1}, k={k1} / BertModel eager", _model(result, n1, "inference"), "ratio", 0.98),
        (f"model training step, n={n1}, k={k1} / BertModel eager", _model(result, n1, "training step"), "ratio", 0.95),
        (f"model inference, n={n2}, k={k2} / BertModel eager", _model(result, n2, "inference"), "ratio", 0.85),
        (f"model inference, n={n2}, k={k2} / BertModel SDPA (stretch)", _model(result, n2, "inference"),
         "sdpa_ratio", 1.0),
    ]


def goal_verdict(row: dict | None, key: str, bound: float) -> dict:
    """``met``: the median ratio ``row[key]`` is at most ``bound`` (None without a row). ``decided``: the interval
    for the median (model rows: ``row[key + "_interval"]``) lies wholly on one side of the bound, so the verdict
    is not noise. Attention rows carry no interval (a ratio of two medians of 7 short repeats) and count as
    decided, though their ratios also move between runs (benchmarks/README.md, "Noise").
    ``range``: the rounds' lowest and highest ratio; ``interval`` and ``coverage``: the interval and its level."""
    if row is None:
        return {"met": None, "decided": None, "range": None, "interval": None, "coverage": None, "rounds": None}
    interval = row.get(f"{key}_interval")
    decided = interval is None or interval[1] <= bound or interval[0] > bound
    return {"met": row[key] <= bound, "decided": decided, "range": row.get(f"{key}_range"), "interval": interval,
            "coverage": row.get("interval_coverage"), "rounds": row.get("rounds")}


def verdict_text(goal: dict) -> str:
    """``yes`` / ``no``, or ``undecided (median: yes)`` where the interval for the median holds the bound."""
    if goal["met"] is None:
        return "n/a"
    met = "yes" if goal["met"] else "no"
    return met if goal["decided"] else f"undecided (median: {met})"


def interval_text(goal: dict) -> str:
    """``low–high (coverage %, N rounds)`` of a model goal's interval for the median; its rounds' range for
    results written before intervals were recorded; empty for attention goals."""
    if goal.get("interval"):
        low, high = goal["interval"]
        return f"{low:.2f}–{high:.2f} ({100 * goal['coverage']:.0f} %, {goal['rounds']} rounds)"
    return "" if not goal.get("range") else f"{goal['range'][0]:.2f}–{goal['range'][1]:.2f} (rounds' range)"


INTERVAL_NOTE = ("A model goal's ratio is the median of per-round ratios; beside it, a distribution-free interval for "
                 "that median (order statistics of the rounds, at least 95 % where the rounds allow it; with 5 "
                 "rounds it is their whole range, 94 %). Where the interval holds the goal, the verdict is "
                 "`undecided`: these rounds cannot tell.")


def _allocator(m: dict) -> str:
    env = m.get("allocator_env") or {}
    if not env:
        return ("glibc malloc defaults (freed blocks above the mmap threshold go back to the system: dense "
                "attention's large score tensors then cost fresh pages on every call).")
    return "glibc malloc with " + " ".join(f"`{k}={v}`" for k, v in env.items()) + " (freed blocks are reused)."


def _x(value):
    return "n/a" if value is None else f"{value:.2f}x"


def markdown(result: dict) -> str:
    m = result["machine"]
    lines = ["# Partial vs dense attention: wall-clock on this machine", "",
             f"Command: `{result['command']}`  ", f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']} "
             f"({m['torch_threads']} threads), Python {m['python']}.  ",
             f"Allocator: {_allocator(m)}  ",
             "Ratios are partial / dense eager attention (and / SDPA) at the same shapes, measured side by side in one "
             "process (cases interleaved, medians). Patterns: `per_query` (each query its own keys), `columns` (one "
             "key set), `blocks` (blocks of 32 rows share keys, each row its own R), `shared_blocks` (blocks of 32 "
             "rows share keys and R). `auto` marks the kernel `partial_implementation=\"auto\"` "
             "picks. `mac_ratio` = multiply-adds of the kernel's attention forward over dense, "
             "(k·d + (n−k)·k + n·d) / (2·n·d), counting what the kernel computes: fused and tiled multiply by all of "
             "[I|R] (n·k), and every kernel but gather gets a per-query pattern's exact scores from the whole QKᵀ "
             "(n·d instead of k·d: gathering each query's keys costs more on a CPU), so per-query patterns do more "
             "multiply-adds than dense attention at every k.", "",
             "## Goals", "", INTERVAL_NOTE, "",
             "| goal | measured | interval for the median | / eager | / SDPA | goal | met | case |",
             "|---|---|---|---|---|---|---|---|"]
    for g in goal_rows(result):
        lines.append(f"| {g['goal']} | {_x(g['measured'])} | {interval_text(g)} | {_x(g['eager'])} | "
                     f"{_x(g['sdpa'])} | <= {g['bound']} | {verdict_text(g)} | {g['case']} |")
    misses = rule_misses(result["attention"])
    lines += ["", "## Rule misses", "", f"Cases where another kernel beats the one `auto` picks by more than "
              f"{round(100 * (RULE_MISS_FACTOR - 1))} % (attention function below): "
              f"{len(misses) or 'none'}.", ""]
    if misses:
        lines += ["| n | B | k | mode | pattern | auto | ms | fastest | ms |", "|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {m['n']} | {m['b']} | {m['k']} | {m['mode']} | {m['pattern']} | rule miss: {m['auto']} | "
                  f"{m['auto_ms']:.2f} | {m['fastest']} | {m['fastest_ms']:.2f} |" for m in misses]
    lines += ["", "## Whole model (BertModel, 12 layers unless --quick; PartialBert: all layers but the last partial)",
              "", "Ratios are medians of per-round ratios (the models of a round run back to back); the range is "
              "the lowest and highest round: the noise a single comparison would show.", "",
              "| mode | layers | hidden | B | n | k | model | s | / eager | (range) | / SDPA | (range) |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["model"]:
        lines.append(f"| {r['mode']} | {r['layers']} | {r['hidden']} | {r['b']} | {r['n']} | {r['k']} | {r['model']} | "
                     f"{r['s']:.3f} | {r['ratio']:.2f} | {_range(r, 'ratio_range')} | {r['sdpa_ratio']:.2f} | "
                     f"{_range(r, 'sdpa_ratio_range')} |")
    if result.get("mixed"):
        lines += _mixed_lines(result)
    lines += ["", "## Attention function (q, k, v as a model gives them: (B, n, H, d) projections seen as "
              "(B, H, n, d); H = 12)", "",
              "| n | B | k | mode | case | auto | ms | / eager | / SDPA | mac_ratio | saved for backward (MiB) |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["attention"]:
        lines.append(f"| {r['n']} | {r['b']} | {r['k']} | {r['mode']} | {r['case']} | {'auto' if r['auto'] else ''} | "
                     f"{r['ms']:.2f} | {r['ratio']:.2f} | {r['sdpa_ratio']:.2f} | {r['mac_ratio']:.2f} | "
                     f"{r['saved_MiB']:.1f} |")
    lines += ["", "## Where the time goes (forward, in units of one dense QKᵀ)", ""]
    for shape, steps in result["breakdown"].items():
        lines.append(f"- {shape}: " + ", ".join(f"{name} {value:.2f}" for name, value in steps.items()))
    lines += ["", "## Peers: self-attention modules with their projections (hidden states in, context out)", "",
              "| n | B | k | module | ms | ratio to BERT eager |", "|---|---|---|---|---|---|"]
    for r in result["peers"]:
        lines.append(f"| {r['n']} | {r['b']} | {r['k']} | {r['case']} | {r['ms']:.2f} | {r['ratio']:.2f} |")
    return "\n".join(lines) + "\n"


def _mixed_lines(result: dict) -> list[str]:
    """The mixed-length rows' table (benchmarks/mixed.py)."""
    lines = ["", "## A batch of mixed lengths (inference; benchmarks/mixed.py)", "",
             "Inputs of lengths drawn uniformly in the range, padded to the longest. Zero-fill: one bucket "
             "(n's P and R for every input); buckets: each input in the smallest bucket >= its length (own k: the "
             "buckets' k of `partial_lengths_k`). Goal (issue 23): buckets / zero-fill <= 1.", "",
             "| layers | hidden | B | n | k | buckets | lengths | padded T | model | s | / eager | / SDPA | "
             "/ zero-fill | (range) |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["mixed"]:
        own = r.get("lengths_k") and r["lengths_k"] != [min(r["k"], b) for b in r["lengths"]][-len(r["lengths_k"]):]
        k = r["lengths_k"] if own else r["k"]
        lines.append(f"| {r['layers']} | {r['hidden']} | {r['b']} | {r['n']} | {k} | {r['lengths']} | "
                     f"{r['t_range'][0]}–{r['t_range'][1]} | {r['padded_length']} | {r['model']} | {r['s']:.3f} | "
                     f"{r['ratio']:.2f} | {r['sdpa_ratio']:.2f} | {r['zero_fill_ratio']:.2f} | "
                     f"{_range(r, 'zero_fill_ratio_range')} |")
    return lines


def mixed_markdown(result: dict) -> str:
    """The report of ``run.py --only-mixed``."""
    m = result["machine"]
    head = ["# A batch of mixed input lengths: buckets vs zero-fill vs eager and SDPA", "",
            f"Command: `{result['command']}`  ", f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']} "
            f"({m['torch_threads']} threads)."]
    return "\n".join(head + _mixed_lines(result)) + "\n"
