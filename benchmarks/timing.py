"""Side-by-side timing helpers: every case is timed interleaved with its baseline, medians of many repeats."""

from __future__ import annotations

import gc
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
    """Seconds of every round per case, running the cases round-robin so machine noise hits all of them alike."""
    for _ in range(warmup):
        for fn in cases.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        gc.collect()  # once per round: a full collection costs ~0.3 s with transformers imported
        for name, fn in cases.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def interleaved_medians(cases: dict[str, Callable[[], object]], repeats: int, warmup: int = 1) -> dict[str, float]:
    """Median seconds per case of `interleaved_times`."""
    return {name: statistics.median(values) for name, values in interleaved_times(cases, repeats, warmup).items()}


def paired_ratios(times: dict[str, list], name: str, baseline: str) -> dict[str, float]:
    """``name`` over ``baseline`` round by round (each pair timed back to back): median, lowest and highest."""
    ratios = [t / base for t, base in zip(times[name], times[baseline])]
    return {"median": statistics.median(ratios), "low": min(ratios), "high": max(ratios)}


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
