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

from test_encoders import N, _reference, batch, source_model
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


@pytest.mark.parametrize("model_type", ["roberta", "modernbert", "distilbert", "bert"])
def test_save_load_remote_code_and_format_4(model_type, tmp_path):
    patterns = layer_patterns(model_type)
    cls = partial_class_for(model_type)
    model = cls.from_source(source_model(model_type), patterns).eval()
    model.save_pretrained(tmp_path)
    config = json.load(open(tmp_path / "config.json"))
    assert (config["partial_format_version"], config["partial_granularity"]) == (4, "layer")
    names = [n for n in load_file(tmp_path / "model.safetensors") if "partial_pattern" in n]
    assert {n.split("partial_pattern_")[1].split(".")[0] for n in names} == {
        f"layer{l}" for l in model.config.partial_layers}
    ids, mask = batch()
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).last_hidden_state
        loaded = cls.from_pretrained(tmp_path).eval()
        torch.testing.assert_close(loaded(input_ids=ids, attention_mask=mask).last_hidden_state, expected,
                                   rtol=0, atol=0)
    for layer in model.config.partial_layers:
        assert torch.equal(loaded.get_pattern(layer).indices, patterns[layer][N].indices)
    _reference(model, str(tmp_path), ids, mask)
    check_remote_loads([f"{tmp_path} AutoModel"], tmp_path)


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
    with pytest.raises(ValueError, match="buckets .* with k"):
        LayerPatterns({0: roberta_layers[0], 1: AttentionPattern.local(N, 6)})


def test_cli_analyze_derive_convert_load_per_layer(minilm_path, tmp_path, capsys):
    """`analyze --granularity layer` → `derive --granularity layer` (held-out error per layer and pooled, beside the
    pooled pattern's) → `convert` (per_layer R by default) → AutoModel on the real MiniLM's first 2 layers."""
    from transformers import AutoModel, BertModel

    source = tmp_path / "minilm2"
    small = BertModel.from_pretrained(minilm_path, num_hidden_layers=2)
    small.save_pretrained(source)
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(minilm_path).save_pretrained(source)
    run = str(tmp_path / "run")
    assert cli.main(["analyze", "--model", str(source), "--seq-len", "16", "--max-sequences", "48", "--granularity",
                     "layer", "--heldout-sequences", "8", "--out", run, "--no-progress"]) == 0
    capsys.readouterr()
    assert cli.main(["derive", run, "--k", "4", "--granularity", "layer", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "per layer, 2 layers" in printed and "the pooled pattern's" in printed
    section = json.load(open(os.path.join(run, "results.json")))["derive_per_query_layer"]
    row = section["patterns"][0]
    assert set(row["heldout_per_layer"]) == {"0", "1"}
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
