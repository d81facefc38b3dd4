"""The user's workflow on encoders other than BERT: analyze → derive → convert → load → train, and the refusal of
models partial attention cannot run in (a decoder, DeBERTa v1), through the command line."""

import os

import pytest
import torch
from transformers import AutoModel, AutoModelForMaskedLM, AutoTokenizer

from hf_partial_attention import AttentionPattern, cli
from hf_partial_attention.analysis.corpus import default_texts
from hf_partial_attention.training import MlmCollator, PartialAttentionTrainer, PartialAttentionTrainingArguments

SIZES = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=37)


def _save(model, tokenizer, path):
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def encoders(tmp_path_factory, minilm_path):
    """A tiny random RoBERTa and ModernBERT (masked LM) with the MiniLM tokenizer, so that they read real text."""
    from transformers import ModernBertConfig, ModernBertForMaskedLM, RobertaConfig, RobertaForMaskedLM

    tok = AutoTokenizer.from_pretrained(minilm_path)
    ids = dict(vocab_size=tok.vocab_size, pad_token_id=tok.pad_token_id, bos_token_id=tok.cls_token_id,
               eos_token_id=tok.sep_token_id)
    torch.manual_seed(0)
    roberta = RobertaForMaskedLM(RobertaConfig(**SIZES, **ids, max_position_embeddings=66))
    modernbert = ModernBertForMaskedLM(ModernBertConfig(**SIZES, **ids, cls_token_id=tok.cls_token_id,
                                                        sep_token_id=tok.sep_token_id, mask_token_id=tok.mask_token_id,
                                                        max_position_embeddings=64, global_attn_every_n_layers=2,
                                                        local_attention=8))
    root = tmp_path_factory.mktemp("encoders")
    return {"roberta": _save(roberta, tok, root / "roberta"), "modernbert": _save(modernbert, tok, root / "modernbert")}


@pytest.mark.parametrize("model_type", ["roberta", "modernbert"])
def test_analyze_derive_convert_load_train(model_type, encoders, tmp_path, capsys):
    source = encoders[model_type]
    text = tmp_path / "text.txt"
    text.write_text("\n\n".join(default_texts()[:6]), encoding="utf-8")
    run = str(tmp_path / "run")
    assert cli.main(["analyze", "--model", source, "--text-file", str(text), "--seq-len", "16", "--max-sequences",
                     "12", "--heldout-every", "0", "--out", run, "--no-progress"]) == 0
    assert cli.main(["derive", run, "--k", "5", "--no-baselines", "--no-evaluate", "--no-progress"]) == 0
    pattern = os.path.join(run, "patterns", "per_query_k5.safetensors")
    ckpt = str(tmp_path / "ckpt")
    capsys.readouterr()
    assert cli.main(["convert", pattern, "--out", ckpt, "--model", source, "--reconstruction", "per_layer"]) == 0
    cls_name = {"roberta": "PartialRobertaModel", "modernbert": "PartialModernBertModel"}[model_type]
    assert capsys.readouterr().out.strip().endswith(f"reloads as {cls_name}")  # the encoder, as for PartialBert
    fitted = AttentionPattern.load(pattern)

    encoder = AutoModel.from_pretrained(ckpt)
    assert type(encoder).__name__ == cls_name
    assert torch.equal(encoder.get_pattern().indices, fitted.indices)  # the derived P, not a default
    original, info = AutoModel.from_pretrained(source, output_loading_info=True)
    partial_names = set(encoder._partial_tensor_names())
    for name, value in original.state_dict().items():  # every weight of the source, under its own name
        if name not in info["missing_keys"]:  # (a pooler the masked-LM source never had is new in both)
            assert torch.equal(encoder.state_dict()[name], value), name
    assert partial_names and not partial_names & set(original.state_dict())
    # the masked-LM head on the converted encoder (the head is new: convert writes the encoder) trains two steps
    model = AutoModelForMaskedLM.from_pretrained(ckpt)
    assert type(model).__name__ == cls_name.replace("Model", "ForMaskedLM")
    assert torch.equal(model.get_pattern().indices, fitted.indices)
    card = open(os.path.join(ckpt, "README.md"), encoding="utf-8").read()
    assert model_type in card.split("---")[1]  # the card's tags name the architecture

    tok = AutoTokenizer.from_pretrained(ckpt)
    enc = tok(default_texts()[6:14], truncation=True, max_length=16, padding="max_length", return_tensors="pt")
    windows = [{"input_ids": i, "attention_mask": m} for i, m in zip(enc["input_ids"], enc["attention_mask"])]
    before = {k: v.detach().clone() for k, v in model.reconstruction_tensors().items()}
    args = PartialAttentionTrainingArguments(output_dir=str(tmp_path / "train"), max_steps=2,
                                             per_device_train_batch_size=4, learning_rate=1e-3, use_cpu=True,
                                             report_to="none", disable_tqdm=True, save_strategy="no",
                                             reconstruction_learning_rate=1e-2)
    trainer = PartialAttentionTrainer(model=model, args=args, train_dataset=windows, data_collator=MlmCollator(tok))
    trainer.train()
    after = model.reconstruction_tensors()
    assert set(after) == set(before) and all(not torch.equal(after[k], before[k]) for k in before)  # R trained
    assert torch.equal(model.get_pattern().indices, fitted.indices)  # P never changes


def _tiny(kind, path):
    from transformers import DebertaConfig, DebertaModel, LlamaConfig, LlamaForCausalLM

    model = {"llama": lambda: LlamaForCausalLM(LlamaConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2,
                                                            num_attention_heads=4, num_key_value_heads=2,
                                                            intermediate_size=37)),
             "deberta": lambda: DebertaModel(DebertaConfig(vocab_size=99, **SIZES))}[kind]()
    model.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("kind, why", [("llama", "decoder"), ("deberta", "AttentionInterface")])
def test_convert_refuses_a_model_it_cannot_run_in_one_line_writing_nothing(kind, why, tmp_path, capsys):
    source = _tiny(kind, tmp_path / "source")
    capsys.readouterr()  # saving the source may draw progress bars: only convert's output is read below
    pattern = tmp_path / "p.safetensors"
    local = AttentionPattern.local(16, 4)
    AttentionPattern(local.indices, local.reconstruction, metadata={"source_model": source}).save(pattern)
    out = tmp_path / "ckpt"
    assert cli.main(["convert", str(pattern), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"model type {kind!r}" in err and why in err, err
    assert "roberta" in err and "modernbert" in err  # what is supported
    assert not out.exists()


@pytest.mark.parametrize("model_type", ["roberta", "modernbert", "distilbert"])
def test_recovery_by_attention_transfer_and_distillation_from_the_exact_twin(model_type, tmp_path):
    """A converted masked LM recovers under `PartialAttentionTrainer` (its exact twin built from it): attention
    transfer trains R only, and its loss falls; distillation then trains the rest; the teacher stays frozen."""
    from test_encoders import source_model

    from hf_partial_attention import AttentionPattern, partial_class_for
    from hf_partial_attention.analysis import collect_covariance, select_pattern
    from hf_partial_attention.training.recovery import exact_teacher

    source = source_model(model_type, "AutoModelForMaskedLM").float()
    with torch.no_grad():  # peaked attention (a random init's is near uniform, where partial is already exact)
        for name, p in source.named_parameters():
            if any(part in name for part in (".query.", ".key.", ".q_lin.", ".k_lin.", ".Wqkv.")):
                p.mul_(25.0)
    # P and R from the analysis of this peaked model, as `analyze` + `derive` would fit them, then R moved off its
    # least-squares optimum (as a pattern fitted on other text would be) so that the transfer has something to recover
    windows = torch.randint(6, 99, (64, 16), generator=torch.Generator().manual_seed(1))  # (S, n)
    fit = select_pattern(collect_covariance(source, windows, seq_len=16, progress=False, distributed=False), 5)
    noise = 0.05 * torch.randn(fit.reconstruction.shape, generator=torch.Generator().manual_seed(2))
    pattern = AttentionPattern(fit.indices, fit.reconstruction + noise.to(fit.reconstruction.dtype))

    def convert():
        return partial_class_for(model_type, "AutoModelForMaskedLM").from_source(source, pattern,
                                                                                reconstruction="per_layer")

    teacher = exact_teacher(convert())
    assert type(teacher) is type(source)
    ids = torch.randint(6, 99, (16, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(teacher(input_ids=ids[:2]).logits, source(input_ids=ids[:2]).logits)
    windows = [{"input_ids": row, "attention_mask": torch.ones_like(row)} for row in ids]

    class Collator:  # MLM labels: every 4th token, the rest ignored
        def __call__(self, rows):
            out = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
            out["labels"] = torch.where(torch.arange(16) % 4 == 0, out["input_ids"], -100)
            return out

    def run(objective, steps, **kw):
        model = convert()  # attention transfer freezes all but R: each run starts from the conversion
        # one batch of all 16 windows: every step's loss is on the same data, so first and last compare
        args = PartialAttentionTrainingArguments(
            output_dir=str(tmp_path / objective), max_steps=steps, per_device_train_batch_size=16, logging_steps=1,
            learning_rate=1e-3, reconstruction_learning_rate=1e-2, use_cpu=True, report_to="none",
            disable_tqdm=True, save_strategy="no", recovery_objective=objective, **kw)
        trainer = PartialAttentionTrainer(model=model, args=args, train_dataset=windows, data_collator=Collator())
        before = {k: v.detach().clone() for k, v in model.state_dict().items()}
        trainer.train()
        changed = {k for k, v in model.state_dict().items() if v.is_floating_point() and not torch.equal(v, before[k])}
        return trainer, changed

    trainer, changed = run("attention_transfer", 6, attention_transfer_parameters="reconstruction")
    assert changed and all("reconstruction" in name for name in changed)
    losses = [h["recovery/attention_transfer"] for h in trainer.state.log_history if "loss" in h]
    assert losses[-1] < losses[0]
    trainer, changed = run("attention_transfer,distill", 2)
    assert any("reconstruction" not in name for name in changed)
    assert not any(p.requires_grad for p in trainer.teacher_model.parameters())


def test_attention_transfer_is_refused_for_albert_naming_the_alternative():
    from test_encoders import fitted_pattern, source_model

    from hf_partial_attention import partial_class_for
    from hf_partial_attention.training.recovery import attention_modules

    model = partial_class_for("albert").from_source(source_model("albert"), fitted_pattern("albert"))
    with pytest.raises(ValueError, match="one attention module in several layers.*distill"):
        attention_modules(model)


def test_a_sentence_transformers_roberta_converts_with_its_pooling_and_normalisation(encoders, tmp_path):
    """A sentence-transformers model on a RoBERTa: converted with k = n it embeds as the original (its mean pooling
    and Normalize carried over); with k < n it loads and embeds unit vectors."""
    from sentence_transformers import SentenceTransformer, models

    from hf_partial_attention.analysis.workflow import convert

    body = models.Transformer(encoders["roberta"], max_seq_length=16)
    pooling = models.Pooling(body.get_word_embedding_dimension(), pooling_mode="mean")
    original = SentenceTransformer(modules=[body, pooling, models.Normalize()], device="cpu")
    st_dir = tmp_path / "st"
    original.save(str(st_dir))
    texts = default_texts()[20:23]
    for name, pattern in (("exact", AttentionPattern.exact(16)), ("k5", AttentionPattern.local(16, 5))):
        path = tmp_path / f"{name}.safetensors"
        AttentionPattern(pattern.indices, pattern.reconstruction, metadata={"source_model": str(st_dir)}).save(path)
        result = convert(str(path), str(tmp_path / name), reconstruction="fixed")
        assert result["partial_class"] == "PartialRobertaModel" and result["sentence_transformers"]
        converted = SentenceTransformer(str(tmp_path / name), device="cpu", trust_remote_code=True)
        assert type(converted[0].auto_model).__name__ == "PartialRobertaModel"
        emb = converted.encode(texts, convert_to_tensor=True)
        torch.testing.assert_close(emb.norm(dim=-1), torch.ones(len(texts)), atol=1e-5, rtol=0)
        if name == "exact":
            torch.testing.assert_close(emb, original.encode(texts, convert_to_tensor=True), atol=1e-5, rtol=0)


def test_length_buckets_with_a_k_per_bucket_on_a_modernbert(encoders, tmp_path, capsys):
    """``analyze --inputs sentences --lengths`` → ``derive --bucket-k`` → ``convert`` on a ModernBERT: the checkpoint
    holds each bucket's own k and P, and a short input runs its bucket's P and R as the buckets file gives them."""
    from hf_partial_attention import partial_class_for
    from hf_partial_attention.pattern_buckets import PatternBuckets

    source = encoders["modernbert"]
    text = tmp_path / "text.txt"
    text.write_text("\n\n".join(default_texts()[:40]), encoding="utf-8")
    run = str(tmp_path / "run")
    assert cli.main(["analyze", "--model", source, "--inputs", "sentences", "--text-file", str(text), "--lengths",
                     "12", "24", "--out", run, "--no-progress"]) == 0
    assert cli.main(["derive", run, "--k", "4", "--bucket-k", "12=6", "--no-evaluate", "--no-progress"]) == 0
    path = os.path.join(run, "patterns", "buckets_k4_b12k6.safetensors")
    buckets = PatternBuckets.load(path)
    assert buckets.lengths_k == [6, 4]
    ckpt = str(tmp_path / "ckpt")
    assert cli.main(["convert", path, "--out", ckpt, "--model", source, "--reconstruction", "common"]) == 0
    model = AutoModel.from_pretrained(ckpt).double().eval()  # float64: the random model's scores are near uniform
    assert type(model).__name__ == "PartialModernBertModel"
    assert (model.config.partial_lengths, model.config.partial_lengths_k) == ([12, 24], [6, 4])
    fresh = partial_class_for("modernbert").from_source(source, buckets, reconstruction="common").double().eval()
    exact = AutoModel.from_pretrained(source).double().eval()
    longest = partial_class_for("modernbert").from_source(source, buckets[24], reconstruction="common").double().eval()
    ids = torch.randint(1000, 2000, (1, 10), generator=torch.Generator().manual_seed(0))  # runs bucket 12
    with torch.no_grad():
        out = model(input_ids=ids).last_hidden_state
        torch.testing.assert_close(out, fresh(input_ids=ids).last_hidden_state, atol=1e-12, rtol=0)
        assert (out - exact(input_ids=ids).last_hidden_state).abs().max() > 1e-7  # k_12 = 6 < 10: P in effect
        assert (out - longest(input_ids=ids).last_hidden_state).abs().max() > 1e-7  # bucket 12's, not n = 24's
