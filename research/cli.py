"""Command line: ``python -m research {expressivity,rank-heads,all} --out DIR``."""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _lr_map(text: str) -> dict[int, float]:
    out = {}
    for item in filter(None, text.split(",")):
        depth, _, lr = item.partition(":")
        if not lr:
            raise argparse.ArgumentTypeError(f"--lr-by-depth item {item!r}: write LAYERS:LR, e.g. 3:0.003")
        out[int(depth)] = float(lr)
    return out


def _widths_map(text: str) -> dict[int, list[int]]:
    out = {}
    for item in filter(None, text.split(",")):
        depth, _, widths = item.partition(":")
        if not widths:
            raise argparse.ArgumentTypeError(f"--widths-by-depth item {item!r}: write LAYERS:W+W, e.g. 1:1+2")
        out[int(depth)] = [int(w) for w in widths.split("+")]
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m research",
                                     description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    expr = argparse.ArgumentParser(add_help=False)
    g = expr.add_argument_group("expressivity (seed 002); defaults are ours")
    g.add_argument("--setups", nargs="+", default=None, metavar="K,GAMMA,EPS1,EPS2[,LMAX]",
                   help="(k, gamma, eps1, eps2) settings; default: five of ours")
    g.add_argument("--L-grid", type=_ints, default=None, help="comma list, default 128,...,2048")
    g.add_argument("--d-step", type=int, default=8, help="uniform d grid step (paper: NF)")
    g.add_argument("--redraws", type=int, default=5, help="Y draws per d (paper: ceil(Q L), Q=1)")
    g.add_argument("--margin", default="auto", help="m in c = ln(1/eps2) + m, or 'auto' (ours)")
    g.add_argument("--ratio-form", choices=("log", "multiplicative"), default="log")
    g.add_argument("--column-order", choices=("per_pass", "per_row"), default="per_pass")
    g.add_argument("--no-ablations", action="store_true", help="skip the ablation table")
    g.add_argument("--expr-seed", type=int, default=0)
    rank = argparse.ArgumentParser(add_help=False)
    g = rank.add_argument_group("rank vs heads (seed 004); defaults are ours (CPU scale)")
    g.add_argument("--d", type=int, default=16)
    g.add_argument("--n-points", type=int, default=16)
    g.add_argument("--ranks", type=_ints, default=None, help="default: divisors of d")
    g.add_argument("--layers", type=_ints, default=[1, 3])
    g.add_argument("--widths", type=_ints, default=[1])
    g.add_argument("--widths-by-depth", type=_widths_map, default={1: [1, 2]},
                   help="per-depth widths, e.g. 1:1+2,3:1 (default 1:1+2; others use --widths)")
    g.add_argument("--seeds", type=_ints, default=[0])
    g.add_argument("--steps", type=int, default=1500)
    g.add_argument("--batch", type=int, default=128)
    g.add_argument("--lr", type=float, default=0.01)
    g.add_argument("--lr-by-depth", type=_lr_map, default={3: 0.003},
                   help="per-depth lr, e.g. 3:0.003 (default; 0.01 collapsed at 3 layers here)")
    g.add_argument("--ffn", type=int, default=64)
    g.add_argument("--target", choices=("farthest", "nearest"), default="farthest")
    for name, parents, text in (("expressivity", [expr], "d_min vs L (seed 002)"),
                                ("rank-heads", [rank], "MSE vs rank (seed 004)"),
                                ("all", [expr, rank], "both, at the committed CPU scale")):
        p = sub.add_parser(name, parents=parents, help=text)
        p.add_argument("--out", type=Path, required=True, help="output folder")
        p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    return parser


def _expr_config(args: argparse.Namespace):
    from .exp_expressivity import DEFAULT_L_GRID, DEFAULT_SETUPS, ExpressivityConfig, Setup

    margin = args.margin if args.margin == "auto" else float(args.margin)
    setups = [Setup.parse(s).validate() for s in args.setups] if args.setups else list(DEFAULT_SETUPS)
    return ExpressivityConfig(setups=setups, L_grid=args.L_grid or list(DEFAULT_L_GRID),
                              d_step=args.d_step, redraws=args.redraws, margin=margin,
                              ratio_form=args.ratio_form, column_order=args.column_order,
                              seed=args.expr_seed, ablations=not args.no_ablations)


def _rank_config(args: argparse.Namespace):
    from .exp_rank_heads import RankHeadsConfig
    from .rank_heads import TrainConfig
    from .rank_model import check_rank

    base = TrainConfig(d=args.d, n_points=args.n_points, steps=args.steps, batch=args.batch,
                       lr=args.lr, ffn=args.ffn, target=args.target).validate()
    for r in args.ranks or ():
        check_rank(args.d, r)  # fail before any training
    return RankHeadsConfig(base=base, ranks=args.ranks, layers=args.layers, widths=args.widths,
                           seeds=args.seeds, lr_by_depth=args.lr_by_depth,
                           widths_by_depth=args.widths_by_depth)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    from .exp_expressivity import run_expressivity
    from .exp_rank_heads import run_rank_heads
    from .report import write_summary

    start = time.perf_counter()
    try:
        expr_cfg = _expr_config(args) if args.command in ("expressivity", "all") else None
        rank_cfg = _rank_config(args) if args.command in ("rank-heads", "all") else None
    except ValueError as exc:
        sys.stderr.write(f"error: {exc}\n")  # CLI output, not library logging
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    expr = run_expressivity(args.out, expr_cfg) if expr_cfg else None
    rank = run_rank_heads(args.out, rank_cfg) if rank_cfg else None
    command = "python -m research " + shlex.join(argv)
    path = write_summary(args.out / "summary.md", command, expr, rank, time.perf_counter() - start)
    sys.stdout.write(f"summary written to {path}\n")
    return 0
