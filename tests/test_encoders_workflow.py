"""The user's workflow on encoders other than BERT: analyze → derive → convert → load → train, and the refusal of
models partial attention cannot run in (a decoder, DeBERTa-v2, MPNet), through the command line."""

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
    from transformers import (DebertaV2Config, DebertaV2Model, LlamaConfig, LlamaForCausalLM, MPNetConfig,
                              MPNetModel)

    model = {"llama": lambda: LlamaForCausalLM(LlamaConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2,
                                                            num_attention_heads=4, num_key_value_heads=2,
                                                            intermediate_size=37)),
             "deberta-v2": lambda: DebertaV2Model(DebertaV2Config(vocab_size=99, **SIZES)),
             "mpnet": lambda: MPNetModel(MPNetConfig(vocab_size=99, **SIZES))}[kind]()
    model.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("kind, why", [("llama", "decoder"), ("deberta-v2", "AttentionInterface"),
                                       ("mpnet", "AttentionInterface")])
def test_convert_refuses_a_model_it_cannot_run_in_one_line_writing_nothing(kind, why, tmp_path, capsys):
    source = _tiny(kind, tmp_path / "source")
    pattern = tmp_path / "p.safetensors"
    local = AttentionPattern.local(16, 4)
    AttentionPattern(local.indices, local.reconstruction, metadata={"source_model": source}).save(pattern)
    out = tmp_path / "ckpt"
    assert cli.main(["convert", str(pattern), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"model type {kind!r}" in err and why in err, err
    assert "roberta" in err and "modernbert" in err  # what is supported
    assert not out.exists()
