"""analyze → derive → convert on a tiny BERT and real text: files, numbers, reload with AutoModel."""

import json
import os

import pytest
import torch

from hf_partial_attention import AttentionPattern
from hf_partial_attention.analysis.corpus import default_texts
from hf_partial_attention.analysis.report import _fmt
from hf_partial_attention.analysis.workflow import analyze, convert, derive


@pytest.fixture(scope="module")
def analysed(tiny_bert_dir, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("analysis"))
    texts = default_texts()[:15]
    summary = analyze(tiny_bert_dir, texts, out, seq_len=16, max_sequences=12, heldout_sequences=4,
                      scopes=("per_query", "whole"), granularity="layer", max_k=64, progress=False)
    return out, summary


def test_analyze_writes_covariance_heldout_figures_and_report(analysed):
    out, summary = analysed
    for name in ("covariance.safetensors", "heldout_windows.safetensors", "results.json", "report.md"):
        assert os.path.isfile(os.path.join(out, name)), name
    assert summary["num_sequences"] == 12 and summary["heldout_sequences"] == 4
    assert set(summary["figures"]) == {"per_query_spectra", "per_query_eigenvectors", "global_eigenvectors",
                                       "energy_global_vs_per_query", "layer_projection"}
    assert all(os.path.isfile(p) for p in summary["figures"].values())
    assert [row["layer"] for row in summary["layer_projection"]] == [0, 1]
    assert 0 < summary["top_eigenvalue_share"]["0"] <= 1


def test_derive_per_query_with_heldout_baselines(analysed):
    out, _ = analysed
    result = derive(out, [2, 4], "per_query", progress=False)
    assert [p["k"] for p in result["patterns"]] == [2, 4]
    assert all(os.path.isfile(p["path"]) for p in result["patterns"])
    methods = {(m["method"], m["k"]) for m in result["heldout"]["methods"]}
    assert ("greedy P + R", 4) in methods and ("Nyström CUR", 2) in methods and len(methods) == 12
    greedy = [m for m in result["heldout"]["methods"] if m["method"] == "greedy P + R"]
    assert all(0 < m["heldout"] < 1.5 and 0 < m["predicted"] < 1 for m in greedy)
    assert {c["scope"] for c in result["curves"]} == {"per_query", "whole"}
    report = open(os.path.join(out, "report.md")).read()
    assert "Held-out reconstruction error" in report and "**Budget k = 4**" in report
    assert "derive_per_query" in json.load(open(os.path.join(out, "results.json")))
    # each file records its measured held-out error, shown beside the predicted one in the report's pattern table
    for row, m in zip(result["patterns"], greedy):
        saved = AttentionPattern.load(row["path"])
        assert saved.heldout_error == m["heldout"] == row["heldout"] and saved.metadata["heldout_windows"] == 4
        assert f"| {_fmt(m['predicted'])} | {_fmt(m['heldout'])} |" in report


def test_derive_whole(analysed):
    out, _ = analysed
    result = derive(out, [8, 16], "whole", baselines=False, progress=False)
    assert [p["k_bar"] for p in result["patterns"]] == [8, 16]
    assert {m["method"] for m in result["heldout"]["methods"]} == {"greedy P + R"}


@pytest.mark.parametrize("family, structure", [("per_query", None), ("columns", 16), ("blocks", 16),
                                               ("windows", 4), ("bands", None)])
def test_derive_each_family(analysed, family, structure):
    from hf_partial_attention.analysis import select_pattern
    from hf_partial_attention.analysis.covariance import ScoreCovariance
    from hf_partial_attention.attention_common import block_rows

    out, _ = analysed
    result = derive(out, [4], "per_query", evaluate=False, family=family, section=f"family_{family}")
    path = result["patterns"][0]["path"]
    tag = "per_query" if family == "per_query" else f"per_query_{family}"
    assert path.endswith(f"patterns/{tag}_k4.safetensors")
    saved = AttentionPattern.load(path)
    # the file holds what the selection entry point gives for this family on the same covariance
    expect = select_pattern(ScoreCovariance.load(os.path.join(out, "covariance.safetensors")), 4, family=family)
    assert torch.equal(saved.indices, expect.indices) and torch.equal(saved.reconstruction, expect.reconstruction)
    assert block_rows(saved.indices) == structure
    if family == "bands":
        n = saved.seq_len
        assert len({tuple(sorted(((saved.indices[i] - i) % n).tolist())) for i in range(n)}) == 1


def test_derive_refusals(analysed, tmp_path, tiny_bert_dir):
    out, _ = analysed
    with pytest.raises(ValueError, match="constrains per-query patterns"):
        derive(out, [4], "whole", family="columns")
    with pytest.raises(ValueError, match="family must be one of"):
        derive(out, [4], "per_query", family="diagonals", evaluate=False)
    with pytest.raises(ValueError, match="k must be in"):
        derive(out, [17], "per_query", evaluate=False)  # n = 16
    with pytest.raises(FileNotFoundError):
        derive(str(tmp_path), [4], "per_query")
    pooled = str(tmp_path / "per_query_only")
    analyze_small = dict(seq_len=16, max_sequences=4, heldout_sequences=0, heldout_every=0, progress=False)
    from hf_partial_attention.analysis.workflow import analyze as run_analyze

    run_analyze(tiny_bert_dir, default_texts()[:3], pooled, **analyze_small)
    with pytest.raises(ValueError, match="rerun analyze with --scopes whole"):
        derive(pooled, [4], "whole")


def test_convert_reloads_with_automodel(analysed, tmp_path):
    from transformers import AutoModel

    from hf_partial_attention import PartialBertModel

    out, _ = analysed
    derive(out, [4], "per_query", evaluate=False)
    result = convert(os.path.join(out, "patterns", "per_query_k4.safetensors"), str(tmp_path / "ckpt"))
    assert result["reloaded_class"] == "PartialBertModel" and result["reload_max_abs_diff"] < 1e-5
    model = AutoModel.from_pretrained(tmp_path / "ckpt")
    assert isinstance(model, PartialBertModel) and model.config.partial_k == 4
    written = AttentionPattern.load(os.path.join(out, "patterns", "per_query_k4.safetensors"))
    assert torch.equal(model.get_pattern().indices, written.indices)  # P and R of the file, not the default
    assert torch.equal(model.get_pattern().reconstruction, written.reconstruction)
    assert not torch.equal(written.indices, AttentionPattern.local(16, 4).indices)


def test_analyze_text_file_holds_out_paragraphs_and_refuses_without_any(tiny_bert_dir, tmp_path):
    paragraphs = default_texts()[:10]
    path = tmp_path / "corpus.txt"
    path.write_text("\n\n".join(paragraphs), encoding="utf-8")
    summary = analyze(tiny_bert_dir, str(path), str(tmp_path / "a"), seq_len=16, max_sequences=6,
                      heldout_sequences=3, progress=False)
    assert summary["heldout_sequences"] == 3  # 2 of the 10 paragraphs held out, 3 windows kept
    with pytest.raises(ValueError, match="No held-out data: 1 text"):
        analyze(tiny_bert_dir, str(path), str(tmp_path / "b"), seq_len=16, max_sequences=6, progress=False,
                text_split="document")
    one_line = tmp_path / "short.txt"
    one_line.write_text("\n\n".join([*paragraphs[:4], "word"]), encoding="utf-8")  # the held-out 5th is too short
    with pytest.raises(ValueError, match="No held-out windows of 16 tokens"):
        analyze(tiny_bert_dir, str(one_line), str(tmp_path / "c"), seq_len=16, max_sequences=2, progress=False)


def test_objectives_comparison_on_a_tiny_model(analysed, tmp_path):
    """The objectives study end to end (what `python -m experiments objectives` runs), tiny."""
    from experiments import cli
    from experiments.objectives.study import compare_objectives

    out, _ = analysed
    result = compare_objectives(out, ks=(4,), out=str(tmp_path), progress=False)
    rows = {r["objective"]: r for r in result["rows"]}
    assert set(rows) == {"paper", "shift", "fisher"} and rows["paper"]["vs_paper"] == 1.0
    # recomputed here, independently: the paper objective's converted model on the held-out windows
    from safetensors.torch import load_file
    from transformers import BertModel

    from hf_partial_attention import PartialBertModel
    from hf_partial_attention.analysis import ScoreCovariance, select_pattern

    cov = ScoreCovariance.load(os.path.join(out, "covariance.safetensors"))
    windows = load_file(os.path.join(out, "heldout_windows.safetensors"))["input_ids"]
    original = BertModel.from_pretrained(cov.metadata["model"]).eval()
    converted = PartialBertModel.from_bert(original, select_pattern(cov, 4)).eval()
    with torch.no_grad():
        ref = original(input_ids=windows, output_hidden_states=True)
        new = converted(input_ids=windows, output_hidden_states=True)
    cos = torch.nn.functional.cosine_similarity(ref.last_hidden_state.mean(1).double(),
                                                new.last_hidden_state.mean(1).double(), dim=-1)
    assert rows["paper"]["one_minus_cos"] == pytest.approx(float(1 - cos.mean()), rel=1e-4)
    h, r = new.hidden_states[1], ref.hidden_states[1]
    assert rows["paper"]["layer_error"][0] == pytest.approx(float((h - r).norm() / r.norm()), rel=1e-4)
    assert all(len(r["layer_error"]) == 2 for r in rows.values())
    # the paper objective's own error is its score error; the others record theirs
    assert rows["paper"]["objective_error"] == rows["paper"]["score_error"]
    assert rows["shift"]["objective_error"] != rows["shift"]["score_error"]
    text = open(tmp_path / "objectives.md").read()
    assert "| 4 | fisher |" in text and "goal of halving it" in text
    assert cli.main(["objectives", out, "--k", "4", "--objectives", "paper", "--out", str(tmp_path / "cli"),
                     "--no-progress"]) == 0
    assert json.load(open(tmp_path / "cli" / "objectives.json"))["rows"][0]["objective"] == "paper"


@pytest.mark.slow
def test_paper_preset_at_a_tiny_n(tiny_bert_dir, tmp_path, monkeypatch):
    """`make paper`'s code path (python -m experiments paper) at n = 8 on the tiny model."""
    from experiments import cli

    monkeypatch.chdir(tmp_path)  # no runs/table1 here, whatever the checkout holds: the report says it is skipped

    results = tmp_path / "results"
    assert cli.main(["paper", "--out", "run", "--results", "results", "--model", tiny_bert_dir,
                     "--seq-len", "8", "--fit-sequences", "24", "--heldout-sequences", "6", "--whole-k", "4", "16",
                     "--k", "2", "--max-k", "16", "--second-sequences", "8", "--no-progress"]) == 0
    saved = json.load(open(results / "results.json"))
    section = saved["analyze_n8"]
    assert [row["layer"] for row in section["layer_projection"]] == [0, 1]
    for row in section["layer_projection"]:  # no 8-dim subspace holds more of C^l than its own top-8
        assert row["global@8"] <= row["own@8"] + 1e-9
    assert section["overlap"]["b"] == "package READMEs" and 0 < section["overlap"]["b_on_a"]["8"] <= 1
    whole = saved["derive_whole_n8"]
    assert [p["k_bar"] for p in whole["patterns"]] == [4, 16]
    assert {m["method"] for m in whole["heldout"]["methods"]} == {"greedy P + R"}
    assert {c["scope"] for c in whole["curves"]} == {"per_query", "whole"}
    report = open(results / "report.md").read()
    for figure in ("layer_projection", "dataset_overlap", "global_eigenvectors", "patterns_whole",
                   "error_curves_whole"):
        assert f"figures/{figure}.png" in report, figure
        assert (results / "figures" / f"{figure}.png").is_file()
    assert str(tmp_path) not in report and "Across training" in report and "skipped" in report
    # the command as typed (relative paths here, as in `make paper`), to rerun it
    # (the model's absolute path, which records no Hub id, by its folder's name: no path of this machine)
    assert (f"Command: `python -m experiments paper --out run --results results --model "
            f"{os.path.basename(tiny_bert_dir)} ") in report and tiny_bert_dir not in report


def test_fit_size_warning_rule(analysed, caplog):
    from hf_partial_attention.analysis.workflow import MIN_WINDOWS_PER_POSITION, fit_size_warning

    assert MIN_WINDOWS_PER_POSITION == 1  # the rule docs/analysis.md states: at least n windows
    assert fit_size_warning(16, 16) is None and fit_size_warning(128, 128) is None
    assert "Fitted on 15 window(s) at n=16, fewer than 16" in fit_size_warning(15, 16)
    out, _ = analysed  # 12 windows at n = 16: derive says so
    with caplog.at_level("WARNING", logger="hf_partial_attention"):
        derive(out, [2], "per_query", evaluate=False, section="fit_size")
    assert any("Fitted on 12 window(s) at n=16, fewer than 16" in r.getMessage() for r in caplog.records)


def test_analyze_warns_on_too_few_windows(tiny_bert_dir, tmp_path, caplog):
    small = dict(seq_len=16, heldout_every=0, progress=False, max_k=8)
    with caplog.at_level("WARNING", logger="hf_partial_attention"):
        analyze(tiny_bert_dir, default_texts()[:6], str(tmp_path / "a"), max_sequences=4, **small)
    assert [r.getMessage()[:40] for r in caplog.records] == ["Fitted on 4 window(s) at n=16, fewer tha"]
    caplog.clear()
    with caplog.at_level("WARNING", logger="hf_partial_attention"):
        analyze(tiny_bert_dir, default_texts()[:6], str(tmp_path / "b"), max_sequences=16, **small)
    assert not any("Fitted on" in r.getMessage() for r in caplog.records)  # n windows at n = 16: enough


def test_failed_analyze_leaves_no_empty_folder(tiny_bert_dir, tmp_path):
    seq_long = tmp_path / "too_long"
    with pytest.raises(ValueError, match="pass --seq-len 64 or less"):  # the tiny model has 64 positions
        analyze(tiny_bert_dir, default_texts()[:3], str(seq_long), seq_len=100, progress=False)
    assert not seq_long.exists()
    short = tmp_path / "short_text"  # fails inside the collection: no window of 16 tokens in one word
    with pytest.raises(ValueError, match="No text is long enough"):
        analyze(tiny_bert_dir, ["word"], str(short), seq_len=16, heldout_every=0, progress=False)
    assert not short.exists()
    existing = tmp_path / "existing"  # a folder the user made stays
    existing.mkdir()
    with pytest.raises(ValueError, match="No text is long enough"):
        analyze(tiny_bert_dir, ["word"], str(existing), seq_len=16, heldout_every=0, progress=False)
    assert existing.is_dir()
