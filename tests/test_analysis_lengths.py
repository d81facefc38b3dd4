"""Length buckets: conditional R, the error at real positions, analyze_lengths / derive_lengths on a tiny BERT and
on the real MiniLM, the CLI and convert of a buckets file."""

import json
import logging
import os

import numpy as np
import pytest
import torch

from hf_partial_attention import AttentionPattern
from hf_partial_attention.analysis.conditional import conditional_reconstruction
from hf_partial_attention.analysis.covariance import ScoreCovariance
from hf_partial_attention.analysis.evaluation import LinearReconstructor
from hf_partial_attention.analysis.length_eval import PaddedPattern, RealPositionMeter
from hf_partial_attention.analysis.derive import derive_lengths
from hf_partial_attention.analysis.lengths import analyze_lengths
from hf_partial_attention.pattern_buckets import PatternBuckets
from hf_partial_attention.reconstruction import complement_indices, solve_reconstruction

LENGTHS = (4, 12, 20, 32)  # 4: no input is that short (>= 3 words + [CLS] + [SEP]), so it is skipped


def _random_problem(n=9, k=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(n, n, n + 4, generator=gen, dtype=torch.float64)
    cov = a @ a.transpose(-1, -2) / (n + 4) + 0.1 * torch.eye(n, dtype=torch.float64)  # (n, n, n) SPD
    indices = torch.sort(torch.stack([torch.randperm(n, generator=gen)[:k] for _ in range(n)]), -1).values
    return cov, indices, torch.randn(n, n, generator=gen, dtype=torch.float64)


@pytest.mark.parametrize("t", [1, 4, 9])
def test_conditional_r_equals_brute_force_solve(t):
    cov, indices, mean = _random_problem()
    n, k = indices.shape
    got = conditional_reconstruction(cov, indices, t, mean, ridge=0.0)
    comp = complement_indices(indices, n)
    for i in range(n):
        if i >= t:
            assert not got.reconstruction[i].any() and not got.bias[i].any() and got.error[i] == 0
            continue
        s = [j for j in indices[i].tolist() if j < t]
        u = [j for j in range(t) if j not in indices[i].tolist()]
        c = cov[i].numpy()
        r = c[np.ix_(u, s)] @ np.linalg.inv(c[np.ix_(s, s)]) if s else np.zeros((len(u), 0))
        rows = [comp[i].tolist().index(j) for j in u]
        cols = [indices[i].tolist().index(j) for j in s]
        np.testing.assert_allclose(got.reconstruction[i][np.ix_(rows, cols)].numpy(), r, rtol=1e-9, atol=1e-10)
        assert got.reconstruction[i].abs().sum() == pytest.approx(np.abs(r).sum(), rel=1e-9)  # zero elsewhere
        mu = mean[i].numpy()
        np.testing.assert_allclose(got.bias[i][rows].numpy(), mu[u] - r @ mu[s], rtol=1e-9, atol=1e-10)
        schur = np.trace(c[np.ix_(u, u)]) - (np.trace(r @ c[np.ix_(s, u)]) if s else 0.0)
        assert float(got.error[i]) == pytest.approx(schur, rel=1e-9, abs=1e-12)
    if t == n:  # every key exists: eq. 7 of the whole pattern
        recon, bias, error = solve_reconstruction(cov, indices, mean, ridge=1e-6)
        full = conditional_reconstruction(cov, indices, t, mean)
        torch.testing.assert_close(full.reconstruction, recon, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(full.error, error, rtol=1e-10, atol=1e-12)


def test_error_at_real_positions_only():
    torch.manual_seed(0)
    b, n, k = 6, 8, 2
    cov, indices, mean = _random_problem(n, k)
    recon, bias, _ = solve_reconstruction(cov, indices, mean)
    pattern = AttentionPattern(indices, recon, bias)
    scores = torch.randn(3, 2, b, b)
    lengths = torch.tensor([6, 3, 4])
    meter = RealPositionMeter(b, {"zero fill": PaddedPattern(pattern)})
    meter.update(0, scores, lengths)
    # by hand: zero every key >= t, pad to n, reconstruct, compare at rows and keys < t only
    sse, values = 0.0, {}
    apply = LinearReconstructor(pattern)
    for s, t in enumerate(lengths.tolist()):
        for h in range(2):
            x = torch.zeros(n, n)
            x[:t, :t] = scores[s, h, :t, :t]
            sse += float((apply(x[None])[0, :t, :t] - x[:t, :t]).double().pow(2).sum())
            for i in range(t):
                for j in range(t):
                    values.setdefault((i, j), []).append(float(x[i, j]))
    variance = sum(np.var(v) * len(v) for v in values.values())
    assert meter.results()["zero fill"] == pytest.approx(sse / variance, rel=1e-5)
    garbage = scores.clone()  # what padded positions scored never counts
    for s, t in enumerate(lengths.tolist()):
        garbage[s, :, t:, :] = 1e3
        garbage[s, :, :, t:] = -7.0
    again = RealPositionMeter(b, {"zero fill": PaddedPattern(pattern)})
    again.update(0, garbage, lengths)
    assert again.results() == meter.results()


@pytest.fixture(scope="module")
def sharp_bert_dir(tmp_path_factory, minilm_path):
    """A tiny random BertModel with the MiniLM tokenizer and weights large enough (initializer_range 0.3) that
    attention is far from uniform: padding that leaked into real positions would show in the scores."""
    from transformers import AutoTokenizer, BertConfig, BertModel

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(minilm_path)
    config = BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=37, max_position_embeddings=64, initializer_range=0.3)
    path = tmp_path_factory.mktemp("sharp_bert")
    BertModel(config).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def bucketed(sharp_bert_dir, tmp_path_factory):
    tiny_bert_dir = sharp_bert_dir
    from hf_partial_attention.analysis.corpus import default_texts
    from hf_partial_attention.analysis.workflow import analyze, derive

    out = str(tmp_path_factory.mktemp("lengths"))
    analyze(tiny_bert_dir, default_texts()[:15], out, seq_len=32, max_sequences=40, heldout_sequences=4,
            progress=False)
    derive(out, [4], evaluate=False, progress=False)  # the fixed-window pattern the buckets are compared with
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("hf_partial_attention.analysis.lengths").addHandler(handler)
    try:
        summary = analyze_lengths(tiny_bert_dir, None, out, lengths=LENGTHS, max_inputs=160, max_heldout=40,
                                  batch_size=16, progress=False)
    finally:
        logging.getLogger("hf_partial_attention.analysis.lengths").removeHandler(handler)
    return out, summary, [r.getMessage() for r in records]


def test_analyze_lengths_files_counts_and_skipped_bucket(bucketed):
    out, summary, messages = bucketed
    assert [r["length"] for r in summary["buckets"]] == [12, 20, 32]
    assert summary["skipped"] == [{"length": 4, "used_instead": 12}]
    assert any("Bucket 4 has no fit input: skipped; inputs of its lengths run bucket 12" in m for m in messages)
    assert not os.path.exists(os.path.join(out, "covariance_len4.safetensors"))
    assert sum(r["fit_inputs"] for r in summary["buckets"]) == summary["fit_inputs"] == 160
    assert sum(r["heldout_inputs"] for r in summary["buckets"]) == summary["heldout_inputs"] == 40
    assert sum(summary["length_histogram"].values()) == 200 and os.path.isfile(summary["figures"]["input_lengths"])
    assert all(key.isdigit() for key in summary["length_histogram"])  # token counts as keys, not tensor reprs
    for r in summary["buckets"]:
        cov = ScoreCovariance.load(r["path"])
        assert cov.seq_len == r["length"] and cov.num_sequences == r["fit_inputs"] and cov.row_counts
        assert r["min_length"] <= r["median_length"] <= r["max_length"] <= r["length"]
    report = open(os.path.join(out, "report.md")).read()
    assert "## Length buckets" in report and "Bucket 4: no fit input, skipped" in report


def test_bucket_covariance_equals_each_input_run_alone_unpadded(bucketed, sharp_bert_dir):
    """A sequence's contribution does not depend on its batch's padding: run every fit input of bucket 20 alone at
    its own length, and accumulate its scores zero-filled to 20."""
    from transformers import AutoTokenizer, BertModel

    from hf_partial_attention.analysis.capture import capture_scores
    from hf_partial_attention.analysis.inputs import flatten, load_inputs, tokenize_inputs
    from hf_partial_attention.analysis.corpus import split_heldout

    out, summary, _ = bucketed
    tok = AutoTokenizer.from_pretrained(sharp_bert_dir)
    model = BertModel.from_pretrained(sharp_bert_dir).eval()
    fit = tokenize_inputs(tok, flatten(split_heldout(load_inputs(None, "sentence"), 5)[0])[0][:160], 32)
    expected = ScoreCovariance(20)

    def alone(layer, x):  # (1, H, t, t): zero-filled to 20
        t = x.shape[-1]
        padded = torch.zeros(1, x.shape[1], 20, 20)
        padded[..., :t, :t] = x
        expected.update(layer, padded, lengths=torch.tensor([t]))

    with torch.no_grad(), capture_scores(model, alone):
        for s in torch.nonzero((fit.lengths > 12) & (fit.lengths <= 20)).flatten().tolist():
            t = int(fit.lengths[s])
            model(input_ids=fit.input_ids[s:s + 1, :t], token_type_ids=fit.token_type_ids[s:s + 1, :t])
    got = ScoreCovariance.load(os.path.join(out, "covariance_len20.safetensors"))
    assert torch.equal(got.row_counts_of(), expected.row_counts_of())
    torch.testing.assert_close(got.per_query(), expected.per_query(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got.mean_per_query(), expected.mean_per_query(), rtol=1e-4, atol=1e-5)


def test_derive_lengths_buckets_file_round_trips_with_heldout_errors(bucketed):
    out, _, _ = bucketed
    result = derive_lengths(out, [4, 12], progress=False)
    k4 = {r["length"]: r for r in result["ks"]["4"]["buckets"]}
    k12 = {r["length"]: r for r in result["ks"]["12"]["buckets"]}
    assert k12[12]["exact"] and not k12[20]["exact"] and not k4[12]["exact"]
    loaded = PatternBuckets.load(os.path.join(out, "patterns", "buckets_k4.safetensors"))
    assert loaded.lengths == [12, 20, 32] and loaded.k == 4 and loaded.exact_lengths == []
    assert loaded.metadata["num_inputs"] == {str(b): k4[b]["fit_inputs"] for b in (12, 20, 32)}
    cov20 = ScoreCovariance.load(os.path.join(out, "covariance_len20.safetensors"))
    from hf_partial_attention.analysis.selection import select_pattern

    fresh = select_pattern(cov20, 4)
    assert torch.equal(loaded[20].indices, fresh.indices) and torch.equal(loaded[20].reconstruction,
                                                                         fresh.reconstruction)
    for b in (12, 20, 32):
        row = k4[b]
        assert loaded[b].metadata["heldout_normalized_error"] == row["heldout"] > 0
        assert loaded[b].metadata["heldout_inputs"] == row["heldout_inputs"] > 0
        assert row["reference_seq_len"] == 32 and 0 < row["zero_fill_n"] and 0 < row["conditional_n"]
        assert row["conditional_bucket"] <= row["heldout"] * 1.05  # conditioning on the keys that exist helps
    # short inputs: the zero fill of n = 32 is worse than the bucket's own pattern
    assert k4[20]["heldout"] < k4[20]["zero_fill_n"]
    assert PatternBuckets.load(os.path.join(out, "patterns", "buckets_k12.safetensors")).exact_lengths == [12]
    report = open(os.path.join(out, "report.md")).read()
    assert "**k = 4**" in report and "zero fill of n" in report
    assert "derive_lengths" in json.load(open(os.path.join(out, "results.json")))


def test_cli_analyze_inputs_and_derive_buckets(tiny_bert_dir, tmp_path, capsys):
    from hf_partial_attention.cli import main

    pairs = tmp_path / "pairs.tsv"
    pairs.write_text("".join(f"the first sentence number {i} is here\tand a second one {i}\n" for i in range(30)))
    out = str(tmp_path / "run")
    assert main(["analyze", "--model", tiny_bert_dir, "--inputs", "pairs", "--text-file", str(pairs),
                 "--lengths", "16", "32", "--out", out, "--no-progress"]) == 0
    assert "covariances of 24 pairs per bucket (b=16: 24)" in capsys.readouterr().out
    assert main(["derive", out, "--k", "4", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "buckets_k4.safetensors" in printed and "b=16: 0." in printed
    assert json.load(open(os.path.join(out, "results.json")))["analyze_lengths"]["skipped"] == [
        {"length": 32, "used_instead": None}]


def test_convert_a_buckets_file(bucketed, tmp_path, sharp_bert_dir):
    from hf_partial_attention.analysis.workflow import convert

    out, _, _ = bucketed
    path = os.path.join(out, "patterns", "buckets_k4.safetensors")
    if not os.path.isfile(path):
        derive_lengths(out, [4], evaluate=False, progress=False)
    result = convert(path, str(tmp_path / "ckpt"), sharp_bert_dir, reconstruction="fixed")
    config = json.load(open(tmp_path / "ckpt" / "config.json"))
    assert result["lengths"] == config["partial_lengths"] == [12, 20, 32] and config["partial_k"] == 4
    assert result["reload_max_abs_diff"] < 1e-5
    from transformers import AutoModel

    from hf_partial_attention import PartialBertModel

    reloaded = AutoModel.from_pretrained(tmp_path / "ckpt").eval()
    assert isinstance(reloaded, PartialBertModel)
    ids = torch.randint(1000, 2000, (1, 15))  # a 15-token input runs bucket 20
    fresh = PartialBertModel.from_bert(sharp_bert_dir, PatternBuckets.load(path), reconstruction="fixed").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).last_hidden_state, fresh(input_ids=ids).last_hidden_state)


def test_derive_and_convert_a_k_per_bucket(bucketed, tmp_path, sharp_bert_dir, capsys):
    """``--bucket-k 20=6``: bucket 20 takes k = 6 (its own greedy at 6), the others --k; the checkpoint converted from
    it holds partial_lengths_k and is of format 3; a bucket that is not one, or the longest, is refused."""
    from hf_partial_attention.analysis.selection import select_pattern
    from hf_partial_attention.cli import main

    out, _, _ = bucketed
    assert main(["derive", out, "--k", "4", "--bucket-k", "20=6", "--no-evaluate", "--no-progress"]) == 0
    assert "b=20 (k=6): not measured, b=32: not measured" in capsys.readouterr().out
    path = os.path.join(out, "patterns", "buckets_k4_b20k6.safetensors")
    loaded = PatternBuckets.load(path)
    assert loaded.lengths_k == [4, 6, 4] and loaded.k == 4
    for b, k in [(12, 4), (20, 6), (32, 4)]:
        fresh = select_pattern(ScoreCovariance.load(os.path.join(out, f"covariance_len{b}.safetensors")), k)
        assert torch.equal(loaded[b].indices, fresh.indices) and torch.equal(loaded[b].reconstruction,
                                                                             fresh.reconstruction)
    capsys.readouterr()
    assert main(["convert", path, "--out", str(tmp_path / "ckpt"), "--model", sharp_bert_dir,
                 "--reconstruction", "common"]) == 0
    # d_h = 8: 1 − (4·8 + 8·4) / (12·8), 1 − (6·8 + 14·6) / (20·8), 1 − (4·8 + 28·4) / (32·8)
    assert "Length buckets (b: k_b, saving): 12: 4, 33.3 %, 20: 6, 17.5 %, 32: 4, 43.8 %" in capsys.readouterr().out
    config = json.load(open(tmp_path / "ckpt" / "config.json"))
    assert (config["partial_lengths_k"], config["partial_format_version"]) == ([4, 6, 4], 3)
    for bad in ({32: 6}, {16: 4}, {20: 21}):
        with pytest.raises(ValueError, match="bucket_k="):
            derive_lengths(out, [4], bucket_k=bad, evaluate=False, progress=False)
    for bad in ([0, 4], [4, 33]):  # the k range of every derive (`derive_files.check_ks`): [1, the longest bucket]
        with pytest.raises(ValueError, match=r"k must be in \[1, 32\] \(the longest bucket of .*pass --k values"):
            derive_lengths(out, bad, evaluate=False, progress=False)
    with pytest.raises(SystemExit):
        main(["derive", out, "--k", "4", "--bucket-k", "20:6"])
    assert "is not B=K" in capsys.readouterr().err


def test_real_minilm_sentences(minilm_path, tmp_path):
    out = str(tmp_path / "minilm")
    summary = analyze_lengths(minilm_path, None, out, lengths=(16, 32), max_inputs=48, max_heldout=16,
                              batch_size=16, progress=False)
    assert summary["lengths"] == [16, 32] and summary["head_dim"] == 32
    result = derive_lengths(out, [8], progress=False)
    rows = {r["length"]: r for r in result["ks"]["8"]["buckets"]}
    for b, row in rows.items():
        assert 0 < row["predicted"] < 1, b
        if row["heldout_inputs"]:
            assert 0 < row["heldout"] < 1.5 and 0 < row["conditional_bucket"] < 1.5, b
