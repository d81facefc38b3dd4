"""Recovery objectives (`training.recovery`): each term against an independent computation, what trains, the loss
normalisation under accumulation, evaluation, and exact resume."""

import os

import pytest
import torch
import torch.nn.functional as F
from transformers import BertConfig, BertForMaskedLM, BertModel

from hf_partial_attention import PartialBertForMaskedLM, PartialBertModel
from hf_partial_attention.pattern import AttentionPattern
from hf_partial_attention.training import (
    MlmCollator,
    PartialAttentionTrainer,
    PartialAttentionTrainingArguments,
)
from hf_partial_attention.training.recovery import (
    exact_teacher,
    parse_recovery_objective,
    recovery_losses,
)

N, K = 32, 8


def bert_config(tokenizer):
    return BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                      intermediate_size=37, max_position_embeddings=64, hidden_dropout_prob=0.0,
                      attention_probs_dropout_prob=0.0)


def converted(tokenizer, mode="per_layer", head=PartialBertForMaskedLM, seed=0):
    """(exact source, its PartialBert conversion): a random tiny BERT (3 layers: 0 and 1 partial)."""
    torch.manual_seed(seed)
    source = (BertForMaskedLM if head is PartialBertForMaskedLM else BertModel)(bert_config(tokenizer)).eval()
    with torch.no_grad():  # peaked attention (a random init's is near uniform, where partial is already exact)
        for name, p in source.named_parameters():
            if ".self.query." in name or ".self.key." in name:
                p.mul_(25.0)
    return source, head.from_bert(source, AttentionPattern.local(N, K), reconstruction=mode)


def batch(tokenizer, windows, rows=4, pad=True):
    """Real windows; with ``pad`` the second row is cut to 19 tokens and padded (a mixed-length batch)."""
    ids = torch.tensor(windows[:rows]["input_ids"])  # (B, N)
    mask = torch.ones_like(ids)
    if pad:
        ids[1, 19:], mask[1, 19:] = tokenizer.pad_token_id, 0
    return {"input_ids": ids, "attention_mask": mask}


def test_exact_teacher_is_the_source_model(tokenizer, windows):
    source, student = converted(tokenizer)
    teacher = exact_teacher(student)
    inputs = batch(tokenizer, windows)
    with torch.no_grad():
        torch.testing.assert_close(teacher(**inputs).logits, source(**inputs).logits, rtol=1e-5, atol=1e-5)
        # and the student is not exact, so the objectives have something to close
        assert (student(**inputs).logits - source(**inputs).logits).abs().max() > 1e-3
    assert not any(p.requires_grad for p in teacher.parameters())


def test_attention_transfer_matches_each_layer_on_the_teachers_inputs(tokenizer, windows):
    """Reference: the teacher's hidden_states[i] through both models' layer-i attention, without hooks (a batch
    without padding, so no mask is needed); the loss and its gradient in R must agree. Feeding each student layer
    its own input instead of the teacher's changes layer 1's term (and fails this test)."""
    _, student = converted(tokenizer, "per_layer")
    teacher = exact_teacher(student)
    inputs = batch(tokenizer, windows, pad=False)
    objective = parse_recovery_objective("attention_transfer")
    loss, terms = recovery_losses(student, teacher, inputs, objective, student.config.partial_layers)
    with torch.no_grad():
        hidden = teacher.bert(**inputs, output_hidden_states=True).hidden_states
    ref = []
    for i in student.config.partial_layers:
        s = student.bert.encoder.layer[i].attention.self(hidden[i])[0]
        with torch.no_grad():
            t = teacher.bert.encoder.layer[i].attention.self(hidden[i])[0]
        ref.append((s - t).pow(2).mean())
    ref = torch.stack(ref).mean()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=0.0)  # the loss is ~7e-3: no absolute slack
    assert float(terms["attention_transfer"]) > 1e-6
    r = student.bert.encoder.layer[1].attention.self.reconstruction
    (g,) = torch.autograd.grad(loss, r, retain_graph=True)
    (g_ref,) = torch.autograd.grad(ref, r)
    torch.testing.assert_close(g, g_ref, rtol=1e-4, atol=1e-9)
    assert g.abs().max() > 1e-6


def test_attention_transfer_ignores_padding(tokenizer, windows):
    """A padded row's loss counts its real tokens only: the same row alone gives the same per-token error."""
    _, student = converted(tokenizer, "per_layer")
    teacher = exact_teacher(student)
    objective = parse_recovery_objective("attention_transfer")
    padded = batch(tokenizer, windows, rows=2)
    alone = {k: v[1:2, :19] for k, v in padded.items()}
    first = {k: v[0:1] for k, v in padded.items()}
    with torch.no_grad():
        both, _ = recovery_losses(student, teacher, padded, objective, [0, 1])
        a, _ = recovery_losses(student, teacher, alone, objective, [0, 1])
        b, _ = recovery_losses(student, teacher, first, objective, [0, 1])
    # token-weighted mean over 32 + 19 real tokens, per layer: exact for one layer, so check with one layer
    with torch.no_grad():
        both1, _ = recovery_losses(student, teacher, padded, objective, [1])
        a1, _ = recovery_losses(student, teacher, alone, objective, [1])
        b1, _ = recovery_losses(student, teacher, first, objective, [1])
    torch.testing.assert_close(both1, (32 * b1 + 19 * a1) / 51, rtol=1e-4, atol=1e-7)
    assert both > 0 and a > 0 and b > 0


def test_distill_terms_against_direct_computation(tokenizer, windows):
    _, student = converted(tokenizer, "common")
    teacher = exact_teacher(student)
    inputs = batch(tokenizer, windows)
    objective = parse_recovery_objective("distill", "2.0")
    assert objective.weights == {"distill_kl": 2.0, "distill_hidden": 2.0}
    loss, terms = recovery_losses(student, teacher, inputs, objective, [0, 1], temperature=2.0)
    real = inputs["attention_mask"].bool()
    with torch.no_grad():
        s, t = student(**inputs, output_hidden_states=True), teacher(**inputs, output_hidden_states=True)
        p_t = F.softmax(t.logits[real] / 2.0, -1)  # (tokens, vocab)
        kl = (p_t * (F.log_softmax(t.logits[real] / 2.0, -1) - F.log_softmax(s.logits[real] / 2.0, -1))).sum(-1)
        hidden = torch.stack([((a - b).pow(2).mean(-1)[real]).mean()
                              for a, b in zip(s.hidden_states, t.hidden_states)]).mean()
    torch.testing.assert_close(terms["distill_kl"], kl.mean() * 4.0, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(terms["distill_hidden"], hidden, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(loss.detach(), 2.0 * (kl.mean() * 4.0 + hidden), rtol=1e-4, atol=1e-6)


def test_embedding_term_is_twice_the_cosine_distance_of_mean_pooled_embeddings(tokenizer, windows):
    source, student = converted(tokenizer, "common", head=PartialBertModel)
    teacher = exact_teacher(student)
    assert type(teacher) is BertModel
    inputs = batch(tokenizer, windows)
    _, terms = recovery_losses(student, teacher, inputs, parse_recovery_objective("embedding", has_mlm_head=False),
                               [0, 1])
    with torch.no_grad():
        def embed(model):
            hidden = model(**inputs).last_hidden_state  # (B, T, hidden)
            m = inputs["attention_mask"].unsqueeze(-1).float()
            return (hidden * m).sum(1) / m.sum(1)  # (B, hidden), the padded row's 19 tokens only
        cos = F.cosine_similarity(embed(student), embed(source), dim=-1)  # (B,)
    torch.testing.assert_close(terms["embedding"], (2 * (1 - cos)).mean(), rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("objective, weights, message", [
    ("attention_transfer,bogus", None, "unknown term 'bogus'"),
    ("mlm,distill", "1", "has 1 values for the 2 terms"),
    ("distill_hidden,distill", None, "lists 'distill_hidden' twice"),
    ("mlm", "-1", "must be >= 0"),
])
def test_objective_errors_name_the_problem(objective, weights, message):
    with pytest.raises(ValueError, match=message):
        parse_recovery_objective(objective, weights)


def test_distill_kl_needs_an_mlm_head():
    assert parse_recovery_objective("distill", has_mlm_head=False).terms == ("distill_hidden",)
    with pytest.raises(ValueError, match="needs an MLM head"):
        parse_recovery_objective("distill_kl", has_mlm_head=False)


def _trainer(tokenizer, windows, out, objective, model=None, mode="per_layer", teacher_model=None, **kw):
    kw = {"max_steps": 6, "per_device_train_batch_size": 4, "save_steps": 3, "learning_rate": 1e-3,
          "reconstruction_learning_rate": 1e-2, **kw}
    args = PartialAttentionTrainingArguments(
        output_dir=out, logging_steps=1, use_cpu=True, report_to="none", seed=0, disable_tqdm=True,
        dataloader_num_workers=0, recovery_objective=objective, **kw)
    model = converted(tokenizer, mode)[1] if model is None else model
    return PartialAttentionTrainer(model=model, args=args, train_dataset=windows, teacher_model=teacher_model,
                                   data_collator=MlmCollator(tokenizer))


def _weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("which, trains", [
    ("reconstruction", lambda n: "reconstruction" in n),
    ("query_key", lambda n: "reconstruction" in n or (".self.query." in n or ".self.key." in n)
     and ".layer.2." not in n),
])
def test_attention_transfer_trains_only_what_it_names(tokenizer, windows, tmp_path, which, trains):
    trainer = _trainer(tokenizer, windows, str(tmp_path), "attention_transfer", attention_transfer_parameters=which)
    before = _weights(trainer.model)
    trainer.train()
    after = _weights(trainer.model)
    changed = {n for n in before if before[n].is_floating_point() and not torch.equal(before[n], after[n])}
    params = {n for n, _ in trainer.model.named_parameters()}
    assert changed == {n for n in params if trains(n)}
    losses = [h["recovery/attention_transfer"] for h in trainer.state.log_history if "loss" in h]
    assert losses[-1] < losses[0]


def test_distill_trains_everything_and_logs_each_term(tokenizer, windows, tmp_path):
    trainer = _trainer(tokenizer, windows, str(tmp_path), "attention_transfer,distill", max_steps=2)
    before = _weights(trainer.model)
    trainer.train()
    after = _weights(trainer.model)
    assert not torch.equal(before["bert.encoder.layer.2.output.dense.weight"],
                           after["bert.encoder.layer.2.output.dense.weight"])
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert {"recovery/attention_transfer", "recovery/distill_kl", "recovery/distill_hidden"} <= set(logs[0])
    # the teacher did not train
    assert not any(p.requires_grad for p in trainer.teacher_model.parameters())


def test_gradient_accumulation_gives_the_same_update(tokenizer, windows, tmp_path):
    """Batch 4 in one step and 2 × 2 accumulated give the same SGD update (the loss is divided by the
    accumulation steps: without that, the accumulated update is twice as large)."""
    runs = []
    for i, (bs, ga) in enumerate(((4, 1), (2, 2))):
        trainer = _trainer(tokenizer, windows, str(tmp_path / str(i)), "attention_transfer", max_steps=1,
                           per_device_train_batch_size=bs, gradient_accumulation_steps=ga, optim="sgd",
                           lr_scheduler_type="constant", reconstruction_learning_rate=1.0)
        before = trainer.model.reconstruction_tensors()["layer.0"].detach().clone()
        trainer.train()
        runs.append(trainer.model.reconstruction_tensors()["layer.0"].detach() - before)
    assert runs[0].abs().max() > 0
    torch.testing.assert_close(runs[1], runs[0], rtol=1e-4, atol=1e-8)


def test_eval_loss_weights_every_example_once(tokenizer, windows, tmp_path):
    trainer = _trainer(tokenizer, windows, str(tmp_path), "attention_transfer", per_device_eval_batch_size=2)
    evaluation = windows.select(range(5))
    got = trainer.evaluate(evaluation)["eval_loss"]
    model = trainer.model.eval()
    per_row = []
    with torch.no_grad():
        for i in range(5):
            one = MlmCollator(tokenizer, epoch=None)([evaluation[i]])
            loss, _ = recovery_losses(model, trainer.teacher_model, one, trainer.recovery, [0, 1])
            per_row.append(float(loss))
    assert got == pytest.approx(sum(per_row) / 5, rel=1e-4)


def test_resume_reproduces_an_uninterrupted_recovery_run(tokenizer, windows, tmp_path):
    """Resumed from the uninterrupted run's step-3 checkpoint, into a model converted afresh: the logged terms after
    step 3 and the final weights are the uninterrupted run's, and the teacher is the model as converted (not the
    checkpoint's partly trained weights)."""
    objective = "attention_transfer,distill_hidden"
    full = _trainer(tokenizer, windows, str(tmp_path / "full"), objective)
    full.train()
    resumed = _trainer(tokenizer, windows, str(tmp_path / "resumed"), objective)
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-3"))
    for key in ("recovery/attention_transfer", "recovery/distill_hidden"):
        after = [[h[key] for h in t.state.log_history if "loss" in h and h["step"] > 3] for t in (full, resumed)]
        assert len(after[1]) == 3 and after[1] == pytest.approx(after[0], rel=1e-5, abs=1e-8), key
    a, b = full.model.state_dict(), resumed.model.state_dict()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-6, msg=name)
    source, _ = converted(tokenizer)
    key = "bert.encoder.layer.0.output.dense.weight"  # trained by distill_hidden in the student, not in the teacher
    torch.testing.assert_close(resumed.teacher_model.state_dict()[key], source.state_dict()[key])
    assert not torch.equal(resumed.model.state_dict()[key], source.state_dict()[key])


def test_a_wrapped_model_needs_its_teacher(tokenizer):
    _, student = converted(tokenizer)
    wrapper = torch.nn.Sequential(student)
    with pytest.raises(TypeError, match="pass the exact model yourself"):
        exact_teacher(wrapper)


def test_a_batch_of_exact_bucket_inputs_is_a_no_op_step(tokenizer, windows, tmp_path):
    """With R alone trained and every input in the exact bucket (T <= k), no trained weight reaches the loss: the step
    must run (not fail in backward) and leave R as it was."""
    from hf_partial_attention.pattern_buckets import PatternBuckets

    torch.manual_seed(0)
    source = BertForMaskedLM(bert_config(tokenizer)).eval()
    buckets = PatternBuckets({N: AttentionPattern.local(N, K)}, exact_lengths=[K])
    student = PartialBertForMaskedLM.from_bert(source, buckets, reconstruction="per_layer")
    assert student.config.partial_lengths == [K, N]
    short = windows.map(lambda row: {"input_ids": row["input_ids"][:K - 1] + [tokenizer.sep_token_id],
                                     "attention_mask": [1] * K, "special_tokens_mask": [1] + [0] * (K - 2) + [1]})
    trainer = _trainer(tokenizer, short, str(tmp_path), "attention_transfer", model=student, max_steps=2)
    before = {k: v.clone() for k, v in student.reconstruction_tensors().items()}
    trainer.train()
    for name, r in student.reconstruction_tensors().items():
        assert torch.equal(r, before[name]), name


def test_every_buckets_r_gets_rs_learning_rate_and_trains_alone(tokenizer):
    """R of shorter buckets (``reconstruction_len16``, in the encoder's pattern module or per layer) is R: in R's
    optimizer group and trainable under attention transfer. Matching only the names ``reconstruction`` and
    ``reconstruction_bias`` left it frozen / at the main learning rate."""
    from hf_partial_attention.pattern_buckets import PatternBuckets
    from hf_partial_attention.training import is_reconstruction_parameter
    from hf_partial_attention.training.recovery import freeze_for_attention_transfer

    torch.manual_seed(0)
    source = BertForMaskedLM(bert_config(tokenizer)).eval()
    buckets = PatternBuckets({16: AttentionPattern.local(16, K), N: AttentionPattern.local(N, K)})
    for mode, expected in (("per_layer", {f"bert.encoder.layer.{i}.attention.self.reconstruction{s}"
                                          for i in (0, 1) for s in ("", "_len16")}),
                           ("common", {"bert.encoder.partial_pattern.reconstruction",
                                       "bert.encoder.partial_pattern_len16.reconstruction"})):
        student = PartialBertForMaskedLM.from_bert(source, buckets, reconstruction=mode)
        assert {n for n, _ in student.named_parameters() if is_reconstruction_parameter(n)} == expected
        assert set(freeze_for_attention_transfer(student, "reconstruction")) == expected
    assert not is_reconstruction_parameter("bert.encoder.layer.0.attention.self.query.weight")


def test_a_bucket_with_its_own_k_trains_its_r(tokenizer, windows, tmp_path):
    """A k per bucket (16 at k = 12, n at K): inputs of 14 tokens train bucket 16's R of shape (16, 4, 12), which then
    reloads from the saved checkpoint with that shape; n's R gets no gradient from them."""
    from hf_partial_attention.pattern_buckets import PatternBuckets

    torch.manual_seed(0)
    source = BertForMaskedLM(bert_config(tokenizer)).eval()
    buckets = PatternBuckets({16: AttentionPattern.local(16, 12), N: AttentionPattern.local(N, K)})
    student = PartialBertForMaskedLM.from_bert(source, buckets, reconstruction="common")
    assert student.config.partial_lengths_k == [12, K]
    short = windows.map(lambda row: {"input_ids": row["input_ids"][:13] + [tokenizer.sep_token_id],
                                     "attention_mask": [1] * 14, "special_tokens_mask": [1] + [0] * 12 + [1]})
    trainer = _trainer(tokenizer, short, str(tmp_path), "attention_transfer", model=student, max_steps=2,
                       teacher_model=source)
    before = {k: v.clone() for k, v in student.reconstruction_tensors().items()}
    trainer.train()
    after = student.reconstruction_tensors()
    assert after["common.len16"].shape == (16, 4, 12) and not torch.equal(after["common.len16"], before["common.len16"])
    assert torch.equal(after["common"], before["common"])
    trainer.save_model(str(tmp_path / "saved"))
    reloaded = PartialBertForMaskedLM.from_pretrained(str(tmp_path / "saved"))
    assert torch.equal(reloaded.reconstruction_tensors()["common.len16"], after["common.len16"])


def test_the_card_of_a_recovery_run_names_its_objective(tokenizer, windows, tmp_path):
    trainer = _trainer(tokenizer, windows, str(tmp_path), "attention_transfer", max_steps=1)
    trainer.train()
    trainer.create_model_card()
    card = open(os.path.join(str(tmp_path), "README.md")).read()
    assert "recovery objective `attention_transfer` against the exact teacher" in card


def test_attention_transfer_trains_lora_adapters_of_a_peft_model(tokenizer, windows, tmp_path):
    """LoRA via peft on the query/key projections, ``attention_transfer_parameters=as_given``: exactly the adapters of
    the partial layers (0 and 1) train, the base weights and the exact layer's adapters do not, and the loss falls
    (one batch of 4 windows every step, so the losses compare)."""
    from peft import LoraConfig, get_peft_model

    source, student = converted(tokenizer)
    model = get_peft_model(student, LoraConfig(r=4, lora_alpha=8, target_modules=["query", "key"]))
    trainer = _trainer(tokenizer, windows.select(range(4)), str(tmp_path), "attention_transfer", model=model,
                       teacher_model=source, learning_rate=5e-2, attention_transfer_parameters="as_given")
    before = _weights(trainer.model)
    trainer.train()
    after = _weights(trainer.model)
    changed = {n for n in before if before[n].is_floating_point() and not torch.equal(before[n], after[n])}
    expected = {n for n in before if "lora_" in n and (".layer.0." in n or ".layer.1." in n)}
    assert expected and changed == expected
    losses = [h["recovery/attention_transfer"] for h in trainer.state.log_history if "loss" in h]
    assert losses[-1] < losses[0]
