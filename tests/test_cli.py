"""The command line: registry, analyze → derive → convert on a tiny model, and the demo (slow)."""

import json
import os

import pytest

from hf_partial_attention import AttentionPattern, cli
from hf_partial_attention.analysis.corpus import default_texts
from hf_partial_attention.partial_attention import block_rows


def test_registry_lists_commands_and_refuses_duplicates():
    assert {"analyze", "derive", "convert", "demo"} <= set(cli.COMMANDS)
    with pytest.raises(ValueError, match="already registered"):
        cli.register_command("analyze", "x", lambda p: None, lambda a: 0)
    parser = cli.build_parser()
    args = parser.parse_args(["derive", "DIR", "--k", "16", "24", "--scope", "whole"])
    assert args.k == [16, 24] and args.scope == "whole"


def test_analyze_derive_convert(tiny_bert_dir, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("\n\n".join(default_texts()[:6]), encoding="utf-8")
    out = str(tmp_path / "run")
    assert cli.main(["analyze", "--model", tiny_bert_dir, "--text-file", str(text), "--seq-len", "16",
                     "--max-sequences", "10", "--heldout-every", "0", "--out", out, "--no-progress"]) == 0
    assert cli.main(["derive", out, "--k", "3", "5", "--no-progress"]) == 0
    results = json.load(open(os.path.join(out, "results.json")))
    assert results["analyze"]["num_sequences"] == 10
    assert [p["k"] for p in results["derive_per_query"]["patterns"]] == [3, 5]
    assert "heldout" not in results["derive_per_query"]  # no held-out windows with --heldout-every 0
    ckpt = str(tmp_path / "ckpt")
    assert cli.main(["convert", os.path.join(out, "patterns", "per_query_k5.safetensors"), "--out", ckpt]) == 0
    assert os.path.isfile(os.path.join(ckpt, "config.json"))
    # a constrained family: one key set shared by all queries (the exact part is one GEMM)
    assert cli.main(["derive", out, "--k", "4", "--family", "columns", "--no-progress"]) == 0
    shared = AttentionPattern.load(os.path.join(out, "patterns", "per_query_columns_k4.safetensors"))
    assert shared.metadata["family"] == "columns" and block_rows(shared.indices) == 16
    results = json.load(open(os.path.join(out, "results.json")))
    assert "derive_per_query_columns" in results and "derive_per_query" in results


@pytest.mark.slow
def test_demo_small(tmp_path, minilm_path):
    out = str(tmp_path / "demo")
    assert cli.main(["demo", "--out", out, "--fit-sequences", "16", "--heldout-sequences", "8", "--k", "16", "32",
                     "--whole-seq-len", "16", "--whole-sequences", "32", "--no-progress"]) == 0
    report = open(os.path.join(out, "report.md")).read()
    assert "Headline, k = 16 at n = 128" in report and "Conversion and sentence embeddings" in report
    assert "saves 43.8% of QKᵀ" in report  # the headline is at a k that saves work (d_h = 32)
    # the model is named by its Hub id, never by a path of this machine
    assert "sentence-transformers/all-MiniLM-L6-v2" in report
    assert minilm_path not in report and str(tmp_path) not in report
    assert os.path.isfile(os.path.join(out, "checkpoint", "config.json"))
