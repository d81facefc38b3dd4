"""Model cards: written by save_pretrained, loadable with ModelCard.load, metadata valid, content complete."""

import glob
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from huggingface_hub import ModelCard
from transformers import BertConfig, BertForSequenceClassification

from hf_partial_attention import PartialBertConfig, PartialBertForMaskedLM, PartialBertForSequenceClassification
from hf_partial_attention.model_card import build_model_card, validate_card_metadata

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


def test_save_pretrained_writes_a_valid_card(model, tmp_path):
    model.save_pretrained(tmp_path)
    card = ModelCard.load(tmp_path / "README.md")
    validate_card_metadata(card)
    meta = card.data.to_dict()
    assert meta["pipeline_tag"] == "fill-mask"
    assert {"partial-attention", "attention-reconstruction", "custom_code"} <= set(meta["tags"])  # ours, not generic
    text = card.text
    # n = 32, k = 8, d_h = 64 / 4 = 16: per query 8·16 + 24·8 = 320 multiply-adds instead of 32·16 = 512,
    # a saving of 1 − 320/512 = 37.5 % in each of the 2 partial layers, 25.0 % over the 3 layers.
    for needle in ("**k = 8**", "n = 32", "bert.encoder.partial_pattern.indices", "(n, n − k, k) = (32, 24, 8)",
                   "saving = 1 − (k·d_h + (n − k)·k) / (n·d_h)", "320 instead of 512", "**37.5 %**", "25.0 % of",
                   "layers [0, 1] (of 3; the last layer stays exact", "per layer", "AutoModelForMaskedLM",
                   "trust_remote_code=True", "## Where the pattern came from"):
        assert needle in text, needle


@pytest.mark.parametrize("layers, phrase, model_saving", [
    ([0], "layers [0] (of 3; layers [1, 2] stay exact; the paper keeps only the last layer exact)", "12.5 %"),
    ([0, 1, 2], "layers [0, 1, 2] (of 3; every layer is partial; the paper keeps the last layer exact)", "37.5 %"),
])
def test_card_states_which_layers_are_exact(layers, phrase, model_saving):
    torch.manual_seed(0)
    text = build_model_card(PartialBertForMaskedLM(PartialBertConfig(**TINY, partial_layers=layers))).text
    assert phrase in text
    assert f"{model_saving} of\nthe model's QKᵀ" in text  # of the 3 layers' QKᵀ: 37.5 % × len(layers) / 3
    assert "the last layer stays exact" not in text


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
    assert card.data.base_model is None
    # named by its folder, never by a path of the machine that wrote the card
    assert f"the local checkpoint `{tmp_path.name}`" in card.text and str(tmp_path) not in card.text


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


@pytest.mark.slow
def test_remote_code_saves_without_the_plugin_or_its_card_module(model, tmp_path):
    model.save_pretrained(tmp_path / "ckpt")
    assert not (tmp_path / "ckpt" / "model_card.py").exists()  # the card is the plugin's job, not the bundle's
    script = textwrap.dedent(f"""
        import os, sys
        from transformers import AutoModelForMaskedLM
        model = AutoModelForMaskedLM.from_pretrained({str(tmp_path / 'ckpt')!r}, trust_remote_code=True)
        assert "hf_partial_attention" not in sys.modules, "the plugin was imported"
        model.save_pretrained({str(tmp_path / 'again')!r})
        print("README" if os.path.exists(os.path.join({str(tmp_path / 'again')!r}, "README.md")) else "NO-README")
        print(sorted(f for f in os.listdir({str(tmp_path / 'again')!r}) if f.endswith(".py")))
    """)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "NO-README" in out.stdout
    assert "'modeling_partial_bert.py'" in out.stdout and "model_card" not in out.stdout


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


def test_card_of_a_bucketed_model_lists_its_buckets():
    """partial_lengths [4, 8, 16, 32], k = 8, d_h = 64 / 4 = 16: 4 and 8 (b <= k) run exactly; bucket 16 saves
    1 − (8·16 + 8·8) / (16·16) = 25.0 %, n = 32 saves 1 − (8·16 + 24·8) / (32·16) = 37.5 %."""
    torch.manual_seed(0)
    model = PartialBertForMaskedLM(PartialBertConfig(**TINY, partial_lengths=[4, 8, 16, 32], reconstruction="common"))
    text = build_model_card(model).text
    lines = text.splitlines()
    assert "- **Length buckets** [4, 8, 16, 32]: each bucket b holds its own P (b, k_b) and R (b, b − k_b, k_b), " \
           "fitted on" in lines
    assert ("if padded to b. Buckets with k_b = b run exact attention. Saving of QKᵀ per query and head in each "
            "bucket:") in text
    header = lines.index("| bucket b | k_b | P and R | saving |")
    assert lines[header + 2:header + 6] == ["| 4 | 4 | exact (k = b) | 0.0 % |", "| 8 | 8 | exact (k = b) | 0.0 % |",
                                            "| 16 | 8 | P `bert.encoder.partial_pattern_len16.indices`; R "
                                            "`bert.encoder.partial_pattern_len16.reconstruction` | 25.0 % |",
                                            "| 32 | 8 | P `bert.encoder.partial_pattern.indices`; R "
                                            "`bert.encoder.partial_pattern.reconstruction` | 37.5 % |"]
    assert lines[header + 6] == ""  # the table ends there
    # a k per bucket: 16's saving at k = 10 (d_h = 16): 1 − (10·16 + 6·10) / (16·16) = 14.1 %
    per_bucket = build_model_card(PartialBertForMaskedLM(PartialBertConfig(
        **TINY, partial_lengths=[4, 8, 16, 32], partial_lengths_k=[4, 8, 10, 8], reconstruction="common"))).text
    assert ("| 16 | 10 | P `bert.encoder.partial_pattern_len16.indices`; R "
            "`bert.encoder.partial_pattern_len16.reconstruction` | 14.1 % |") in per_bucket.splitlines()
    assert "bert.encoder.partial_pattern_len16" in dict(model.named_modules())  # the name is the module's
    one = build_model_card(PartialBertForMaskedLM(PartialBertConfig(**TINY, reconstruction="common"))).text
    assert "Length buckets" not in one and "| bucket b |" not in one
