"""The Table-1 study's report: ``table1.json`` (every number), ``table1.md`` (table, verdicts, cost, command)
and a model card per fine-tuned arm with its evaluation in the Hub's ``model-index`` format.

The arms are the `table1_spec.Arm` values of the study's arguments (``table1.json`` stores the arguments, so a
report read back has its arms too); this module imports the spec, never the runner (`table1`).
"""

from __future__ import annotations

import json
import os
import platform
import sys
from typing import Any

import torch

from hf_partial_attention.cost import score_cost

from .table1_data import TASK_DESCRIPTION
from .table1_spec import COMMAND, Arm, StudyArguments, StudyArms, job_names
from .table1_stats import MIN_EFFECT_NATS, accuracy_summary, mlm_loss, verdicts

__all__ = ["write_report", "render", "report_arms"]


def report_arms(report: dict) -> StudyArms:
    """The arms of a report (fresh, or ``table1.json`` read back), from the arguments it stores."""
    return StudyArguments(**report["arguments"]).arms()


def collect(a: StudyArguments, store, data, command: str) -> dict[str, Any]:
    """Everything the report shows, from the finished jobs."""
    missing = [j for j in job_names(a) if not store.done(j)]
    if missing:
        raise ValueError(f"The study in {store.run_dir!r} has unfinished jobs {missing}; run it again to finish.")
    arms = a.arms()
    phase1 = store.load("phase1")
    mlm = {arm.name: store.load(f"mlm_{arm.name}") for arm in arms.mlm}
    ft = {arm.name: [store.load(f"ft_{arm.name}_s{s}") for s in a.seeds] for arm in arms.finetune}
    timing = store.load("timing")
    patterns = store.load("patterns")
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(store.model_dir("phase1"))
    d_head, layers = config.hidden_size // config.num_attention_heads, config.num_hidden_layers
    rows = {}
    for arm in arms.finetune:
        k = arm.k
        saving = 0.0 if arm.is_exact else score_cost(a.max_seq_length, k, d_head).saving
        job = mlm.get(arm.name)
        rows[arm.name] = {
            "k": k, "mode": arm.mode, "qk_saving_partial_layers": saving,
            "qk_saving_model": saving * (layers - 1) / layers,  # all layers but the last are partial
            "predicted_normalized_error": None if arm.is_exact else patterns["normalized_error"][str(k)],
            "mlm_loss_converted": mlm_loss(job["converted"]) if job and "converted" in job else None,
            "mlm_loss": mlm_loss(job) if job else None, "r_drift": job.get("r_drift") if job else None,
            "accuracy": accuracy_summary(ft[arm.name]),
        }
        twin = arm.recovered().name
        if not arm.recovery and twin in mlm:  # the same converted weights were scored there
            rows[arm.name]["mlm_loss_converted"] = mlm_loss(mlm[twin]["converted"])
    seconds = {"phase1": phase1["seconds"], "patterns": patterns["seconds"],
               "phase2": sum(j["seconds"] for j in mlm.values()),
               "finetune": sum(r["seconds"] for runs in ft.values() for r in runs), "timing": timing["seconds"]}
    seconds["total"] = sum(seconds.values())
    return {
        "command": command, "arguments": a.result_fields(), "model": data.model_id, "corpus": data.corpus,
        "task": a.task, "labels": list(data.labels), "sizes": data.sizes, "d_head": d_head, "layers": layers,
        "phase1_mlm_loss": mlm_loss(phase1), "phase1_train_losses": phase1["train_losses"],
        "rows": rows, "verdicts": verdicts(arms, mlm, phase1, ft), "timing": timing,
        "seconds": seconds,
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "cpus": os.cpu_count(), "torch": torch.__version__, "python": sys.version.split()[0],
                    "threads": timing["threads"]},
    }


def _f(value, digits=4):
    return "–" if value is None else f"{value:.{digits}f}"


def render(report: dict) -> str:
    """table1.md."""
    a, rows, t = report["arguments"], report["rows"], report["timing"]
    n_eval = report["sizes"]["pairs"]["validation"]
    chance = 1 / len(report["labels"])
    exact = rows[Arm().name]["accuracy"]
    head = ["arm", "k", "R", "QKᵀ saving (partial layers / model)", "predicted ε/Tr C", "MLM loss converted, "
            "not retrained", "MLM loss after phase 2", "R drift", "accuracy (mean ± sd)", "per seed"]
    table = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for arm in report_arms(report).finetune:
        r = rows[arm.name]
        acc = r["accuracy"]
        table.append("| " + " | ".join([
            arm.name, "–" if arm.is_exact else str(arm.k), arm.mode,
            f"{100 * r['qk_saving_partial_layers']:.1f} % / {100 * r['qk_saving_model']:.1f} %",
            _f(r["predicted_normalized_error"], 3), _f(r["mlm_loss_converted"]),
            _f(r["mlm_loss"]) if arm.recovery else "(not retrained)", _f(r["r_drift"], 3),
            f"{100 * acc['mean']:.1f} ± {100 * acc['sd']:.1f}", ", ".join(f"{100 * v:.1f}" for v in acc["values"]),
        ]) + " |")
    ms = t["ms"]
    timing = ["| model | partial kernel | inference ms | / exact eager | / exact SDPA | train step ms | "
              "/ exact eager | / exact SDPA |", "|---|---|---|---|---|---|---|---|"]
    for name, v in ms.items():
        e, s = ms["exact/eager"], ms["exact/sdpa"]
        timing.append(f"| {name} | {t['kernels'].get(name, '–')} | {v['inference']:.0f} | "
                      f"{v['inference'] / e['inference']:.2f} | {v['inference'] / s['inference']:.2f} | "
                      f"{v['train_step']:.0f} | {v['train_step'] / e['train_step']:.2f} | "
                      f"{v['train_step'] / s['train_step']:.2f} |")
    verdict_lines = []
    for key, v in report["verdicts"].items():
        verdict_lines.append(f"- **({key}) {v['claim']}: {v['verdict']}.**")
        verdict_lines += [f"  - {line}" for line in v["evidence"]]
    s, m = report["seconds"], report["machine"]
    return "\n".join([
        "# Table 1 on the real pretrained MiniLM: exact vs partial attention, R fixed / common / per layer", "",
        f"Command (wall time {s['total'] / 60:.1f} min: phase 1 {s['phase1']:.0f} s, P and R {s['patterns']:.0f} s, "
        f"phase 2 {s['phase2']:.0f} s, fine-tuning {s['finetune']:.0f} s, timing {s['timing']:.0f} s; "
        f"{m['cpus']} CPUs, {m['threads']} torch threads, torch {m['torch']}, Python {m['python']}, {m['platform']}):",
        "", "```", report["command"], "```", "",
        f"- Model: `{report['model']}` ({report['layers']} layers, d_h = {report['d_head']}); n = "
        f"{a['max_seq_length']}; partial in all layers but the last; P greedy and R optimal (eq. 7) from the "
        f"{a['covariance']} of the phase-1 model's per-query scores on {a['covariance_windows']} training windows, "
        "pooled over all layers and heads.",
        f"- MLM text: {report['corpus']}, windows {report['sizes']['mlm_windows']}. Phase 1 (exact, new MLM head): "
        f"{a['phase1_steps']} steps, lr {a['phase1_learning_rate']}, held-out MLM loss "
        f"{report['phase1_mlm_loss']:.4f}. Phase 2: {a['arm_steps']} "
        f"steps per arm, batch {a['pretrain_batch_size']}, lr {a['pretrain_learning_rate']}, the same data order "
        "and masks for every arm.",
        f"- Fine-tuning: {report['task']} ({', '.join(report['labels'])}; chance {100 * chance:.1f} %), "
        f"pairs {report['sizes']['pairs']}, {a['finetune_steps']} steps, batch {a['finetune_batch_size']}, lr "
        f"{a['finetune_learning_rate']}, seeds {a['finetune_seeds']}. `kK_converted`: the phase-1 exact model "
        "converted (common R) and fine-tuned without MLM recovery.",
        f"- Exact arm: {100 * exact['mean']:.1f} % ({100 * (exact['mean'] - chance):.1f} points above chance); one "
        f"run's binomial standard error on {n_eval} held-out pairs: {100 * exact['binomial_se']:.2f} points.", "",
        *table, "",
        "Saving: QKᵀ multiply-adds per query, `1 − (k·d_h + (n−k)·k)/(n·d_h)`. MLM losses: nats per masked "
        "token "
        "on the same held-out windows and masks for every arm. R drift: ‖R − R₀‖/‖R₀‖ after phase 2.", "",
        "## Verdicts", "",
        "A difference counts when it exceeds twice its standard error (MLM: paired over held-out windows; "
        f"accuracy: seeds and examples) and {MIN_EFFECT_NATS} nats (MLM) or 1 point (accuracy). MLM losses decide; "
        "accuracies are shown beside them.", "",
        *verdict_lines, "",
        f"## Cost: measured time at B = {t['batch']}, n = {t['n']} (medians of {t['repeats']} interleaved repeats)",
        "", "Partial models run the `auto` kernel in their partial layers and the named attention in the exact "
        "last layer; `fixed` R is frozen (its W is cached), `common` R is trained. The training step is forward "
        "and backward of the masked-only MLM loss.", "", *timing, "",
    ])


def write_cards(a: StudyArguments, store, data, report: dict) -> list[str]:
    """A model card per fine-tuning arm (its seed-0 checkpoint), evaluation results in ``model-index``."""
    from hf_partial_attention.model_card import write_model_card
    from hf_partial_attention.modeling_partial_bert import PartialBertForSequenceClassification

    paths = []
    for arm in a.arms().finetune:
        row = report["rows"][arm.name]
        folder = store.model_dir(f"ft_{arm.name}_s{a.seeds[0]}")
        if arm.is_exact:
            from transformers import BertForSequenceClassification

            model = BertForSequenceClassification.from_pretrained(folder)
        else:
            model = PartialBertForSequenceClassification.from_pretrained(folder)
        acc = row["accuracy"]
        source = None if arm.is_exact else (
            f"greedy P and optimal R (eq. 7) for k = {arm.k} from the {a.covariance} of the per-query "
            f"pre-softmax scores of `{data.model_id}` after phase 1 (exact MLM), pooled over all layers and "
            f"heads, {a.covariance_windows} windows; predicted normalized error "
            f"{row['predicted_normalized_error']:.3f}; R {arm.reconstruction}")
        details = (f"Table-1 study arm `{arm.name}` (`{COMMAND}`, results/table1/table1.md): "
                   f"{a.phase1_steps} exact MLM steps, " + (f"{a.arm_steps} MLM steps in this arm" if arm.recovery
                                                            else "no MLM recovery")
                   + f", then {a.finetune_steps} fine-tuning steps on {TASK_DESCRIPTION[a.task]}. This checkpoint "
                   f"is seed "
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
