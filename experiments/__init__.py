"""The repository's studies with committed results, run by ``python -m experiments <study>`` (`make demo`,
`make paper`, `make objectives`, `make table1`); not part of the installed package, which they use like any
user does (``hf_partial_attention``'s public modules).

* :mod:`.demo` -- the whole analysis on the real MiniLM and pydoc text (`make demo` -> ``runs/demo``).
* :mod:`.paper` -- the analysis at the paper's scale, whole matrix at n = 128 (``results/paper``).
* :mod:`.objectives` -- paper vs shift-invariant vs Fisher selection objectives at the output
  (``results/objectives``).
* :mod:`.table1` -- Table 1 on the real MiniLM: conversion vs training with partial attention
  (``results/table1``); its arms and flags are typed in :mod:`.table1_spec`, its report is
  :mod:`.table1_report`, its resumable job store :mod:`.store`.

Each has a tiny version in the tests. They need the ``train`` and ``demo`` extras. This package imports nothing
at import time: ``python -m experiments --help`` lists the studies.
"""
