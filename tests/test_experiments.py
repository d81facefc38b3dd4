"""The repository's studies (`experiments/`, run by `python -m experiments` and the Makefile), apart from the
installed package: what the package no longer holds, the Table-1 arms' names, the command lines, no import cycle,
and the demo (slow)."""

import ast
import dataclasses
import importlib
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from experiments import cli as studies_cli
from experiments.table1.gaps import GOALS_ACCURACY
from experiments.table1.spec import Arm, StudyArguments, job_names, study_arms

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("module", ["hf_partial_attention.studies", "hf_partial_attention.analysis.demo",
                                    "hf_partial_attention.analysis.paper", "hf_partial_attention.analysis.objectives"])
def test_the_installed_package_holds_no_study(module):
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(module)


def test_the_package_keeps_what_its_commands_need():
    from setuptools import find_packages

    from hf_partial_attention import cli
    from hf_partial_attention.analysis.defaults import DEFAULT_MODEL_ID, resolve_model
    from hf_partial_attention.analysis.selection import FAMILIES, OBJECTIVES

    assert list(cli.COMMANDS) == ["analyze", "derive", "convert"]
    assert OBJECTIVES == ("paper", "shift", "fisher") and "shared_blocks" in FAMILIES
    # a model given is named by the Hub id it records: a Hub id as it is, a folder that records none by nothing
    assert resolve_model(None)[1] == DEFAULT_MODEL_ID and resolve_model("bert-base-uncased") == ("bert-base-uncased",
                                                                                                "bert-base-uncased")
    assert resolve_model(ROOT) == (ROOT, None)
    # what the wheel packs (pyproject: packages.find where = ["src"]): the plugin only, no study
    packages = find_packages(os.path.join(ROOT, "src"))
    assert "hf_partial_attention" in packages
    assert not [p for p in packages if p.split(".")[0] != "hf_partial_attention" or "studies" in p]


@pytest.mark.parametrize("flags", [{}, dict(ks="8,16,32", modes="per_layer,common", recoveries="mlm,distill",
                                        zero_fill_control="32:common:mlm", rlr_arm="32:common:distill"),
                                   dict(ks="8", modes="fixed", recoveries="none", zero_fill_control="", rlr_arm="",
                                        reconstruction_learning_rates="1e-3")],
                         ids=["default", "three_ks", "one_arm"])
def test_arm_names_round_trip(flags):
    a = StudyArguments(**flags)
    arms = a.arms()
    by_name = arms.by_name()
    assert len(by_name) == len(arms.finetune)  # every arm its own name
    for arm in arms.finetune:
        assert by_name[arm.name] == arm  # name -> Arm -> name
        assert Arm(**dataclasses.asdict(arm)) == arm and Arm(**dataclasses.asdict(arm)).name == arm.name
    assert all(arm.recovery != "none" for arm in arms.mlm) and all(arm.recovery == "none" for arm in arms.converted)
    assert set(arms.mlm) | set(arms.converted) == set(arms.finetune)
    # every job of an arm is named by it (the run folder's files, which a resumed run reads)
    jobs = job_names(a)
    assert len(set(jobs)) == len(jobs)
    assert {f"mlm_{arm.name}" for arm in arms.mlm} <= set(jobs)
    assert {f"ft_{arm.name}_s{s}" for arm in arms.finetune for s in a.seeds} <= set(jobs)


def _report_entry(report: dict, path: str):
    """``rows.exact.accuracy.mean`` -> report["rows"]["exact"]["accuracy"]["mean"] (arm names hold no dot)."""
    value = report
    for key in path.split("."):
        value = value[key]
    return value


def test_committed_table1_is_the_second_protocol_and_consistent():
    """results/table1/table1.json: made by the command with today's default arguments, one row per arm of that
    protocol, and every step of its gap decomposition and goals the difference of the two entries it names (a
    paired MLM difference is the difference of the two token-weighted means; an accuracy difference the difference
    of the seeds' means). The cards of model_cards/table1-<arm> carry the seed-0 accuracy of their row."""
    with open(os.path.join(ROOT, "results", "table1", "table1.json")) as f:
        report = json.load(f)
    assert report["command"].startswith("python -m experiments table1")
    defaults = StudyArguments()
    assert report["arguments"] == defaults.result_fields()
    names = [arm.name for arm in defaults.arms().finetune]
    assert sorted(report["rows"]) == sorted(names) and len(names) == 20
    for row in report["rows"].values():
        acc = row["accuracy"]
        assert len(acc["values"]) == 3 and acc["mean"] == pytest.approx(sum(acc["values"]) / 3, abs=1e-12)
    checked = 0
    for k, d in report["decomposition"].items():
        for step in d["steps"]:
            for kind in ("windows", "pairs", "accuracy"):
                m = step[kind]
                if m is None:
                    continue
                assert m["diff"] == pytest.approx(_report_entry(report, m["of"]) - _report_entry(report, m["minus"]),
                                                  abs=1e-9), (k, step["comparison"], kind)
                assert m["se"] > 0
                checked += 1
        worst = min(d["accuracy_steps"], key=lambda s: s["diff"])
        assert d["loses_most"]["step"] == worst["step"]
    assert checked >= 20
    exact = report["rows"]["exact"]["accuracy"]["mean"]
    for goal in report["goals"]:
        if "diff" in goal:
            row = report["rows"][goal["arm"]]
            assert goal["diff"] == pytest.approx(row["accuracy"]["mean"] - exact, abs=1e-12)
            tolerance = GOALS_ACCURACY[report["rows"][goal["arm"]]["k"]]
            assert goal["met"] == (goal["diff"] >= -tolerance)
    for name in names:
        with open(os.path.join(ROOT, "model_cards", f"table1-{name}", "README.md")) as f:
            card = f.read()
        value = round(report["rows"][name]["accuracy"]["values"][0], 4)
        assert re.search(rf"value: {value}\b", card), name


def test_study_arms_refuse_a_name_twice():
    with pytest.raises(ValueError, match="repeat a name"):
        study_arms([8, 8], ["fixed"])
    with pytest.raises(ValueError, match="repeat a name"):
        StudyArguments(modes="common,common")


@pytest.mark.parametrize("command", [None, *studies_cli.COMMANDS])
def test_help_of_every_study_prints_usage(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        studies_cli.main([command, "--help"] if command else ["--help"])
    assert exit_info.value.code in (0, None)
    out = capsys.readouterr().out
    assert out.startswith(f"usage: python -m experiments{' ' + command if command else ''}")


def test_makefile_targets_run_the_studies():
    """`make demo / paper / objectives / table1` (dry run): each line is a `python -m experiments` command that
    parses, with the outputs the targets promise."""
    proc = subprocess.run(["make", "-n", "--no-print-directory", "demo", "paper", "objectives", "table1"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, check=True)
    lines = [line.split(" -m experiments ", 1)[1].split() for line in proc.stdout.splitlines()
             if " -m experiments " in line]
    assert [line[0] for line in lines] == ["demo", "paper", "demo", "objectives", "table1"]
    for argv in lines:
        if argv[0] != "table1":
            studies_cli.build_parser().parse_args(argv)  # exits on an unknown flag
    from transformers import HfArgumentParser

    (study,) = HfArgumentParser(StudyArguments).parse_args_into_dataclasses(lines[-1][1:])
    assert (study.output_dir, study.run_dir) == ("results/table1", "runs/table1")
    assert lines[0][1:] == ["--out", "runs/demo"] and lines[1][1:] == ["--out", "runs/paper", "--results",
                                                                      "results/paper"]
    assert lines[3][-2:] == ["--out", "results/objectives"]


@pytest.mark.slow
def test_python_m_experiments_in_a_fresh_process():
    proc = subprocess.run([sys.executable, "-m", "experiments", "objectives", "does-not-exist", "--no-progress"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 2, proc.stderr  # a user error, in one line
    assert proc.stderr.startswith("error: ") and len(proc.stderr.strip().splitlines()) == 1


def _import_graph(folders: dict[str, str]) -> dict[str, set[str]]:
    """Module -> the repository's modules it imports (every import statement, at the top or inside functions)."""
    files = {}
    for folder, base in folders.items():
        for dirpath, _, names in os.walk(os.path.join(ROOT, folder)):
            for name in names:
                if name.endswith(".py"):
                    path = os.path.join(dirpath, name)
                    module = os.path.relpath(path, os.path.join(ROOT, base))[:-3].replace(os.sep, ".")
                    files[module.removesuffix(".__init__")] = path
    graph = {}
    for module, path in files.items():
        package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                parts = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
                source = ".".join(parts + ([node.module] if node.module else []))
                targets |= {f"{source}.{a.name}" if f"{source}.{a.name}" in files else source for a in node.names}
        for target in targets:
            while target and target not in files:  # a name inside a module: the module
                target = target.rpartition(".")[0]
            if target and target != module:
                graph.setdefault(module, set()).add(target)
    return graph


def test_no_import_cycle_in_the_repository():
    graph = _import_graph({"src/hf_partial_attention": "src", "experiments": ".", "research": ".",
                           "benchmarks": "."})
    assert "experiments.table1.spec" in graph.get("experiments.table1.report", set())  # the graph sees imports

    def on_a_cycle(module):  # does a path of imports lead from the module back to it?
        seen, todo = set(), list(graph.get(module, ()))
        while todo:
            nxt = todo.pop()
            if nxt == module:
                return True
            if nxt not in seen:
                seen.add(nxt)
                todo += graph.get(nxt, ())
        return False

    cycles = sorted(module for module in graph if on_a_cycle(module))
    assert not cycles, f"modules on an import cycle: {cycles}"


@pytest.mark.slow
def test_demo_small(tmp_path, small_minilm_dir, small_minilm_id, capsys):
    """The tiny version of `make demo` on the small MiniLM (6 layers, d_h = 32 as the MiniLM; conftest)."""
    out = str(tmp_path / "demo")
    assert studies_cli.main(["demo", "--out", out, "--model", small_minilm_dir, "--fit-sequences", "16",
                             "--heldout-sequences", "8", "--k", "16", "24", "--whole-seq-len", "16",
                             "--whole-sequences", "32", "--bucket-inputs", "96", "--embedding-paragraphs", "16",
                             "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"Wrote {os.path.join(out, 'report.md')} in ")
    assert printed.rstrip().endswith(f"checkpoint {os.path.join(out, 'checkpoint')} (a k per layer at k = 16's saving, "
                                     "layer 4 exact)")
    report = open(os.path.join(out, "report.md")).read()
    assert "Headline, k = 16 at n = 128" in report and "Conversion and sentence embeddings" in report
    assert "saves 43.8% of QKᵀ" in report  # the headline is at a k that saves work (d_h = 32)
    # the model is named by its Hub id, never by a path of this machine
    assert small_minilm_id in report
    assert small_minilm_dir not in report and str(tmp_path) not in report
    assert os.path.isfile(os.path.join(out, "checkpoint", "config.json"))
    config = json.load(open(os.path.join(out, "checkpoint", "config.json")))
    assert config["partial_lengths"] == [16, 32, 64, 128]  # the checkpoint carries the length buckets
    # P and R per head, a k per partial layer at k = 16's saving with the last partial layer (4) exact within it
    # (derive --saving k16 --exact-layers 4): layers 0-3 and the dense layer 4 cost no more than five layers at k = 16
    assert config["partial_granularity"] == "head" and config["partial_format_version"] == 5
    assert config["partial_layers"] == [0, 1, 2, 3]
    from hf_partial_attention.cost import score_cost

    rows = config["partial_layers_k"]
    assert len(rows) == 4 and all(row[0] == 16 for row in rows)  # bucket 16 at k = 16 runs exactly
    for i, b in enumerate((32, 64, 128), start=1):
        spent = sum(score_cost(b, row[i], 32).total for row in rows) + score_cost(b, b, 32).dense
        assert spent <= 5 * score_cost(b, 16, 32).total
    assert "Length buckets" in report and ("length buckets [16, 32, 64, 128]), k=16, P and R per head, a k per layer "
                                           "at k=16's saving, layer 4 exact") in report


@pytest.mark.slow
def test_lengths_small(tmp_path, small_minilm_dir, small_minilm_id, capsys):
    """The tiny version of `make lengths` on the small MiniLM (conftest): every arm, kind and k measured, the goals
    table rendered, the figure drawn, and the four arms give different embeddings (each runs its own P and R); bucket
    64 at its own k (--bucket-k)."""
    from hf_partial_attention.cost import score_cost

    results = str(tmp_path / "results")
    assert studies_cli.main(["lengths", "--model", small_minilm_dir, "--out", str(tmp_path / "run"), "--results",
                             results, "--k", "16", "--fit-windows", "16", "--fit-inputs", "120", "--max-heldout", "24",
                             "--bucket-k", "64=24", "--no-progress"]) == 0
    assert capsys.readouterr().out.startswith(f"Wrote {os.path.join(results, 'lengths.md')} in ")
    data = json.load(open(os.path.join(results, "lengths.json")))
    arms = {(r["arm"], r["inputs_kind"]) for r in data["rows"]}
    assert {arm for arm, _ in arms} == {"zero-fill", "buckets", "conditional", "bucket-conditional"}
    assert {kind for _, kind in arms} >= {"sentences", "paragraphs", "windows"}
    by_arm = {}
    for r in data["rows"]:
        if r["inputs_kind"] == "sentences" and r["bucket"] == 32:
            by_arm[r["arm"]] = r["one_minus_cos"]
            assert len(r["hidden_error"]) == 6 and 0 <= r["spearman"] <= 1
    assert len(set(by_arm.values())) == 4, by_arm
    text = open(os.path.join(results, "lengths.md")).read()
    assert "## Goals at k = 16, bucket 64 at k = 24" in text and small_minilm_id in text
    assert data["bucket_k"] == {"64": 24} and data["saving"]["16"]["per_bucket"]["64"] == score_cost(64, 24, 32).saving
    assert data["saving"]["16"]["per_bucket"]["128"] == score_cost(128, 16, 32).saving
    assert [r["k"] for r in data["score_errors"]["16"]["buckets"]] == [16, 16, 24, 16]
    assert small_minilm_dir not in text
    assert os.path.isfile(os.path.join(results, "figures", "one_minus_cos_vs_length.png"))


def test_spearman_matches_scipy():
    from scipy.stats import spearmanr

    from experiments.lengths.study import spearman

    g = torch.Generator().manual_seed(0)
    a = torch.randn(200, generator=g, dtype=torch.float64)
    b = a + 0.7 * torch.randn(200, generator=g, dtype=torch.float64)
    assert abs(spearman(a, b) - spearmanr(a.numpy(), b.numpy()).statistic) < 1e-12
    assert spearman(a, -a) == pytest.approx(-1.0)


@pytest.mark.slow
def test_recover_small(tmp_path, small_minilm_dir, small_minilm_id, capsys):
    """The tiny version of `make recover` on the small MiniLM (conftest): buckets fitted, converted, two recovery steps,
    measured, saved. The saved checkpoint is the measured one (its embeddings reproduce the recovered row), it differs
    from the conversion, it loads in sentence-transformers, and its card names the base model, the command and the
    numbers."""
    from sentence_transformers import SentenceTransformer
    from transformers import AutoTokenizer, BertModel

    import hf_partial_attention  # noqa: F401  (registers PartialBert with the Auto classes)
    from experiments.lengths.study import held_out_inputs
    from experiments.lengths.recover import measure
    from hf_partial_attention.modeling_partial_bert import PartialBertModel

    out, results = str(tmp_path / "run"), str(tmp_path / "results")
    assert studies_cli.main(["recover", "--model", small_minilm_dir, "--out", out, "--results", results, "--steps", "2",
                             "--batch-size", "8", "--train-inputs", "48", "--fit-inputs", "120", "--max-heldout", "24",
                             "--bucket-k", "64=20", "--no-progress"]) == 0
    assert "recovery.md" in capsys.readouterr().out
    assert os.path.isfile(os.path.join(out, "buckets", "patterns", "buckets_k16_b64k20.safetensors"))
    data = json.load(open(os.path.join(results, "recovery.json")))
    assert data["lengths"] == [16, 32, 64, 128] and data["steps"] == 2
    rows = {(r["model"], r["inputs_kind"], r["bucket"]): r for r in data["rows"]}
    assert {m for m, _, _ in rows} == {"converted", "recovered"}
    rec, conv = rows[("recovered", "sentences", "all")], rows[("converted", "sentences", "all")]
    assert rec["one_minus_cos"] != conv["one_minus_cos"]
    folder = os.path.join(out, "recovered")
    tok = AutoTokenizer.from_pretrained(folder)
    saved = PartialBertModel.from_pretrained(folder, add_pooling_layer=False).eval()
    assert saved.config.partial_lengths_k == [16, 16, 20, 16]  # bucket 64 at its own k (--bucket-k)
    original = BertModel.from_pretrained(small_minilm_dir, add_pooling_layer=False).eval()
    again = measure(original, {"recovered": saved}, {"sentences": held_out_inputs(tok, 24, 0, 128)[0]["sentences"]},
                    data["lengths"])
    again = {r["bucket"]: r for r in again}
    assert again["all"]["one_minus_cos"] == pytest.approx(rec["one_minus_cos"], rel=1e-6, abs=1e-9)
    st = SentenceTransformer(folder, trust_remote_code=True, device="cpu")
    assert st.encode(["A held-out sentence."]).shape == (1, 128)  # the small MiniLM's width
    card = open(os.path.join(folder, "README.md")).read()
    assert f"base_model: {small_minilm_id}" in card
    assert "python -m experiments recover" in card and f"{rec['one_minus_cos']:.4f}" in card
    assert small_minilm_dir not in card and small_minilm_dir not in open(os.path.join(results, "recovery.md")).read()


@pytest.mark.slow
def test_granularity_small(tmp_path, small_minilm_dir, capsys):
    """The tiny version of `make granularity` on the small MiniLM (conftest): one analysis per head, the three
    granularities measured at the same k, each converting what it names (the pooled row is the pooled pattern's
    conversion, recomputed here)."""
    from hf_partial_attention import PartialBertModel
    from hf_partial_attention.analysis.covariance import ScoreCovariance
    from hf_partial_attention.analysis.embeddings import embedding_cosines, window_batches
    from hf_partial_attention.analysis.selection import select_pattern
    from safetensors.torch import load_file
    from transformers import AutoModel

    from experiments.objectives.study import model_outputs

    run, results = str(tmp_path / "run"), str(tmp_path / "results")
    assert studies_cli.main(["granularity", "--model", small_minilm_dir, run, "--results", results, "--k", "4",
                             "--objectives", "paper", "--seq-len", "16", "--fit-sequences", "32", "--heldout-sequences",
                             "6", "--no-progress"]) == 0
    assert capsys.readouterr().out.startswith(f"Wrote {os.path.join(results, 'granularity.md')} in ")
    data = json.load(open(os.path.join(results, "granularity.json")))
    rows = {r["granularity"]: r for r in data["rows"]}
    assert set(rows) == {"pooled", "layer", "head"} and data["partial_layers"] == [0, 1, 2, 3, 4]
    assert len({r["one_minus_cos"] for r in rows.values()}) == 3  # three different conversions
    cov = ScoreCovariance.load(os.path.join(run, "covariance.safetensors"))
    assert cov.granularity == "head" and len(cov.heads) == 4  # the small MiniLM's heads
    original = AutoModel.from_pretrained(small_minilm_dir).eval()
    batches = window_batches(load_file(os.path.join(run, "heldout_windows.safetensors"))["input_ids"], 16)
    pooled = PartialBertModel.from_bert(original, select_pattern(cov, 4), reconstruction="fixed").eval()
    ref, _ = model_outputs(original, batches, False, "")
    got, _ = model_outputs(pooled, batches, False, "")
    assert abs(float(1 - embedding_cosines(ref, got).mean()) - rows["pooled"]["one_minus_cos"]) < 1e-6
    text = open(os.path.join(results, "granularity.md")).read()
    assert "| 4 | paper | head |" in text and small_minilm_dir not in text


@pytest.mark.slow
def test_granularity_lengths_small(tmp_path, small_minilm_dir, capsys, monkeypatch):
    """The tiny version of `make granularity-lengths` on the small MiniLM (conftest; buckets 16 and 32, k = 4): the five
    arms measured on every kind of input, the budgeted arms with a k per partial layer that costs no more than k = 4 in
    every layer, and the pooled arm equal to a conversion of the pooled fit recomputed here from the same covariances;
    then the tiny version of `make granularity-recover` on that run."""
    from hf_partial_attention import PartialBertModel
    from hf_partial_attention.analysis.covariance import ScoreCovariance
    from hf_partial_attention.analysis.lengths import bucket_covariance_files
    from hf_partial_attention.analysis.selection import select_pattern
    from hf_partial_attention.cost import score_cost
    from hf_partial_attention.pattern_buckets import PatternBuckets
    from transformers import AutoModel, AutoTokenizer

    from experiments.lengths.study import held_out_inputs
    from experiments.lengths.recover import measure

    run, results = str(tmp_path / "run"), str(tmp_path / "results")
    assert studies_cli.main(["granularity-lengths", "--model", small_minilm_dir, "--out", run, "--results", results,
                             "--k", "4", "--lengths", "16", "32", "--fit-inputs", "80", "--fit-windows", "16",
                             "--max-heldout", "12", "--heldout-windows", "4", "--no-progress"]) == 0
    assert capsys.readouterr().out.startswith(f"Wrote {os.path.join(results, 'granularity_lengths.md')} in ")
    data = json.load(open(os.path.join(results, "granularity_lengths.json")))
    assert data["arms"] == ["pooled uniform", "layer uniform", "layer budget", "head uniform", "head budget"]
    assert {(r["model"], r["inputs_kind"]) for r in data["rows"]} >= {
        (arm, kind) for arm in data["arms"] for kind in ("sentences", "paragraphs", "pairs", "windows")}
    for arm in ("layer budget", "head budget"):
        ks = data["saving"][arm]["ks"]
        assert sorted(ks) == ["0", "1", "2", "3", "4"] and len({tuple(v) for v in ks.values()}) > 1
        assert sum(score_cost(32, v[-1], 32).total for v in ks.values()) <= 5 * score_cost(32, 4, 32).total
    assert data["saving"]["head uniform"]["ks"]["0"] == [4, 4]
    text = open(os.path.join(results, "granularity_lengths.md")).read()
    assert "## Goals (issue 34" in text and "`head budget`" in text and small_minilm_dir not in text
    # the pooled arm: P and R of the summed covariances, converted, measured the same way
    covs = {b: ScoreCovariance.load(p) for b, p in bucket_covariance_files(os.path.join(run, "fit")).items()}
    assert all(c.granularity == "head" for c in covs.values())
    # the longest bucket's fit: its inputs and the 16 windows of n tokens
    longest = ScoreCovariance.load(bucket_covariance_files(os.path.join(run, "buckets"))[32])
    assert covs[32].num_sequences == longest.num_sequences + 16 == data["fit_inputs"]["32"]
    pooled = PatternBuckets({b: select_pattern(covs[b], 4, objective="fisher") for b in (16, 32)}, k=4)
    original = AutoModel.from_pretrained(small_minilm_dir).eval()
    model = PartialBertModel.from_bert(original, pooled, reconstruction="fixed").eval()
    tokens, _ = held_out_inputs(AutoTokenizer.from_pretrained(small_minilm_dir), 12, 0, 32)
    expected = measure(original, {"pooled uniform": model}, {"sentences": tokens["sentences"]}, (16, 32))
    got = {(r["inputs_kind"], r["bucket"]): r["one_minus_cos"] for r in data["rows"] if r["model"] == "pooled uniform"}
    for r in expected:
        assert got[("sentences", r["bucket"])] == pytest.approx(r["one_minus_cos"], rel=1e-6)

    # The tiny version of `make granularity-recover` on this run: two arms converted and recovered (one step), each
    # from its own bucket file (the pooled arm's: the file the pooled row above was measured with), read back when run
    # again with the same settings, not with others.
    import experiments.lengths.recover as recover_module
    from safetensors.torch import load_file

    pooled_file = os.path.join(run, "fit", "patterns", "buckets_per_query_fisher_pooled_k4.safetensors")
    saved = load_file(pooled_file)
    assert any(torch.equal(v, pooled[32].indices) for v in saved.values())
    recovered, out = str(tmp_path / "recovered"), str(tmp_path / "recover_runs")
    argv = ["granularity-recover", "--model", small_minilm_dir, "--lengths-run", run, "--out", out, "--results",
            recovered, "--k", "4", "--steps", "1", "--batch-size", "8", "--train-inputs", "16", "--max-heldout", "8",
            "--arms", "pooled_uniform", "head_budget", "--no-progress"]
    assert studies_cli.main(argv) == 0
    capsys.readouterr()
    data = json.load(open(os.path.join(recovered, "granularity_recover.json")))
    assert data["arms"] == ["pooled uniform", "head budget"]
    for arm, source in (("pooled uniform", "pooled_k4"), ("head budget", "head_savingk4_budget")):
        own = json.load(open(os.path.join(recovered, arm.replace(" ", "_"), "recovery.json")))
        assert own["buckets_source"] == f"buckets_per_query_fisher_{source}.safetensors" and own["steps"] == 1
        worst = max(r["one_minus_cos"] for r in own["rows"] if r["model"] == "recovered" and r["bucket"] != "all")
        assert data["goals"][arm]["worst_one_minus_cos"] == worst
    config = json.load(open(os.path.join(out, "head_budget", "recovered", "config.json")))
    assert config["partial_granularity"] == "head" and len({tuple(r) for r in config["partial_layers_k"]}) > 1
    text = open(os.path.join(recovered, "granularity_recover.md")).read()
    assert "## Goal (issue 34" in text and small_minilm_dir not in text

    calls = []
    real = recover_module.run_recover
    monkeypatch.setattr(recover_module, "run_recover", lambda *a, **kw: calls.append(kw["buckets"]) or real(*a, **kw))
    assert studies_cli.main(argv) == 0  # the same settings: both arms read back
    assert calls == []
    from experiments.granularity.recover import _existing

    own = os.path.join(recovered, "head_budget", "recovery.json")
    budget_file = os.path.join(run, "fit", "patterns", "buckets_per_query_fisher_head_savingk4_budget.safetensors")
    assert _existing(own, budget_file, 1, 8) is not None
    assert _existing(own, budget_file, 2, 8) is None and _existing(own, budget_file, 1, 9) is None  # run again
    assert _existing(own, pooled_file, 1, 8) is None  # another arm's file

    # The tiny version of `make granularity-layers` on this run: layer 0 alone partial is measured again here on the
    # same calibration windows, and the calibrated budget is written beside the plain one.
    from hf_partial_attention.analysis.corpus import default_texts, make_windows
    from hf_partial_attention.pattern_layers import LayerPatterns

    layers_results = str(tmp_path / "layers")
    assert studies_cli.main(["granularity-layers", "--model", small_minilm_dir, "--lengths-run", run, "--results",
                             layers_results, "--k", "4", "--calibration-windows", "8", "--max-heldout", "12",
                             "--heldout-windows", "4", "--no-progress"]) == 0
    capsys.readouterr()
    data = json.load(open(os.path.join(layers_results, "granularity_layers.json")))
    assert data["layers"] == [0, 1, 2, 3, 4] and data["arms"][:3] == ["head uniform", "head budget", "head calibrated"]
    # the exact arm: the layer whose being left exact gives the lowest calibration error, exact at the same saving
    chosen = min(range(5), key=lambda layer: data["ablation"]["exact"][str(layer)]["calibration"])
    assert data["exact_layer"] == chosen and len(data["arms"]) == 3  # k = 4's saving cannot pay for a dense layer
    assert "leave fewer layers exact" in data["exact_skipped"]
    ids = make_windows(AutoTokenizer.from_pretrained(small_minilm_dir), default_texts(), 32, 8)  # (8, 32)
    uniform = LayerPatterns.load(os.path.join(run, "fit", "patterns",
                                              "buckets_per_query_fisher_head_savingk4_uniform.safetensors"))
    alone = PartialBertModel.from_bert(original, uniform, reconstruction="fixed", partial_layers=[0]).eval()
    with torch.no_grad():
        ref, got = (m(input_ids=ids).last_hidden_state.mean(1) for m in (original, alone))
    expected = float((1 - torch.cosine_similarity(ref, got, dim=-1)).mean())
    assert data["ablation"]["alone"]["0"]["calibration"] == pytest.approx(expected, rel=1e-5)
    added = data["ablation"]["all"]["calibration"] - data["ablation"]["exact"]["0"]["calibration"]
    assert data["weights"]["0"] == pytest.approx(added / data["objective_at_k"]["0"])
    assert os.path.isfile(os.path.join(run, "fit", "patterns",
                                       "buckets_per_query_fisher_head_savingk4_calibrated.safetensors"))
    assert "## Ablation" in open(os.path.join(layers_results, "granularity_layers.md")).read()

    # The tiny version of `make granularity-refit` on this run, and its estimator against the library's fit: with the
    # original's scores, a layer's refit R and bias are fit_pattern's on the covariance `collect_covariance` gathers
    # (through the attention hooks) from the same windows; in context, layer 0 sees the original's inputs (the same
    # refit) and layer 1 the converted model's (another one).
    from hf_partial_attention.analysis.collect import collect_covariance
    from hf_partial_attention.analysis.selection import fit_pattern

    from experiments.granularity.refit import refit_layer

    refit_results = str(tmp_path / "refit")
    assert studies_cli.main(["granularity-refit", "--model", small_minilm_dir, "--lengths-run", run, "--results",
                             refit_results, "--k", "4", "--windows", "8", "--max-heldout", "12", "--heldout-windows",
                             "4", "--no-progress"]) == 0
    capsys.readouterr()
    data = json.load(open(os.path.join(refit_results, "granularity_refit.json")))
    assert data["arms"] == ["fit", "refit", "refit with docstrings", "refit in context"]
    assert data["layers"] == [0, 1, 2, 3, 4]  # the partial layers: the last runs exactly
    rows = {(r["model"], r["inputs_kind"]): r for r in data["rows"]}
    assert {arm for arm, kind in rows if kind == "windows"} == set(data["arms"])
    assert data["predicted_error"]["2"] == pytest.approx(
        sum(uniform.group(2, h)[32].metadata["normalized_error"] for h in range(4)) / 4)
    held = held_out_inputs(AutoTokenizer.from_pretrained(small_minilm_dir), 12, 4, 32)[1].input_ids  # (4, 32)
    converted = PartialBertModel.from_bert(original, uniform, reconstruction="fixed").eval()
    with torch.no_grad():
        ref, got = (m(input_ids=held).last_hidden_state.mean(1) for m in (original, converted))
    expected = float((1 - torch.cosine_similarity(ref.double(), got.double(), dim=-1)).mean())
    assert rows[("fit", "windows")]["one_minus_cos"] == pytest.approx(expected, rel=1e-4)
    assert rows[("refit", "windows")]["one_minus_cos"] != rows[("fit", "windows")]["one_minus_cos"]
    cov = collect_covariance(original, ids, small_minilm_dir, seq_len=32, granularity="head", progress=False,
                             distributed=False)
    plain = refit_layer(original, uniform, 1, ids)
    for head in (0, 3):
        fitted = uniform.group(1, head)[32]
        want = fit_pattern(cov, fitted.indices, centered=True, bias=True, ridge=fitted.metadata["ridge"], layer=1,
                           head=head)
        torch.testing.assert_close(plain[head].reconstruction, want.reconstruction, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(plain[head].bias, want.bias, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(plain[0].reconstruction, uniform.group(1, 0)[32].reconstruction, atol=1e-3)
    for layer, same in ((0, True), (1, False)):
        base = plain if layer == 1 else refit_layer(original, uniform, 0, ids)
        context = refit_layer(original, uniform, layer, ids, context=converted)
        assert torch.allclose(context[3].reconstruction, base[3].reconstruction, atol=1e-5) == same
    with pytest.raises(ValueError, match=r"windows must be \(W, 32\)"):
        refit_layer(original, uniform, 1, ids[:, :16])

    # An exact-layer arm (`--arms head_exact4`, at k = 12's saving: k = 4's cannot pay for a dense layer) on the same
    # fit, converted and recovered: the model leaves layer 4 exact, its saving counts layer 4 as saving nothing, and
    # its held-out windows are those of the file's conversion.
    from experiments.granularity.lengths import parse_arm

    exact_results = str(tmp_path / "exact")
    assert studies_cli.main(["granularity-lengths", "--model", small_minilm_dir, "--out", run, "--results",
                             exact_results, "--k", "12", "--lengths", "16", "32", "--fit-inputs", "80", "--fit-windows",
                             "16", "--max-heldout", "12", "--heldout-windows", "4", "--arms", "head_exact4",
                             "--no-progress"]) == 0
    capsys.readouterr()
    data = json.load(open(os.path.join(exact_results, "granularity_lengths.json")))
    assert data["arms"] == ["head exact4"] and data["saving"]["head exact4"]["ks"]["4"] == [16, 32]
    assert data["saving"]["head exact4"]["per_layer"]["4"] == 0.0
    exact_file = os.path.join(run, "fit", "patterns", "buckets_per_query_fisher_head_savingk12_exact4.safetensors")
    exact_model = PartialBertModel.from_bert(original, LayerPatterns.load(exact_file), reconstruction="fixed").eval()
    assert exact_model.config.partial_layers == [0, 1, 2, 3]
    with torch.no_grad():
        ref, got = (m(input_ids=held).last_hidden_state.mean(1) for m in (original, exact_model))
    expected = float((1 - torch.cosine_similarity(ref.double(), got.double(), dim=-1)).mean())
    windows_row = next(r for r in data["rows"] if r["inputs_kind"] == "windows" and r["bucket"] == "all")
    assert windows_row["one_minus_cos"] == pytest.approx(expected, rel=1e-4)
    assert studies_cli.main(["granularity-recover", "--model", small_minilm_dir, "--lengths-run", run, "--out", out,
                             "--results", str(tmp_path / "exact_recovered"), "--k", "12", "--steps", "1",
                             "--batch-size", "8", "--train-inputs", "16", "--max-heldout", "8", "--arms", "head_exact4",
                             "--no-progress"]) == 0
    capsys.readouterr()
    config = json.load(open(os.path.join(out, "head_exact4", "recovered", "config.json")))
    assert config["partial_layers"] == [0, 1, 2, 3]
    assert parse_arm("head_exact1and4") == ("head", "exact1and4")
    for bad in ("pooled_exact4", "head_exact", "head_budgets"):
        with pytest.raises(ValueError, match="use one of"):
            parse_arm(bad)


def test_demo_derives_only_patterns_that_save_work():
    """`make demo` runs the defaults: every k it derives saves QKᵀ work at the MiniLM's d_h = 32 and n = 128."""
    from hf_partial_attention.cost import saving_warning

    args = studies_cli.build_parser().parse_args(["demo"])
    assert args.k and all(saving_warning(128, k, 32) is None for k in args.k), args.k
    assert args.convert_k in args.k


def test_demo_compares_embeddings_of_64_paragraphs_by_default_and_refuses_fewer_than_two(tmp_path):
    """The smoke test above compares 16 paragraphs' embeddings; `make demo` keeps 64; fewer than two have no pair for
    the reference cosine and are refused in one line before any work (nothing written)."""
    from experiments.demo.study import run_demo

    assert studies_cli.build_parser().parse_args(["demo"]).embedding_paragraphs == 64
    out = tmp_path / "demo"
    with pytest.raises(ValueError, match="embedding_paragraphs=1.*--embedding-paragraphs 2 or more"):
        run_demo(str(out), embedding_paragraphs=1)
    assert not out.exists()


def test_recorded_commands_name_a_local_model_by_its_hub_id(tmp_path, monkeypatch):
    """A study's recorded command names a local model folder as reports do: by the Hub id its card records, else an
    absolute path by the folder's name; a relative path, a Hub id, a missing path and the other flags' values are kept
    as given."""
    from experiments.flags import portable_argv

    named = tmp_path / "models" / "mine"
    named.mkdir(parents=True)
    (named / "modules.json").write_text("[]")
    (named / "README.md").write_text("model = SentenceTransformer('org/name')\n")
    bare = tmp_path / "bare"
    bare.mkdir()
    argv = ["demo", "--model", str(named), "--out", str(bare), "--model_name_or_path", str(bare)]
    assert portable_argv(argv) == ["demo", "--model", "org/name", "--out", str(bare), "--model_name_or_path", "bare"]
    assert portable_argv([f"--model={named}", "--k", "16"]) == ["--model=org/name", "--k", "16"]
    monkeypatch.chdir(tmp_path)
    assert portable_argv(["--model", "bare"]) == ["--model", "bare"]
    assert portable_argv(["--model", "org/other", "--model", "no/such/folder"]) == ["--model", "org/other", "--model",
                                                                                     "no/such/folder"]
