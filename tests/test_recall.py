"""The recall study (`experiments.recall`): its tasks say what they claim (MQAR's queries beyond P's reach, the copy
offsets, the majority's margin), its arguments refuse what cannot run, its verdicts follow their stated rules, two
processes share one run, and a tiny run goes end to end through the project's models and trainer."""

import json
import os

import pytest
import torch

from experiments.recall.run import run_recall
from experiments.recall.spec import RecallArguments
from experiments.recall.report import _verdicts, mean_se
from experiments.recall.run import _claim
from experiments.recall.study import sweep
from experiments.recall.spec import parse_recall_arm
from experiments.recall.tasks import FIRST_SYMBOL, RecallTask, task_tensors


def test_mqar_queries_find_their_key_beyond_the_reach_of_p():
    task = RecallTask("mqar", n=64, symbols=32, pairs=4)
    data = task_tensors(task, seed=5, count=200)
    half = task.symbols // 2
    for ids, types, labels in zip(data["input_ids"], data["token_type_ids"], data["labels"]):
        queries = (labels != -100).nonzero().flatten()
        assert len(queries) == task.pairs and queries.min() >= task.n // 2
        for q in queries:
            (where,) = ((ids == ids[q]) & (types > 0)).nonzero().flatten()  # the one position holding the key
            assert labels[q] == FIRST_SYMBOL + half + types[where] - 1  # its value
            assert q - where > task.n // 4  # beyond a band of k <= n/4 keys, even over two layers
        assert int((types > 0).sum()) == task.pairs and int((types[task.n // 4:] > 0).sum()) == 0


@pytest.mark.parametrize("name, offset", [("far_copy", 24), ("near_copy", 2)])
def test_copy_labels_are_the_symbol_offset_positions_back(name, offset):
    task = RecallTask(name, n=64)
    assert task.offset == offset
    data = task_tensors(task, seed=1, count=20)
    ids, labels = data["input_ids"], data["labels"]
    assert (labels[:, :offset] == -100).all()
    assert torch.equal(labels[:, offset:], ids[:, :-offset])


def test_majority_label_is_the_most_frequent_symbol_by_a_margin():
    task = RecallTask("majority", n=64)
    data = task_tensors(task, seed=3, count=50)
    for ids, labels in zip(data["input_ids"], data["labels"]):
        counts = torch.bincount(ids, minlength=task.vocab_size)
        assert (labels == labels[0]).all() and counts[labels[0]] == task.majority_count
        others = counts.clone()
        others[labels[0]] = 0
        assert others.max() <= task.majority_count - 3


def test_splits_are_reproducible_and_distinct():
    task = RecallTask("far_copy", n=32)
    a, b = task_tensors(task, 1, 8), task_tensors(task, 1, 8)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["input_ids"], task_tensors(task, 2, 8)["input_ids"])


def test_arms_parse_and_arguments_refuse_what_cannot_run(tmp_path):
    arm = parse_recall_arm("k8_trained_last_exact_greedy")
    assert (arm.k, arm.kind, arm.last_exact, arm.greedy, arm.reconstruction) == (8, "trained", True, True, "per_layer")
    assert parse_recall_arm("k16_p_only").reconstruction is None
    with pytest.raises(ValueError, match="k<k>_<kind>"):
        parse_recall_arm("k8_common")
    with pytest.raises(ValueError, match="seq_len"):
        RecallArguments(run_dir=str(tmp_path), arms="exact,k64_trained", seq_len=64)
    with pytest.raises(ValueError, match="must give every task"):
        RecallArguments(run_dir=str(tmp_path), steps="mqar=10")
    with pytest.raises(ValueError, match="start with 'exact'"):
        RecallArguments(run_dir=str(tmp_path), arms="k8_trained,exact")
    with pytest.raises(ValueError, match="majority at n=64 needs symbols >= 9"):
        RecallTask("majority", n=64, symbols=8)  # 7 others x 7 = 49 < 54 positions: no window exists
    with pytest.raises(ValueError, match="mqar with pairs=9"):
        RecallTask("mqar", n=64, pairs=9)
    a = RecallArguments(run_dir=str(tmp_path), learning_rates="1e-3,3e-3", r_lr_ratios="1,0.1")
    assert sweep(a, parse_recall_arm("k8_trained")) == [(1e-3, 1.0), (1e-3, 0.1), (3e-3, 1.0), (3e-3, 0.1)]
    assert sweep(a, parse_recall_arm("k8_p_only")) == [(1e-3, None), (3e-3, None)]


def test_mean_se():
    out = mean_se([1.0, 2.0, 3.0])
    assert out["mean"] == 2.0 and out["se"] == pytest.approx(1 / 3 ** 0.5)
    assert mean_se([0.5])["se"] is None


def _cell(mean, se):
    return {"accuracy": {"mean": mean, "se": se}}


def test_verdicts_follow_their_stated_rules(tmp_path):
    a = RecallArguments(run_dir=str(tmp_path), arms="exact,k8_trained,k8_p_only,k8_trained_last_exact")
    rows = {"exact": {"far_copy": _cell(1.0, 0.0), "mqar": _cell(1.0, 0.001)},
            "k8_trained": {"far_copy": _cell(0.9, 0.01), "mqar": _cell(0.3, 0.02)},
            "k8_p_only": {"far_copy": _cell(0.1, 0.01), "mqar": _cell(0.3, 0.02)},
            "k8_trained_last_exact": {"far_copy": None, "mqar": _cell(0.995, 0.002)}}
    v = _verdicts(rows, {"far_copy": True, "mqar": True}, a)
    assert v["e1"]["holds"] and v["e2"]["holds"] and v["e3"]["holds"]
    assert v["e1"]["comparisons"]["k8_trained"]["difference"] == pytest.approx(0.8)
    rows["k8_p_only"]["far_copy"] = _cell(0.88, 0.01)  # within 2 se of P + R: R earns nothing here
    rows["k8_trained"]["mqar"] = _cell(0.999, 0.001)  # a partial model that recalls by content: (e2) fails
    rows["k8_trained_last_exact"]["mqar"] = _cell(0.5, 0.01)  # the exact layer did not restore it
    v = _verdicts(rows, {"far_copy": True, "mqar": True}, a)
    assert not v["e1"]["holds"] and not v["e2"]["holds"] and not v["e3"]["holds"]
    assert _verdicts(rows, {"far_copy": False, "mqar": False}, a) == {}  # void where exact does not solve
    rows["k8_p_only"]["far_copy"] = _cell(0.1, None)  # one seed finished: no standard error yet
    del rows["k8_trained_last_exact"]
    v = _verdicts(rows, {"far_copy": True, "mqar": True}, a)
    assert v["e1"]["holds"] is None and v["e3"]["holds"] is None  # undecided, not "does not hold"


def test_a_job_held_by_a_live_process_is_left_and_a_dead_ones_taken_over(tmp_path):
    lock = str(tmp_path / "locks" / "job.lock")
    assert _claim(lock)
    assert not _claim(lock)  # held by this (live) process
    with open(lock, "w") as f:
        f.write("999999999")  # no such process: a killed run's lock
    assert _claim(lock)


@pytest.mark.slow
def test_tiny_study_end_to_end_and_resumed(tmp_path):
    a = RecallArguments(output_dir=str(tmp_path / "out"), run_dir=str(tmp_path / "run"), tasks="mqar,far_copy",
                        arms="exact,k4_trained,k4_p_only,k4_fixed_last_exact,k4_p_only_greedy", seq_len=32,
                        symbols=16, pairs=2, hidden_size=32, intermediate_size=37, steps="mqar=6,far_copy=6",
                        batch_size=8, learning_rates="1e-3,3e-3", r_lr_ratios="1,0.1", seeds="0,1",
                        validation_examples=32, test_examples=32, covariance_examples=32, progress=False)
    result = run_recall(a, ["--tiny"])
    with open(tmp_path / "out" / "recall.json") as f:
        saved = json.load(f)
    assert saved["complete"] and saved["command"] == "python -m experiments recall --tiny"
    # per task: exact 2 rates + 1 seed, k4_trained 2 × 2 (R's ratio) + 1, three arms of 2 + 1
    assert saved["jobs"] == {"finished": 2 * (3 + 5 + 3 * 3), "total": 34}
    for arm in a.arm_list():
        for task in ("mqar", "far_copy"):
            row = saved["rows"][arm.name][task]
            assert len(row["accuracy"]["values"]) == 2 and row["lr"] in (1e-3, 3e-3)
    # each arm ran what it names: R trained moved, R fixed did not; P a band or the greedy's
    run = tmp_path / "run" / "jobs"
    drift = json.loads((run / "k4_trained" / "mqar" / "s1.json").read_text())["r_drift"]
    assert drift and max(drift.values()) > 0
    fixed = json.loads((run / "k4_fixed_last_exact" / "mqar" / "s1.json").read_text())["r_drift"]
    assert max(fixed.values(), default=0.0) == 0.0
    from experiments.recall.study import RecallStudy
    from hf_partial_attention.reconstruction import nearest_keys

    study = RecallStudy(a, None)
    task = study.tasks["mqar"]
    assert study.new_model(study.arms["k4_fixed_last_exact"], task, 0).config.partial_layers == [0]
    model = study.new_model(study.arms["k4_trained"], task, 0)
    assert model.config.partial_layers == [0, 1]
    assert torch.equal(model.get_pattern().indices, nearest_keys(32, 4))
    assert saved["patterns"]["mqar"]["error"].keys() == {"band_k4", "greedy_k4"}
    assert (tmp_path / "out" / "recall.md").read_text().count("| k4_") == 4
    # resumed: nothing runs again
    stamps = {p: os.path.getmtime(p) for p in run.rglob("*.json")}
    run_recall(a, ["--tiny"])
    assert {p: os.path.getmtime(p) for p in run.rglob("*.json")} == stamps
    assert result["rows"].keys() == saved["rows"].keys()


def test_the_recorded_command_leaves_out_what_does_not_shape_results():
    from experiments.recall.run import _result_flags

    assert _result_flags(["--threads", "1", "--seeds", "0,1", "--progress", "false", "--report_only=true",
                          "--steps", "mqar=5"]) == ["--seeds", "0,1", "--steps", "mqar=5"]
