"""What every study's command line shares: the program's name and the command line a study's results record."""

from __future__ import annotations

import os
import shlex

__all__ = ["PROG", "MODEL_FLAGS", "command_line", "portable_argv"]

PROG = "python -m experiments"
# The flags whose value is a model to load: a local folder there is recorded by its Hub id, not its path.
MODEL_FLAGS = ("--model", "--model_name_or_path", "--model-dir")


def command_line(args) -> str:
    """The command line that ran this study (``args.argv``: its arguments after ``PROG``), `portable_argv`."""
    return shlex.join([*PROG.split(), *portable_argv(args.argv)])


def portable_argv(argv: list[str]) -> list[str]:
    """``argv`` with each local model folder (the value of a `MODEL_FLAGS` flag) named by the Hub id it records
    (`analysis.collect.hub_id`), else an absolute path by its folder's name (a relative one is kept as typed, to rerun
    from the same folder): results name models by their Hub id, never by a path on the machine that ran them."""
    from hf_partial_attention.analysis.collect import display_name, hub_id

    def named(value: str) -> str:
        if not os.path.exists(value):
            return value
        return hub_id(value) or (display_name(value) if os.path.isabs(value) else value)

    out, argv = [], list(argv)
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if eq and flag in MODEL_FLAGS:
            arg = f"{flag}={named(value)}"
        elif i and argv[i - 1] in MODEL_FLAGS:
            arg = named(arg)
        out.append(arg)
    return out
