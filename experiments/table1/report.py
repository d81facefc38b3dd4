"""The Table-1 study's report: ``table1.json`` (every number), ``table1.md`` (table, verdicts, gap decomposition,
goals, cost, command) and a model card per fine-tuned arm with its evaluation in the Hub's ``model-index`` format.

The arms are the `spec.Arm` values of the study's arguments (``table1.json`` stores the arguments, so a
report read back has its arms too); this module imports the spec, never the runner (`table1`).
"""

from __future__ import annotations

import json
import os
import platform
import sys
from dataclasses import dataclass
from typing import Any

import torch

from hf_partial_attention.cost import distribution_saving, score_cost

from .budget import BUDGET_SECONDS, estimate_seconds
from .data import TASK_DESCRIPTION
from .gaps import gap_decomposition, goals, render_gaps, render_goals
from .spec import BUCKET_OBJECTIVE, COMMAND, Arm, StudyArguments, StudyArms, job_names, layers_key
from .stats import MIN_EFFECT_NATS, ArmLosses, accuracy_summary, mlm_loss, verdicts

__all__ = ["write_report", "render", "report_arms", "collect"]


def report_arms(report: dict) -> StudyArms:
    """The arms of a report (fresh, or ``table1.json`` read back), from the arguments it stores."""
    return StudyArguments(**report["arguments"]).arms()


def _losses(job: dict | None) -> dict | None:
    return None if job is None else {kind: mlm_loss(job[kind]) for kind in ("windows", "pairs")}


def collect(a: StudyArguments, store, data, command: str) -> dict[str, Any]:
    """Everything the report shows, from the finished jobs."""
    from transformers import AutoConfig

    missing = [j for j in job_names(a) if not store.done(j)]
    if missing:
        raise ValueError(f"The study in {store.run_dir!r} has unfinished jobs {missing}; run it again to finish.")
    arms = a.arms()
    phase1, phase1_eval, rlr = store.load("phase1"), store.load("phase1_eval"), store.load("rlr")
    patterns, timing = store.load("patterns"), store.load("timing")
    mlm = {arm.name: store.load(f"mlm_{arm.name}") for arm in arms.mlm}
    conv = {arm.name: store.load(f"conv_{arm.name}") for arm in arms.converted}
    ft = {arm.name: [store.load(f"ft_{arm.name}_s{s}") for s in a.seeds] for arm in arms.finetune}
    losses = _arm_losses(arms, mlm, conv)
    zero_fill = _zero_fill_losses(arms, conv, losses)
    config = AutoConfig.from_pretrained(store.model_dir("phase1"))
    shape = _Shape(config.hidden_size // config.num_attention_heads, config.num_hidden_layers, a.max_seq_length,
                   [len(x) for x in data.pairs["validation"]["input_ids"]])
    d_head, layers, pair_lengths = shape.d_head, shape.layers, shape.pair_lengths
    rows = {arm.name: _row(arm, mlm.get(arm.name) or conv[arm.name], losses[arm.name], ft[arm.name], patterns, shape)
            for arm in arms.finetune}
    seconds = {"phase1": phase1["seconds"], "patterns": patterns["seconds"], "rlr": rlr["seconds"],
               "phase2": sum(j["seconds"] for j in mlm.values()) + phase1_eval["seconds"],
               "conv": sum(j["seconds"] for j in conv.values()),
               "finetune": sum(r["seconds"] for runs in ft.values() for r in runs), "timing": timing["seconds"]}
    seconds["total"] = sum(seconds.values())
    return {
        "command": command, "arguments": a.result_fields(), "model": data.model_id, "corpus": data.corpus,
        "task": a.task, "labels": list(data.labels), "sizes": data.sizes, "d_head": d_head, "layers": layers,
        "phase1_mlm_loss": _losses(phase1_eval), "phase1_selection_loss": mlm_loss(phase1["selection"]),
        "phase1_train_losses": phase1["train_losses"], "selection": _selection(rlr),
        "patterns": {"normalized_error": patterns["normalized_error"], "buckets": patterns["buckets"],
                     "bucket_fit": patterns["bucket_fit"], "bucket_objective": patterns["bucket_objective"],
                     "layers": patterns.get("layers", {})},
        "zero_fill_converted": {k: _losses(v) for k, v in zero_fill.items()},
        "pair_lengths": {"median": sorted(pair_lengths)[len(pair_lengths) // 2], "min": min(pair_lengths),
                         "max": max(pair_lengths)},
        "rows": rows, "verdicts": verdicts(arms, losses, phase1_eval, ft),
        "decomposition": gap_decomposition(arms, losses, phase1_eval, ft, zero_fill),
        "goals": goals(arms, losses, ft), "timing": timing, "seconds": seconds, "estimate": estimate_seconds(a),
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "cpus": os.cpu_count(), "torch": torch.__version__, "python": sys.version.split()[0],
                    "threads": timing["threads"]},
    }


def _arm_losses(arms: StudyArms, mlm: dict, conv: dict) -> dict[str, ArmLosses]:
    """Each fine-tuned arm's `ArmLosses`, from its phase-2 job or, without recovery, its conversion job."""
    losses = {}
    for arm in arms.finetune:
        job = mlm.get(arm.name) or conv[arm.name]
        losses[arm.name] = ArmLosses(job.get("converted"), job.get("recovered"), job.get("r_drift"),
                                     job.get("r_drift_max"))
    return losses


def _zero_fill_losses(arms: StudyArms, conv: dict, losses: dict[str, ArmLosses]) -> dict[str, dict]:
    """The zero-fill conversion's test losses per k: scored beside the first converted arm of each k, else taken
    from a zero-fill arm's own conversion."""
    zero_fill = {str(arm.k): conv[arm.name]["zero_fill_converted"] for arm in arms.converted
                 if "zero_fill_converted" in conv[arm.name]}
    for arm in arms.finetune:
        if arm.lengths == "zero_fill" and losses[arm.name].converted is not None:
            zero_fill.setdefault(str(arm.k), losses[arm.name].converted)
    return zero_fill


@dataclass(frozen=True)
class _Shape:
    """What the savings depend on: the head width, the layer count, n, and the test pairs' lengths."""

    d_head: int
    layers: int
    n: int
    pair_lengths: list[int]


def _row(arm: Arm, job: dict, own: ArmLosses, runs: list[dict], patterns: dict, shape: _Shape) -> dict[str, Any]:
    """One arm's row of the table: its buckets, QKᵀ savings, predicted error, MLM losses, R drift, recovery cost and
    accuracy over seeds (``runs``)."""
    d_head, layers, n, pair_lengths = shape.d_head, shape.layers, shape.n, shape.pair_lengths
    lengths = None if arm.is_exact else (patterns["buckets"][str(arm.k)]["lengths"] if arm.lengths == "buckets"
                                         else [n])
    saving = 0.0 if arm.is_exact else score_cost(n, arm.k, d_head).saving
    pairs_saving = 0.0 if arm.is_exact else distribution_saving(lengths, arm.k, d_head, pair_lengths)
    error = None if arm.is_exact else (patterns["buckets"][str(arm.k)]["normalized_error"][str(n)]
                                       if arm.lengths == "buckets" else patterns["normalized_error"][str(arm.k)])
    if not arm.is_exact and arm.budget:  # each partial layer its own k: the mean of their savings
        layers_k = patterns.get("layers", {})[layers_key(arm.k, arm.granularity, arm.exact_layers)]["layers_k"]
        # the budget's layers, all but the last (an exact one among them has k = b in every bucket: no saving)
        ks = [layers_k[str(layer)] for layer in range(layers - 1)]
        saving = sum(score_cost(n, row[-1], d_head).saving for row in ks) / len(ks)
        pairs_saving = sum(distribution_saving(lengths, row, d_head, pair_lengths) for row in ks) / len(ks)
    if not arm.is_exact and arm.granularity != "pooled":
        error = None  # the pooled fit's prediction does not describe P and R per layer or head
    converted, recovered = _losses(own.converted), _losses(own.recovered)
    return {
        "k": arm.k, "mode": arm.mode, "recovery": arm.recovery,
        "lengths": None if arm.is_exact else arm.lengths + ("" if arm.form == "pooled" else f" ({arm.form})"),
        "partial_lengths": lengths, "qk_saving_partial_layers": saving,
        "qk_saving_model": saving * (layers - 1) / layers,  # all layers but the last are partial
        "qk_saving_pairs": pairs_saving, "predicted_normalized_error": error,
        "mlm_converted_windows": converted and converted["windows"],
        "mlm_converted_pairs": converted and converted["pairs"],
        "mlm_windows": recovered and recovered["windows"], "mlm_pairs": recovered and recovered["pairs"],
        "r_drift": own.r_drift, "r_drift_max": own.r_drift_max,
        "recovery_seconds": job.get("train_seconds"), "recovery_steps": job.get("steps"),
        "reused_from": job.get("reused_from"), "accuracy": accuracy_summary(runs),
    }


def _selection(rlr: dict) -> dict[str, Any]:
    """The R-learning-rate selection as the report shows it: the arm, the winner and each candidate's numbers."""
    return {"arm": rlr["arm"], "chosen": rlr["chosen"], "windows": rlr.get("selection_windows"),
            "candidates": [{k: c[k] for k in ("reconstruction_learning_rate", "selection_loss", "r_drift",
                                              "r_drift_max", "train_seconds")} for c in rlr["candidates"]]}


def _f(value, digits=4):
    return "–" if value is None else f"{value:.{digits}f}"


def _table(report: dict) -> list[str]:
    rows = report["rows"]
    head = ["arm", "k", "R", "recovery", "lengths", "QKᵀ saving: at n, partial layers / model / at the pairs' "
            "lengths", "predicted ε/Tr C (n)", "MLM converted: windows / pairs", "MLM after phase 2: windows / pairs",
            "R drift (mean / largest)", "recovery s (steps)", "accuracy (mean ± sd)", "per seed"]
    table = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for arm in report_arms(report).finetune:
        r, acc = rows[arm.name], rows[arm.name]["accuracy"]
        after = (f"{_f(r['mlm_windows'])} / {_f(r['mlm_pairs'])}" if arm.trains else "(not retrained)")
        seconds = "–" if r["recovery_seconds"] is None else f"{r['recovery_seconds']:.0f} ({r['recovery_steps']})"
        table.append("| " + " | ".join([
            arm.name, "–" if arm.is_exact else str(arm.k), arm.mode, arm.recovery, r["lengths"] or "–",
            f"{100 * r['qk_saving_partial_layers']:.1f} % / {100 * r['qk_saving_model']:.1f} % / "
            f"{100 * r['qk_saving_pairs']:.1f} %", _f(r["predicted_normalized_error"], 3),
            "–" if arm.is_exact else f"{_f(r['mlm_converted_windows'])} / {_f(r['mlm_converted_pairs'])}", after,
            "–" if r["r_drift"] is None else f"{r['r_drift']:.3f} / {r['r_drift_max']:.3f}", seconds,
            f"{100 * acc['mean']:.1f} ± {100 * acc['sd']:.1f}", ", ".join(f"{100 * v:.1f}" for v in acc["values"]),
        ]) + " |")
    return table


def _timing_table(t: dict) -> list[str]:
    ms = t["ms"]
    out = ["| model | partial kernel | inference ms | / exact eager | / exact SDPA | train step ms | "
           "/ exact eager | / exact SDPA |", "|---|---|---|---|---|---|---|---|"]
    e, s = ms["exact/eager"], ms["exact/sdpa"]
    for name, v in ms.items():
        out.append(f"| {name} | {t['kernels'].get(name, '–')} | {v['inference']:.0f} | "
                   f"{v['inference'] / e['inference']:.2f} | {v['inference'] / s['inference']:.2f} | "
                   f"{v['train_step']:.0f} | {v['train_step'] / e['train_step']:.2f} | "
                   f"{v['train_step'] / s['train_step']:.2f} |")
    return out


def render(report: dict) -> str:
    """table1.md."""
    t = report["timing"]
    verdict_lines = []
    for key, v in report["verdicts"].items():
        verdict_lines.append(f"- **({key}) {v['claim']}: {v['verdict']}.**")
        verdict_lines += [f"  - {line}" for line in v["evidence"]]
    return "\n".join([
        *_header(report), *_setup(report),
        *_table(report), "",
        "Saving: QKᵀ multiply-adds per query, `1 − (k·d_h + (n−k)·k)/(n·d_h)` at n; at the pairs' lengths each pair "
        "runs its bucket (zero-fill: n) against dense attention over its own tokens (negative: more work than "
        "dense). MLM losses: nats per masked token, the same test examples and masks for every arm. R drift: "
        "‖R − R₀‖/‖R₀‖ after phase 2 over the model's R tensors (n's and each bucket's; phase 2 runs the training "
        "windows and the training pairs at their own lengths, so each bucket's R trains on the inputs of its "
        "range).", "",
        "## Verdicts", "",
        "A difference counts when it exceeds twice its standard error (MLM: paired over test windows; accuracy: "
        f"seeds and examples) and {MIN_EFFECT_NATS} nats (MLM) or 1 point (accuracy). MLM losses on the windows "
        "decide; the pairs' losses and accuracies are shown beside them.", "",
        *verdict_lines, "", *render_gaps(report["decomposition"]), *render_goals(report["goals"]),
        f"## Cost: measured time at B = {t['batch']}, n = {t['n']} (medians of {t['repeats']} interleaved repeats)",
        "", "Partial models (buckets; at n every input runs n's bucket) run the `auto` kernel in their partial layers "
        "and the named attention in the exact last layer; `fixed` R is frozen (its W is cached), `common` R is "
        "trained. The training step is forward and backward of the masked-only MLM loss.", "",
        *_timing_table(t), "",
    ])


def _header(report: dict) -> list[str]:
    """table1.md's title and the command that made it, with the wall time and the machine."""
    s, m = report["seconds"], report["machine"]
    return [
        f"# Table 1 v2 on the pretrained `{report['model'] or 'model'}`: exact vs partial attention at the inputs' own "
        "lengths", "",
        f"Command (wall time {s['total'] / 60:.1f} min: phase 1 {s['phase1']:.0f} s, P and R {s['patterns']:.0f} s, "
        f"R learning rate {s['rlr']:.0f} s, phase 2 {s['phase2']:.0f} s, conversions {s['conv']:.0f} s, fine-tuning "
        f"{s['finetune']:.0f} s, timing {s['timing']:.0f} s; {m['cpus']} CPUs, {m['threads']} torch threads, torch "
        f"{m['torch']}, Python {m['python']}, {m['platform']}):", "", "```", report["command"], "```", "",
    ]


def _setup(report: dict) -> list[str]:
    """table1.md's bullets on the setup: budget, model and patterns, MLM text, R's learning rate, phase 2,
    fine-tuning and the exact arm's accuracy."""
    a, rows = report["arguments"], report["rows"]
    n_eval = report["sizes"]["pairs"]["validation"]
    chance = 1 / len(report["labels"])
    exact = rows[Arm().name]["accuracy"]
    est, sel = report["estimate"], report["selection"]
    fit, p1 = report["patterns"]["bucket_fit"], report["phase1_mlm_loss"]
    candidates = ", ".join(f"{c['reconstruction_learning_rate']:g}: {c['selection_loss']:.4f} nats (R drift "
                           f"{_f(c['r_drift_max'], 3)})" for c in sel["candidates"]) or "one candidate, not trained"
    pl = report["pair_lengths"]
    return [
        f"- Budget: issue 24 asks for ≤ {BUDGET_SECONDS / 3600:.0f} h on 2 cores; the estimate for these arguments "
        f"(`experiments.table1.budget`, step times measured on 2 cores at n = 128) is {est['total'] / 3600:.2f} h.",
        f"- Model: `{report['model']}` ({report['layers']} layers, d_h = {report['d_head']}); n = "
        f"{a['max_seq_length']}; partial in all layers but the last. Zero-fill: greedy P and optimal R (eq. 7) from "
        f"the {a['covariance']} of the phase-1 model's per-query scores on {a['covariance_windows']} training "
        f"windows, pooled over all layers and heads; inputs shorter than n use n's P and R, missing keys scoring "
        f"zero. Buckets {a['lengths']}: P and R per bucket ({report['patterns']['bucket_objective']} objective) from "
        f"{fit['inputs']} training sentences and paragraphs at their own lengths (per bucket {fit['per_bucket']}).",
        f"- MLM text: {report['corpus']}, windows {report['sizes']['mlm_windows']} (validation: the test split). "
        f"Phase 1 (exact, new MLM head): {a['phase1_steps']} steps, batch {a['phase1_batch_size']}, lr "
        f"{a['phase1_learning_rate']}; test MLM loss {p1['windows']:.4f} on windows, {p1['pairs']:.4f} on "
        f"{report['sizes']['mlm_pairs']} test pairs at their own lengths (median {pl['median']} tokens).",
        (f"- R's learning rate, chosen before any test number was read: `{sel['arm']}` trained per candidate, MLM "
         f"loss on {sel['windows']} selection windows (training documents used for nothing else): {candidates}; "
         f"chosen **{sel['chosen']:g}**, used for every trained R in phase 2 and fine-tuning." if sel["arm"] else
         f"- R's learning rate: **{sel['chosen']:g}**, given (`--rlr_arm ''`, one candidate: no selection), used for "
         "every trained R in phase 2 and fine-tuning."),
        f"- Phase 2, equal budgets: {a['arm_steps']} steps per arm at batch {a['pretrain_batch_size']}, lr "
        f"{a['pretrain_learning_rate']}, the same data order and masks for every arm; recovery `mlm` (the MLM loss) "
        f"or `distill` (`{a['distill_objective']}` against the frozen phase-1 model, every weight trained); the "
        "measured training seconds are in the table. `none`: converted and fine-tuned at once.",
        f"- Fine-tuning: {report['task']} ({', '.join(report['labels'])}; chance {100 * chance:.1f} %), pairs "
        f"{report['sizes']['pairs']} at their own lengths ({pl['min']}–{pl['max']} tokens), {a['finetune_steps']} "
        f"steps, batch {a['finetune_batch_size']}, lr {a['finetune_learning_rate']}, seeds {a['finetune_seeds']}.",
        f"- Exact arm: {100 * exact['mean']:.1f} % ({100 * (exact['mean'] - chance):.1f} points above chance); one "
        f"run's binomial standard error on {n_eval} test pairs: {100 * exact['binomial_se']:.2f} points.", "",
    ]


def _form_phrase(arm) -> str:
    if arm.granularity == "pooled":
        return "pooled over all layers and heads"
    own = "each layer" if arm.granularity == "layer" else "each head of each layer"
    if arm.exact_layers:
        return (f"{own} its own, layers {list(arm.exact_layers)} exact within k's saving and the other layers a k "
                "each (`derive --saving --exact-layers`)")
    return f"{own} its own" + (" (a k per layer at k's saving: `derive --saving`)" if arm.budget else "")


def write_cards(a: StudyArguments, store, data, report: dict) -> list[str]:
    """A model card per fine-tuning arm (its seed-0 checkpoint), evaluation results in ``model-index``."""
    from transformers import BertForSequenceClassification

    from hf_partial_attention.model_card import write_model_card
    from hf_partial_attention.modeling_partial_bert import PartialBertForSequenceClassification

    paths = []
    for arm in a.arms().finetune:
        row = report["rows"][arm.name]
        folder = store.model_dir(f"ft_{arm.name}_s{a.seeds[0]}")
        model = (BertForSequenceClassification if arm.is_exact else PartialBertForSequenceClassification
                 ).from_pretrained(folder)
        acc = row["accuracy"]
        source = None if arm.is_exact else (
            (f"P and R per length bucket {row['partial_lengths']} ({BUCKET_OBJECTIVE} objective) from the training "
             f"sentences and paragraphs of `{data.model_id}` after phase 1" if arm.lengths == "buckets" else
             f"greedy P and optimal R (eq. 7) from the {a.covariance} of the per-query pre-softmax scores of "
             f"`{data.model_id}` after phase 1 on {a.covariance_windows} windows, zero-filled below n")
            + f" (exact MLM), {_form_phrase(arm)}, k = {arm.k}" + (
                "" if row["predicted_normalized_error"] is None else
                f"; predicted normalized error at n {row['predicted_normalized_error']:.3f}")
            + f"; R {arm.reconstruction}")
        recovery = {"none": "no recovery", "mlm": f"{a.arm_steps} MLM steps in this arm",
                    "distill": f"{a.arm_steps} steps of `{a.distill_objective}` against the exact phase-1 model"}
        # the report's place in the repository (never a path of the machine that ran it)
        where = "table1.md" if os.path.isabs(a.output_dir) else f"{a.output_dir}/table1.md"
        details = (f"Table-1 study arm `{arm.name}` (`{COMMAND}`, {where}): "
                   f"{a.phase1_steps} exact MLM steps, {recovery[arm.recovery]}, then {a.finetune_steps} fine-tuning "
                   f"steps on {TASK_DESCRIPTION[a.task]} at the pairs' own lengths. R learning rate "
                   f"{report['selection']['chosen']:g} (chosen on a selection split). This checkpoint is seed "
                   f"{a.seeds[0]}: accuracy {100 * acc['values'][0]:.1f} %; over seeds {a.finetune_seeds}: "
                   f"{100 * acc['mean']:.1f} ± {100 * acc['sd']:.1f} %.")
        evals = [{"task_type": "text-classification", "dataset_type": "local", "dataset_name": TASK_DESCRIPTION[a.task],
                  "dataset_split": "held-out documents", "metric_type": "accuracy",
                  "metric_value": round(acc["values"][0], 4)}]
        name = f"table1-{arm.name}"
        os.makedirs(os.path.join(a.cards_dir, name), exist_ok=True)
        paths.append(write_model_card(model, os.path.join(a.cards_dir, name), overwrite=True, model_name=name,
                                      base_model=data.model_id, pattern_source=source, eval_results=evals,
                                      training_details=details))
    return paths


def write_report(a: StudyArguments, store, data, command: str) -> dict:
    """Write ``table1.json``, ``table1.md`` and the arms' cards; returns the report (with ``cards``: their paths)."""
    report = collect(a, store, data, command)
    os.makedirs(a.output_dir, exist_ok=True)
    with open(os.path.join(a.output_dir, "table1.json"), "w") as f:
        json.dump(report, f, indent=1)
    with open(os.path.join(a.output_dir, "table1.md"), "w") as f:
        f.write(render(report))
    report["cards"] = write_cards(a, store, data, report)
    return report
