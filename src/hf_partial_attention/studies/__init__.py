"""Long studies with committed results (``hf-partial-attention table1``); each has a tiny version in the tests.

Needs the ``train`` and ``demo`` extras.
"""

from .table1 import StudyArguments, run_table1

__all__ = ["StudyArguments", "run_table1"]
