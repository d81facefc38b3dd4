"""Model cards: written by save_pretrained, loadable with ModelCard.load, metadata valid, content complete."""

import glob
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from huggingface_hub import ModelCard, constants
from transformers import BertConfig, BertForSequenceClassification

from hf_partial_attention import PartialBertConfig, PartialBertForMaskedLM, PartialBertForSequenceClassification
from hf_partial_attention.model_card import attention_cost, build_model_card, validate_card_metadata

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = dict(vocab_size=99, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=37,
            max_position_embeddings=64, partial_seq_len=32, partial_k=8)
EVALS = [{"task_type": "text-classification", "dataset_type": "nyu-mll/glue", "dataset_name": "MNLI",
          "dataset_config": "mnli", "dataset_split": "validation_matched", "metric_type": "accuracy",
          "metric_value": 0.8123}]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return PartialBertForMaskedLM(PartialBertConfig(**TINY, reconstruction="per_layer"))


def test_cost_formula_matches_method_notes():
    assert attention_cost(128, 32, 64)["saving"] == pytest.approx(0.375)
    assert attention_cost(128, 24, 64)["saving"] == pytest.approx(1 - (24 * 64 + 104 * 24) / (128 * 64))
    assert round(100 * attention_cost(128, 24, 64)["saving"], 1) == 50.8
    assert attention_cost(128, 128, 64)["saving"] == 0.0
    with pytest.raises(ValueError, match="1 <= k <= n"):
        attention_cost(16, 32, 64)


def test_save_pretrained_writes_a_valid_card(model, tmp_path):
    model.save_pretrained(tmp_path)
    card = ModelCard.load(tmp_path / "README.md")
    validate_card_metadata(card)
    meta = card.data.to_dict()
    assert meta["library_name"] == "transformers" and meta["pipeline_tag"] == "fill-mask"
    assert {"partial-attention", "bert", "custom_code"} <= set(meta["tags"])
    text = card.text
    saving = attention_cost(32, 8, 16)["saving"]
    assert saving == pytest.approx(0.375)
    for needle in ("**k = 8**", "n = 32", "bert.encoder.partial_pattern.indices", "(n, n − k, k) = (32, 24, 8)",
                   "saving = 1 − (k·d_h + (n − k)·k) / (n·d_h)", f"{100 * saving:.1f} %", "layers [0, 1] (of 3",
                   "per layer", "AutoModelForMaskedLM", "trust_remote_code=True", "## Where the pattern came from"):
        assert needle in text, needle


def test_existing_readme_is_kept_unless_asked(model, tmp_path):
    (tmp_path / "README.md").write_text("my own notes\n")
    model.save_pretrained(tmp_path)
    assert (tmp_path / "README.md").read_text() == "my own notes\n"
    model.save_pretrained(tmp_path, write_model_card=True)
    assert "partial attention" in (tmp_path / "README.md").read_text()
    other = tmp_path / "other"
    model.save_pretrained(other, write_model_card=False)
    assert not (other / "README.md").exists()
    model.save_pretrained(tmp_path / "rank1", is_main_process=False)
    assert not (tmp_path / "rank1" / "README.md").exists()


def test_card_with_results_round_trips(tmp_path):
    torch.manual_seed(0)
    clf = PartialBertForSequenceClassification(PartialBertConfig(**TINY, reconstruction="common", num_labels=3))
    card = build_model_card(clf, model_name="partial-bert-mnli", base_model="google-bert/bert-base-uncased",
                            datasets=["nyu-mll/glue"], pattern_source="greedy P from a covariance", eval_results=EVALS,
                            training_details="Trained briefly.")
    card.save(tmp_path / "README.md")
    loaded = ModelCard.load(tmp_path / "README.md")
    validate_card_metadata(loaded)
    assert loaded.data.base_model == "google-bert/bert-base-uncased" and loaded.data.datasets == ["nyu-mll/glue"]
    assert loaded.data.metrics == ["accuracy"] and loaded.data.pipeline_tag == "text-classification"
    result = loaded.data.eval_results[0]
    assert (result.metric_value, result.dataset_split, result.task_type) == (0.8123, "validation_matched",
                                                                            "text-classification")
    assert "| text-classification | MNLI (mnli) | validation_matched | accuracy | 0.8123 |" in loaded.text
    assert "greedy P from a covariance" in loaded.text and "one trainable tensor" in loaded.text


def test_local_base_model_stays_out_of_metadata(model, tmp_path):
    card = build_model_card(model, base_model=str(tmp_path))
    assert card.data.base_model is None and str(tmp_path) in card.text


def test_exact_baseline_card():
    torch.manual_seed(0)
    bert = BertForSequenceClassification(BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2,
                                                    num_attention_heads=4, intermediate_size=37))
    card = build_model_card(bert, model_name="baseline")
    validate_card_metadata(card)
    assert "exact-attention BERT" in card.text and "partial-attention-baseline" in card.data.tags


def test_invalid_metadata_is_reported(model):
    card = build_model_card(model)
    card.data.tags = "partial-attention"
    with pytest.raises(ValueError, match="tags"):
        validate_card_metadata(card)
    bad = ModelCard("---\nlibrary_name: transformers\ntags: [a]\n---\nbody")
    with pytest.raises(ValueError, match="pipeline_tag"):
        validate_card_metadata(bad)


@pytest.mark.skipif(constants.HF_HUB_OFFLINE, reason="ModelCard.validate needs the Hub")
def test_card_validates_on_the_hub(model):
    build_model_card(model, eval_results=EVALS, model_name="m").validate()


def test_card_is_written_by_remote_code_without_the_plugin(model, tmp_path):
    model.save_pretrained(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "model_card.py").is_file()
    script = textwrap.dedent(f"""
        import os, sys
        from transformers import AutoModelForMaskedLM
        model = AutoModelForMaskedLM.from_pretrained({str(tmp_path / 'ckpt')!r}, trust_remote_code=True)
        assert "hf_partial_attention" not in sys.modules, "the plugin was imported"
        model.save_pretrained({str(tmp_path / 'again')!r})
        print(open(os.path.join({str(tmp_path / 'again')!r}, "README.md")).read()[:2000])
    """)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "library_name: transformers" in out.stdout


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "model_cards", "*", "README.md"))))
def test_committed_cards_load_and_validate(path):
    card = ModelCard.load(path)
    validate_card_metadata(card)
    assert "## How to load" in card.text


def test_base_model_card_is_feature_extraction():
    from hf_partial_attention import PartialBertModel

    torch.manual_seed(0)
    card = build_model_card(PartialBertModel(PartialBertConfig(**TINY)))
    validate_card_metadata(card)
    assert card.data.pipeline_tag == "feature-extraction" and "AutoModel.from_pretrained" in card.text
