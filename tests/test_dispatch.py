"""Attention through transformers' dispatch: every kernel in a whole model equals the reference, the kernel is a
run-time setting, exact layers keep attn_implementation, and construction builds no pattern it does not need."""

import json

import pytest
import torch
from transformers import AttentionInterface, AutoModel, BertConfig, BertModel
from transformers.models.bert.modeling_bert import BertSelfAttention
from transformers.masking_utils import AttentionMaskInterface

from hf_partial_attention import (
    AttentionPattern,
    PartialBertConfig,
    PartialBertForMaskedLM,
    PartialBertForQuestionAnswering,
    PartialBertForSequenceClassification,
    PartialBertForTokenClassification,
    PartialBertModel,
    PartialBertPreTrainedModel,
)
from hf_partial_attention import partial_pattern
from hf_partial_attention.modeling_partial import PartialModelMixin
from hf_partial_attention.partial_layer import is_partial
from hf_partial_attention.attention_dispatch import attention_function_name, kernel_function
from hf_partial_attention.configuration_partial_bert import KERNEL_NAMES, PARTIAL_IMPLEMENTATIONS

IMPLEMENTATIONS = ("gather", "fused", "tiled")  # the triton kernel: tests/test_triton_kernel.py (float32, interpreter)

TINY = dict(vocab_size=99, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=37,
            partial_seq_len=16, partial_k=4, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
HEADS = (PartialBertModel, PartialBertForMaskedLM, PartialBertForSequenceClassification,
         PartialBertForTokenClassification, PartialBertForQuestionAnswering)


def _pattern(n=16, k=4, structured=False, bias=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    if structured:  # blocks of 8 rows sharing keys: the fused kernel's block-GEMM path
        idx = torch.cat([torch.sort(torch.randperm(n, generator=g)[:k]).values.expand(8, k) for _ in range(n // 8)])
    else:
        idx = torch.sort(torch.argsort(torch.rand(n, n, generator=g), -1)[:, :k], -1).values
    r = torch.randn(n, n - k, k, generator=g) * 0.3
    return AttentionPattern(idx, r, torch.randn(n, n - k, generator=g) * 0.1 if bias else None)


def _batch(t=12):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 99, (2, t), generator=g)
    mask = torch.ones(2, t, dtype=torch.long)
    mask[1, 8:] = 0
    return ids, mask


def test_kernels_are_registered_with_transformers():
    assert PARTIAL_IMPLEMENTATIONS == ("auto", *KERNEL_NAMES)
    for name in KERNEL_NAMES:
        assert kernel_function(name).__name__ == f"{name}_attention"  # one function per kernel, by its name
    for name in PARTIAL_IMPLEMENTATIONS:
        assert attention_function_name(name) in AttentionInterface._global_mapping
        # a name without a mask function would silently receive attention_mask=None
        assert attention_function_name(name) in AttentionMaskInterface._global_mapping


@pytest.mark.parametrize("mode", ["fixed", "common", "per_layer"])
@pytest.mark.parametrize("structured, bias", [(False, False), (True, True)])
def test_every_kernel_in_the_model_equals_the_reference(mode, structured, bias):
    """Outputs and gradients (q/k/v weights and R) of the whole model, each kernel against "gather"."""
    ids, mask = _batch()
    results = {}
    for kernel in IMPLEMENTATIONS:
        torch.manual_seed(0)
        config = PartialBertConfig(**TINY, reconstruction=mode, partial_use_bias=bias)
        model = PartialBertModel(config).double()
        model.set_pattern(_pattern(structured=structured, bias=bias))
        model.set_partial_implementation(kernel)
        out = model(input_ids=ids, attention_mask=mask).last_hidden_state
        (out * torch.linspace(-1, 1, out.shape[-1], dtype=out.dtype)).sum().backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters()
                 if p.grad is not None and ("attention.self" in name or "reconstruction" in name)}
        results[kernel] = (out.detach(), grads)
    ref_out, ref_grads = results["gather"]
    assert any("reconstruction" in name for name in ref_grads) == (mode != "fixed")
    for kernel, (out, grads) in results.items():
        torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-10, msg=kernel)
        assert grads.keys() == ref_grads.keys()
        for name, g in grads.items():
            torch.testing.assert_close(g, ref_grads[name], rtol=1e-9, atol=1e-10, msg=f"{kernel} {name}")


def test_the_kernel_runs_through_the_registry(monkeypatch):
    calls = []
    original = AttentionInterface._global_mapping[attention_function_name("fused")]

    def spy(module, *args, **kwargs):
        calls.append(module.layer_idx)
        return original(module, *args, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, attention_function_name("fused"), spy)
    model = PartialBertModel(PartialBertConfig(**TINY, partial_implementation="fused")).eval()
    model(input_ids=_batch()[0])
    assert calls == [0, 1]  # the two partial layers; the last layer is exact


def test_kernel_is_a_runtime_setting_not_a_checkpoint_one(tmp_path):
    model = PartialBertModel(PartialBertConfig(**TINY, partial_implementation="gather")).eval()
    model.save_pretrained(tmp_path)
    assert "partial_implementation" not in json.loads((tmp_path / "config.json").read_text())
    # a config.json of version 0.1.0 that names a kernel does not force it on this machine
    stored = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**stored, "partial_implementation": "gather"}))
    assert AutoModel.from_pretrained(tmp_path).config.partial_implementation == "auto"
    loaded = AutoModel.from_pretrained(tmp_path, partial_implementation="tiled")
    assert loaded.config.partial_implementation == "tiled"
    loaded.set_partial_implementation("fused")
    assert loaded.config.partial_implementation == "fused"
    with pytest.raises(ValueError, match="partial_implementation must be one of"):
        loaded.set_partial_implementation("cuda")


def test_a_misspelt_kernel_is_refused_at_load(tmp_path):
    # before: the folder loaded, and the first forward raised a bare KeyError 'partial_fussed' inside transformers
    PartialBertModel(PartialBertConfig(**TINY)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"partial_implementation must be one of \('auto', .*got 'fussed'"):
        AutoModel.from_pretrained(tmp_path, partial_implementation="fussed")
    with pytest.raises(ValueError, match="got 'fussed'"):
        PartialBertConfig.from_pretrained(tmp_path, partial_implementation="fussed")


@pytest.mark.parametrize("exact", ["eager", "sdpa"])
def test_exact_layers_keep_attn_implementation(exact, monkeypatch):
    seen = []
    original = AttentionInterface._global_mapping.get(exact)
    model = PartialBertModel(PartialBertConfig(**TINY)).eval()
    model.set_attn_implementation(exact)

    def spy(module, *args, **kwargs):
        seen.append(module.layer_idx)
        return (original or __import__("transformers").models.bert.modeling_bert.eager_attention_forward)(
            module, *args, **kwargs)

    if exact == "eager":  # eager is the fallback, not in the registry: register a spy under a new name
        AttentionInterface.register("spy_eager", spy)
        AttentionMaskInterface.register("spy_eager", AttentionMaskInterface._global_mapping["eager"])
        model.set_attn_implementation("spy_eager")
    else:
        monkeypatch.setitem(AttentionInterface._global_mapping, exact, spy)
    ids, mask = _batch()
    model(input_ids=ids, attention_mask=mask)
    assert seen == [2]  # only the exact last layer


@pytest.mark.parametrize("cls", HEADS)
def test_heads_are_berts_own_classes_made_partial_in_place(cls):
    """PartialBert comes from the architecture table like every encoder: transformers' own BERT classes (body and
    heads, never copies), the partial layers' ``BertSelfAttention`` made partial in place."""
    model = cls(PartialBertConfig(**TINY, num_labels=3))
    body = model if cls is PartialBertModel else model.bert
    bert_cls = cls._source_class  # BertModel, BertForMaskedLM, ...
    assert type(body) is (PartialBertModel if cls is PartialBertModel else BertModel)
    assert [type(layer.attention.self) for layer in body.encoder.layer] == [BertSelfAttention] * 3
    assert [is_partial(layer.attention.self) for layer in body.encoder.layer] == [True, True, False]
    assert cls.__mro__[1:4] == (PartialBertPreTrainedModel, PartialModelMixin, bert_cls)
    assert bert_cls.__module__ == "transformers.models.bert.modeling_bert"
    bert = bert_cls(BertConfig(**{k: v for k, v in TINY.items() if not k.startswith("partial")}, num_labels=3))
    prefix = "" if cls is PartialBertModel else "bert."
    assert set(model.state_dict()) - set(bert.state_dict()) == {f"{prefix}encoder.partial_pattern.{t}" for t in
                                                                ("indices", "reconstruction")}
    # BERT's modules, of BERT's types, in BERT's places
    ours = {name: type(m).__name__ for name, m in model.named_modules() if "partial_pattern" not in name}
    theirs = {name: type(m).__name__ for name, m in bert.named_modules()}
    assert {name: bert_cls.__name__ if kind == cls.__name__ else kind for name, kind in ours.items()} == theirs
    assert [m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)] == \
        [m.p for m in bert.modules() if isinstance(m, torch.nn.Dropout)]


def test_from_bert_never_builds_the_default_pattern(monkeypatch):
    bert = BertModel(BertConfig(**{k: v for k, v in TINY.items() if not k.startswith("partial")}))
    pattern = _pattern()
    partial_pattern._local_pattern.cache_clear()

    def refuse(*args, **kwargs):
        raise AssertionError("the default pattern was built")

    monkeypatch.setattr(AttentionPattern, "local", refuse)
    model = PartialBertModel.from_bert(bert, pattern, reconstruction="per_layer")
    assert torch.equal(model.encoder.partial_pattern.indices, pattern.indices)
    assert torch.equal(model.encoder.layer[1].attention.self.reconstruction, pattern.reconstruction)
    with pytest.raises(AssertionError, match="default pattern was built"):
        PartialBertModel(PartialBertConfig(**TINY))  # built from a config alone: the default it is


def test_default_pattern_is_valid_after_construction_and_its_cache_bounded():
    from transformers.initialization import no_init_weights

    with no_init_weights():  # construction alone, no _init_weights: P and R must already hold the default
        model = PartialBertModel(PartialBertConfig(**TINY))
    local = AttentionPattern.local(16, 4)
    assert torch.equal(model.encoder.partial_pattern.indices, local.indices)
    assert torch.equal(model.encoder.partial_pattern.reconstruction.detach(), local.reconstruction)
    partial_pattern._local_pattern.cache_clear()
    for k in range(1, 9):
        partial_pattern.default_pattern(PartialBertConfig(**{**TINY, "partial_k": k}))
    info = partial_pattern._local_pattern.cache_info()
    assert info.currsize == info.maxsize == 4
