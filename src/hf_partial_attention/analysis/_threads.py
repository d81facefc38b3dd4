"""Thread control for batches of small linear-algebra problems.

Batched LAPACK calls on many small matrices (n problems of n×n) parallelise poorly: with several OpenMP
threads on a busy machine, a batched ``torch.linalg.eigh`` over such matrices can be many times slower than with
one thread. Such calls run inside `single_thread()`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["single_thread"]


@contextlib.contextmanager
def single_thread(active: bool = True) -> Iterator[None]:
    """Run the block with one torch thread (when ``active``), restoring the previous count afterwards."""
    previous = torch.get_num_threads()
    if active and previous > 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if torch.get_num_threads() != previous:
            torch.set_num_threads(previous)
