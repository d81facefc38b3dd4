"""The two architectures whose scores carry position terms their attention modules add themselves, MPNet (a bias) and
DeBERTa-v2 (content-to-position and position-to-content terms), through what a user does with them: k = n equals the
source with the plugin and by remote code, analyze → derive in every form → convert → AutoModel, peft and compile.
What is particular to each: tests/test_mpnet.py, tests/test_deberta.py; what the table gives every encoder:
tests/test_encoders.py."""

import os

import pytest
import torch
from transformers import AutoModel, AutoTokenizer

from hf_partial_attention import AttentionPattern, cli, partial_class_for
from hf_partial_attention.analysis.corpus import default_texts
from hf_partial_attention.architectures import architecture_for

from test_encoders import tiny_config

N, K = 16, 5
TYPES = ["mpnet", "deberta-v2"]
# the position parameters each tiny model draws at scale 1 (the tiny init's std 0.02 barely moves a score), and the
# projections LoRA targets
POSITIONS = {"mpnet": "encoder.relative_attention_bias.weight", "deberta-v2": "encoder.rel_embeddings.weight"}
LORA_TARGETS = {"mpnet": ["q", "v"], "deberta-v2": ["query_proj", "value_proj"]}
# what convert prints of an exact score's cost (tiny configs: d_h = 8; DeBERTa-v2's score has three terms)
DIM_PHRASE = {"mpnet": "d_h = 8", "deberta-v2": "d = 24 (d_h = 8 times 3 score terms)"}


def source(model_type: str, auto: str = "AutoModelForMaskedLM", vocab_size: int = 99):
    """A tiny ``model_type`` source model of class ``auto`` (float64, eval) whose position terms matter."""
    torch.manual_seed(0)
    config = tiny_config(model_type)
    config.vocab_size = vocab_size
    model = architecture_for(model_type).source_class(auto)(config).double().eval()
    with torch.no_grad():
        model.base_model.get_parameter(POSITIONS[model_type]).normal_(0.0, 1.0)
    return model


def batch():
    """A padded batch: sequence 0 of N tokens, sequence 1 of 9 (padding after)."""
    ids = torch.randint(6, 99, (2, N), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    return ids, mask


def tiny_folder(model_type: str, folder, minilm_path) -> str:
    """A tiny ``model_type`` masked LM with the MiniLM tokenizer (real text), saved as a source checkpoint."""
    tok = AutoTokenizer.from_pretrained(minilm_path)
    source(model_type, vocab_size=tok.vocab_size).float().save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", TYPES)
def test_every_key_exact_equals_the_source_in_each_head_with_and_without_the_plugin(model_type, tmp_path):
    """k = n (every layer partial, R empty) equals the source in float32 on a padded batch (≤ 1e-5) for the base
    model, the masked LM and the classifier, with the plugin and by remote code in a process that cannot import it."""
    from test_encoders import N as TABLE_N, batch as table_batch
    from test_hub import remote_load_results

    arch = architecture_for(model_type)
    ids, mask = table_batch()
    jobs = []
    for auto in ("AutoModel", "AutoModelForMaskedLM", "AutoModelForSequenceClassification"):
        torch.manual_seed(0)
        model_source = arch.source_class(auto)(tiny_config(model_type)).eval()
        model = partial_class_for(model_type, auto).from_source(model_source, AttentionPattern.exact(TABLE_N),
                                                                partial_layers=[0, 1, 2]).eval()
        with torch.no_grad():
            want = model_source(input_ids=ids, attention_mask=mask)[0]
            got = model(input_ids=ids, attention_mask=mask)[0]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0, msg=f"{model_type} {auto}")
        folder = tmp_path / auto
        model.save_pretrained(folder)
        partial = {k: v for k, v in model.state_dict().items() if "partial_pattern" in k or "reconstruction" in k}
        torch.save({"ids": ids, "mask": mask.long(), "out": want, "partial": partial}, folder / "reference.pt")
        jobs.append(f"{folder} {auto}")
    for folder, result in remote_load_results(jobs, tmp_path).items():  # against the source's outputs
        module, diff, same_r = result.split()
        assert module == "transformers_modules" and float(diff) <= 1e-5 and same_r == "True", (folder, result)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", TYPES)
def test_analyze_derive_every_form_convert_load(model_type, tmp_path, capsys, minilm_path):
    """One analysis (per head, sentences in length buckets 12 and 16) → derive pooled, per layer, per head, per head at
    a QKᵀ saving → convert each → AutoModel loads the partial class running the derived P and a k per layer."""
    folder = tiny_folder(model_type, tmp_path / "source", minilm_path)
    text = tmp_path / "text.txt"
    text.write_text("\n\n".join(default_texts()[:20]), encoding="utf-8")
    run = str(tmp_path / "run")
    assert cli.main(["analyze", "--model", folder, "--text-file", str(text), "--inputs", "sentences",
                     "--max-sequences", "48", "--heldout-every", "0", "--granularity", "head", "--lengths", "12", "16",
                     "--out", run, "--no-progress"]) == 0
    forms = {"buckets_k5": ([], "pooled"), "buckets_per_query_layer_k5": (["--granularity", "layer"], "layer"),
             "buckets_per_query_head_k5": (["--granularity", "head"], "head"),
             "buckets_per_query_head_saving0.3_budget": (["--granularity", "head", "--saving", "0.3"], "head")}
    cls_name = partial_class_for(model_type).__name__
    ids, mask = batch()
    for name, (flags, granularity) in forms.items():
        assert cli.main(["derive", run, "--k", str(K), "--no-baselines", "--no-evaluate", "--no-progress",
                         *flags]) == 0, name
        ckpt = str(tmp_path / f"ckpt_{name}")
        capsys.readouterr()
        assert cli.main(["convert", os.path.join(run, "patterns", name + ".safetensors"), "--out", ckpt, "--model",
                         folder, "--reconstruction", "fixed"]) == 0, name
        printed = capsys.readouterr().out
        assert f"reloads as {cls_name}" in printed, name
        assert f"at n = 16, {DIM_PHRASE[model_type]}: a saving of" in printed, name
        model = AutoModel.from_pretrained(ckpt).eval()
        assert type(model).__name__ == cls_name
        assert model.config.partial_granularity == granularity and model.config.partial_lengths == [12, 16], name
        assert ("budget" in name) == (model.config.partial_layers_k is not None), name
        with torch.no_grad():
            assert torch.isfinite(model(input_ids=ids, attention_mask=mask).last_hidden_state).all()


@pytest.mark.parametrize("model_type", TYPES)
def test_peft_lora_with_r_under_modules_to_save(model_type, tmp_path):
    """LoRA on the query and value projections with the common R trained through modules_to_save: R trains, and the
    saved adapter reloads the same model."""
    from peft import LoraConfig, PeftModel, get_peft_model

    def base():
        return partial_class_for(model_type, "AutoModelForMaskedLM").from_source(
            source(model_type).float(), AttentionPattern.local(N, K, correlation=0.5), reconstruction="common")

    model = get_peft_model(base(), LoraConfig(target_modules=LORA_TARGETS[model_type],
                                              modules_to_save=["partial_pattern"]))
    r0 = base().base_model.encoder.partial_pattern.reconstruction.detach().clone()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids, mask = batch()
    for _ in range(3):
        model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    trained = model.base_model.model.base_model.encoder.partial_pattern.modules_to_save["default"].reconstruction
    assert float((trained.detach() - r0).abs().max()) > 1e-3
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    model.save_pretrained(tmp_path)
    reloaded = PeftModel.from_pretrained(base(), tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids, attention_mask=mask).logits, logits, rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", TYPES)
def test_compiled_equals_eager(model_type):
    """torch.compile (fullgraph: no graph break from the adapter) gives the eager model's outputs, R frozen (the
    compiled fast path for MPNet; W in the graph for DeBERTa's position terms) and trained."""
    ids, mask = batch()
    for mode in ("fixed", "per_layer"):
        model = partial_class_for(model_type).from_source(source(model_type, "AutoModel").float(),
                                                          AttentionPattern.local(N, K, correlation=0.5),
                                                          reconstruction=mode).eval()
        with torch.no_grad():
            eager = model(input_ids=ids, attention_mask=mask).last_hidden_state
            compiled = torch.compile(model, fullgraph=True, backend="aot_eager")(input_ids=ids, attention_mask=mask)
        torch.testing.assert_close(compiled.last_hidden_state, eager, atol=1e-5, rtol=0)
