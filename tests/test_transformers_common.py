"""transformers' own common model tests (`ModelTesterMixin`, from the sdist of the installed transformers, fetched by
``make test``: `fetch_transformers_tests.py`) on partial models of BERT, RoBERTa, ModernBERT, DistilBERT and ALBERT:
the layouts that differ (BERT's; RoBERTa's positions from padding; ModernBERT's RoPE with alternating local and
global layers, attention in the base model; DistilBERT's attention without ``layer_idx``; ALBERT's one attention
module for every layer).

Each model is partial (k = 3 of n = 8, the testers' sequence length) in layer 0 and exact elsewhere, built by its
config alone (the default P and R), as the mixin builds every model. The tester is transformers' model-tester shape
(batch 13, hidden 32, 2 layers, 4 heads, vocab 99), with token ids above the special tokens.

Tests the mixin runs that partial attention does not pass by design, skipped here with the reason:
  * ``test_model_weights_reload_no_missing_tied_weights`` loads a checkpoint with no tensors at all and expects
    every weight reported missing and initialised; a partial checkpoint without P and R is refused instead (never run
    with a default pattern: `test_checkpoints`, `test_encoders::test_a_checkpoint_without_p_is_refused`).
  * ``test_model_rope_scaling_from_config`` (ModernBERT) runs inputs of 1.5 x max_position_embeddings tokens; P and
    R are for at most n = ``partial_seq_len`` tokens, and longer inputs are refused.
The mixin itself skips what needs an accelerator, flash attention, the kernels library, deepspeed, tensor parallel
plans or generation, and SDPA dispatch (a partial layer's attention is its own `AttentionInterface` function).
"""

from __future__ import annotations

import sys
import unittest

from transformers.models.auto import modeling_auto

import hf_partial_attention  # noqa: F401  (registers the partial classes with the Auto classes)
from hf_partial_attention import partial_class_for
from hf_partial_attention.architectures import HEAD_SUFFIXES
from hf_partial_attention.configuration_partial_encoders import config_class_for

from fetch_transformers_tests import DEFAULT_DEST, PACKAGE

if not (DEFAULT_DEST / PACKAGE / "test_modeling_common.py").is_file():
    raise ImportError(f"transformers' common tests are missing from {DEFAULT_DEST}: run `make test` (or python "
                      "tests/fetch_transformers_tests.py), which downloads them from the sdist on PyPI.")
sys.path.insert(0, str(DEFAULT_DEST))
from transformers_tests.test_modeling_common import ModelTesterMixin, ids_tensor, random_attention_mask  # noqa: E402

MODEL_TYPES = ("bert", "roberta", "modernbert", "distilbert", "albert")
N, K = 8, 3
FIRST_ID = 6  # ids below are special tokens (pad 0, bos 1, eos 2, cls 3, sep 4, mask 5)

# The mixin picks labels and skips base models by the class names transformers lists per Auto class. An in-library
# model is listed there; the partial classes are registered with the Auto classes instead, so list them for the
# duration of this module (`setUpModule`, `tearDownModule`).
_NAME_MAPS = {
    "AutoModel": modeling_auto.MODEL_MAPPING_NAMES,
    "AutoModelForMaskedLM": modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    "AutoModelForSequenceClassification": modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
    "AutoModelForTokenClassification": modeling_auto.MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES,
    "AutoModelForQuestionAnswering": modeling_auto.MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES,
}


def model_classes(model_type: str) -> dict[str, type]:
    """Auto class name -> the partial class of ``model_type`` for it."""
    classes = {}
    for auto in HEAD_SUFFIXES:
        try:
            classes[auto] = partial_class_for(model_type, auto)
        except ValueError:  # the architecture has no such head
            pass
    return classes


def setUpModule():
    for model_type in MODEL_TYPES:
        for auto, cls in model_classes(model_type).items():
            _NAME_MAPS[auto][cls.config_class.model_type] = cls.__name__


def tearDownModule():
    for model_type in MODEL_TYPES:
        for auto, cls in model_classes(model_type).items():
            _NAME_MAPS[auto].pop(cls.config_class.model_type, None)


class PartialModelTester:
    """transformers' model-tester sizes for a partial ``model_type``; P of k = K for n = N in layer 0."""

    model_type = "bert"

    def __init__(self, parent, batch_size=13, seq_length=N, is_training=True, vocab_size=99, hidden_size=32,
                 num_hidden_layers=2, num_attention_heads=4, intermediate_size=37, num_labels=3,
                 type_sequence_label_size=2, num_choices=4):
        self.parent = parent
        self.batch_size, self.seq_length, self.is_training = batch_size, seq_length, is_training
        self.vocab_size, self.hidden_size, self.intermediate_size = vocab_size, hidden_size, intermediate_size
        self.num_hidden_layers, self.num_attention_heads = num_hidden_layers, num_attention_heads
        self.num_labels, self.type_sequence_label_size, self.num_choices = (num_labels, type_sequence_label_size,
                                                                            num_choices)

    def get_config(self):
        extra = {"partial_layers": [0]}
        if self.model_type == "modernbert":  # window 4 < n: layer 1 is local; layer 0 (global) is partial
            extra.update(local_attention=4, global_attn_every_n_layers=2, bos_token_id=1, eos_token_id=2,
                         cls_token_id=3, sep_token_id=4, mask_token_id=5)
        if self.model_type == "albert":  # one module serves both layers: both partial
            extra.update(embedding_size=16, partial_layers=[0, 1])
        return config_class_for(self.model_type)(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads, intermediate_size=self.intermediate_size,
            max_position_embeddings=64, pad_token_id=0, partial_seq_len=N, partial_k=K, **extra)

    def prepare_config_and_inputs_for_common(self):
        ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size - FIRST_ID) + FIRST_ID  # (B, n)
        mask = random_attention_mask([self.batch_size, self.seq_length])  # (B, n), padding included
        return self.get_config(), {"input_ids": ids, "attention_mask": mask}


def _skip(reason: str):
    def test(self):
        self.skipTest(reason)
    return test


_BY_DESIGN = {
    "test_model_weights_reload_no_missing_tied_weights":
        "a partial checkpoint without P and R is refused, not initialised (see the module docstring)",
    "test_model_rope_scaling_from_config":  # parameterized: _0_linear, _1_dynamic, _2_yarn
        "runs 1.5 x max_position_embeddings tokens; partial attention runs at most n = partial_seq_len tokens",
}


class _PartialCommonTests(ModelTesterMixin):
    model_type = "bert"

    def setUp(self):
        self.model_tester = type("Tester", (PartialModelTester,), {"model_type": self.model_type})(self)


for _name in dir(ModelTesterMixin):
    for _prefix, _reason in _BY_DESIGN.items():
        if _name.startswith(_prefix):
            setattr(_PartialCommonTests, _name, _skip(_reason))


# DistilBERT and ALBERT are here for their layouts (no layer_idx; one module for every layer): their base model and
# one head (the head's base is the source's class, which the initialisation must reach) keep `make test` short.
_CLASSES = {"distilbert": ("AutoModel", "AutoModelForMaskedLM"), "albert": ("AutoModel", "AutoModelForMaskedLM")}


def _case(model_type: str, name: str) -> type:
    classes = model_classes(model_type)
    classes = {auto: cls for auto, cls in classes.items() if auto in _CLASSES.get(model_type, classes)}
    namespace = {"model_type": model_type, "all_model_classes": tuple(classes.values())}
    return type(name, (_PartialCommonTests, unittest.TestCase), namespace)


CASES = [_case(model_type, f"TestPartial{name}Common") for model_type, name in
         (("bert", "Bert"), ("roberta", "Roberta"), ("modernbert", "ModernBert"), ("distilbert", "DistilBert"),
          ("albert", "Albert"))]
TestPartialBertCommon, TestPartialRobertaCommon, TestPartialModernBertCommon, TestPartialDistilBertCommon, \
    TestPartialAlbertCommon = CASES


def test_the_common_tests_run_partial_attention():
    """What the cases above build is partial: k < n in layer 0 of every class (a tester that quietly built exact
    models, or source classes, would pass the mixin without testing partial attention)."""
    from hf_partial_attention.partial_layer import is_partial

    for case in CASES:
        tester = type("Tester", (PartialModelTester,), {"model_type": case.model_type})(None)
        config = tester.get_config()
        assert config.partial_k < config.partial_seq_len == tester.seq_length
        for cls in case.all_model_classes:
            model = cls(config)
            assert is_partial(model._partial_attention(0)), (cls.__name__, "layer 0 is not partial")
