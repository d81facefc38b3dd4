"""Every push path uploads this project's card, the code files and the weights: checked at the HfApi boundary
(create_repo / create_commit captured, no network)."""

import concurrent.futures
import fnmatch
import os

import pytest
import torch
from huggingface_hub import HfApi, ModelCard
from huggingface_hub.hf_api import RepoUrl

from hf_partial_attention import AttentionPattern, PartialBertForMaskedLM

TINY = dict(vocab_size=99, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=37,
            partial_seq_len=16, partial_k=4)
BUNDLE = {"modeling_partial_bert.py", "configuration_partial_bert.py", "pattern.py", "reconstruction.py",
          "cost.py", "conversion.py", "partial_pattern.py", "attention_common.py",
          "attention_gather.py", "attention_fused.py", "attention_tiled.py", "attention_triton.py",
          "attention_dispatch.py"}


@pytest.fixture
def hub(monkeypatch):
    """Captured commits: one dict per commit with its files {path_in_repo: bytes}."""
    commits = []

    def create_repo(self, repo_id, **kwargs):
        return RepoUrl(f"https://huggingface.co/{repo_id}")

    def create_commit(self, repo_id, operations, **kwargs):
        files = {}
        for op in operations:
            source = op.path_or_fileobj
            files[op.path_in_repo] = source if isinstance(source, bytes) else open(source, "rb").read()
        commits.append({"repo_id": repo_id, "files": files, **kwargs})
        return None

    def upload_folder(self, repo_id, folder_path, ignore_patterns=None, **kwargs):  # Trainer.push_to_hub's path
        files = {}
        for root, _, names in os.walk(folder_path):
            for name in names:
                rel = os.path.relpath(os.path.join(root, name), folder_path)
                if not any(fnmatch.fnmatch(rel, pattern) for pattern in ignore_patterns or []):
                    files[rel] = open(os.path.join(root, name), "rb").read()
        commits.append({"repo_id": repo_id, "files": files, **kwargs})
        if kwargs.get("run_as_future"):  # checkpoint pushes during training
            future = concurrent.futures.Future()
            future.set_result(None)
            return future
        return None

    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "create_commit", create_commit)
    monkeypatch.setattr(HfApi, "create_branch", lambda self, **kwargs: None)
    return commits


@pytest.fixture
def converted():
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    bert = BertForMaskedLM(BertConfig(**{k: v for k, v in TINY.items() if not k.startswith("partial")}))
    bert.config._name_or_path = "google-bert/bert-base-uncased"  # as if loaded by Hub id
    return PartialBertForMaskedLM.from_bert(bert, AttentionPattern.local(16, 4))


def _check_card(files, repo_id):
    assert BUNDLE <= set(files) and {"config.json", "model.safetensors", "README.md"} <= set(files)
    assert "model_card.py" not in files and "hub.py" not in files
    text = files["README.md"].decode()
    card = ModelCard(text)
    assert "automatically generated" not in text  # not transformers' template
    assert {"partial-attention", "custom_code"} <= set(card.data.tags)
    assert card.data.base_model == "google-bert/bert-base-uncased"
    assert "## Partial attention: P and R" in text and "**k = 4**" in text
    assert f'from_pretrained("{repo_id}")' in text
    return card


def test_save_pretrained_with_push_uploads_the_project_card(hub, converted, tmp_path):
    converted.save_pretrained(tmp_path / "out", push_to_hub=True, repo_id="me/partial-mlm")
    assert len(hub) == 1 and hub[0]["repo_id"] == "me/partial-mlm"
    _check_card(hub[0]["files"], "me/partial-mlm")
    assert (tmp_path / "out" / "README.md").read_bytes() == hub[0]["files"]["README.md"]


def test_push_to_hub_uploads_the_project_card(hub, converted):
    converted.push_to_hub("me/partial-mlm", commit_message="first", tags=["my-tag"])
    assert len(hub) == 1 and hub[0]["commit_message"] == "first"
    card = _check_card(hub[0]["files"], "me/partial-mlm")
    assert "my-tag" in card.data.tags


def test_trainer_push_uploads_the_project_card(hub, converted, tmp_path):
    from transformers import TrainingArguments

    from hf_partial_attention.training import PartialAttentionTrainer

    args = TrainingArguments(output_dir=str(tmp_path / "run"), push_to_hub=True, hub_model_id="me/partial-mlm",
                             report_to=[], use_cpu=True, max_steps=1, per_device_train_batch_size=2)
    ids = torch.randint(1, 99, (4, 16), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row, "labels": row} for row in ids]
    trainer = PartialAttentionTrainer(model=converted, args=args, train_dataset=data)
    trainer.train()
    trainer.push_to_hub(commit_message="trained", dataset="pydoc-topics")
    card = _check_card(hub[-1]["files"], "me/partial-mlm")
    text = hub[-1]["files"]["README.md"].decode()
    assert "PartialAttentionTrainer` for 1 steps" in text and card.data.datasets in ("pydoc-topics", ["pydoc-topics"])
    assert os.path.isfile(tmp_path / "run" / "README.md")


@pytest.mark.parametrize("model_type, hub_id", [("roberta", "FacebookAI/roberta-base"),
                                                ("modernbert", "answerdotai/ModernBERT-base")])
def test_push_to_hub_of_a_converted_encoder_uploads_its_card_and_code(hub, model_type, hub_id):
    """Another architecture pushes like PartialBert: the project's card with the source's Hub id as base_model and its
    architecture in the tags, the config's auto_map naming files that are in the commit."""
    import json

    from transformers import AutoConfig, AutoModelForMaskedLM

    from hf_partial_attention import partial_class_for

    sizes = {k: v for k, v in TINY.items() if not k.startswith("partial")}
    torch.manual_seed(0)
    source = AutoModelForMaskedLM.from_config(AutoConfig.for_model(model_type, **sizes, max_position_embeddings=40,
                                                                   pad_token_id=0))
    source.config._name_or_path = hub_id  # as if loaded by Hub id
    model = partial_class_for(model_type, "AutoModelForMaskedLM").from_source(source, AttentionPattern.local(16, 4))
    model.push_to_hub("me/partial-encoder")
    files = hub[-1]["files"]
    card = ModelCard(files["README.md"].decode())
    assert card.data.base_model == hub_id
    assert {"partial-attention", "custom_code", model_type} <= set(card.data.tags)
    assert "**k = 4**" in files["README.md"].decode()
    config = json.loads(files["config.json"])
    assert config["model_type"] == f"partial_{model_type}"
    assert config["auto_map"]["AutoModelForMaskedLM"].endswith("." + type(model).__name__)
    for reference in config["auto_map"].values():
        assert reference.split(".")[0] + ".py" in files, reference
    assert "model.safetensors" in files
