"""The repository's studies with committed results, each run by ``python -m experiments <study>`` and its ``make``
target; not part of the installed package, which they use like any user does (``hf_partial_attention``'s public
modules). One folder per study, its flags in the folder's ``cli.py``; ``python -m experiments --help`` lists them;
each has a tiny version in the slow test tier.

* ``demo`` (`demo/`, `make demo`): the whole analysis on the real MiniLM and pydoc text (``runs/demo``).
* ``paper`` (`paper/`): the analysis at the paper's scale, whole matrix at n = 128 (``results/paper``).
* ``objectives`` (`objectives/`): paper vs shift-invariant vs Fisher selection objectives at the output
  (``results/objectives``).
* ``lengths``, ``recover`` (`lengths/`): length buckets on inputs of real lengths, and a bucketed model recovered by
  distillation (``results/lengths``, ``results/recovery``).
* ``granularity``, ``granularity-lengths``, ``granularity-recover``, ``granularity-layers``, ``granularity-refit``
  (`granularity/`): one P and R vs per layer vs per head (``results/granularity*``).
* ``table1``, ``table1-scratch`` (`table1/`): the paper's Table 1 on the real MiniLM, and pretrained from scratch
  (``results/table1``, ``results/table1_scratch``; resumable job stores, `store`, shared by ``recall``).
* ``recall`` (`recall/`): what R earns on tasks where attention matters (``results/recall``).

They need the ``train`` and ``demo`` extras. This package imports nothing at import time.
"""
