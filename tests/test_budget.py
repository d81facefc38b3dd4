"""`derive --saving S`: a k per layer within the QKᵀ budget of one uniform k (`analysis.budget`), the config's
``partial_layers_k`` (checkpoint format 5) and the card."""

import json
import os

import pytest
import torch

from hf_partial_attention import cli, partial_class_for
from hf_partial_attention.analysis.budget import allocate, parse_saving, uniform_k
from hf_partial_attention.analysis.derive import derive_budget
from hf_partial_attention.cost import score_cost
from hf_partial_attention.pattern_layers import LayerPatterns

from test_encoders import source_model
from test_layer_patterns import analyze_windows, head_patterns, minilm2, minilm_layers  # noqa: F401  (minilm2: a fixture)


@pytest.fixture(scope="module")
def minilm3(tmp_path_factory, minilm_path):
    """The real MiniLM's first 3 layers (2 partial layers by default)."""
    return minilm_layers(tmp_path_factory, minilm_path, 3)


def test_uniform_k_at_a_saving():
    """b = 128, d_h = 32: k = 16 costs 16·32 + 112·16 = 2304 of 4096 multiply-adds per query, a saving of 0.4375
    exactly; asking 0.44 leaves k = 15 (15·32 + 113·15 = 2175: 0.469). "k16" is min(16, b)."""
    assert uniform_k(128, 32, 0.4375) == 16
    assert uniform_k(128, 32, 0.44) == 15
    assert [uniform_k(b, 32, "k16") for b in (8, 16, 64, 128)] == [8, 16, 16, 16]
    with pytest.raises(ValueError, match="out of reach in bucket 128"):
        uniform_k(128, 32, 0.99)
    for bad in ("1.5", "sixteen", "k", 0):
        with pytest.raises(ValueError, match="fraction in \\(0, 1\\).*k<K>"):
            parse_saving(bad)


def test_allocate_spends_where_the_error_falls_most():
    """Two layers at b = 128, d_h = 32 (k costs 32k + (128 − k)k per query: 159, 316, 471 for k = 1, 2, 3) with the
    budget of k = 2 in both (632): layer 0's error halves with each k, layer 1's barely moves, so both extra scores
    go to layer 0 (1 → 2: +157, 2 → 3: +155; 318 + 157 + 155 = 630 <= 632) and layer 1 stays at k = 1."""
    curves = {0: torch.tensor([100.0, 50.0, 25.0, 12.0]), 1: torch.tensor([10.0, 9.9, 9.8, 9.7])}
    assert allocate(curves, 128, 32, 2 * 316) == {0: 3, 1: 1}
    # with layer 1 the steep one, the choice follows it
    assert allocate({0: curves[1], 1: curves[0]}, 128, 32, 2 * 316) == {0: 1, 1: 3}
    with pytest.raises(ValueError, match="cannot give 2 layers k = 1"):
        allocate(curves, 128, 32, 300)


def test_allocate_stays_within_the_budget_of_the_uniform_k():
    """Random decreasing curves for 5 layers: the chosen ks never cost more than k = 16 in every layer, and leave
    less summed error than it (the curves are convex: each step's gain shrinks)."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        gains = torch.rand(5, 31, generator=gen).sort(dim=1, descending=True).values * torch.rand(5, 1, generator=gen)
        curves = {layer: 100 - gains[layer].cumsum(0) for layer in range(5)}
        ks = allocate(curves, 128, 32, 5 * score_cost(128, 16, 32).total // 128)
        assert sum(score_cost(128, k, 32).total for k in ks.values()) <= 5 * score_cost(128, 16, 32).total
        assert sum(float(curves[l][k - 1]) for l, k in ks.items()) <= sum(float(c[15]) for c in curves.values())


def test_config_partial_layers_k_checks():
    config_class = partial_class_for("roberta").config_class
    base = dict(partial_seq_len=16, num_hidden_layers=3, vocab_size=99, hidden_size=32, num_attention_heads=4,
                intermediate_size=37, reconstruction="fixed")
    config = config_class(**base, partial_k=6, partial_granularity="head", partial_layers_k=[[3], [6]])
    assert (config.bucket_k(None, 0), config.bucket_k(None, 1), config.bucket_k()) == (3, 6, 6)
    assert config.required_format_version == 5
    back = config_class.from_dict(json.loads(config.to_json_string()))
    assert back.partial_layers_k == [[3], [6]]
    with pytest.raises(ValueError, match="needs a P per layer"):
        config_class(**base, partial_k=6, partial_layers_k=[[3], [6]])
    with pytest.raises(ValueError, match="one list per layer of partial_layers=\\[0, 1\\]"):
        config_class(**base, partial_k=6, partial_granularity="layer", partial_layers_k=[[3]])
    with pytest.raises(ValueError, match="largest k of partial_layers_k \\(\\[5\\]\\); set partial_lengths_k=\\[5\\]"):
        config_class(**base, partial_k=6, partial_granularity="layer", partial_layers_k=[[3], [5]])
    with pytest.raises(ValueError, match="layer 0 has k = 8 in bucket 8"):  # bucket 8 runs exactly only in layer 0
        config_class(**base, partial_k=6, partial_lengths=[8, 16], partial_lengths_k=[6, 6],
                     partial_granularity="layer", partial_layers_k=[[8, 3], [6, 6]])


def test_heads_of_a_layer_share_k():
    heads = head_patterns("roberta", 3)[0]
    with pytest.raises(ValueError, match="layer 0's heads have different ks"):
        LayerPatterns({0: [*heads[:3], head_patterns("roberta", 5)[0][3]]})


def test_cli_derive_saving_convert_load(minilm3, tmp_path, capsys):
    """`analyze --granularity head` → `derive --saving k4 --granularity head` on MiniLM's first 3 layers (the budget
    spread over the default partial layers 0 and 1): each layer's P holds its own k, the budgeted set costs no more
    than k = 4 in both and predicts no more error; `convert` installs it with ``partial_layers_k``, format 5, and the
    card lists each layer's k."""
    from transformers import AutoModel

    run = str(tmp_path / "run")
    analyze_windows(minilm3, run, "head", capsys)
    assert cli.main(["derive", run, "--saving", "k4", "--granularity", "head", "--objective", "fisher",
                     "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "b=16: k per layer {0: " in out and "(uniform 4)" in out
    result = json.load(open(os.path.join(run, "results.json")))["budget_per_query_fisher_head"]["k4"]
    row = result["buckets"][0]
    ks = {int(layer): k for layer, k in row["k_per_layer"].items()}
    assert sorted(ks) == [0, 1] and ks[0] != ks[1]  # the two layers' curves differ: the budget moves
    d = 32  # MiniLM's head dimension
    assert sum(score_cost(16, k, d).total for k in ks.values()) <= 2 * score_cost(16, 4, d).total
    assert row["saving"] >= row["saving_uniform"] == pytest.approx(score_cost(16, 4, d).saving)
    assert row["predicted_objective"] <= row["predicted_objective_uniform"]
    budgeted, uniform = LayerPatterns.load(result["budget_path"]), LayerPatterns.load(result["uniform_path"])
    assert budgeted.layers_k([0, 1]) == [[ks[0]], [ks[1]]] and uniform.layers_k() is None and uniform.k == 4
    assert all(budgeted.group(layer, head)[16].k == ks[layer] for layer in (0, 1) for head in range(12))
    ckpt = str(tmp_path / "ckpt")
    assert cli.main(["convert", result["budget_path"], "--out", ckpt, "--model", str(minilm3)]) == 0
    model = AutoModel.from_pretrained(ckpt)
    assert model.config.partial_layers == [0, 1] and model.config.partial_layers_k == [[ks[0]], [ks[1]]]
    assert model.config.partial_format_version == 5 and model.get_pattern(0, head=7).k == ks[0]
    assert torch.equal(model.get_pattern(0, head=7).indices, budgeted.group(0, 7)[16].indices)
    card = open(os.path.join(ckpt, "README.md"), encoding="utf-8").read()
    assert "A k per layer" in card and f"| 0 | {ks[0]} |" in card and f"| 1 | {ks[1]} |" in card


def test_saving_needs_p_per_layer(minilm2, tmp_path, capsys):  # noqa: F811
    run = str(tmp_path / "run")
    assert cli.main(["analyze", "--model", str(minilm2), "--seq-len", "16", "--max-sequences", "8",
                     "--heldout-sequences", "0", "--out", run, "--no-progress"]) == 0
    capsys.readouterr()
    assert cli.main(["derive", run, "--saving", "0.3"]) == 2
    assert "needs P per layer: use --granularity layer or head" in capsys.readouterr().err
    assert cli.main(["derive", run, "--saving", "0.3", "--granularity", "layer"]) == 2
    assert "granularity ['pooled']" in capsys.readouterr().err


def test_a_budgeted_model_runs_each_layers_own_k():
    """A RoBERTa with layer 0 at k = 3 and layer 1 at k = 6 (per head): layer l of it is layer l of a model where l
    alone is partial (one k: no partial_layers_k), fed the same hidden states."""
    cls = partial_class_for("roberta")
    sets = LayerPatterns({0: head_patterns("roberta", 3)[0], 1: head_patterns("roberta", 6)[1],
                          2: head_patterns("roberta", 5)[2]})
    model = cls.from_source(source_model("roberta"), sets, reconstruction="fixed").eval()
    assert model.config.partial_layers_k == [[3], [6]]
    ids = torch.randint(6, 99, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hidden = model(input_ids=ids, output_hidden_states=True).hidden_states
        for layer, k in ((0, 3), (1, 6)):
            alone = cls.from_source(source_model("roberta"), sets, partial_layers=[layer],
                                    reconstruction="fixed").eval()
            assert alone.config.partial_layers_k is None and alone.config.partial_k == k
            expected = alone.encoder.layer[layer](hidden[layer])
            expected = expected[0] if isinstance(expected, tuple) else expected
            torch.testing.assert_close(hidden[layer + 1], expected, rtol=0, atol=1e-12)


def test_a_budget_never_predicts_more_error_than_the_one_k(monkeypatch, minilm2, tmp_path, capsys):  # noqa: F811
    """Where marginal allocation ends above the uniform k's predicted error (curves that are not convex), the bucket
    keeps the uniform k: here an allocation forced to k = 1 in both layers (the greedy's error falls with k, so it
    predicts more error than k = 4)."""
    import hf_partial_attention.analysis.budget as budget

    run = str(tmp_path / "run")
    analyze_windows(minilm2, run, "layer", capsys)
    monkeypatch.setattr(budget, "allocate", lambda curves, b, d, cost: {0: 1, 1: 1})
    result = derive_budget(run, "k4", granularity="layer", layers=[0, 1])
    row = result["buckets"][0]
    assert row["k_per_layer"] == {"0": 4, "1": 4}
    assert row["predicted_objective"] == pytest.approx(row["predicted_objective_uniform"])


def test_layer_weights_move_the_budget_and_write_beside_the_plain_one(minilm2, tmp_path, capsys):  # noqa: F811
    """A layer whose error is weighted far above the other's gets more exact scores than without weights (the
    allocation spends on weighted error); the weighted file and its results entry sit beside the plain budget's, and
    weights that miss a layer or are not positive are refused."""

    run = str(tmp_path / "run")
    analyze_windows(minilm2, run, "layer", capsys)
    plain = derive_budget(run, "k4", granularity="layer", layers=[0, 1])
    ks = plain["buckets"][0]["k_per_layer"]
    heavy = "0" if ks["0"] <= ks["1"] else "1"  # the layer the plain budget gives less
    weights = {int(heavy): 1e6, 1 - int(heavy): 1.0}
    weighted = derive_budget(run, "k4", granularity="layer", layers=[0, 1], layer_weights=weights,
                                    name="weighted")
    assert weighted["buckets"][0]["k_per_layer"][heavy] > ks[heavy]
    assert weighted["layer_weights"] == {str(k): v for k, v in sorted(weights.items())}
    assert weighted["budget_path"].endswith("_savingk4_weighted.safetensors") and os.path.isfile(plain["budget_path"])
    stored = json.load(open(os.path.join(run, "results.json")))["budget_per_query_layer"]
    assert set(stored) == {"k4", "k4_weighted"}
    for bad in ({0: 1.0}, {0: 1.0, 1: 0.0}):
        with pytest.raises(ValueError, match="layer_weights must give every budget layer"):
            derive_budget(run, "k4", granularity="layer", layers=[0, 1], layer_weights=bad, name="weighted")
    with pytest.raises(ValueError, match="name must be letters and digits"):
        derive_budget(run, "k4", granularity="layer", layers=[0, 1], name="uniform")


def test_exact_layers_pay_dense_cost_out_of_the_budget(minilm3, tmp_path, capsys):
    """`derive --saving k12 --exact-layers 1` on MiniLM's first 3 layers (budget layers 0 and 1, b = 16, d_h = 32):
    layer 1 is exact, paying 16·32 multiply-adds per query row out of the two layers' budget at k = 12, and layer 0
    gets the largest k the rest affords; the file holds no P for layer 1 and `convert` leaves it exact. A budget an
    exact layer does not fit in, every budget layer exact, a layer outside the budget and the flag without --saving
    are refused."""
    from transformers import AutoModel

    run = str(tmp_path / "run")
    analyze_windows(minilm3, run, "head", capsys)
    assert cli.main(["derive", run, "--saving", "k12", "--granularity", "head", "--exact-layers", "1",
                     "--no-progress"]) == 0
    assert "b=16: k per layer {0: 9, 1: exact}" in capsys.readouterr().out
    result = json.load(open(os.path.join(run, "results.json")))["budget_per_query_head"]["k12_exact1"]
    budget = 2 * score_cost(16, 12, 32).total - score_cost(16, 16, 32).dense  # per query row times 16 rows
    affordable = max(k for k in range(1, 16) if score_cost(16, k, 32).total <= budget)
    assert affordable == 9 and result["buckets"][0]["k_per_layer"] == {"0": 9, "1": 16}
    assert result["exact_layers"] == [1] and result["budget_path"].endswith("_savingk12_exact1.safetensors")
    assert result["buckets"][0]["saving"] >= result["buckets"][0]["saving_uniform"]
    budgeted = LayerPatterns.load(result["budget_path"])
    assert sorted(budgeted.layers) == [0, 2] and budgeted.metadata["exact_layers"] == [1]
    assert "exact_layers" not in LayerPatterns.load(result["uniform_path"]).metadata
    ckpt = str(tmp_path / "ckpt")
    assert cli.main(["convert", result["budget_path"], "--out", ckpt, "--model", str(minilm3)]) == 0
    saving = score_cost(16, 9, 32).saving / 2  # the budget's two layers: layer 0 at k = 9, layer 1 dense
    assert (f"k = 9 (layers [1] exact within the budget) exact scores per query at n = 16, d_h = 32: a saving of "
            f"{100 * saving:.1f} %") in capsys.readouterr().out
    model = AutoModel.from_pretrained(ckpt)
    assert model.config.partial_layers == [0] and model.get_pattern(0, head=3).k == 9
    with pytest.raises(ValueError, match="not a partial layer"):
        model.get_pattern(1, head=3)
    with pytest.raises(ValueError, match=r"Layers \[1\] exact take 512 of it: leave fewer layers exact"):
        derive_budget(run, "k4", granularity="head", exact_layers=[1])
    for bad in ([0, 1], [2]):
        with pytest.raises(ValueError, match="give some, not all, of the budget layers"):
            derive_budget(run, "k12", granularity="head", exact_layers=bad)
    assert cli.main(["derive", run, "--k", "4", "--exact-layers", "1", "--no-progress"]) == 2
    assert "--exact-layers leaves layers exact out of a --saving budget" in capsys.readouterr().err


def test_each_groups_patterns_are_fitted_by_one_call_and_equal_a_fit_of_their_own(minilm3, tmp_path, capsys,
                                                                                   monkeypatch):
    """`derive --saving k4 --granularity head` on MiniLM's first 3 layers (b = 16): the budgeted and the uniform sets
    need two ks of a budget layer's head whose budgeted k is not 4; both come from one `select_patterns` call per
    (bucket, layer, head), which reads its covariance once, and each pattern equals a fit of that k alone."""
    import hf_partial_attention.analysis.derive as derive_module
    from hf_partial_attention.analysis.covariance import ScoreCovariance
    from hf_partial_attention.analysis.selection import select_pattern

    run = str(tmp_path / "run")
    analyze_windows(minilm3, run, "head", capsys)
    calls = []
    fit = derive_module.select_patterns  # the one fit of every derive (`derive._fit`)

    def counted(cov, ks, *args, **kwargs):
        calls.append((kwargs["layer"], kwargs["head"], tuple(ks)))
        return fit(cov, ks, *args, **kwargs)

    monkeypatch.setattr(derive_module, "select_patterns", counted)
    result = derive_budget(run, "k4", granularity="head", objective="fisher")
    ks = {int(layer): k for layer, k in result["buckets"][0]["k_per_layer"].items()}
    assert sorted(ks) == [0, 1] and ks[0] != ks[1]
    # layers 0 and 1 at their budgeted k and at 4, layer 2 (outside the budget) at 4 in both sets: one call each
    assert sorted(calls) == sorted((layer, head, tuple(sorted({ks.get(layer, 4), 4})))
                                   for layer in (0, 1, 2) for head in range(12))
    budgeted, uniform = LayerPatterns.load(result["budget_path"]), LayerPatterns.load(result["uniform_path"])
    cov = ScoreCovariance.load(os.path.join(run, "covariance.safetensors"))
    for layer, head in ((0, 3), (1, 11)):
        for saved, k in ((budgeted.group(layer, head)[16], ks[layer]), (uniform.group(layer, head)[16], 4)):
            alone = select_pattern(cov, k, layer=layer, head=head, objective="fisher")
            assert torch.equal(saved.indices, alone.indices)
            torch.testing.assert_close(saved.reconstruction, alone.reconstruction, rtol=0, atol=0)
