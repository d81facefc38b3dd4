"""The from-scratch Table 1 study's report: ``table1.md``, ``table1.json`` (``rows[arm]``: ``k``, ``kind``,
``reconstruction``, ``qk_saving``, ``mlm_windows`` (held-out MLM loss, nats per masked token), its paired difference
to exact, ``accuracy`` (``mean``, ``sd``, per seed) and its difference to exact, the curve against steps), the
verdicts on the paper's claims (a)–(d) and ours (e), the goals, a figure and the trained-in arms' model cards.

A difference counts when it exceeds twice its standard error (MLM: paired over the same test windows and masks;
accuracy: seeds and examples, `stats.accuracy_difference`); no other floor. The "best R mode" of a k is
chosen on the validation windows where the study has them (``--validation_every``), else on the test windows, and
the report says which.
"""

from __future__ import annotations

import os
import platform
from typing import Any

from ..store import write_study
from .scratch_curve import render_diagnostics
from .scratch_spec import ScratchArm, ScratchArguments
from .stats import accuracy_difference, accuracy_summary, fmt_difference, mlm_loss, seeds_loss_difference

__all__ = ["collect_scratch", "render_scratch", "write_scratch_report"]


def _saving(a: ScratchArguments, arm: ScratchArm, patterns: dict) -> float | None:
    """QKᵀ multiply-adds saved over the whole model (every layer; the last is exact) at n."""
    from hf_partial_attention.cost import score_cost

    n, layers = a.max_seq_length, a.num_hidden_layers
    if arm.kind == "exact":
        return 0.0
    if arm.kind == "p_only":  # k exact scores a query and nothing to reconstruct: 1 − k/n in each partial layer
        return (1 - arm.k / n) * (layers - 1) / layers
    if arm.kind == "head_budget":
        ks = [row[-1]
              for layer, row in sorted(patterns["head"][str(arm.k)]["layers_k"].items(), key=lambda x: int(x[0]))
              if int(layer) < layers - 1]
    else:
        ks = [arm.k] * (layers - 1)
    return sum(score_cost(n, k, a.d_head).saving for k in ks) / layers


def _verdict(diff: float, se: float) -> str:
    """'below' / 'above' / 'not distinguishable' (|diff| within twice its se)."""
    if abs(diff) <= 2 * se:
        return "not distinguishable"
    return "below" if diff < 0 else "above"


def collect_scratch(a: ScratchArguments, stores, data, command: str) -> dict[str, Any]:
    """The report's numbers from the job stores of every pretraining seed (the first: the study's own seed)."""
    stores = list(stores) if isinstance(stores, (list, tuple)) else [stores]
    store = stores[0]
    arms = a.arm_list()
    seeds = a.seed_list()
    patterns = store.load("patterns")
    test = {}  # arm -> its test job of every pretraining seed
    for arm in arms:
        job = f"convert_{arm.name}" if arm.kind == "convert" else f"pretrain_{arm.name}"
        test[arm.name] = [s.load(job) for s in stores]
    runs = {arm.name: [s.load(f"ft_{arm.name}_s{seed}") for s in stores for seed in seeds] for arm in arms}
    rows = {}
    for arm in arms:
        jobs = test[arm.name]
        job = jobs[0]
        mlm_diff = seeds_loss_difference(jobs, test["exact"])
        acc_diff = accuracy_difference(runs[arm.name], runs["exact"])
        validation = [mlm_loss(j["validation"]) for j in jobs if j.get("validation")]
        rows[arm.name] = {
            "k": arm.k, "kind": arm.kind, "reconstruction": arm.reconstruction, "qk_saving": _saving(a, arm, patterns),
            "mlm_windows": sum(mlm_loss(j["test"]) for j in jobs) / len(jobs),
            "mlm_windows_per_seed": [mlm_loss(j["test"]) for j in jobs], "mlm_vs_exact": list(mlm_diff),
            "accuracy": accuracy_summary(runs[arm.name]), "accuracy_vs_exact": list(acc_diff),
            "curve": job.get("curve"), "train_seconds": job.get("train_seconds"), "steps": job.get("steps"),
            "r_drift": job.get("r_drift"), "train_losses": job.get("train_losses"),
            "mlm_validation": sum(validation) / len(validation) if len(validation) == len(jobs) else None}
    # every job's wall time, of every pretraining seed, this run or before
    seconds = sum(s.load(f[:-5]).get("seconds", 0.0) for s in stores for f in os.listdir(s.jobs_dir)
                  if f.endswith(".json"))
    report = {"command": command, "arguments": a.result_fields(), "corpus": data.corpus, "sizes": data.sizes,
              "pretrain_seeds": a.pretrain_seed_list(),
              "d_head": a.d_head,
              "tokenizer": (f"a WordPiece vocabulary of {len(data.tokenizer)} tokens trained on the training documents"
                            if a.tokenizer_name == "wordpiece" else
                            "bert-base-uncased vocabulary (sentence-transformers/all-MiniLM-L6-v2)"
                            if a.tokenizer_name is None else f"the tokenizer of {a.tokenizer_name}"),
              "patterns": patterns, "rows": rows, "estimate": store.load("estimate"),
              "timing": store.load("timing"), "seconds": seconds,
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
              "selection_split": "validation" if all(r["mlm_validation"] is not None for r in rows.values()
                                                      if r["kind"] in ("fixed", "common", "per_layer")) and
              any(r["mlm_validation"] is not None for r in rows.values()) else "test"}
    report["verdicts"] = _verdicts(report, arms, runs, test)
    report["goals"] = _goals(report, arms)
    return report


def _best_trained(report: dict, arms, k: int) -> str | None:
    """The trained-in arm of pooled P at ``k`` with the lowest MLM loss on the selection split (the paper's 'best R
    mode'): the validation windows where the study has them, else the test windows (`selection_split`)."""
    names = [arm.name for arm in arms if arm.k == k and arm.kind in ("fixed", "common", "per_layer")]
    key = "mlm_validation" if report["selection_split"] == "validation" else "mlm_windows"
    return min(names, key=lambda name: report["rows"][name][key]) if names else None


def _pair(test, runs, a_name: str, b_name: str) -> dict:
    mlm = seeds_loss_difference(test[a_name], test[b_name])
    acc = accuracy_difference(runs[a_name], runs[b_name])
    return {"arms": [a_name, b_name], "mlm": list(mlm), "mlm_verdict": _verdict(*mlm),
            "accuracy": list(acc), "accuracy_verdict": _verdict(*acc)}


def _verdicts(report: dict, arms, runs, test) -> dict:
    names = {arm.name for arm in arms}
    ks = sorted({arm.k for arm in arms if arm.k}, reverse=True)
    out: dict[str, list] = {"a": [], "b": [], "c": [], "d": [], "e": []}
    for k in ks:
        best = _best_trained(report, arms, k)
        if f"k{k}_convert" in names:
            out["a"].append(_pair(test, runs, f"k{k}_convert", "exact"))
            if best:
                out["a"].append(_pair(test, runs, f"k{k}_convert", best))
        if best:
            out["b"].append(_pair(test, runs, best, "exact"))
        for trained in ("common", "per_layer"):
            if {f"k{k}_{trained}", f"k{k}_fixed"} <= names:
                out["c"].append(_pair(test, runs, f"k{k}_{trained}", f"k{k}_fixed"))
        if {f"k{k}_common", f"k{k}_per_layer"} <= names:
            out["d"].append(_pair(test, runs, f"k{k}_common", f"k{k}_per_layer"))
        if f"k{k}_p_only" in names:
            with_r = best or next((arm.name for arm in arms if arm.k == k and arm.trained_in), None)
            if with_r:
                out["e"].append(_pair(test, runs, with_r, f"k{k}_p_only"))
    return out


def _goals(report: dict, arms) -> list[dict]:
    rows = report["rows"]
    exact, unigram = rows["exact"], report["sizes"]["unigram_nats"]
    goals = [{"goal": "the exact model has learned: held-out MLM loss >= 1.5 nats below the unigram model's and the "
                      "pair task >= 10 points above chance (33.3 %)",
              "met": unigram - exact["mlm_windows"] >= 1.5 and exact["accuracy"]["mean"] - 1 / 3 >= 0.10,
              "figure": f"MLM {exact['mlm_windows']:.3f} vs unigram {unigram:.3f} nats "
                        f"({unigram - exact['mlm_windows']:.2f} below); accuracy "
                        f"{100 * exact['accuracy']['mean']:.1f} % "
                        f"({100 * (exact['accuracy']['mean'] - 1 / 3):+.1f} points over chance)"}]
    for k, points in ((32, 0.01), (24, 0.01), (16, 0.02)):
        best = _best_trained(report, arms, k)
        if best is None:
            continue
        acc, se = rows[best]["accuracy_vs_exact"]
        mlm = rows[best]["mlm_vs_exact"][0]
        met = acc >= -points and (k == 16 or mlm <= 0.05)
        goals.append({"goal": f"k = {k} trained in ({best}) within {round(100 * points)} point(s) of exact"
                              + ("" if k == 16 else " and 0.05 nats"),
                      "met": met, "figure": f"{fmt_difference(acc, se, 'acc')}, MLM {mlm:+.4f} nats"})
    for pair in report["verdicts"]["a"]:
        if pair["arms"][1] != "exact":
            diff, se = pair["accuracy"]
            goals.append({"goal": f"{pair['arms'][0]} below {pair['arms'][1]} by more than 2 se", "met": diff < -2 * se,
                          "figure": fmt_difference(diff, se, "acc")})
    for pair in report["verdicts"]["e"]:
        diff, se = pair["mlm"]
        goals.append({"goal": f"P with R ({pair['arms'][0]}) ahead of P alone ({pair['arms'][1]})",
                      "met": diff < -2 * se, "figure": f"MLM {fmt_difference(diff, se)}, accuracy "
                                                       f"{fmt_difference(*pair['accuracy'], 'acc')}"})
    ms = report["timing"]["ms"]
    for name, row in ms.items():
        if not name.startswith("exact/"):
            ratio = row["train_step"] / ms["exact/sdpa"]["train_step"]
            goals.append({"goal": f"training step of {name} <= 1.02x exact (SDPA)", "met": ratio <= 1.02,
                          "figure": f"{ratio:.3f}x"})
    return goals


_CLAIMS = {
    "a": "(a) conversion alone loses: the exact model converted at the end, against exact and the trained-in arm",
    "b": "(b) trained in, the best R mode (chosen on the selection split) loses little against exact",
    "c": "(c) trained R beats fixed R",
    "d": "(d) common R helps at smaller k, per-layer R at larger k (common − per layer)",
    "e": "(e, ours) P with R beats P alone (sparse attention, the same P)",
}


def _f(value, digits=4) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def render_scratch(report: dict) -> str:
    a = report["arguments"]
    sizes = report["sizes"]
    lines = [
        "# Table 1 from scratch: partial attention trained in (issue 41)", "",
        f"Command: `{report['command']}`; wall time {report['seconds'] / 3600:.2f} h on {report['machine']['cpus']} "
        f"CPUs (estimated before it started: {report['estimate']['estimate_seconds'] / 3600:.2f} h).", "",
        f"- Model: BERT, {a['num_hidden_layers']} layers, hidden {a['hidden_size']}, {a['num_attention_heads']} heads "
        f"(d_h = {report['d_head']}), n = {a['max_seq_length']}, {report['tokenizer']}; for each pretraining seed "
        f"({', '.join(map(str, report.get('pretrain_seeds', [a['seed']])))}) every arm starts from the same initial "
        f"weights and sees the same {a['pretrain_steps']} batches of {a['pretrain_batch_size']} windows with the "
        "same masks; with several seeds, MLM differences are the mean over seeds of each seed's paired difference, "
        "their standard error the seeds' spread plus their own.",
        f"- Text: {report['corpus']}: {sizes['words']:,} words in {sum(sizes['documents'].values())} documents, every "
        f"{a['test_every']}th held out; {sizes['windows']['train']:,} training windows ({sizes['train_tokens']:,} "
        f"tokens: pretraining reads {a['pretrain_steps'] * a['pretrain_batch_size'] / sizes['windows']['train']:.1f} "
        f"epochs), {sizes['windows']['test']} held-out windows. A unigram model scores "
        f"{sizes['unigram_nats']:.3f} nats per held-out token.",
        f"- Pair task: sentence order (next / previous / unrelated, chance 33.3 %), {sizes['pairs']['train']:,} "
        f"training and {sizes['pairs']['test']:,} held-out pairs, {a['finetune_steps']} steps, seeds {a['seeds']}.",
        f"- P and R: `analyze` (second moment) on {report['patterns']['windows']} training windows of the exact model, "
        "`derive` (pooled greedy, optimal R); per head: `derive_budget` at k's saving. Every layer but the last is "
        "partial.",
        f"- `*_convert`: the exact model converted after pretraining, untrained; `*_convert_train`: then "
        f"{round(a['pretrain_steps'] * a['convert_train_fraction'])} more MLM steps with P and R built in (per-layer "
        "R trained), so it has seen more batches than exact, and its lead over exact is that extra training; "
        "`*_p_only`: the same P with no R (masked attention, sparse like the paper's alternative); its QKᵀ saving is "
        "1 − k/n in each partial layer (nothing to reconstruct).",
        f"- Rules: a difference counts when it exceeds twice its standard error, with no other floor; the best R mode "
        f"of a k is chosen on the {report.get('selection_split', 'test')} windows"
        + ("" if report.get("selection_split") == "validation" else
           " (the study had no validation split: run it with --validation_every)") + ".", "",
        "| arm | k | R | QKᵀ saving | held-out MLM (nats) | vs exact | accuracy (mean ± sd) | vs exact |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += _arm_rows(report)
    lines += ["", "## Verdicts", ""]
    for claim, pairs in report["verdicts"].items():
        lines.append(f"**{_CLAIMS[claim]}**" + ("" if pairs else ": not run (its arms are not in --arms)."))
        for p in pairs:
            lines.append(f"- {p['arms'][0]} − {p['arms'][1]}: MLM {fmt_difference(*p['mlm'])} ({p['mlm_verdict']}), "
                         f"accuracy {fmt_difference(*p['accuracy'], 'acc')} ({p['accuracy_verdict']})")
        lines.append("")
    lines += ["## Goals", "", "| goal | met | figure |", "|---|---|---|"]
    lines += [f"| {g['goal']} | {'**met**' if g['met'] else '**not met**'} | {g['figure']} |" for g in report["goals"]]
    lines += _cost(report["timing"])
    lines += render_diagnostics(report["rows"])
    lines += ["", "Held-out MLM loss against steps and training time: `figures/curves.png`; accuracy against QKᵀ "
                  "saving: `figures/accuracy_saving.png`.", ""]
    return "\n".join(lines)


def _arm_rows(report: dict) -> list[str]:
    """The table's row per arm: k, R, saving, held-out MLM loss and accuracy, each against exact."""
    lines = []
    for name, r in report["rows"].items():
        acc = r["accuracy"]
        vs_mlm = "" if name == "exact" else fmt_difference(*r["mlm_vs_exact"])
        vs_acc = "" if name == "exact" else fmt_difference(*r["accuracy_vs_exact"], "acc")
        saving = "—" if r["qk_saving"] is None else f"{100 * r['qk_saving']:.1f} %"
        lines.append(f"| {name} | {r['k'] or '—'} | {r['reconstruction'] or '—'} | {saving} | {_f(r['mlm_windows'])} | "
                     f"{vs_mlm} | {100 * acc['mean']:.1f} ± {100 * acc['sd']:.1f} | {vs_acc} |")
    return lines


def _cost(t: dict) -> list[str]:
    """The cost section: each model's inference and training-step time, the step against exact (SDPA)."""
    lines = ["", f"## Cost (batch {t['batch']}, n = {t['n']}, median of {t['repeats']}, {t['threads']} threads, "
                 f"interleaved)", "", "| model | inference ms | training step ms | step / exact SDPA |",
             "|---|---|---|---|"]
    base = t["ms"]["exact/sdpa"]["train_step"]
    lines += [f"| {name} | {row['inference']:.1f} | {row['train_step']:.1f} | {row['train_step'] / base:.3f} |"
              for name, row in t["ms"].items()]
    return lines


def _figures(report: dict, folder: str) -> dict[str, str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(folder, exist_ok=True)
    rows = report["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, r in rows.items():
        if not r["curve"] or r["kind"] in ("convert", "convert_train"):
            continue
        style = "k-" if name == "exact" else ("--" if r["kind"] == "p_only" else "-")
        for ax, x in zip(axes, ("step", "train_seconds")):
            ax.plot([p[x] for p in r["curve"]], [p["loss"] for p in r["curve"]], style, label=name, linewidth=1.2)
    for ax, label in zip(axes, ("step", "training seconds")):
        ax.set_xlabel(label)
        ax.set_ylabel("held-out MLM loss (nats)")
    axes[0].legend(fontsize=7)
    fig.suptitle("Pretrained from scratch: exact, P and R built in (solid), P alone (dashed)")
    paths = {"curves": os.path.join(folder, "curves.png")}
    fig.tight_layout()
    fig.savefig(paths["curves"], dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    groups = {"trained in": ("fixed", "common", "per_layer", "head_budget"), "converted": ("convert",),
              "converted + trained": ("convert_train",), "P alone": ("p_only",)}
    for label, kinds in groups.items():
        points = [(r["qk_saving"], r["accuracy"]["mean"], name) for name, r in rows.items() if r["kind"] in kinds]
        if points:
            ax.scatter([100 * p[0] for p in points], [100 * p[1] for p in points], label=label)
    ax.axhline(100 * rows["exact"]["accuracy"]["mean"], color="k", linewidth=0.8, label="exact")
    ax.set_xlabel("QKᵀ saving over the model (%)")
    ax.set_ylabel("pair-task accuracy (%)")
    ax.legend(fontsize=8)
    paths["accuracy_saving"] = os.path.join(folder, "accuracy_saving.png")
    fig.tight_layout()
    fig.savefig(paths["accuracy_saving"], dpi=110)
    plt.close(fig)
    return paths


def _cards(a: ScratchArguments, store, report: dict) -> list[str]:
    """Model cards of the trained-in arms' MLM checkpoints: trained from scratch with P and R built in."""
    from hf_partial_attention.model_card import write_model_card
    from hf_partial_attention.modeling_partial_bert import PartialBertForMaskedLM

    written = []
    for name, r in report["rows"].items():
        if r["kind"] not in ("fixed", "common", "per_layer", "head_budget"):
            continue
        model = PartialBertForMaskedLM.from_pretrained(store.model_dir(name))
        folder = os.path.join(a.cards_dir, name)
        os.makedirs(folder, exist_ok=True)
        written.append(write_model_card(
            model, folder, overwrite=True, model_name=f"table1-scratch-{name}", base_model=None,
            pattern_source=f"`derive` on the exact model of the same study ({report['corpus']})",
            training_details=(f"Pretrained from scratch with P and R built in (MLM, {r['steps']} steps of "
                              f"{a.pretrain_batch_size} windows of n = {a.max_seq_length}, R {r['reconstruction']}), "
                              f"every layer partial but the last, by `python -m experiments table1-scratch`; held-out "
                              f"MLM loss {r['mlm_windows']:.4f} nats "
                              f"(exact: {report['rows']['exact']['mlm_windows']:.4f}). "
                              "Results: results/table1_scratch/table1.md.")))
    return written


def write_scratch_report(a: ScratchArguments, stores, data, command: str) -> dict:
    """``table1.md``, ``table1.json``, the figures and the cards, from every pretraining seed's job store."""
    report = collect_scratch(a, stores, data, command)
    store = stores[0] if isinstance(stores, (list, tuple)) else stores
    report["figures"] = {k: os.path.relpath(v, a.output_dir) for k, v in
                         _figures(report, os.path.join(a.output_dir, "figures")).items()}
    if a.cards_dir:
        report["cards"] = _cards(a, store, report)
    write_study(a.output_dir, "table1", report, render_scratch(report))
    return report
