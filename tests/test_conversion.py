"""from_bert: head settings and loading arguments reach the source load, the report of what it did not provide,
dtype kept; output_attentions gives one map per layer under sdpa."""

import pytest
import torch
from transformers import BertConfig, BertForSequenceClassification, BertForTokenClassification, BertModel

from hf_partial_attention import (
    AttentionPattern,
    PartialBertConfig,
    PartialBertForSequenceClassification,
    PartialBertForTokenClassification,
    PartialBertModel,
)

BERT = dict(vocab_size=99, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=37,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


@pytest.mark.parametrize("bert_cls, partial_cls",
                         [(BertForSequenceClassification, PartialBertForSequenceClassification),
                          (BertForTokenClassification, PartialBertForTokenClassification)])
def test_from_bert_path_with_three_labels(tmp_path, bert_cls, partial_cls):
    torch.manual_seed(0)
    BertModel(BertConfig(**BERT)).save_pretrained(tmp_path)  # a body-only checkpoint, as most Hub BERTs
    model, info = partial_cls.from_bert(str(tmp_path), AttentionPattern.local(16, 4), num_labels=3,
                                        id2label={0: "entailment", 1: "neutral", 2: "contradiction"},
                                        output_loading_info=True)
    assert model.config.num_labels == 3 and model.classifier.out_features == 3
    assert model.config.id2label[2] == "contradiction"
    assert info["missing_keys"] == ["classifier.bias", "classifier.weight"]  # the new head, reported
    assert set(info["source"]["missing_keys"]) == {"classifier.bias", "classifier.weight"}
    assert model.config.partial_base_model == str(tmp_path)


def test_from_bert_keeps_the_source_dtype(tmp_path):
    torch.manual_seed(0)
    BertModel(BertConfig(**BERT)).save_pretrained(tmp_path)
    model = PartialBertModel.from_bert(str(tmp_path), AttentionPattern.local(16, 4), dtype=torch.bfloat16)
    assert model.embeddings.word_embeddings.weight.dtype == torch.bfloat16
    assert model.encoder.partial_pattern.reconstruction.dtype == torch.bfloat16
    assert model.encoder.partial_pattern.indices.dtype == torch.int64


def test_from_bert_refuses_settings_an_instance_cannot_take():
    bert = BertForSequenceClassification(BertConfig(**BERT))  # two labels
    with pytest.raises(ValueError, match="num_labels.*pass the path or Hub id"):
        PartialBertForSequenceClassification.from_bert(bert, AttentionPattern.local(16, 4), num_labels=3)
    with pytest.raises(ValueError, match="revision"):
        PartialBertForSequenceClassification.from_bert(bert, AttentionPattern.local(16, 4), revision="main")


def test_output_attentions_has_one_map_per_layer_under_sdpa():
    torch.manual_seed(0)
    model = PartialBertModel(PartialBertConfig(**BERT, partial_seq_len=16, partial_k=4)).eval()
    ids = torch.randint(1, 99, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    with torch.no_grad():
        model.set_attn_implementation("eager")
        eager = model(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
        model.set_attn_implementation("sdpa")
        sdpa = model(input_ids=ids, attention_mask=mask, output_attentions=True)
    assert model.config._attn_implementation == "sdpa"  # the setting is restored after the call
    assert len(sdpa.attentions) == 3
    for layer, (a, b) in enumerate(zip(sdpa.attentions, eager)):
        torch.testing.assert_close(a, b, msg=f"layer {layer}")
    assert float(sdpa.attentions[1][1, :, :, 8:].abs().max()) == 0.0  # padded keys get no probability


def test_weights_the_source_provides_are_not_initialised_first_and_a_new_head_is(monkeypatch):
    """A conversion builds the model without the random initialisation the source's copy overwrites (a third of its
    time); a head the source lacks (a BertModel instance into a classifier) is initialised as a plain construction
    with the same seed initialises it, not left as uninitialised memory."""
    pattern = AttentionPattern.local(16, 4)
    bert = BertModel(BertConfig(**BERT)).eval()
    inits = []
    real_init = PartialBertModel._init_weights
    monkeypatch.setattr(PartialBertModel, "_init_weights", lambda self, m: inits.append(m) or real_init(self, m))
    model = PartialBertModel.from_bert(bert, pattern)
    assert inits == []  # nothing initialised: every weight came from the source
    for name, value in bert.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name

    torch.manual_seed(3)
    converted, info = PartialBertForSequenceClassification.from_bert(bert, pattern, output_loading_info=True)
    assert info["missing_keys"] == ["classifier.bias", "classifier.weight"]
    torch.manual_seed(3)
    built = PartialBertForSequenceClassification(converted.config, pattern=pattern)
    assert torch.equal(converted.classifier.weight, built.classifier.weight)
    assert torch.equal(converted.classifier.bias, built.classifier.bias) and converted.classifier.weight.abs().sum() > 0
