#!/usr/bin/env python
"""Masked-language-model pretraining of an encoder with partial attention (or of the exact baseline), for every
architecture `hf_partial_attention.supported_model_types()` names (BERT, RoBERTa, ModernBERT, DistilBERT, ...).

Data: any `datasets` Hub dataset (``--dataset_name``) or local text files (``--train_file``), tokenized and cut
into windows of exactly n tokens, ``[CLS] … [SEP]`` (``--mlm_inputs windows``, the default), or one example per
line / sentence at its own length, at most n (``--mlm_inputs lines|sentences``), each batch padded to its longest
example; ``--group_by_length`` (= ``--train_sampling_strategy group_by_length``) batches similar lengths.
Model: from scratch (``--model_type`` or ``--config_name``, with ``--config_overrides``), from a checkpoint of a
supported encoder converted with its weights kept, or a partial checkpoint (``--model_name_or_path``); P and R from
``--pattern`` (any file ``derive`` writes); R trained as
``--reconstruction fixed|common|per_layer``. Every `TrainingArguments` flag works,
plus ``--reconstruction_learning_rate`` and ``--reconstruction_weight_decay``.

Runs the same way on one CPU, N CPU processes, one GPU or many:

    python examples/pretrain_mlm.py --output_dir out --train_file corpus.txt --tokenizer_name bert-base-uncased ...
    accelerate launch --config_file examples/accelerate/cpu_2proc.yaml examples/pretrain_mlm.py ... --use_cpu
    accelerate launch --config_file examples/accelerate/multi_gpu.yaml examples/pretrain_mlm.py ...

See examples/README.md for complete commands. Writes ``all_results.json`` and a model card (README.md).
"""

from __future__ import annotations

import logging
import os
import sys

from transformers import AutoTokenizer, HfArgumentParser, set_seed

from hf_partial_attention.model_card import write_model_card
from hf_partial_attention.training import (
    MlmCollator,
    MlmDataArguments,
    ModelArguments,
    PartialAttentionTrainer,
    PartialAttentionTrainingArguments,
    build_model,
    examples_at_own_length,
    group_into_windows,
    load_text_datasets,
)
from hf_partial_attention.training.utils import perplexity, resolve_resume, sequence_length, setup_logging

logger = logging.getLogger(__name__)


def parse_args(argv: list[str] | None = None):
    parser = HfArgumentParser((ModelArguments, MlmDataArguments, PartialAttentionTrainingArguments))
    if argv is None and len(sys.argv) == 2 and sys.argv[1].endswith(".json"):
        return parser.parse_json_file(json_file=os.path.abspath(sys.argv[1]))
    return parser.parse_args_into_dataclasses(args=argv)


def get_datasets(data_args, model_args, training_args, tokenizer, n: int):
    """Train / validation examples: windows of n tokens, or lines / sentences of at most n (``--mlm_inputs``;
    tests may swap this function)."""
    with training_args.main_process_first(desc="loading and tokenizing texts"):
        raw = load_text_datasets(data_args, cache_dir=model_args.cache_dir, token=model_args.token)
        options = dict(num_proc=data_args.preprocessing_num_workers, load_from_cache_file=not data_args.overwrite_cache)
        if data_args.mlm_inputs == "windows":
            examples = group_into_windows(raw, tokenizer, n, data_args.text_column_name, **options)
        else:
            examples = examples_at_own_length(raw, tokenizer, n, data_args.mlm_inputs, data_args.text_column_name,
                                              **options)
    train, evaluation = examples["train"], examples.get("validation")
    if data_args.max_train_samples is not None:
        train = train.select(range(min(len(train), data_args.max_train_samples)))
    if evaluation is not None and data_args.max_eval_samples is not None:
        evaluation = evaluation.select(range(min(len(evaluation), data_args.max_eval_samples)))
    return train, evaluation


def main(argv: list[str] | None = None) -> dict[str, float]:
    model_args, data_args, training_args = parse_args(argv)
    setup_logging(training_args, logger)
    set_seed(training_args.seed)

    tokenizer_path = model_args.tokenizer_name or model_args.model_name_or_path
    if tokenizer_path is None:
        raise ValueError("Give --tokenizer_name (or --model_name_or_path, whose tokenizer is used).")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, cache_dir=model_args.cache_dir, token=model_args.token)
    built = build_model("masked_lm", model_args, tokenizer, max_seq_length=data_args.max_seq_length)
    model = built.model
    n = sequence_length(model, data_args.max_seq_length)
    logger.info("Model %s, n=%d, pattern: %s, inputs: %s, sampling: %s", type(model).__name__, n,
                built.pattern_source, data_args.mlm_inputs, training_args.train_sampling_strategy)

    train_dataset, eval_dataset = get_datasets(data_args, model_args, training_args, tokenizer, n)
    collator = MlmCollator(tokenizer, mlm_probability=data_args.mlm_probability,
                           seed=training_args.data_seed if training_args.data_seed is not None else training_args.seed,
                           pad_to_multiple_of=data_args.pad_to_multiple_of)
    trainer = PartialAttentionTrainer(
        model=model, args=training_args, data_collator=collator, processing_class=tokenizer,
        train_dataset=train_dataset if training_args.do_train else None,
        eval_dataset=eval_dataset if training_args.do_eval else None,
    )

    results: dict[str, float] = {}
    if training_args.do_train:
        train_result = trainer.train(resume_from_checkpoint=resolve_resume(training_args.resume_from_checkpoint))
        trainer.save_model()
        metrics = {**train_result.metrics, "train_samples": len(train_dataset)}
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()
        results.update(metrics)
    if training_args.do_eval:
        if eval_dataset is None:
            raise ValueError("--do_eval needs a validation split: --validation_file or "
                             "--validation_split_percentage > 0.")
        metrics = trainer.evaluate()
        metrics["eval_samples"] = len(eval_dataset)
        metrics["perplexity"] = perplexity(metrics["eval_loss"])
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)
        results.update(metrics)

    if trainer.is_world_process_zero() and training_args.do_train:
        dataset = data_args.dataset_name or os.path.basename(data_args.train_file)
        evals = ([{"task_type": "fill-mask", "dataset_type": dataset, "dataset_name": dataset,
                   "dataset_config": data_args.dataset_config_name, "dataset_split": "validation",
                   "metric_type": "perplexity", "metric_value": results["perplexity"]}]
                 if "perplexity" in results else None)
        inputs = (f"n = {n} tokens per window" if data_args.mlm_inputs == "windows" else
                  f"one example per {data_args.mlm_inputs[:-1]} at its own length (at most n = {n} tokens)")
        write_model_card(
            trainer.accelerator.unwrap_model(trainer.model), training_args.output_dir, overwrite=True,
            model_name=os.path.basename(os.path.abspath(training_args.output_dir)), base_model=built.base_model,
            datasets=data_args.dataset_name, pattern_source=built.pattern_source, eval_results=evals,
            training_details=(f"MLM pretraining with `examples/pretrain_mlm.py` on {dataset}: "
                              f"{trainer.state.global_step} steps, {inputs}, "
                              f"learning rate {training_args.learning_rate}."),
        )
    return results


if __name__ == "__main__":
    main()
