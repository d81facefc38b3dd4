"""Refit the rule of ``partial_implementation="auto"`` on this machine: `make fit-auto`.

Times every kernel that runs in PyTorch (dense, fused, tiled) on each pattern structure — ``shared`` (blocks
of 32 rows share P and R), ``keys_shared`` (blocks share P, each row its own R), ``per_query`` — at n = 128
(B = 32) and n = 512 (B = 8), H = 12, d = 64, k / d ∈ {0.25, 0.5, 1}, forward without autograd (inference) and
forward + backward (training), side by side (`run.attention_rows`), under glibc's default malloc and with freed
blocks reused (each in a child process, `run.ALLOCATORS`); in each cell the kernel with the smallest geometric mean
of its two ratios to eager becomes the rule (about 6 min on 2 cores).

    python benchmarks/fit_auto.py --write              # rewrite the table in src/hf_partial_attention/auto_rule.py
    python benchmarks/fit_auto.py --out rule.json      # or a JSON file: HF_PARTIAL_ATTENTION_AUTO_RULE=rule.json
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import ALLOCATORS, KERNELS, attention_rows, machine  # noqa: E402
from timing import command_line  # noqa: E402

RULE_FILE = Path(__file__).resolve().parents[1] / "src" / "hf_partial_attention" / "auto_rule.py"
STRUCTURE_OF = {"shared": "shared", "blocks": "keys_shared", "per_query": "per_query"}
GRID = [dict(b=32, h=12, n=128, d=64, ks=[16, 32, 64]), dict(b=8, h=12, n=512, d=64, ks=[16, 32, 64])]
QUICK = [dict(b=2, h=2, n=16, d=8, ks=[2, 4, 8])]


def fit(rows: list[dict]) -> list[dict]:
    """One cell per (structure, n, k / d, mode): the kernel whose ratios to eager over the allocators timed (rows'
    ``"allocator"``; one if absent) have the smallest geometric mean. Both allocators count, because the fastest
    kernel under one can be the slowest under the other (tiled with autograd at n = 512, k = 32: 0.95x of eager
    under glibc's defaults, 2.08x with freed blocks reused, in the results of 2026-12-01 before this fit); a
    geometric mean, so that a large gain under one is not given up for a small one under the other (tiled
    inference there: 0.45x and 0.80x, fused 0.75x and 0.74x: the worst case would pick fused)."""
    logs: dict[tuple, dict[str, list[float]]] = {}
    for r in rows:
        if r["pattern"] not in STRUCTURE_OF or r["implementation"] not in KERNELS:
            continue
        mode = "training" if r["mode"] != "forward" else "inference"
        key = (STRUCTURE_OF[r["pattern"]], r["n"], r["k"] / r["d"], mode)
        logs.setdefault(key, {}).setdefault(r["implementation"], []).append(math.log(r["ratio"]))
    cells = []
    for (s, n, kd, mode), kernels in sorted(logs.items()):
        mean = {kernel: sum(values) / len(values) for kernel, values in kernels.items()}
        kernel = min(mean, key=mean.get)
        cells.append({"structure": s, "n": n, "k_over_d": kd, "mode": mode, "kernel": kernel,
                      "ratio_to_eager": round(math.exp(mean[kernel]), 3)})
    return cells


def timed_rows(shapes: list[dict], repeats: int, allocator: str) -> list[dict]:
    """`run.attention_rows` of the fitted structures in a child process under ``allocator`` (`run.ALLOCATORS`:
    malloc reads its settings at start), each row marked with it."""
    env = {key: value for key, value in os.environ.items() if key not in ALLOCATORS["reuse"]}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rows.json"
        subprocess.run([sys.executable, str(Path(__file__).resolve()), "--rows-out", str(path), "--repeats",
                        str(repeats), "--shapes", json.dumps(shapes)], env={**env, **ALLOCATORS[allocator]}, check=True)
        return [{**r, "allocator": allocator} for r in json.loads(path.read_text())]


def write_rule(rule: dict, path: Path = RULE_FILE) -> None:
    """Replace the table between the FITTED RULE markers of auto_rule.py."""
    text = path.read_text()
    head = {key: value for key, value in rule.items() if key != "cells"}
    # the table keeps what decides; each cell's ratio to eager stays in the JSON (--out) and the printout
    cells = "".join(f"        {json.dumps({k: v for k, v in cell.items() if k != 'ratio_to_eager'})},\n"
                    for cell in rule["cells"])
    block = ("RULE = {\n" + "".join(f"    {json.dumps(key)}: {json.dumps(value)},\n" for key, value in head.items())
             + '    "cells": [\n' + cells + "    ],\n}\n")
    new, count = re.subn(r"(# BEGIN FITTED RULE[^\n]*\n).*?(# END FITTED RULE)",
                         lambda m: m.group(1) + block + m.group(2), text, flags=re.S)
    if count != 1:
        raise ValueError(f"{path} has no '# BEGIN FITTED RULE' ... '# END FITTED RULE' block to replace.")
    path.write_text(new)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="rewrite the table in auto_rule.py")
    parser.add_argument("--out", default=None, help="write the rule as JSON here")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="tiny shapes (tests)")
    parser.add_argument("--rule-file", default=str(RULE_FILE), help=argparse.SUPPRESS)
    parser.add_argument("--allocators", default="default,reuse",
                        help="glibc malloc settings to time under (run.ALLOCATORS), comma-separated")
    parser.add_argument("--rows-out", default=None, help=argparse.SUPPRESS)  # internal: one allocator's rows
    parser.add_argument("--shapes", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.rows_out:  # the child of `timed_rows`
        rows = []
        for shape in json.loads(args.shapes):
            rows += [r for r in attention_rows(shape, args.repeats, skip_gather_over=0) if r["pattern"] in STRUCTURE_OF]
        Path(args.rows_out).write_text(json.dumps(rows))
        return {}
    allocators = [a for a in args.allocators.split(",") if a]
    unknown = [a for a in allocators if a not in ALLOCATORS]
    if unknown or not allocators:
        raise ValueError(f"--allocators must name some of {tuple(ALLOCATORS)}, got {args.allocators!r}.")
    rows = [r for a in allocators for r in timed_rows(QUICK if args.quick else GRID, args.repeats, a)]
    m = machine()
    rule = {"machine": f"{m['cpu']}, {m['cores']} cores, torch {m['torch']} ({m['torch_threads']} threads)",
            "command": command_line("fit_auto.py", argv if argv is not None else sys.argv[1:]),
            "allocators": allocators, "shared_min_rows": 16, "cells": fit(rows)}
    if args.write:
        write_rule(rule, Path(args.rule_file))
    if args.out:
        Path(args.out).write_text(json.dumps(rule, indent=1))
    sys.stdout.write(json.dumps(rule, indent=1) + "\n")
    return rule


if __name__ == "__main__":
    main()
