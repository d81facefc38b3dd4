"""The flags of ``python -m experiments objectives`` (`make objectives`)."""

from __future__ import annotations

import os

__all__ = ["STUDIES"]


def _objectives_args(p):
    from hf_partial_attention.analysis.selection import OBJECTIVES

    p.add_argument("dir", help="folder written by `hf-partial-attention analyze` (with held-out windows)")
    p.add_argument("--k", type=int, nargs="+", default=[8, 16], help="per-query ks to compare at")
    p.add_argument("--objectives", nargs="+", default=list(OBJECTIVES), choices=OBJECTIVES,
                   help="selection objectives to compare")
    p.add_argument("--max-windows", type=int, default=None, help="held-out windows to use (default: all)")
    p.add_argument("--out", default=None, help="where objectives.json/.md go (default: DIR)")


def _run_objectives(args) -> int:
    from .study import compare_objectives

    out = args.out or args.dir
    compare_objectives(args.dir, tuple(args.k), tuple(args.objectives), out=out, max_windows=args.max_windows,
                       progress=not args.no_progress)
    print(f"Wrote {os.path.join(out, 'objectives.md')}")
    return 0


# name -> (help, add the flags, run)
STUDIES = {
    "objectives": ("paper vs shift-invariant vs Fisher selection objectives, judged at the output "
                   "(make objectives)", _objectives_args, _run_objectives),
}
