"""Which kernel ``partial_implementation="auto"`` runs: a table of timings, refitted by one command.

Part of the remote-code bundle (imports: the standard library only).

The table below was written by ``python benchmarks/fit_auto.py --write`` (``make fit-auto``) on the machine it
names: for each cell — pattern structure, sequence length n, k / head size, inference or training — the kernel
whose ratios to eager attention, timed side by side under each allocator setting it names, had the smallest
geometric mean. At run time the cell of the same structure and mode nearest in (log n, k / d) decides. On
another machine, refit it (``make fit-auto`` rewrites this table in a source checkout), or write a JSON file
with ``python benchmarks/fit_auto.py --out rule.json`` and point the environment variable
``HF_PARTIAL_ATTENTION_AUTO_RULE`` at it.

Structures: ``"shared"`` (blocks of at least ``shared_min_rows`` rows share P and R: `tiled_kernel.shared_rows`),
``"keys_shared"`` (blocks of rows share P, each row its own R: `partial_scores.block_rows`), ``"per_query"``.
"""

from __future__ import annotations

import json
import logging
import math
import os

__all__ = ["RULE", "STRUCTURES", "MODES", "load_rule", "pattern_structure", "auto_implementation"]

logger = logging.getLogger(__name__)

STRUCTURES = ("shared", "keys_shared", "per_query")
MODES = ("inference", "training")
_ENV = "HF_PARTIAL_ATTENTION_AUTO_RULE"

# BEGIN FITTED RULE (written by benchmarks/fit_auto.py; edit by refitting, not by hand)
RULE = {
    "machine": "AMD EPYC, 2 cores, torch 2.13.0+cpu (2 threads)",
    "command": "python benchmarks/fit_auto.py --write",
    "allocators": ["default", "reuse"],
    "shared_min_rows": 16,
    "cells": [
        {"structure": "keys_shared", "n": 128, "k_over_d": 0.25, "mode": "inference", "kernel": "fused"},
        {"structure": "keys_shared", "n": 128, "k_over_d": 0.25, "mode": "training", "kernel": "fused"},
        {"structure": "keys_shared", "n": 128, "k_over_d": 0.5, "mode": "inference", "kernel": "fused"},
        {"structure": "keys_shared", "n": 128, "k_over_d": 0.5, "mode": "training", "kernel": "fused"},
        {"structure": "keys_shared", "n": 128, "k_over_d": 1.0, "mode": "inference", "kernel": "fused"},
        {"structure": "keys_shared", "n": 128, "k_over_d": 1.0, "mode": "training", "kernel": "fused"},
        {"structure": "keys_shared", "n": 512, "k_over_d": 0.25, "mode": "inference", "kernel": "fused"},
        {"structure": "keys_shared", "n": 512, "k_over_d": 0.25, "mode": "training", "kernel": "fused"},
        {"structure": "keys_shared", "n": 512, "k_over_d": 0.5, "mode": "inference", "kernel": "fused"},
        {"structure": "keys_shared", "n": 512, "k_over_d": 0.5, "mode": "training", "kernel": "fused"},
        {"structure": "keys_shared", "n": 512, "k_over_d": 1.0, "mode": "inference", "kernel": "fused"},
        {"structure": "keys_shared", "n": 512, "k_over_d": 1.0, "mode": "training", "kernel": "fused"},
        {"structure": "per_query", "n": 128, "k_over_d": 0.25, "mode": "inference", "kernel": "fused"},
        {"structure": "per_query", "n": 128, "k_over_d": 0.25, "mode": "training", "kernel": "fused"},
        {"structure": "per_query", "n": 128, "k_over_d": 0.5, "mode": "inference", "kernel": "fused"},
        {"structure": "per_query", "n": 128, "k_over_d": 0.5, "mode": "training", "kernel": "fused"},
        {"structure": "per_query", "n": 128, "k_over_d": 1.0, "mode": "inference", "kernel": "fused"},
        {"structure": "per_query", "n": 128, "k_over_d": 1.0, "mode": "training", "kernel": "fused"},
        {"structure": "per_query", "n": 512, "k_over_d": 0.25, "mode": "inference", "kernel": "fused"},
        {"structure": "per_query", "n": 512, "k_over_d": 0.25, "mode": "training", "kernel": "fused"},
        {"structure": "per_query", "n": 512, "k_over_d": 0.5, "mode": "inference", "kernel": "fused"},
        {"structure": "per_query", "n": 512, "k_over_d": 0.5, "mode": "training", "kernel": "fused"},
        {"structure": "per_query", "n": 512, "k_over_d": 1.0, "mode": "inference", "kernel": "fused"},
        {"structure": "per_query", "n": 512, "k_over_d": 1.0, "mode": "training", "kernel": "fused"},
        {"structure": "shared", "n": 128, "k_over_d": 0.25, "mode": "inference", "kernel": "fused"},
        {"structure": "shared", "n": 128, "k_over_d": 0.25, "mode": "training", "kernel": "fused"},
        {"structure": "shared", "n": 128, "k_over_d": 0.5, "mode": "inference", "kernel": "fused"},
        {"structure": "shared", "n": 128, "k_over_d": 0.5, "mode": "training", "kernel": "fused"},
        {"structure": "shared", "n": 128, "k_over_d": 1.0, "mode": "inference", "kernel": "fused"},
        {"structure": "shared", "n": 128, "k_over_d": 1.0, "mode": "training", "kernel": "fused"},
        {"structure": "shared", "n": 512, "k_over_d": 0.25, "mode": "inference", "kernel": "tiled"},
        {"structure": "shared", "n": 512, "k_over_d": 0.25, "mode": "training", "kernel": "fused"},
        {"structure": "shared", "n": 512, "k_over_d": 0.5, "mode": "inference", "kernel": "tiled"},
        {"structure": "shared", "n": 512, "k_over_d": 0.5, "mode": "training", "kernel": "fused"},
        {"structure": "shared", "n": 512, "k_over_d": 1.0, "mode": "inference", "kernel": "tiled"},
        {"structure": "shared", "n": 512, "k_over_d": 1.0, "mode": "training", "kernel": "fused"},
    ],
}
# END FITTED RULE

_loaded: dict | None = None


def _check(rule: dict, source: str) -> dict:
    cells = rule.get("cells") if isinstance(rule, dict) else None
    if not cells:
        raise ValueError(f"{source}: an auto rule needs a non-empty 'cells' list (write one with "
                         "python benchmarks/fit_auto.py --out rule.json).")
    for cell in cells:
        if cell.get("structure") not in STRUCTURES or cell.get("mode") not in MODES or "kernel" not in cell:
            raise ValueError(f"{source}: bad cell {cell!r}; each needs structure in {STRUCTURES}, mode in {MODES}, "
                             "n, k_over_d and kernel.")
    return rule


def load_rule() -> dict:
    """The rule in use: the JSON file named by ``HF_PARTIAL_ATTENTION_AUTO_RULE`` if set, else `RULE`."""
    global _loaded
    path = os.environ.get(_ENV)
    if _loaded is None or _loaded.get("_path") != path:
        if path:
            with open(path) as f:
                rule = _check(json.load(f), f"{_ENV}={path}")
            logger.info("partial_implementation='auto' uses the rule fitted on %s (%s)", rule.get("machine"), path)
        else:
            rule = _check(RULE, "auto_rule.RULE")
        _loaded = {**rule, "_path": path}
    return _loaded


def pattern_structure(block_rows: int | None, shared: int, shared_min_rows: int) -> str:
    """The structure class of a pattern (see the module docstring)."""
    if shared >= shared_min_rows:
        return "shared"
    return "keys_shared" if block_rows is not None else "per_query"


def auto_implementation(n: int, k: int, head_dim: int, block_rows: int | None, shared: int,
                        mode: str = "inference", rule: dict | None = None) -> str:
    """The kernel of the fitted cell nearest to (n, k / head_dim) with this pattern's structure and ``mode``
    (``"inference"`` or ``"training"``); cells of the other mode stand in where the table has none."""
    rule = load_rule() if rule is None else rule
    structure = pattern_structure(block_rows, shared, int(rule.get("shared_min_rows", 16)))
    cells = [c for c in rule["cells"] if c["structure"] == structure]
    if not cells:
        return "tiled" if structure == "shared" else "fused" if k < head_dim else "dense"
    same_mode = [c for c in cells if c["mode"] == mode] or cells

    def distance(cell):
        return abs(math.log2(cell["n"] / n)) + 4 * abs(cell["k_over_d"] - k / head_dim)

    return min(same_mode, key=distance)["kernel"]
