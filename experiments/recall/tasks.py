"""The recall study's synthetic tasks: windows of n token ids with labels at the positions to predict (-100
elsewhere), each example a function of (task, seed, index), so any split is reproducible and never stored.

`RecallTask` describes each task and which dependency it needs (docs/method.md, "What partial attention can
express"); `task_tensors` and `TaskDataset` make a split of one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["TASKS", "ALL_TASKS", "RecallTask", "FILLER", "FIRST_SYMBOL", "TaskDataset", "task_tensors",
           "majority_windows"]

# Token ids: 0 pad (unused: every window is full), 1 filler, then ``symbols`` ids for the tasks' symbols; MQAR's
# keys and values are two disjoint halves of them.
FILLER, FIRST_SYMBOL = 1, 2
TASKS = ("mqar", "far_copy", "near_copy", "majority")  # the defaults
ALL_TASKS = (*TASKS, "mqar_adjacent")


@dataclass(frozen=True)
class RecallTask:
    """One task at window length ``n`` over ``symbols`` symbols (``pairs``: MQAR's key-value pairs).

    The tasks, and which dependency each needs:

    - ``mqar`` (far, by content): multi-query associative recall in an encoder's form. ``pairs`` keys at random
      positions of the window's first quarter, each carrying its value in the same position (the value as the token
      type: ``token_type_ids`` = 1 + value there, 0 elsewhere), then each key once more at a random position of the
      second half, labelled with its value: the distances from a key to its query spread over (n/4, n), beyond the
      reach of a band of k ≤ n/4 keys even over two layers. Finding the key that matches is one content lookup.
    - ``mqar_adjacent``: Zoology's own layout, ``k v k v ...`` at the start (values as tokens) and the queries in the
      second half; it needs a previous-token step before the lookup. Not a default task: in a throwaway probe before
      this study (a plain training loop, not in the repository), exact did not leave the level of naming one of the
      window's values within a few thousand steps, where the one-position form was solved; ``--tasks
      mqar_adjacent`` runs it through the study (not run yet).
    - ``far_copy`` (far, by position): random symbols; position i is labelled with the symbol at i − offset
      (3n/8: 48 at n = 128, 24 at n = 64).
    - ``near_copy`` (local, the control): the same at offset 2.
    - ``majority`` (content-blind global): random symbols in which one symbol occurs more often than any other
      (``majority_count`` times, the others at most ``majority_count − 3``, drawn from a pool of each that many
      times); every position is labelled with it.
    """

    name: str
    n: int = 64
    symbols: int = 32
    pairs: int = 4

    def __post_init__(self):
        if self.name not in ALL_TASKS:
            raise ValueError(f"task {self.name!r} is not one of {ALL_TASKS}.")
        if self.name.startswith("mqar") and (2 * self.pairs > self.n // 4 or self.pairs > self.symbols // 2):
            raise ValueError(f"{self.name} with pairs={self.pairs} needs n >= {8 * self.pairs} and symbols >= "
                             f"{2 * self.pairs}; got n={self.n}, symbols={self.symbols}.")
        cap = self.majority_count - 3  # the other symbols' most, so the mode wins by 3
        if self.name == "majority" and (self.symbols - 1) * cap < self.n - self.majority_count:
            raise ValueError(f"majority at n={self.n} needs symbols >= {1 + -(-(self.n - self.majority_count) // cap)} "
                             f"(each other symbol at most {cap} times); got symbols={self.symbols}.")

    @property
    def vocab_size(self) -> int:
        return FIRST_SYMBOL + self.symbols

    @property
    def offset(self) -> int | None:
        """The copy tasks' offset (3n/8 or 2)."""
        return {"far_copy": 3 * self.n // 8, "near_copy": 2}.get(self.name)

    @property
    def majority_count(self) -> int:
        return max(4, self.n // 6)

    @property
    def type_vocab_size(self) -> int:
        """Token types: 0, and MQAR's values (1 + value) in the keys' positions."""
        return 1 + self.symbols // 2

    def chance(self) -> float:
        """The accuracy of guessing (a uniform symbol; MQAR: a uniform value)."""
        return 1.0 / (self.symbols // 2 if self.name.startswith("mqar") else self.symbols)

    def example(self, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(input_ids, token_type_ids, labels)``, each ``(n,)``, drawn with ``g``."""
        n, s = self.n, self.symbols
        labels, types = torch.full((n,), -100), torch.zeros(n, dtype=torch.long)
        if self.name.startswith("mqar"):
            half = s // 2
            keys = torch.randperm(half, generator=g)[: self.pairs] + FIRST_SYMBOL  # (pairs,)
            values = torch.randint(half, (self.pairs,), generator=g)  # (pairs,)
            ids = torch.full((n,), FILLER)
            if self.name == "mqar":  # each key's value in its own position, as its token type
                where = torch.randperm(n // 4, generator=g)[: self.pairs]  # (pairs,) in [0, n/4)
                ids[where], types[where] = keys, 1 + values
            else:  # k v k v ... from position 0
                ids[0: 2 * self.pairs: 2], ids[1: 2 * self.pairs: 2] = keys, values + FIRST_SYMBOL + half
            queries = torch.randperm(n - n // 2, generator=g)[: self.pairs] + n // 2  # (pairs,) in [n/2, n)
            ids[queries], labels[queries] = keys, values + FIRST_SYMBOL + half
            return ids, types, labels
        if self.name == "majority":
            ids, labels = majority_windows(self, 1, g)
            return ids[0], types, labels[0]
        ids = torch.randint(s, (n,), generator=g) + FIRST_SYMBOL
        labels[self.offset:] = ids[: n - self.offset]
        return ids, types, labels


def majority_windows(task: RecallTask, count: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` majority windows at once, ``(ids, labels)`` each (count, n): the mode ``majority_count`` times, the
    other positions a draw without replacement from a pool holding each other symbol ``majority_count − 3`` times
    (so none reaches the cap), shuffled. Batched: an example at a time took a millisecond, a third of a job."""
    n, s, count_mode = task.n, task.symbols, task.majority_count
    cap = count_mode - 3
    mode = torch.randint(s, (count, 1), generator=g)  # (count, 1)
    draw = torch.rand(count, (s - 1) * cap, generator=g).argsort(dim=1)[:, : n - count_mode]  # (count, n - m)
    others = draw // cap  # (count, n - m) in [0, s - 1): the other symbols' ranks
    others = others + (others >= mode).long()  # (count, n - m): skip the mode
    window = torch.cat([mode.expand(count, count_mode), others], dim=1)  # (count, n)
    order = torch.rand(count, n, generator=g).argsort(dim=1)  # (count, n)
    ids = window.gather(1, order) + FIRST_SYMBOL  # (count, n)
    return ids, (mode + FIRST_SYMBOL).expand(count, n).clone()


def task_tensors(task: RecallTask, seed: int, count: int) -> dict[str, torch.Tensor]:
    """``count`` examples of split ``seed``: ``input_ids``, ``token_type_ids``, ``attention_mask`` and ``labels``,
    each (count, n)."""
    g = torch.Generator().manual_seed(seed)
    if task.name == "majority":
        ids, labels = majority_windows(task, count, g)
        types = torch.zeros_like(ids)
    else:
        examples = [task.example(g) for _ in range(count)]
        ids = torch.stack([e[0] for e in examples])  # (count, n)
        types, labels = torch.stack([e[1] for e in examples]), torch.stack([e[2] for e in examples])
    return {"input_ids": ids, "token_type_ids": types, "attention_mask": torch.ones_like(ids), "labels": labels}


class TaskDataset(torch.utils.data.Dataset):
    """A map-style dataset of ``count`` examples of split ``seed`` (made once, in memory: 64 ints a row)."""

    def __init__(self, task: RecallTask, seed: int, count: int):
        self.tensors = task_tensors(task, seed, count)

    def __len__(self) -> int:
        return self.tensors["input_ids"].shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {name: t[i] for name, t in self.tensors.items()}
