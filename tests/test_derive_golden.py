"""`derive` writes what it wrote when it was five functions (issue 43: one pipeline, the same files): every
combination of groups (pooled, per layer, per head), inputs (fixed windows, length buckets) and k allocation (one k,
a k per bucket, a budget over layers, exact layers), with families, objectives and the whole scope, run through the
command line on a tiny BERT against `tests/data/golden/derive` (written by `make_derive_golden.py` at c1cdbf3): the
same printed lines, the same pattern files with the same P (exactly), R and metadata, the same results.json."""

import importlib.util
import json
import math
import os

import pytest
import torch

GOLDEN = os.path.join(os.path.dirname(__file__), "data", "golden", "derive")


def _maker():
    spec = importlib.util.spec_from_file_location(
        "make_derive_golden", os.path.join(os.path.dirname(GOLDEN), "make_derive_golden.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def derived(tmp_path_factory, minilm_path):
    maker = _maker()
    root = str(tmp_path_factory.mktemp("derive_golden"))
    maker.build_folders(root, minilm_path)
    return maker.run_commands(root), maker.read_outputs(root), maker.read_outputs(GOLDEN), os.path.join(root, "windows")


def _close(a, b, where: str) -> None:
    """JSON values equal, floats within 1e-9 relative (the same sums in another order)."""
    if isinstance(a, float) or isinstance(b, float):
        assert isinstance(a, (int, float)) and isinstance(b, (int, float)), where
        assert math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12) or (math.isnan(a) and math.isnan(b)), \
            f"{where}: {a} != {b}"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a) == sorted(b), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for key in a:
            _close(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), f"{where}: {a} != {b}"
        for i, (x, y) in enumerate(zip(a, b)):
            _close(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def test_every_derive_prints_what_it_printed(derived):
    printed = derived[0]
    with open(os.path.join(GOLDEN, "printed.txt")) as f:
        assert printed == f.read().splitlines()


def test_every_derive_writes_the_same_files_and_results(derived):
    _, now, golden, _ = derived
    assert sorted(now) == sorted(golden)
    for path, value in golden.items():
        if path.endswith("results.json"):
            _close(json.loads(json.dumps(now[path])), value, path)
            continue
        tensors, meta = value
        new_tensors, new_meta = now[path]
        assert sorted(new_tensors) == sorted(tensors), path
        for key, t in tensors.items():
            if t.is_floating_point():
                torch.testing.assert_close(new_tensors[key], t, rtol=1e-9, atol=1e-12, msg=f"{path}: {key}")
            else:
                assert torch.equal(new_tensors[key], t), f"{path}: {key}"
        _close(new_meta, meta, f"{path} metadata")


def test_the_python_request_of_the_usage_page_runs_as_printed(derived, tmp_path, monkeypatch, capsys):
    """docs/usage.md's `DeriveRequest` snippet on a copy of the per-head windows folder (k3 for k16: n = 8 here): it
    prints the budgeted file, which holds every layer's P and R per head at the ks it reports."""
    import re
    import shutil

    from hf_partial_attention.pattern_layers import LayerPatterns

    root = os.path.dirname(GOLDEN)
    usage = open(os.path.join(root, "..", "..", "..", "docs", "usage.md"), encoding="utf-8").read()
    snippet = re.search(r"```python\n(from hf_partial_attention.analysis.derive import .*?)```", usage, re.S).group(1)
    folder = tmp_path / "runs" / "h"
    shutil.copytree(derived[3], folder)
    monkeypatch.chdir(tmp_path)
    exec(compile(snippet.replace('"k16"', '"k3"'), "usage.md", "exec"), {})
    source, path, ks = capsys.readouterr().out.split(" ", 2)
    assert source == "windows" and path == "runs/h/patterns/per_query_fisher_head_savingk3_budget.safetensors"
    layers = LayerPatterns.load(path)
    assert layers.metadata["granularity"] == "head" and layers.metadata["objective"] == "fisher"
    by_layer = json.loads(ks.strip().replace("'", '"'))[0]
    assert {int(layer) for layer in by_layer} == {0, 1}  # the budget layers: all but the last
    for layer, k in by_layer.items():
        assert layers.group(int(layer), 1).lengths_k == [k]  # head 1 of that layer at its k
