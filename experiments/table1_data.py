"""The Table-1 study's data: the start model, its tokenizer, MLM windows and sentence pairs.

Default (offline): the English prose that ships with CPython (``pydoc_data.topics`` and the standard library's
docstrings), split by document: every `train_every`-th document is for training (MLM and fine-tuning), the
others are held out (MLM losses and accuracies), so no evaluation sentence is seen in training. Holding out
the larger part buys a held-out pair set big enough for a standard error under one point.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

__all__ = ["StudyData", "load_study_data", "split_documents", "TASK_DESCRIPTION"]

TASK_DESCRIPTION = {
    "next_sentence": "next-sentence prediction (next / unrelated) on CPython's English prose",
    "sentence_order": "sentence order (next / previous / unrelated) on CPython's English prose",
    "mnli": "MNLI",
}


@dataclass
class StudyData:
    model_path: str  # what from_pretrained loads
    model_id: str  # how reports name it (a Hub id, never a local path)
    tokenizer: Any
    windows: Any  # DatasetDict train / validation of n-token MLM windows
    pairs: Any  # DatasetDict train / validation of tokenized pairs (validation sorted by length)
    labels: tuple[str, ...]
    corpus: str
    sizes: dict
    pooler: dict  # the start model's pooler weights (fine-tuning heads start from them)


def split_documents(documents: list, train_every: int) -> tuple[list, list]:
    """(train, held-out): document i trains when ``i % train_every == 0``."""
    if train_every < 2:
        raise ValueError(f"train_every must be >= 2 (some documents held out), got {train_every}.")
    return ([d for i, d in enumerate(documents) if i % train_every == 0],
            [d for i, d in enumerate(documents) if i % train_every != 0])


def load_study_data(a) -> StudyData:
    from datasets import Dataset, DatasetDict
    from transformers import AutoTokenizer

    from hf_partial_attention.analysis.corpus import pydoc_paragraphs
    from hf_partial_attention.analysis.defaults import resolve_model
    from hf_partial_attention.training import (
        MlmDataArguments, MnliDataArguments, group_into_windows, load_mnli, load_text_datasets, tokenize_pairs,
    )
    from hf_partial_attention.training.pair_task import (
        NEXT_SENTENCE_LABELS, PAIR_LABELS, next_sentence_examples, sentence_order_examples, stdlib_docstring_documents,
    )

    path, hub_id = resolve_model(a.model_name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    prose = None
    if a.pretrain_dataset_name or a.pretrain_train_file:
        raw = load_text_datasets(MlmDataArguments(dataset_name=a.pretrain_dataset_name,
                                                  dataset_config_name=a.pretrain_dataset_config_name,
                                                  train_file=a.pretrain_train_file))
        corpus = a.pretrain_dataset_name or "local text files"
    else:
        prose = split_documents(pydoc_paragraphs() + stdlib_docstring_documents(), a.train_every)
        raw = DatasetDict({split: Dataset.from_dict({"text": [" ".join(d) for d in docs]})
                           for split, docs in zip(("train", "validation"), prose)})
        corpus = f"pydoc_data.topics + standard-library docstrings (CPython {sys.version.split()[0]})"
    windows = group_into_windows(raw, tokenizer, a.max_seq_length)
    held = windows["validation"]
    windows["validation"] = held.select(range(min(a.mlm_eval_windows, len(held))))
    if a.task == "mnli":
        pairs_raw = load_mnli(MnliDataArguments(dataset_name=a.finetune_dataset_name,
                                                dataset_config_name=a.finetune_dataset_config_name,
                                                train_file=a.finetune_train_file,
                                                validation_file=a.finetune_validation_file))
        pairs_raw = DatasetDict(train=pairs_raw["train"], validation=pairs_raw["validation_matched"])
        labels = ("entailment", "neutral", "contradiction")
    else:
        if prose is None:
            prose = split_documents(pydoc_paragraphs() + stdlib_docstring_documents(), a.train_every)
        make, labels = ((next_sentence_examples, NEXT_SENTENCE_LABELS) if a.task == "next_sentence" else
                        (sentence_order_examples, PAIR_LABELS))
        pairs_raw = DatasetDict(train=Dataset.from_list(make(prose[0], seed=a.seed, all_variants=True)),
                                validation=Dataset.from_list(make(prose[1], seed=a.seed + 1)))
    if a.max_finetune_eval:
        pairs_raw["validation"] = pairs_raw["validation"].select(range(min(a.max_finetune_eval,
                                                                           len(pairs_raw["validation"]))))
    pairs = tokenize_pairs(pairs_raw, tokenizer, a.max_seq_length, pad=False)
    lengths = [len(x) for x in pairs["validation"]["input_ids"]]
    pairs["validation"] = pairs["validation"].add_column("length", lengths).sort("length").remove_columns("length")
    sizes = {"mlm_windows": {k: len(v) for k, v in windows.items()}, "pairs": {k: len(v) for k, v in pairs.items()}}
    pooler = _start_pooler(path)
    return StudyData(path, hub_id or a.model_name_or_path, tokenizer, windows, pairs, labels, corpus, sizes, pooler)


def _start_pooler(path: str) -> dict:
    """The pooler of the start model (a freshly initialised one, logged, if its checkpoint has none)."""
    import logging

    from transformers import BertModel

    model, info = BertModel.from_pretrained(path, output_loading_info=True)
    if any(key.startswith("pooler.") for key in info["missing_keys"]):
        logging.getLogger(__name__).warning("%s has no pooler weights: fine-tuning starts from a new one.", path)
    return {k: v.clone() for k, v in model.pooler.state_dict().items()}
