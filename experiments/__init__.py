"""The repository's studies with committed results, each run by ``python -m experiments <study>`` and its ``make``
target; not part of the installed package, which they use like any user does (``hf_partial_attention``'s public
modules). One folder per study, its flags in the folder's ``cli.py``; ``python -m experiments --help`` lists them
(`experiments.cli` lists each study's folder and results beside `COMMANDS`); each has a tiny version in the slow
test tier.

They need the ``train`` and ``demo`` extras. This package imports nothing at import time.
"""
