"""`convert` as a new user meets it: the card states where P and R came from and that the checkpoint is converted,
not retrained; base_model is a Hub id or left out; the card's snippets run as printed, with and without the
plugin; patterns that cannot work are refused naming the fix, and ones that cannot pay are warned about."""

import json
import logging
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from huggingface_hub import ModelCard

from hf_partial_attention import AttentionPattern
from hf_partial_attention.analysis.collect import hub_id
from hf_partial_attention.analysis.corpus import default_texts
from hf_partial_attention.analysis.covariance import ScoreCovariance
from hf_partial_attention.analysis.workflow import analyze, convert, derive
from hf_partial_attention.model_card import validate_card_metadata

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# all-MiniLM-L6-v2's own card loads it as SentenceTransformer('sentence-transformers/all-MiniLM-L6-v2'), while its
# config.json names the model it was trained from
MINILM_ID = "sentence-transformers/all-MiniLM-L6-v2"
COMMAND = "hf-partial-attention convert runs/demo/patterns/per_query_k4.safetensors --out ckpt"
PLACEHOLDER = "path/to/this/folder"
PROMPT = "Do you wish to run the custom code"  # transformers' question when trust_remote_code is not given


@pytest.fixture(scope="module")
def derived(tiny_bert_dir, tmp_path_factory):
    """analyze (12 fit windows, 4 held-out windows, n = 16) and derive k = 4 on the tiny BERT folder."""
    out = str(tmp_path_factory.mktemp("provenance"))
    analyze(tiny_bert_dir, default_texts()[:15], out, seq_len=16, max_sequences=12, heldout_sequences=4,
            progress=False)
    derive(out, [4], "per_query", baselines=False, progress=False)
    return out, os.path.join(out, "patterns", "per_query_k4.safetensors")


@pytest.fixture(scope="module")
def minilm_converted(minilm_path, tmp_path_factory):
    """The real MiniLM (a sentence-transformers folder) converted at k = 16 with the default pattern."""
    tmp = tmp_path_factory.mktemp("minilm")
    pattern = AttentionPattern.local(128, 16)
    pattern.metadata["source_model"] = minilm_path
    pattern.save(tmp / "p.safetensors")
    convert(str(tmp / "p.safetensors"), str(tmp / "ckpt"), reconstruction="fixed", verify=False)
    return tmp / "ckpt"


def _tiny_pattern(tmp_path, tiny_bert_dir, pattern, name="p"):
    pattern.metadata["source_model"] = tiny_bert_dir
    path = tmp_path / f"{name}.safetensors"
    pattern.save(path)
    return str(path)


def test_hub_id_of_a_model_source(tmp_path, minilm_path, tiny_bert_dir):
    assert hub_id("google-bert/bert-base-uncased") == "google-bert/bert-base-uncased"  # not a path: a Hub id
    assert hub_id(minilm_path) == MINILM_ID  # its card's id, not config.json's nreimers/MiniLM-L6-H384-uncased
    assert hub_id(tiny_bert_dir) is None  # transformers 5 records no _name_or_path: the folder's name is no id
    for recorded, expect in (("google-bert/bert-base-uncased", "google-bert/bert-base-uncased"),
                             ("/home/someone/models/bert", None)):
        folder = tmp_path / f"old_{expect is None}"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"_name_or_path": recorded, "model_type": "bert"}))
        assert hub_id(str(folder)) == expect
    snapshot = tmp_path / "hub" / "models--me--tiny-bert" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    assert hub_id(str(snapshot)) == "me/tiny-bert"


def test_analyze_of_a_local_folder_records_no_folder_name_as_model_id(derived):
    out, path = derived
    assert ScoreCovariance.load(os.path.join(out, "covariance.safetensors")).metadata["model_id"] == ""
    assert AttentionPattern.load(path).metadata["source_model_id"] == ""


def test_convert_card_states_where_the_pattern_came_from(derived, tiny_bert_dir, tmp_path):
    _, path = derived
    pattern = AttentionPattern.load(path)
    result = convert(path, str(tmp_path / "ckpt"), command=COMMAND, verify=False)
    card = ModelCard.load(tmp_path / "ckpt" / "README.md")
    validate_card_metadata(card)
    text = card.text
    # the numbers come from the pattern file and from analyze's arguments (12 fit windows, 4 held out, n = 16)
    assert f"| predicted from the covariance | {pattern.metadata['normalized_error']:.4f} |" in text
    assert f"| held-out, measured by `derive` on 4 held-out windows | " \
           f"{pattern.metadata['heldout_normalized_error']:.4f} |" in text
    assert "greedy P, R at its optimum (eq. 7 of the paper) for the covariance" in text
    assert "over 12 windows of n = 16 tokens" in text and "`per_query_k4.safetensors`" in text
    assert COMMAND in text
    assert "**converted, not retrained.**" in text and "performs poorly" in text
    assert "not recorded" not in text.lower()
    # a local folder that records no Hub id: no base_model, and the body says so
    assert card.data.base_model is None and "no Hub id is recorded for the source" in text
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert config["partial_base_model"] is None and result["base_model"] is None
    assert config["partial_conversion"]["command"] == COMMAND
    assert text.lstrip().startswith(f"# {os.path.basename(tiny_bert_dir)} with partial attention (k = 4)\n")


def test_heldout_error_not_measured_is_said(tiny_bert_dir, tmp_path):
    pattern = AttentionPattern.local(16, 4)
    pattern.metadata.update(normalized_error=0.125, num_sequences=7, covariance="centered", method="greedy")
    convert(_tiny_pattern(tmp_path, tiny_bert_dir, pattern), str(tmp_path / "ckpt"), verify=False)
    text = (tmp_path / "ckpt" / "README.md").read_text()
    assert "| predicted from the covariance | 0.1250 |" in text
    assert "| held-out, measured by `derive` | not measured |" in text and "The held-out error was not measured" in text
    assert "no command line recorded" in text


def test_pattern_files_of_earlier_versions_name_no_folder_as_base(tiny_bert_dir, tmp_path):
    pattern = AttentionPattern.local(16, 4)
    pattern.metadata["source_model_id"] = os.path.basename(tiny_bert_dir)  # what analyze recorded before
    convert(_tiny_pattern(tmp_path, tiny_bert_dir, pattern), str(tmp_path / "ckpt"), verify=False)
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["partial_base_model"] is None
    assert ModelCard.load(tmp_path / "ckpt" / "README.md").data.base_model is None


def test_sentence_transformers_conversion_card(minilm_converted):
    card = ModelCard.load(minilm_converted / "README.md")
    validate_card_metadata(card)
    meta = card.data.to_dict()
    assert meta["base_model"] == MINILM_ID
    assert json.loads((minilm_converted / "config.json").read_text())["partial_base_model"] == MINILM_ID
    assert meta["library_name"] == "sentence-transformers" and meta["pipeline_tag"] == "sentence-similarity"
    assert {"sentence-transformers", "sentence-similarity", "partial-attention", "custom_code"} <= set(meta["tags"])
    assert card.text.lstrip().startswith("# all-MiniLM-L6-v2 with partial attention (k = 16)\n")
    assert "SentenceTransformer(" in card.text


def test_a_trainers_card_no_longer_says_not_retrained(derived, tmp_path):
    from transformers import AutoModel, TrainingArguments

    from hf_partial_attention.training import PartialAttentionTrainer

    _, path = derived
    convert(path, str(tmp_path / "ckpt"), command=COMMAND, verify=False)
    model = AutoModel.from_pretrained(tmp_path / "ckpt")
    args = TrainingArguments(output_dir=str(tmp_path / "run"), report_to=[], use_cpu=True)
    PartialAttentionTrainer(model=model, args=args).create_model_card()
    text = (tmp_path / "run" / "README.md").read_text()
    assert "Trained with `hf_partial_attention.training.PartialAttentionTrainer`" in text
    assert "not retrained" not in text and "converted without retraining" not in text
    assert COMMAND in text and "`per_query_k4.safetensors`" in text  # the provenance stays, from config.json


# ---------------------------------------------------------------------------------------------- refusals, warnings
def test_convert_refuses_patterns_that_cannot_work(tiny_bert_dir, tmp_path):
    n = 16
    whole = AttentionPattern(torch.arange(8), torch.zeros(n * n - 8, 8), scope="whole", seq_len=n)
    with pytest.raises(ValueError, match=r"whole-matrix patterns are for analysis; convert a per-query pattern "
                                         r"\(patterns/per_query_k\*\.safetensors\)"):
        convert(_tiny_pattern(tmp_path, tiny_bert_dir, whole, "whole"), str(tmp_path / "a"), verify=False)
    junk = tmp_path / "junk.safetensors"
    junk.write_text("no tensors here")
    with pytest.raises(ValueError, match=re.escape(repr(str(junk))) + " is not a pattern file.*attention derive"):
        convert(str(junk), str(tmp_path / "b"))
    with pytest.raises(FileNotFoundError, match="No pattern file at"):
        convert(str(tmp_path / "missing.safetensors"), str(tmp_path / "c"))
    long = AttentionPattern.local(128, 4)  # the tiny BERT has 64 positions
    with pytest.raises(ValueError, match=r"n = 128 positions.*max_position_embeddings = 64.*--seq-len 64"):
        convert(_tiny_pattern(tmp_path, tiny_bert_dir, long, "long"), str(tmp_path / "d"), verify=False)
    assert not any((tmp_path / d).exists() for d in "abcd")  # refused before anything is written


def test_convert_warns_when_k_saves_nothing(tiny_bert_dir, tmp_path, caplog):
    # tiny BERT: d_h = 32 / 4 = 8; k = 8 at n = 16: 8·8 + 8·8 = 128 = 16·8 multiply-adds, no saving
    path = _tiny_pattern(tmp_path, tiny_bert_dir, AttentionPattern.local(16, 8))
    with caplog.at_level(logging.WARNING):
        result = convert(path, str(tmp_path / "ckpt"), verify=False)
    assert any("saves no attention work at n=16, d_h=8" in r.getMessage() for r in caplog.records)
    assert len(result["warnings"]) == 1


def test_convert_warns_when_the_pattern_comes_from_another_model(tiny_bert_dir, tmp_path, caplog):
    from transformers import BertConfig, BertModel

    other = tmp_path / "other_bert"
    BertModel(BertConfig(vocab_size=30522, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=37, max_position_embeddings=32)).save_pretrained(other)  # d_h = 12
    for name in os.listdir(tiny_bert_dir):
        if name.startswith(("tokenizer", "vocab", "special")):
            shutil.copy(os.path.join(tiny_bert_dir, name), other / name)
    path = _tiny_pattern(tmp_path, tiny_bert_dir, AttentionPattern.local(16, 4))
    with caplog.at_level(logging.WARNING):
        convert(path, str(tmp_path / "ckpt"), str(other), verify=False)
    messages = " | ".join(r.getMessage() for r in caplog.records)
    source = os.path.basename(tiny_bert_dir)
    assert f"was derived on {source}, not on other_bert" in messages
    assert f"derived on {source} (d_h = 8) and is converted into other_bert (d_h = 12)" in messages
    assert f"derived on {source} (max_position_embeddings = 64) and is converted into other_bert " \
           "(max_position_embeddings = 32)" in messages
    text = (tmp_path / "ckpt" / "README.md").read_text()
    assert f"derived on `{source}` and installed in `other_bert`, another model" in text
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # the model it was derived on: nothing to say
        convert(path, str(tmp_path / "same"), tiny_bert_dir, verify=False)
    assert not [r for r in caplog.records if "derived on" in r.getMessage()]


# ------------------------------------------------------------------------------------------- snippets as printed
WITHOUT_PLUGIN = textwrap.dedent("""
    import json, sys
    sys.modules["hf_partial_attention"] = None  # a user without the plugin: importing it fails
    for folder, code in json.loads(sys.argv[1]):
        exec(compile(code, folder + "/README.md", "exec"), {})
        print("RAN", folder)
""")


def _snippets(folder) -> tuple[list[str], list[str]]:
    """The card's loading snippets for ``folder``: (with the plugin, without it), the placeholder filled in."""
    text = (folder / "README.md").read_text()
    section = text[text.index("## How to load"):text.index("## Citation")]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert blocks and all(PLACEHOLDER in block for block in blocks)
    blocks = [block.replace(PLACEHOLDER, str(folder)) for block in blocks]
    return ([b for b in blocks if "import hf_partial_attention" in b],
            [b for b in blocks if "import hf_partial_attention" not in b])


def _run_snippets(folders, tmp_path) -> None:
    jobs = []
    for folder in folders:
        with_plugin, without = _snippets(folder)
        assert len(with_plugin) == 1 and without
        exec(compile(with_plugin[0], str(folder / "README.md"), "exec"), {})  # the plugin is imported here
        jobs += [(str(folder), code) for code in without]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    proc = subprocess.run([sys.executable, "-c", WITHOUT_PLUGIN, json.dumps(jobs)], capture_output=True, text=True,
                          env=env, timeout=300, stdin=subprocess.DEVNULL)  # a prompt reads EOF and fails
    assert proc.returncode == 0 and PROMPT not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    assert proc.stdout.count("RAN ") == len(jobs)


@pytest.mark.slow
def test_card_snippets_run_as_printed_on_converted_folders(derived, minilm_converted, tmp_path):
    _, path = derived
    convert(path, str(tmp_path / "ckpt"), verify=False)
    _, without = _snippets(minilm_converted)
    assert any("SentenceTransformer(" in block for block in without)  # runs without the plugin too
    _run_snippets([tmp_path / "ckpt", minilm_converted], tmp_path)


@pytest.mark.slow
def test_usage_python_api_writes_a_folder_its_card_loads(tiny_bert_dir, tmp_path, monkeypatch):
    readme = open(os.path.join(ROOT, "docs", "usage.md"), encoding="utf-8").read()
    quick = re.search(r"## PartialBert and the paper\n\n[^`]*```python\n(.*?)```", readme, flags=re.S).group(1)
    assert quick.count('"bert-base-uncased"') >= 1 and 'save_pretrained("pbert")' in quick
    monkeypatch.chdir(tmp_path)
    os.makedirs("runs/demo/patterns")
    AttentionPattern.local(16, 4).save("runs/demo/patterns/per_query_k16.safetensors")  # n = 16 fits the tiny BERT
    exec(compile(quick.replace('"bert-base-uncased"', repr(tiny_bert_dir)), "usage.md", "exec"), {})
    _run_snippets([tmp_path / "pbert"], tmp_path)


@pytest.mark.slow
def test_readme_quickstart_runs_as_printed(minilm_path, tmp_path, monkeypatch, capsys):
    """The README's three commands and its sentence-transformers comparison, on the packaged MiniLM (the Hub id
    replaced by its local folder: tests are offline) and a text file of real prose."""
    import shlex

    from hf_partial_attention import cli
    from hf_partial_attention.analysis.corpus import default_texts

    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    section = readme.split("## Quickstart", 1)[1]
    commands = re.search(r"```bash\n(.*?)```", section, flags=re.S).group(1)
    python = re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)
    model_id = "sentence-transformers/all-MiniLM-L6-v2"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_text.txt").write_text("\n\n".join(default_texts()[:40]), encoding="utf-8")
    lines = [line.split("  #")[0] for line in commands.strip().splitlines()]
    assert len(lines) == 3 and all(line.startswith("hf-partial-attention ") for line in lines)
    for line in lines:
        argv = [minilm_path if word == model_id else word for word in shlex.split(line)[1:]]
        extra = ["--max-sequences", "64", "--heldout-sequences", "16", "--no-progress"] if argv[0] == "analyze" else []
        assert cli.main(argv + extra) == 0
    assert "a saving of 43.8 % of QKᵀ" in capsys.readouterr().out  # MiniLM: d_h = 32, k = 16, n = 128
    namespace = {}
    exec(compile(python.replace(repr(model_id).replace("'", '"'), repr(minilm_path)), "README.md", "exec"), namespace)
    cosines = namespace["torch"].nn.functional.cosine_similarity(namespace["a"], namespace["b"])
    assert cosines.shape == (3,) and bool((cosines > 0.5).all()) and bool((cosines < 0.99999).any())
