"""report.md rendering from results dicts."""

from hf_partial_attention.analysis.report import markdown_table, render_report


def test_markdown_table_formats_numbers():
    table = markdown_table(["a", 1], [[0.5, None], [1e-5, 3]])
    assert table.splitlines()[0] == "| a | 1 |"
    assert "| 0.5000 | – |" in table and "1.00e-05" in table


def test_render_sections():
    results = {
        "summary": ["headline"],
        "analyze": {"seq_len": 4, "total_variance": 2.0, "top_eigenvalue_share": {"0": 0.5},
                    "top_eigenvalue_share_inner_mean": 0.6, "per_query_energy": {"1": 0.5}, "figures": {}},
        "derive_per_query": {"scope": "per_query", "seq_len": 4, "head_dim": 8,
                             "patterns": [{"k": 2, "k_bar": 8, "path": "p.safetensors", "predicted": 0.1}],
                             "curves": [{"scope": "per_query", "seq_len": 4, "k": [2], "k_bar": [8], "greedy": [0.1],
                                         "eigen": [0.05], "relative_cost": [0.9]}],
                             "heldout": {"windows": 3, "score_matrices": 24, "total_variance": 1.0,
                                         "train_total_variance": 1.1,
                                         "methods": [{"method": "greedy P + R", "k": 2, "param": "k=2",
                                                      "relative_cost": 0.9, "predicted": 0.1, "heldout": 0.12,
                                                      "heldout_shift": 0.2}]},
                             "figures": {}},
        "notes": ["a note"],
    }
    md = render_report(results)
    for piece in ("headline", "## Spectra: analyze", "## Patterns: derive_per_query", "**Budget k = 2**",
                  "| greedy P + R | k=2 | 0.9000 | 0.1000 | 0.1200 | 0.2000 |", "- a note"):
        assert piece in md


def test_pattern_table_shows_heldout_and_rows_off_the_curve():
    """A row kept from an earlier derive (k = 3, not on this run's curve) still shows its cost and file."""
    section = {"scope": "per_query", "seq_len": 4, "head_dim": 8, "figures": {},
               "patterns": [{"k": 2, "k_bar": 8, "path": "patterns/a_k2.safetensors", "predicted": 0.1,
                             "heldout": 0.125, "relative_cost": 0.75},
                            {"k": 3, "k_bar": 12, "path": "patterns/a_k3.safetensors", "predicted": 0.05,
                             "relative_cost": 0.5}],
               "curves": [{"scope": "per_query", "seq_len": 4, "k": [2], "k_bar": [8], "greedy": [0.1],
                           "eigen": [0.0625]}]}
    md = render_report({"derive_x": section})
    assert "| predicted normalised error | held-out |" in md
    assert "| 2 | 8 | 0.7500 | 0.1000 | 0.1250 | 0.0625 | patterns/a_k2.safetensors |" in md
    assert "| 3 | 12 | 0.5000 | 0.0500 | – | – | patterns/a_k3.safetensors |" in md
