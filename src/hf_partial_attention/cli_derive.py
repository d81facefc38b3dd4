"""``hf-partial-attention derive``: its options and its runners (pooled, per layer or head, length buckets, a QKᵀ
budget). Registered by `cli` (which adds the options every command takes)."""

from __future__ import annotations

import argparse
import os

__all__ = ["derive_arguments", "run_derive", "parse_bucket_k"]


def parse_bucket_k(text: str) -> tuple[int, int]:
    """``"64=24"`` -> ``(64, 24)`` (argparse names the value when this raises)."""
    try:
        b, k = (int(v) for v in text.split("="))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not B=K (a bucket length and its k, e.g. 64=24)") from None
    return b, k


def derive_arguments(p):
    from .analysis.selection import FAMILIES, OBJECTIVES

    p.add_argument("dir", help="folder written by `analyze`")
    p.add_argument("--k", type=int, nargs="+", default=[16, 24, 32, 48],
                   help="exact scores per query (whole scope: in all), each in [1, n]; saves work only for k < d_h")
    p.add_argument("--scope", default="per_query", choices=["per_query", "whole"],
                   help="per-query P_i (what the model runs) or one P over the n² pairs (analysis)")
    p.add_argument("--family", default="per_query", choices=FAMILIES,
                   help="constrain per-query P to a family whose exact part is one dense GEMM (columns, blocks, "
                        "windows), shared diagonals (bands), or blocks of 32 rows sharing P and R (shared_blocks: "
                        "the tiled kernel); see hf_partial_attention.analysis.selection")
    p.add_argument("--objective", default="paper", choices=OBJECTIVES,
                   help="error the greedy minimises: paper (eq. 8, every score alike), shift "
                        "(modulo a per-row constant) or fisher (weighted by the attention probabilities). "
                        "On a converted MiniLM fisher came closest at the model's output although its score error "
                        "is higher (the project's objectives study); compare them on your model by converting each. "
                        "Files of another objective than paper are named <scope>_<objective>_k<k>")
    p.add_argument("--bucket-k", nargs="+", default=None, metavar="B=K", type=parse_bucket_k,
                   help="length buckets: a bucket that takes its own k instead of --k, e.g. 64=24 (partial_lengths_k; "
                        "files buckets_k<k>_b<b>k<k_b>)")
    p.add_argument("--granularity", default="pooled", choices=["pooled", "layer", "head"],
                   help="one P and R for every layer (the paper's), each layer its own or each head of each layer "
                        "its own, fitted on its own covariance (needs analyze --granularity layer / head; files "
                        "<scope>_layer_k<k> / <scope>_head_k<k>; convert installs them)")
    p.add_argument("--saving", default=None, metavar="S",
                   help="instead of one --k: a k per layer that saves at least S of the partial layers' QKᵀ "
                        "multiply-adds in every length bucket (a fraction, e.g. 0.4, or k16: k = 16's saving), spent "
                        "where the greedy's error falls most (needs --granularity layer or head); also writes the "
                        "uniform k at the same saving (files <scope>_..._saving<S>_budget / _uniform)")
    p.add_argument("--budget-layers", type=int, nargs="+", default=None, metavar="L",
                   help="with --saving: the layers the budget is spread over (default: every layer but the last, the "
                        "partial layers convert makes by default); the others get the uniform k")
    p.add_argument("--exact-layers", type=int, nargs="+", default=None, metavar="L",
                   help="with --saving: budget layers left exact, each paying dense attention's cost out of the same "
                        "budget; the others share the rest (file <scope>_..._saving<S>_exact<L>; convert leaves them "
                        "exact)")
    p.add_argument("--no-evaluate", action="store_true", help="skip the held-out measurement")
    p.add_argument("--no-baselines", action="store_true", help="skip the equal-cost baselines")
    p.add_argument("--batch-size", type=int, default=8, help="held-out windows per forward pass")


def run_derive(args) -> int:
    """Map the flags onto one `analysis.derive.DeriveRequest`, run it and print a line per file."""
    from .analysis.derive import DeriveRequest, derive_patterns
    from .partial_places import per_layer_granularity

    request = DeriveRequest(ks=tuple(args.k), scope=args.scope, family=args.family, objective=args.objective,
                            granularity=args.granularity, bucket_k=dict(args.bucket_k or ()), saving=args.saving,
                            budget_layers=args.budget_layers, exact_layers=args.exact_layers,
                            evaluate=not args.no_evaluate, baselines=not args.no_baselines,
                            batch_size=args.batch_size, progress=not args.no_progress)
    for inputs, result in derive_patterns(args.dir, request):
        if args.saving is not None:
            _print_budget(result, args.objective)
            return 0
        if per_layer_granularity(args.granularity):
            (_print_layer_buckets if inputs == "buckets" else _print_layers)(result, args)
            return 0
        (_print_buckets if inputs == "buckets" else _print_windows)(result, args)
    print(f"Report: {os.path.join(args.dir, 'report.md')}")
    return 0


def _fmt(value) -> str:
    return "not measured" if value is None else f"{value:.4f}"


def _deficient(result, b=None) -> str:
    """The mark of a window length (None: the fixed windows' n) whose covariance is rank-deficient
    (`derive._rank_deficient`), or ""."""
    found = result.get("rank_deficient") or []
    return " (rank-deficient: fewer windows than n)" if (found if b is None else int(b) in found) else ""


def _print_windows(result, args) -> None:
    for row in result["patterns"]:
        if row["k"] in args.k:  # this run's; the report also lists the folder's earlier ones
            print(f"k={row['k']}: {row['path']} (predicted error {_fmt(row['predicted'])}, "
                  f"held-out {_fmt(row.get('heldout'))}){_deficient(result)}")


def _print_buckets(result, args) -> None:
    for entry in result["ks"].values():
        errors = ", ".join(f"b={r['length']}" + (f" (k={r['k']})" if r["k"] != entry["k"] and not r["exact"] else "")
                           + ": " + ("exact" if r["exact"]
                                     else _fmt(r.get("heldout")) + _deficient(result, r["length"]))
                           for r in entry["buckets"])
        print(f"k={entry['k']}: {entry['path']} (held-out error per bucket {errors})")


def _print_layers(result, args) -> None:
    groups = f"{len(result['layers'])} layers" + (f" x {len(result['heads'])} heads" if result["heads"] else "")
    for row in result["patterns"]:
        if row["k"] in args.k:
            print(f"k={row['k']}: {row['path']} (per {args.granularity}, {groups}; held-out error "
                  f"{_fmt(row.get('heldout'))}, the pooled pattern's {_fmt(row.get('heldout_pooled_pattern'))})"
                  f"{_deficient(result)}")


def _print_layer_buckets(result, args) -> None:
    for row in result["patterns"]:
        if row["k"] in args.k:
            held = row.get("heldout") or {}
            errors = ", ".join(f"b={b}: " + (f"{held[b]:.4f} (pooled pattern {row['heldout_pooled_pattern'][b]:.4f})"
                                             if b in held else f"predicted {e:.4f}") + _deficient(result, b)
                               for b, e in row["predicted_per_bucket"].items())
            print(f"k={row['k']}: {row['path']} (per {args.granularity}, length buckets; held-out error per bucket "
                  f"{errors})")


def _print_budget(result, objective: str) -> None:
    for row in result["buckets"]:
        if row["exact"]:
            print(f"b={row['length']}: exact in every layer (the saving asks for k >= b)")
            continue
        ks = ", ".join(f"{layer}: {'exact' if int(layer) in result['exact_layers'] else k}"
                       for layer, k in row["k_per_layer"].items())
        print(f"b={row['length']}: k per layer {{{ks}}} (uniform {row['uniform_k']}), saving "
              f"{100 * row['saving']:.1f} % (uniform {100 * row['saving_uniform']:.1f} %); predicted "
              f"{objective} error {row['predicted_objective']:.4f} (uniform "
              f"{row['predicted_objective_uniform']:.4f}){_deficient(result, row['length'])}")
    print(f"budgeted: {result['budget_path']}\nuniform:  {result['uniform_path']}")
