"""Speed vs accuracy: reconstruction error of the fast pattern families beside the per-query greedy.

Uses an analysis folder written by `hf-partial-attention analyze` (or `make demo`: runs/demo), i.e. the
per-query covariance of a real model's pre-softmax scores and held-out token windows of other documents:

    python benchmarks/families.py runs/demo --ks 16 24 32 --out benchmarks/results

Every family is fitted on the same covariance (P from the constrained greedy, R optimal for that P) and
measured on the same held-out scores. Writes families.json and families.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from safetensors.torch import load_file

from hf_partial_attention.analysis.collect import display_name, load_model_and_tokenizer, run_windows
from hf_partial_attention.analysis.covariance import ScoreCovariance
from hf_partial_attention.analysis.evaluation import ErrorMeter, LinearReconstructor
from hf_partial_attention.analysis.selection import FAMILIES, select_pattern
from hf_partial_attention.analysis.workflow import COVARIANCE_FILE, HELDOUT_FILE

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import command_line  # noqa: E402

KERNEL = {"per_query": "QKᵀ then select (every row its own keys)", "columns": "one GEMM (keys shared by all rows)",
          "blocks": "one GEMM per block of 32 rows", "windows": "one GEMM per block (block-local windows)",
          "bands": "QKᵀ then select (no band kernel yet)",
          "shared_blocks": "tiled: one GEMM per block for exact scores and for R (block shares P and R)"}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("analysis_dir", help="folder with covariance.safetensors and heldout_windows.safetensors")
    parser.add_argument("--ks", type=int, nargs="+", default=[16, 24, 32])
    parser.add_argument("--families", nargs="+",
                        default=["per_query", "blocks", "windows", "columns", "bands", "shared_blocks"],
                        choices=FAMILIES)
    parser.add_argument("--shared-block-rows", type=int, nargs="+", default=[32, 16],
                        help="rows per block sharing P and R, for family shared_blocks (one row each)")
    parser.add_argument("--max-heldout", type=int, default=None, help="use at most this many held-out windows")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    folder = Path(args.analysis_dir)
    cov = ScoreCovariance.load(folder / COVARIANCE_FILE)
    n = cov.seq_len
    patterns, rows = {}, []
    for k in args.ks:
        for family in args.families:
            if family == "windows" and n % k:
                continue  # block-local windows of k rows need k | n
            if family == "shared_blocks":
                for block in args.shared_block_rows:
                    patterns[(f"shared_blocks_{block}", k)] = select_pattern(cov, k, "per_query", family=family,
                                                                            block_rows=block)
                continue
            patterns[(family, k)] = select_pattern(cov, k, "per_query", family=family)
    windows = load_file(str(folder / HELDOUT_FILE))["input_ids"]
    if args.max_heldout:
        windows = windows[: args.max_heldout]
    model, _ = load_model_and_tokenizer(cov.metadata["model"], load_tokenizer=False)
    meter = ErrorMeter({key: LinearReconstructor(p) for key, p in patterns.items()})
    run_windows(model, windows, meter.sink, desc="held-out")
    measured = meter.results()
    for (family, k), p in patterns.items():
        kernel = KERNEL[family.rstrip("_0123456789")]  # shared_blocks_32 -> shared_blocks
        rows.append({"family": family, "k": k, "exact kernel": kernel, "predicted": p.normalized_error,
                     "heldout": measured[(family, k)]["normalized_error"],
                     "heldout_shift": measured[(family, k)]["normalized_error_shift"]})
    result = {"command": command_line("families.py", argv if argv is not None else sys.argv[1:]),
              "model": cov.metadata.get("model_id") or display_name(cov.metadata.get("model", "")), "seq_len": n,
              "fit_windows": cov.num_sequences,
              "heldout_windows": int(windows.shape[0]), "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "families.json").write_text(json.dumps(result, indent=1))
    lines = ["# Pattern families: reconstruction error on real scores", "",
             f"Command: `{result['command']}`  ",
             f"Model: `{result['model']}`, n = {n}; "
             f"fitted on {result['fit_windows']} windows, measured on {result['heldout_windows']} held-out windows of "
             "other documents. Normalised error = MSE / Tr of the held-out covariance; 'mod shift' ignores a per-row "
             "constant (softmax does).", "",
             "| k | family | exact part computed by | predicted | held-out | held-out mod shift |",
             "|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["k"], r["heldout"])):
        lines.append(f"| {r['k']} | {r['family']} | {r['exact kernel']} | {r['predicted']:.4f} | {r['heldout']:.4f} | "
                     f"{r['heldout_shift']:.4f} |")
    text = "\n".join(lines) + "\n"
    (out / "families.md").write_text(text)
    sys.stdout.write(text)
    return result


if __name__ == "__main__":
    main()
