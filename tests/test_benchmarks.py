"""The benchmark suite runs end to end (tiny shapes) and its report checks the targets."""

import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def test_quick_benchmark_writes_tables_and_targets(tmp_path):
    sys.path.insert(0, str(BENCH))
    try:
        import run
    finally:
        sys.path.remove(str(BENCH))
    result = run.main(["--quick", "--repeats", "1", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["machine"]["torch"] and saved["model"] and saved["peers"]
    cases = {r["case"] for r in result["attention"]}
    assert {"dense_eager", "sdpa", "fused/per_query", "fused/columns", "fused/blocks", "gather/per_query"} <= cases
    text = (tmp_path / "results.md").read_text()
    assert "## Targets" in text and "whole model, training step" in text
    for r in result["attention"]:
        assert r["ratio"] > 0 and r["ms"] > 0
