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


def test_any_architecture_and_pattern_form(tmp_path):
    """A RoBERTa checkpoint with P and R per head and a k per layer (what `derive --granularity head --saving`
    writes) is converted as a PartialRoberta with that file's P and R in every head (R per layer, as `convert` makes
    it); the saved partial checkpoint loads back as is, and `--pattern` replaces its P and R."""
    from hf_partial_attention.pattern_layers import LayerPatterns
    from transformers import RobertaConfig, RobertaForMaskedLM

    torch.manual_seed(0)
    config = RobertaConfig(vocab_size=99, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                           intermediate_size=37, max_position_embeddings=64, pad_token_id=0)
    RobertaForMaskedLM(config).save_pretrained(tmp_path / "roberta")
    heads = {layer: [AttentionPattern.local(32, k, correlation=0.3 + 0.1 * h) for h in range(4)]
             for layer, k in ((0, 4), (1, 8))}
    LayerPatterns(heads).save(tmp_path / "heads.safetensors")
    built = build_model("sequence_classification", ModelArguments(model_name_or_path=str(tmp_path / "roberta"),
                                                                  pattern=str(tmp_path / "heads.safetensors")),
                        num_labels=3)
    model = built.model
    assert type(model).__name__ == "PartialRobertaForSequenceClassification" and model.config.num_labels == 3
    assert (model.config.partial_granularity, model.config.reconstruction) == ("head", "per_layer")
    assert model.config.partial_layers_k == [[4], [8]]
    for layer, patterns in heads.items():
        for head, pattern in enumerate(patterns):
            assert torch.equal(model.get_pattern(layer, head=head).indices, pattern.indices)
            assert torch.allclose(model.get_pattern(layer, head=head).reconstruction, pattern.reconstruction)
    model.save_pretrained(tmp_path / "partial")
    again = build_model("sequence_classification", ModelArguments(model_name_or_path=str(tmp_path / "partial")),
                        num_labels=3).model
    assert torch.equal(again.get_pattern(1, head=2).indices, heads[1][2].indices)
    # a RoBERTa checkpoint into PartialBert's head is impossible now: the table picks the class
    with pytest.raises(ValueError, match="--model_type 'bert' contradicts"):
        build_model("masked_lm", ModelArguments(model_name_or_path=str(tmp_path / "partial"), model_type="bert"))
    with pytest.raises(ValueError, match="exact needs a roberta checkpoint"):
        build_model("masked_lm", ModelArguments(model_name_or_path=str(tmp_path / "partial"), attention="exact"))
