"""What every study's command line shares: the program's name and the command line a study's results record."""

from __future__ import annotations

import shlex

__all__ = ["PROG", "command_line"]

PROG = "python -m experiments"


def command_line(args) -> str:
    """The command line that ran this study (``args.argv``: its arguments after ``PROG``)."""
    return shlex.join([*PROG.split(), *args.argv])
