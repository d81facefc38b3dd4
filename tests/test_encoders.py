"""Partial attention in every supported encoder (`architectures.ARCHITECTURES`), on tiny random configs of
transformers' own tester sizes (hidden 32, 3 layers, 4 heads, vocab 99): the shared mechanism, not BERT's alone."""

import functools
import os

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModel

import hf_partial_attention
from hf_partial_attention import AttentionPattern, partial_class_for
from hf_partial_attention.pattern_buckets import PatternBuckets
from hf_partial_attention.architectures import ARCHITECTURES, architecture_for
from hf_partial_attention.partial_layer import is_partial

from test_hub import assert_remote_load, remote_load_results

N = 16  # the pattern's n; inputs are padded batches of at most N tokens
TINY = dict(vocab_size=99, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=37)
SPECIAL = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)


def tiny_config(model_type: str):
    """A tiny config of ``model_type`` (dropout off, so train-mode outputs compare too)."""
    cls = AutoConfig.for_model(model_type).__class__
    if model_type == "distilbert":
        return cls(vocab_size=99, dim=32, n_layers=3, n_heads=4, hidden_dim=37, max_position_embeddings=64,
                   dropout=0.0, attention_dropout=0.0, pad_token_id=0)
    if model_type == "albert":
        return cls(**TINY, embedding_size=16, max_position_embeddings=64, hidden_dropout_prob=0.0,
                   attention_probs_dropout_prob=0.0, **SPECIAL)
    if model_type == "modernbert":  # window 8 < N: the local layers' window mask matters
        return cls(**TINY, max_position_embeddings=64, local_attention=8, global_attn_every_n_layers=2,
                   attention_dropout=0.0, embedding_dropout=0.0, mlp_dropout=0.0, cls_token_id=3,
                   sep_token_id=4, mask_token_id=5, **SPECIAL)
    if model_type == "deberta-v2":  # DeBERTa-v3's attention: both position terms, shared keys, log buckets
        return cls(**TINY, max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                   relative_attention=True, pos_att_type=["p2c", "c2p"], position_buckets=8,
                   max_relative_positions=64, share_att_key=True, norm_rel_ebd="layer_norm", type_vocab_size=0,
                   **SPECIAL)
    if model_type in ("nomic_bert", "gte", "eurobert"):
        config = cls(**TINY, max_position_embeddings=64, **SPECIAL)
        for name in ("hidden_dropout_prob", "attention_probs_dropout_prob", "attention_dropout", "mlp_dropout",
                     "embedding_dropout"):
            if hasattr(config, name):
                setattr(config, name, 0.0)
        return config
    return cls(**TINY, max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
               **({"embedding_size": 32} if model_type == "electra" else {}), **SPECIAL)


def installed(*model_types: str) -> list:
    """``model_types`` as test parameters, each the installed transformers lacks skipped with the reason (the library
    refuses it in one line: `test_an_architecture_the_installed_transformers_lacks_is_refused_in_one_line`)."""
    return [t if ARCHITECTURES[t].available() else pytest.param(t, marks=pytest.mark.skip(
        reason=f"transformers {transformers.__version__} has no {t!r} model (refused by the library in one line)"))
        for t in model_types]


TYPES = installed(*ARCHITECTURES)


def test_an_architecture_the_installed_transformers_lacks_is_refused_in_one_line(monkeypatch):
    """What the skipped parameters stand for: each architecture the installed transformers lacks (and GTE, made to
    look missing, as in older transformers) is refused in one line, naming why."""
    from hf_partial_attention.architectures import Architecture, UnsupportedModelError

    has = Architecture.available
    monkeypatch.setattr(Architecture, "available", lambda self: self.model_type != "gte" and has(self))
    for model_type in [t for t, arch in ARCHITECTURES.items() if not arch.available()]:
        with pytest.raises(UnsupportedModelError, match="the installed transformers does not have it") as error:
            partial_class_for(model_type)
        assert "\n" not in str(error.value)


def source_model(model_type: str, auto: str = "AutoModel"):
    torch.manual_seed(0)
    return architecture_for(model_type).source_class(auto)(tiny_config(model_type)).double().eval()


def batch():
    """A padded batch: sequence 0 of N tokens, sequence 1 of 9 (padding after), token ids >= 6."""
    ids = torch.randint(6, 99, (2, N), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    ids[1, 9:] = 0
    return ids, mask


def all_layers(model_type):
    """Every layer partial, for an equality check that covers every kind of layer (ModernBERT's local ones too)."""
    return list(range(3))


@functools.lru_cache(maxsize=None)
def fitted_pattern(model_type: str, n: int = N, k: int = 5, bias: bool = False) -> AttentionPattern:
    """P and R fitted by the project's own analysis on the tiny ``model_type`` model: the covariance of its scores
    over 64 random windows of n tokens (`collect_covariance`, what `analyze` runs), then greedy P and optimal R
    (`select_pattern`, what `derive` runs). Cached: every test of one architecture uses the same fit."""
    from hf_partial_attention.analysis import collect_covariance, select_pattern

    windows = torch.randint(6, 99, (64, n), generator=torch.Generator().manual_seed(n))  # (S, n)
    cov = collect_covariance(source_model(model_type).float(), windows, seq_len=n, progress=False,
                             distributed=False)
    pattern = select_pattern(cov, k, bias=bias)
    assert pattern.indices.shape == (n, k)
    return AttentionPattern(pattern.indices, pattern.reconstruction.double(),
                            None if pattern.bias is None else pattern.bias.double())


@pytest.mark.parametrize("model_type", TYPES)
def test_every_key_exact_equals_the_source_in_float64(model_type):
    """k = n (every score exact, R empty): the partial model is the source model, padded batch included."""
    source = source_model(model_type)
    cls = partial_class_for(model_type)
    model = cls.from_source(source, AttentionPattern.exact(N), partial_layers=all_layers(model_type)).eval()
    assert model.config.model_type == architecture_for(model_type).partial_model_type
    modules = [m for _, m in model._partial_arch.attention_modules(model.base_model)]
    assert modules and all(is_partial(m) for m in modules)
    ids, mask = batch()
    with torch.no_grad():
        ref = source(input_ids=ids, attention_mask=mask).last_hidden_state
        for kernel in ("gather", "fused", "tiled"):
            model.set_partial_implementation(kernel)
            out = model(input_ids=ids, attention_mask=mask).last_hidden_state
            # at the real tokens: a padding query whose window holds only padding (ModernBERT's local layers) has
            # no key to attend, and its output is the implementation's convention, in the source as here
            real = mask.bool()
            torch.testing.assert_close(out[real], ref[real], atol=1e-10, rtol=0, msg=f"{model_type} {kernel}")


@pytest.mark.parametrize("model_type", TYPES)
def test_a_padded_sequence_gets_what_it_gets_alone(model_type):
    """With k < n, padding must not reach the reconstruction: sequence 1 padded in a batch equals it alone."""
    model = partial_class_for(model_type).from_source(source_model(model_type), fitted_pattern(model_type)).eval()
    ids, mask = batch()
    with torch.no_grad():
        padded = model(input_ids=ids, attention_mask=mask).last_hidden_state[1, :9]
        alone = model(input_ids=ids[1:, :9], attention_mask=mask[1:, :9]).last_hidden_state[0]
        exact = source_model(model_type)(input_ids=ids[1:, :9], attention_mask=mask[1:, :9]).last_hidden_state[0]
    torch.testing.assert_close(padded, alone, atol=1e-10, rtol=0)
    assert (alone - exact).abs().max() > 1e-6  # k < n: the pattern is in effect


def _modes(model_type):
    return ["fixed", "common"] + ([] if model_type == "albert" else ["per_layer"])


@pytest.mark.parametrize("model_type", TYPES)
def test_every_kernel_equals_the_reference_in_outputs_and_gradients(model_type):
    """gather (the reference), fused and tiled (inference) on P and R fitted by the analysis, every R mode, with
    length buckets [8, 16] and a bias: outputs and the gradients of q/k/v weights and R agree in float64."""
    buckets = PatternBuckets({8: fitted_pattern(model_type, 8, 3, bias=True), N: fitted_pattern(model_type, bias=True)},
                             k=5)
    ids, mask = batch()
    for mode in _modes(model_type):
        model = partial_class_for(model_type).from_source(source_model(model_type), buckets, reconstruction=mode)
        model.train()  # dropout is 0: train mode runs the autograd kernels
        results = kernel_runs(model, ("gather", "fused"), ids, mask)
        ref_out, ref_grads = results["gather"]
        out, grads = results["fused"]
        torch.testing.assert_close(out, ref_out, atol=1e-10, rtol=0, msg=f"{model_type} {mode}")
        assert set(grads) == set(ref_grads) and (mode == "fixed") != any("reconstruction" in n for n in grads)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, ref_grads[name], atol=1e-9, rtol=0, msg=f"{model_type} {mode} {name}")
        model.eval().set_partial_implementation("tiled")
        with torch.no_grad():
            tiled = model(input_ids=ids, attention_mask=mask).last_hidden_state
        torch.testing.assert_close(tiled, ref_out, atol=1e-10, rtol=0)


def _reference(model, folder, ids, mask):
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask)[0]
    partial = {k: v for k, v in model.state_dict().items() if "partial_pattern" in k or "reconstruction" in k}
    torch.save({"ids": ids, "mask": mask.long(), "out": out, "partial": partial}, os.path.join(folder, "reference.pt"))


REMOTE_TYPES = installed(*(t for t in ARCHITECTURES if t != "bert"))  # bert: test_hub.py
# the model types themselves (a type transformers lacks is a skipped `pytest.param` in REMOTE_TYPES, not a string)
_REMOTE_AVAILABLE = [t for t in ARCHITECTURES if t != "bert" and ARCHITECTURES[t].available()]


def _save_and_check(model_type: str, root) -> list[str]:
    """Convert ``model_type``'s base model (R per layer; ALBERT, whose layers share weights, fixed) and MLM model (R
    common), save each, reload with the plugin (identical outputs) and write the reference the remote-code check
    compares with; returns the two job lines for `check_remote_loads`."""
    ids, mask = batch()
    jobs = []
    for auto, mode in (("AutoModel", "per_layer" if model_type != "albert" else "fixed"),
                       ("AutoModelForMaskedLM", "common")):
        model = partial_class_for(model_type, auto).from_source(source_model(model_type, auto),
                                                                  fitted_pattern(model_type),
                                                                  reconstruction=mode).float().eval()
        folder = str(root / auto)
        model.save_pretrained(folder)
        factory = getattr(__import__("transformers"), auto)
        loaded = factory.from_pretrained(folder).eval()
        assert type(loaded) is type(model)
        with torch.no_grad():
            got, want = loaded(input_ids=ids, attention_mask=mask)[0], model(input_ids=ids, attention_mask=mask)[0]
        assert torch.equal(got, want)
        _reference(model, folder, ids, mask)
        jobs.append(f"{folder} {auto}")
    return jobs


@pytest.fixture(scope="module")
def remote_loads(tmp_path_factory):
    """Every architecture's two folders (`_save_and_check`), then all of them loaded by remote code in one process
    without the plugin (a fresh Python with torch and transformers costs seconds: once here, not once per
    architecture). ``{model_type: (the error its own checks raised or None, {folder: the remote load's result})}``."""
    root = tmp_path_factory.mktemp("remote_code")
    jobs, raised = {}, {}
    for model_type in _REMOTE_AVAILABLE:
        try:
            jobs[model_type] = _save_and_check(model_type, root / model_type)
        except Exception as err:  # noqa: BLE001  (re-raised by that architecture's test)
            raised[model_type] = err
    results = remote_load_results([job for lines in jobs.values() for job in lines], root)
    return {t: (raised.get(t), {job.split()[0]: results.get(job.split()[0]) for job in jobs.get(t, [])})
            for t in _REMOTE_AVAILABLE}


@pytest.mark.slow
@pytest.mark.parametrize("model_type", REMOTE_TYPES)
def test_save_load_with_the_plugin_and_by_remote_code_without_it(model_type, remote_loads):
    raised, results = remote_loads[model_type]
    if raised is not None:
        raise raised
    assert len(results) == 2
    for folder, result in results.items():
        assert_remote_load(folder, result)


@pytest.mark.parametrize("model_type", installed("roberta", "modernbert", "distilbert", "albert"))
def test_a_checkpoint_without_p_is_refused_naming_the_tensor(model_type, tmp_path):
    model = partial_class_for(model_type).from_source(source_model(model_type), fitted_pattern(model_type))
    model.save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    name = next(k for k in state if k.endswith("partial_pattern.indices"))
    del state[name]
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"missing: \['{name}'\]"):
        AutoModel.from_pretrained(tmp_path)


def test_a_roberta_is_not_converted_into_partial_bert():
    with pytest.raises(ValueError, match="'roberta' model, but BertModel loads 'bert'"):
        hf_partial_attention.PartialBertModel.from_bert(source_model("roberta"), AttentionPattern.exact(N))


def test_albert_refuses_r_per_layer_and_a_split_layer_group():
    cls = partial_class_for("albert")
    with pytest.raises(ValueError, match="per_layer.*share one attention module"):
        cls.from_source(source_model("albert"), fitted_pattern("albert"), reconstruction="per_layer")
    with pytest.raises(ValueError, match="splits layers that share one attention module"):
        cls.from_source(source_model("albert"), fitted_pattern("albert"), partial_layers=[0, 1])
    assert cls.from_source(source_model("albert"), fitted_pattern("albert")).config.partial_layers == [0, 1, 2]


def test_modernbert_makes_its_global_layers_but_the_last_partial_by_default():
    model = partial_class_for("modernbert").from_source(source_model("modernbert"), fitted_pattern("modernbert"))
    assert model.config.layer_types == ["full_attention", "sliding_attention", "full_attention"]
    assert model.config.partial_layers == [0]  # layer 2 is global but last; layer 1 is local
    assert [is_partial(layer.attn) for layer in model.layers] == [True, False, False]


def test_output_attentions_gives_every_layers_map():
    model = partial_class_for("roberta").from_source(source_model("roberta"), fitted_pattern("roberta")).eval()
    ids, mask = batch()
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, output_attentions=True)
    assert len(out.attentions) == 3 and all(a.shape == (2, 4, N, N) for a in out.attentions)
    torch.testing.assert_close(out.attentions[0].sum(-1)[0], torch.ones(4, N, dtype=torch.float64))


@pytest.mark.slow
@pytest.mark.parametrize("model_type", TYPES)
def test_export_with_a_dynamic_batch_and_length_up_to_n(model_type):
    """torch.export with a dynamic batch and sequence length (<= n, n included) from a full-length padded example,
    as for the source model; the program equals the eager model at other batch sizes and lengths."""
    from torch.export import Dim

    model = partial_class_for(model_type).from_source(source_model(model_type), fitted_pattern(model_type))
    model = model.float().eval()
    ids, mask = batch()
    dims = {0: Dim("batch", min=1, max=8), 1: Dim("seq", min=2, max=N)}
    with torch.no_grad():
        program = torch.export.export(model, (), {"input_ids": ids, "attention_mask": mask},
                                      dynamic_shapes={"input_ids": dims, "attention_mask": dims}).module()
        for b, t in ((1, 7), (3, N), (2, 11)):
            ids = torch.randint(6, 99, (b, t), generator=torch.Generator().manual_seed(t))
            mask = torch.ones_like(ids)
            mask[0, t - 2:] = 0
            torch.testing.assert_close(program(input_ids=ids, attention_mask=mask).last_hidden_state,
                                       model(input_ids=ids, attention_mask=mask).last_hidden_state, atol=1e-5, rtol=0)


def test_the_real_minilm_through_the_generic_path_equals_from_bert(minilm_path):
    """PartialBert is the BERT entry: `partial_class_for` + `from_source` and `PartialBertModel.from_bert` of the same
    pattern give the same embeddings of the real MiniLM."""
    from transformers import AutoTokenizer

    pattern = AttentionPattern.local(128, 16)
    generic = partial_class_for(AutoConfig.from_pretrained(minilm_path).model_type).from_source(minilm_path, pattern)
    bert = hf_partial_attention.PartialBertModel.from_bert(minilm_path, pattern)
    assert type(generic) is type(bert)
    texts = ["The quick brown fox.", "Attention is low rank, the paper finds."]
    enc = AutoTokenizer.from_pretrained(minilm_path)(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        diff = (generic.eval()(**enc).last_hidden_state - bert.eval()(**enc).last_hidden_state).abs().max()
    assert float(diff) <= 1e-6


@pytest.mark.parametrize("model_type", installed("roberta", "modernbert"))
def test_the_triton_kernel_under_the_interpreter_equals_the_reference(model_type):
    """The Triton kernel (conftest sets TRITON_INTERPRET=1: it runs on CPU tensors) through a RoBERTa and a ModernBERT
    (rotary positions, local layers partial too): outputs and gradients equal the reference kernel's in float32."""
    import triton  # noqa: F401  (a dev dependency: missing, this test fails instead of skipping)

    config = tiny_config(model_type)
    config.num_attention_heads = 2  # head_dim 16: the kernel's smallest tile
    torch.manual_seed(0)
    source = architecture_for(model_type).source_class("AutoModel")(config).eval()
    model = partial_class_for(model_type).from_source(source, fitted_pattern(model_type, bias=True),
                                                      partial_layers=all_layers(model_type), reconstruction="common")
    check_triton_equals_gather(model)


def kernel_runs(model, kernels, ids, mask, real_only: bool = False) -> dict:
    """``{kernel: (last hidden state, {parameter: gradient})}`` of ``model`` on ``ids``/``mask`` under each kernel, the
    loss a fixed linear read-out of the last hidden state (of real tokens only with ``real_only``)."""
    results = {}
    for kernel in kernels:
        model.zero_grad()
        model.set_partial_implementation(kernel)
        out = model(input_ids=ids, attention_mask=mask).last_hidden_state
        weight = torch.linspace(-1, 1, out.shape[-1], dtype=out.dtype)
        (out * weight * (mask[..., None] if real_only else 1)).sum().backward()
        results[kernel] = out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return results


def check_triton_equals_gather(model):
    """``model`` (float32, training mode, dropout 0) on the padded `batch`: the Triton kernel's outputs at real tokens
    and every gradient equal the reference kernel's (float32 tolerances), R's included."""
    model.train()
    ids, mask = batch()
    # the loss reads real tokens only: a padding query with no key in its window is each kernel's convention
    results = kernel_runs(model, ("gather", "triton"), ids, mask, real_only=True)
    (ref, ref_grads), (out, grads) = results["gather"], results["triton"]
    real = mask.bool()
    torch.testing.assert_close(out[real], ref[real], atol=2e-5, rtol=1e-4)
    assert set(grads) == set(ref_grads) and any("reconstruction" in n for n in grads)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], atol=5e-5, rtol=1e-3, msg=name)


@pytest.mark.parametrize("model_type", TYPES)
def test_attention_dropout_drops_as_the_source_does(model_type):
    """Attention dropout in training: with k = n, the reference kernel drops the same probabilities as the source's
    eager attention from the same seed (the dropout the architecture hands the attention function reaches it)."""
    config = tiny_config(model_type)
    for name in ("attention_probs_dropout_prob", "attention_dropout"):
        if hasattr(config, name):
            setattr(config, name, 0.5)
    torch.manual_seed(0)
    source = architecture_for(model_type).source_class("AutoModel")(config).double()
    source.set_attn_implementation("eager")
    model = partial_class_for(model_type).from_source(source, AttentionPattern.exact(N),
                                                      partial_layers=all_layers(model_type))
    model.set_partial_implementation("gather")
    ids = batch()[0]  # unpadded: eager ModernBERT gives NaN at padding queries whose window is all padding
    outputs = []
    for module, training in ((source, True), (model, True), (source, False)):
        torch.manual_seed(5)
        outputs.append(module.train(training)(input_ids=ids).last_hidden_state)
    dropped, ours, undropped = outputs
    # EuroBERT's eager softmax runs in float32 (1e-7); a different draw moves the outputs by 1e-2
    torch.testing.assert_close(ours, dropped, atol=1e-5, rtol=0)
    assert (dropped - undropped).abs().max() > 1e-2  # dropout is in effect


@pytest.mark.parametrize("model_type", TYPES)
def test_masked_only_mlm_loss_equals_each_architectures_own_loss(model_type):
    """`masked_only_mlm_loss` (the head run at the labelled positions only) gives the model's own MLM loss and
    gradient, through each architecture's own MLM head (ELECTRA's generator head, DistilBERT's projector, ...)."""
    from hf_partial_attention.training.losses import masked_only_mlm_loss

    model = partial_class_for(model_type, "AutoModelForMaskedLM").from_source(
        source_model(model_type, "AutoModelForMaskedLM"), fitted_pattern(model_type),
        reconstruction="common").float().train()
    ids, mask = batch()
    labels = torch.full_like(ids, -100)
    labels[0, 2], labels[0, 15], labels[1, 0], labels[1, 8] = 7, 9, 11, 13
    inputs = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    ours = masked_only_mlm_loss(model, inputs)
    assert ours["logits"].shape == (4, model.config.vocab_size)
    ours["loss"].backward()
    r = model._partial_owner().partial_pattern.reconstruction
    grad = r.grad.clone()
    model.zero_grad()
    theirs = model(**inputs).loss
    theirs.backward()
    torch.testing.assert_close(ours["loss"], theirs)
    torch.testing.assert_close(grad, r.grad)
    with pytest.raises(TypeError, match="mlm_logits_at_masked_only"):
        masked_only_mlm_loss(model.base_model, inputs)
