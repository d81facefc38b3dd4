"""Checkpoints that never load silently wrong: missing, mis-shaped or invalid P/R are errors; buffers are valid
after construction; compile (fullgraph) and export run the precomputed layout and match eager exactly."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModel, AutoModelForMaskedLM

from hf_partial_attention import AttentionPattern, PartialBertConfig, PartialBertForMaskedLM, PartialBertModel

TINY = dict(vocab_size=99, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=37,
            partial_seq_len=16, partial_k=4, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def _pattern(seed=3):
    g = torch.Generator().manual_seed(seed)
    idx = torch.sort(torch.argsort(torch.rand(16, 16, generator=g), -1)[:, :4], -1).values
    return AttentionPattern(idx, torch.randn(16, 12, 4, generator=g) * 0.3)


def _saved(tmp_path, mode="common", cls=PartialBertModel):
    torch.manual_seed(0)
    model = cls(PartialBertConfig(**TINY, reconstruction=mode)).eval()
    model.set_pattern(_pattern())
    model.save_pretrained(tmp_path)
    return model


def _edit_weights(folder, edit):
    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.mark.parametrize("mode, name", [("common", "encoder.partial_pattern.indices"),
                                        ("common", "encoder.partial_pattern.reconstruction"),
                                        ("fixed", "encoder.partial_pattern.reconstruction"),
                                        ("per_layer", "encoder.layer.1.attention.self.reconstruction")])
def test_a_checkpoint_without_p_or_r_is_an_error_naming_it(tmp_path, mode, name):
    _saved(tmp_path, mode)
    _edit_weights(tmp_path, lambda t: t.pop(name))
    with pytest.raises(ValueError, match=rf"missing: \['{name}'\].*from_bert"):
        AutoModel.from_pretrained(tmp_path)


def test_a_checkpoint_with_p_of_another_shape_is_an_error(tmp_path):
    _saved(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "partial_k": 5}))
    with pytest.raises(ValueError, match=r"partial_lengths_k=\[4\] must end with partial_k=5"):  # n's k twice
        AutoModel.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**config, "partial_k": 5, "partial_lengths_k": [5]}))
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):  # transformers' own refusal
        AutoModel.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="of the wrong shape.*encoder.partial_pattern.indices"):
        AutoModel.from_pretrained(tmp_path, ignore_mismatched_sizes=True)  # would re-initialise P: refused


def test_a_checkpoint_with_invalid_p_is_an_error(tmp_path):
    _saved(tmp_path)

    def unsort(t):
        t["encoder.partial_pattern.indices"] = t["encoder.partial_pattern.indices"].flip(-1).contiguous()

    _edit_weights(tmp_path, unsort)
    with pytest.raises(ValueError, match="invalid P or R.*sorted"):
        AutoModel.from_pretrained(tmp_path)


def test_a_complete_checkpoint_loads_its_own_pattern(tmp_path):
    model = _saved(tmp_path, "per_layer", PartialBertForMaskedLM)
    loaded, info = AutoModelForMaskedLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"]
    assert torch.equal(loaded.get_pattern(1).indices, _pattern().indices)
    ids = torch.randint(1, 99, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded.eval()(input_ids=ids).logits, model(input_ids=ids).logits)


@pytest.mark.parametrize("mode", ["fixed", "common", "per_layer"])
def test_buffers_are_valid_without_weight_initialisation(mode):
    """transformers' test_init_weights_can_init_buffers: P and R hold the default right after __init__."""
    from transformers.initialization import no_init_weights

    with no_init_weights():
        model = PartialBertModel(PartialBertConfig(**TINY, reconstruction=mode))
    default = AttentionPattern.local(16, 4)
    assert torch.equal(model.encoder.partial_pattern.indices, default.indices)
    for r in model.reconstruction_tensors().values():
        assert torch.equal(r.detach(), default.reconstruction)
    layout = model.encoder.partial_pattern.layout()
    assert torch.equal(layout.complement, default.complement)


def test_layout_follows_p_changed_in_place():
    model = PartialBertModel(PartialBertConfig(**TINY)).eval()
    ids = torch.randint(1, 99, (1, 16), generator=torch.Generator().manual_seed(0))
    pattern = _pattern()
    with torch.no_grad():
        model.encoder.partial_pattern.indices.copy_(pattern.indices)  # by hand, not through set_pattern
        by_hand = model(input_ids=ids).last_hidden_state
        model.set_pattern(AttentionPattern(pattern.indices, model.get_pattern().reconstruction))
        proper = model(input_ids=ids).last_hidden_state
    assert torch.equal(by_hand, proper)
    assert torch.equal(model.encoder.partial_pattern.complement, pattern.complement)


@pytest.mark.slow
@pytest.mark.parametrize("implementation", ["gather", "fused", "tiled"])
def test_compile_fullgraph_and_export_match_eager(implementation):
    torch.manual_seed(0)
    model = PartialBertModel(PartialBertConfig(**TINY)).eval()
    model.set_pattern(_pattern())
    model.set_partial_implementation(implementation)
    ids = torch.randint(1, 99, (2, 16), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 10:] = 0
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).last_hidden_state
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True, backend="eager")  # fullgraph: a graph break is an error
        assert torch.equal(compiled(input_ids=ids, attention_mask=mask).last_hidden_state, ref)
    with torch.no_grad():  # exported for inference: the kernel's own no-grad path, bit-exact
        exported = torch.export.export(model, (), {"input_ids": ids, "attention_mask": mask})
        assert torch.equal(exported.module()(input_ids=ids, attention_mask=mask).last_hidden_state, ref)


@pytest.mark.slow
def test_onnx_export_runs_in_onnxruntime():
    torch.manual_seed(0)
    model = PartialBertModel(PartialBertConfig(**TINY)).eval()
    model.set_pattern(_pattern())
    ids = torch.randint(1, 99, (2, 16), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 10:] = 0
    program = torch.onnx.export(model, (), kwargs={"input_ids": ids, "attention_mask": mask}, dynamo=True)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).last_hidden_state
    out = program(input_ids=ids, attention_mask=mask)[0]  # runs the ONNX graph in onnxruntime
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("implementation", ["auto", "fused"])
def test_exported_eval_model_runs_with_autograd_on(implementation):
    # Exported as users call it (an eval model, autograd on): the program replays the kernel's ops under autograd,
    # so it must not hold the in-place out= inference path (bmm(out=) refuses to run there).
    torch.manual_seed(0)
    model = PartialBertModel(PartialBertConfig(**TINY)).eval()
    model.set_pattern(_pattern())
    model.set_partial_implementation(implementation)
    ids = torch.randint(1, 99, (2, 16), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 10:] = 0
    exported = torch.export.export(model, (), {"input_ids": ids, "attention_mask": mask})
    out = exported.module()(input_ids=ids, attention_mask=mask).last_hidden_state  # autograd on
    ref = model(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=0)
    out.sum().backward()  # and it differentiates, as the model does
    grads = {name: p.grad for name, p in exported.module().named_parameters() if p.grad is not None}
    assert grads, "no parameter received a gradient"
    with torch.no_grad():  # and without autograd (the reference kernel's numbers: equal up to rounding)
        torch.testing.assert_close(exported.module()(input_ids=ids, attention_mask=mask).last_hidden_state,
                                   model(input_ids=ids, attention_mask=mask).last_hidden_state, atol=1e-6, rtol=0)


@pytest.mark.slow
def test_export_with_dynamic_shapes_by_input_name():
    # transformers' documented call: keyword inputs named as BertModel.forward names them, a dynamic length
    from torch.export import Dim

    torch.manual_seed(0)
    model = PartialBertModel(PartialBertConfig(**TINY)).eval()
    model.set_pattern(_pattern())
    model.set_partial_implementation("gather")  # the other kernels' tile sizes specialise on the length
    ids = torch.randint(1, 99, (2, 12), generator=torch.Generator().manual_seed(1))
    length = Dim("length", min=2, max=15)  # inputs shorter than n = 16 (a full-length input is its own graph)
    with torch.no_grad():
        exported = torch.export.export(model, (), {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                                       dynamic_shapes={"input_ids": {1: length}, "attention_mask": {1: length}})
        short = ids[:, :7]
        torch.testing.assert_close(exported.module()(input_ids=short, attention_mask=torch.ones_like(short))
                                   .last_hidden_state, model(input_ids=short).last_hidden_state, atol=1e-6, rtol=0)


def test_forward_keeps_bert_signature():
    import inspect

    from transformers import BertModel

    for cls in (PartialBertModel,):
        assert list(inspect.signature(cls.forward).parameters) == list(inspect.signature(BertModel.forward).parameters)
        assert cls.main_input_name in inspect.signature(cls.forward).parameters


@pytest.mark.parametrize("mode", ["fixed", "common", "per_layer"])
def test_init_weights_sets_every_buffer_of_a_meta_device_model(mode):
    # transformers' test_init_weights_can_init_buffers: big-model loading builds the model on the meta device,
    # moves it with to_empty (garbage memory) and runs init_weights: every buffer must equal a direct build's.
    config = dict(TINY, reconstruction=mode)
    direct = PartialBertModel(PartialBertConfig(**config))
    with torch.device("meta"):
        meta = PartialBertModel(PartialBertConfig(**config))
    meta.to_empty(device="cpu")
    meta.init_weights()
    built, initialised = dict(direct.named_buffers()), dict(meta.named_buffers())
    assert sorted(built) == sorted(initialised)
    assert [name for name in built if not torch.equal(built[name], initialised[name])] == []
    pattern = meta.encoder.partial_pattern
    assert pattern.block_rows == direct.encoder.partial_pattern.block_rows
