"""Training with partial attention built in: `PartialAttentionTrainer`, its arguments, data and model builders.

Needs the ``train`` extra (``accelerate``, ``datasets``, ``evaluate``). The example scripts in ``examples/``
(``pretrain_mlm.py``, ``finetune_mnli.py``) and the repository's Table-1 study (``experiments/table1.py``) are thin
layers over this package.
"""

from __future__ import annotations

from .arguments import MlmDataArguments, MnliDataArguments, ModelArguments, PartialAttentionTrainingArguments
from .data import (
    MLM_INPUTS,
    MNLI_LABELS,
    MlmCollator,
    examples_at_own_length,
    group_into_windows,
    load_mnli,
    load_text_datasets,
    tokenize_pairs,
)
from .metrics import classification_metrics, load_metric
from .models import HEADS, BuiltModel, build_model
from .sampling import EpochLengthGroupedSampler, example_lengths
from .trainer import RECONSTRUCTION_INITIAL_NAME, PartialAttentionTrainer, is_reconstruction_parameter

__all__ = [
    "PartialAttentionTrainer",
    "PartialAttentionTrainingArguments",
    "ModelArguments",
    "MlmDataArguments",
    "MnliDataArguments",
    "MlmCollator",
    "MNLI_LABELS",
    "load_text_datasets",
    "group_into_windows",
    "MLM_INPUTS",
    "examples_at_own_length",
    "EpochLengthGroupedSampler",
    "example_lengths",
    "load_mnli",
    "tokenize_pairs",
    "load_metric",
    "classification_metrics",
    "HEADS",
    "BuiltModel",
    "build_model",
    "RECONSTRUCTION_INITIAL_NAME",
    "is_reconstruction_parameter",
]
