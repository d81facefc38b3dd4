"""P and R per layer (``partial_granularity="layer"``, `LayerPatterns`): each partial layer runs its own P and R,
fitted on its own layer's covariance by the project's analysis; the file, the config's refusals, checkpoints of
format 4 (save, load, remote code, a missing layer refused), the CLI from analyze to a loaded model."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_partial_attention import AttentionPattern, cli, partial_class_for
from hf_partial_attention.pattern_buckets import PatternBuckets
from hf_partial_attention.pattern_layers import LayerPatterns, load_patterns

from test_encoders import N, _reference, batch, kernel_runs, source_model
from test_encoders_workflow import encoders  # noqa: F401  (the fixture: tiny RoBERTa / ModernBERT folders)
from test_hub import check_remote_loads


def layer_patterns(model_type: str, k: int = 5) -> LayerPatterns:
    """Every layer's P and R from its own covariance (`collect_covariance(granularity="layer")`, `select_pattern`
    with ``layer=``), in float64."""
    from hf_partial_attention.analysis import collect_covariance, select_pattern

    windows = torch.randint(6, 99, (64, N), generator=torch.Generator().manual_seed(0))  # (S, n)
    cov = collect_covariance(source_model(model_type).float(), windows, seq_len=N, progress=False,
                             distributed=False, granularity="layer")
    fitted = {layer: select_pattern(cov, k, layer=layer) for layer in cov.layers}
    return LayerPatterns({layer: AttentionPattern(p.indices, p.reconstruction.double()) for layer, p in fitted.items()})


def minilm_layers(tmp_path_factory, minilm_path, layers: int):
    """The real MiniLM's first ``layers`` layers and its tokenizer, saved as a model folder (what the CLI reads)."""
    from transformers import AutoTokenizer, BertModel

    source = tmp_path_factory.mktemp(f"minilm{layers}")
    BertModel.from_pretrained(minilm_path, num_hidden_layers=layers).save_pretrained(source)
    AutoTokenizer.from_pretrained(minilm_path).save_pretrained(source)
    return source


@pytest.fixture(scope="module")
def minilm2(tmp_path_factory, minilm_path):
    return minilm_layers(tmp_path_factory, minilm_path, 2)


def analyze_windows(source, run: str, granularity: str, capsys) -> None:
    """``analyze --seq-len 16`` of ``source`` into ``run`` per layer or head (48 fit windows, 8 held out)."""
    assert cli.main(["analyze", "--model", str(source), "--seq-len", "16", "--max-sequences", "48", "--granularity",
                     granularity, "--heldout-sequences", "8", "--out", run, "--no-progress"]) == 0
    capsys.readouterr()


@pytest.fixture(scope="module")
def roberta_layers():
    return layer_patterns("roberta")


def test_layers_fit_different_patterns(roberta_layers):
    """The analysis gives layers different P (else this file tests nothing a pooled P does not)."""
    p = [roberta_layers[layer][N].indices for layer in roberta_layers.layers]
    assert not torch.equal(p[0], p[1]) and not torch.equal(p[1], p[2])


@pytest.mark.parametrize("reconstruction", ["per_layer", "fixed"])
def test_each_layer_runs_its_own_pattern(roberta_layers, reconstruction):
    """Layer l of the per-layer model is layer l of a pooled model holding layer l's pattern, fed the same input
    (unpadded: a layer called alone gets no mask)."""
    cls = partial_class_for("roberta")
    model = cls.from_source(source_model("roberta"), roberta_layers, reconstruction=reconstruction).eval()
    assert (model.config.partial_granularity, model.config.partial_layers) == ("layer", [0, 1])
    ids = batch()[0]
    with torch.no_grad():
        hidden = model(input_ids=ids, output_hidden_states=True).hidden_states
        for layer in (0, 1):
            pooled = cls.from_source(source_model("roberta"), roberta_layers[layer], partial_layers=[layer]).eval()
            expected = pooled.encoder.layer[layer](hidden[layer])
            expected = expected[0] if isinstance(expected, tuple) else expected
            torch.testing.assert_close(hidden[layer + 1], expected, rtol=0, atol=1e-12)


def test_a_pooled_model_with_layer_0s_pattern_differs_at_layer_1(roberta_layers):
    """The check above can fail: layer 1 under layer 0's pattern is another output."""
    cls = partial_class_for("roberta")
    model = cls.from_source(source_model("roberta"), roberta_layers).eval()
    pooled = cls.from_source(source_model("roberta"), roberta_layers[0], partial_layers=[0, 1]).eval()
    ids = batch()[0][:1]
    with torch.no_grad():
        a = model(input_ids=ids, output_hidden_states=True).hidden_states
        b = pooled(input_ids=ids, output_hidden_states=True).hidden_states
    torch.testing.assert_close(a[1], b[1], rtol=0, atol=1e-12)
    assert (a[2] - b[2]).abs().max() > 1e-6  # float64: 1e-15 would be rounding


def _save_and_load(model_type: str, patterns: LayerPatterns, folder) -> str:
    """Save the converted model, reload it with the plugin (identical outputs and P), write the reference for the
    remote-code check; returns its job line for `check_remote_loads`."""
    model = partial_class_for(model_type).from_source(source_model(model_type), patterns).eval()
    model.save_pretrained(folder)
    config = json.load(open(folder / "config.json"))
    version = 4 if patterns.layers_k(model.config.partial_layers) is None else 5  # 5: a k per layer
    assert (config["partial_format_version"], config["partial_granularity"]) == (version, patterns.granularity)
    names = [n for n in load_file(folder / "model.safetensors") if "partial_pattern" in n]
    assert {n.split("partial_pattern_")[1].split(".")[0] for n in names} == {
        f"layer{l}" for l in model.config.partial_layers}
    ids, mask = batch()
    loaded = partial_class_for(model_type).from_pretrained(folder).eval()
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).last_hidden_state
        torch.testing.assert_close(loaded(input_ids=ids, attention_mask=mask).last_hidden_state, expected,
                                   rtol=0, atol=0)
    heads = [None] if patterns.heads is None else range(patterns.heads)
    for layer in model.config.partial_layers:
        for head in heads:
            assert torch.equal(loaded.get_pattern(layer, head=head).indices, patterns.group(layer, head)[N].indices)
    _reference(model, str(folder), ids, mask)
    return f"{folder} AutoModel"


@pytest.mark.slow
def test_save_load_remote_code_and_format_4(tmp_path):
    """P and R per layer (BERT, RoBERTa, ModernBERT, DistilBERT) and per head (RoBERTa, ModernBERT): format 4, one
    pattern module per partial layer (the head dimension leading per head), identical after loading with the plugin
    and by remote code without it (one process for all); per head with a k per layer (RoBERTa, ModernBERT): format
    5."""
    jobs = [_save_and_load(t, layer_patterns(t), tmp_path / f"{t}_layer")
            for t in ("bert", "roberta", "modernbert", "distilbert")]
    for t in ("roberta", "modernbert"):
        patterns = head_patterns(t)
        jobs.append(_save_and_load(t, patterns, tmp_path / f"{t}_head"))
        # a k per layer (`derive --saving`): layer 0 at k = 3, layer 1 at 6, per head (format 5)
        budgeted = LayerPatterns({0: head_patterns(t, 3)[0], 1: head_patterns(t, 6)[1], 2: patterns[2]})
        jobs.append(_save_and_load(t, budgeted, tmp_path / f"{t}_budget"))
        weights = load_file(tmp_path / f"{t}_head" / "model.safetensors")
        shapes = [tensor.shape for name, tensor in weights.items() if "partial_pattern" in name]
        assert shapes and all(shape[0] == 4 for shape in shapes)  # the head dimension leads
    check_remote_loads(jobs, tmp_path)


def test_a_checkpoint_missing_a_layers_p_is_refused(roberta_layers, tmp_path):
    model = partial_class_for("roberta").from_source(source_model("roberta"), roberta_layers)
    model.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["encoder.partial_pattern_layer1.indices"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="partial_pattern_layer1.indices"):
        partial_class_for("roberta").from_pretrained(tmp_path)


def test_config_refusals(roberta_layers):
    cls = partial_class_for("roberta")
    with pytest.raises(ValueError, match="reconstruction='common'.*no meaning.*per_layer"):
        cls.from_source(source_model("roberta"), roberta_layers, reconstruction="common")
    short = LayerPatterns({0: roberta_layers[0], 1: roberta_layers[1]})
    with pytest.raises(ValueError, match=r"no P and R for partial layers \[2\]"):
        cls.from_source(source_model("roberta"), short, partial_layers=[0, 1, 2])
    with pytest.raises(ValueError, match="partial_granularity='layer' is not available for .*albert"):
        partial_class_for("albert").from_source(source_model("albert"), layer_patterns("albert"),
                                                reconstruction="fixed")
    with pytest.raises(ValueError, match="needs P and R per layer"):
        cls(cls.config_class(partial_seq_len=N, partial_k=5, num_hidden_layers=3, partial_granularity="layer",
                             reconstruction="fixed", vocab_size=99, hidden_size=32, num_attention_heads=4,
                             intermediate_size=37), pattern=roberta_layers[0])


def test_the_file_round_trips_and_a_pooled_reader_refuses_it(roberta_layers, tmp_path):
    path = tmp_path / "layers.safetensors"
    roberta_layers.save(path)
    back = load_patterns(path)
    assert isinstance(back, LayerPatterns) and list(back.layers) == [0, 1, 2]
    for layer in back.layers:
        assert torch.equal(back[layer][N].indices, roberta_layers[layer][N].indices)
        assert torch.equal(back[layer][N].reconstruction, roberta_layers[layer][N].reconstruction)
    with pytest.raises(ValueError, match="not a pattern file"):
        PatternBuckets.load(path)
    other_buckets = PatternBuckets({8: AttentionPattern.local(8, 3), N: AttentionPattern.local(N, 5)})
    with pytest.raises(ValueError, match=r"buckets \[8, 16\].*same buckets"):
        LayerPatterns({0: roberta_layers[0], 1: other_buckets})
    assert LayerPatterns({0: roberta_layers[0], 1: AttentionPattern.local(N, 6)}).layers_k() == [[5], [6]]


def test_cli_analyze_derive_convert_load_per_layer(minilm2, tmp_path, capsys):
    """`analyze --granularity layer` → `derive --granularity layer` (held-out error per layer and pooled, beside the
    pooled pattern's) → `convert` (per_layer R by default) → AutoModel on the real MiniLM's first 2 layers."""
    from transformers import AutoModel

    source = minilm2
    run = str(tmp_path / "run")
    analyze_windows(source, run, "layer", capsys)
    assert cli.main(["derive", run, "--k", "4", "--granularity", "layer", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "per layer, 2 layers" in printed and "the pooled pattern's" in printed
    section = json.load(open(os.path.join(run, "results.json")))["derive_per_query_layer"]
    row = section["patterns"][0]
    assert set(row["heldout_per_group"]) == {"0", "1"}
    # per-layer P and R, each fitted to its layer, leave less error than one pooled P and R on held-out text
    assert row["heldout"] < row["heldout_pooled_pattern"]
    ckpt = str(tmp_path / "ckpt")
    assert cli.main(["convert", row["path"], "--out", ckpt, "--model", str(source)]) == 0
    model = AutoModel.from_pretrained(ckpt)
    assert (model.config.partial_granularity, model.config.reconstruction) == ("layer", "per_layer")
    assert torch.equal(model.get_pattern(0).indices, LayerPatterns.load(row["path"])[0][16].indices)
    card = open(os.path.join(ckpt, "README.md"), encoding="utf-8").read()
    assert "partial_pattern_layer{l}.indices" in card and "own covariance" in card
    report = open(os.path.join(run, "report.md"), encoding="utf-8").read()
    assert "## Patterns per layer" in report


# ---------------------------------------------------------------- P and R per head
def head_patterns(model_type: str, k: int = 5) -> LayerPatterns:
    """Every (layer, head)'s P and R from its own covariance (`collect_covariance(granularity="head")`,
    `select_pattern` with ``layer=``, ``head=``), in float64."""
    from hf_partial_attention.analysis import collect_covariance, select_pattern

    windows = torch.randint(6, 99, (64, N), generator=torch.Generator().manual_seed(0))  # (S, n)
    cov = collect_covariance(source_model(model_type).float(), windows, seq_len=N, progress=False,
                             distributed=False, granularity="head")

    def fit(layer, head):
        p = select_pattern(cov, k, layer=layer, head=head)
        return AttentionPattern(p.indices, p.reconstruction.double())

    return LayerPatterns({layer: [fit(layer, head) for head in cov.heads] for layer in cov.layers})


@pytest.fixture(scope="module")
def roberta_heads():
    return head_patterns("roberta")


def test_heads_fit_different_patterns(roberta_heads):
    p = [roberta_heads.group(0, head)[N].indices for head in range(4)]
    assert roberta_heads.heads == 4 and not all(torch.equal(p[0], q) for q in p[1:])


def test_each_head_runs_its_own_pattern(roberta_heads):
    """Head h of layer 0 attends as a pooled model holding head h's pattern does at that head (the maps of
    `output_attentions`), and differs from it at the other heads' where their patterns differ."""
    cls = partial_class_for("roberta")
    model = cls.from_source(source_model("roberta"), roberta_heads).eval()
    assert model.config.partial_granularity == "head"
    ids, mask = batch()
    with torch.no_grad():
        maps = model(input_ids=ids, attention_mask=mask, output_attentions=True).attentions[0]  # (B, H, n, n)
        for head in range(4):
            pooled = cls.from_source(source_model("roberta"), roberta_heads.group(0, head), partial_layers=[0]).eval()
            expected = pooled(input_ids=ids, attention_mask=mask, output_attentions=True).attentions[0]
            torch.testing.assert_close(maps[:, head], expected[:, head], rtol=0, atol=1e-12)
            other = (head + 1) % 4
            if not torch.equal(roberta_heads.group(0, other)[N].indices, roberta_heads.group(0, head)[N].indices):
                assert (maps[:, other] - expected[:, other]).abs().max() > 1e-6


@pytest.mark.parametrize("reconstruction", ["per_layer", "fixed"])
def test_every_kernel_equals_the_reference_per_head(roberta_heads, reconstruction):
    """gather (the reference), fused and tiled on P and R per head: the same outputs and gradients in float64, on a
    padded batch."""
    model = partial_class_for("roberta").from_source(source_model("roberta"), roberta_heads,
                                                     reconstruction=reconstruction)
    ids, mask = batch()
    results = kernel_runs(model, ("gather", "fused"), ids, mask)
    (ref, ref_grads), (out, grads) = results["gather"], results["fused"]
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-10)
    assert set(grads) == set(ref_grads) and (reconstruction == "per_layer") == any(
        "reconstruction" in n for n in grads)
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=0, atol=1e-9, msg=name)
    model.eval().set_partial_implementation("tiled")
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).last_hidden_state, ref, rtol=0,
                                   atol=1e-10)


def test_per_head_maps_under_autograd_come_from_the_reference(roberta_heads):
    """Asked for the attention maps in training, a per-head layer runs each head by the reference kernel (the
    all-heads node writes no map): the maps are there and are the reference's, and the gradients still flow."""
    model = partial_class_for("roberta").from_source(source_model("roberta"), roberta_heads, reconstruction="per_layer")
    ids, mask = batch()
    model.set_partial_implementation("gather")
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    model.set_partial_implementation("fused")
    out = model(input_ids=ids, attention_mask=mask, output_attentions=True)
    assert all(a is not None for a in out.attentions)
    for got, ref in zip(out.attentions, expected):
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)
    out.last_hidden_state.sum().backward()
    assert any(p.grad is not None and "reconstruction" in n for n, p in model.named_parameters())


def test_get_layer_patterns_gives_back_what_was_installed(roberta_heads):
    model = partial_class_for("roberta").from_source(source_model("roberta"), roberta_heads)
    back = model.get_layer_patterns()
    assert back.heads == 4 and list(back.layers) == [0, 1]
    assert torch.equal(back.group(1, 3)[N].reconstruction, roberta_heads.group(1, 3)[N].reconstruction)
    model.set_pattern(back)  # and takes it back
    assert torch.equal(model.get_pattern(1, head=2).indices, roberta_heads.group(1, 2)[N].indices)


def test_set_pattern_per_head_derives_each_modules_layout_once(roberta_heads, monkeypatch):
    """A module holds every head's P: `set_pattern` derives its layout once, after the last head's P is in (not once
    per head, which made a per-head conversion H times slower), and that layout is every head's."""
    from hf_partial_attention import attention_common

    model = partial_class_for("roberta").from_source(source_model("roberta"), roberta_heads)
    derived = []
    original = attention_common.PatternLayout.from_indices.__func__
    monkeypatch.setattr(attention_common.PatternLayout, "from_indices",
                        classmethod(lambda cls, p, r=None: derived.append(p.clone()) or original(cls, p, r)))
    model.set_pattern(roberta_heads)
    layers, heads = model.config.partial_layers, roberta_heads.heads
    assert len(derived) == len(layers) * heads  # one layout per (layer, head), not per (layer, head, head)
    for i, layer in enumerate(layers):
        for head in range(heads):
            assert torch.equal(derived[i * heads + head], roberta_heads.group(layer, head)[N].indices)


def test_per_head_refusals(roberta_heads, roberta_layers, tmp_path):
    cls = partial_class_for("roberta")
    three = LayerPatterns({l: [roberta_heads.group(l, h) for h in range(3)] for l in roberta_heads.layers})
    with pytest.raises(ValueError, match="holds 3 heads per layer but the model has num_attention_heads=4"):
        cls.from_source(source_model("roberta"), three)
    model = cls.from_source(source_model("roberta"), roberta_heads)
    with pytest.raises(ValueError, match="needs P and R per head .* got layer"):
        model.set_pattern(roberta_layers)
    with pytest.raises(ValueError, match="either every layer gives one pattern per head"):
        LayerPatterns({0: roberta_heads[0], 1: roberta_layers[1]})
    path = tmp_path / "heads.safetensors"
    roberta_heads.save(path)
    back = load_patterns(path)
    assert back.heads == 4 and torch.equal(back.group(2, 3)[N].indices, roberta_heads.group(2, 3)[N].indices)


def test_cli_derive_per_head_on_minilm(minilm2, tmp_path, capsys):
    """`analyze --granularity head` → `derive --granularity head`: each head's P and R leave less held-out error than
    one pooled P and R at the same k; `convert` installs them, one per head."""
    from transformers import AutoModel

    source = minilm2
    run = str(tmp_path / "run")
    analyze_windows(source, run, "head", capsys)
    assert cli.main(["derive", run, "--k", "4", "--granularity", "head", "--no-progress"]) == 0
    assert "per head, 2 layers x 12 heads" in capsys.readouterr().out
    row = json.load(open(os.path.join(run, "results.json")))["derive_per_query_head"]["patterns"][0]
    assert len(row["heldout_per_group"]) == 24 and row["heldout"] < row["heldout_pooled_pattern"]
    ckpt = str(tmp_path / "ckpt")
    assert cli.main(["convert", row["path"], "--out", ckpt, "--model", str(source)]) == 0
    model = AutoModel.from_pretrained(ckpt)
    assert model.config.partial_granularity == "head"
    card = open(os.path.join(ckpt, "README.md"), encoding="utf-8").read()
    assert "(H, n, k) = (H = 12, 16, 4)" in card and "every head has its own P" in card
    assert torch.equal(model.get_pattern(0, head=5).indices, LayerPatterns.load(row["path"]).group(0, 5)[16].indices)


def test_memory_of_r_per_head_is_stated_before_it_is_built():
    """BERT-base per head at n = 512, k = 32 (the issue's example): 11 partial layers × 12 heads of (512, 480, 32) in
    float32; MiniLM at the demo's n = 128, k = 16 stays quiet."""
    from hf_partial_attention.cost import memory_warning, reconstruction_bytes

    assert reconstruction_bytes(512, 32, 11 * 12) == 11 * 12 * 512 * 480 * 32 * 4
    warning = memory_warning(512, 32, 11, 12)
    assert "3.9 GiB" in warning and "11 layers × 12 heads" in warning and "--granularity layer" in warning
    assert memory_warning(512, 32, 11, None) is None  # per layer: 0.3 GiB
    assert memory_warning(128, 16, 5, 12) is None
    assert reconstruction_bytes(128, 16, 1, lengths_k={16: 16, 128: 16}) == 128 * 112 * 16 * 4  # exact buckets: none


@pytest.mark.slow
def test_length_buckets_per_head_through_the_cli(encoders, tmp_path, capsys):  # noqa: F811
    """``analyze --inputs sentences --lengths 12 24 --granularity head`` → ``derive --granularity head --bucket-k``
    → ``convert``: every head of every partial layer holds its own P per bucket, and a short input runs bucket 12's
    P and R of each head: head h of layer 0 attends as a pooled model holding head h's buckets does."""
    from hf_partial_attention.analysis.corpus import default_texts

    source = encoders["roberta"]
    text = tmp_path / "text.txt"
    text.write_text("\n\n".join(default_texts()[:40]), encoding="utf-8")
    run = str(tmp_path / "run")
    assert cli.main(["analyze", "--model", source, "--inputs", "sentences", "--text-file", str(text), "--lengths",
                     "12", "24", "--granularity", "head", "--out", run, "--no-progress"]) == 0
    capsys.readouterr()
    assert cli.main(["derive", run, "--k", "4", "--bucket-k", "12=6", "--granularity", "head", "--no-progress"]) == 0
    assert "per head, length buckets; held-out error per bucket b=12: " in capsys.readouterr().out
    path = os.path.join(run, "patterns", "buckets_per_query_head_k4_b12k6.safetensors")
    sets = load_patterns(path)
    # held-out errors per (layer, head) and bucket: layer 1, head 1's at b = 12 recomputed from its own scores alone
    from hf_partial_attention.analysis.length_eval import PaddedPattern, RealPositionMeter, run_inputs
    from hf_partial_attention.analysis.lengths import load_heldout_inputs
    from hf_partial_attention.pattern_buckets import bucket_for

    row = json.load(open(os.path.join(run, "results.json")))["lengths_per_query_head"]["patterns"][0]
    assert sorted(row["heldout"]) == ["12", "24"] and len(row["heldout_per_group"]["12"]) == len(sets.layers) * 4
    held = load_heldout_inputs(run)
    index = [i for i, t in enumerate(held.lengths.tolist()) if bucket_for([12, 24], t) == 12]
    meter = RealPositionMeter(12, {"own": PaddedPattern(sets.group(1, 1)[12])})
    from hf_partial_attention.analysis.collect import load_model_and_tokenizer

    run_inputs(load_model_and_tokenizer(source, load_tokenizer=False)[0], held, index, 12,
               lambda layer, scores, lengths: meter.update(layer, scores[:, 1:2], lengths) if layer == 1 else None,
               progress=False)
    assert row["heldout_per_group"]["12"]["1.1"] == pytest.approx(meter.results()["own"], rel=1e-6)
    assert sets.group(1, 1)[12].metadata["heldout_normalized_error"] == row["heldout_per_group"]["12"]["1.1"]
    assert sets.heads == 4 and sets.lengths == [12, 24] and sets.lengths_k == [6, 4]
    ckpt = str(tmp_path / "ckpt")
    assert cli.main(["convert", path, "--out", ckpt, "--model", source]) == 0
    from transformers import AutoModel

    model = AutoModel.from_pretrained(ckpt).double().eval()
    assert (model.config.partial_granularity, model.config.partial_lengths_k) == ("head", [6, 4])
    for head in range(4):
        assert torch.equal(model.get_pattern(0, 12, head).indices, sets.group(0, head)[12].indices)
    ids = torch.randint(1000, 2000, (1, 10), generator=torch.Generator().manual_seed(0))  # runs bucket 12
    with torch.no_grad():
        maps = model(input_ids=ids, output_attentions=True).attentions[0]
        for head in range(4):
            pooled = partial_class_for("roberta").from_source(source, sets.group(0, head), partial_layers=[0],
                                                              reconstruction="fixed").double().eval()
            expected = pooled(input_ids=ids, output_attentions=True).attentions[0]
            torch.testing.assert_close(maps[:, head], expected[:, head], rtol=0, atol=1e-12)


def test_the_triton_kernel_per_head_under_the_interpreter_equals_the_reference():
    """P and R per head through the Triton kernel (TRITON_INTERPRET=1, conftest): outputs and gradients equal the
    reference kernel's in float32 (a RoBERTa with 2 heads: head_dim 16, the kernel's smallest tile)."""
    import triton  # noqa: F401  (a dev dependency: missing, this test fails instead of skipping)

    from hf_partial_attention.analysis import collect_covariance, select_pattern
    from hf_partial_attention.architectures import architecture_for
    from test_encoders import check_triton_equals_gather, tiny_config

    config = tiny_config("roberta")
    config.num_attention_heads = 2
    torch.manual_seed(0)
    source = architecture_for("roberta").source_class("AutoModel")(config).eval()
    windows = torch.randint(6, 99, (64, N), generator=torch.Generator().manual_seed(0))  # (S, n)
    cov = collect_covariance(source, windows, seq_len=N, progress=False, distributed=False, granularity="head")
    patterns = LayerPatterns({layer: [select_pattern(cov, 5, layer=layer, head=head) for head in cov.heads]
                              for layer in cov.layers})
    assert not torch.equal(patterns.group(0, 0)[N].indices, patterns.group(0, 1)[N].indices)
    check_triton_equals_gather(partial_class_for("roberta").from_source(source, patterns))  # dropout is 0
