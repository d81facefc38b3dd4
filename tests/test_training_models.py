"""build_model: the model a training script gets from ModelArguments."""

import pytest
import torch
from transformers import BertConfig, BertForMaskedLM, BertForSequenceClassification

from hf_partial_attention import AttentionPattern, PartialBertForMaskedLM, PartialBertForSequenceClassification
from hf_partial_attention.training import ModelArguments, PartialAttentionTrainingArguments, build_model

TINY = "hidden_size=32,num_hidden_layers=3,num_attention_heads=4,intermediate_size=37,max_position_embeddings=64"


@pytest.fixture
def pattern_file(tmp_path):
    pattern = AttentionPattern.local(32, 8, correlation=0.5)
    path = tmp_path / "p.safetensors"
    pattern.save(path)
    return str(path), pattern


@pytest.fixture
def bert_dir(tmp_path):
    torch.manual_seed(0)
    config = BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                        intermediate_size=37, max_position_embeddings=64)
    BertForMaskedLM(config).save_pretrained(tmp_path / "bert")
    return str(tmp_path / "bert")


def test_from_scratch_with_pattern(pattern_file):
    path, pattern = pattern_file
    built = build_model("masked_lm", ModelArguments(config_overrides=TINY + ",vocab_size=99", pattern=path,
                                                    reconstruction="per_layer"))
    model = built.model
    assert isinstance(model, PartialBertForMaskedLM) and built.base_model is None
    assert (model.config.partial_seq_len, model.config.partial_k, model.config.partial_layers) == (32, 8, [0, 1])
    assert torch.equal(model.bert.encoder.partial_pattern.indices, pattern.indices)
    for r in model.reconstruction_tensors().values():
        assert torch.equal(r.detach(), pattern.reconstruction)
    assert "p.safetensors" in built.pattern_source


def test_bert_checkpoint_is_converted_keeping_weights(bert_dir, pattern_file):
    path, pattern = pattern_file
    built = build_model("sequence_classification", ModelArguments(model_name_or_path=bert_dir, pattern=path,
                                                                  partial_layers="0"), num_labels=3)
    model = built.model
    bert = BertForMaskedLM.from_pretrained(bert_dir)
    assert isinstance(model, PartialBertForSequenceClassification) and model.config.num_labels == 3
    assert model.config.partial_layers == [0] and model.config.reconstruction == "common"
    assert torch.equal(model.bert.embeddings.word_embeddings.weight, bert.bert.embeddings.word_embeddings.weight)
    assert torch.equal(model.bert.encoder.layer[0].attention.self.query.weight,
                       bert.bert.encoder.layer[0].attention.self.query.weight)
    assert built.base_model == bert_dir


def test_partial_checkpoint_keeps_its_p_and_r(tmp_path, pattern_file):
    path, pattern = pattern_file
    mlm = build_model("masked_lm", ModelArguments(config_overrides=TINY + ",vocab_size=99", pattern=path,
                                                  reconstruction="per_layer")).model
    with torch.no_grad():
        mlm.bert.encoder.layer[1].attention.self.reconstruction.add_(0.5)  # "trained"
    mlm.save_pretrained(tmp_path / "mlm")
    built = build_model("sequence_classification", ModelArguments(model_name_or_path=str(tmp_path / "mlm")),
                        num_labels=3)
    for name, r in mlm.reconstruction_tensors().items():
        assert torch.equal(built.model.reconstruction_tensors()[name], r)
    with pytest.raises(ValueError, match="trained with reconstruction='per_layer'"):
        build_model("masked_lm", ModelArguments(model_name_or_path=str(tmp_path / "mlm"), reconstruction="common"))


def test_exact_baseline(bert_dir):
    built = build_model("sequence_classification", ModelArguments(model_name_or_path=bert_dir, attention="exact"),
                        num_labels=3)
    assert type(built.model) is BertForSequenceClassification and built.model.config.num_labels == 3
    with pytest.raises(ValueError, match="attention exact"):
        ModelArguments(attention="exact", reconstruction="common")


def test_default_pattern_and_length_checks(pattern_file):
    path, _ = pattern_file
    built = build_model("masked_lm", ModelArguments(config_overrides=TINY + ",vocab_size=99", partial_k=4),
                        max_seq_length=16)
    assert (built.model.config.partial_seq_len, built.model.config.partial_k) == (16, 4)
    assert "local default pattern" in built.pattern_source
    with pytest.raises(ValueError, match="max_seq_length"):
        build_model("masked_lm", ModelArguments(config_overrides=TINY, pattern=path), max_seq_length=64)
    with pytest.raises(ValueError, match="head must be one of"):
        build_model("causal_lm", ModelArguments())
    with pytest.raises(ValueError, match="partial_layers"):
        ModelArguments(partial_layers="0,x").partial_layer_list()


def test_training_arguments_validate_r_fields(tmp_path):
    with pytest.raises(ValueError, match="reconstruction_learning_rate"):
        PartialAttentionTrainingArguments(str(tmp_path), reconstruction_learning_rate=-1.0, use_cpu=True)
    with pytest.raises(ValueError, match="reconstruction_weight_decay"):
        PartialAttentionTrainingArguments(str(tmp_path), reconstruction_weight_decay=-0.1, use_cpu=True)
