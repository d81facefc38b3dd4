"""The from-scratch Table 1 study (`experiments.table1.scratch`): a tiny run of every kind of arm end to end, its
resume, the P-alone control against a hand-computed masked attention, and the study's arguments."""

import json
import math
import os
import pathlib

import pytest
import torch
from transformers import BertConfig, BertModel

from experiments.table1.p_only import allowed_keys, install_p_only
from experiments.table1.scratch import ScratchArguments, estimate_seconds, run_table1_scratch
from experiments.table1.scratch_spec import parse_scratch_arm
from experiments.table1.stats import mlm_loss

ARMS = "exact,k8_fixed,k8_per_layer,k8_head_budget,k8_p_only,k8_convert,k8_convert_train"


def tiny_args(tmp_path, **overrides):
    fields = dict(output_dir=str(tmp_path / "results"), run_dir=str(tmp_path / "run"),
                  cards_dir=str(tmp_path / "cards"), corpus="pydoc", max_seq_length=32, num_hidden_layers=2,
                  hidden_size=32, num_attention_heads=2, intermediate_size=37, arms=ARMS, pretrain_steps=20,
                  pretrain_batch_size=8, eval_every=10, covariance_windows=128, test_windows=32, curve_windows=16,
                  test_pairs=64, finetune_steps=4, finetune_batch_size=8, seeds="0", pretrain_seeds="0,1",
                  timing_repeats=2, timing_batch_size=4, max_train_windows=400, validation_every=4,
                  reconstruction_learning_rates="1e-3,1e-4", progress=False)
    return ScratchArguments(**{**fields, **overrides})


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("scratch")
    a = tiny_args(tmp)
    return a, run_table1_scratch(a, ["--tiny"])


@pytest.mark.slow
def test_tiny_study_end_to_end(tiny_run):
    a, report = tiny_run
    with open(os.path.join(a.output_dir, "table1.json")) as f:
        saved = json.load(f)
    rows = saved["rows"]
    assert list(rows) == ARMS.split(",")
    assert saved["command"] == "python -m experiments table1-scratch --tiny" and saved["seconds"] > 0
    for name, row in rows.items():
        assert 0.0 <= row["accuracy"]["mean"] <= 1.0 and len(row["accuracy"]["values"]) == 2  # 2 pretraining seeds
        assert len(row["mlm_windows_per_seed"]) == 2
        assert row["mlm_windows"] > 0
        assert row["k"] == (None if name == "exact" else 8)
    # the losses against steps: every eval_every steps and the last, for the arms that train from scratch
    assert [p["step"] for p in rows["k8_per_layer"]["curve"]] == [10, 20]
    assert [p["step"] for p in rows["k8_convert_train"]["curve"]] == [2]  # a tenth of the steps
    assert rows["k8_convert"]["curve"] is None
    # the diagnostics of a diverging arm at every point: largest |R| (None without R), entropy per layer
    point = rows["k8_per_layer"]["curve"][-1]
    assert point["max_abs_r"] > 0 and len(point["entropy"]) == 2 and 0 < point["entropy"][0] < math.log(32)
    assert rows["exact"]["curve"][-1]["max_abs_r"] is None
    text = open(os.path.join(a.output_dir, "table1.md")).read()  # and the report shows them, point by point
    assert f"| k8_per_layer | {point['step']} | {point['loss']:.4f} | {point['max_abs_r']:.3g} | " \
        f"{point['entropy'][0]:.3f}, {point['entropy'][1]:.3f} |" in text
    losses = rows["k8_per_layer"]["train_losses"]  # beside them the training loss, each fifth of the steps
    assert len(losses) == 5 and f"- k8_per_layer: {', '.join(f'{v:.4f}' for v in losses)}" in text
    # trained R moved, fixed R did not
    assert max(rows["k8_per_layer"]["r_drift"].values()) > 0
    assert max(rows["k8_fixed"]["r_drift"].values(), default=0.0) == 0.0
    # the saving of a pooled k = 8 at n = 32, d_h = 16 in 1 of 2 layers: (1 - (8·16 + 24·8) / (32·16)) / 2
    assert rows["k8_fixed"]["qk_saving"] == pytest.approx((1 - (8 * 16 + 24 * 8) / (32 * 16)) / 2)
    # P alone: k exact scores a query, nothing to reconstruct: (1 − 8/32) in 1 of 2 layers
    assert rows["k8_p_only"]["qk_saving"] == pytest.approx((1 - 8 / 32) / 2)
    # the best R mode is chosen on the validation windows (training documents held out), never on test
    # R's own rate, chosen on validation on the first pretraining seed, used by every seed
    jobs = pathlib.Path(a.run_dir) / "jobs"
    tried = {r: json.loads((jobs / f"pretrain_k8_per_layer_rlr{r}.json").read_text()) for r in ("0.001", "0.0001")}
    best = min(tried, key=lambda r: mlm_loss(tried[r]["validation"]))
    for seed_jobs in (jobs, pathlib.Path(a.run_dir) / "pretrain_seed1" / "jobs"):
        chosen = json.loads((seed_jobs / "pretrain_k8_per_layer.json").read_text())
        assert chosen["reconstruction_learning_rate"] == float(best)
        assert chosen["reconstruction_learning_rates"] == {r: mlm_loss(t["validation"]) for r, t in tried.items()}
    assert not (jobs / "pretrain_k8_fixed_rlr0.001.json").exists()  # R fixed: nothing to choose
    assert saved["selection_split"] == "validation" and all(
        row["mlm_validation"] > 0 for row in rows.values())
    assert "chosen on the validation windows" in open(os.path.join(a.output_dir, "table1.md")).read()
    assert {v for pairs in saved["verdicts"].values() for p in pairs for v in (p["mlm_verdict"],)} <= {
        "below", "above", "not distinguishable"}
    learned, convert = saved["goals"][:2]
    assert learned["goal"].startswith("the exact model has learned") and convert["goal"].startswith("k8_convert")
    # 20 steps of a tiny model learn little: its MLM loss is not 1.5 nats below the unigram model's
    assert saved["sizes"]["unigram_nats"] - rows["exact"]["mlm_windows"] < 1.5 and learned["met"] is False
    with open(os.path.join(a.output_dir, "table1.md")) as f:
        text = f.read()
    assert "| k8_p_only | 8 | — | 37.5 % |" in text and "(e, ours)" in text  # P alone: its saving shown
    for figure in saved["figures"].values():
        assert os.path.getsize(os.path.join(a.output_dir, figure)) > 1000
    for arm in ("k8_fixed", "k8_per_layer", "k8_head_budget"):
        with open(os.path.join(a.cards_dir, arm, "README.md")) as f:
            assert "Pretrained from scratch with P and R built in" in f.read()


@pytest.mark.slow
def test_arms_run_what_they_name(tiny_run):
    """The saved checkpoints are what each arm says: P and R of the derived files, P alone in a BERT config, the
    per-head arm per head; the exact arm and a trained-in one start from the same weights."""
    from experiments.table1.scratch import _Study
    from hf_partial_attention.modeling_partial_bert import PartialBertForMaskedLM
    from hf_partial_attention.pattern import AttentionPattern

    a, _ = tiny_run
    models = os.path.join(a.run_dir, "models")
    pooled = AttentionPattern.load(os.path.join(a.run_dir, "analysis", "patterns", "per_query_k8.safetensors"))
    trained = PartialBertForMaskedLM.from_pretrained(os.path.join(models, "k8_per_layer"))
    assert torch.equal(trained.get_pattern(0).indices, pooled.indices)
    assert trained.config.reconstruction == "per_layer" and trained.config.partial_layers == [0]
    head = PartialBertForMaskedLM.from_pretrained(os.path.join(models, "k8_head_budget"))
    assert head.config.partial_granularity == "head"
    with open(os.path.join(models, "k8_p_only", "config.json")) as f:
        config = json.load(f)
    assert config["p_only_layers"] == [0] and torch.equal(torch.tensor(config["p_only_indices"]), pooled.indices)
    study = _Study.__new__(_Study)
    study.a, study.arms = a, {arm.name: arm for arm in a.arm_list()}
    study.data = type("Data", (), {"tokenizer": __import__("transformers").AutoTokenizer.from_pretrained(
        os.path.join(models, "exact"))})()
    exact, partial = study.new_model(parse_scratch_arm("exact")), study.new_model(parse_scratch_arm("k8_common"))
    partial_state = partial.state_dict()
    for name, tensor in exact.state_dict().items():
        assert torch.equal(partial_state[name], tensor), name


@pytest.mark.slow
def test_resume_runs_only_missing_jobs(tiny_run):
    a, report = tiny_run
    paths = list(pathlib.Path(a.run_dir).rglob("jobs/*.json"))  # both pretraining seeds' stores
    assert len([p for p in paths if "pretrain_seed1" in str(p)]) == 7 + 1 + 7  # pretraining / convert, P, R, ft
    stamps = {p: os.path.getmtime(p) for p in paths}
    killed = pathlib.Path(a.run_dir) / "pretrain_seed1" / "jobs" / "ft_k8_p_only_s0.json"
    os.remove(killed)  # as if killed in that job
    again = run_table1_scratch(a, ["--tiny"])
    for path, stamp in stamps.items():
        if path != killed:
            assert os.path.getmtime(path) == stamp, path
    assert again["rows"]["k8_p_only"]["accuracy"]["values"] == report["rows"]["k8_p_only"]["accuracy"]["values"]
    with pytest.raises(ValueError, match="other arguments"):
        run_table1_scratch(tiny_args(pathlib.Path(a.run_dir).parent, pretrain_steps=30), [])


@pytest.mark.slow
def test_a_study_of_head_budget_arms_alone_fits_no_pooled_pattern(tmp_path):
    """`--arms exact,k8_head_budget` (the head-budget diagnostic): no pooled k to derive, so no pooled analysis
    (which refused an empty list of ks, ending the study after its exact pretraining); the per-head budget is
    fitted and the arm trains."""
    a = tiny_args(tmp_path, arms="exact,k8_head_budget", pretrain_seeds="0", eval_every=20)
    report = run_table1_scratch(a, ["--tiny"])
    assert list(report["rows"]) == ["exact", "k8_head_budget"]
    assert not (tmp_path / "run" / "analysis").exists() and (tmp_path / "run" / "analysis_head").is_dir()
    assert math.isfinite(report["rows"]["k8_head_budget"]["mlm_windows"])


def test_a_difference_over_pretraining_seeds_adds_their_spread():
    from experiments.table1.stats import paired_loss_difference, seeds_loss_difference

    def job(sums):
        return {"test": {"loss_sums": sums, "token_counts": [10, 10, 10]}}

    a, b = [job([30.0, 31.0, 29.0]), job([33.0, 34.0, 32.0])], [job([29.0, 30.0, 28.0]), job([30.0, 31.0, 29.0])]
    one = paired_loss_difference(a[0]["test"], b[0]["test"])
    assert seeds_loss_difference(a[:1], b[:1]) == one  # one seed: its paired difference
    mean, se = seeds_loss_difference(a, b)
    assert mean == pytest.approx((0.1 + 0.3) / 2)  # each seed's paired difference, averaged
    assert se >= 0.1 / 2 ** 0.5 * 0.99  # at least the seeds' spread (sd 0.1414 / √2), whatever their own errors


def test_p_only_attention_is_masked_attention():
    """P alone equals a hand-written attention with every key outside P masked; P holding every key is SDPA."""
    torch.manual_seed(0)
    config = BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=37, max_position_embeddings=16, attention_probs_dropout_prob=0.0)
    model = BertModel(config).eval()
    ids = torch.randint(5, 99, (2, 16))
    mask = torch.ones_like(ids)
    mask[1, 11:] = 0
    reference = model(ids, attention_mask=mask).last_hidden_state
    install_p_only(model, torch.arange(16).repeat(16, 1), [0])
    assert torch.allclose(model(ids, attention_mask=mask).last_hidden_state, reference, atol=1e-6)
    indices = torch.stack([torch.tensor(sorted({0, i, min(i + 1, 15), max(i - 1, 0)} | {15 - i})[:3])
                           for i in range(16)])  # (n, 3)
    install_p_only(model, indices, [0])
    seen = {}
    self_attn = model.encoder.layer[0].attention.self
    hook = self_attn.register_forward_hook(lambda mod, args, kwargs, out: seen.update(x=args[0], out=out[0]),
                                           with_kwargs=True)
    got = model(ids, attention_mask=mask).last_hidden_state
    hook.remove()
    assert not torch.allclose(got, reference, atol=1e-3)
    # layer 0's attention by hand, every key outside P (and padding) masked
    q, k, v = (lin(seen["x"]).view(2, 16, 2, 16).transpose(1, 2) for lin in (self_attn.query, self_attn.key,
                                                                              self_attn.value))  # (B, H, T, d)
    keep = allowed_keys(indices, 16)[None, None] & mask.bool()[:, None, None, :]  # (B, 1, T, T)
    weights = (q @ k.transpose(-1, -2) / 4.0).masked_fill(~keep, float("-inf")).softmax(-1)  # (B, H, T, T)
    expected = (weights @ v).transpose(1, 2).reshape(2, 16, 32)  # (B, T, h)
    assert torch.allclose(seen["out"].reshape(2, 16, 32), expected, atol=1e-5)
    with pytest.raises(ValueError, match="positions"):
        install_p_only(model, torch.arange(4).repeat(32, 1), [0])


def test_arguments_refuse_and_estimate(tmp_path):
    with pytest.raises(ValueError, match="must start with 'exact'"):
        tiny_args(tmp_path, arms="k8_fixed,exact")
    with pytest.raises(ValueError, match="kind one of"):
        tiny_args(tmp_path, arms="exact,k8_sparse")
    for p in (0.0, 1.0):
        with pytest.raises(ValueError, match="mlm_probability"):
            tiny_args(tmp_path, mlm_probability=p)
    a = tiny_args(tmp_path, pretrain_steps=100, eval_every=100, curve_windows=8, finetune_steps=10, seeds="0",
                  reconstruction_learning_rates="")
    # 6 pretraining runs from scratch... of which exact, fixed, per_layer, head_budget, p_only: 5 × 100 steps; the
    # convert-train arm 10; curves 6 arms × 2 points × 8/8 batches / 3; fine-tuning 7 × 10 × 0.35
    expected = 1.1 * 0.5 * (500 + 10 + 6 * 2 * 8 / 8 / 3 + 7 * 10 * 0.35)
    assert estimate_seconds(a, 0.5) == pytest.approx(2 * expected)  # twice: two pretraining seeds
    one_seed = tiny_args(tmp_path, pretrain_steps=100, eval_every=100, curve_windows=8, finetune_steps=10, seeds="0",
                         pretrain_seeds="", reconstruction_learning_rates="")
    assert estimate_seconds(one_seed, 0.5) == pytest.approx(expected)
    with pytest.raises(ValueError, match="validation_every"):
        tiny_args(tmp_path, validation_every=0)  # R's rates are chosen on validation
    with pytest.raises(ValueError, match="must start with seed=0"):
        tiny_args(tmp_path, pretrain_seeds="1,0")


def test_a_wordpiece_vocabulary_is_trained_on_the_given_documents(tmp_path):
    from transformers import AutoTokenizer

    from experiments.table1.scratch_data import train_wordpiece

    docs = [["The quick brown fox jumps over the lazy dog.", "Attention scores lie in a low-dimensional space."],
            ["Partial attention computes k scores per query and reconstructs the rest."]] * 20
    tok = train_wordpiece(docs, vocab_size=200, folder=str(tmp_path / "tok"))
    assert [tok.convert_ids_to_tokens(i) for i in range(5)] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    assert 100 < len(tok) <= 200
    ids = tok("Partial attention reconstructs scores.")["input_ids"]
    assert ids[0] == tok.cls_token_id and ids[-1] == tok.sep_token_id and tok.unk_token_id not in ids
    assert tok.decode(ids, skip_special_tokens=True) == "partial attention reconstructs scores."
    again = AutoTokenizer.from_pretrained(tmp_path / "tok")  # saved: a resumed run reads the same vocabulary
    assert again("the lazy fox")["input_ids"] == tok("the lazy fox")["input_ids"]
    with pytest.raises(ValueError, match="vocab_size"):
        train_wordpiece(docs, vocab_size=50)


def test_each_pass_cuts_the_windows_at_its_own_offset():
    from datasets import Dataset, DatasetDict
    from transformers import AutoTokenizer

    from experiments.table1.scratch_data import window_passes
    from hf_partial_attention.analysis.defaults import resolve_model
    from hf_partial_attention.training import group_into_windows

    tok = AutoTokenizer.from_pretrained(resolve_model(None)[0])
    words = [f"token{i}" for i in range(600)]  # no window of text repeats
    train = Dataset.from_dict({"text": [" ".join(words[:300]), " ".join(words[300:])]})
    once = group_into_windows(DatasetDict(train=train), tok, 16)["train"]
    three = window_passes(train, tok, 16, passes=3, seed=0)
    assert 2.5 * len(once) < len(three) <= 3 * len(once)  # a later pass loses the words it skips
    assert three[: len(once)]["input_ids"] == once["input_ids"]  # pass 0: the windows of one cut
    firsts = {tuple(three[i]["input_ids"]) for i in (0, len(once), len(three) - 1)}
    assert len(firsts) == 3 and all(len(w) == 16 for w in three["input_ids"])
    # another pass starts inside the text, not at a window boundary of pass 0
    assert three[len(once)]["input_ids"] not in once["input_ids"]


@pytest.mark.slow
def test_the_study_data_with_its_own_vocabulary_and_two_cuts(tmp_path):
    from experiments.table1.scratch_data import load_scratch_data

    one = load_scratch_data(tiny_args(tmp_path / "a", tokenizer_name="wordpiece", vocab_size=500))
    two = load_scratch_data(tiny_args(tmp_path / "b", tokenizer_name="wordpiece", vocab_size=500, window_passes=2))
    assert len(one.tokenizer) <= 500 and (tmp_path / "a" / "run" / "tokenizer" / "tokenizer.json").exists()
    # the same training documents: the same tokens (at this size; ties at the cutoff can differ at thousands), numbered
    # alike (sorted), so the same ids
    assert one.tokenizer.get_vocab() == two.tokenizer.get_vocab()
    assert len(one.windows["train"]) == 400 and len(two.windows["train"]) == 800  # max_train_windows per pass
    assert two.windows["train"][400]["input_ids"] not in one.windows["train"]["input_ids"]  # pass 1: other cuts
    again = load_scratch_data(tiny_args(tmp_path / "a", tokenizer_name="wordpiece", vocab_size=500))
    assert again.windows["train"]["input_ids"] == one.windows["train"]["input_ids"]  # the saved vocabulary reused
