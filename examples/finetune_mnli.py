#!/usr/bin/env python
"""MNLI fine-tuning of an encoder with partial attention (or of the exact baseline), matched and mismatched accuracy,
for every architecture `hf_partial_attention.supported_model_types()` names (each with its own
sequence-classification head).

Data: ``nyu-mll/glue`` / ``mnli`` from the Hub (default), or local JSON lines with ``premise``, ``hypothesis`` and
``label`` (``--train_file``, ``--validation_file`` for matched, ``--validation_mismatched_file``). Every pair is
truncated to n tokens (partial attention's P and R are defined for n positions) and keeps its own length, each
batch padded to its longest pair (``--pad_to_max_length`` pads every pair to n instead; ``--group_by_length``
batches pairs of similar length). Accuracy comes from ``evaluate``: the Hub metric when reachable, else the
bundled local module (same numbers), so it works offline.

Model: usually the output of ``pretrain_mlm.py`` (``--model_name_or_path``); also a partial checkpoint of
``hf-partial-attention convert``, a source checkpoint (BERT, RoBERTa, ...) converted with ``--pattern``, or
``--attention exact`` for the baseline. Every `TrainingArguments` flag works.

    python examples/finetune_mnli.py --model_name_or_path runs/mlm --output_dir runs/mnli --do_train --do_eval
    accelerate launch --config_file examples/accelerate/multi_gpu.yaml examples/finetune_mnli.py ...

Writes ``all_results.json`` (``eval_accuracy`` matched, ``eval_accuracy_mm`` mismatched, as ``run_glue.py``) and
a model card with the results.
"""

from __future__ import annotations

import logging
import os
import sys

from transformers import AutoTokenizer, DataCollatorWithPadding, HfArgumentParser, set_seed

from hf_partial_attention.model_card import write_model_card
from hf_partial_attention.training import (
    MNLI_LABELS,
    MnliDataArguments,
    ModelArguments,
    PartialAttentionTrainer,
    PartialAttentionTrainingArguments,
    build_model,
    classification_metrics,
    load_mnli,
    tokenize_pairs,
)
from hf_partial_attention.training.utils import resolve_resume, sequence_length, setup_logging

logger = logging.getLogger(__name__)
EVAL_SPLITS = {"validation_matched": "eval", "validation_mismatched": "eval_mm"}


def parse_args(argv: list[str] | None = None):
    parser = HfArgumentParser((ModelArguments, MnliDataArguments, PartialAttentionTrainingArguments))
    if argv is None and len(sys.argv) == 2 and sys.argv[1].endswith(".json"):
        return parser.parse_json_file(json_file=os.path.abspath(sys.argv[1]))
    return parser.parse_args_into_dataclasses(args=argv)


def get_datasets(data_args, model_args, training_args, tokenizer, n: int):
    """Tokenized MNLI splits, each pair truncated to n tokens and, with ``--pad_to_max_length``, padded to n (tests
    may swap this function)."""
    with training_args.main_process_first(desc="loading and tokenizing MNLI"):
        raw = load_mnli(data_args, cache_dir=model_args.cache_dir, token=model_args.token)
        encoded = tokenize_pairs(raw, tokenizer, n, num_proc=data_args.preprocessing_num_workers,
                                 load_from_cache_file=not data_args.overwrite_cache, pad=data_args.pad_to_max_length)
    if data_args.max_train_samples is not None and "train" in encoded:
        encoded["train"] = encoded["train"].select(range(min(len(encoded["train"]), data_args.max_train_samples)))
    if data_args.max_eval_samples is not None:
        for split in EVAL_SPLITS:
            if split in encoded:
                encoded[split] = encoded[split].select(range(min(len(encoded[split]), data_args.max_eval_samples)))
    return encoded


def main(argv: list[str] | None = None) -> dict[str, float]:
    model_args, data_args, training_args = parse_args(argv)
    setup_logging(training_args, logger)
    set_seed(training_args.seed)

    tokenizer_path = model_args.tokenizer_name or model_args.model_name_or_path
    if tokenizer_path is None:
        raise ValueError("Give --tokenizer_name (or --model_name_or_path, whose tokenizer is used).")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, cache_dir=model_args.cache_dir, token=model_args.token)
    labels = {"num_labels": len(MNLI_LABELS), "id2label": dict(enumerate(MNLI_LABELS)),
              "label2id": {name: i for i, name in enumerate(MNLI_LABELS)}}
    built = build_model("sequence_classification", model_args, tokenizer,
                        max_seq_length=data_args.max_seq_length, **labels)
    model = built.model
    n = sequence_length(model, data_args.max_seq_length)
    logger.info("Model %s, n=%d, pattern: %s, pairs padded to %s, sampling: %s", type(model).__name__, n,
                built.pattern_source, "n" if data_args.pad_to_max_length else "each batch's longest",
                training_args.train_sampling_strategy)

    data = get_datasets(data_args, model_args, training_args, tokenizer, n)
    trainer = PartialAttentionTrainer(
        model=model, args=training_args, processing_class=tokenizer,
        # pads each batch to its longest pair (already n long with --pad_to_max_length: then it only stacks them)
        data_collator=DataCollatorWithPadding(tokenizer, pad_to_multiple_of=data_args.pad_to_multiple_of),
        train_dataset=data["train"] if training_args.do_train else None,
        eval_dataset=data.get("validation_matched") if training_args.do_eval else None,
        compute_metrics=classification_metrics(),
    )

    results: dict[str, float] = {}
    if training_args.do_train:
        train_result = trainer.train(resume_from_checkpoint=resolve_resume(training_args.resume_from_checkpoint))
        trainer.save_model()
        metrics = {**train_result.metrics, "train_samples": len(data["train"])}
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()
        results.update(metrics)
    evals = []
    if training_args.do_eval:
        for split, prefix in EVAL_SPLITS.items():
            if split not in data:
                logger.warning("No %s split: skipped.", split)
                continue
            metrics = trainer.evaluate(eval_dataset=data[split])
            metrics = {(k + "_mm" if prefix == "eval_mm" else k): v for k, v in metrics.items()}  # run_glue's names
            metrics[f"{prefix}_samples"] = len(data[split])
            trainer.log_metrics(prefix, metrics)
            trainer.save_metrics(prefix, metrics)
            results.update(metrics)
            accuracy = metrics["eval_accuracy_mm" if prefix == "eval_mm" else "eval_accuracy"]
            hub = data_args.train_file is None
            evals.append({"task_type": "text-classification", "dataset_type": data_args.dataset_name if hub else "json",
                          "dataset_name": data_args.dataset_name if hub else "local MNLI-style JSON lines",
                          "dataset_config": data_args.dataset_config_name if data_args.train_file is None else None,
                          "dataset_split": split, "metric_type": "accuracy", "metric_value": accuracy})

    if trainer.is_world_process_zero() and training_args.do_train:
        write_model_card(
            trainer.accelerator.unwrap_model(trainer.model), training_args.output_dir, overwrite=True,
            model_name=os.path.basename(os.path.abspath(training_args.output_dir)), base_model=built.base_model,
            datasets=data_args.dataset_name if data_args.train_file is None else None,
            pattern_source=built.pattern_source, eval_results=evals or None,
            training_details=(f"MNLI fine-tuning with `examples/finetune_mnli.py`: {trainer.state.global_step} steps, "
                              f"pairs {'padded' if data_args.pad_to_max_length else 'truncated'} to n = {n} tokens, "
                              f"learning rate {training_args.learning_rate}."),
        )
    return results


if __name__ == "__main__":
    main()
