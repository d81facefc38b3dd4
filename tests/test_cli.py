"""The command line: registry, analyze → derive → convert on a tiny model (the studies: test_experiments)."""

import json
import os
import shlex

import pytest

from hf_partial_attention import AttentionPattern, cli
from hf_partial_attention.analysis.corpus import default_texts
from hf_partial_attention.attention_common import block_rows


def test_registry_lists_commands_and_refuses_duplicates():
    assert list(cli.COMMANDS) == ["analyze", "derive", "convert"]  # a user's commands; studies: `experiments`
    with pytest.raises(ValueError, match="already registered"):
        cli.register_command("analyze", "x", lambda p: None, lambda a: 0)
    parser = cli.build_parser()
    args = parser.parse_args(["derive", "DIR", "--k", "16", "24", "--scope", "whole"])
    assert args.k == [16, 24] and args.scope == "whole"


@pytest.mark.slow
def test_analyze_derive_convert(tiny_bert_dir, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text("\n\n".join(default_texts()[:6]), encoding="utf-8")
    out = str(tmp_path / "run")
    assert cli.main(["analyze", "--model", tiny_bert_dir, "--text-file", str(text), "--seq-len", "16",
                     "--max-sequences", "10", "--heldout-every", "0", "--out", out, "--no-progress"]) == 0
    assert capsys.readouterr().out.startswith(f"Wrote {out}: covariance of 10 windows at n = 16 (0 held-out")
    assert cli.main(["derive", out, "--k", "3", "5", "--no-progress"]) == 0
    results = json.load(open(os.path.join(out, "results.json")))
    printed = capsys.readouterr().out.splitlines()
    for line, row in zip(printed, results["derive_per_query"]["patterns"]):
        assert line == (f"k={row['k']}: {row['path']} (predicted error {row['predicted']:.4f}, "
                        "held-out not measured)")
    assert printed[-1] == f"Report: {os.path.join(out, 'report.md')}"
    assert results["analyze"]["num_sequences"] == 10
    assert [p["k"] for p in results["derive_per_query"]["patterns"]] == [3, 5]
    assert "heldout" not in results["derive_per_query"]  # no held-out windows with --heldout-every 0
    ckpt = str(tmp_path / "ckpt")
    pattern = os.path.join(out, "patterns", "per_query_k5.safetensors")
    assert cli.main(["convert", pattern, "--out", ckpt]) == 0
    assert os.path.isfile(os.path.join(ckpt, "config.json"))
    # the card records the command line as typed
    assert shlex.join(["hf-partial-attention", "convert", pattern, "--out", ckpt]) in open(
        os.path.join(ckpt, "README.md"), encoding="utf-8").read()
    # n = 16, k = 5, d_h = 8: 5·8 + 11·5 = 95 of 128 multiply-adds per query, a saving of 25.8 %
    assert capsys.readouterr().out.strip() == (f"Wrote checkpoint {ckpt}: k = 5 exact scores per query at n = 16, "
                                               "d_h = 8: a saving of 25.8 % of QKᵀ multiply-adds; reloads as "
                                               "PartialBertModel")
    # a constrained family: one key set shared by all queries (the exact part is one GEMM)
    assert cli.main(["derive", out, "--k", "4", "--family", "columns", "--no-progress"]) == 0
    shared = AttentionPattern.load(os.path.join(out, "patterns", "per_query_columns_k4.safetensors"))
    assert shared.metadata["family"] == "columns" and block_rows(shared.indices) == 16
    results = json.load(open(os.path.join(out, "results.json")))
    assert "derive_per_query_columns" in results and "derive_per_query" in results


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


@pytest.fixture(scope="module")
def tiny_run(tiny_bert_dir, tmp_path_factory):
    """An analyze folder of the tiny model: n = 16, d_h = 8, 10 fitted windows, no held-out windows."""
    tmp = tmp_path_factory.mktemp("cli_run")
    text = tmp / "text.txt"
    text.write_text("\n\n".join(default_texts()[:6]), encoding="utf-8")
    out = str(tmp / "run")
    assert cli.main(["analyze", "--model", tiny_bert_dir, "--text-file", str(text), "--seq-len", "16",
                     "--max-sequences", "10", "--heldout-every", "0", "--out", out, "--no-progress"]) == 0
    return out


@pytest.mark.parametrize("command", [None, *cli.COMMANDS])
def test_help_of_every_command_prints_usage(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([command, "--help"] if command else ["--help"])
    assert exit_info.value.code in (0, None)
    out = capsys.readouterr().out
    assert out.startswith(f"usage: hf-partial-attention{' ' + command if command else ''}")
    # plain text, and nothing an installed user cannot reach (a clone's results/, its experiments, make)
    for clone_only in ("``", "results/", "python -m experiments", "make "):
        assert clone_only not in " ".join(out.split()), clone_only


def test_help_shows_defaults_and_version(capsys):
    def help_of(command):
        with pytest.raises(SystemExit):
            cli.main([command, "--help"])
        return " ".join(capsys.readouterr().out.split())  # argparse wraps lines at the terminal's width

    assert "(default: [16, 24, 32, 48])" in help_of("derive") and "(default: paper)" in help_of("derive")
    analyze_help = help_of("analyze")
    assert "(default: 128)" in analyze_help and "(default: every window of the text)" in analyze_help
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    from hf_partial_attention.version import __version__

    assert capsys.readouterr().out.strip() == f"hf-partial-attention {__version__}"


def test_derive_k_out_of_range_names_only_the_users_k(tiny_run, capsys):
    assert cli.main(["derive", tiny_run, "--k", "200", "--no-progress"]) == 2
    line = _one_line_error(capsys)
    assert "got k=200;" in line and "[1, 16]" in line and "--k" in line
    assert "1, 2, 4" not in line  # the error curve's own ks are not the user's
    with pytest.raises(ValueError, match="got k=200;"):  # -v: the traceback instead
        cli.main(["derive", tiny_run, "--k", "200", "--no-progress", "-v"])


def test_analyze_seq_len_beyond_the_models_positions(tiny_bert_dir, tmp_path, capsys):
    out = tmp_path / "never"
    assert cli.main(["analyze", "--model", tiny_bert_dir, "--seq-len", "100", "--out", str(out),
                     "--no-progress"]) == 2
    line = _one_line_error(capsys)
    assert "seq_len=100" in line and "max_position_embeddings=64" in line and "--seq-len 64 or less" in line
    assert not out.exists()  # refused before any work: no folder left behind


def test_text_file_and_dataset_together_is_a_user_error(tiny_bert_dir, tmp_path, capsys):
    assert cli.main(["analyze", "--model", tiny_bert_dir, "--text-file", "x.txt", "--dataset", "wikitext",
                     "--out", str(tmp_path / "o")]) == 2
    assert "pass one of them" in _one_line_error(capsys)


def test_lengths_without_inputs_is_a_user_error_not_ignored(tiny_bert_dir, tmp_path, capsys):
    """--lengths (buckets of inputs at their own lengths) without --inputs would run fixed windows and drop the
    buckets without a word: refused in one line naming the fix, before any work."""
    for flags in (["--lengths", "8", "16"], ["--max-heldout-inputs", "10"]):
        assert cli.main(["analyze", "--model", tiny_bert_dir, *flags, "--out", str(tmp_path / "o")]) == 2
        line = _one_line_error(capsys)
        assert flags[0] in line and "--inputs sentences" in line
    assert not (tmp_path / "o").exists()


def test_convert_refusals_are_one_line(tiny_bert_dir, tmp_path, capsys):
    import torch

    n, k = 16, 4
    whole = AttentionPattern(torch.arange(k), torch.zeros(n * n - k, k), scope="whole", seq_len=n,
                             metadata={"source_model": tiny_bert_dir})
    whole.save(tmp_path / "whole.safetensors")
    assert cli.main(["convert", str(tmp_path / "whole.safetensors"), "--out", str(tmp_path / "c1")]) == 2
    assert "per-query" in _one_line_error(capsys)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"this is not a safetensors file at all")
    assert cli.main(["convert", str(junk), "--out", str(tmp_path / "c2")]) == 2
    assert "not a safetensors file" in _one_line_error(capsys)


@pytest.mark.slow
def test_derive_warnings_reach_the_terminal(tiny_run):
    """In a fresh process, as a user runs it: the CLI's logging shows the library's warnings on stderr."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "hf_partial_attention.cli", "derive", tiny_run, "--k", "5", "8",
                           "--no-evaluate", "--no-progress"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr
    # n = 16, d_h = 8: k = 8 costs 8·8 + 8·8 = 128 = n·d_h multiply-adds per query, k = 5 costs 95
    assert "k=8 saves no attention work" in proc.stderr and "k=5 saves" not in proc.stderr
    assert "Fitted on 10 window(s) at n=16, fewer than 16" in proc.stderr
    assert f"k=8: {os.path.join(tiny_run, 'patterns', 'per_query_k8.safetensors')}" in proc.stdout


@pytest.mark.slow
def test_second_derive_keeps_the_first_ones_patterns_in_the_report(tiny_bert_dir, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("\n\n".join(default_texts()[:6]), encoding="utf-8")
    out = str(tmp_path / "run")
    assert cli.main(["analyze", "--model", tiny_bert_dir, "--text-file", str(text), "--seq-len", "16",
                     "--max-sequences", "4", "--out", out, "--no-progress"]) == 0
    assert cli.main(["derive", out, "--k", "3", "--no-baselines", "--no-progress"]) == 0
    assert cli.main(["derive", out, "--k", "5", "--no-baselines", "--no-progress"]) == 0
    report = open(os.path.join(out, "report.md")).read()
    for k in (3, 5):  # row "| k | k̄ = n·k |", its file, and its held-out measurement
        assert f"| {k} | {16 * k} |" in report and f"patterns/per_query_k{k}.safetensors" in report
        assert f"**Budget k = {k}**" in report
    section = json.load(open(os.path.join(out, "results.json")))["derive_per_query"]
    assert [p["k"] for p in section["patterns"]] == [3, 5]
    assert [m["k"] for m in section["heldout"]["methods"]] == [3, 5]
    os.remove(os.path.join(out, "patterns", "per_query_k3.safetensors"))  # a deleted file leaves the report
    assert cli.main(["derive", out, "--k", "5", "--no-evaluate", "--no-progress"]) == 0
    section = json.load(open(os.path.join(out, "results.json")))["derive_per_query"]
    assert [p["k"] for p in section["patterns"]] == [5]


def test_derive_objective(tiny_run):
    import torch

    from hf_partial_attention.analysis import ScoreCovariance, select_pattern

    assert cli.main(["derive", tiny_run, "--k", "4", "--objective", "fisher", "--no-evaluate", "--no-progress"]) == 0
    saved = AttentionPattern.load(os.path.join(tiny_run, "patterns", "per_query_fisher_k4.safetensors"))
    cov = ScoreCovariance.load(os.path.join(tiny_run, "covariance.safetensors"))
    assert saved.metadata["objective"] == "fisher"
    assert torch.equal(saved.indices, select_pattern(cov, 4, objective="fisher").indices)
    assert not torch.equal(saved.indices, select_pattern(cov, 4).indices)  # the objective changed P here


@pytest.mark.slow
def test_analyze_derive_convert_without_matplotlib(tiny_bert_dir, tmp_path):
    """matplotlib is the [analysis] extra: without it the commands write every number and say once which extra
    brings the figures."""
    import subprocess
    import sys

    text = tmp_path / "text.txt"
    text.write_text("\n\n".join(default_texts()[:6]), encoding="utf-8")
    out, ckpt = str(tmp_path / "run"), str(tmp_path / "ckpt")
    script = (  # matplotlib made unimportable, as in an environment without it
        "import sys; sys.modules['matplotlib'] = None\n"
        "from hf_partial_attention import cli\n"
        f"assert cli.main(['analyze', '--model', {tiny_bert_dir!r}, '--text-file', {str(text)!r}, '--seq-len', '16',"
        f" '--max-sequences', '10', '--heldout-every', '0', '--out', {out!r}, '--no-progress']) == 0\n"
        f"assert cli.main(['derive', {out!r}, '--k', '5', '--no-progress']) == 0\n"
        f"assert cli.main(['convert', {os.path.join(out, 'patterns', 'per_query_k5.safetensors')!r}, '--out', "
        f"{ckpt!r}]) == 0\n"
        "assert 'matplotlib' not in sys.modules or sys.modules['matplotlib'] is None\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.count("figures skipped: matplotlib is not installed (pip install "
                             "'hf-partial-attention[analysis]'") == 1
    assert os.path.isfile(os.path.join(ckpt, "model.safetensors"))
    assert not os.path.exists(os.path.join(out, "figures")) or not os.listdir(os.path.join(out, "figures"))
    assert "![" not in open(os.path.join(out, "report.md"), encoding="utf-8").read()
