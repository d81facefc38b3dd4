"""Reduction of accumulators across processes: a no-op alone, exact sums with two gloo processes."""

import os

import pytest

import torch
import torch.multiprocessing as mp

from hf_partial_attention.analysis.covariance import ScoreCovariance
from hf_partial_attention.analysis.distributed import process_info, reduce_covariance


def _part(rank):
    cov = ScoreCovariance(4, ("per_query", "whole"), "layer")
    gen = torch.Generator().manual_seed(rank)
    for layer in range(rank + 1):  # rank 0 lacks layer 1: it must join with zeros
        cov.update(layer, torch.randn(2, 3, 4, 4, generator=gen))
    cov.num_sequences = 2
    return cov


def _worker(rank, init_file, out_dir):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        cov = reduce_covariance(_part(rank))
        if rank == 0:
            cov.save(os.path.join(out_dir, "reduced.safetensors"))
    finally:
        dist.destroy_process_group()


def test_single_process_is_a_no_op():
    cov = _part(0)
    before = {k: v.clone() for k, v in cov.tensors().items()}
    assert reduce_covariance(cov) is cov
    assert all(torch.equal(before[k], v) for k, v in cov.tensors().items())
    assert process_info("auto") == (0, 1) or os.environ.get("WORLD_SIZE", "1") != "1"


@pytest.mark.slow
def test_two_processes_sum_exactly(tmp_path):
    mp.spawn(_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    reduced = ScoreCovariance.load(tmp_path / "reduced.safetensors")
    expected = _part(0).merge(_part(1))
    assert reduced.counts() == expected.counts() and reduced.num_sequences == 4
    for name, tensor in expected.tensors().items():
        torch.testing.assert_close(reduced.tensors()[name], tensor, rtol=1e-14, atol=1e-14)


def _short_part(rank):
    """Rank 1 sees inputs shorter than n (per-row counts), rank 0 full windows only: the reduction still adds up."""
    cov = ScoreCovariance(4, ("per_query",), "layer")
    gen = torch.Generator().manual_seed(rank)
    if rank == 1:
        cov.update(0, torch.randn(3, 2, 4, 4, generator=gen), lengths=torch.tensor([1, 3, 4]))
    else:
        cov.update(0, torch.randn(2, 2, 4, 4, generator=gen))
    cov.num_sequences = 3 - rank
    return cov


def _short_worker(rank, init_file, out_dir):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        cov = reduce_covariance(_short_part(rank))
        if rank == 0:
            cov.save(os.path.join(out_dir, "reduced.safetensors"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_processes_reduce_row_counts_exactly(tmp_path):
    mp.spawn(_short_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    reduced = ScoreCovariance.load(tmp_path / "reduced.safetensors")
    expected = _short_part(0).merge(_short_part(1))
    assert reduced.row_counts and reduced.row_counts_of().tolist() == [10, 8, 8, 6]
    for name, tensor in expected.tensors().items():
        torch.testing.assert_close(reduced.tensors()[name], tensor, rtol=1e-14, atol=1e-14)
