"""Length-grouped batching that resumes exactly: `EpochLengthGroupedSampler` and `example_lengths`.

transformers' ``--train_sampling_strategy group_by_length`` builds a `LengthGroupedSampler` whose order comes from
the global torch RNG at the start of each epoch. A run resumed in its second epoch or later draws that order from
the RNG as it is before the checkpoint's RNG state is loaded (the Trainer loads it after skipping the trained
batches), so it trains on other batches than the uninterrupted run. Here the order of epoch e is drawn from a
generator seeded by ``(seed, e)``: the same in the uninterrupted and in the resumed run, and in every process.

The Trainer also drops the columns its model does not take, the length column included, before it builds the
sampler; `LengthGroupedSampler` then measures every example in Python, one row at a time. `example_lengths` reads
the length column where it exists, else the lengths of the input-id lists in one Arrow operation.
"""

from __future__ import annotations

import logging

import torch
from transformers.trainer_pt_utils import LengthGroupedSampler, get_length_grouped_indices

logger = logging.getLogger(__name__)

__all__ = ["EpochLengthGroupedSampler", "example_lengths"]


def example_lengths(dataset, length_column: str | None = "length", input_name: str = "input_ids") -> list[int]:
    """Each example's length: its `length_column` value if the dataset has that column, else the length of its
    `input_name` list (one Arrow pass for a `datasets.Dataset`; row by row for other map-style datasets).

    Raises:
        ValueError: if the examples have neither the length column nor `input_name`.
    """
    columns = getattr(dataset, "column_names", None)
    if columns is not None and length_column in columns:
        return [int(x) for x in dataset[length_column]]
    if columns is not None and input_name in columns:
        import pyarrow.compute as pc

        table = dataset.with_format("arrow")[:]  # the selected rows, in order (respects .select/.shuffle)
        return pc.list_value_length(table[input_name]).to_pylist()
    if len(dataset) and not (hasattr(dataset[0], "keys") and input_name in dataset[0]):
        raise ValueError(f"group_by_length needs each example's length: a {length_column!r} column "
                         f"(--length_column_name) or an {input_name!r} entry per example; neither is in the dataset.")
    return [len(dataset[i][input_name]) for i in range(len(dataset))]


class EpochLengthGroupedSampler(LengthGroupedSampler):
    """`LengthGroupedSampler` (mega-batches of similar lengths, the longest batch first) whose order in epoch e
    depends only on ``(seed, e)``. The Trainer calls `set_epoch` at the start of each epoch (through accelerate's
    ``DataLoaderShard.set_epoch``)."""

    def __init__(self, batch_size: int, lengths: list[int], seed: int = 0):
        super().__init__(batch_size, lengths=lengths)
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose order `__iter__` yields."""
        self.epoch = int(epoch)

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed + 1_000_003 * self.epoch)
        return iter(get_length_grouped_indices(self.lengths, self.batch_size, generator=generator))
