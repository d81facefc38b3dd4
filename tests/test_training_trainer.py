"""PartialAttentionTrainer: R's optimizer group, R per mode, drift logs, loss normalisation, exact resume."""

import os

import pytest
import torch
from datasets import Dataset, DatasetDict
from safetensors.torch import load_file
from transformers import TrainerCallback

from hf_partial_attention import PartialBertConfig, PartialBertForMaskedLM
from hf_partial_attention.training import (
    RECONSTRUCTION_INITIAL_NAME,
    EpochLengthGroupedSampler,
    MlmCollator,
    PartialAttentionTrainer,
    PartialAttentionTrainingArguments,
    example_lengths,
    examples_at_own_length,
)

DATA = os.path.join(os.path.dirname(__file__), "data")
TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
            max_position_embeddings=64)
N, K, STEPS, SAVE = 32, 8, 8, 4
MODES = ("fixed", "common", "per_layer")


def tiny_model(tokenizer, mode, seed=0):
    torch.manual_seed(seed)
    config = PartialBertConfig(vocab_size=len(tokenizer), **TINY, partial_seq_len=N, partial_k=K, reconstruction=mode)
    return PartialBertForMaskedLM(config)


def make_trainer(tokenizer, windows, out, mode, seed=0, callbacks=None, model=None, **kw):
    kw = {"max_steps": STEPS, "per_device_train_batch_size": 4, "save_steps": SAVE, **kw}
    args = PartialAttentionTrainingArguments(
        output_dir=out, logging_steps=1, learning_rate=1e-3, reconstruction_learning_rate=1e-2, use_cpu=True,
        report_to="none", seed=0, disable_tqdm=True, dataloader_num_workers=0, **kw)
    model = tiny_model(tokenizer, mode, seed) if model is None else model
    return PartialAttentionTrainer(model=model, args=args, train_dataset=windows,
                                   data_collator=MlmCollator(tokenizer), callbacks=callbacks)


def r_and_p(model):
    return ({k: v.detach().clone() for k, v in model.reconstruction_tensors().items()},
            model.bert.encoder.partial_pattern.indices.clone())


@pytest.fixture(scope="module")
def full_runs(tokenizer, windows, tmp_path_factory):
    """One uninterrupted run per R mode: (trainer, R and P before training)."""
    runs = {}
    for mode in MODES:
        trainer = make_trainer(tokenizer, windows, str(tmp_path_factory.mktemp(f"full_{mode}")), mode)
        before = r_and_p(trainer.model)
        trainer.train()
        runs[mode] = (trainer, before)
    return runs


def logged(trainer, key, after=0):
    """(steps, values) of `key` in the training logs after step `after`."""
    rows = [h for h in trainer.state.log_history if "loss" in h and h["step"] > after]
    return [h["step"] for h in rows], [h[key] for h in rows]


def test_optimizer_gives_r_its_own_group(tokenizer, windows, tmp_path):
    trainer = make_trainer(tokenizer, windows, str(tmp_path), "per_layer", reconstruction_weight_decay=0.5,
                           weight_decay=0.01)
    opt = trainer.create_optimizer()
    r_ids = {id(t) for t in trainer.model.reconstruction_tensors().values()}
    r_groups = [g for g in opt.param_groups if any(id(p) in r_ids for p in g["params"])]
    assert len(r_groups) == 1 and {id(p) for p in r_groups[0]["params"]} == r_ids
    assert r_groups[0]["lr"] == 1e-2 and r_groups[0]["weight_decay"] == 0.5
    others = [g for g in opt.param_groups if g is not r_groups[0]]
    assert {g["lr"] for g in others} == {1e-3} and {g["weight_decay"] for g in others} == {0.01, 0.0}
    n_trainable = sum(1 for p in trainer.model.parameters() if p.requires_grad)
    assert sum(len(g["params"]) for g in opt.param_groups) == n_trainable


def _qkv(model):
    attn = model.bert.encoder.layer[0].attention.self
    return {name: getattr(attn, name).weight.detach().clone() for name in ("query", "key", "value")}


def test_fixed_r_has_no_optimizer_group(tokenizer, windows, tmp_path):
    trainer = make_trainer(tokenizer, windows, str(tmp_path), "fixed")
    opt = trainer.create_optimizer()
    assert all(g.get("lr") == 1e-3 for g in opt.param_groups)  # no group at reconstruction_learning_rate=1e-2
    r = trainer.model.reconstruction_tensors()["fixed"]
    optimised = [p for g in opt.param_groups for p in g["params"]]
    assert not any(p is r or p.data_ptr() == r.data_ptr() for p in optimised)
    assert len(optimised) == sum(1 for p in trainer.model.parameters() if p.requires_grad)


def test_fixed_r_is_not_trained_while_the_rest_is(tokenizer, full_runs):
    """fixed: R gets no gradient and no optimizer slot, so it stays R₀ while q/k/v move; the same run in common mode
    (same seed, data and steps) does move R, so an R that trains would be seen here."""
    trainer, (r0, p0) = full_runs["fixed"]
    model = trainer.model
    r = model.reconstruction_tensors()["fixed"]
    assert "bert.encoder.partial_pattern.reconstruction" in dict(model.named_buffers())
    assert "bert.encoder.partial_pattern.reconstruction" not in dict(model.named_parameters())
    assert not r.requires_grad and r.grad is None
    optimised = [p for g in trainer.optimizer.param_groups for p in g["params"]]
    assert optimised and not any(p.data_ptr() == r.data_ptr() for p in optimised)
    # training happened: q/k/v moved away from the same seed's initial weights; R and P did not move
    initial = _qkv(tiny_model(tokenizer, "fixed", seed=0))
    for name, weight in _qkv(model).items():
        assert not torch.allclose(weight, initial[name]), name
    r1, p1 = r_and_p(model)
    assert torch.equal(r1["fixed"], r0["fixed"]) and torch.equal(p1, p0)
    drifts = logged(trainer, "reconstruction_drift/fixed")[1]
    assert len(drifts) == STEPS and max(drifts) == 0.0
    # the control: with the same data, common mode's R (a parameter) changed and its drift was logged as > 0
    common, (r0_common, _) = full_runs["common"]
    assert torch.equal(r0_common["common"], r0["fixed"])  # both start from the same R₀ ...
    assert not torch.allclose(common.model.reconstruction_tensors()["common"], r0_common["common"])  # ... one moves
    assert min(logged(common, "reconstruction_drift/common")[1]) > 0


def test_common_r_changes_and_stays_shared(full_runs):
    trainer, (r0, p0) = full_runs["common"]
    r1, p1 = r_and_p(trainer.model)
    assert torch.equal(p1, p0) and not torch.allclose(r1["common"], r0["common"])
    layer0 = trainer.model.bert.encoder.layer[0].attention.self
    assert "reconstruction" not in layer0._parameters  # one tensor, owned by the encoder
    drifts = logged(trainer, "reconstruction_drift/common")[1]
    assert drifts[-1] > drifts[0] > 0


def test_per_layer_r_changes_per_layer(tokenizer, windows, full_runs, tmp_path):
    trainer, (r0, p0) = full_runs["per_layer"]
    r1, p1 = r_and_p(trainer.model)
    assert torch.equal(p1, p0) and list(r1) == ["layer.0"]  # 2 layers: the last stays exact
    assert not torch.allclose(r1["layer.0"], r0["layer.0"])
    assert not hasattr(trainer.model.bert.encoder.layer[1].attention.self, "reconstruction")
    # With two partial layers, each layer's R moves on its own.
    torch.manual_seed(0)
    config = PartialBertConfig(vocab_size=len(tokenizer), **{**TINY, "num_hidden_layers": 3},
                               partial_seq_len=N, partial_k=K, reconstruction="per_layer")
    three = make_trainer(tokenizer, windows, str(tmp_path), "per_layer", model=PartialBertForMaskedLM(config),
                         save_strategy="no")
    three.train()
    r = three.model.reconstruction_tensors()
    assert list(r) == ["layer.0", "layer.1"] and not torch.allclose(r["layer.0"], r["layer.1"])
    logged = [h for h in three.state.log_history if "loss" in h][-1]
    assert {"reconstruction_drift/layer.0", "reconstruction_drift/layer.1", "reconstruction_drift/mean"} <= set(logged)


def test_checkpoints_carry_initial_r(full_runs):
    trainer, (r0, _) = full_runs["common"]
    saved = load_file(os.path.join(trainer.args.output_dir, f"checkpoint-{SAVE}", RECONSTRUCTION_INITIAL_NAME))
    assert torch.equal(saved["common"], r0["common"])


class _Snapshot(TrainerCallback):
    """R, P and the optimizer state right after a resumed trainer has loaded its checkpoint."""

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.r_and_p = r_and_p(model)
        self.optimizer_state = {i: {k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()}
                                for i, state in optimizer.state_dict()["state"].items()}  # copies: training goes on


@pytest.mark.parametrize("mode", MODES)
def test_resume_reproduces_uninterrupted_run(tokenizer, windows, full_runs, tmp_path, mode):
    full, _ = full_runs[mode]
    checkpoint = os.path.join(full.args.output_dir, f"checkpoint-{SAVE}")
    snap = _Snapshot()
    resumed = make_trainer(tokenizer, windows, str(tmp_path), mode, seed=123, callbacks=[snap])  # other init
    resumed.train(resume_from_checkpoint=checkpoint)
    # P, R and R's AdamW moments are the checkpoint's, exactly.
    ckpt_weights = load_file(os.path.join(checkpoint, "model.safetensors"))
    r_loaded, p_loaded = snap.r_and_p
    assert torch.equal(p_loaded, ckpt_weights["bert.encoder.partial_pattern.indices"])
    for name, tensor in r_loaded.items():
        key = ("bert.encoder.partial_pattern.reconstruction" if name in ("fixed", "common")
               else f"bert.encoder.{name}.attention.self.reconstruction")
        assert torch.equal(tensor, ckpt_weights[key]), name
    saved_opt = torch.load(os.path.join(checkpoint, "optimizer.pt"), weights_only=True)["state"]
    assert saved_opt.keys() == snap.optimizer_state.keys()
    for idx, state in saved_opt.items():
        for key, value in state.items():
            assert torch.equal(value, snap.optimizer_state[idx][key]), (idx, key)
    # The losses after the checkpoint, R's drift and the final R are those of the uninterrupted run.
    steps, resumed_losses = logged(resumed, "loss", SAVE)
    assert steps == list(range(SAVE + 1, STEPS + 1))
    assert resumed_losses == pytest.approx(logged(full, "loss", SAVE)[1], rel=1e-6, abs=1e-6)
    drift_key = f"reconstruction_drift/{next(iter(full.model.reconstruction_tensors()))}"
    assert logged(resumed, drift_key, SAVE)[1] == pytest.approx(logged(full, drift_key, SAVE)[1], abs=1e-6)
    for name, tensor in full.model.reconstruction_tensors().items():
        torch.testing.assert_close(resumed.model.reconstruction_tensors()[name], tensor, rtol=1e-6, atol=1e-7)


def test_loss_is_normalised_by_global_item_count(tokenizer, windows, tmp_path):
    trainer = make_trainer(tokenizer, windows, str(tmp_path), "common")
    model = trainer.model.train()
    batch = MlmCollator(tokenizer)([windows[i] for i in range(4)])
    torch.manual_seed(0)
    mean = model(**batch).loss
    local = int(batch["labels"].ne(-100).sum())
    torch.manual_seed(0)
    scaled = trainer.compute_loss(model, batch, num_items_in_batch=torch.tensor(3 * local))
    torch.testing.assert_close(scaled, mean / 3)
    torch.manual_seed(0)
    assert torch.equal(trainer.compute_loss(model, batch), mean)  # evaluation: the model's own mean
    # A process with no labelled item contributes zero loss and zero (finite) gradients.
    empty = {**batch, "labels": torch.full_like(batch["labels"], -100)}
    loss = trainer.compute_loss(model, empty, num_items_in_batch=torch.tensor(local))
    loss.backward()
    assert loss.item() == 0.0
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_evaluation_masks_do_not_depend_on_epoch(tokenizer, windows, tmp_path):
    trainer = make_trainer(tokenizer, windows, str(tmp_path), "common", per_device_eval_batch_size=8)
    trainer.data_collator.epoch = 3
    first = trainer.evaluate(eval_dataset=windows.select(range(8)))["eval_loss"]
    trainer.data_collator.epoch = 5
    second = trainer.evaluate(eval_dataset=windows.select(range(8)))["eval_loss"]
    assert first == second and trainer.data_collator.epoch == 5


def test_eval_loss_is_token_weighted_for_any_batch_size(tokenizer, windows, tmp_path):
    """eval_loss = the cross-entropy summed over every masked token of the eval set / their number, computed here
    with the model and the collator one example at a time; the same for eval batches 1, 3 and 8 of 13 windows."""
    evaluation = windows.select(range(13))  # a multiple of none of the batch sizes: the last batch is short
    model = tiny_model(tokenizer, "common").eval()
    collator = MlmCollator(tokenizer)
    collator.epoch = None  # evaluation's masks
    total, items = 0.0, 0
    with torch.no_grad():
        for i in range(len(evaluation)):
            batch = collator([evaluation[i]])
            labels = batch.pop("labels")  # (1, N)
            chosen = labels != -100
            logits = model(**batch).logits  # (1, N, vocab)
            total += torch.nn.functional.cross_entropy(logits[chosen], labels[chosen], reduction="sum").item()
            items += int(chosen.sum())
    by_hand = total / items
    for size in (1, 3, 8):
        trainer = make_trainer(tokenizer, windows, str(tmp_path / str(size)), "common", model=model,
                               per_device_eval_batch_size=size)
        assert trainer.evaluate(eval_dataset=evaluation)["eval_loss"] == pytest.approx(by_hand, rel=1e-5), size


# ---------------------------------------------------------------- variable lengths: sentences, group_by_length
VAR_STEPS, VAR_SAVE, VAR_BATCH = 12, 6, 4  # 20 sentences, batch 4: 5 steps per epoch, the checkpoint in epoch 2


@pytest.fixture(scope="module")
def sentences(tokenizer):
    """One example per sentence of the corpus, at its own length (8 to N tokens)."""
    with open(os.path.join(DATA, "tiny_corpus.txt")) as f:
        texts = [t for t in f.read().split("\n\n") if t.strip()]
    return examples_at_own_length(DatasetDict(train=Dataset.from_dict({"text": texts})), tokenizer, N,
                                  "sentences")["train"]


def test_sentences_have_variable_lengths(sentences):
    lengths = example_lengths(sentences)
    assert len(sentences) > 40 and min(lengths) < N // 2 and max(lengths) == N and len(set(lengths)) > 10


def test_group_by_length_batches_similar_lengths_in_an_epoch_seeded_order(tokenizer, sentences, tmp_path):
    """group_by_length: the Trainer's sampler sorts each mega-batch by length (much less padding than random
    batches) and its order is a function of (seed, epoch) alone; the lengths are the examples' own, though the
    Trainer strips every column the model does not take before it builds the sampler."""
    grouped = make_trainer(tokenizer, sentences, str(tmp_path / "g"), "common", group_by_length=True)
    assert grouped.args.train_sampling_strategy == "group_by_length"
    sampler = grouped._get_train_sampler()
    assert isinstance(sampler, EpochLengthGroupedSampler)
    lengths = [len(ids) for ids in sentences["input_ids"]]
    assert sampler.lengths == lengths

    def padding(trainer):
        return sum(int((b["attention_mask"] == 0).sum()) for b in trainer.get_train_dataloader())

    random_order = make_trainer(tokenizer, sentences, str(tmp_path / "r"), "common")
    assert padding(grouped) < 0.6 * padding(random_order)
    sampler.set_epoch(1)
    first = list(sampler)
    assert sorted(first) == list(range(len(sentences)))
    mega = 4 * min(len(sentences) // 16, 50)  # LengthGroupedSampler's mega-batch: each sorted longest first
    for start in range(mega, len(first), mega):
        chunk = [lengths[i] for i in first[start:start + mega]]
        assert chunk == sorted(chunk, reverse=True)
    torch.manual_seed(12345)  # the global RNG plays no part
    assert list(sampler) == first
    sampler.set_epoch(2)
    assert list(sampler) != first
    # a length column (--length_column_name), which the Trainer strips before building the sampler, is still read
    flagged = sentences.add_column("length", [100 - t for t in lengths])
    column = make_trainer(tokenizer, flagged, str(tmp_path / "c"), "common", group_by_length=True)
    assert column._get_train_sampler(column._remove_unused_columns(flagged)).lengths == [100 - t for t in lengths]


def _example_by_example_loss(model, collator, evaluation):
    """The eval set's cross-entropy summed over its masked tokens / their number, one example at a time."""
    total, items = 0.0, 0
    with torch.no_grad():
        for i in range(len(evaluation)):
            batch = collator([evaluation[i]])
            labels = batch.pop("labels")  # (1, t): the example's own length, no padding
            chosen = labels != -100
            logits = model(**batch).logits  # (1, t, vocab)
            total += torch.nn.functional.cross_entropy(logits[chosen], labels[chosen], reduction="sum").item()
            items += int(chosen.sum())
    return total / items


@pytest.mark.parametrize("group_by_length", [False, True])
def test_eval_loss_is_token_weighted_on_variable_lengths(tokenizer, sentences, tmp_path, group_by_length):
    """Variable-length sentences, padded per batch: eval_loss is the example-by-example token-weighted loss (no
    padding at all) for eval batches 1, 3 and 8, in order or grouped by length."""
    evaluation = sentences.select(range(13))
    assert len(set(example_lengths(evaluation))) > 5
    model = tiny_model(tokenizer, "common").eval()
    collator = MlmCollator(tokenizer)
    collator.epoch = None
    by_hand = _example_by_example_loss(model, collator, evaluation)
    losses = []
    for size in (1, 3, 8):
        trainer = make_trainer(tokenizer, sentences, str(tmp_path / str(size)), "common", model=model,
                               per_device_eval_batch_size=size, group_by_length=group_by_length)
        losses.append(trainer.evaluate(eval_dataset=evaluation)["eval_loss"])
    assert losses == pytest.approx([by_hand] * 3, rel=1e-5), losses
    assert max(losses) - min(losses) <= 1e-5 * by_hand


def _var_trainer(tokenizer, data, out, seed=0, callbacks=None):
    return make_trainer(tokenizer, data, out, "per_layer", seed=seed, callbacks=callbacks, group_by_length=True,
                        max_steps=VAR_STEPS, save_steps=VAR_SAVE, per_device_train_batch_size=VAR_BATCH)


def test_resume_is_exact_on_variable_lengths_grouped_by_length(tokenizer, sentences, tmp_path):
    """Sentences of 8 to 32 tokens, group_by_length, R per layer: 12 steps in one go, and 6 steps + resume from
    checkpoint-6 (in the second epoch: the sampler's order must not come from the RNG at resume time), end with
    the same weights, bit for bit, after the same losses."""
    data = sentences.select(range(5 * VAR_BATCH))
    full = _var_trainer(tokenizer, data, str(tmp_path / "full"))
    full.train()
    checkpoint = os.path.join(full.args.output_dir, f"checkpoint-{VAR_SAVE}")
    resumed = _var_trainer(tokenizer, data, str(tmp_path / "resumed"), seed=123)  # other initial weights
    resumed.train(resume_from_checkpoint=checkpoint)
    steps, resumed_losses = logged(resumed, "loss", VAR_SAVE)
    assert steps == list(range(VAR_SAVE + 1, VAR_STEPS + 1))
    assert resumed_losses == logged(full, "loss", VAR_SAVE)[1]
    final, again = full.model.state_dict(), resumed.model.state_dict()
    assert final.keys() == again.keys()
    for name, tensor in final.items():
        assert torch.equal(again[name], tensor), name
