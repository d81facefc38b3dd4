"""Side-by-side timing helpers: every case is timed interleaved with its baseline, medians of many repeats."""

from __future__ import annotations

import gc
import math
import statistics
import time
from typing import Callable

import torch


def command_line(script: str, argv: list[str]) -> str:
    """The command that made a result, as results record it: without ``--out DIR`` (a path of the machine that ran
    it; the numbers do not depend on it)."""
    args, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--out":
            skip = True
        elif not arg.startswith("--out="):
            args.append(arg)
    return " ".join(["python", f"benchmarks/{script}", *args])


def saved_bytes(fn: Callable[[], torch.Tensor]) -> int:
    """Bytes of the tensors autograd saves for backward in one forward of ``fn`` (training activation memory)."""
    total = 0
    seen: set[int] = set()

    def pack(t):
        nonlocal total
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return total


def interleaved_times(cases: dict[str, Callable[[], object]], repeats: int, warmup: int = 1) -> dict[str, list]:
    """Seconds of every round per case, running the cases round-robin so machine noise hits all of them alike.

    Round r starts with case r mod m (m cases; the order is rotated, not shuffled), so over m rounds every case
    runs once in every position: none always runs first after the round's garbage collection."""
    names = list(cases)
    for _ in range(warmup):
        for fn in cases.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in cases}
    for r in range(repeats):
        gc.collect()  # once per round: a full collection costs ~0.3 s with transformers imported
        for i in range(len(names)):
            name = names[(r + i) % len(names)]
            start = time.perf_counter()
            cases[name]()
            times[name].append(time.perf_counter() - start)
    return times


def interleaved_medians(cases: dict[str, Callable[[], object]], repeats: int, warmup: int = 1) -> dict[str, float]:
    """Median seconds per case of `interleaved_times`."""
    return {name: statistics.median(values) for name, values in interleaved_times(cases, repeats, warmup).items()}


def median_interval(values: list[float], level: float = 0.95) -> dict:
    """A distribution-free interval for the median of independent values: the j-th lowest and the j-th highest,
    j the largest with P(Binomial(N, 1/2) < j) <= (1 - level) / 2. ``coverage`` is the interval's exact level
    (>= ``level``). Below the N that allows one (N < 6 at 95 %) it is the lowest and highest value, with their
    coverage, 1 - 2 / 2^N (0.9375 at N = 5)."""
    n = len(values)
    if n == 0:
        raise ValueError("median_interval needs at least one value; got none")

    def below(j: int) -> float:  # P(Binomial(n, 1/2) < j)
        return sum(math.comb(n, i) for i in range(j)) / 2**n

    j = 1  # the interval is [x_(j), x_(n+1-j)] of the sorted values
    while j < (n + 1) // 2 and below(j + 1) <= (1.0 - level) / 2:
        j += 1
    tail = below(j)
    ordered = sorted(values)
    return {"low": ordered[j - 1], "high": ordered[n - j], "coverage": 1.0 - 2.0 * tail}


def paired_ratios(times: dict[str, list], name: str, baseline: str) -> dict:
    """``name`` over ``baseline`` round by round (each pair timed back to back): median, lowest, highest, and a
    95 % interval for the median (`median_interval`: ``interval`` [low, high] and its exact ``coverage``)."""
    ratios = [t / base for t, base in zip(times[name], times[baseline])]
    ci = median_interval(ratios)
    return {"median": statistics.median(ratios), "low": min(ratios), "high": max(ratios),
            "interval": [ci["low"], ci["high"]], "coverage": ci["coverage"]}


def forward_and_backward(fn: Callable[[], torch.Tensor], inputs: list[torch.Tensor]) -> Callable[[], None]:
    """A closure running forward + backward of ``fn().sum()``; gradients are cleared each time."""

    def run():
        for t in inputs:
            t.grad = None
        fn().float().sum().backward()

    return run


def no_grad(fn: Callable[[], object]) -> Callable[[], object]:
    def run():
        with torch.no_grad():
            return fn()

    return run
