"""peft: LoRA on q/v with a common R trained through modules_to_save=["partial_pattern"], saved and reloaded."""

import torch
from peft import LoraConfig, PeftModel, get_peft_model

from hf_partial_attention import AttentionPattern, PartialBertConfig, PartialBertForMaskedLM

TINY = dict(vocab_size=99, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=37,
            partial_seq_len=16, partial_k=4, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
            initializer_range=0.5)  # large weights: scores, and so R, matter to the output


def _base():
    torch.manual_seed(0)
    return PartialBertForMaskedLM(PartialBertConfig(**TINY, reconstruction="common"))


def _train(model) -> torch.Tensor:
    """Three AdamW steps of the MLM loss on a fixed batch (returned: the token ids)."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(1, 99, (4, 16), generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return ids


def _lora_only(base, model):
    """``base`` with LoRA on q/v holding ``model``'s trained LoRA weights (its R as it started)."""
    lora = get_peft_model(base, LoraConfig(target_modules=["query", "value"]))
    lora.load_state_dict({k: v for k, v in model.state_dict().items() if "lora_" in k}, strict=False)
    return lora.eval()


def _check_reload(model, base, ids, logits, tmp_path):
    model.save_pretrained(tmp_path)
    reloaded = PeftModel.from_pretrained(base, tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, logits, rtol=0, atol=0)


def test_common_r_trains_under_modules_to_save_and_reloads(tmp_path):
    model = get_peft_model(_base(), LoraConfig(target_modules=["query", "value"], modules_to_save=["partial_pattern"]))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad and "partial_pattern" in n]
    assert trainable == ["base_model.model.bert.encoder.partial_pattern.modules_to_save.default.reconstruction"]
    r0 = _base().bert.encoder.partial_pattern.reconstruction.detach().clone()
    ids = _train(model)
    wrapper = model.base_model.model.bert.encoder.partial_pattern
    trained_r = wrapper.modules_to_save["default"].reconstruction.detach().clone()
    assert float((trained_r - r0).abs().max()) > 1e-3  # peft's copy of R was trained ...
    assert torch.equal(wrapper.original_module.reconstruction.detach(), r0)  # ... the original kept
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        # the model runs the trained R: the same as the merged LoRA model with the trained R installed by hand
        manual = _lora_only(_base(), model)
        manual.base_model.model.set_pattern(AttentionPattern(
            manual.base_model.model.bert.encoder.partial_pattern.indices, trained_r))
        torch.testing.assert_close(manual(input_ids=ids).logits, logits, rtol=0, atol=1e-6)
        assert float((_lora_only(_base(), model)(input_ids=ids).logits - logits).abs().max()) > 1e-4
    _check_reload(model, _base(), ids, logits, tmp_path)


def test_per_head_r_trains_under_modules_to_save_and_reloads(tmp_path):
    """P and R per head (``partial_granularity="head"``, R per layer): each partial layer's module
    ``partial_pattern_layer{l}`` is named in modules_to_save, its R (H, n, n−k, k) trains, and the saved adapter
    reloads the same model."""
    config = dict(TINY, reconstruction="per_layer", partial_granularity="head")

    def base():
        torch.manual_seed(0)
        return PartialBertForMaskedLM(PartialBertConfig(**config))

    names = [f"partial_pattern_layer{layer}" for layer in base().config.partial_layers]
    model = get_peft_model(base(), LoraConfig(target_modules=["query", "value"], modules_to_save=names))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad and "partial_pattern" in n]
    assert trainable == [f"base_model.model.bert.encoder.{name}.modules_to_save.default.reconstruction"
                         for name in names]
    r0 = base().bert.encoder.partial_pattern_layer1.reconstruction.detach().clone()  # (H, n, n-k, k)
    assert r0.shape == (4, 16, 12, 4)
    ids = _train(model)
    wrapper = model.base_model.model.bert.encoder.partial_pattern_layer1
    trained = wrapper.modules_to_save["default"].reconstruction.detach()
    assert float((trained - r0).abs().amax(dim=(1, 2, 3)).min()) > 1e-4  # every head's R moved
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        assert float((_lora_only(base(), model)(input_ids=ids).logits - logits).abs().max()) > 1e-4  # R trained
    _check_reload(model, base(), ids, logits, tmp_path)
