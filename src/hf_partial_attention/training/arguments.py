"""Argument dataclasses for `PartialAttentionTrainer` and the example scripts (`HfArgumentParser`-ready).

Names follow transformers' ``run_mlm.py`` / ``run_glue.py`` (``--model_name_or_path``, ``--config_name``,
``--tokenizer_name``, ``--dataset_name``, ``--dataset_config_name``, ``--train_file``, ``--validation_file``,
``--max_seq_length``, ...), plus ``--pattern`` and ``--reconstruction`` for the partial attention.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import TrainingArguments

from ..configuration_partial_bert import RECONSTRUCTION_MODES
from .data import MLM_INPUTS
from .recovery import ATTENTION_TRANSFER_PARAMETERS, parse_recovery_objective

__all__ = ["PartialAttentionTrainingArguments", "ModelArguments", "MlmDataArguments", "MnliDataArguments"]

ATTENTION_KINDS = ("partial", "exact")


@dataclass
class PartialAttentionTrainingArguments(TrainingArguments):
    """`TrainingArguments` plus the optimisation of the reconstruction R.

    R's parameters (names containing ``reconstruction``; only in ``common`` and ``per_layer`` models) get their
    own optimizer group with `reconstruction_learning_rate` and `reconstruction_weight_decay`; the learning-rate
    schedule scales that group like the others.
    """

    reconstruction_learning_rate: float | None = field(
        default=None, metadata={"help": "Peak learning rate of R (and its bias). Defaults to --learning_rate."}
    )
    reconstruction_weight_decay: float = field(
        default=0.0, metadata={"help": "AdamW weight decay of R (decay pulls R towards zero, not to its init)."}
    )
    log_reconstruction_stats: bool = field(
        default=True,
        metadata={"help": "Log R's relative drift ||R - R0|| / ||R0|| from its value at the start of training."},
    )
    group_by_length: bool = field(
        default=False,
        metadata={"help": "Batch examples of similar length together (less padding): shorthand for "
                          "--train_sampling_strategy group_by_length, transformers 4's flag (transformers 5 has only "
                          "the strategy). Lengths come from --length_column_name if the dataset has it, else from "
                          "the input ids."},
    )
    recovery_objective: str = field(
        default="mlm",
        metadata={"help": "What training minimises, comma-separated terms summed with --recovery_weights: mlm (the "
                          "model's own loss), attention_transfer (each partial layer's attention output on the exact "
                          "teacher's input to that layer, MSE), distill_kl, distill_hidden, distill (both), embedding "
                          "(mean-pooled normalised embedding, squared distance). Every term but mlm needs the exact "
                          "teacher (PartialAttentionTrainer's teacher_model, default the model's exact twin)."},
    )
    recovery_weights: str | None = field(
        default=None, metadata={"help": "Comma-separated weights, one per term of --recovery_objective (default 1)."}
    )
    attention_transfer_parameters: str | None = field(
        default=None,
        metadata={"help": "What trains when the objective is attention_transfer alone: reconstruction (R and bias), "
                          "query_key (also the partial layers' query and key weights) or as_given (the caller's "
                          "choice, e.g. LoRA adapters). Default reconstruction; with other terms, as_given.",
                  "choices": ATTENTION_TRANSFER_PARAMETERS},
    )
    distill_temperature: float = field(default=1.0, metadata={"help": "Temperature of the distill_kl term."})
    mlm_logits_at_masked_only: bool = field(
        default=False,
        metadata={"help": "MLM models (any architecture's MLM head): compute vocabulary logits only at the "
                          "labelled positions (same loss and gradients; less work when the vocabulary is large)."},
    )

    def __post_init__(self):
        if self.group_by_length:
            if self.train_sampling_strategy not in ("random", "group_by_length"):
                raise ValueError(f"group_by_length=True asks for train_sampling_strategy='group_by_length', but "
                                 f"train_sampling_strategy={self.train_sampling_strategy!r} was given; drop one.")
            self.train_sampling_strategy = "group_by_length"
        super().__post_init__()
        lr = self.reconstruction_learning_rate
        if lr is not None and lr < 0:
            raise ValueError(f"reconstruction_learning_rate must be >= 0 or None, got {lr}.")
        if self.reconstruction_weight_decay < 0:
            raise ValueError(f"reconstruction_weight_decay must be >= 0, got {self.reconstruction_weight_decay}.")
        parse_recovery_objective(self.recovery_objective, self.recovery_weights)  # a ValueError naming the term
        if (self.attention_transfer_parameters is not None
                and self.attention_transfer_parameters not in ATTENTION_TRANSFER_PARAMETERS):
            raise ValueError(f"attention_transfer_parameters must be one of {ATTENTION_TRANSFER_PARAMETERS}, got "
                             f"{self.attention_transfer_parameters!r}.")
        if self.distill_temperature <= 0:
            raise ValueError(f"distill_temperature must be > 0, got {self.distill_temperature}.")


@dataclass
class ModelArguments:
    """Which model to train: a checkpoint (of a supported encoder, or partial) or a config to train from scratch."""

    model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "A checkpoint (path or Hub id) of a supported encoder (BERT, RoBERTa, ModernBERT, ...: "
                          "converted, weights kept) or a partial one (loaded with its P and R). "
                          "Leave unset to train from scratch."},
    )
    config_name: str | None = field(
        default=None, metadata={"help": "Config (path or Hub id) if not the one of model_name_or_path."}
    )
    model_type: str | None = field(
        default=None,
        metadata={"help": "The architecture of a model trained from scratch without --config_name (bert, roberta, "
                          "modernbert, distilbert, ...; default bert), with --config_overrides."},
    )
    config_overrides: str | None = field(
        default=None,
        metadata={"help": "Comma-separated config fields for a model trained from scratch, e.g. "
                          "'hidden_size=128,num_hidden_layers=4,num_attention_heads=4,intermediate_size=512'."},
    )
    tokenizer_name: str | None = field(
        default=None, metadata={"help": "Tokenizer (path or Hub id) if not the one of model_name_or_path."}
    )
    cache_dir: str | None = field(default=None, metadata={"help": "Where Hub downloads are stored."})
    model_revision: str = field(default="main", metadata={"help": "Branch, tag or commit of the checkpoint."})
    token: str | None = field(default=None, metadata={"help": "Hub token for private checkpoints or datasets."})
    trust_remote_code: bool = field(default=False, metadata={"help": "Allow custom code from the Hub."})
    attention: str = field(
        default="partial",
        metadata={"help": "'partial' (partial attention) or 'exact' (the architecture's own class, the baseline).",
                  "choices": ATTENTION_KINDS},
    )
    pattern: str | None = field(
        default=None,
        metadata={"help": "An AttentionPattern file (P and initial R). Without it: the checkpoint's own P and R, "
                          "or the local default pattern (k nearest keys) for source checkpoints and new models. Any "
                          "file `derive` writes: one pattern, length buckets, P and R per layer or head."},
    )
    reconstruction: str | None = field(
        default=None,
        metadata={"help": "How R is trained: fixed, common or per_layer. Defaults to the checkpoint's mode, "
                          "else 'common'.", "choices": RECONSTRUCTION_MODES},
    )
    partial_k: int | None = field(
        default=None, metadata={"help": "k for the default pattern when no --pattern is given (default 32)."}
    )
    partial_layers: str | None = field(
        default=None, metadata={"help": "Comma-separated partial layers, e.g. '0,1,2'. Default: all but the last."}
    )

    def __post_init__(self):
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(f"attention must be one of {ATTENTION_KINDS}, got {self.attention!r}.")
        if self.reconstruction is not None and self.reconstruction not in RECONSTRUCTION_MODES:
            raise ValueError(f"reconstruction must be one of {RECONSTRUCTION_MODES}, got {self.reconstruction!r}.")
        if self.attention == "exact" and (self.pattern or self.reconstruction or self.partial_k):
            raise ValueError("--attention exact trains the architecture's own exact class: drop --pattern, "
                             "--reconstruction and --partial_k.")

    def partial_layer_list(self) -> list[int] | None:
        """`partial_layers` parsed to a list of ints (None: the config's default)."""
        if self.partial_layers is None or self.partial_layers.strip() == "":
            return None
        try:
            return [int(x) for x in self.partial_layers.split(",") if x.strip()]
        except ValueError as err:
            raise ValueError(f"partial_layers must be comma-separated integers, got {self.partial_layers!r}.") from err


@dataclass
class _CommonDataArguments:
    dataset_name: str | None = field(default=None, metadata={"help": "A `datasets` Hub dataset name."})
    dataset_config_name: str | None = field(default=None, metadata={"help": "Its configuration name."})
    train_file: str | None = field(default=None, metadata={"help": "Local training file (.txt, .json/.jsonl, .csv)."})
    validation_file: str | None = field(default=None, metadata={"help": "Local validation file, same format."})
    max_seq_length: int | None = field(
        default=None,
        metadata={"help": "Tokens per example (the pattern's n). Defaults to the pattern's n, else 128. "
                          "Must not exceed the model's partial_seq_len."},
    )
    pad_to_multiple_of: int | None = field(
        default=None,
        metadata={"help": "Pad each batch's length up to a multiple of this (e.g. 8 on GPUs) instead of exactly to "
                          "its longest example; examples are never padded beyond what their batch needs."},
    )
    max_train_samples: int | None = field(default=None, metadata={"help": "Truncate the training set (debugging)."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Truncate each evaluation set (debugging)."})
    preprocessing_num_workers: int | None = field(default=None, metadata={"help": "Processes for `Dataset.map`."})
    overwrite_cache: bool = field(default=False, metadata={"help": "Recompute cached preprocessing."})

    def _check_sources(self) -> None:
        if self.dataset_name is None and self.train_file is None:
            raise ValueError("Give a dataset: --dataset_name (Hub) or --train_file (local).")
        if self.max_seq_length is not None and self.max_seq_length < 3:
            raise ValueError("max_seq_length must be >= 3 (room for [CLS], [SEP] and a token), "
                             f"got {self.max_seq_length}.")
        if self.pad_to_multiple_of is not None and self.pad_to_multiple_of < 1:
            raise ValueError(f"pad_to_multiple_of must be a positive integer, got {self.pad_to_multiple_of}; "
                             "leave it unset to pad to the longest example of each batch.")


@dataclass
class MlmDataArguments(_CommonDataArguments):
    """Data for masked-language-model pretraining: any text dataset, as n-token windows or at its own lengths."""

    mlm_inputs: str = field(
        default="windows",
        metadata={"help": "'windows': the token stream cut into windows of exactly n tokens (the paper's setup); "
                          "'lines' / 'sentences': one example per row of the text column / per sentence, at its "
                          "own length (at most n), padded per batch.", "choices": MLM_INPUTS},
    )
    text_column_name: str | None = field(default=None, metadata={"help": "Text column (default 'text' or the first)."})
    validation_split_percentage: int = field(
        default=5, metadata={"help": "Percent of train used for validation when there is no validation split."}
    )
    mlm_probability: float = field(default=0.15, metadata={"help": "Fraction of tokens masked for the MLM loss."})

    def __post_init__(self):
        self._check_sources()
        if self.mlm_inputs not in MLM_INPUTS:
            raise ValueError(f"mlm_inputs must be one of {MLM_INPUTS}, got {self.mlm_inputs!r}.")
        if not 0.0 < self.mlm_probability < 1.0:
            raise ValueError(f"mlm_probability must be in (0, 1), got {self.mlm_probability}.")
        if not 0 <= self.validation_split_percentage < 100:
            raise ValueError("validation_split_percentage must be in [0, 100), "
                             f"got {self.validation_split_percentage}.")


@dataclass
class MnliDataArguments(_CommonDataArguments):
    """Data for MNLI-style sentence-pair classification (premise, hypothesis, label)."""

    dataset_name: str | None = field(default="nyu-mll/glue",
                                     metadata={"help": "Hub dataset (ignored with --train_file)."})
    dataset_config_name: str | None = field(default="mnli", metadata={"help": "Its configuration name."})
    validation_mismatched_file: str | None = field(
        default=None, metadata={"help": "Local mismatched validation file (JSON lines: premise, hypothesis, label)."}
    )
    pad_to_max_length: bool = field(
        default=False,
        metadata={"help": "Pad every pair to n (max_seq_length). False: each pair keeps its own length and each "
                          "batch is padded to its longest pair (less compute; partial attention runs inputs shorter "
                          "than n). Name as in run_glue.py."},
    )

    def __post_init__(self):
        self._check_sources()
