"""What every `derive` writes alike (`analysis.derive_files`): file tags, the granularity and k checks each derive
runs before fitting, and the report rows kept from an earlier derive."""

import os

import pytest
import torch

from hf_partial_attention.analysis.covariance import ScoreCovariance
from hf_partial_attention.analysis.derive_files import bucket_k_suffix, file_tag, keep_previous_rows
from hf_partial_attention.analysis.derive import derive_budget, derive_layers


def _folder(tmp_path, granularity):
    """A folder holding only a covariance of random scores (n = 8, 2 layers of 2 heads) collected at ``granularity``."""
    cov = ScoreCovariance(8, ("per_query",), granularity)
    g = torch.Generator().manual_seed(0)
    for layer in (0, 1):
        cov.update(layer, torch.randn(16, 2, 8, 8, generator=g))
    cov.num_sequences = 16
    cov.metadata.update(head_dim=16)
    cov.save(tmp_path / "covariance.safetensors")
    return str(tmp_path)


def test_file_tags_leave_the_defaults_out():
    assert file_tag() == "per_query" and file_tag(granularity="pooled") == "per_query"
    assert file_tag("whole") == "whole"
    assert file_tag("per_query", "blocks", "fisher", "head") == "per_query_blocks_fisher_head"
    assert file_tag(objective="shift", granularity="layer") == "per_query_shift_layer"


def test_bucket_k_suffix_names_the_buckets_in_length_order():
    """One spelling for a per-bucket k in every derive's file name (buckets, per layer or head x buckets)."""
    assert bucket_k_suffix({64: 24, 32: 20}) == "_b32k20_b64k24" and bucket_k_suffix(None) == bucket_k_suffix({}) == ""


@pytest.mark.parametrize("collected,asked", [("pooled", "layer"), ("pooled", "head"), ("layer", "head")])
def test_every_derive_refuses_a_coarser_analysis_naming_the_analyze_flag(tmp_path, collected, asked):
    out = _folder(tmp_path, collected)
    flag = f"rerun `hf-partial-attention analyze --granularity {asked}` into it"
    with pytest.raises(ValueError, match=rf"granularity \['{collected}'\]: P and R per {asked} needs .*{flag}"):
        derive_layers(out, [4], granularity=asked, evaluate=False)
    with pytest.raises(ValueError, match=rf"granularity \['{collected}'\]: a k per layer needs .*{flag}"):
        derive_budget(out, "k4", granularity=asked)
    assert not os.path.isdir(os.path.join(out, "patterns"))  # refused before anything is written


def test_per_layer_ks_are_checked_against_the_analysis_n(tmp_path):
    out = _folder(tmp_path, "layer")
    for bad in ([9], [0, 4], []):
        with pytest.raises(ValueError, match=r"k must be in \[1, 8\] \(n = 8, the seq_len of"):
            derive_layers(out, bad, evaluate=False)
    result = derive_layers(out, [4, 2, 4], evaluate=False)
    assert [row["k"] for row in result["patterns"]] == [2, 4]


def test_rows_of_an_earlier_derive_stay_while_their_files_remain(tmp_path):
    kept, gone = tmp_path / "a_k2.safetensors", tmp_path / "a_k3.safetensors"
    kept.write_bytes(b"")
    previous = {"patterns": [{"k": 2, "path": str(kept)}, {"k": 3, "path": str(gone)}, {"k": 4, "path": str(kept)}]}
    rows = [{"k": 4, "path": "new"}, {"k": 1, "path": "new"}]
    assert keep_previous_rows(previous, rows, [1, 4]) == [{"k": 1, "path": "new"}, {"k": 2, "path": str(kept)},
                                                         {"k": 4, "path": "new"}]
    assert keep_previous_rows(None, rows, [1, 4]) is rows


def test_a_request_names_its_inputs_and_a_budget_chooses_its_own(tmp_path):
    """`DeriveRequest.inputs` is one of the three sources (a typo would otherwise read as the buckets), and a budget,
    which fits on the buckets when the folder has them, refuses a source named for it; both before anything is
    written."""
    from hf_partial_attention.analysis.derive import DeriveRequest, derive_patterns

    out = _folder(tmp_path, "layer")
    with pytest.raises(ValueError, match="inputs must be 'auto', 'windows' or 'buckets', got 'window'"):
        derive_patterns(out, DeriveRequest(ks=(4,), inputs="window"))
    with pytest.raises(ValueError, match="inputs='windows' with a saving: .* leave inputs='auto'"):
        derive_patterns(out, DeriveRequest(saving="k4", granularity="layer", inputs="windows"))
    assert not os.path.isdir(os.path.join(out, "patterns"))
    [(source, result)] = derive_patterns(out, DeriveRequest(ks=(4,), granularity="layer", inputs="windows",
                                                            evaluate=False))
    assert source == "windows" and [row["k"] for row in result["patterns"]] == [4]


def test_a_length_fitted_on_fewer_rows_than_positions_is_marked_rank_deficient(capsys):
    """A group's rows are the score matrices it pools: 12 windows x 2 heads (count 24) at n = 14 are enough pooled
    over heads, too few for one head's covariance; the printed line marks the bucket that is, not the other."""
    import types

    from hf_partial_attention.analysis.derive import _rank_deficient
    from hf_partial_attention.analysis.derive_files import Source
    from hf_partial_attention.cli_derive import _print_buckets

    source = Source("buckets", {14: types.SimpleNamespace(count=24), 16: types.SimpleNamespace(count=64)})
    assert _rank_deficient(source, [(None, None)]) == []
    assert _rank_deficient(source, [(0, 0), (0, 1)]) == [14]  # 12 rows a head at b = 14; 32 at b = 16
    result = {"rank_deficient": [14], "ks": {3: {"k": 3, "path": "p", "buckets": [
        {"length": 14, "k": 3, "exact": False, "heldout": 0.5},
        {"length": 16, "k": 3, "exact": False, "heldout": 0.4}]}}}
    _print_buckets(result, None)
    assert capsys.readouterr().out == ("k=3: p (held-out error per bucket b=14: 0.5000 (rank-deficient: fewer windows "
                                       "than n), b=16: 0.4000)\n")
