"""The benchmark suite runs end to end (tiny shapes) and its report checks the targets."""

import json
import sys
from pathlib import Path

import pytest

IMPLEMENTATIONS = ("gather", "fused", "tiled")  # the kernels timed on a CPU (triton: benchmarks/gpu.py)

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
N, B, D, KS = 16, 2, 8, (4, 8)  # the --quick attention shapes: (b=2, h=2, n=16, d=8, ks=[4, 8]), (b=1, n=32, ks=[4])
SHAPES = {(16, 2): (4, 8), (32, 1): (4,)}
FAMILIES = ("per_query", "columns", "blocks", "shared_blocks")
MODES = ("forward", "forward+backward")


def mac_ratio_by_hand(n, d, k, impl, family):
    """Multiply-adds per query of partial / dense attention forward over 2·n·d: the exact scores (q·K_P, or the
    whole q·Kᵀ where the kernel selects P from it: dense always, fused and tiled for per-query patterns), [I|R]
    (fused, tiled) or R, and P·V."""
    whole_qk = impl in ("fused", "tiled") and family == "per_query"
    fused = impl in ("fused", "tiled")
    return ((n * d if whole_qk else k * d) + (n * k if fused else (n - k) * k) + n * d) / (2 * n * d)


def _import(name):
    sys.path.insert(0, str(BENCH))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(BENCH))


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """`benchmarks/run.py --quick` once (its tables and its result) for the tests that read it."""
    out = tmp_path_factory.mktemp("quick")
    run = _import("run")
    run.FRESH_PROCESSES = False  # what the rows record, not their speed: test_model_study_... keeps the processes
    try:
        return out, run.main(["--quick", "--repeats", "1", "--out", str(out)])
    finally:
        run.FRESH_PROCESSES = True


@pytest.mark.slow
def test_quick_benchmark_writes_tables_and_goals(quick_run):
    tmp_path, result = quick_run
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved == json.loads(json.dumps(result))  # the file holds what main returned
    assert saved["machine"]["torch"] and saved["machine"]["torch_threads"] and saved["model"] and saved["peers"]

    # every (shape, k, mode) has each case exactly once: dense, sdpa and every implementation × pattern family
    att = saved["attention"]
    expected_cases = {"dense_eager", "sdpa"} | {f"{impl}/{fam}" for impl in IMPLEMENTATIONS for fam in FAMILIES}
    groups = {}
    for r in att:
        groups.setdefault((r["n"], r["b"], r["k"], r["mode"]), []).append(r)
    assert set(groups) == {(n, b, k, mode) for (n, b), ks in SHAPES.items() for k in ks for mode in MODES}
    for (_, _, _, mode), rows in groups.items():
        skipped = {f"tiled/{fam}" for fam in FAMILIES} if mode == "forward+backward" else set()  # inference only
        assert sorted(r["case"] for r in rows) == sorted(expected_cases - skipped)
        dense_ms = next(r["ms"] for r in rows if r["case"] == "dense_eager")
        sdpa_ms = next(r["ms"] for r in rows if r["case"] == "sdpa")
        for fam in FAMILIES:  # auto picks exactly one kernel per pattern (a timed one)
            assert sum(r["auto"] for r in rows if r["pattern"] == fam) == 1
        for r in rows:
            assert r["ratio"] == pytest.approx(r["ms"] / dense_ms, rel=1e-9), r
            assert r["sdpa_ratio"] == pytest.approx(r["ms"] / sdpa_ms, rel=1e-9), r
            impl, _, family = r["case"].partition("/")
            assert (r["implementation"], r["pattern"]) == (impl, family or "-")
            want_mac = mac_ratio_by_hand(r["n"], D, r["k"], impl, family) if family else 1.0
            assert r["mac_ratio"] == pytest.approx(want_mac, rel=1e-12), r
            assert (r["saved_MiB"] > 0) == (r["mode"] == "forward+backward"), r  # memory is measured with grad only

    # the whole model: each model's seconds over BertModel eager's and SDPA's at the same shape and mode
    by_run = {}
    for r in saved["model"]:
        by_run.setdefault((r["arch"], r["n"], r["mode"]), {})[r["model"]] = r
    assert set(by_run) == {("bert", 16, "inference"), ("bert", 16, "training step"), ("bert", 32, "inference"),
                           ("roberta", 16, "inference"), ("roberta", 16, "training step")}
    for (arch, n, mode), models in by_run.items():
        source, partial = {"bert": ("BertModel", "PartialBert"), "roberta": ("RobertaModel", "PartialRoberta")}[arch]
        assert {f"{source} eager", f"{source} sdpa", f"{partial} shared"} <= set(models)
        for r in models.values():
            assert r["ratio"] == pytest.approx(r["s"] / models[f"{source} eager"]["s"], rel=1e-9)
            assert r["sdpa_ratio"] == pytest.approx(r["s"] / models[f"{source} sdpa"]["s"], rel=1e-9)

    # the mixed-length batch (benchmarks/mixed.py): the five models on the same batch, each over zero-fill by round
    mixed = {r["model"]: r for r in saved["mixed"]}
    assert len(saved["mixed"]) == 5 and set(mixed) == {"BertModel eager", "BertModel sdpa", "PartialBert zero-fill",
                                                       "PartialBert buckets", "PartialBert buckets, own k"}
    assert (mixed["PartialBert buckets"]["lengths_k"], mixed["PartialBert buckets, own k"]["lengths_k"],
            mixed["PartialBert zero-fill"]["lengths_k"]) == ([4, 4, 4], [4, 6, 4], [4])
    zero = mixed["PartialBert zero-fill"]
    assert zero["zero_fill_ratio"] == 1.0 and zero["zero_fill_ratio_range"] == [1.0, 1.0]
    for r in mixed.values():
        assert (r["mode"], r["n"], r["k"], r["lengths"], r["t_range"]) == ("inference, mixed lengths", 32, 4,
                                                                           [8, 16, 32], [3, 30])
        assert len(r["input_lengths"]) == r["b"] == 4 and r["padded_length"] == max(r["input_lengths"])
        assert all(3 <= t <= 30 for t in r["input_lengths"]) and r["input_lengths"] == zero["input_lengths"]
        assert r["zero_fill_ratio"] == pytest.approx(r["round_s"][0] / zero["round_s"][0], rel=1e-12)  # one round
        assert r["ratio"] == pytest.approx(r["round_s"][0] / mixed["BertModel eager"]["round_s"][0], rel=1e-12)

    # the goals: read from the rows above (recomputed here), met against the stated bound
    goals = {g["goal"]: g for g in saved["goals"]}
    structured = [r for r in att if r["n"] == 16 and r["k"] == 4 and r["mode"] == "forward"
                  and r["pattern"] in ("columns", "blocks", "shared_blocks")]
    first = goals["attention fwd, n=16, k=4, fastest structured / eager"]
    assert first["measured"] == min(r["ratio"] for r in structured)
    slowest = goals["slowest configuration `auto` picks, any k < d / eager"]
    assert slowest["measured"] == max(r["ratio"] for r in att if r["auto"] and r["k"] < D)
    train = goals["model training step, n=16, k=4 / BertModel eager"]
    assert train["measured"] == by_run["bert", 16, "training step"]["PartialBert shared"]["ratio"]
    for g in saved["goals"]:
        assert g["met"] == (g["measured"] <= g["bound"])

    text = (tmp_path / "results.md").read_text()
    # results name no path of the machine that made them: the command is recorded without --out
    assert saved["command"] == "python benchmarks/run.py --quick --repeats 1" and str(tmp_path) not in text
    lines = text.splitlines()
    low, high = train["range"]  # one round at --quick: the range is that round's ratio
    assert low == high == train["measured"]
    # one round: the interval for the median is that round's ratio, at coverage 0; one value decides the verdict
    assert train["interval"] == [low, high] and train["coverage"] == 0.0 and train["rounds"] == 1
    assert (f"| model training step, n=16, k=4 / BertModel eager | {train['measured']:.2f}x | "
            f"{low:.2f}–{high:.2f} (0 %, 1 rounds) | {train['eager']:.2f}x | {train['sdpa']:.2f}x | <= 0.95 | "
            f"{'yes' if train['met'] else 'no'} | PartialBert shared |") in lines
    table = [line for line in lines if line.count("|") == 12 and line.split("|")[4].strip() in MODES]
    assert len(table) == len(att)
    assert "## A batch of mixed lengths (inference; benchmarks/mixed.py)" in lines
    for r in saved["mixed"]:
        k = "[4, 6, 4]" if r["model"] == "PartialBert buckets, own k" else "4"
        assert (f"| 2 | 32 | 4 | 32 | {k} | [8, 16, 32] | 3–30 | {r['padded_length']} | {r['model']} | {r['s']:.3f} | "
                f"{r['ratio']:.2f} | {r['sdpa_ratio']:.2f} | {r['zero_fill_ratio']:.2f} |") in text


def test_model_ratios_pair_each_round_with_its_baseline():
    """Per-round ratios (a slow round slows every model), not the ratio of the medians."""
    timing = _import("timing")
    times = {"partial": [2.0, 9.0, 4.0], "eager": [1.0, 3.0, 4.0]}  # rounds' ratios 2, 3, 1; medians 4 / 3
    # 3 rounds allow no 95 % interval: the whole range, covering the median with probability 1 - 2/8
    assert timing.paired_ratios(times, "partial", "eager") == {"median": 2.0, "low": 1.0, "high": 3.0,
                                                               "interval": [1.0, 3.0], "coverage": 0.75}


def test_median_interval_is_the_order_statistics_of_the_binomial_rule():
    """Worked by hand from the binomial tails P(Binomial(N, 1/2) <= j - 1) <= 2.5 %: N = 20 -> the 6th lowest and
    6th highest (tail (1 + 20 + 190 + 1140 + 4845 + 15504) / 2^20 = 0.0207); N = 15 -> the 4th (576 / 2^15 =
    0.0176); N = 5 allows none -> min and max at 1 - 2/32."""
    timing = _import("timing")
    values = [7.0, 3.0, 19.0, 1.0, 12.0, 5.0, 16.0, 9.0, 2.0, 14.0, 20.0, 8.0, 11.0, 4.0, 17.0, 6.0, 13.0, 10.0, 18.0,
              15.0]  # 1..20 shuffled: the j-th lowest is j
    assert timing.median_interval(values) == {"low": 6.0, "high": 15.0, "coverage": 1 - 2 * 21700 / 2**20}
    # the first 15: 1 2 3 4 5 7 8 9 11 12 14 16 17 19 20 sorted
    assert timing.median_interval(values[:15]) == {"low": 4.0, "high": 16.0, "coverage": 1 - 2 * 576 / 2**15}
    assert timing.median_interval([5.0, 1.0, 4.0, 2.0, 3.0]) == {"low": 1.0, "high": 5.0, "coverage": 1 - 2 / 32}
    with pytest.raises(ValueError, match="at least one value"):
        timing.median_interval([])


def test_interleaved_rounds_rotate_the_order():
    """Round r starts with case r mod m, so no case always runs first after the round's garbage collection."""
    timing = _import("timing")
    calls = []
    cases = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    times = timing.interleaved_times(cases, repeats=4, warmup=1)
    assert calls == list("abc") + list("abc") + list("bca") + list("cab") + list("abc")
    assert {name: len(t) for name, t in times.items()} == {"a": 4, "b": 4, "c": 4}


def test_goal_verdicts_are_undecided_where_the_interval_holds_the_bound():
    report = _import("report")
    row = {"ratio": 0.97, "ratio_range": [0.85, 1.12], "ratio_interval": [0.90, 1.09], "interval_coverage": 0.965,
           "rounds": 15}
    g = report.goal_verdict(row, "ratio", 0.98)
    assert (g["met"], g["decided"], g["interval"], g["coverage"]) == (True, False, [0.90, 1.09], 0.965)
    assert report.verdict_text(g) == "undecided (median: yes)"
    assert report.interval_text(g) == "0.90–1.09 (96 %, 15 rounds)"
    missed = report.goal_verdict({**row, "ratio": 0.99}, "ratio", 0.98)
    assert report.verdict_text(missed) == "undecided (median: no)"
    assert report.verdict_text(report.goal_verdict({**row, "ratio_interval": [0.90, 0.98]}, "ratio", 0.98)) == "yes"
    assert report.verdict_text(report.goal_verdict({**row, "ratio": 1.0, "ratio_interval": [0.981, 1.1]},
                                                   "ratio", 0.98)) == "no"
    attention = report.goal_verdict({"ratio": 0.5}, "ratio", 0.75)  # medians of many repeats: no interval
    assert (attention["decided"], report.verdict_text(attention), report.interval_text(attention)) == (True, "yes", "")
    assert report.verdict_text(report.goal_verdict(None, "ratio", 0.75)) == "n/a"
    old = {"ratio": 1.05, "ratio_range": [0.90, 1.09]}  # results written before intervals: the range is shown
    assert report.interval_text(report.goal_verdict(old, "ratio", 0.98)) == "0.90–1.09 (rounds' range)"


def test_benchmark_families_have_the_structure_of_the_analysis_families():
    """The benchmarks' patterns, named as the analysis families, have those families' structure (one vocabulary)."""
    import torch

    from hf_partial_attention.analysis.selection import FAMILY_STRUCTURE
    from hf_partial_attention.attention_common import PatternLayout

    cases = _import("cases")
    n, k = 128, 16
    r = torch.randn(n, n - k, k)
    for family in cases.PATTERNS:
        recon = cases.shared_r(r, n) if family == "shared_blocks" else r
        layout = PatternLayout.from_indices(cases.pattern_indices(family, n, k), recon)
        assert layout.structure is FAMILY_STRUCTURE[family], family


@pytest.mark.slow
def test_rule_misses_are_found_and_printed(quick_run):
    """A case where another kernel beats auto's choice by more than 10 % is a rule miss, in the results and their
    table; within 10 % it is not. The --quick run's own misses are the ones its rows show."""
    report = _import("report")
    row = {"n": 16, "b": 2, "k": 4, "mode": "forward", "pattern": "shared_blocks"}
    att = [{**row, "implementation": "fused", "ms": 10.0, "auto": True},
           {**row, "implementation": "tiled", "ms": 9.0, "auto": False},  # 11 % faster: a miss
           {**row, "pattern": "columns", "implementation": "fused", "ms": 10.0, "auto": True},
           {**row, "pattern": "columns", "implementation": "tiled", "ms": 9.2, "auto": False}]  # 8.7 %: no miss
    assert report.rule_misses(att) == [{**row, "auto": "fused", "auto_ms": 10.0, "fastest": "tiled",
                                        "fastest_ms": 9.0}]
    tmp_path, result = quick_run
    assert result["rule_misses"] == report.rule_misses(result["attention"])
    text = (tmp_path / "results.md").read_text()
    assert f"by more than 10 % (attention function below): {len(result['rule_misses']) or 'none'}." in text
    for m in result["rule_misses"]:
        assert f"| {m['pattern']} | rule miss: {m['auto']} | {m['auto_ms']:.2f} | {m['fastest']} |" in text


def test_frozen_w_benchmark_times_what_it_names(tmp_path, monkeypatch):
    """The cached case builds W once, the rebuilt case on every call; the table's ratios are ms / eager ms."""
    import hf_partial_attention.attention_common as ps

    sys.path.insert(0, str(BENCH))
    import frozen_w

    builds = []
    original = ps.reconstruction_matrix
    monkeypatch.setattr(ps, "reconstruction_matrix", lambda *a: builds.append(1) or original(*a))
    result = frozen_w.main(["--quick", "--repeats", "3", "--out", str(tmp_path)])
    # warm-up + 3 repeats: the rebuilt case builds 4 times, the cached case once
    assert len(builds) == 4 + 1
    row = result["rows"][0]
    text = (tmp_path / "frozen_w.md").read_text()
    ratio = row["ms"]["fused, W cached"] / row["ms"]["dense_eager"]
    assert f"{ratio:.2f}x |" in text and result["command"] == "python benchmarks/frozen_w.py --quick --repeats 3"


def test_gpu_benchmark_dry_run(tmp_path):
    """benchmarks/gpu.py at tiny shapes on CPU (Triton's interpreter): every step runs, ratios are its own times."""
    from benchmarks import gpu

    result = gpu.main(["--dry-run", "--out", str(tmp_path)])
    assert result["check_max_abs_error"] < 1e-5  # the kernel equals the reference before anything is timed
    rows = result["rows"]
    sdpa = next(r for r in rows if r["method"] == "sdpa")
    eager = next(r for r in rows if r["method"] == "eager")
    partial = [r for r in rows if r["method"] == "triton"]
    assert {r["family"] for r in partial} == {"blocks", "per_query"}
    for r in partial:
        assert r["forward_vs_sdpa"] == pytest.approx(r["forward_ms"] / sdpa["forward_ms"])
        assert r["train_vs_sdpa"] == pytest.approx(r["train_ms"] / sdpa["train_ms"])
        assert r["forward_vs_eager"] == pytest.approx(r["forward_ms"] / eager["forward_ms"])
        n, b, k = r["n"], r["batch"], r["k"]
        assert r["flop_forward"] == 2 * b * result["heads"] * n * (k * 16 + n * k + n * 16)  # d = 16 in the dry run
    text = (tmp_path / "gpu_dry_run.md").read_text()
    assert "| 32 | 1 | 8 | per_query | triton |" in text



def test_model_rows_keep_every_round_and_pair_the_ratios_by_round():
    """Three rounds at a tiny shape: each model's seconds per round are kept in round order, and its ratio is the
    median of the per-round ratios to BertModel eager (recomputed here from the kept rounds), its range their
    lowest and highest."""
    import statistics

    run = _import("run")
    spec = dict(layers=1, hidden=16, heads=2, b=1, n=8, k=2, modes=["inference"])
    rows = {r["model"]: r for r in run.model_rows(spec, 3)}
    eager = rows["BertModel eager"]["round_s"]
    for r in rows.values():
        assert len(r["round_s"]) == 3 and r["s"] == statistics.median(r["round_s"])
        ratios = [a / b for a, b in zip(r["round_s"], eager)]
        assert r["ratio"] == pytest.approx(statistics.median(ratios), rel=1e-12)
        assert r["ratio_range"] == pytest.approx([min(ratios), max(ratios)], rel=1e-12)
        # 3 rounds: the interval for the median is the whole range, covering it with probability 1 - 2/8
        assert r["ratio_interval"] == pytest.approx([min(ratios), max(ratios)], rel=1e-12)
        assert (r["interval_coverage"], r["rounds"]) == (0.75, 3)
    assert set(rows) == {"BertModel eager", "BertModel sdpa", "PartialBert shared", "PartialBert per_query"}
    chosen = run.model_rows({**spec, "models": ["BertModel eager", "BertModel sdpa", "PartialBert shared"]}, 1)
    assert [r["model"] for r in chosen] == ["BertModel eager", "BertModel sdpa", "PartialBert shared"]
    with pytest.raises(ValueError, match="baselines"):
        run.model_rows({**spec, "models": ["BertModel eager", "PartialBert shared"]}, 1)


@pytest.mark.slow
def test_model_study_decides_each_goal_from_its_rounds(tmp_path):
    """The study at --quick shapes: only the models the goals name, each comparison in its own process; each goal's
    median and interval recomputed here from the kept per-round seconds, and its verdict from them."""
    import statistics

    study = _import("model_study")
    result = study.main(["--quick", "--rounds", "6", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "model_study.json").read_text())
    assert saved == json.loads(json.dumps(result)) and saved["command"] == "python benchmarks/model_study.py --quick " \
        "--rounds 6"
    roberta = [r for r in saved["model"] if r["arch"] == "roberta"]
    assert {r["model"] for r in roberta} == {"RobertaModel eager", "RobertaModel sdpa", "PartialRoberta shared"}
    assert {(r["n"], r["mode"]) for r in roberta} == {(16, "inference"), (16, "training step")}
    rows = {(r["n"], r["mode"], r["model"]): r for r in saved["model"] if r["arch"] == "bert"}
    assert {key[2] for key in rows} == {"BertModel eager", "BertModel sdpa", "PartialBert shared"}
    assert {key[:2] for key in rows} == {(16, "inference"), (16, "training step"), (32, "inference")}
    text = (tmp_path / "model_study.md").read_text()
    assert str(tmp_path) not in text
    wanted = {"model inference, n=16, k=4 / BertModel eager": ((16, "inference"), "BertModel eager", 0.98),
              "model training step, n=16, k=4 / BertModel eager": ((16, "training step"), "BertModel eager", 0.95),
              "model inference, n=32, k=4 / BertModel eager": ((32, "inference"), "BertModel eager", 0.85),
              "model inference, n=32, k=4 / BertModel SDPA (stretch)": ((32, "inference"), "BertModel sdpa", 1.0)}
    assert [g["goal"] for g in saved["goals"]] == list(wanted)
    for g in saved["goals"]:
        (n, mode), baseline, bound = wanted[g["goal"]]
        partial, base = rows[n, mode, "PartialBert shared"]["round_s"], rows[n, mode, baseline]["round_s"]
        ratios = sorted(a / b for a, b in zip(partial, base))
        assert len(ratios) == 6 and g["measured"] == pytest.approx(statistics.median(ratios), rel=1e-12)
        # 6 rounds: P(Binomial(6, 1/2) = 0) = 1/64 <= 2.5 %, P(<= 1) = 7/64 is not: the whole range, 1 - 2/64
        assert g["interval"] == pytest.approx([ratios[0], ratios[-1]], rel=1e-12) and g["coverage"] == 1 - 2 / 64
        decided = ratios[-1] <= bound or ratios[0] > bound
        assert (g["bound"], g["met"], g["decided"]) == (bound, g["measured"] <= bound, decided)
        verdict = ("yes" if g["met"] else "no") if decided else f"undecided (median: {'yes' if g['met'] else 'no'})"
        assert f"| {g['goal']} | {g['measured']:.3f}x | {ratios[0]:.2f}–{ratios[-1]:.2f} (97 %, 6 rounds) | " \
            f"<= {bound} | {verdict} |" in text.splitlines()


def test_granularity_speed_times_a_per_head_model(tmp_path):
    """The tiny version of benchmarks/granularity_speed.py: every model in every mode, ratios to each baseline, and
    the per-head model is one (a P per head that differs between heads)."""
    granularity_speed = _import("granularity_speed")
    models = granularity_speed.models(granularity_speed.SPECS["tiny"])
    per_head = models["PartialBert per head"]
    assert per_head.config.partial_granularity == "head"
    p = per_head.encoder.partial_pattern_layer0.indices  # (H, n, k)
    assert tuple(p.shape) == (4, 16, 4) and not bool((p[0] == p[1]).all())
    result = granularity_speed.main(["--spec", "tiny", "--rounds", "3", "--out", str(tmp_path)])
    assert set(result["results"]) == {"inference", "training step"}
    for rows in result["results"].values():
        assert set(rows) == set(models)
        assert rows["PartialBert pooled"]["vs_pooled"]["median"] == 1.0
    assert "| inference | PartialBert per head |" in (tmp_path / "granularity_speed_tiny.md").read_text()


@pytest.mark.slow
def test_granularity_speed_times_mpnet_per_head_in_one_pass_and_head_by_head(tmp_path, monkeypatch):
    """The MPNet spec (tiny): the per-head model runs its layers in one pass, the head-by-head entry the same model
    each head by its own kernel (no one-pass call), with the same output; ratios to pooled and eager."""
    import torch

    import hf_partial_attention.attention_heads as heads

    granularity_speed = _import("granularity_speed")
    models = granularity_speed.models(granularity_speed.SPECS["mpnet_tiny"])
    calls = []
    monkeypatch.setattr(heads, "_group", lambda *a, f=heads._group: calls.append(1) or f(*a))
    ids = torch.randint(5, 99, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        one = models["partial per head"].eval()(input_ids=ids).last_hidden_state
        assert len(calls) == 1  # layer 0 partial (the last exact), every head in one group
        by_head = models["partial per head, head by head"].eval()(input_ids=ids).last_hidden_state
        assert len(calls) == 1
    torch.testing.assert_close(by_head, one, rtol=1e-5, atol=1e-6)
    result = granularity_speed.main(["--spec", "mpnet_tiny", "--rounds", "3", "--modes", "inference",
                                     "--out", str(tmp_path)])
    rows = result["results"]["inference"]
    assert set(rows) == set(models) and rows["MPNetModel eager"]["vs_eager"]["median"] == 1.0
    assert set(rows["partial pooled"]) == {"median_s", "round_s", "vs_pooled", "vs_eager"}
    text = (tmp_path / "granularity_speed_mpnet_tiny.md").read_text()
    assert "| inference | partial per head, head by head |" in text
