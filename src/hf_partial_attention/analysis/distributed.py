"""Exact reduction of score accumulators across processes (``accelerate launch`` / ``torchrun``)."""

from __future__ import annotations

import logging
import os

import torch

from .covariance import ScoreCovariance

logger = logging.getLogger(__name__)

__all__ = ["process_info", "reduce_covariance"]


def process_info(distributed: bool | str = "auto") -> tuple[int, int]:
    """``(rank, world_size)``; under ``accelerate launch`` (WORLD_SIZE > 1) this initialises the process group.

    Args:
        distributed: ``"auto"`` (use the launcher's environment when WORLD_SIZE > 1), True or False.
    """
    if distributed not in ("auto", True, False):
        raise ValueError(f"distributed must be 'auto', True or False, got {distributed!r}.")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if distributed is False or (distributed == "auto" and world <= 1):
        return 0, 1
    import torch.distributed as dist

    if not dist.is_initialized():
        from accelerate import PartialState

        PartialState()  # initialises torch.distributed from the launcher's environment
    return dist.get_rank(), dist.get_world_size()


def reduce_covariance(cov: ScoreCovariance, group=None) -> ScoreCovariance:
    """Sum every accumulator, count, per-row count and the window cursor over all processes, in place (float64,
    exact).

    A no-op without an initialised process group or with a single process. Processes that saw no data
    join with zero accumulators.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return cov
    world = dist.get_world_size(group)
    all_keys: list = [None] * world
    dist.all_gather_object(all_keys, (cov.group_keys(), cov.row_counts), group=group)
    union = sorted({tuple(key) for keys, _ in all_keys for key in keys})
    if any(rows for _, rows in all_keys):  # per-row counts anywhere: every process reduces them (exact)
        cov.enable_row_counts()
    cov.ensure_groups(union)
    for _, tensor in sorted(cov.tensors().items()):
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    names = sorted(cov.counts())
    counts = torch.tensor([cov.counts()[name] for name in names] + [cov.num_sequences], dtype=torch.int64)
    dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
    cov.set_counts(dict(zip(names, counts[:-1].tolist())))
    cov.num_sequences = int(counts[-1])
    logger.info("Reduced covariance over %d processes: %d score matrices", world, cov.count)
    return cov
