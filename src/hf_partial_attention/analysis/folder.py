"""The files of an analysis folder that every step reads or writes: their names, and ``results.json`` (every number
of the report) with ``report.md`` rendered from it after each step."""

from __future__ import annotations

import json
import os

from .report import write_report

__all__ = ["COVARIANCE_FILE", "HELDOUT_FILE", "RESULTS_FILE", "load_results", "update_results"]

COVARIANCE_FILE = "covariance.safetensors"
HELDOUT_FILE = "heldout_windows.safetensors"
RESULTS_FILE = "results.json"


def load_results(out: str) -> dict:
    """``out/results.json`` (empty when there is none yet)."""
    path = os.path.join(out, RESULTS_FILE)
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def update_results(out: str, section: str, data: dict) -> dict:
    """Store ``data`` under ``section`` in ``results.json`` and re-render ``report.md``."""
    os.makedirs(out, exist_ok=True)
    results = load_results(out)
    results[section] = data
    with open(os.path.join(out, RESULTS_FILE), "w") as f:
        json.dump(results, f, indent=1)
    write_report(results, os.path.join(out, "report.md"))
    return results
