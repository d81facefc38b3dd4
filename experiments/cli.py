"""Command line: ``python -m experiments <study> ...`` (the Makefile's targets); ``--help`` lists the studies.

Each study's flags live beside it, in its folder's ``cli.py`` (`STUDIES`: argparse flags; `DATACLASS_STUDIES`:
a dataclass parsed by transformers' `HfArgumentParser`, ``<study> -h`` lists them). Errors a user can cause
(`hf_partial_attention.cli.USER_ERRORS`: a wrong value, a missing file) print as one line, ``error: <what and the
fix>``, on stderr and exit with 2; ``-v`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence

from hf_partial_attention.cli import USER_ERRORS, HelpFormatter, common_arguments, report_user_error

from .demo.cli import STUDIES as _DEMO
from .flags import PROG
from .granularity.cli import STUDIES as _GRANULARITY
from .lengths.cli import STUDIES as _LENGTHS
from .mpnet.cli import STUDIES as _MPNET
from .objectives.cli import STUDIES as _OBJECTIVES
from .paper.cli import STUDIES as _PAPER
from .recall.cli import DATACLASS_STUDIES as _RECALL
from .table1.cli import DATACLASS_STUDIES as _TABLE1

__all__ = ["main", "build_parser", "COMMANDS", "PROG"]

# The studies, their folders and results:
# * ``demo`` (`demo/`, `make demo`): the whole analysis on the real MiniLM and pydoc text (``runs/demo``).
# * ``paper`` (`paper/`): the analysis at the paper's scale, whole matrix at n = 128 (``results/paper``).
# * ``objectives`` (`objectives/`): paper vs shift-invariant vs Fisher selection objectives at the output
#   (``results/objectives``).
# * ``lengths``, ``recover`` (`lengths/`): length buckets on inputs of real lengths, and a bucketed model recovered
#   by distillation (``results/lengths``, ``results/recovery``).
# * ``granularity``, ``granularity-lengths``, ``granularity-recover``, ``granularity-layers``, ``granularity-refit``
#   (`granularity/`): one P and R vs per layer vs per head (``results/granularity*``).
# * ``table1``, ``table1-scratch`` (`table1/`): the paper's Table 1 on the real MiniLM, and pretrained from scratch
#   (``results/table1``, ``results/table1_scratch``; resumable job stores, `store`, shared by ``recall``).
# * ``recall`` (`recall/`): what R earns on tasks where attention matters (``results/recall``).
# * ``mpnet`` (`mpnet/`): the real all-mpnet-base-v2 partial per head, measured and timed (``results/mpnet``).
# name -> (help, add the flags, run): the studies whose flags are argparse's
_SUBCOMMANDS = {**_DEMO, **_PAPER, **_OBJECTIVES, **_LENGTHS, **_GRANULARITY, **_MPNET}
# name -> (help, "module:arguments class", "module:run function", report file): flags a dataclass
_DATACLASS_STUDIES = {**_TABLE1, **_RECALL}
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
    for name, (text, arguments, _, _) in _DATACLASS_STUDIES.items():
        p = sub.add_parser(name, help=text, description=text, add_help=False)
        p.add_argument("study_args", nargs=argparse.REMAINDER,
                       help=f"the study's own flags ({arguments.partition(':')[2]}; `{PROG} {name} -h` lists them)")
    return parser


def _resolve(where: str):
    """``"module:name"`` (a module under experiments) -> the object, imported only when its study runs."""
    module, _, name = where.partition(":")
    return getattr(importlib.import_module(f"{__package__}.{module}"), name)


def _run_dataclass_study(name: str, study_args: list[str]) -> int:
    from transformers import HfArgumentParser

    text, arguments, run, report_file = _DATACLASS_STUDIES[name]
    parser = HfArgumentParser(_resolve(arguments), prog=f"{PROG} {name}",
                              description=f"{text}. -v: tracebacks of errors.")
    (study,) = parser.parse_args_into_dataclasses(study_args)
    logging.getLogger("hf_partial_attention").setLevel(logging.INFO)
    logging.getLogger("experiments").setLevel(logging.INFO)
    report = _resolve(run)(study, study_args)
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
